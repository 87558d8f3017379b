#!/usr/bin/env python3
"""Where one decode layer's gRPC round trip from Python goes.

The layer of bench/flashinfer_layer.py (a decode step of --batch sequences
over --kv_len keys, BatchDecodeWithPagedKVCacheWrapper.run over gRPC with
the tensors inline), taken apart, each part timed --iters times on its own
(p50, ms):
  info      GetServerInfo through the raw stub: an empty call's round trip
  q_to_host q (on --device) to host memory, as the request builder copies it
  build     the Prefill request's bytes (q's copy included)
  call      the raw stub call with those bytes: gRPC both ways and the server
  parse     the response bytes to output and LSE tensors on --device
  to_device output-sized bytes to --device alone
  run       the whole run() with the output ready on the caller's stream
  server    the server's own time per request (/metrics), kernel included
Then cProfile over --profile_iters run() calls: the functions with the most
time of their own (--profile writes the table).

  bench/python_grpc_breakdown.py --target 127.0.0.1:50051 --metrics 127.0.0.1:9464 \\
      --device cuda --json breakdown.json --profile profile.txt
"""
import argparse
import cProfile
import io
import json
import os
import pstats
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from flashinfer_layer import fill  # noqa: E402
from server_handling import SERVER, delta, p50, scrape  # noqa: E402

import attnserve  # noqa: E402
import attnserve.flashinfer as fi  # noqa: E402


def timed(fn, iters, sync):
    out = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        sync()
        out.append(time.perf_counter() - t0)
    return float(np.percentile(np.array(out) * 1e3, 50))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", default="127.0.0.1:50051")
    ap.add_argument("--metrics", default="127.0.0.1:9464")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--kv_len", type=int, default=4096)
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--profile_iters", type=int, default=200)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json")
    ap.add_argument("--profile")
    args = ap.parse_args()
    device = torch.device(args.device)
    sync = (lambda: torch.cuda.current_stream(device).synchronize()) \
        if device.type == "cuda" else (lambda: None)
    client = attnserve.Client(args.target, timeout=120)
    ps = client.info().page_size
    pages = args.batch * -(-args.kv_len // ps)
    res = {"batch": args.batch, "kv_len": args.kv_len, "device": str(device),
           "grpcio": __import__("grpc").__version__,
           "protobuf": __import__("google.protobuf").protobuf.__version__}
    with fi.PagedKVCache(client, pages, transport="grpc") as cache:
        indptr, indices, last = fill(cache, args.batch, args.kv_len, device, args.seed)
        w = fi.BatchDecodeWithPagedKVCacheWrapper(cache)
        w.plan(indptr, indices, last, cache.num_qo_heads, cache.num_kv_heads, cache.head_dim,
               ps, q_data_type=cache.dtype, kv_data_type=cache.kv_dtype)
        q = (torch.randn(args.batch, cache.num_qo_heads, cache.head_dim) * 2).to(
            cache.dtype).to(device)
        grpc_t = cache._grpc
        captured = []
        submit = grpc_t.submit
        grpc_t.submit = lambda r: (captured.append(r), submit(r))[1]
        for _ in range(20):
            w.run(q, cache[0])
        sync()
        grpc_t.submit = submit
        r = captured[-1]
        rpc = cache.rpc

        def build():
            return rpc._req_prefill(r.layer, r.q, r.layout, r.k, r.v, "torch", r.q.device, None,
                                    r.options)
        method, body, parse = build()
        stub = rpc._stubs[method]
        info_body = rpc._req_info()[1]
        raw = stub(body, timeout=60, metadata=rpc._metadata)
        out_bytes = bytearray(len(raw))
        res["request_bytes"], res["response_bytes"] = len(body), len(raw)
        t = {}
        t["info"] = timed(lambda: rpc._stubs["GetServerInfo"](info_body, timeout=60,
                                                                metadata=rpc._metadata),
                          args.iters, lambda: None)
        t["q_to_host"] = timed(lambda: q.detach().to("cpu"), args.iters, lambda: None)
        t["build"] = timed(build, args.iters, lambda: None)
        before = scrape(args.metrics)
        t["call"] = timed(lambda: stub(body, timeout=60, metadata=rpc._metadata), args.iters,
                          lambda: None)
        after = scrape(args.metrics)
        server = delta(before, after, *SERVER)
        n = server["count"] or args.iters
        t["server_mean"] = server["sum"] / n * 1e3
        t["server_p50"] = p50(server) * 1e3 if server["count"] else None
        t["parse"] = timed(lambda: parse(raw), args.iters, sync)
        t["to_device"] = timed(lambda: torch.frombuffer(out_bytes, dtype=torch.uint8).to(device),
                               args.iters, sync)
        t["run"] = timed(lambda: w.run(q, cache[0]), args.iters, sync)
        res["p50_ms"] = t
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(args.profile_iters):
            w.run(q, cache[0])
            sync()
        prof.disable()
        w.close()
    client.close()
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(35)
    if args.profile:
        with open(args.profile, "w") as f:
            f.write(s.getvalue())
    print(" ".join(f"{k} {v:.3f}" for k, v in t.items() if v is not None), "ms (p50);",
          f"request {res['request_bytes']} B, response {res['response_bytes']} B;",
          f"grpcio {res['grpcio']}, protobuf {res['protobuf']}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
