#!/usr/bin/env python3
"""PyTorch baselines for the MLA issue's workloads, beside attnserve_mla_bench.

Absorbed MLA over a dense latent cache (no pages), bf16, as a model written
with matmuls computes it: scores = q . cache (576 wide) * scale, softmax,
out = p @ cache[..., :512]. Decode runs the batch as two batched matmuls;
prefill runs torch's scaled_dot_product_attention per sequence (the 128
heads share the one latent head through expand; a value width of 512 beside
a key width of 576), causal. Also the device copy ceiling of the latent
bytes. Times are CUDA events around each call after warm-up, the median of
20. FLOPs and bytes are counted as attnserve_mla_bench counts them.

  bench/mla_torch.py [--only decode_h128,prefill_h128]
Prints one "TORCH workload=... ms=... tflops=... latent_tbps=..." line each.
"""
import argparse

import torch

WORKLOADS = [
    # name, batch, q_len, kv_len, heads
    ("decode_h128", 64, 1, 4096, 128),
    ("decode_h16", 64, 1, 4096, 16),
    ("prefill_h128", 8, 4096, 4096, 128),
]


def timed(fn, reps=20, warmup=5):
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for i in range(warmup + reps):
        torch.cuda.synchronize()
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        if i >= warmup:
            times.append(start.elapsed_time(stop))
    times.sort()
    return times[len(times) // 2]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", default="")
    args = ap.parse_args()
    only = set(filter(None, args.only.split(",")))
    dev = torch.device("cuda")
    scale = 0.0722
    for name, batch, q_len, kv_len, heads in WORKLOADS:
        if only and name not in only:
            continue
        cache = torch.randn(batch, kv_len, 576, device=dev, dtype=torch.bfloat16) * 0.5
        q = torch.randn(batch, heads, q_len, 576, device=dev, dtype=torch.bfloat16) * 0.5
        if q_len == 1:
            def run():
                s = torch.matmul(q[:, :, 0, :], cache.transpose(1, 2)).float() * scale
                p = torch.softmax(s, dim=-1).to(torch.bfloat16)
                return torch.matmul(p, cache[:, :, :512])
            pairs = batch * kv_len
        else:
            def run():
                out = []
                for b in range(batch):
                    k = cache[b].view(1, 1, kv_len, 576).expand(1, heads, kv_len, 576)
                    v = cache[b, :, :512].view(1, 1, kv_len, 512).expand(1, heads, kv_len, 512)
                    out.append(torch.nn.functional.scaled_dot_product_attention(
                        q[b:b + 1], k, v, is_causal=True, scale=scale))
                return out
            pairs = batch * (q_len * (q_len + 1) // 2)
        ms = timed(run)
        flops = 2.0 * (576 + 512) * heads * pairs
        latent = batch * kv_len * 1152
        copy = torch.empty_like(cache)
        copy_ms = timed(lambda: copy.copy_(cache))
        print(f"TORCH workload={name} ms={ms:.4f} tflops={flops / ms / 1e9:.1f} "
              f"latent_tbps={latent / ms / 1e9:.3f} copy_tbps={2 * latent / copy_ms / 1e9:.3f}",
              flush=True)


if __name__ == "__main__":
    main()
