#!/usr/bin/env python3
"""One layer's round trip from Python through attnserve.flashinfer, by transport.

A decode step of --batch sequences over --kv_len keys each (page 16; the
server's geometry), the layout planned once (a server plan), then --iters
calls of BatchDecodeWithPagedKVCacheWrapper.run(q, kv_cache[0]) with q a
bf16 tensor on --device, each timed from the call until its output is ready
on the caller's stream (torch.cuda's current stream synchronized). Layer 0's
keys are written first (random, through append_paged_kv_cache and flush).
For each transport it prints the round trip (p50, mean, p99), the kernel
time (the server's /metrics: attention kernel per request), and the server's
stages per request (attnserve_request_stage_seconds, the queue wait and
attnserve_batch_stage_seconds), and writes them to --json.

  bench/flashinfer_layer.py --target 127.0.0.1:50051 --metrics 127.0.0.1:9464 \\
      --transports grpc,channel,cuda --device cuda --json layer.json
"""
import argparse
import json
import os
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from server_handling import KERNELS, SERVER, STAGES, delta, p50, scrape  # noqa: E402

import attnserve  # noqa: E402
import attnserve.flashinfer as fi  # noqa: E402


def fill(cache, batch, kv_len, device, seed):
    """Layer 0's keys of every sequence, random."""
    ps = cache.page_size
    per_seq = -(-kv_len // ps)
    indptr = torch.arange(batch + 1, dtype=torch.int32) * per_seq
    indices = torch.arange(batch * per_seq, dtype=torch.int32)
    last = torch.full((batch,), kv_len - (per_seq - 1) * ps, dtype=torch.int32)
    g = torch.Generator().manual_seed(seed)
    h, d = cache.num_kv_heads, cache.head_dim
    chunk = max(1, (4 << 20) // (kv_len * h * d * 2))   # about 4 MiB of K per flush
    for s0 in range(0, batch, chunk):
        s1 = min(batch, s0 + chunk)
        n = (s1 - s0) * kv_len
        k = torch.randn(n, h, d, generator=g).to(cache.dtype).to(device)
        v = torch.randn(n, h, d, generator=g).to(cache.dtype).to(device)
        bi = torch.arange(s0, s1, dtype=torch.int32).repeat_interleave(kv_len)
        pos = torch.arange(kv_len, dtype=torch.int32).repeat(s1 - s0)
        fi.append_paged_kv_cache(k, v, bi, pos, cache[0], indices, indptr, last)
        cache.flush(0)
    return indptr, indices, last


def one(client, metrics, transport, args):
    batch, kv_len = args.batch, args.kv_len
    ps = client.info().page_size
    pages = batch * -(-kv_len // ps)
    device = torch.device(args.device)
    with fi.PagedKVCache(client, pages, transport=transport, spin_us=args.spin_us) as cache:
        indptr, indices, last = fill(cache, batch, kv_len, device, args.seed)
        w = fi.BatchDecodeWithPagedKVCacheWrapper(cache)
        w.plan(indptr, indices, last, cache.num_qo_heads, cache.num_kv_heads, cache.head_dim,
               ps, q_data_type=cache.dtype, kv_data_type=cache.kv_dtype)
        q = (torch.randn(batch, cache.num_qo_heads, cache.head_dim) * 2).to(cache.dtype).to(device)
        sync = (lambda: torch.cuda.current_stream(device).synchronize()) \
            if device.type == "cuda" else (lambda: None)
        for _ in range(args.warmup):
            w.run(q, cache[0])
        sync()
        before = scrape(metrics)
        profile = None
        if args.profile:
            import cProfile
            profile = cProfile.Profile()
            profile.enable()
        times = []
        for _ in range(args.iters):
            t0 = time.perf_counter()
            w.run(q, cache[0])
            sync()
            times.append(time.perf_counter() - t0)
        if profile is not None:
            profile.disable()
        after = scrape(metrics)
        w.close()
    rt = np.array(times) * 1e3
    if profile is not None:
        import io
        import pstats
        text = io.StringIO()
        pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(30)
        with open(f"{args.profile}.{transport}.txt", "w") as f:
            f.write(text.getvalue())
    out = {"transport": transport, "spin_us": args.spin_us, "batch": batch, "kv_len": kv_len,
           "iters": args.iters,
           "round_trip_ms": {"p50": float(np.percentile(rt, 50)), "mean": float(rt.mean()),
                             "p99": float(np.percentile(rt, 99))}}
    server = delta(before, after, *SERVER)   # channel requests count as Prefills too
    n = server["count"] or args.iters
    kernel = max((delta(before, after, *k) for k in KERNELS), key=lambda d: d["count"])
    out["kernel_ms"] = kernel["sum"] / n * 1e3
    out["server_ms"] = {"mean": server["sum"] / n * 1e3 if server["count"] else None,
                        "p50": p50(server) * 1e3 if server["count"] else None,
                        "requests": server["count"]}
    out["stages_ms"] = {}
    for stage, name, label in STAGES:
        d = delta(before, after, name, label)
        out["stages_ms"][stage] = d["sum"] / n * 1e3
    out["p50_less_kernel_ms"] = out["round_trip_ms"]["p50"] - out["kernel_ms"]
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", default="127.0.0.1:50051")
    ap.add_argument("--metrics", default="127.0.0.1:9464")
    ap.add_argument("--transports", default="grpc,channel,cuda")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--kv_len", type=int, default=4096)
    ap.add_argument("--iters", type=int, default=300)
    ap.add_argument("--warmup", type=int, default=30)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--spin_us", type=float, default=50,
                    help="PagedKVCache's spin_us: how long a call polls for its answer before "
                         "it sleeps (channel and cuda transports)")
    ap.add_argument("--profile", help="cProfile the timed calls into PROFILE.TRANSPORT.txt "
                                      "(the 30 functions with the most own time)")
    ap.add_argument("--json")
    args = ap.parse_args()
    client = attnserve.Client(args.target, timeout=120)
    results = []
    for t in args.transports.split(","):
        r = one(client, args.metrics, t, args)
        results.append(r)
        st = " ".join(f"{k} {v:.3f}" for k, v in r["stages_ms"].items())
        print(f"{t}: round trip p50 {r['round_trip_ms']['p50']:.3f} mean "
              f"{r['round_trip_ms']['mean']:.3f} p99 {r['round_trip_ms']['p99']:.3f} ms; kernel "
              f"{r['kernel_ms']:.3f}; p50 - kernel {r['p50_less_kernel_ms']:.3f}; server "
              f"{r['server_ms']}; stages {st}", flush=True)
    client.close()
    if args.json:
        json.dump(results, open(args.json, "w"), indent=1)


if __name__ == "__main__":
    main()
