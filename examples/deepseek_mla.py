#!/usr/bin/env python3
"""A small DeepSeek-V2/V3-style decoder whose multi-head latent attention runs
locally or on attnserve.

Written from DeepSeek-V2's published model definition (the paper's section
2.1 and the released modeling code): the query through a low-rank bottleneck
(q_a_proj, its RMSNorm, q_b_proj) split per head into q_nope
(qk_nope_head_dim) and q_pe (qk_rope_head_dim); the keys and values through
one compressed latent c_kv (kv_lora_rank values per token, RMSNorm'd) plus a
rope key k_pe (qk_rope_head_dim values per token, shared by every head); rope
on q_pe and k_pe alone (decoupled rope; here examples/decoder.py's half-split
rotation, where DeepSeek's released checkpoints keep those dimensions
interleaved: a fixed permutation of the weights); kv_b_proj up-projects c_kv to each
head's k_nope and value (v_head_dim); the softmax scale
1/sqrt(qk_nope_head_dim + qk_rope_head_dim). A dense SwiGLU MLP stands in for
DeepSeek's mixture of experts (attention never sees it). Random weights from
a fixed seed (nothing is downloaded); small widths so that it runs on a CPU.

Attention runs in these modes, with the same weights (local in the plain
form, the others in the absorbed form):

  local     in PyTorch, the plain (non-absorbed) form: c_kv is up-projected
            to per-head K_nope and V, and every head attends over
            [K_nope | k_pe] keys with its [q_nope | q_pe] query;
  server    on attnserve (--attention=mla) in the absorbed form, through
            attnserve.flashinfer's BatchMLAPagedAttentionWrapper (FlashInfer's
            MLA plan/run and append_paged_mla_kv_cache, docs/flashinfer.md)
            over --transport grpc, shm or channel: the server caches one
            latent row per token, [c_kv | k_pe] (kv_lora_rank +
            qk_rope_head_dim values), and gets the query [q_nope @ W_UK |
            q_pe] per head (W_UK: the K half of kv_b_proj); its output is each
            head's latent (kv_lora_rank values), which the model multiplies
            by W_UV (the V half) here;
  kvmanager the same through attnserve.KvManager (one Prefill per layer with
            the new latent rows appended);
  pingpong  the same through the asyncio client's AsyncKvManager, the batch
            in two micro-batches.

examples/decoder.py runs generation (a prompt's prefill, then greedy decode
steps) and checks that the modes' logits agree within bf16 tolerance and
that their greedy tokens are identical, as for examples/llama.py.

  # a server with the small preset's geometry, in another shell:
  build/bin/attnserve --backend=cpu --attention=mla --num_layers=2 --num_qo_heads=8 \\
      --kv_lora_rank=64 --qk_rope_head_dim=16
  PYTHONPATH=client/python python3 examples/deepseek_mla.py
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import math
import os
import sys
import time
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # decoder.py beside it
import decoder  # noqa: E402

import attnserve  # noqa: E402  (decoder.py put it on the path when needed)
from attnserve.aio import AsyncClient  # noqa: E402


@dataclass(frozen=True)
class Config:
    vocab: int
    layers: int
    qo_heads: int
    hidden: int
    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    ffn: int
    rope_theta: float = 10000.0
    eps: float = 1e-6

    # What decoder.LocalAttention reads: the plain form's per-head keys.
    @property
    def head_dim(self) -> int:
        """qk_head_dim of the plain form: q_nope | q_pe."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def kv_heads(self) -> int:
        """The plain form has a K and V head per query head."""
        return self.qo_heads

    @property
    def latent_dim(self) -> int:
        """One cached latent row: c_kv | k_pe (the server's qk_head_dim)."""
        return self.kv_lora_rank + self.qk_rope_head_dim


PRESETS = {
    # Fits CPU CI: attnserve --attention=mla --num_layers=2 --num_qo_heads=8
    # --kv_lora_rank=64 --qk_rope_head_dim=16.
    "small": dict(config=Config(vocab=512, layers=2, qo_heads=8, hidden=256, q_lora_rank=96,
                                kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16,
                                v_head_dim=32, ffn=512),
                  batch=4, steps=8, prompt_len=(3, 24)),
    # DeepSeek-V3's attention widths on one GPU of eight (128 heads / 8): a
    # latent of 512 + 64, q_nope 128, v 128; narrow hidden and MLP.
    "v3": dict(config=Config(vocab=1024, layers=2, qo_heads=16, hidden=1024, q_lora_rank=384,
                             kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
                             v_head_dim=128, ffn=1024),
               batch=2, steps=8, prompt_len=(4, 16)),
}


class Model:
    """Weights drawn from N(0, 1/fan_in) with a fixed seed; compute in `dtype`.

    absorbed=False: pre_attention gives the plain form's q, k, v (per head);
    absorbed=True: the absorbed query, the latent row and no v, and
    post_attention takes each head's latent output (absorbed_view() shares
    the weights)."""

    def __init__(self, cfg: Config, *, seed: int = 0, device="cpu", dtype=torch.float32,
                 absorbed: bool = False):
        self.cfg = cfg
        self.device = torch.device(device)
        self.dtype = dtype
        self.absorbed = absorbed
        gen = torch.Generator(device="cpu").manual_seed(seed)

        def w(fan_in, *shape):
            t = torch.randn(*shape, generator=gen) / math.sqrt(fan_in)
            return t.to(device=self.device, dtype=dtype)

        def norm_weight(n):
            t = 1.0 + 0.1 * torch.randn(n, generator=gen)
            return t.to(device=self.device, dtype=dtype)

        c, h, hq = cfg, cfg.hidden, cfg.qo_heads
        qk = c.qk_nope_head_dim + c.qk_rope_head_dim
        self.embed = w(1, c.vocab, h)
        self.layers = []
        for _ in range(c.layers):
            self.layers.append(dict(
                attn_norm=norm_weight(h),
                q_a=w(h, h, c.q_lora_rank), q_a_norm=norm_weight(c.q_lora_rank),
                q_b=w(c.q_lora_rank, c.q_lora_rank, hq * qk),
                # kv_a_proj_with_mqa: the latent c_kv and the shared k_pe.
                kv_a=w(h, h, c.kv_lora_rank + c.qk_rope_head_dim),
                kv_a_norm=norm_weight(c.kv_lora_rank),
                # kv_b_proj: per head, k_nope (W_UK) then the value (W_UV).
                kv_b=w(c.kv_lora_rank, c.kv_lora_rank,
                       hq * (c.qk_nope_head_dim + c.v_head_dim)),
                wo=w(hq * c.v_head_dim, hq * c.v_head_dim, h),
                mlp_norm=norm_weight(h),
                w_gate=w(h, h, c.ffn), w_up=w(h, h, c.ffn), w_down=w(c.ffn, c.ffn, h)))
        self.final_norm = norm_weight(h)
        # Logits in float32 whatever the compute dtype (as examples/llama.py).
        self.lm_head = w(h, h, c.vocab).float()
        half = c.qk_rope_head_dim // 2
        self.inv_freq = (1.0 / c.rope_theta ** (torch.arange(half, dtype=torch.float32) / half)
                         ).to(self.device)
        self.softmax_scale = 1.0 / math.sqrt(qk)

    def absorbed_view(self) -> "Model":
        """The same model (shared weights) in the absorbed form."""
        m = object.__new__(Model)
        m.__dict__.update(self.__dict__)
        m.absorbed = True
        return m

    def _kv_b(self, layer: int):
        """(W_UK [kv_lora_rank, heads, qk_nope_head_dim], W_UV [kv_lora_rank,
        heads, v_head_dim]): kv_b_proj's halves."""
        c = self.cfg
        kv_b = self.layers[layer]["kv_b"].view(c.kv_lora_rank, c.qo_heads,
                                               c.qk_nope_head_dim + c.v_head_dim)
        return kv_b[..., :c.qk_nope_head_dim], kv_b[..., c.qk_nope_head_dim:]

    def embed_tokens(self, ids):
        return self.embed[ids]

    def rms_norm(self, x, weight):
        x32 = x.float()
        return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.cfg.eps)).to(
            self.dtype) * weight

    def rope(self, x, positions):
        return decoder.rope(x, positions, self.inv_freq, self.dtype)

    def pre_attention(self, layer: int, x, positions):
        """Plain: q, k [T, heads, qk_nope + qk_rope], v [T, heads, v_head_dim].
        Absorbed: q [T, heads, kv_lora_rank + qk_rope] = [q_nope @ W_UK^T |
        q_pe], the latent row [T, 1, kv_lora_rank + qk_rope] = [c_kv | k_pe],
        and None."""
        p, c = self.layers[layer], self.cfg
        t = x.shape[0]
        h = self.rms_norm(x, p["attn_norm"])
        q = (self.rms_norm(h @ p["q_a"], p["q_a_norm"]) @ p["q_b"]).view(
            t, c.qo_heads, c.qk_nope_head_dim + c.qk_rope_head_dim)
        q_nope, q_pe = q.split([c.qk_nope_head_dim, c.qk_rope_head_dim], dim=-1)
        q_pe = self.rope(q_pe, positions)
        kv = h @ p["kv_a"]
        c_kv, k_pe = kv.split([c.kv_lora_rank, c.qk_rope_head_dim], dim=-1)
        c_kv = self.rms_norm(c_kv, p["kv_a_norm"])
        k_pe = self.rope(k_pe.view(t, 1, c.qk_rope_head_dim), positions)   # one head, shared
        w_uk, _ = self._kv_b(layer)
        if self.absorbed:
            q_latent = torch.einsum("thn,rhn->thr", q_nope, w_uk)
            return (torch.cat([q_latent, q_pe], dim=-1),
                    torch.cat([c_kv.view(t, 1, c.kv_lora_rank), k_pe], dim=-1), None)
        kv_up = (c_kv @ p["kv_b"]).view(t, c.qo_heads, c.qk_nope_head_dim + c.v_head_dim)
        k_nope, v = kv_up.split([c.qk_nope_head_dim, c.v_head_dim], dim=-1)
        k = torch.cat([k_nope, k_pe.expand(t, c.qo_heads, c.qk_rope_head_dim)], dim=-1)
        return torch.cat([q_nope, q_pe], dim=-1), k, v

    def attention_probs(self, layer, dots, visible, distance):
        """Softmax(q . k x softmax_scale) under the causal mask (the plain form)."""
        scores = (dots * self.softmax_scale).masked_fill(~visible, float("-inf"))
        return torch.softmax(scores, dim=-1).nan_to_num(0.0)   # padded rows: 0

    def server_options(self) -> dict:
        # The model's scale: 1/sqrt(qk_nope + qk_rope), not the server's
        # default 1/sqrt(kv_lora_rank + qk_rope).
        return {"sm_scale": self.softmax_scale}

    def post_attention(self, layer: int, x, attn):
        """Absorbed: each head's latent output times W_UV; then the output
        projection, the residual and the SwiGLU MLP block."""
        p = self.layers[layer]
        if self.absorbed:
            _, w_uv = self._kv_b(layer)
            attn = torch.einsum("thr,rhv->thv", attn.to(self.dtype), w_uv)
        x = x + attn.reshape(x.shape[0], -1).to(self.dtype) @ p["wo"]
        h = self.rms_norm(x, p["mlp_norm"])
        return x + (F.silu(h @ p["w_gate"]) * (h @ p["w_up"])) @ p["w_down"]

    def logits(self, x):
        return self.rms_norm(x, self.final_norm).float() @ self.lm_head

    def describe(self) -> str:
        c = self.cfg
        return (f"{c.layers} layers, hidden {c.hidden}, {c.qo_heads} heads, q_lora_rank "
                f"{c.q_lora_rank}, kv_lora_rank {c.kv_lora_rank}, qk_nope {c.qk_nope_head_dim}, "
                f"qk_rope {c.qk_rope_head_dim}, v {c.v_head_dim}, ffn {c.ffn}, vocab {c.vocab}")


def check_geometry(cfg: Config, info: attnserve.ServerInfo, wire: str) -> None:
    """Stops with every difference between the model and the server."""
    pairs = [("attention", info.attention, "mla"),
             ("num_layers", info.num_layers, cfg.layers),
             ("num_qo_heads", info.num_qo_heads, cfg.qo_heads),
             ("kv_lora_rank", info.kv_lora_rank, cfg.kv_lora_rank),
             ("qk_rope_head_dim", info.qk_rope_head_dim, cfg.qk_rope_head_dim),
             ("kv_dtype", info.q_dtype or info.kv_dtype, wire)]
    diffs = [f"  {name}: server {s}, model {m} (server flag --{name}={m})"
             for name, s, m in pairs if s != m]
    if diffs:
        raise decoder.GeometryMismatch(
            f"the server at {info.device!r} does not fit the model:\n" + "\n".join(diffs))


class FlashInferMLAAttention:
    """Attention on attnserve through attnserve.flashinfer's MLA wrapper, as a
    FlashInfer engine runs it: its own page table over the cache's page
    indices, one plan per step, and per layer append_paged_mla_kv_cache of
    the new latent rows, then run(q_nope, q_pe, ...)."""

    def __init__(self, client, max_num_pages: int, model: Model, transport: str = "grpc"):
        import attnserve.flashinfer as flashinfer
        self.fi, self.model, self.info = flashinfer, model, client.server_info
        self.cache = flashinfer.PagedKVCache(client, max_num_pages, transport=transport)
        self.wrapper = flashinfer.BatchMLAPagedAttentionWrapper(self.cache)
        self.free = list(range(max_num_pages - 1, -1, -1))
        self.pages: dict = {}
        self.lens: dict = {}
        self.round_trips: list = []
        self.step = None

    def begin_step(self, seq_ids, q_lens):
        ps, g = self.info.page_size, self.info
        for sid, n in zip(seq_ids, q_lens):
            self.lens[sid] = self.lens.get(sid, 0) + n
            pages = self.pages.setdefault(sid, [])
            while len(pages) * ps < self.lens[sid]:
                pages.append(self.free.pop())
        i32 = dict(dtype=torch.int32)
        kv_indptr = torch.tensor([0] + np.cumsum([len(self.pages[s]) for s in seq_ids]).tolist(),
                                 **i32)
        kv_indices = torch.tensor([p for s in seq_ids for p in self.pages[s]], **i32)
        kv_lens = torch.tensor([self.lens[s] for s in seq_ids], **i32)
        kv_last = torch.tensor([self.lens[s] - (len(self.pages[s]) - 1) * ps for s in seq_ids],
                               **i32)
        qo_indptr = torch.tensor([0] + np.cumsum(q_lens).tolist(), **i32)
        self.wrapper.plan(qo_indptr, kv_indptr, kv_indices, kv_lens, g.num_qo_heads,
                          g.kv_lora_rank, g.qk_rope_head_dim, ps, True,
                          self.model.softmax_scale, self.cache.dtype, self.cache.dtype)
        batch_indices, positions = self.fi.get_batch_indices_positions(
            qo_indptr, kv_lens, int(qo_indptr[-1]))
        self.step = dict(kv_indptr=kv_indptr, kv_indices=kv_indices, kv_last=kv_last,
                         batch_indices=batch_indices, positions=positions)
        return positions.to(torch.int64)

    def attention(self, layer, q, latent, v):
        s, rank = self.step, self.info.kv_lora_rank
        t0 = time.perf_counter()
        self.fi.append_paged_mla_kv_cache(latent[:, 0, :rank], latent[:, 0, rank:],
                                          s["batch_indices"], s["positions"], self.cache[layer],
                                          self.cache[layer], s["kv_indices"], s["kv_indptr"],
                                          s["kv_last"])
        out = self.wrapper.run(q[..., :rank].contiguous(), q[..., rank:].contiguous(),
                               self.cache[layer], self.cache[layer])
        self.round_trips.append(time.perf_counter() - t0)
        return out

    def finish(self, seq_ids):
        for sid in seq_ids:
            self.free.extend(reversed(self.pages.pop(sid, [])))
            self.lens.pop(sid, None)
        if not self.pages:
            self.wrapper.close()
            self.cache.close()


MODES = ("local", "server", "kvmanager", "pingpong")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--target", default="127.0.0.1:50051")
    p.add_argument("--token", default=None, help="bearer token (--auth_tokens_file servers)")
    p.add_argument("--preset", choices=sorted(PRESETS), default="small")
    p.add_argument("--attention", default="all",
                   help="local, server, kvmanager, pingpong, several comma-separated (run in "
                        "that order, each compared with the first), or all (every one)")
    p.add_argument("--transport", choices=["grpc", "shm", "channel"], default="grpc",
                   help="how --attention server reaches the server (shm and channel: on this "
                        "host, with --allow_shared_memory)")
    p.add_argument("--attn_dtype", choices=["bf16", "fp16"], default="bf16")
    p.add_argument("--batch", type=int, default=None)
    p.add_argument("--steps", type=int, default=None, help="decode steps after the prefill")
    p.add_argument("--device", default="cpu", help="cpu or cuda[:N] for the model")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rel_tol", type=float, default=2e-2,
                   help="largest relative error of a step's logits between modes")
    p.add_argument("--no_server_plans", action="store_true",
                   help="send each step's layout with every layer instead of CreatePlan")
    p.add_argument("--strict", action="store_true",
                   help="also fail when greedy tokens differ at near-ties")
    p.add_argument("--timeout", type=float, default=300, help="per-call deadline, seconds")
    p.add_argument("--json", default=None, help="write the report here")
    args = p.parse_args(argv)
    modes = list(MODES) if args.attention == "all" else args.attention.split(",")
    bad = [m for m in modes if m not in MODES]
    if bad or len(set(modes)) != len(modes):
        p.error(f"--attention: {args.attention!r}: modes are {', '.join(MODES)} (each once)")

    preset = PRESETS[args.preset]
    cfg = preset["config"]
    batch = args.batch or preset["batch"]
    steps = preset["steps"] if args.steps is None else args.steps
    wire_dtype = torch.bfloat16 if args.attn_dtype == "bf16" else torch.float16
    model = Model(cfg, seed=args.seed, device=args.device)
    prompts = decoder.random_prompts(cfg.vocab, batch, *preset["prompt_len"], args.seed + 1)
    print(f"model: {model.describe()}; batch {batch}, {steps} decode steps", flush=True)

    client = None
    if any(m != "local" for m in modes):
        client = attnserve.Client(args.target, token=args.token, timeout=args.timeout)
        info = client.server_info
        check_geometry(cfg, info, args.attn_dtype)
        print(f"server {args.target}: {info.backend} {info.device}, attention {info.attention}, "
              f"{info.num_qo_heads} heads, latent rows of {info.kv_lora_rank} + "
              f"{info.qk_rope_head_dim}, outputs of {info.v_head_dim}", flush=True)

    runs, follow = {}, None
    for mode in modes:
        if mode == "local":
            local = decoder.LocalAttention(cfg, args.device, wire_dtype, model.attention_probs)
            runs[mode] = decoder.generate(model, local, prompts, steps, wire_dtype, mode, follow)
        elif mode == "server":
            remote = FlashInferMLAAttention(
                client, decoder.pages_for(prompts, steps, client.server_info.page_size), model,
                args.transport)
            runs[mode] = decoder.generate(model.absorbed_view(), remote, prompts, steps,
                                          wire_dtype, mode, follow)
        elif mode == "kvmanager":
            remote = decoder.ServerAttention(client, not args.no_server_plans, model)
            runs[mode] = decoder.generate(model.absorbed_view(), remote, prompts, steps,
                                          wire_dtype, mode, follow)
        else:
            async def pingpong():
                async with AsyncClient(args.target, token=args.token,
                                       timeout=args.timeout) as aclient:
                    return await decoder.generate_pingpong(
                        model.absorbed_view(), aclient, prompts, steps, wire_dtype, follow,
                        not args.no_server_plans)
            runs[mode] = asyncio.run(pingpong())
        if follow is None and len(modes) > 1:
            follow = runs[mode].tokens
        print(json.dumps(runs[mode].summary(batch)), flush=True)
    if client is not None:
        client.close()

    report = {"config": dataclasses.asdict(cfg), "batch": batch, "steps": steps,
              "runs": [r.summary(batch) for r in runs.values()], "comparisons": {}}
    ok = True
    names = list(runs)
    for other in names[1:]:
        c = decoder.compare_runs(runs[other], runs[names[0]], args.rel_tol)
        if args.strict:
            c["ok"] = c["ok"] and c["tokens_identical"]
        report["comparisons"][f"{other}_vs_{names[0]}"] = c
        print(decoder.describe_comparison(f"{other} vs {names[0]}", c), flush=True)
        ok &= c["ok"]
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    if not ok:
        print(f"FAILED: the modes disagree (tolerance {args.rel_tol})", file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
