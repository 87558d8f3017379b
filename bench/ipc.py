#!/usr/bin/env python3
"""CUDA IPC regions end to end (issue #16 targets; docs/transport.md).

A torch client on GPU 0 keeps every tensor in CUDA regions (K/V for WriteKV,
q, the output and the LSE) of a CUDA server on GPU 1 (GPU 0 when only one is
visible), through the Python client (attnserve.regions.register_cuda_tensor):

  decode64    64 sequences x 1 query over 4,096 keys, 32/4 heads, head_dim
              128, bf16, page_size 16: p50 of the Prefill call
  prefill16k  one 16,384-row causal prefill over its own 16,384 keys
              (128 MiB of q in, 128 MiB of output out): p50

Each case is checked first against a float64 computation of sampled rows
(numpy), then timed. The kernel time per request comes from the server's
/metrics (attention + merge + append), and the server's own time per request
from attnserve_request_duration_seconds, so the table splits the latency
into kernel, server and client (Python gRPC) parts. Writes OUT/ipc.md and
OUT/ipc.json; exit code 1 when a check fails.

Usage: bench/ipc.py INSTALL_DIR OUT_DIR [--smoke]
  --smoke  small shapes (and the CPU-side checks) for a quick run
"""
import argparse
import json
import os
import re
import subprocess
import sys
import time
import urllib.request

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "client", "python"))

import torch  # noqa: E402

import attnserve  # noqa: E402
from attnserve.regions import register_cuda_tensor  # noqa: E402

HEADS, KV_HEADS, DIM, PAGE = 32, 4, 128, 16


def start_server(bin_dir, out, device, num_pages):
    log_path = os.path.join(out, "ipc_server.log")
    cmd = [f"{bin_dir}/attnserve", "--listen=127.0.0.1:0", "--metrics_listen=127.0.0.1:0",
           "--backend=cuda", f"--device={device}", "--allow_shared_memory",
           "--max_region_bytes_per_tenant=17179869184",
           f"--num_qo_heads={HEADS}", f"--num_kv_heads={KV_HEADS}", f"--head_dim={DIM}",
           "--kv_dtype=bf16", f"--page_size={PAGE}", "--num_layers=1", f"--num_pages={num_pages}"]
    log = open(log_path, "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    for _ in range(1200):
        time.sleep(0.05)
        m = re.search(r"listening grpc=(\S+) metrics=(\S+)", open(log_path).read())
        if m:
            return proc, m.group(1), m.group(2)
        if proc.poll() is not None:
            break
    sys.exit(f"attnserve did not start; see {log_path}:\n{open(log_path).read()[-3000:]}")


def scrape(metrics):
    body = urllib.request.urlopen(f"http://{metrics}/metrics", timeout=10).read().decode()
    out = {"kernel": 0.0, "server": 0.0, "requests": 0.0, "cuda_in": 0.0, "cuda_out": 0.0}
    for line in body.splitlines():
        m = re.match(r'attnserve_kernel_duration_seconds_sum\{kernel="(attention|merge|append)"\} (\S+)', line)
        if m:
            out["kernel"] += float(m.group(2))
        m = re.match(r'attnserve_request_duration_seconds_(sum|count)\{method="Prefill",shape="\w+"\} (\S+)', line)
        if m:
            out["server" if m.group(1) == "sum" else "requests"] += float(m.group(2))
        m = re.match(r'attnserve_transfer_bytes_total\{direction="(in|out)",path="cuda"\} (\S+)', line)
        if m:
            out["cuda_" + m.group(1)] = float(m.group(2))
    return out


def reference_rows(q, rows, keys_of_row):
    """float64 attention of the sampled rows: (o [n, H, D], lse base 2 [n, H])."""
    group = HEADS // KV_HEADS
    o = np.zeros((len(rows), HEADS, DIM))
    lse = np.zeros((len(rows), HEADS))
    scale = 1.0 / np.sqrt(DIM)
    for i, r in enumerate(rows):
        ks, vs = keys_of_row(r)
        for h in range(HEADS):
            s = (ks[:, h // group, :] @ q[r, h]) * scale
            m = s.max()
            w = np.exp(s - m)
            o[i, h] = (w[:, None] * vs[:, h // group, :]).sum(0) / w.sum()
            lse[i, h] = (m + np.log(w.sum())) / np.log(2.0)
    return o, lse


def check(name, o, lse, o_ref, lse_ref):
    err = np.linalg.norm(o - o_ref) / np.linalg.norm(o_ref)
    lse_err = np.abs(lse - lse_ref).max()
    ok = err < 1e-2 and lse_err < 1e-3 and np.isfinite(o).all()
    print(f"check {name}: output rel err {err:.2e}, lse max abs err {lse_err:.2e}: "
          f"{'ok' if ok else 'WRONG'}", flush=True)
    return ok


def to64(t):
    return t.float().cpu().numpy().astype(np.float64)


def timed(fn, iters):
    lat = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        lat.append(time.perf_counter() - t0)
    return np.array(lat)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("install")
    ap.add_argument("out")
    ap.add_argument("--smoke", action="store_true")
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    bin_dir = os.path.join(os.path.abspath(a.install), "bin")
    n_dev = torch.cuda.device_count()
    if n_dev == 0:
        sys.exit("no GPU")
    server_dev = 1 if n_dev >= 2 else 0
    seqs, kv_len, long_q = (8, 512, 1024) if a.smoke else (64, 4096, 16384)
    decode_pages = seqs * kv_len // PAGE
    long_pages = long_q // PAGE
    proc, target, metrics = start_server(bin_dir, a.out, server_dev, decode_pages + long_pages + 8)
    results = {"client_device": 0, "server_device": server_dev,
               "devices": [torch.cuda.get_device_name(i) for i in range(n_dev)]}
    ok = True
    regions = []
    try:
        client = attnserve.Client(target, timeout=600)
        dev = torch.device("cuda:0")
        torch.cuda.set_device(dev)
        gen = torch.Generator(device=dev).manual_seed(16)

        def reg(name, t):
            regions.append(name)
            return register_cuda_tensor(client, name, t)

        pages = client.allocate_pages(decode_pages + long_pages)
        # K/V of every page, from CUDA regions, in chunks of 64k rows.
        rows = len(pages) * PAGE
        k = torch.randn(rows, KV_HEADS, DIM, generator=gen, device=dev).to(torch.bfloat16)
        v = torch.randn(rows, KV_HEADS, DIM, generator=gen, device=dev).to(torch.bfloat16)
        k_ref, v_ref = reg("k", k), reg("v", v)
        torch.cuda.synchronize()
        slots = (np.repeat(np.array(pages, np.int64) * PAGE, PAGE) +
                 np.tile(np.arange(PAGE, dtype=np.int64), len(pages)))
        chunk = 65536
        t0 = time.perf_counter()
        for at in range(0, rows, chunk):
            n = min(chunk, rows - at)
            kr = attnserve.RegionTensor("k", k_ref.offset + at * KV_HEADS * DIM * 2, (n, KV_HEADS, DIM), "bf16")
            vr = attnserve.RegionTensor("v", v_ref.offset + at * KV_HEADS * DIM * 2, (n, KV_HEADS, DIM), "bf16")
            client.write_kv(0, slots[at:at + n], kr, vr)
        write_s = time.perf_counter() - t0
        results["write_kv"] = {"rows": rows, "seconds": write_s,
                               "GB_per_s": 2 * rows * KV_HEADS * DIM * 2 / write_s / 1e9}
        print(f"write_kv of {rows} rows from CUDA regions: {write_s * 1e3:.1f} ms", flush=True)

        # decode64: sequence s holds pages [s * per, (s + 1) * per).
        per = kv_len // PAGE
        q = torch.randn(seqs, HEADS, DIM, generator=gen, device=dev).to(torch.bfloat16)
        o = torch.empty_like(q)
        lse = torch.empty(seqs, HEADS, dtype=torch.float32, device=dev)
        qo = np.arange(seqs + 1, dtype=np.int32)
        kv_indptr = np.arange(seqs + 1, dtype=np.int32) * per
        kv_indices = np.array(pages[:decode_pages], np.int32)
        last = np.full(seqs, PAGE, np.int32)
        out = (reg("d_o", o), reg("d_lse", lse))
        q_region = reg("d_q", q)
        torch.cuda.synchronize()

        def decode():
            client.prefill(0, q_region, qo, kv_indptr, kv_indices, last, output_to=out)

        decode()
        sample = list(range(0, seqs, max(1, seqs // 8)))
        o_ref, lse_ref = reference_rows(
            to64(q), sample,
            lambda s: (to64(k[s * kv_len:(s + 1) * kv_len]), to64(v[s * kv_len:(s + 1) * kv_len])))
        ok &= check("decode64", to64(o)[sample], to64(lse)[sample], o_ref, lse_ref)
        before = scrape(metrics)
        iters = 50 if a.smoke else 300
        lat = timed(decode, iters)
        after = scrape(metrics)
        n_req = after["requests"] - before["requests"]
        results["decode64"] = {
            "iters": iters, "p50_ms": float(np.percentile(lat, 50) * 1e3),
            "p90_ms": float(np.percentile(lat, 90) * 1e3), "min_ms": float(lat.min() * 1e3),
            "kernel_ms": (after["kernel"] - before["kernel"]) / n_req * 1e3,
            "server_ms": (after["server"] - before["server"]) / n_req * 1e3}

        # One long causal prefill over its own keys (sequence = the last pages).
        q = torch.randn(long_q, HEADS, DIM, generator=gen, device=dev).to(torch.bfloat16)
        o = torch.empty_like(q)
        lse = torch.empty(long_q, HEADS, dtype=torch.float32, device=dev)
        qo = np.array([0, long_q], np.int32)
        kv_indptr = np.array([0, long_pages], np.int32)
        kv_indices = np.array(pages[decode_pages:], np.int32)
        last = np.array([PAGE], np.int32)
        out = (reg("p_o", o), reg("p_lse", lse))
        q_region = reg("p_q", q)
        torch.cuda.synchronize()

        def prefill():
            client.prefill(0, q_region, qo, kv_indptr, kv_indices, last, output_to=out)

        prefill()
        base = decode_pages * PAGE
        sample = [0, 1, 777, long_q // 2, long_q - 2, long_q - 1]
        o_ref, lse_ref = reference_rows(
            to64(q), sample,
            lambda r: (to64(k[base:base + r + 1]), to64(v[base:base + r + 1])))
        ok &= check("prefill16k", to64(o)[sample], to64(lse)[sample], o_ref, lse_ref)
        before = scrape(metrics)
        iters = 5 if a.smoke else 20
        lat = timed(prefill, iters)
        after = scrape(metrics)
        n_req = after["requests"] - before["requests"]
        results["prefill16k"] = {
            "iters": iters, "bytes_each_way": long_q * HEADS * DIM * 2,
            "p50_ms": float(np.percentile(lat, 50) * 1e3), "min_ms": float(lat.min() * 1e3),
            "kernel_ms": (after["kernel"] - before["kernel"]) / n_req * 1e3,
            "server_ms": (after["server"] - before["server"]) / n_req * 1e3}
        m = scrape(metrics)
        results["cuda_transfer_bytes"] = {"in": m["cuda_in"], "out": m["cuda_out"]}
        for name in regions:
            client.unregister_region(name)
        regions.clear()
        if client.list_regions():
            print("WRONG: regions left after unregistering", flush=True)
            ok = False
    finally:
        proc.terminate()
        proc.wait(timeout=30)

    results["ok"] = bool(ok)
    json.dump(results, open(os.path.join(a.out, "ipc.json"), "w"), indent=1)
    lines = [f"CUDA IPC regions: client {results['devices'][0]} (GPU 0), server GPU {server_dev}",
             "", "| case | p50 ms | kernel ms | server ms | p50 - kernel ms | target |",
             "|---|---|---|---|---|---|"]
    targets = {"decode64": "<= kernel + 0.12 (goal + 0.06)", "prefill16k": "<= 12 (goal 8)"}
    for case in ("decode64", "prefill16k"):
        r = results[case]
        lines.append(f"| {case} | {r['p50_ms']:.3f} | {r['kernel_ms']:.3f} | {r['server_ms']:.3f} | "
                     f"{r['p50_ms'] - r['kernel_ms']:.3f} | {targets[case]} |")
    lines.append("")
    lines.append(f"WriteKV from CUDA regions: {results['write_kv']['GB_per_s']:.1f} GB/s; "
                 f"checks {'passed' if ok else 'FAILED'}")
    text = "\n".join(lines) + "\n"
    open(os.path.join(a.out, "ipc.md"), "w").write(text)
    print(text)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
