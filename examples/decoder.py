"""What the example decoders share: attention local or on attnserve, greedy
generation, and the checks that the two agree.

A model (examples/llama.py, gpt_oss.py, gemma2.py) is a PyTorch module-less
class with random weights that provides

  cfg                         layers, qo_heads, kv_heads, head_dim (and its own)
  embed_tokens(ids)           [T] token ids -> [T, hidden]
  pre_attention(layer, x, positions) -> q [T, qo_heads, head_dim], k, v [T, kv_heads, head_dim]
                              (v None where the server takes K rows alone: an
                              MLA model's latent rows, examples/deepseek_mla.py)
  attention_probs(layer, dots, visible, distance)
                              its softmax as its published definition writes it:
                              dots [B, Hq, Tq, Tk] = q . k (float32), visible
                              [B, 1, Tq, Tk] the causal mask (and the padding),
                              distance [1, 1, Tq, Tk] = query position - key
                              position; returns the weights [B, Hq, Tq, Tk]
  server_options()            the same attention for attnserve's KvManager:
                              sm_scale, options (attnserve.AttentionOptions of
                              every layer) and layer_options (per layer)
  post_attention(layer, x, attn) -> x
  logits(x)                   [N, hidden] -> [N, vocab] float32

and generation runs its attention

  local     in PyTorch (LocalAttention: a padded per-sequence KV cache and the
            model's attention_probs, float32 math on the bf16 q/k/v the
            server would get);
  server    on attnserve through its FlashInfer-style wrappers
            (FlashInferAttention, attnserve.flashinfer: FlashInfer's plan /
            run / append_paged_kv_cache loop, one request per layer with the
            new tokens' K/V fused in), over the transport --transport picks:
            grpc, shm (a shared-memory region), channel (a request channel:
            no gRPC call per layer) or cuda (CUDA tensors stay on the GPU;
            needs a GPU and a CUDA server on this host);
  kvmanager on attnserve through attnserve.KvManager (one Prefill per layer
            with the new tokens' K/V appended in the same call; with
            --no_server_plans the layout travels with every layer);
  pingpong  on attnserve through the asyncio client, with the batch split in
            two micro-batches: while one micro-batch's attention is on the
            server, the other's MLP and projections run here.

main() runs the modes, feeds the later ones the first one's tokens and
checks that every step's logits agree within bf16 tolerance and that the
greedy tokens are identical (but at near-ties: where the two best logits are
closer than the runs' difference, no numerics can order them).

Against a server whose KV cache is FP8 (attnserve --kv_dtype=fp8_e4m3 or
fp8_e5m2; docs/design.md, "FP8 KV cache") the server modes attend over FP8
keys and values while local attention keeps bf16: main() sets the server's
KV scales (--kv_scale, every layer, K and V) and runs local attention a
second time over K/V rows rounded as the server stores them (local_fp8:
quantized by the format's definition with those scales, attnserve.dtypes).
The server modes are checked against local_fp8 (within --rel_tol, as
above), and how far the logits and greedy tokens move from bf16 is reported
(checked too when --fp8_rel_tol is given).
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

try:
    import attnserve
except ImportError:  # run from the source tree without PYTHONPATH
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "client",
                                    "python"))
    import attnserve
from attnserve.aio import AsyncClient


def rope(x, positions, inv_freq, dtype):
    """Rotary embedding as Llama, Gemma and gpt-oss define it: the two halves
    of each head rotated by position * frequency, in float32. x [T, H, D],
    inv_freq [D/2] on x's device; returns dtype."""
    angles = positions.to(inv_freq.device, torch.float32)[:, None] * inv_freq[None, :]
    cos, sin = angles.cos()[:, None, :], angles.sin()[:, None, :]      # [T, 1, D/2]
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(dtype)


def plain_causal_probs(head_dim: int):
    """Softmax(q . k / sqrt(head_dim)) under the causal mask: Llama's attention."""
    scale = 1.0 / math.sqrt(head_dim)

    def probs(layer, dots, visible, distance):
        scores = (dots * scale).masked_fill(~visible, float("-inf"))
        return torch.softmax(scores, dim=-1).nan_to_num(0.0)   # padded rows: 0
    return probs


# ---------------------------------------------------------------- attention
class LocalAttention:
    """Attention in PyTorch over a padded per-sequence KV cache (float32 math
    on the bf16 q/k/v the server would get; output rounded to bf16).

    probs: the model's attention_probs (default: plain causal softmax).
    kv_fp8: (format, scale): keep K/V rows as an FP8 server with that KV
    scale in every layer stores them (quantized as its writes are, then
    dequantized in float32), so that the same attention over them is what the
    server should compute (main's "local_fp8" run)."""

    def __init__(self, cfg, device, wire_dtype=torch.bfloat16, probs=None, kv_fp8=None):
        self.cfg, self.device, self.wire_dtype = cfg, torch.device(device), wire_dtype
        self.kv_fp8 = kv_fp8
        self.cache_dtype = torch.float32 if kv_fp8 is not None else wire_dtype
        self.probs = probs or plain_causal_probs(cfg.head_dim)
        self.slot_of: dict = {}
        self.lens: dict = {}
        # layer -> (k, v) [slots, capacity, kv_heads, head_dim] (v's last
        # dimension may differ from k's: MLA's v_head_dim)
        self.cache: dict = {}
        self.step = None

    def begin_step(self, seq_ids, q_lens):
        for sid in seq_ids:
            if sid not in self.slot_of:
                self.slot_of[sid] = len(self.slot_of)
                self.lens[sid] = 0
        starts = [self.lens[s] for s in seq_ids]
        for sid, n in zip(seq_ids, q_lens):
            self.lens[sid] += n
        ql = torch.tensor(q_lens, dtype=torch.int64)
        st = torch.tensor(starts, dtype=torch.int64)
        batch_of = torch.repeat_interleave(torch.arange(len(seq_ids)), ql)
        first = torch.cumsum(ql, 0) - ql
        col = torch.arange(int(ql.sum())) - first[batch_of]                 # row within its seq
        positions = st[batch_of] + col
        self.step = dict(slots=torch.tensor([self.slot_of[s] for s in seq_ids]),
                         q_lens=ql, kv_lens=st + ql, batch_of=batch_of, col=col,
                         positions=positions)
        return positions

    def _grow(self, layer, slots_needed, length, k_row, v_row):
        """The layer's cache with room for slots_needed sequences of length
        rows of k_row and v_row ([kv_heads, dim] each)."""
        k, v = self.cache.get(layer, (None, None))
        cap = 0 if k is None else k.shape[1]
        n = 0 if k is None else k.shape[0]
        if k is not None and n >= slots_needed and cap >= length:
            return k, v
        new_cap, new_n = max(cap, 16), max(n, slots_needed, 4)
        while new_cap < length:
            new_cap *= 2
        nk = torch.zeros((new_n, new_cap, *k_row), dtype=self.cache_dtype, device=self.device)
        nv = torch.zeros((new_n, new_cap, *v_row), dtype=self.cache_dtype, device=self.device)
        if k is not None:
            nk[:n, :cap], nv[:n, :cap] = k, v
        self.cache[layer] = (nk, nv)
        return nk, nv

    def attention(self, layer, q, k, v):
        s, c = self.step, self.cfg
        dev = self.device
        kv_lens = s["kv_lens"].to(dev)
        k_cache, v_cache = self._grow(layer, len(self.slot_of), int(s["kv_lens"].max()),
                                      tuple(k.shape[1:]), tuple(v.shape[1:]))
        slots = s["slots"].to(dev)
        tok_slot = slots[s["batch_of"].to(dev)]
        tok_pos = s["positions"].to(dev)
        k_cache[tok_slot, tok_pos] = self._stored(k)
        v_cache[tok_slot, tok_pos] = self._stored(v)
        b, tq, tk = len(slots), int(s["q_lens"].max()), int(s["kv_lens"].max())
        q_pad = torch.zeros(b, tq, c.qo_heads, q.shape[-1], dtype=torch.float32, device=dev)
        q_pad[s["batch_of"].to(dev), s["col"].to(dev)] = q.to(self.wire_dtype).float()
        group = c.qo_heads // k.shape[1]
        keys = k_cache[slots, :tk].float().repeat_interleave(group, dim=2)    # [B, tk, Hq, D]
        vals = v_cache[slots, :tk].float().repeat_interleave(group, dim=2)
        dots = torch.einsum("bihd,bjhd->bhij", q_pad, keys)
        i = torch.arange(tq, device=dev)[None, :, None]
        j = torch.arange(tk, device=dev)[None, None, :]
        ql = s["q_lens"].to(dev)[:, None, None]
        kl = kv_lens[:, None, None]
        query_pos = i + kl - ql                                             # bottom-right
        visible = (j < kl) & (j <= query_pos)
        # Rows past a sequence's end are padding: they see nothing either.
        visible = visible & (i < ql)
        distance = (query_pos - j)[:, None]                                 # [B, 1, tq, tk]
        probs = self.probs(layer, dots, visible[:, None], distance)
        out = torch.einsum("bhij,bjhd->bihd", probs, vals)
        return out[s["batch_of"].to(dev), s["col"].to(dev)].to(self.wire_dtype)

    def _stored(self, x):
        """Rows as the cache holds them: the wire dtype's values, or on an FP8
        cache the server's quantization of those (x / scale, nearest even,
        saturating) times the scale, in float32."""
        x = x.to(self.wire_dtype)
        if self.kv_fp8 is None:
            return x
        fmt, scale = self.kv_fp8
        scale = np.float32(scale)                       # the server holds float32 scales
        bits = attnserve.float_to_fp8_bits(x.double().cpu().numpy(), fmt, float(scale))
        values = attnserve.fp8_bits_to_float32(bits, fmt) * scale
        return torch.from_numpy(values.astype(np.float32)).to(x.device)

    def finish(self, seq_ids):
        pass  # slots are not reused within one run


def _server_options(model) -> dict:
    options = getattr(model, "server_options", None)
    return options() if options is not None else {}


class ServerAttention:
    """Attention on attnserve through the blocking client and KvManager; with
    `model`, its attention options (server_options()) on every layer."""

    def __init__(self, client, server_plans: bool = True, model=None):
        self.mgr = attnserve.KvManager(client, server_plans=server_plans,
                                       **_server_options(model))
        self.round_trips: list = []

    def begin_step(self, seq_ids, q_lens):
        return torch.from_numpy(self.mgr.plan(seq_ids, q_lens).positions)

    def attention(self, layer, q, k, v):
        t0 = time.perf_counter()
        out = self.mgr.run(layer, q, k, v, out="torch", device=q.device).output
        self.round_trips.append(time.perf_counter() - t0)
        return out

    def finish(self, seq_ids):
        self.mgr.finish(*seq_ids)


def pages_for(prompts, steps: int, page_size: int) -> int:
    """Pages the sequences of a generation hold at its end."""
    return sum(-(-(len(p) + steps) // page_size) for p in prompts)


class FlashInferAttention:
    """Attention on attnserve through its FlashInfer-style wrappers
    (attnserve.flashinfer, docs/flashinfer.md): the loop a FlashInfer engine
    runs, with its import and its KV-cache allocation changed. The engine
    keeps its own page table (a free list over the cache's page indices
    0..max_num_pages-1), plans each step once per wrapper (a prefill wrapper
    for steps with prompts, a decode wrapper for one-token steps; one of each
    per distinct window and soft-cap, as an engine does for models whose
    layers differ) and, per layer, appends the new tokens' K/V with
    append_paged_kv_cache and runs the layer's wrapper (its sinks passed to
    run()). transport: PagedKVCache's ("grpc", "shm", "channel", "cuda")."""

    def __init__(self, client, max_num_pages: int, model=None, transport: str = "grpc"):
        import attnserve.flashinfer as flashinfer
        self.fi = flashinfer
        info = client.server_info
        self.info = info
        self.cache = flashinfer.PagedKVCache(client, max_num_pages, transport=transport)
        self.free = list(range(max_num_pages - 1, -1, -1))
        self.pages: dict = {}
        self.lens: dict = {}
        opts = _server_options(model)
        self.sm_scale = opts.get("sm_scale")
        every = opts.get("options")
        per_layer = opts.get("layer_options") or {}
        self.groups: dict = {}      # (window_left, soft_cap) -> (prefill, decode) wrappers
        self.layer_group, self.layer_sinks = [], []
        for layer in range(info.num_layers):
            o = per_layer.get(layer, every)
            window = -1 if o is None or o.window_left is None else int(o.window_left)
            cap = None if o is None else o.logits_soft_cap
            key = (window, cap)
            if key not in self.groups:
                self.groups[key] = (
                    flashinfer.BatchPrefillWithPagedKVCacheWrapper(self.cache, "NHD"),
                    flashinfer.BatchDecodeWithPagedKVCacheWrapper(self.cache, "NHD"))
            self.layer_group.append(key)
            sinks = None if o is None or o.sinks is None else torch.as_tensor(
                np.asarray(o.sinks, np.float32))
            self.layer_sinks.append(sinks)
        self.round_trips: list = []
        self.step = None

    def begin_step(self, seq_ids, q_lens):
        fi, ps = self.fi, self.info.page_size
        for sid, n in zip(seq_ids, q_lens):
            length = self.lens.get(sid, 0) + n
            pages = self.pages.setdefault(sid, [])
            while len(pages) * ps < length:
                pages.append(self.free.pop())
            self.lens[sid] = length
        i32 = dict(dtype=torch.int32)
        kv_indptr = torch.tensor([0] + np.cumsum([len(self.pages[s]) for s in seq_ids]).tolist(),
                                 **i32)
        kv_indices = torch.tensor([p for s in seq_ids for p in self.pages[s]], **i32)
        kv_last = torch.tensor([self.lens[s] - (len(self.pages[s]) - 1) * ps for s in seq_ids],
                               **i32)
        qo_indptr = torch.tensor([0] + np.cumsum(q_lens).tolist(), **i32)
        seq_lens = fi.get_seq_lens(kv_indptr, kv_last, ps)
        nnz = int(qo_indptr[-1])
        batch_indices, positions = fi.get_batch_indices_positions(qo_indptr, seq_lens, nnz)
        decode = all(n == 1 for n in q_lens)
        g = self.info
        for (window, cap), (prefill, dec) in self.groups.items():
            if decode:
                dec.plan(kv_indptr, kv_indices, kv_last, g.num_qo_heads, g.num_kv_heads,
                         g.head_dim, ps, window_left=window, logits_soft_cap=cap,
                         q_data_type=self.cache.dtype, kv_data_type=self.cache.kv_dtype,
                         sm_scale=self.sm_scale)
            else:
                prefill.plan(qo_indptr, kv_indptr, kv_indices, kv_last, g.num_qo_heads,
                             g.num_kv_heads, g.head_dim, ps, causal=True, window_left=window,
                             logits_soft_cap=cap, q_data_type=self.cache.dtype,
                             kv_data_type=self.cache.kv_dtype, sm_scale=self.sm_scale)
        self.step = dict(kv_indptr=kv_indptr, kv_indices=kv_indices, kv_last=kv_last,
                         batch_indices=batch_indices, positions=positions, decode=decode)
        return positions.to(torch.int64)

    def attention(self, layer, q, k, v):
        s = self.step
        t0 = time.perf_counter()
        self.fi.append_paged_kv_cache(k, v, s["batch_indices"], s["positions"],
                                      self.cache[layer], s["kv_indices"], s["kv_indptr"],
                                      s["kv_last"])
        prefill, dec = self.groups[self.layer_group[layer]]
        out = (dec if s["decode"] else prefill).run(q, self.cache[layer],
                                                     sinks=self.layer_sinks[layer])
        self.round_trips.append(time.perf_counter() - t0)
        return out

    def finish(self, seq_ids):
        for sid in seq_ids:
            self.free.extend(reversed(self.pages.pop(sid, [])))
            self.lens.pop(sid, None)
        if not self.pages:
            self.close()

    def close(self):
        for prefill, dec in self.groups.values():
            prefill.close()
            dec.close()
        self.cache.close()


class AsyncServerAttention:
    """Attention on attnserve through the asyncio client; one per micro-batch."""

    def __init__(self, mgr: attnserve.AsyncKvManager, round_trips: list):
        self.mgr, self.round_trips, self.plan = mgr, round_trips, None

    async def begin_step(self, seq_ids, q_lens):
        self.plan = await self.mgr.plan(seq_ids, q_lens)
        return torch.from_numpy(self.plan.positions)

    async def attention(self, layer, q, k, v):
        t0 = time.perf_counter()
        r = await self.mgr.run(layer, q, k, v, plan=self.plan, out="torch", device=q.device)
        self.round_trips.append(time.perf_counter() - t0)
        return r.output

    async def finish(self, seq_ids):
        await self.mgr.finish(*seq_ids)


# ---------------------------------------------------------------- generation
def _last_rows(q_lens):
    return torch.cumsum(torch.tensor(q_lens), 0) - 1


def _step_inputs(model, tokens):
    q_lens = [len(t) for t in tokens]
    flat = torch.tensor([x for t in tokens for x in t], device=model.device)
    return q_lens, model.embed_tokens(flat)


def _to(x, dtype):
    return None if x is None else x.to(dtype)


def forward(model, attn, seq_ids, tokens, wire_dtype):
    """One step for every sequence: logits [batch, vocab] of each one's last token."""
    q_lens, x = _step_inputs(model, tokens)
    positions = attn.begin_step(seq_ids, q_lens)
    for layer in range(model.cfg.layers):
        q, k, v = model.pre_attention(layer, x, positions)
        o = attn.attention(layer, q.to(wire_dtype), k.to(wire_dtype), _to(v, wire_dtype))
        x = model.post_attention(layer, x, o)
    return model.logits(x[_last_rows(q_lens).to(model.device)])


async def forward_async(model, attn, seq_ids, tokens, wire_dtype):
    """forward() for one micro-batch; awaits the server once per layer."""
    q_lens, x = _step_inputs(model, tokens)
    positions = await attn.begin_step(seq_ids, q_lens)
    for layer in range(model.cfg.layers):
        q, k, v = model.pre_attention(layer, x, positions)
        o = await attn.attention(layer, q.to(wire_dtype), k.to(wire_dtype), _to(v, wire_dtype))
        x = model.post_attention(layer, x, o)
    return model.logits(x[_last_rows(q_lens).to(model.device)])


@dataclass
class Run:
    mode: str
    tokens: torch.Tensor          # [batch, steps + 1] greedy tokens
    logits: list                  # steps + 1 tensors [batch, vocab] float32 (CPU)
    prefill_s: float
    decode_s: float
    round_trips: list             # seconds per layer round trip (server modes)

    def summary(self, batch: int) -> dict:
        steps = len(self.logits) - 1
        rt = np.array(self.round_trips) * 1e3
        return {
            "mode": self.mode, "batch": batch, "decode_steps": steps,
            "prefill_s": round(self.prefill_s, 4), "decode_s": round(self.decode_s, 4),
            "decode_tokens_per_s": round(batch * steps / self.decode_s, 1) if self.decode_s else None,
            "layer_round_trip_ms_mean": round(float(rt.mean()), 3) if rt.size else None,
            "layer_round_trip_ms_p50": round(float(np.percentile(rt, 50)), 3) if rt.size else None,
            "layer_round_trip_ms_p99": round(float(np.percentile(rt, 99)), 3) if rt.size else None,
        }


def _sync(device):
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def _next_inputs(tokens, follow, step):
    """Each sequence's next input: its own greedy token, or follow[:, step] when
    following another run's tokens (so that two runs' logits stay comparable)."""
    chosen = tokens[-1] if follow is None else follow[:, step]
    return [[int(t)] for t in chosen.tolist()]


def generate(model, attn, prompts, steps, wire_dtype, mode, follow=None) -> Run:
    """Prefill, then `steps` greedy decode steps. follow [batch, steps + 1]: feed
    these tokens instead of the run's own (its own argmax is still recorded)."""
    seq_ids = list(range(len(prompts)))
    t0 = time.perf_counter()
    logits = [forward(model, attn, seq_ids, prompts, wire_dtype)]
    tokens = [logits[-1].argmax(-1)]
    _sync(model.device)
    t1 = time.perf_counter()
    for step in range(steps):
        logits.append(forward(model, attn, seq_ids, _next_inputs(tokens, follow, step),
                              wire_dtype))
        tokens.append(logits[-1].argmax(-1))
    _sync(model.device)
    t2 = time.perf_counter()
    attn.finish(seq_ids)
    return Run(mode, torch.stack(tokens, 1).cpu(), [l.cpu() for l in logits], t1 - t0, t2 - t1,
               list(getattr(attn, "round_trips", [])))


async def generate_pingpong(model, client: AsyncClient, prompts, steps, wire_dtype,
                            follow=None, server_plans: bool = True) -> Run:
    """generate() with two micro-batches in flight: each step runs both halves'
    forward passes concurrently, so one's attention overlaps the other's MLP."""
    mgr = attnserve.AsyncKvManager(client, server_plans=server_plans, **_server_options(model))
    round_trips: list = []
    half = (len(prompts) + 1) // 2
    groups = [list(range(0, half)), list(range(half, len(prompts)))]
    groups = [g for g in groups if g]
    attns = [AsyncServerAttention(mgr, round_trips) for _ in groups]

    async def step(inputs):
        outs = await asyncio.gather(*(forward_async(model, a, g, [inputs[i] for i in g],
                                                    wire_dtype)
                                      for a, g in zip(attns, groups)))
        return torch.cat(outs, 0)

    t0 = time.perf_counter()
    logits = [await step(prompts)]
    tokens = [logits[-1].argmax(-1)]
    _sync(model.device)
    t1 = time.perf_counter()
    for i in range(steps):
        logits.append(await step(_next_inputs(tokens, follow, i)))
        tokens.append(logits[-1].argmax(-1))
    _sync(model.device)
    t2 = time.perf_counter()
    await mgr.release()
    return Run("pingpong", torch.stack(tokens, 1).cpu(), [l.cpu() for l in logits], t1 - t0,
               t2 - t1, round_trips)


# ---------------------------------------------------------------- checks
class GeometryMismatch(SystemExit):
    pass


def check_geometry(cfg, info: attnserve.ServerInfo, wire: str) -> None:
    """Stops with every difference between the model and the server (whose
    queries' dtype must be --attn_dtype; its KV cache may be FP8)."""
    pairs = [("num_layers", info.num_layers, cfg.layers, "--layers"),
             ("num_qo_heads", info.num_qo_heads, cfg.qo_heads, "--qo_heads"),
             ("num_kv_heads", info.num_kv_heads, cfg.kv_heads, "--kv_heads"),
             ("head_dim", info.head_dim, cfg.head_dim, "--head_dim"),
             ("q_dtype", info.q_dtype or info.kv_dtype, wire, "--attn_dtype")]
    diffs = [f"  {name}: server {s}, model {m} (server flag --{name}={m}, or model {flag}={s})"
             for name, s, m, flag in pairs if s != m]
    if diffs:
        raise GeometryMismatch(
            f"the server at {info.device!r} does not fit the model:\n" + "\n".join(diffs))


def describe_comparison(label: str, c: dict) -> str:
    """One line of a compare_runs() result: the logits' error and the tokens."""
    return (f"{label}: max logits rel error {c['max_logits_rel_error']:.2e}, "
            f"greedy tokens identical: {c['tokens_identical']}"
            + ("" if c["tokens_identical"] else
               f" ({c['greedy_differences']} of {c['tokens_compared']} differ, "
               f"{c['greedy_differences_at_near_ties']} of them at near-ties)"))


def compare_runs(a: Run, b: Run, rel_tol: float) -> dict:
    """a against the reference b, which a followed (the same inputs at every step).

    max_logits_rel_error: the largest relative norm error of a step's logits.
    greedy_differences: (seq, step) where the argmax differs; each is a near-tie
    when b's two best logits there are closer than the largest difference
    between a's and b's logits in that row (the numerics cannot order them).
    """
    errors = [float((x - y).norm() / y.norm()) for x, y in zip(a.logits, b.logits)]
    diff = (a.tokens != b.tokens).nonzero().tolist()             # [(seq, step), ...]
    near_ties = 0
    for seq, step in diff:
        top2 = b.logits[step][seq].topk(2).values
        if float(top2[0] - top2[1]) <= float((a.logits[step][seq] - b.logits[step][seq]).abs().max()):
            near_ties += 1
    return {"max_logits_rel_error": max(errors), "tokens_identical": not diff,
            "greedy_differences": len(diff), "greedy_differences_at_near_ties": near_ties,
            "tokens_compared": int(a.tokens.numel()),
            "ok": max(errors) < rel_tol and near_ties == len(diff)}


def random_prompts(vocab, batch, lo, hi, seed):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, int(rng.integers(lo, hi + 1))).tolist() for _ in range(batch)]


# ---------------------------------------------------------------- main
ATTENTION_MODES = ("local", "server", "kvmanager", "pingpong")


def main(argv, *, description: str, presets: dict, make_model) -> int:
    """The command line of an example decoder: presets (each a dict of
    config, batch, steps, prompt_len), make_model(cfg, seed=, device=, dtype=)."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--target", default="127.0.0.1:50051")
    p.add_argument("--token", default=None, help="bearer token (--auth_tokens_file servers)")
    p.add_argument("--preset", choices=sorted(presets), default="small")
    def attention_modes(text):
        modes = ["local", "server", "pingpong"] if text == "all" else text.split(",")
        for m in modes:
            if m not in ATTENTION_MODES:
                raise argparse.ArgumentTypeError(
                    f"{m!r} is not one of {', '.join(ATTENTION_MODES)} or all")
        if len(set(modes)) != len(modes):
            raise argparse.ArgumentTypeError(f"{text!r} names a mode twice")
        return modes
    p.add_argument("--attention", type=attention_modes, default="all",
                   help="local, server, kvmanager, pingpong, or several of them comma-separated "
                        "(run in that order, each compared with the first); all: local, server "
                        "and pingpong")
    p.add_argument("--transport", choices=["grpc", "shm", "channel", "cuda"], default="grpc",
                   help="how --attention server reaches the server: shm, channel and cuda need "
                        "it on this host with --allow_shared_memory (cuda: a GPU here and the "
                        "CUDA backend there)")
    for name in ("layers", "qo_heads", "kv_heads", "head_dim", "ffn", "vocab"):
        p.add_argument(f"--{name}", type=int, default=None, help="override the preset")
    p.add_argument("--attn_dtype", choices=["bf16", "fp16"], default="bf16")
    p.add_argument("--batch", type=int, default=None)
    p.add_argument("--steps", type=int, default=None, help="decode steps after the prefill")
    p.add_argument("--prompt_len", default=None, help="MIN:MAX tokens per prompt")
    p.add_argument("--device", default="cpu", help="cpu or cuda[:N] for the model")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                   help="model compute dtype; with bfloat16 the modes' greedy tokens part "
                        "ways after the first near-tie, so compare in float32")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rel_tol", type=float, default=2e-2,
                   help="largest relative error of a step's logits between modes")
    p.add_argument("--no_server_plans", action="store_true",
                   help="kvmanager and pingpong: send each step's layout with every layer "
                        "instead of CreatePlan")
    p.add_argument("--strict", action="store_true",
                   help="also fail when greedy tokens differ at near-ties")
    p.add_argument("--kv_scale", type=float, default=1.0,
                   help="FP8 servers: the KV scale set for every layer's K and V (real = fp8 "
                        "value x scale; 1.0 as vLLM's default)")
    p.add_argument("--fp8_rel_tol", type=float, default=None,
                   help="FP8 servers: largest relative error of a step's logits between the "
                        "server's FP8 attention and local bf16 attention (default: reported, "
                        "not checked; the server is checked against local_fp8 within --rel_tol)")
    p.add_argument("--timeout", type=float, default=300, help="per-call deadline, seconds")
    p.add_argument("--json", default=None, help="write the report here")
    args = p.parse_args(argv)

    preset = presets[args.preset]
    overrides = {k: getattr(args, k) for k in ("layers", "qo_heads", "kv_heads", "head_dim",
                                               "ffn", "vocab") if getattr(args, k) is not None}
    cfg = dataclasses.replace(preset["config"], **overrides)
    batch = args.batch or preset["batch"]
    steps = preset["steps"] if args.steps is None else args.steps
    lo, hi = preset["prompt_len"] if args.prompt_len is None else map(
        int, args.prompt_len.split(":"))
    dtype = getattr(torch, args.dtype)
    wire_dtype = torch.bfloat16 if args.attn_dtype == "bf16" else torch.float16

    modes = args.attention
    client = None
    if any(m != "local" for m in modes):
        client = attnserve.Client(args.target, token=args.token, timeout=args.timeout)
        check_geometry(cfg, client.server_info, args.attn_dtype)
        info = client.server_info
        if "server" in modes and args.transport == "cuda":
            import attnserve.flashinfer as flashinfer
            try:
                flashinfer.PagedKVCache._check_cuda(info)
            except RuntimeError as e:
                print(f"--transport=cuda: {e}", file=sys.stderr)
                client.close()
                return 2
        print(f"server {args.target}: {info.backend} {info.device}, {info.num_layers} layers, "
              f"{info.num_qo_heads}/{info.num_kv_heads} heads x {info.head_dim}, "
              f"KV {info.kv_dtype}, queries {info.q_dtype or info.kv_dtype}, "
              f"{info.free_pages} free pages of {info.page_size}", flush=True)
        if info.kv_fp8:
            client.set_kv_scales({layer: (args.kv_scale, args.kv_scale)
                                  for layer in range(info.num_layers)})
            print(f"FP8 KV cache: K and V scales {args.kv_scale} in every layer; the server "
                  f"modes are checked against local attention over the same FP8 rows "
                  f"(local_fp8) within --rel_tol={args.rel_tol}, and their move from local "
                  f"bf16 attention is reported" + (
                      "" if args.fp8_rel_tol is None else
                      f" and checked within --fp8_rel_tol={args.fp8_rel_tol}"), flush=True)

    model = make_model(cfg, seed=args.seed, device=args.device, dtype=dtype)
    prompts = random_prompts(cfg.vocab, batch, lo, hi, args.seed + 1)
    print(f"model: {model.describe()}, {str(dtype)[6:]} on {args.device}; batch {batch}, "
          f"prompts {lo}..{hi} tokens, {steps} decode steps", flush=True)

    fp8 = client is not None and client.server_info.kv_fp8
    kv_dtype = client.server_info.kv_dtype if client is not None else None
    if fp8 and "local" in modes and len(modes) > 1:
        # The server's FP8 attention, computed here: what the server modes
        # are checked against.
        modes = modes[:modes.index("local") + 1] + ["local_fp8"] + modes[modes.index("local") + 1:]
    runs = {}
    follow = None  # with several modes, the later ones follow the first one's tokens
    for mode in modes:
        if mode in ("local", "local_fp8"):
            local = LocalAttention(cfg, args.device, wire_dtype, model.attention_probs,
                                   (kv_dtype, args.kv_scale) if mode == "local_fp8" else None)
            runs[mode] = generate(model, local, prompts, steps, wire_dtype, mode, follow)
        elif mode == "server":
            try:
                remote = FlashInferAttention(client, pages_for(prompts, steps, info.page_size),
                                             model, args.transport)
            except (RuntimeError, NotImplementedError, attnserve.AttnserveError) as e:
                print(f"--transport={args.transport}: {e}", file=sys.stderr)
                client.close()
                return 2
            runs[mode] = generate(model, remote, prompts, steps, wire_dtype, mode, follow)
            print(f"transport: {args.transport}", flush=True)
        elif mode == "kvmanager":
            remote = ServerAttention(client, not args.no_server_plans, model)
            runs[mode] = generate(model, remote, prompts, steps, wire_dtype, mode, follow)
        else:
            async def pingpong():
                async with AsyncClient(args.target, token=args.token,
                                       timeout=args.timeout) as aclient:
                    return await generate_pingpong(model, aclient, prompts, steps, wire_dtype,
                                                   follow, not args.no_server_plans)
            runs[mode] = asyncio.run(pingpong())
        if follow is None and len(modes) > 1:
            follow = runs[mode].tokens
        print(json.dumps(runs[mode].summary(batch)), flush=True)

    report = {"config": dataclasses.asdict(cfg), "batch": batch, "steps": steps,
              "transport": args.transport,
              "runs": [r.summary(batch) for r in runs.values()], "comparisons": {}}
    if client is not None:
        report["server_kv_dtype"] = kv_dtype
    ok = True
    failed_tolerances = set()
    names = list(runs)
    first = names[0]
    pairs = []  # (mode, reference, tolerance (None: reported, not checked), FP8 against bf16)
    for other in names[1:]:
        # FP8 attention (a server mode, local_fp8) against bf16 (local): how
        # far FP8 moves the model, checked only with --fp8_rel_tol; a server
        # mode against local_fp8: both FP8, checked within --rel_tol.
        crossed = fp8 and (other == "local") != (first == "local")
        if crossed and other != "local_fp8" and "local_fp8" in runs:
            pairs.append((other, "local_fp8", args.rel_tol, False))
        pairs.append((other, first, args.fp8_rel_tol if crossed else args.rel_tol, crossed))

    def kind(mode):
        return args.attn_dtype if mode == "local" else kv_dtype

    for other, ref, tolerance, crossed in pairs:
        c = compare_runs(runs[other], runs[ref], math.inf if tolerance is None else tolerance)
        c["checked"] = tolerance is not None
        if crossed:
            c["kv_dtypes"] = [kind(other), kind(ref)]
        report["comparisons"][f"{other}_vs_{ref}"] = c
        if args.strict:
            c["ok"] = c["ok"] and c["tokens_identical"]
        label = (f"{other} ({kind(other)}{'' if other == 'local' else ' KV'}) vs {ref} "
                 f"({kind(ref)}{'' if ref == 'local' else ' KV'})" if crossed
                 else f"{other} vs {ref}")
        print(describe_comparison(label, c) + ("" if c["checked"] else " (reported)"),
              flush=True)
        if c["checked"]:
            ok &= c["ok"]
            if not c["ok"]:
                failed_tolerances.add(tolerance)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    if client is not None:
        client.close()
    if not ok:
        print(f"FAILED: the modes disagree (tolerance "
              f"{', '.join(str(t) for t in sorted(failed_tolerances))})", file=sys.stderr)
    return 0 if ok else 1
