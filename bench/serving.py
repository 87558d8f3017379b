#!/usr/bin/env python3
"""End-to-end serving benchmark: attnbench against attnserve and attnecho.

For each case the same attnbench run goes once against attnecho (the
transport floor: same API, same payload sizes, no compute) and once against
attnserve; the server's /metrics give the device time of its kernels. Each
row then splits attnserve's p50 into

    end-to-end = transport floor + kernel time + server overhead

where the transport floor is attnecho's p50, the kernel time is the mean
device time per request of the attention, merge and append launches, and the
overhead is what is left.

Usage: bench/serving.py INSTALL_DIR OUT_DIR [--quick] [--backend=cuda]
INSTALL_DIR holds bin/attnserve, bin/attnecho, bin/attnbench (and lib/).
Writes OUT_DIR/serving.md (the table), OUT_DIR/*.json (attnbench results, for
bench/plot.py) and OUT_DIR/*.log.
"""
import argparse
import json
import os
import re
import subprocess
import sys
import time
import urllib.request

GEOMETRY = ["--num_qo_heads=32", "--num_kv_heads=4", "--head_dim=128", "--kv_dtype=bf16",
            "--page_size=16"]


def start(cmd, log_path, pattern):
    log = open(log_path, "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    for _ in range(600):
        time.sleep(0.05)
        text = open(log_path).read()
        m = re.search(pattern, text)
        if m:
            return proc, m
        if proc.poll() is not None:
            break
    sys.exit(f"{cmd[0]} did not start; see {log_path}:\n{open(log_path).read()}")


def scrape(metrics):
    """Sums and counts of the histograms that split a request's time."""
    body = urllib.request.urlopen(f"http://{metrics}/metrics", timeout=10).read().decode()
    out = {}
    for line in body.splitlines():
        m = re.match(r'attnserve_kernel_duration_seconds_(sum|count)\{kernel="(\w+)"\} (\S+)', line)
        if m:
            out[(m.group(2), m.group(1))] = float(m.group(3))
        m = re.match(r'attnserve_batch_stage_seconds_(sum|count)\{stage="(\w+)"\} (\S+)', line)
        if m:
            out[("stage_" + m.group(2), m.group(1))] = float(m.group(3))
        # Prefills of both shapes (decode, prefill) add up.
        m = re.match(r'attnserve_request_duration_seconds_(sum|count)\{method="Prefill",shape="\w+"\} (\S+)', line)
        if m:
            out[("server", m.group(1))] = out.get(("server", m.group(1)), 0.0) + float(m.group(2))
        m = re.match(r'attnserve_request_stage_seconds_(sum|count)\{stage="(\w+)"\} (\S+)', line)
        if m:
            out[("rstage_" + m.group(2), m.group(1))] = float(m.group(3))
        m = re.match(r"attnserve_(batch_requests|queue_wait_seconds)_(sum|count) (\S+)", line)
        if m:
            out[(m.group(1), m.group(2))] = float(m.group(3))
    return out


def bench(bin_dir, target, args, json_path, log_path):
    cmd = [f"{bin_dir}/attnbench", f"--target={target}", f"--json={json_path}"] + args
    with open(log_path, "w") as log:
        rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT).returncode
    if rc != 0:
        print(f"attnbench failed ({rc}): {' '.join(cmd)}\n{open(log_path).read()[-2000:]}")
        return None
    return json.load(open(json_path))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("install")
    ap.add_argument("out")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--backend", default="cuda")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes, to check the script on a CPU")
    ap.add_argument("--delays", default="0,200", help="extra --max_queue_delay_us values for decode1_c64")
    a = ap.parse_args()
    a.delays = [int(x) for x in a.delays.split(",") if x]
    bin_dir = os.path.join(os.path.abspath(a.install), "bin")
    os.makedirs(a.out, exist_ok=True)
    dur = "2" if a.quick else "5"

    def start_server(extra):
        proc, m = start([f"{bin_dir}/attnserve", f"--backend={a.backend}", "--listen=127.0.0.1:0",
                         "--metrics_listen=127.0.0.1:0", "--num_layers=2", "--num_pages=40000"]
                        + GEOMETRY + extra,
                        os.path.join(a.out, f"attnserve{'_'.join([''] + extra)}.log".replace("--", "")),
                        r"listening grpc=(\S+) metrics=(\S+)")
        return proc, m.group(1), m.group(2)

    serve, serve_addr, metrics = start_server([])
    echo, m = start([f"{bin_dir}/attnecho", "--listen=127.0.0.1:0", "--num_layers=2"] + GEOMETRY,
                    os.path.join(a.out, "attnecho.log"), r"listening grpc=(\S+)")
    echo_addr = m.group(1)
    # The same floor, answered from a worker thread as attnserve does.
    echo_w, m = start([f"{bin_dir}/attnecho", "--listen=127.0.0.1:0", "--num_layers=2",
                       "--respond_from_worker"] + GEOMETRY,
                      os.path.join(a.out, "attnecho_worker.log"), r"listening grpc=(\S+)")
    echo_w_addr = m.group(1)

    cases = [
        # name, attnbench args
        ("decode64_c1", ["--workload=decode", "--batch=64", "--kv_len=4096", "--concurrency=1",
                         f"--duration_s={dur}"]),
        ("decode1_c1", ["--workload=decode", "--batch=1", "--kv_len=4096", "--concurrency=1",
                        f"--duration_s={dur}"]),
        ("decode1_c4", ["--workload=decode", "--batch=1", "--kv_len=4096", "--concurrency=4",
                        f"--duration_s={dur}"]),
        ("decode1_c16", ["--workload=decode", "--batch=1", "--kv_len=4096", "--concurrency=16",
                         f"--duration_s={dur}"]),
        ("decode1_c64", ["--workload=decode", "--batch=1", "--kv_len=4096", "--concurrency=64",
                         f"--duration_s={dur}"]),
        ("long_c1", ["--workload=prefill", "--batch=1", "--q_len=16384", "--concurrency=1",
                     "--requests=4" if a.quick else "--requests=12", "--duration_s=120"]),
    ]
    if a.smoke:
        cases = [(n, [x.replace("4096", "256").replace("16384", "64").replace("=64", "=4")
                      .replace("=12", "=2").replace("=5", "=1") for x in args]) for n, args in cases]
    def measure(name, args, addr, metrics_addr, tag):
        before = scrape(metrics_addr) if metrics_addr else {}
        extra = [f"--metrics={metrics_addr}"] if metrics_addr else []
        res = bench(bin_dir, addr, args + extra, os.path.join(a.out, f"{name}_{tag}.json"),
                    os.path.join(a.out, f"{name}_{tag}.log"))
        after = scrape(metrics_addr) if metrics_addr else {}
        return res, {k: after.get(k, 0) - before.get(k, 0) for k in after}

    rows = []
    for name, args in cases:
        floor, _ = measure(name, args, echo_addr, None, "echo")
        floor_w = None
        if name.endswith("_c1"):
            floor_w, _ = measure(name, args, echo_w_addr, None, "echo_worker")
        res, d = measure(name, args, serve_addr, metrics, a.backend)
        if floor is None or res is None:
            rows.append((name, None))
            continue
        requests = d.get(("batch_requests", "sum"), 0) or 1
        batches = d.get(("batch_requests", "count"), 0) or 1
        kernel_s = sum(d.get((k, "sum"), 0)
                       for k in ("attention_prefill", "attention_decode", "merge", "append"))
        stages = {st: d.get(("stage_" + st, "sum"), 0) / batches * 1e3
                  for st in ("submit", "wait", "unpack", "finish")}
        rows.append((name, dict(floor=floor, floor_w=floor_w, res=res,
                                kernel_ms=kernel_s / requests * 1e3,
                                server_ms=d.get(("server", "sum"), 0) / max(d.get(("server", "count"), 0), 1) * 1e3,
                                queue_ms=d.get(("queue_wait_seconds", "sum"), 0) / max(d.get(("queue_wait_seconds", "count"), 0), 1) * 1e3,
                                stages=stages, per_launch=requests / batches)))
        print(name, "done", flush=True)

    # The many-clients case under other batching delays (server restarted).
    delay_rows = []
    for delay in ([] if a.smoke else a.delays):
        proc, addr, maddr = start_server([f"--max_queue_delay_us={delay}"])
        args = dict(cases)["decode1_c64"]
        res, d = measure(f"decode1_c64_delay{delay}", args, addr, maddr, a.backend)
        proc.terminate()
        proc.wait(timeout=30)
        if res is not None:
            b = d.get(("batch_requests", "count"), 0) or 1
            delay_rows.append((delay, res, d.get(("batch_requests", "sum"), 0) / b))

    # Verified passes (every response against the float64 reference): the
    # 64-sequence request alone, and many single-sequence clients batched.
    vkv = "--kv_len=256" if a.smoke else "--kv_len=4096"
    verify = []
    for vname, vargs in (("verify_decode64", ["--batch=64", "--concurrency=1", "--requests=8"]),
                         ("verify_decode1_c16", ["--batch=1", "--concurrency=16", "--requests=400"])):
        res = bench(bin_dir, serve_addr, ["--workload=decode", vkv, "--verify"] + vargs,
                    os.path.join(a.out, f"{vname}.json"), os.path.join(a.out, f"{vname}.log"))
        verify.append((vname, res))

    for proc in (serve, echo, echo_w):
        proc.terminate()
        proc.wait(timeout=30)

    lines = ["| case | clients | attnserve req/s | p50 ms | p99 ms | floor p50 ms | floor p99 ms | "
             "floor req/s | kernel ms/request | overhead ms (p50 - floor - kernel) | overhead % of e2e | "
             "requests/launch |", "|" + "---|" * 12]
    for name, r in rows:
        if r is None:
            lines.append(f"| {name} | failed |")
            continue
        f, s = r["floor"], r["res"]
        e2e, fl = s["latency_ms"]["p50"], f["latency_ms"]["p50"]
        over = e2e - fl - r["kernel_ms"]
        lines.append(
            f"| {name} | {s['concurrency']} | {s['requests_per_s']:.1f} | {e2e:.3f} | "
            f"{s['latency_ms']['p99']:.3f} | {fl:.3f} | {f['latency_ms']['p99']:.3f} | "
            f"{f['requests_per_s']:.1f} | {r['kernel_ms']:.4f} | {over:.3f} | "
            f"{100 * over / e2e:.1f} | {r['per_launch']:.2f} |")
    lines += ["", "Inside the server (means; stages per batch, from /metrics):", "",
              "| case | handler ms/request (arrival to Finish) | queue wait ms | submit ms | wait ms | "
              "unpack ms | finish ms | floor p50 answered from a worker thread ms |",
              "|" + "---|" * 8]
    for name, r in rows:
        if r is None:
            continue
        st = r["stages"]
        fw = f"{r['floor_w']['latency_ms']['p50']:.3f}" if r["floor_w"] else "-"
        lines.append(f"| {name} | {r['server_ms']:.3f} | {r['queue_ms']:.3f} | {st['submit']:.3f} | "
                     f"{st['wait']:.3f} | {st['unpack']:.3f} | {st['finish']:.3f} | {fw} |")
    if delay_rows:
        lines += ["", "decode1_c64 by --max_queue_delay_us:", "",
                  "| max_queue_delay_us | req/s | p50 ms | p99 ms | requests/launch |", "|---|---|---|---|---|"]
        lines.append(f"| default (above) | {dict(rows)['decode1_c64']['res']['requests_per_s']:.1f} | "
                     f"{dict(rows)['decode1_c64']['res']['latency_ms']['p50']:.3f} | "
                     f"{dict(rows)['decode1_c64']['res']['latency_ms']['p99']:.3f} | "
                     f"{dict(rows)['decode1_c64']['per_launch']:.2f} |" if dict(rows).get('decode1_c64') else "")
        for delay, res, per in delay_rows:
            lines.append(f"| {delay} | {res['requests_per_s']:.1f} | {res['latency_ms']['p50']:.3f} | "
                         f"{res['latency_ms']['p99']:.3f} | {per:.2f} |")
    lines.append("")
    for vname, res in verify:
        if res is None:
            lines.append(f"{vname}: attnbench failed (see {vname}.log)")
        else:
            lines.append(f"{vname}: {res['ok']} OK of {res['requests']}, wrong results "
                         f"{res['wrong_results']}, errors {res['errors']}")
    table = "\n".join(lines)
    open(os.path.join(a.out, "serving.md"), "w").write(table + "\n")
    print(table)


if __name__ == "__main__":
    main()
