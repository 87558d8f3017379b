#!/usr/bin/env python3
"""Transport benchmark: how tensors reach the server, each path in one run.

For decode64 (64 sequences x 1 row over 4,096 keys: 512 KiB of queries in,
520 KiB out) and one 16k-row prefill (128 MiB each way) it measures, on one
host over loopback:

  tcp_echo          the same byte counts over one raw TCP connection (the floor)
  attnecho          the API with no compute, gRPC tuned and untuned
  attnserve inline  the server, gRPC tuned and untuned (--transport_tuning)
  attnserve shm     q, output and LSE in a system region, a memfd (attnbench --shm)
  attnserve channel the same, and the request sent through a request channel
                    in that region instead of a gRPC call (attnbench --channel)
  attnserve cuda    q, output and LSE in a CUDA region on GPU 0 of the client,
                    the server on GPU 1 (attnbench --shm --cuda_device=0; only
                    with two GPUs visible, or --cuda-regions): device-to-device
                    copies over NVLink, by gRPC call and through a channel
  settings          each path under SETTINGS below (tuned, gRPC defaults, ...)

and prints one table (also OUT/transport.md). The kernel time per request
comes from the server's /metrics; "p50 - kernel" is what the transport and
the server add.

Usage: bench/transport.py INSTALL_DIR OUT_DIR [--backend=cuda] [--smoke] [--before=DIR]

--before=DIR also runs attnserve inline (tuned) from another install, e.g.
the previous commit's, in the same run: the code's before and after.
"""
import argparse
import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from serving import GEOMETRY, bench, scrape, start  # noqa: E402

DECODE64 = ["--workload=decode", "--batch=64", "--kv_len=4096", "--concurrency=1"]
LONG = ["--workload=prefill", "--batch=1", "--q_len=16384", "--concurrency=1", "--duration_s=120"]
# gRPC settings compared in one run (client and server alike): the tuned
# set (common/transport.h, the default) and gRPC's own defaults. (Two more
# sets, a fixed 64 MiB window without BDP probing and a 1 MiB initial window,
# were measured on 2026-12-01 and are no better: bench/results.)
SETTINGS = [
    ("tuned (default)", ["--transport_tuning=true"]),
    ("gRPC defaults", ["--transport_tuning=false"]),
]
# Where a request's time goes in the server: mean ms per request of each
# stage (attnserve_request_stage_seconds, attnserve_queue_wait_seconds,
# attnserve_batch_stage_seconds), in the order a request meets them.
STAGES = [("parse", "rstage_parse"), ("admit", "rstage_admit"), ("queue", "queue_wait_seconds"),
          ("submit", "stage_submit"), ("wait", "stage_wait"), ("unpack", "stage_unpack"),
          ("finish", "stage_finish"), ("respond", "rstage_respond"), ("send", "rstage_send")]


def visible_gpus():
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return 0
    return sum(1 for line in out.splitlines() if line.startswith("GPU "))


def kernel_ms(before, after):
    d = {k: after.get(k, 0) - before.get(k, 0) for k in after}
    requests = d.get(("batch_requests", "sum"), 0) or 1
    return sum(d.get((k, "sum"), 0) for k in ("attention", "merge", "append")) / requests * 1e3


def stage_means(before, after):
    """Mean ms per request of each stage, and of the server's whole handling."""
    d = {k: after.get(k, 0) - before.get(k, 0) for k in after}
    out = {}
    for name, key in STAGES + [("server", "server")]:
        n = d.get((key, "count"), 0)
        out[name] = d.get((key, "sum"), 0) / n * 1e3 if n else None
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("install")
    ap.add_argument("out")
    ap.add_argument("--backend", default="cuda")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes, to check the script on a CPU")
    ap.add_argument("--before", default="", help="another install to run attnserve inline from")
    ap.add_argument("--no-echo", action="store_true", help="skip attnecho (the gRPC floor)")
    ap.add_argument("--tuned-only", action="store_true",
                    help="skip the gRPC-defaults server and attnecho under gRPC's defaults")
    ap.add_argument("--cuda-regions", choices=["auto", "on", "off"], default="auto",
                    help="the CUDA-region server (client GPU 0, server GPU 1; auto: with two GPUs)")
    a = ap.parse_args()
    bin_dir = os.path.join(os.path.abspath(a.install), "bin")
    os.makedirs(a.out, exist_ok=True)
    decode, long_ = list(DECODE64), list(LONG)
    dur, long_n, echo_iters = "--duration_s=4", "--requests=8", "0"
    if a.smoke:
        decode = [x.replace("4096", "256").replace("=64", "=4") for x in decode]
        long_ = [x.replace("16384", "64") for x in long_]
        dur, long_n, echo_iters = "--duration_s=1", "--requests=2", "50"
    rows = []  # (case, path, setting, result json, kernel ms)
    lines = []

    # The raw TCP floor, same byte counts.
    q_bytes = 64 * 32 * 128 * 2
    cases = f"{q_bytes}:{q_bytes + 64 * 32 * 4},134217728:{134217728 + 16384 * 32 * 4}"
    if a.smoke:
        cases = "4096:4608,65536:73728"
    tcp = subprocess.run([f"{bin_dir}/tcp_echo", f"--cases={cases}", f"--iterations={echo_iters}"],
                         capture_output=True, text=True, timeout=120)
    open(os.path.join(a.out, "tcp_echo.log"), "w").write(tcp.stdout + tcp.stderr)
    lines += ["tcp_echo (raw TCP round trips over loopback, the floor):", "", tcp.stdout.strip(), ""]
    print(tcp.stdout, flush=True)

    def run(tag, target, args, extra):
        res = bench(bin_dir, target, args + extra, os.path.join(a.out, f"{tag}.json"),
                    os.path.join(a.out, f"{tag}.log"))
        print(tag, "done" if res else "FAILED", flush=True)
        return res

    # attnecho under each setting.
    for i, (setting, t) in enumerate([] if a.no_echo else SETTINGS[:1] if a.tuned_only else SETTINGS):
        echo, m = start([f"{bin_dir}/attnecho", "--listen=127.0.0.1:0", "--num_layers=2"] + t + GEOMETRY,
                        os.path.join(a.out, f"attnecho_{i}.log"), r"listening grpc=(\S+)")
        rows.append(("decode64", "attnecho (floor)", setting,
                     run(f"echo_decode64_{i}", m.group(1), decode + [dur], t), None))
        rows.append(("prefill 128 MiB", "attnecho (floor)", setting,
                     run(f"echo_long_{i}", m.group(1), long_ + [long_n], t), None))
        echo.terminate()
        echo.wait(timeout=30)

    # attnserve: inline under each setting; shm regions (default setting);
    # inline from the --before install.
    verify = []
    stages = []  # (case, path, setting, result json, stage means)
    # (install bin, index, setting, client+server flags, server-only flags)
    servers = [(bin_dir, i, setting, t, []) for i, (setting, t) in enumerate(SETTINGS)
               if not (a.tuned_only and i > 0)]
    # The batch worker polling 2 ms for the next request (--idle_spin_us)
    # instead of sleeping: decode only.
    spin = len(SETTINGS)
    # (The channels' pollers spin as long: --channel_spin_us.)
    servers.append((bin_dir, spin, "tuned, server --idle_spin_us=2000", SETTINGS[0][1],
                    ["--idle_spin_us=2000", "--channel_spin_us=2000"]))
    # CUDA regions: the client's tensors on GPU 0, the server on GPU 1 (the
    # last GPU when only one is visible), polling as the spin server does.
    cuda = spin + 1
    gpus = visible_gpus() if a.backend == "cuda" else 0
    if a.cuda_regions == "on" or (a.cuda_regions == "auto" and gpus >= 2):
        servers.append((bin_dir, cuda, "tuned, server --idle_spin_us=2000, on GPU 1", SETTINGS[0][1],
                        ["--idle_spin_us=2000", "--channel_spin_us=2000",
                         f"--device={min(1, max(gpus - 1, 0))}"]))
    if a.before:
        servers.append((os.path.join(os.path.abspath(a.before), "bin"), spin + 2,
                        "tuned, --before install", ["--transport_tuning=true"], []))
    for serve_bin, i, setting, t, server_only in servers:
        serve, m = start([f"{serve_bin}/attnserve", f"--backend={a.backend}", "--listen=127.0.0.1:0",
                          "--metrics_listen=127.0.0.1:0", "--num_layers=2", "--num_pages=40000",
                          "--allow_shared_memory"] + t + server_only + GEOMETRY,
                         os.path.join(a.out, f"attnserve_{i}.log"),
                         r"listening grpc=(\S+) metrics=(\S+)")
        addr, metrics = m.group(1), m.group(2)
        # --plan: the layout registered once (CreatePlan), as an engine's
        # per-layer requests of one step send it; decode only (a prefill's
        # layout is a few bytes).
        paths = [("inline", [], i != spin)]
        if i in (0, spin):
            paths += [("inline, plan", ["--plan"], False), ("system shm region", ["--shm"], i == 0),
                      ("system shm region, plan", ["--shm", "--plan"], False),
                      # No gRPC call per request: a request channel in the region.
                      ("system shm region, channel", ["--shm", "--channel"], i == 0),
                      ("system shm region, plan, channel", ["--shm", "--plan", "--channel"], False)]
        if i == cuda:
            on_gpu = ["--shm", "--cuda_device=0"]
            paths = [("CUDA region", on_gpu, True), ("CUDA region, plan", on_gpu + ["--plan"], False),
                     ("CUDA region, channel", on_gpu + ["--channel"], True),
                     ("CUDA region, plan, channel", on_gpu + ["--plan", "--channel"], False),
                     ("CUDA region, plan, channel, client --busy_poll",
                      on_gpu + ["--plan", "--channel", "--busy_poll"], False)]
        if i == spin:
            # The client polls for its responses too (attnbench --busy_poll).
            paths += [("inline, client --busy_poll", ["--busy_poll"], False),
                      ("inline, plan, client --busy_poll", ["--plan", "--busy_poll"], False),
                      ("system shm region, plan, client --busy_poll", ["--shm", "--plan", "--busy_poll"], False),
                      ("system shm region, plan, channel, client --busy_poll",
                       ["--shm", "--plan", "--channel", "--busy_poll"], False)]
        for path, flag, with_prefill in paths:
            cases = [("decode64", decode, dur)] + ([("prefill 128 MiB", long_, long_n)] if with_prefill else [])
            for case, args, n in cases:
                tag = f"serve_{'_'.join(f.strip('-') for f in flag) or 'inline'}_{case.split()[0]}_{i}"
                before = scrape(metrics)
                res = bench(serve_bin, addr, args + [n, f"--metrics={metrics}"] + flag + t,
                            os.path.join(a.out, f"{tag}.json"), os.path.join(a.out, f"{tag}.log"))
                print(tag, "done" if res else "FAILED", flush=True)
                after = scrape(metrics)
                rows.append((case, f"attnserve {path}", setting, res, kernel_ms(before, after)))
                stages.append((case, path, setting, res, stage_means(before, after)))
        checks = []
        if i == cuda:
            checks = (("verify_decode64_cuda_plan_channel", ["--shm", "--cuda_device=0", "--plan", "--channel"]),
                      ("verify_decode64_cuda", ["--shm", "--cuda_device=0"]),
                      ("verify_prefill_cuda", ["--shm", "--cuda_device=0"]),
                      ("verify_prefill_cuda_channel", ["--shm", "--cuda_device=0", "--channel"]))
        if i == 0:
            checks = (("verify_decode64_inline", []), ("verify_decode64_shm", ["--shm"]),
                      ("verify_decode64_shm_plan", ["--shm", "--plan"]),
                      ("verify_decode64_shm_plan_channel", ["--shm", "--plan", "--channel"]),
                      ("verify_prefill_inline", []), ("verify_prefill_shm", ["--shm"]),
                      ("verify_prefill_shm_channel", ["--shm", "--channel"]))
        for vname, vflag in checks:
            # A 1k-row prefill (8 MiB each way): the float64 reference of 16k rows takes too long.
            vargs = ([x.replace("16384", "1024") for x in long_] + ["--requests=2"]
                     if "prefill" in vname else decode + ["--requests=8"])
            res = run(vname, addr, vargs + ["--verify"] + vflag, t)
            verify.append((vname, res))
        serve.terminate()
        serve.wait(timeout=60)

    lines += ["| case | path | gRPC settings | p50 ms | p99 ms | req/s | kernel ms/request | "
              "p50 - kernel ms |", "|" + "---|" * 8]
    for case, path, setting, res, kms in rows:
        if res is None:
            lines.append(f"| {case} | {path} | {setting} | failed | | | | |")
            continue
        p50, p99 = res["latency_ms"]["p50"], res["latency_ms"]["p99"]
        k = f"{kms:.4f}" if kms is not None else "-"
        over = f"{p50 - kms:.3f}" if kms is not None else "-"
        lines.append(f"| {case} | {path} | {setting} | {p50:.3f} | {p99:.3f} | "
                     f"{res['requests_per_s']:.1f} | {k} | {over} |")
    lines.append("")
    lines += ["Where the time goes: mean ms per request by stage in the server (parse .. send; "
              "queue is the wait for the worker; submit, wait, unpack, finish are per batch, one "
              "request per batch here), the server's whole handling, and the client's mean "
              "latency less that (the client, gRPC and the network).", "",
              "| case | path | gRPC settings | " + " | ".join(n for n, _ in STAGES) +
              " | server | mean latency | client + gRPC |", "|" + "---|" * (len(STAGES) + 6)]
    for case, path, setting, res, st in stages:
        if res is None:
            continue
        mean = sum(res["latencies_ms"]) / len(res["latencies_ms"]) if res.get("latencies_ms") else None
        server = st["server"]
        rest = mean - server if mean is not None and server is not None else None
        cells = [st[n] for n, _ in STAGES] + [server, mean, rest]
        lines.append(f"| {case} | {path} | {setting} | " +
                     " | ".join("-" if c is None else f"{c:.3f}" for c in cells) + " |")
    lines.append("")
    for vname, res in verify:
        lines.append(f"{vname}: " + ("attnbench failed" if res is None else
                                     f"{res['ok']} OK of {res['requests']}, wrong results "
                                     f"{res['wrong_results']}, errors {res['errors']}"))
    table = "\n".join(lines)
    open(os.path.join(a.out, "transport.md"), "w").write(table + "\n")
    print(table)


if __name__ == "__main__":
    main()
