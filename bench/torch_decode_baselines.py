#!/usr/bin/env python3
"""PyTorch SDPA baselines (cuDNN and flash backends) on the decode shapes of
attnserve_decode_bench: 32 query heads, 4 KV heads, head_dim 128, bf16,
dense contiguous K/V (no paging), causal aligned bottom-right.

The shapes and how each call is made come from torch_baselines.py (same
directory): q_len 1 runs SDPA without a mask (every key is visible) with
enable_gqa=True; q_len 4 (speculative) gives cuDNN an explicit bottom-right
boolean mask with enable_gqa=True and runs flash through
torch.ops.aten._flash_attention_forward(is_causal=True), which is bottom-right
aligned, with GQA native. When a call fails the fallback repeats K/V to 32
heads (repeat_interleave); the `how` column of each TORCH line says which
way ran. kv_tbs = K/V bytes (2 * batch * kv_len * 4 * 128 * 2) / time.
ms times each call on an idle device (host launch latency included);
ms_queued times it queued behind a spin kernel (device time alone), as
attnserve_decode_bench reports both.

Usage: bench/torch_decode_baselines.py [--quick] [--only=NAME,...]
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch  # noqa: E402

import torch_baselines  # noqa: E402

# name, batch, q_len, kv_len (attnserve_decode_bench's workloads).
SHAPES = [
    ("decode_b64", 64, 1, 4096),
    ("decode_b128", 128, 1, 4096),
    ("decode_b256", 256, 1, 4096),
    ("decode_b8_128k", 8, 1, 131072),
    ("decode_b1", 1, 1, 4096),
    ("spec_b64_q4", 64, 4, 4096),
]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--only", default="", help="comma-separated shape names (default: all)")
    args = ap.parse_args()
    names = [n for n in args.only.split(",") if n]
    unknown = [n for n in names if n not in {s[0] for s in SHAPES}]
    if unknown:
        ap.error(f"--only: unknown shape {unknown[0]!r}; the shapes are {', '.join(s[0] for s in SHAPES)}")
    reps = 10 if args.quick else 50
    print(f"torch {torch.__version__}, cuDNN {torch.backends.cudnn.version()}, {torch.cuda.get_device_name()}")
    for name, b, ql, kl in SHAPES:
        if names and name not in names:
            continue
        torch_baselines.run(name, b, ql, kl, reps, queued=True)


if __name__ == "__main__":
    main()
