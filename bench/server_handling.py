#!/usr/bin/env python3
"""The server's own handling of decode-shaped Prefills over gRPC, by stage.

Runs attnbench (decode: --batch sequences x 1 query row, --kv_len keys each,
the layout registered once as a step plan, one request at a time) against an
attnserve it starts, and prints from /metrics, per request, the mean of each
stage (attnserve_request_stage_seconds, attnserve_queue_wait_seconds,
attnserve_batch_stage_seconds), the kernel time, and the server's whole
handling (attnserve_request_duration_seconds) with and without the kernel,
mean and p50 (the p50 interpolated within the histogram's power-of-two
buckets, so good to about a bucket's width).

Usage: bench/server_handling.py BIN_DIR [--backend=cpu] [--kv_len=64]
       [--requests=3000] [--runs=3] [--warmup=200] [--server_args="..."] [--json=PATH]

On the CPU backend the kernel runs on the host, so `wait` there is the kernel;
the other stages are the same code as on the CUDA backend's edge and core
(the CUDA backend's submit and finish pack and unpack through pinned staging
instead).
"""
import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from serving import GEOMETRY, start  # noqa: E402

STAGES = [("parse", 'attnserve_request_stage_seconds', 'stage="parse"'),
          ("admit", 'attnserve_request_stage_seconds', 'stage="admit"'),
          ("queue", 'attnserve_queue_wait_seconds', None),
          ("submit", 'attnserve_batch_stage_seconds', 'stage="submit"'),
          ("wait", 'attnserve_batch_stage_seconds', 'stage="wait"'),
          ("unpack", 'attnserve_batch_stage_seconds', 'stage="unpack"'),
          ("finish", 'attnserve_batch_stage_seconds', 'stage="finish"'),
          ("respond", 'attnserve_request_stage_seconds', 'stage="respond"'),
          ("send", 'attnserve_request_stage_seconds', 'stage="send"')]
SERVER = ('attnserve_request_duration_seconds', 'method="Prefill",shape="decode"')
KERNELS = [('attnserve_kernel_duration_seconds', 'kernel="attention_prefill"'),
           ('attnserve_kernel_duration_seconds', 'kernel="attention_decode"')]


def scrape(metrics):
    """{(name, label): {"sum", "count", "buckets": [(le, cumulative)]}}"""
    body = urllib.request.urlopen(f"http://{metrics}/metrics", timeout=10).read().decode()
    out = {}
    for line in body.splitlines():
        m = re.match(r'(\w+)_(sum|count|bucket)(?:\{(.*)\})? (\S+)$', line)
        if not m:
            continue
        name, kind, labels, value = m.group(1), m.group(2), m.group(3) or "", float(m.group(4))
        le = None
        if kind == "bucket":
            lm = re.search(r'le="([^"]+)"', labels)
            le = float(lm.group(1)) if lm else None
            labels = re.sub(r',?le="[^"]+"', "", labels)
        entry = out.setdefault((name, labels), {"sum": 0.0, "count": 0.0, "buckets": []})
        if kind == "bucket":
            entry["buckets"].append((le, value))
        else:
            entry[kind] = value
    return out


def series(snap, name, label):
    for (n, labels), e in snap.items():
        if n == name and (label is None or label in labels):
            return e
    return {"sum": 0.0, "count": 0.0, "buckets": []}


def delta(before, after, name, label):
    a, b = series(after, name, label), series(before, name, label)
    bb = dict(b["buckets"])
    return {"sum": a["sum"] - b["sum"], "count": a["count"] - b["count"],
            "buckets": [(le, c - bb.get(le, 0.0)) for le, c in a["buckets"]]}


def p50(d):
    """Median from cumulative buckets, linear within the bucket."""
    n = d["count"]
    if not n:
        return None
    lo_le, lo_c = 0.0, 0.0
    for le, c in sorted(d["buckets"]):
        if c >= n / 2:
            if le == float("inf"):
                return lo_le
            return lo_le + (le - lo_le) * (n / 2 - lo_c) / max(c - lo_c, 1e-12)
        lo_le, lo_c = le, c
    return None


def one_run(args, bin_dir, tmp, run):
    metrics = "127.0.0.1:19464"
    target = "127.0.0.1:50151"
    cmd = [f"{bin_dir}/attnserve", f"--backend={args.backend}", "--num_layers=1",
           f"--num_pages={max(1024, args.batch * (args.kv_len // 16 + 2))}",
           f"--listen={target}", f"--metrics_listen={metrics}"] + GEOMETRY + args.server_args.split()
    server, _ = start(cmd, f"{tmp}/server{run}.log", r"listening grpc=")
    try:
        bench = [f"{bin_dir}/attnbench", f"--target={target}", "--workload=decode",
                 f"--batch={args.batch}", f"--kv_len={args.kv_len}", "--concurrency=1", "--plan"]
        # Warm-up (the plan, the connection, the allocator), then the measured run.
        subprocess.run(bench + [f"--requests={args.warmup}"], check=True, capture_output=True)
        before = scrape(metrics)
        res = subprocess.run(bench + [f"--requests={args.requests}", f"--json={tmp}/b{run}.json"],
                             check=True, capture_output=True, text=True)
        after = scrape(metrics)
    finally:
        server.terminate()
        server.wait()
    client = json.load(open(f"{tmp}/b{run}.json"))
    out = {"client_mean_ms": None, "client_p50_ms": None}
    lat = client.get("latency_ms") or client
    for key, name in (("mean", "client_mean_ms"), ("p50", "client_p50_ms")):
        if isinstance(lat, dict) and key in lat:
            out[name] = lat[key]
    server_d = delta(before, after, *SERVER)
    n = server_d["count"]
    for stage, name, label in STAGES:
        d = delta(before, after, name, label)
        out[stage] = d["sum"] / n * 1e3 if n else None
    # The CPU backend's attention counts as the prefill family's, the CUDA
    # decode family's as attention_decode: whichever ran.
    kernel = max((delta(before, after, *k) for k in KERNELS), key=lambda d: d["count"])
    out["kernel"] = kernel["sum"] / n * 1e3 if n else None
    out["server_mean"] = server_d["sum"] / n * 1e3 if n else None
    out["server_p50"] = p50(server_d) * 1e3 if n else None
    out["server_less_kernel_mean"] = out["server_mean"] - out["kernel"]
    # The kernel's p50 from its own histogram: p50(server) - p50(kernel)
    # is the handling's p50 when the kernel's spread is small.
    out["kernel_p50"] = p50(kernel) * 1e3 if kernel["count"] else None
    out["server_less_kernel_p50"] = out["server_p50"] - (out["kernel_p50"] or 0.0)
    out["requests"] = n
    out["client"] = {k: client[k] for k in client if "latency" in k or k in ("p50_ms", "mean_ms")}
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("bin_dir")
    ap.add_argument("--backend", default="cpu")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--kv_len", type=int, default=64)
    ap.add_argument("--requests", type=int, default=3000)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=200, help="requests before the measured ones")
    ap.add_argument("--server_args", default="")
    ap.add_argument("--json")
    args = ap.parse_args()
    tmp = tempfile.mkdtemp(prefix="attnserve-handling-")
    runs = [one_run(args, os.path.abspath(args.bin_dir), tmp, r) for r in range(args.runs)]
    cols = [s for s, _, _ in STAGES] + ["kernel", "server_mean", "server_less_kernel_mean",
                                        "server_p50", "server_less_kernel_p50"]
    print(f"decode {args.batch} x 1 row over {args.kv_len} keys, step plan, backend "
          f"{args.backend}, {args.requests} requests x {args.runs} runs; ms per request")
    print("| run | " + " | ".join(cols) + " |")
    print("|---" * (len(cols) + 1) + "|")
    for i, r in enumerate(runs):
        print(f"| {i + 1} | " + " | ".join(f"{r[c]:.3f}" for c in cols) + " |")
    print("| median | " + " | ".join(f"{statistics.median(r[c] for r in runs):.3f}" for c in cols)
          + " |")
    print("client:", [r["client"] for r in runs])
    if args.json:
        json.dump({"args": vars(args), "runs": runs}, open(args.json, "w"), indent=1)


if __name__ == "__main__":
    main()
