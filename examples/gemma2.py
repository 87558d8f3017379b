#!/usr/bin/env python3
"""A small Gemma-2-style decoder whose attention runs locally or on attnserve.

Written from Gemma 2's published definition (the Gemma 2 report, Hugging
Face's Gemma2): embeddings scaled by sqrt(hidden), RMSNorm with (1 + weight)
before and after both the attention and the MLP, RoPE, GQA attention scaled
by query_pre_attn_scalar^-1/2 (not head_dim's), its logits soft-capped at 50
(50 * tanh(x / 50)), layers alternating between a sliding window (even
layers; 4096 tokens in Gemma 2, a few here so that it cuts in short
prompts) and full causal attention, a GeGLU MLP, tied embeddings and final
logits soft-capped at 30. Random weights from a fixed seed; small widths so
that it runs on a CPU.

On attnserve the scale is sm_scale, the soft-cap logits_soft_cap and the
windows window_left = sliding_window - 1 on the windowed layers: the plan()
arguments of the FlashInfer-style wrappers (--attention server; one pair of
wrappers for the windowed layers, one for the full ones), or
attnserve.AttentionOptions registered with each step's plan by
attnserve.KvManager (kvmanager, pingpong). examples/decoder.py runs the
modes and checks that they agree, as for examples/llama.py.

  # a server with the small preset's geometry (tests/python's), in another shell:
  build/bin/attnserve --backend=cpu --num_layers=2 --num_qo_heads=8 --num_kv_heads=2 --head_dim=64
  PYTHONPATH=client/python python3 examples/gemma2.py
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

import attnserve  # noqa: E402  (decoder.py put it on the path when needed)


@dataclass(frozen=True)
class Config:
    vocab: int
    layers: int
    qo_heads: int
    kv_heads: int
    head_dim: int
    hidden: int
    ffn: int
    query_pre_attn_scalar: float  # the attention scale is its inverse square root
    sliding_window: int           # tokens a windowed layer's query sees, itself included
    attn_logit_softcapping: float = 50.0
    final_logit_softcapping: float = 30.0
    rope_theta: float = 10000.0
    eps: float = 1e-6

    def sliding(self, layer: int) -> bool:
        """Gemma 2's layers: sliding windows on even layers, full on odd."""
        return layer % 2 == 0


PRESETS = {
    # CPU CI: the attention geometry of tests/python's servers. The scalar is
    # 144 (Gemma 2 27B's hidden / heads), not head_dim, so the scale is not
    # 1/sqrt(head_dim); the window cuts in these prompts.
    "small": dict(config=Config(vocab=512, layers=2, qo_heads=8, kv_heads=2, head_dim=64,
                                hidden=256, ffn=512, query_pre_attn_scalar=144.0,
                                sliding_window=16),
                  batch=4, steps=8, prompt_len=(8, 40)),
    # The attention of the server's default flags (scripts/run.sh): 4 layers,
    # 32 query / 4 KV heads of 128.
    "default": dict(config=Config(vocab=1024, layers=4, qo_heads=32, kv_heads=4, head_dim=128,
                                  hidden=512, ffn=1024, query_pre_attn_scalar=144.0,
                                  sliding_window=32),
                    batch=2, steps=8, prompt_len=(8, 64)),
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

        def norm_weight(n):  # Gemma's RMSNorm scales by (1 + weight)
            return (0.1 * torch.randn(n, generator=gen)).to(device=self.device, dtype=dtype)

        c, h = cfg, cfg.hidden
        qd, kvd = c.qo_heads * c.head_dim, c.kv_heads * c.head_dim
        # Tied: the embedding is also the output projection. Its rows have
        # norm about 1, so that the logits (hidden values of size ~1 times
        # them) are of order sqrt(hidden) before the final soft-cap.
        self.embed = w(h, c.vocab, h)
        # Queries and keys drawn 5 times larger: attention logits of tens,
        # the range Gemma 2's soft-cap of 50 is for (it bends them).
        self.layers = []
        for _ in range(c.layers):
            self.layers.append(dict(
                input_norm=norm_weight(h), wq=5 * w(h, h, qd), wk=5 * w(h, h, kvd),
                wv=w(h, h, kvd),
                wo=w(qd, qd, h), post_attn_norm=norm_weight(h), pre_ffn_norm=norm_weight(h),
                w_gate=w(h, h, c.ffn), w_up=w(h, h, c.ffn), w_down=w(c.ffn, c.ffn, h),
                post_ffn_norm=norm_weight(h)))
        self.final_norm = norm_weight(h)
        half = c.head_dim // 2
        self.inv_freq = (1.0 / c.rope_theta ** (torch.arange(half, dtype=torch.float32) / half)
                         ).to(self.device)

    def describe(self) -> str:
        c = self.cfg
        return (f"Gemma 2 style, {c.layers} layers ({c.sliding_window}-token windows on even "
                f"layers), hidden {c.hidden}, {c.qo_heads}/{c.kv_heads} heads x {c.head_dim}, "
                f"query_pre_attn_scalar {c.query_pre_attn_scalar:g}, soft-caps "
                f"{c.attn_logit_softcapping:g}/{c.final_logit_softcapping:g}, ffn {c.ffn}, "
                f"vocab {c.vocab}")

    def embed_tokens(self, ids):
        # The normalizer in the compute dtype, as Gemma's.
        return self.embed[ids] * torch.tensor(self.cfg.hidden ** 0.5, dtype=self.dtype)

    def rms_norm(self, x, weight):
        x32 = x.float()
        out = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.cfg.eps)
        return (out * (1.0 + weight.float())).to(self.dtype)

    def rope(self, x, positions):
        return decoder.rope(x, positions, self.inv_freq, self.dtype)

    def pre_attention(self, layer: int, x, positions):
        """q [T, qo_heads, head_dim], k, v [T, kv_heads, head_dim] of x [T, hidden]."""
        p, c = self.layers[layer], self.cfg
        h = self.rms_norm(x, p["input_norm"])
        q = (h @ p["wq"]).view(-1, c.qo_heads, c.head_dim)
        k = (h @ p["wk"]).view(-1, c.kv_heads, c.head_dim)
        v = (h @ p["wv"]).view(-1, c.kv_heads, c.head_dim)
        return self.rope(q, positions), self.rope(k, positions), v

    def attention_probs(self, layer, dots, visible, distance):
        """Gemma 2's softmax: logits scaled by query_pre_attn_scalar^-1/2, then
        soft-capped, then the causal mask and on sliding layers the window (a
        key at distance >= sliding_window is out)."""
        c = self.cfg
        scores = dots * c.query_pre_attn_scalar ** -0.5
        cap = c.attn_logit_softcapping
        scores = torch.tanh(scores / cap) * cap
        if c.sliding(layer):
            visible = visible & (distance < c.sliding_window)
        scores = scores.masked_fill(~visible, float("-inf"))
        return torch.softmax(scores, dim=-1).nan_to_num(0.0)   # padded rows: 0

    def server_options(self) -> dict:
        """The same attention on attnserve: the scale, the soft-cap on every
        layer, and the window on the sliding ones."""
        c = self.cfg
        every = attnserve.AttentionOptions(logits_soft_cap=c.attn_logit_softcapping)
        windowed = attnserve.AttentionOptions(logits_soft_cap=c.attn_logit_softcapping,
                                              window_left=c.sliding_window - 1)
        return dict(sm_scale=c.query_pre_attn_scalar ** -0.5, options=every,
                    layer_options={layer: windowed for layer in range(c.layers)
                                   if c.sliding(layer)})

    def post_attention(self, layer: int, x, attn):
        """The output projection and its norm into the residual, then the
        normed GeGLU MLP into the residual."""
        p = self.layers[layer]
        a = attn.reshape(x.shape[0], -1).to(self.dtype) @ p["wo"]
        x = x + self.rms_norm(a, p["post_attn_norm"])
        h = self.rms_norm(x, p["pre_ffn_norm"])
        m = (F.gelu(h @ p["w_gate"], approximate="tanh") * (h @ p["w_up"])) @ p["w_down"]
        return x + self.rms_norm(m, p["post_ffn_norm"])

    def logits(self, x):
        cap = self.cfg.final_logit_softcapping
        out = self.rms_norm(x, self.final_norm).float() @ self.embed.float().T
        return torch.tanh(out / cap) * cap


def main(argv=None) -> int:
    return decoder.main(argv, description=__doc__.split("\n")[0], presets=PRESETS,
                        make_model=Model)


if __name__ == "__main__":
    sys.exit(main())
