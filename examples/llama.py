#!/usr/bin/env python3
"""A small Llama-style decoder whose attention runs locally or on attnserve.

RMSNorm, RoPE, GQA attention and a SwiGLU MLP with random weights from a
fixed seed (nothing is downloaded). A batch of random prompts goes through
prefill, then greedy decode, with the attention of every layer computed

  local     in PyTorch, from the same bf16 q/k/v the server would get;
  server    on attnserve through its FlashInfer-style wrappers
            (attnserve.flashinfer: plan once per step, append_paged_kv_cache
            and run per layer, docs/flashinfer.md), over --transport grpc,
            shm, channel or cuda;
  kvmanager on attnserve through attnserve.KvManager (one Prefill per layer
            with the new tokens' K/V appended in the same call);
  pingpong  on attnserve through the asyncio client, with the batch split in
            two micro-batches: while one micro-batch's attention is on the
            server, the other's MLP and projections run here.

`--attention all` (the default) runs local, server and pingpong, the later ones fed the
first one's tokens, and checks that every step's logits agree within bf16
tolerance and that the greedy tokens are identical, except at near-ties: where
the two best logits are closer than the runs' difference, no numerics can
order them (they occur at the realistic size; --strict fails on them too).
The server's geometry (layers, heads, head_dim, dtype) must be the model's:
the example reads it from info() and stops with the differences otherwise.
examples/decoder.py holds what this and the other example decoders
(gpt_oss.py, gemma2.py) share.

  scripts/run.sh        # the server's default geometry (--preset default); in another shell:
  PYTHONPATH=client/python python3 examples/llama.py --preset default

  # on a GPU machine, against a server there (same geometry):
  PYTHONPATH=client/python python3 examples/llama.py --preset realistic --device cuda

Against a server with an FP8 KV cache (attnserve --kv_dtype=fp8_e4m3) the
server modes attend over FP8 keys and values: the example sets the KV scales
(--kv_scale), checks the server modes against local attention over the same
FP8 rows ("server vs local_fp8", within --rel_tol) and reports how far the
logits and greedy tokens move from local bf16 attention ("server (fp8_e4m3
KV) vs local (bf16)"; a check too with --fp8_rel_tol).
"""

from __future__ import annotations

import math
import os
import sys
from dataclasses import dataclass

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # decoder.py beside it
import decoder  # noqa: E402
# What every example decoder shares (examples/decoder.py), under the names
# this module has always had.
from decoder import (AsyncServerAttention, GeometryMismatch, LocalAttention, Run,  # noqa: E402
                     ServerAttention, check_geometry, compare_runs, forward, generate,
                     generate_pingpong, random_prompts)

__all__ = ["Config", "PRESETS", "Model", "main", "AsyncServerAttention", "GeometryMismatch",
           "LocalAttention", "Run", "ServerAttention", "check_geometry", "compare_runs",
           "forward", "generate", "generate_pingpong", "random_prompts"]


# ---------------------------------------------------------------- the model
@dataclass(frozen=True)
class Config:
    vocab: int
    layers: int
    qo_heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    rope_theta: float = 10000.0
    eps: float = 1e-5

    @property
    def hidden(self) -> int:
        return self.qo_heads * self.head_dim


PRESETS = {
    # Fits CPU CI: the attention geometry of tests/python's servers.
    "small": dict(config=Config(vocab=512, layers=2, qo_heads=8, kv_heads=2, head_dim=64,
                                ffn=1024), batch=4, steps=8, prompt_len=(3, 24)),
    # The attention of the server's default flags (scripts/run.sh): 4 layers, 32
    # query / 4 KV heads of 128, bf16; a narrow MLP and vocabulary so that it
    # runs in seconds on a CPU.
    "default": dict(config=Config(vocab=1024, layers=4, qo_heads=32, kv_heads=4, head_dim=128,
                                  ffn=1024), batch=2, steps=8, prompt_len=(4, 16)),
    # The same attention with Llama-2-7B's widths, batch and length: for a GPU.
    "realistic": dict(config=Config(vocab=32000, layers=4, qo_heads=32, kv_heads=4, head_dim=128,
                                    ffn=11008), batch=64, steps=128, prompt_len=(16, 64)),
}


class Model:
    """Weights drawn from N(0, 1/fan_in) with a fixed seed; compute in `dtype`."""

    def __init__(self, cfg: Config, *, seed: int = 0, device="cpu", dtype=torch.float32):
        self.cfg = cfg
        self.device = torch.device(device)
        self.dtype = dtype
        gen = torch.Generator(device="cpu").manual_seed(seed)

        def w(fan_in, *shape):
            t = torch.randn(*shape, generator=gen) / math.sqrt(fan_in)
            return t.to(device=self.device, dtype=dtype)

        def norm_weight(n):
            t = 1.0 + 0.1 * torch.randn(n, generator=gen)
            return t.to(device=self.device, dtype=dtype)

        h, c = cfg.hidden, cfg
        self.embed = w(1, c.vocab, h)
        self.layers = []
        for _ in range(c.layers):
            self.layers.append(dict(
                attn_norm=norm_weight(h), wq=w(h, h, c.qo_heads * c.head_dim),
                wk=w(h, h, c.kv_heads * c.head_dim), wv=w(h, h, c.kv_heads * c.head_dim),
                wo=w(h, c.qo_heads * c.head_dim, h), mlp_norm=norm_weight(h),
                w_gate=w(h, h, c.ffn), w_up=w(h, h, c.ffn), w_down=w(c.ffn, c.ffn, h)))
        self.final_norm = norm_weight(h)
        # Logits in float32 whatever the compute dtype: bf16 logits tie often
        # enough to make greedy decoding arbitrary.
        self.lm_head = w(h, h, c.vocab).float()
        half = c.head_dim // 2
        self.inv_freq = (1.0 / c.rope_theta ** (torch.arange(half, dtype=torch.float32) / half)
                         ).to(self.device)

    def embed_tokens(self, ids):
        return self.embed[ids]

    def attention_probs(self, layer, dots, visible, distance):
        """Softmax(q . k / sqrt(head_dim)) under the causal mask."""
        scores = dots / math.sqrt(self.cfg.head_dim)
        scores = scores.masked_fill(~visible, float("-inf"))
        return torch.softmax(scores, dim=-1).nan_to_num(0.0)   # padded rows: 0

    def server_options(self) -> dict:
        return {}  # attnserve's defaults: causal, 1/sqrt(head_dim)

    def describe(self) -> str:
        c = self.cfg
        return (f"{c.layers} layers, hidden {c.hidden}, {c.qo_heads}/{c.kv_heads} heads x "
                f"{c.head_dim}, ffn {c.ffn}, vocab {c.vocab}")

    def rms_norm(self, x, weight):
        x32 = x.float()
        return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.cfg.eps)).to(
            self.dtype) * weight

    def rope(self, x, positions):
        return decoder.rope(x, positions, self.inv_freq, self.dtype)

    def pre_attention(self, layer: int, x, positions):
        """q [T, qo_heads, head_dim], k, v [T, kv_heads, head_dim] of x [T, hidden]."""
        p, c = self.layers[layer], self.cfg
        h = self.rms_norm(x, p["attn_norm"])
        q = (h @ p["wq"]).view(-1, c.qo_heads, c.head_dim)
        k = (h @ p["wk"]).view(-1, c.kv_heads, c.head_dim)
        v = (h @ p["wv"]).view(-1, c.kv_heads, c.head_dim)
        return self.rope(q, positions), self.rope(k, positions), v

    def post_attention(self, layer: int, x, attn):
        """The residual, the output projection and the SwiGLU MLP block."""
        p = self.layers[layer]
        x = x + attn.reshape(x.shape[0], -1).to(self.dtype) @ p["wo"]
        h = self.rms_norm(x, p["mlp_norm"])
        return x + (F.silu(h @ p["w_gate"]) * (h @ p["w_up"])) @ p["w_down"]

    def logits(self, x):
        return self.rms_norm(x, self.final_norm).float() @ self.lm_head


# ---------------------------------------------------------------- main
def main(argv=None) -> int:
    return decoder.main(argv, description=__doc__.split("\n")[0], presets=PRESETS,
                        make_model=Model)


if __name__ == "__main__":
    sys.exit(main())
