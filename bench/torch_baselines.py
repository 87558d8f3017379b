#!/usr/bin/env python3
"""PyTorch SDPA baselines (cuDNN and FlashAttention-2) on the shapes of
attnserve_kernel_bench: 32 query heads, 4 KV heads, head_dim 128, bf16,
causal aligned bottom-right, dense contiguous K/V.

How each case is run is printed in the `how` column:
  * q_len == kv_len: SDPA is_causal=True (top-left == bottom-right), GQA via
    enable_gqa=True.
  * q_len == 1: every key is visible, SDPA without a mask, enable_gqa=True.
  * otherwise (prefix): cuDNN gets an explicit boolean bottom-right mask
    (attn_mask, enable_gqa=True); FA2 runs through
    torch.ops.aten._flash_attention_forward(is_causal=True), which is
    bottom-right aligned and what causal_lower_right dispatches to, with GQA
    native (K/V keep 4 heads).
If a call fails, the next fallback is K/V repeat_interleave'd to 32 heads.
FLOPs: 4 * head_dim * num_qo_heads * visible (query, key) pairs (ANCHORS.md).
Timing: CUDA events, warm-up, median of repeats.
"""
import argparse
import statistics
import sys

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
import torch.nn.functional as F

H, KVH, D = 32, 4, 128


def visible_pairs(q_len, kv_len):
    return sum(min(kv_len, max(0, i + kv_len - q_len + 1)) for i in range(q_len))


# queued=True: a ~50 us spin kernel runs ahead of the start event, so the
# events and the call are queued behind busy work and their difference is the
# device time alone, without the host's launch latency (the way a call runs
# inside a stream of work); queued=False times an idle device, host launch
# latency included (the way one lone call runs).
SPIN_CYCLES = 100_000


def time_ms(fn, reps, queued=False):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a = torch.cuda.Event(enable_timing=True)
        b = torch.cuda.Event(enable_timing=True)
        if queued:
            torch.cuda._sleep(SPIN_CYCLES)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def candidates(backend, q, k, v, q_len, kv_len):
    """Yields (how, fn) in order of preference."""
    scale = 1.0 / D ** 0.5
    kr = k.repeat_interleave(H // KVH, dim=1)
    vr = v.repeat_interleave(H // KVH, dim=1)
    be = SDPBackend.CUDNN_ATTENTION if backend == "cudnn" else SDPBackend.FLASH_ATTENTION

    def sdpa(how, k, v, mask=None, causal=False, gqa=False):
        def fn():
            with sdpa_kernel([be]):
                return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=scale,
                                                      enable_gqa=gqa)
        return how, fn

    if q_len == kv_len:
        yield sdpa("is_causal, enable_gqa", k=k, v=v, causal=True, gqa=True)
        yield sdpa("is_causal, repeat_interleave", k=kr, v=vr, causal=True)
    elif q_len == 1:
        yield sdpa("no mask (q_len 1), enable_gqa", k=k, v=v, gqa=True)
        yield sdpa("no mask (q_len 1), repeat_interleave", k=kr, v=vr)
    else:
        if backend == "fa2":
            qt, kt, vt = (x.transpose(1, 2).contiguous() for x in (q, k, v))

            def fa2():
                return torch.ops.aten._flash_attention_forward(qt, kt, vt, None, None, q_len, kv_len, 0.0, True,
                                                               False, scale=scale)
            yield "_flash_attention_forward is_causal (bottom-right), GQA native", fa2
            from torch.nn.attention.bias import causal_lower_right
            bias = causal_lower_right(q_len, kv_len)
            yield sdpa("causal_lower_right, repeat_interleave", k=kr, v=vr, mask=bias)
        else:
            i = torch.arange(q_len, device=q.device)[:, None]
            j = torch.arange(kv_len, device=q.device)[None, :]
            mask = j <= i + (kv_len - q_len)
            yield sdpa("bool mask bottom-right, enable_gqa", k=k, v=v, mask=mask, gqa=True)
            yield sdpa("bool mask bottom-right, repeat_interleave", k=kr, v=vr, mask=mask)


def run(name, batch, q_len, kv_len, reps, queued=False):
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(batch, H, q_len, D, device="cuda", dtype=torch.bfloat16, generator=g)
    k = torch.randn(batch, KVH, kv_len, D, device="cuda", dtype=torch.bfloat16, generator=g)
    v = torch.randn(batch, KVH, kv_len, D, device="cuda", dtype=torch.bfloat16, generator=g)
    flops = 4.0 * D * H * batch * visible_pairs(q_len, kv_len)
    kv_bytes = 2.0 * batch * kv_len * KVH * D * 2
    for backend in ("cudnn", "fa2"):
        result = None
        errors = []
        for how, fn in candidates(backend, q, k, v, q_len, kv_len):
            try:
                ms = time_ms(fn, reps)
                result = (how, ms, time_ms(fn, reps, queued=True) if queued else None)
                break
            except Exception as e:  # noqa: BLE001 - try the next way
                errors.append(f"{how}: {type(e).__name__}: {str(e).splitlines()[0][:120]}")
        if result is None:
            print(f"TORCH backend={backend} workload={name} ms=nan tflops=nan kv_tbs=nan how=\"failed: "
                  f"{' | '.join(errors)}\"")
        else:
            how, ms, ms_queued = result
            extra = f" ms_queued={ms_queued:.4f}" if ms_queued is not None else ""
            print(f"TORCH backend={backend} workload={name} ms={ms:.4f} tflops={flops / ms / 1e9:.1f} "
                  f"kv_tbs={kv_bytes / ms / 1e9:.2f}{extra} how=\"{how}\"")
        sys.stdout.flush()
    del q, k, v
    torch.cuda.empty_cache()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    reps = 5 if args.quick else 20
    print(f"torch {torch.__version__}, cuDNN {torch.backends.cudnn.version()}, {torch.cuda.get_device_name()}")
    for name, b, ql, kl in [("long", 1, 16384, 16384), ("batch", 16, 2048, 2048), ("prefix", 32, 512, 4096),
                            ("decode", 64, 1, 4096)]:
        run(name, b, ql, kl, reps)
    for ln in (512, 1024, 2048, 4096, 8192, 16384):
        run(f"sweep_len{ln}", 16384 // ln, ln, ln, reps)


if __name__ == "__main__":
    main()
