#!/usr/bin/env python3
"""A small gpt-oss-style decoder whose attention runs locally or on attnserve.

Written from gpt-oss's published definition (OpenAI's model card and
reference implementation, Hugging Face's GptOss): RMSNorm, RoPE, GQA
attention with biased projections whose layers alternate between a
128-token sliding window (even layers) and full causal attention, one
learned sink logit per query head in every layer's softmax denominator, and
a mixture-of-experts MLP (top-k routing over experts with gpt-oss's clamped
SwiGLU). Random weights from a fixed seed (nothing is downloaded); small
widths so that it runs on a CPU.

On attnserve the windows and sinks are attnserve.AttentionOptions per layer
(window_left = sliding_window - 1: a query sees itself and the 127 keys
before it). Through the FlashInfer-style wrappers (--attention server) the
windowed and the full layers each have their wrappers, planned with their
window_left, and each layer passes its sinks to run(); through
attnserve.KvManager (kvmanager, pingpong) they are registered with each
step's plan. examples/decoder.py runs the modes and checks that they agree,
as for examples/llama.py.

  # a server with the small preset's geometry (tests/python's), in another shell:
  build/bin/attnserve --backend=cpu --num_layers=2 --num_qo_heads=8 --num_kv_heads=2 --head_dim=64
  PYTHONPATH=client/python python3 examples/gpt_oss.py
"""

from __future__ import annotations

import math
import os
import sys
from dataclasses import dataclass

import torch

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
    ffn: int                     # each expert's intermediate size
    experts: int
    experts_per_token: int
    sliding_window: int = 128    # tokens a windowed layer's query sees, itself included
    rope_theta: float = 150000.0
    eps: float = 1e-5
    swiglu_limit: float = 7.0
    swiglu_alpha: float = 1.702

    def sliding(self, layer: int) -> bool:
        """gpt-oss's layer types: sliding_attention on even layers, full on odd."""
        return layer % 2 == 0


PRESETS = {
    # CPU CI: the attention geometry of tests/python's servers; prompts longer
    # than the window, so that it cuts.
    "small": dict(config=Config(vocab=512, layers=2, qo_heads=8, kv_heads=2, head_dim=64,
                                hidden=256, ffn=256, experts=4, experts_per_token=2),
                  batch=4, steps=8, prompt_len=(100, 200)),
    # The attention of the server's default flags (scripts/run.sh): 4 layers,
    # 32 query / 4 KV heads of 128.
    "default": dict(config=Config(vocab=1024, layers=4, qo_heads=32, kv_heads=4, head_dim=128,
                                  hidden=512, ffn=256, experts=4, experts_per_token=2),
                    batch=2, steps=8, prompt_len=(100, 200)),
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

        def small(*shape):
            return (0.02 * torch.randn(*shape, generator=gen)).to(device=self.device, dtype=dtype)

        def norm_weight(n):
            t = 1.0 + 0.1 * torch.randn(n, generator=gen)
            return t.to(device=self.device, dtype=dtype)

        c, h = cfg, cfg.hidden
        qd, kvd = c.qo_heads * c.head_dim, c.kv_heads * c.head_dim
        self.embed = w(1, c.vocab, h)
        self.layers = []
        for _ in range(c.layers):
            self.layers.append(dict(
                attn_norm=norm_weight(h),
                wq=w(h, h, qd), bq=small(qd), wk=w(h, h, kvd), bk=small(kvd),
                wv=w(h, h, kvd), bv=small(kvd), wo=w(qd, qd, h), bo=small(h),
                # One sink logit per query head (natural units): large enough
                # to take a good share of a 128-key window's denominator.
                sinks=(4.0 + torch.randn(c.qo_heads, generator=gen)).float().to(self.device),
                mlp_norm=norm_weight(h),
                router=w(h, h, c.experts), router_bias=small(c.experts),
                gate_up=w(h, c.experts, h, 2 * c.ffn), gate_up_bias=small(c.experts, 2 * c.ffn),
                down=w(c.ffn, c.experts, c.ffn, h), down_bias=small(c.experts, h)))
        self.final_norm = norm_weight(h)
        # Logits in float32 whatever the compute dtype (greedy decoding on
        # bf16 logits ties too often).
        self.lm_head = w(h, h, c.vocab).float()
        half = c.head_dim // 2
        self.inv_freq = (1.0 / c.rope_theta ** (torch.arange(half, dtype=torch.float32) / half)
                         ).to(self.device)

    def describe(self) -> str:
        c = self.cfg
        return (f"gpt-oss style, {c.layers} layers ({c.sliding_window}-token windows on even "
                f"layers, sinks), hidden {c.hidden}, {c.qo_heads}/{c.kv_heads} heads x "
                f"{c.head_dim}, {c.experts} experts (top {c.experts_per_token}) of {c.ffn}, "
                f"vocab {c.vocab}")

    def embed_tokens(self, ids):
        return self.embed[ids]

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
        q = (h @ p["wq"] + p["bq"]).view(-1, c.qo_heads, c.head_dim)
        k = (h @ p["wk"] + p["bk"]).view(-1, c.kv_heads, c.head_dim)
        v = (h @ p["wv"] + p["bv"]).view(-1, c.kv_heads, c.head_dim)
        return self.rope(q, positions), self.rope(k, positions), v

    def attention_probs(self, layer, dots, visible, distance):
        """gpt-oss's softmax: scaled logits, the causal mask and on sliding
        layers the window (a key at distance >= sliding_window is out), then
        the head's sink as one more logit whose weight is dropped."""
        c = self.cfg
        scores = dots * c.head_dim ** -0.5
        if c.sliding(layer):
            visible = visible & (distance < c.sliding_window)
        scores = scores.masked_fill(~visible, float("-inf"))
        b, h, tq, _ = scores.shape
        sinks = self.layers[layer]["sinks"].reshape(1, -1, 1, 1).expand(b, h, tq, 1)
        combined = torch.cat([scores, sinks.to(scores.dtype)], dim=-1)
        combined = combined - combined.max(dim=-1, keepdim=True).values
        return torch.softmax(combined, dim=-1)[..., :-1]

    def server_options(self) -> dict:
        """The same attention on attnserve: per layer, the window (on sliding
        layers) and the sinks."""
        c = self.cfg
        layers = {}
        for layer in range(c.layers):
            layers[layer] = attnserve.AttentionOptions(
                window_left=c.sliding_window - 1 if c.sliding(layer) else None,
                sinks=self.layers[layer]["sinks"])
        return dict(sm_scale=c.head_dim ** -0.5, layer_options=layers)

    def experts(self, layer: int, h):
        """gpt-oss's MLP: a router picks experts_per_token experts per token
        (softmax over their router logits); each is a clamped SwiGLU."""
        p, c = self.layers[layer], self.cfg
        router = h @ p["router"] + p["router_bias"]                          # [T, E]
        top, chosen = router.topk(c.experts_per_token, dim=-1)
        weights = torch.softmax(top.float(), dim=-1).to(self.dtype)          # [T, k]
        gate_up = torch.einsum("th,ehf->tef", h, p["gate_up"]) + p["gate_up_bias"]
        gate, up = gate_up[..., ::2], gate_up[..., 1::2]                    # interleaved
        gate = gate.clamp(max=c.swiglu_limit)
        up = up.clamp(min=-c.swiglu_limit, max=c.swiglu_limit)
        glu = gate * torch.sigmoid(gate * c.swiglu_alpha)
        out = torch.einsum("tef,efh->teh", (up + 1) * glu, p["down"]) + p["down_bias"]
        picked = out.gather(1, chosen[..., None].expand(-1, -1, out.shape[-1]))  # [T, k, H]
        return (picked * weights[..., None]).sum(1)

    def post_attention(self, layer: int, x, attn):
        """The residual, the biased output projection and the MoE block."""
        p = self.layers[layer]
        x = x + attn.reshape(x.shape[0], -1).to(self.dtype) @ p["wo"] + p["bo"]
        return x + self.experts(layer, self.rms_norm(x, p["mlp_norm"]))

    def logits(self, x):
        return self.rms_norm(x, self.final_norm).float() @ self.lm_head


def main(argv=None) -> int:
    return decoder.main(argv, description=__doc__.split("\n")[0], presets=PRESETS,
                        make_model=Model)


if __name__ == "__main__":
    sys.exit(main())
