#!/usr/bin/env python3
"""Two servers (one per GPU) against one: what context parallelism and
placement over a cluster buy (docs/cluster.md).

  bench/cluster_bench.py --bin INSTALL/bin/attnserve --devices 0,1 [--json out.json]

Starts one attnserve per device (CUDA_VISIBLE_DEVICES=<device>, its own
ports, 1 layer, the default heads: 32 query and 4 KV heads of 128, bf16)
and measures:

(a) prefill (two fresh servers): one causal prefill of --prefill_len tokens
    (32k) attending to itself, on one server and spread over two. The
    two-server rows hold the keys [0, s) and [s, L), send every query to the
    first and the queries [s, L) to the second (the others see nothing
    there), with kv_keys_after so that the mask is the whole sequence's.
    Split points: the middle, and s = L(1 - 1/sqrt(2)), where the two
    servers' shares of the causal triangle's work are equal (what
    attnserve.Cluster does with split_min_tokens:
    attnserve.cluster.causal_spread). The kernels' critical path is max over
    servers of the device time their /metrics report for the request
    (attnserve_kernel_duration_seconds, every kernel). The merge of the two
    partial states of rows [s, L) is timed apart for each place it can run:
    numpy (attnserve.merge on float32 outputs), torch_cpu and torch_cuda
    (attnserve.merge on the CPU on float32 outputs, and on the client's GPU
    on the bf16 outputs; the host-to-device copy reported beside),
    server_cuda (the first server's MergeStates kernel on the bf16 states in
    CUDA regions on its GPU, cuda:0 of the client: one call, no tensor bytes),
    server_rpc (the first server's MergeStates, the states sent over gRPC and
    back; first repetition only).
    Each is added to the kernels' critical path and set against one GPU's
    kernel time: the issue's quantity. The merged output is checked against
    the one-server output (relative error). Last, the same prefill through
    attnserve.Cluster (split_min_tokens=L), K/V appended in the same
    Prefills, with numpy outputs and with torch outputs on the GPU: device
    time and wall time.
(b) decode: --seqs (128) sequences of --kv_len (4096) keys placed by
    attnserve.Cluster over one fresh server, then over two fresh servers
    (the same flags; --num_pages holds every sequence on one server four
    times over); --clients (32) processes, each with its own Cluster and
    --seqs / --clients of the sequences, decode one token per sequence per
    step (layout sent with each step, no server plans: one Prefill per server
    touched): --warmup seconds untimed, then --duration seconds timed.
    Reported: requests/s (a request is one client's step), Prefill RPCs/s,
    tokens/s, the step latency's p50 / p99, the client's time in plan() and
    its CPU per step, and per server over the timed window: Prefills, batches
    and requests per batch, kernel time per batch and device busy fraction,
    queue wait, time in the server per Prefill.

Ends with the scaling table of the run (the issue's targets).

With --backend cpu and small sizes it runs anywhere (a smoke test).
"""
import argparse
import json
import multiprocessing as mp
import os
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
import urllib.request

import numpy as np

sys.path.insert(0, __file__.rsplit("/bench/", 1)[0] + "/client/python")

_LISTENING = re.compile(r"listening grpc=(\S+) metrics=(\S+)")


class Server:
    """attnserve on one device, ports chosen by the server."""

    def __init__(self, binary, device, backend, num_pages, log_path):
        env = dict(os.environ)
        if device is not None:
            env["CUDA_VISIBLE_DEVICES"] = str(device)
        self.log = open(log_path, "w")
        self.proc = subprocess.Popen(
            [binary, "--listen=127.0.0.1:0", "--metrics_listen=127.0.0.1:0",
             f"--backend={backend}", "--num_layers=1", f"--num_pages={num_pages}",
             "--max_message_bytes=1073741824", "--allow_shared_memory"],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
        self.address = self.metrics = None
        deadline = time.monotonic() + 300
        for line in self.proc.stdout:
            self.log.write(line)
            m = _LISTENING.search(line)
            if m:
                self.address, self.metrics = m.group(1), m.group(2)
                break
            if time.monotonic() > deadline:
                break
        if self.address is None:
            raise RuntimeError(f"attnserve on device {device} did not start: see {log_path}")
        threading.Thread(target=self._drain, daemon=True).start()

    def _drain(self):
        for line in self.proc.stdout:
            self.log.write(line)

    def kernel_seconds(self) -> float:
        """Sum of attnserve_kernel_duration_seconds over every kernel (its
        values are disjoint)."""
        text = urllib.request.urlopen(f"http://{self.metrics}/metrics", timeout=30).read().decode()
        total = 0.0
        for line in text.splitlines():
            if line.startswith("attnserve_kernel_duration_seconds_sum"):
                total += float(line.rsplit(" ", 1)[1])
        return total

    def stop(self):
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def half_tensor(rng, shape):
    """Random bf16 values: a torch bf16 tensor when torch is there (sent as is)."""
    x = rng.standard_normal(shape, dtype=np.float32)
    try:
        import torch
        return torch.from_numpy(x).to(torch.bfloat16)
    except ImportError:
        return x


def as_f32(x):
    """float32 numpy of a numpy or torch tensor."""
    if hasattr(x, "detach"):
        return x.detach().to("cpu").float().numpy()
    return x


def sync():
    try:
        import torch
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    except ImportError:
        pass


def merge_methods(backend: str) -> list:
    """Where the client can merge: numpy always; torch on the CPU and on the
    client's GPU when torch (with CUDA) is there; the server's MergeStates
    kernel on states in CUDA regions (CUDA servers); the server's
    MergeStates with the states over gRPC."""
    out = ["numpy"]
    try:
        import torch
        out.append("torch_cpu")
        if torch.cuda.is_available():
            out.append("torch_cuda")
            if backend == "cuda":
                out.append("server_cuda")
    except ImportError:
        pass
    return out + ["server_rpc"]


def merge_all(methods, vs, ls, client, rpc):
    """Times the merge of two partial states (vs [n, h, d] bf16 torch or
    float32 numpy, ls [n, h]) each way; returns ({method: seconds}, merged
    float32 numpy of the first method). server_rpc (MergeStates on a server,
    states sent over gRPC and back) runs only when rpc is true."""
    from attnserve.merge import merge_states
    times, first = {}, None

    def as_torch(xs):  # float32 torch tensors on the CPU (the results may be numpy)
        import torch
        return [x if isinstance(x, torch.Tensor) else torch.from_numpy(np.ascontiguousarray(as_f32(x)))
                for x in xs]

    for m in methods:
        if m == "numpy":
            v_np = [np.asarray(as_f32(x)) for x in vs]   # what out="numpy" returns
            l_np = [np.asarray(as_f32(x)) for x in ls]
            t0 = time.perf_counter()
            o, _ = merge_states(v_np, l_np)
            times[m] = time.perf_counter() - t0
            del v_np
        elif m == "torch_cpu":
            vt, lt = as_torch(vs), as_torch(ls)
            t0 = time.perf_counter()
            o, _ = merge_states(vt, lt)
            times[m] = time.perf_counter() - t0
        elif m == "torch_cuda":
            import torch
            sync()
            t0 = time.perf_counter()
            # The states in bf16, as the servers return them (and as
            # attnserve.Cluster with out="torch" hands them over).
            vt, lt = [x.to(torch.bfloat16) for x in as_torch(vs)], as_torch(ls)
            sync()
            t0 = time.perf_counter()
            v_d = [x.to("cuda:0", non_blocking=False) for x in vt]
            l_d = [x.to("cuda:0") for x in lt]
            sync()
            t1 = time.perf_counter()
            o, _ = merge_states(v_d, l_d)
            sync()
            times[m] = time.perf_counter() - t1
            times[m + "_h2d"] = t1 - t0
            del v_d, l_d
        elif m == "server_cuda":
            # The first server's merge kernel (MergeStates, the same code as
            # the split-KV merge) on states in CUDA regions on its own GPU,
            # cuda:0 here: one MergeStates call that carries no tensor bytes,
            # as when the servers write their partial outputs into the
            # client's device memory.
            import torch
            from attnserve.regions import register_cuda_tensor
            v_d = [torch.from_numpy(np.ascontiguousarray(as_f32(x))).to(torch.bfloat16).to("cuda:0")
                   if not hasattr(x, "detach") else x.to("cuda:0", torch.bfloat16) for x in vs]
            l_d = [x.to("cuda:0") for x in as_torch(ls)]
            o_d, lo_d = torch.empty_like(v_d[0]), torch.empty_like(l_d[0])
            names = [f"merge-{i}-{time.monotonic_ns()}" for i in range(6)]
            refs = [register_cuda_tensor(client, n, t)
                    for n, t in zip(names, v_d + l_d + [o_d, lo_d])]
            try:
                sync()
                t0 = time.perf_counter()
                client.merge_states([(refs[0], refs[2]), (refs[1], refs[3])], into=(refs[4], refs[5]))
                times[m] = time.perf_counter() - t0
                o = o_d
            finally:
                for n in names:
                    client.unregister_region(n)
            del v_d, l_d
        elif m == "server_rpc":
            if client is None or not rpc:
                continue
            t0 = time.perf_counter()
            o, _ = client.merge_states(list(zip(vs, ls)))
            times[m] = time.perf_counter() - t0
        if first is None:
            first = np.asarray(as_f32(o))
        elif m in times:
            # Each other method against the first (bf16 rounding of the inputs and output).
            diff = np.asarray(as_f32(o)) - first
            times[m + "_err"] = float(np.linalg.norm(diff) / max(np.linalg.norm(first), 1e-30))
        del o
    return times, first


# ---------------------------------------------------------------- (a) prefill
def prefill_bench(a, servers, log):
    import attnserve
    from attnserve.merge import merge_states
    L = a.prefill_len
    clients = [attnserve.Client(s.address, timeout=600) for s in servers]
    g = clients[0].server_info
    ps = g.page_size
    rng = np.random.default_rng(0)
    q = half_tensor(rng, (L, g.num_qo_heads, g.head_dim))
    k = half_tensor(rng, (L, g.num_kv_heads, g.head_dim))
    v = half_tensor(rng, (L, g.num_kv_heads, g.head_dim))

    # Each server gets the keys of its range once (WriteKV); the prefill runs
    # over them. One server holds all of them too, for the single-GPU row.
    def load(client, lo, hi):
        n = hi - lo
        pages = client.allocate_pages(-(-n // ps))
        slots = np.array([pages[i // ps] * ps + i % ps for i in range(n)], dtype=np.int64)
        step = 8192
        for i in range(0, n, step):
            client.write_kv(0, slots[i:i + step], k[lo + i:lo + min(n, i + step)],
                            v[lo + i:lo + min(n, i + step)])
        return pages, n

    def run(client, server, pages, n, after, first_row=0, kind="numpy"):
        # The queries from first_row on (the rows before see nothing of a
        # range that starts there, as the cluster leaves them out).
        last = n - (len(pages) - 1) * ps
        before = server.kernel_seconds()
        t0 = time.perf_counter()
        r = client.prefill(0, q[first_row:], [0, L - first_row], [0, len(pages)], pages, [last],
                           kv_keys_after=[after], out=kind)
        wall = time.perf_counter() - t0
        return r, wall, server.kernel_seconds() - before

    results = {}
    whole_pages, _ = load(clients[0], 0, L)
    ref = None
    rows = []
    for rep in range(a.reps):
        r, wall, kern = run(clients[0], servers[0], whole_pages, L, 0)
        ref = np.asarray(as_f32(r.output)) if ref is None else ref
        rows.append((kern, wall))
    results["one_gpu"] = {"kernel_s": statistics.median(x for x, _ in rows),
                          "wall_s": statistics.median(y for _, y in rows)}
    print(f"(a) 1 GPU : kernel {results['one_gpu']['kernel_s'] * 1e3:8.2f} ms   "
          f"wall {results['one_gpu']['wall_s'] * 1e3:8.1f} ms", file=log, flush=True)
    clients[0].free_pages(whole_pages)

    from attnserve.cluster import causal_spread
    splits = {"even": L // 2, "balanced": causal_spread(L, 2)[0]}
    methods = merge_methods(a.backend)
    for name, s in splits.items():
        parts = [load(clients[0], 0, s), load(clients[1], s, L)]
        afters = [L - s, 0]
        rows = []
        for rep in range(a.reps):
            out = [None, None]

            def go(i):
                out[i] = run(clients[i], servers[i], parts[i][0], parts[i][1], afters[i],
                             0 if i == 0 else s, kind="torch" if "torch" in methods else "numpy")
            t0 = time.perf_counter()
            threads = [threading.Thread(target=go, args=(i,)) for i in range(2)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            t_kernels = time.perf_counter() - t0
            # Rows [0, s) come from the first server only; [s, L) are merged.
            vs = [out[0][0].output[s:], out[1][0].output]
            ls = [out[0][0].lse[s:], out[1][0].lse]
            times, merged = merge_all(methods, vs, ls, clients[0], rpc=rep == 0)
            o = np.asarray(as_f32(out[0][0].output))
            o[s:] = merged
            err = float(np.linalg.norm(o - ref) / np.linalg.norm(ref))
            rows.append((max(out[0][2], out[1][2]), out[0][2], out[1][2], times, t_kernels, err))
        med = lambda i: statistics.median(r[i] for r in rows)  # noqa: E731
        merge_s = {m: statistics.median(r[3][m] for r in rows if m in r[3])
                   for m in rows[0][3]}
        crit = med(0)
        r = results[f"two_gpus_{name}"] = {
            "split": s, "merged_rows": L - s, "kernel_critical_s": crit,
            "kernel_s": [med(1), med(2)], "merge_s": merge_s,
            "critical_path_s": {m: crit + t for m, t in merge_s.items()
                                if not m.endswith(("_h2d", "_err"))},
            "kernels_wall_s": med(4), "rel_error_vs_one_gpu": max(r[5] for r in rows)}
        one = results["one_gpu"]["kernel_s"]
        print(f"(a) 2 GPUs, {name:8s} split at {s:6d}: kernels {r['kernel_s'][0] * 1e3:8.2f} / "
              f"{r['kernel_s'][1] * 1e3:8.2f} ms, critical path {crit * 1e3:.2f} ms "
              f"({one / crit:.2f}x), wall of the two Prefills {r['kernels_wall_s'] * 1e3:.1f} ms, "
              f"rel error {r['rel_error_vs_one_gpu']:.2e}", file=log, flush=True)
        for m, t in merge_s.items():
            if m.endswith("_h2d") or m.endswith("_err"):
                continue
            extra = (f" (+ {merge_s[m + '_h2d'] * 1e3:.2f} ms host to device)"
                     if m + "_h2d" in merge_s else "")
            if m + "_err" in merge_s:
                extra += f", rel. difference to {methods[0]} {merge_s[m + '_err']:.1e}"
            print(f"      merge of {L - s} rows, {m:12s}: {t * 1e3:9.2f} ms{extra}; kernels + merge "
                  f"{(crit + t) * 1e3:9.2f} ms = {one / (crit + t):.2f}x one GPU", file=log,
                  flush=True)
        for c, (pages, _) in zip(clients, parts):
            c.free_pages(pages)
    for c in clients:
        c.close()

    # The same through attnserve.Cluster: the prompt's K/V appended in the
    # same Prefills, split by causal_spread, merged by the client.
    cluster = attnserve.Cluster([s.address for s in servers], split_min_tokens=L, timeout=600)
    outs = [("numpy", None)]
    if "torch_cuda" in methods:
        outs.append(("torch", "cuda:0"))
    for kind, device in outs:
        rows = []
        for rep in range(a.reps):
            before = [s.kernel_seconds() for s in servers]
            t0 = time.perf_counter()
            step = cluster.plan([rep], [L])
            t1 = time.perf_counter()
            r = cluster.run(0, q, k, v, step=step, out=kind, device=device)
            sync()
            wall = time.perf_counter() - t1
            kern = [s.kernel_seconds() - b for s, b in zip(servers, before)]
            err = float(np.linalg.norm(np.asarray(as_f32(r.output)) - ref) / np.linalg.norm(ref))
            rows.append((max(kern), wall, t1 - t0, err,
                         [sh.length for sh in cluster.shards_of(rep)]))
            cluster.finish(rep)
        key = "cluster" if kind == "numpy" else "cluster_torch_cuda"
        results[key] = {"out": kind, "device": device,
                        "kernel_critical_s": statistics.median(x[0] for x in rows),
                        "run_wall_s": statistics.median(x[1] for x in rows),
                        "plan_wall_s": statistics.median(x[2] for x in rows),
                        "rel_error_vs_one_gpu": max(x[3] for x in rows), "shards": rows[0][4]}
        r = results[key]
        print(f"(a) attnserve.Cluster (out={kind}{', ' + device if device else ''}), shards "
              f"{r['shards']}: kernels on the critical path {r['kernel_critical_s'] * 1e3:8.2f} "
              f"ms, run wall {r['run_wall_s'] * 1e3:8.1f} ms (plan {r['plan_wall_s'] * 1e3:.1f} "
              f"ms), rel error {r['rel_error_vs_one_gpu']:.2e}", file=log, flush=True)
    cluster.close()
    return results


# ---------------------------------------------------------------- (b) decode
_SAMPLE = re.compile(r'^([a-z_]+)(\{[^}]*\})? (\S+)$')


def metrics_snapshot(server) -> dict:
    """{name or name{method=...}: value} of the counters and histogram sums
    and counts the decode table uses, summed over other labels."""
    text = urllib.request.urlopen(f"http://{server.metrics}/metrics", timeout=30).read().decode()
    out = {}
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if not m:
            continue
        name, labels, value = m.group(1), m.group(2) or "", float(m.group(3))
        if name in ("attnserve_requests_total", "attnserve_request_duration_seconds_sum",
                    "attnserve_request_duration_seconds_count"):
            meth = re.search(r'method="([^"]+)"', labels)
            if not meth or meth.group(1) != "Prefill":
                continue
        elif name not in ("attnserve_kernel_duration_seconds_sum",
                          "attnserve_batch_requests_sum", "attnserve_batch_requests_count",
                          "attnserve_queue_wait_seconds_sum", "attnserve_queue_wait_seconds_count"):
            continue
        out[name] = out.get(name, 0.0) + value
    return out


def server_window(before: dict, after: dict, seconds: float) -> dict:
    d = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    batches = d.get("attnserve_batch_requests_count", 0.0)
    prefills = d.get("attnserve_request_duration_seconds_count", 0.0)
    waits = d.get("attnserve_queue_wait_seconds_count", 0.0)
    return {
        "prefills_per_s": prefills / seconds,
        "batches_per_s": batches / seconds,
        "requests_per_batch": d.get("attnserve_batch_requests_sum", 0.0) / batches if batches else 0,
        "kernel_ms_per_batch": 1e3 * d.get("attnserve_kernel_duration_seconds_sum", 0.0) / batches
        if batches else 0,
        "device_busy": d.get("attnserve_kernel_duration_seconds_sum", 0.0) / seconds,
        "queue_wait_ms": 1e3 * d.get("attnserve_queue_wait_seconds_sum", 0.0) / waits if waits else 0,
        "server_ms_per_prefill": 1e3 * d.get("attnserve_request_duration_seconds_sum", 0.0) /
        prefills if prefills else 0,
    }


def decode_bench(a, servers, label, log):
    """Every client process: --seqs / --clients sequences of --kv_len keys,
    then --warmup seconds of steps, then --duration seconds timed. A client
    request is one step: one token for each of its sequences (the same
    request in both configurations; over two servers it is one Prefill per
    server touched, sent at once)."""
    targets = [s.address for s in servers]
    per = a.seqs // a.clients
    ctx = mp.get_context("spawn")  # no gRPC state shared with the children
    queue = ctx.Queue()
    start = ctx.Value("d", 0.0)     # set once every client is ready
    procs = []
    for i in range(a.clients):
        ids = list(range(i * per, (i + 1) * per))
        p = ctx.Process(target=_decode_run, args=(targets, ids, a.kv_len, a.warmup, a.duration,
                                                  start, queue))
        p.start()
        procs.append(p)
    ready = 0
    while ready < a.clients:
        kind, payload = queue.get(timeout=600)
        if kind == "error":
            raise RuntimeError(f"a decode client failed: {payload}")
        ready += kind == "ready"
    start.value = time.time() + 0.5
    # The servers' counters over the timed window (after the warmup).
    time.sleep(max(0.0, start.value + a.warmup - time.time()))
    before = [metrics_snapshot(s) for s in servers]
    time.sleep(max(0.0, start.value + a.warmup + a.duration - time.time()))
    after = [metrics_snapshot(s) for s in servers]
    results = []
    while len(results) < a.clients:
        kind, payload = queue.get(timeout=600)
        if kind == "error":
            raise RuntimeError(f"a decode client failed: {payload}")
        if kind == "done":
            results.append(payload)
    for p in procs:
        p.join(timeout=60)
    lat = sorted(x for r in results for x in r[0])
    steps = len(lat)
    prefills = sum(r[1] for r in results)
    servers_used = sorted({s for r in results for s in r[2][1]})
    per_server = [server_window(b, e, a.duration) for b, e in zip(before, after)]
    out = {"servers": len(servers), "clients": a.clients, "seqs": a.seqs, "kv_len": a.kv_len,
           "seqs_per_request": per,
           "requests_per_s": steps / a.duration, "prefills_per_s": prefills / a.duration,
           "tokens_per_s": steps * per / a.duration,
           "p50_ms": lat[len(lat) // 2] * 1e3 if lat else None,
           "p99_ms": lat[min(len(lat) - 1, int(len(lat) * 0.99))] * 1e3 if lat else None,
           "kv_len_at_end": max(r[3] for r in results),
           # Where a client's step goes: plan() (pages, layout) and its own CPU
           # time (process time: serializing, converting; not waiting).
           "client_plan_ms_per_step": 1e3 * sum(r[4] for r in results) / max(steps, 1),
           "client_cpu_ms_per_step": 1e3 * sum(r[5] for r in results) / max(steps, 1),
           "servers_used": servers_used, "per_server": per_server}
    print(f"(b) {label}: {out['requests_per_s']:8.1f} requests/s ({per} sequences each), "
          f"{out['prefills_per_s']:8.1f} Prefill RPCs/s, {out['tokens_per_s']:9.1f} tokens/s, "
          f"p50 {out['p50_ms']:.2f} ms, p99 {out['p99_ms']:.2f} ms, keys at the end <= "
          f"{out['kv_len_at_end']} (servers used {servers_used}); per step a client spends "
          f"{out['client_plan_ms_per_step']:.2f} ms in plan() and {out['client_cpu_ms_per_step']:.2f} "
          f"ms of its own CPU", file=log, flush=True)
    for i, w in enumerate(per_server):
        print(f"      server {i}: {w['prefills_per_s']:.1f} Prefills/s in {w['batches_per_s']:.1f} "
              f"batches/s ({w['requests_per_batch']:.1f} requests each, kernels "
              f"{w['kernel_ms_per_batch']:.3f} ms/batch, device busy {w['device_busy'] * 100:.1f}%), "
              f"queue wait {w['queue_wait_ms']:.2f} ms, in the server {w['server_ms_per_prefill']:.2f} "
              f"ms/Prefill", file=log, flush=True)
    return out


def _decode_run(targets, ids, kv_len, warmup, duration, start_value, queue):
    """One client process: its sequences' prompts, then decode steps from the
    common start time: `warmup` seconds untimed, `duration` seconds timed, or
    until the sequences reach 4 x kv_len keys (the room --num_pages gives them
    by default; a fast server could otherwise outgrow the cache)."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # 32 clients share the host's cores
    try:
        import attnserve
        try:
            import torch
            torch.set_num_threads(1)
        except ImportError:
            pass
        c = attnserve.Cluster(targets, timeout=600, server_plans=False)
        g = c.server_info
        rng = np.random.default_rng(ids[0])
        for done in range(0, kv_len, 1024):  # the prompts, in chunks of 1024 tokens
            step = c.plan(ids, [min(1024, kv_len - done)] * len(ids))
            n = step.total_q
            c.run(0, half_tensor(rng, (n, g.num_qo_heads, g.head_dim)),
                  half_tensor(rng, (n, g.num_kv_heads, g.head_dim)),
                  half_tensor(rng, (n, g.num_kv_heads, g.head_dim)))
        q = half_tensor(rng, (len(ids), g.num_qo_heads, g.head_dim))
        kv = half_tensor(rng, (len(ids), g.num_kv_heads, g.head_dim))
        queue.put(("ready", None))
        while start_value.value == 0.0:
            time.sleep(0.005)
        start_at = start_value.value
        while time.time() < start_at:
            time.sleep(0.001)
        latencies, prefills, plan_s, cpu_s = [], 0, 0.0, 0.0
        timed_from = start_at + warmup
        end = timed_from + duration
        while True:
            now = time.time()
            if now >= end or c.kv_len(ids[0]) + 1 >= 4 * kv_len:
                break
            c0, t0 = time.process_time(), time.perf_counter()
            s = c.plan(ids, [1] * len(ids))
            t1 = time.perf_counter()
            c.run(0, q, kv, kv, step=s)
            if now >= timed_from:
                latencies.append(time.perf_counter() - t0)
                plan_s += t1 - t0
                cpu_s += time.process_time() - c0
                prefills += len(s.parts)
        placement = ([len(c.shards_of(i)) for i in ids], [c.shards_of(i)[0].server for i in ids])
        kv_end = max(c.kv_len(i) for i in ids)
        c.release()
        c.close()
        queue.put(("done", (latencies, prefills, placement, kv_end, plan_s, cpu_s)))
    except Exception as e:  # noqa: BLE001 - reported to the parent, which fails
        queue.put(("error", repr(e)))
        raise


def scaling_table(results, log):
    """The issue's table: two GPUs against one, from this run."""
    print("\nScaling, two servers (one per GPU) against one, this run:", file=log)
    print("| case | 1 GPU | 2 GPUs | 2 / 1 | must reach |", file=log)
    print("|---|---|---|---|---|", file=log)
    pre = results.get("prefill")
    if pre:
        one = pre["one_gpu"]["kernel_s"]
        b = pre["two_gpus_balanced"]
        L = results["args"]["prefill_len"]
        print(f"| {L}-token causal prefill, kernels only (critical path) | {one * 1e3:.2f} ms | "
              f"{b['kernel_critical_s'] * 1e3:.2f} ms | {one / b['kernel_critical_s']:.2f}x | |",
              file=log)
        for m, t in b["critical_path_s"].items():
            print(f"| {L}-token causal prefill, kernels + merge ({m}) | {one * 1e3:.2f} ms | "
                  f"{t * 1e3:.2f} ms | {one / t:.2f}x | >= 1.7x |", file=log)
    one, two = results.get("decode_one_server"), results.get("decode_two_servers")
    if one and two:
        print(f"| decode {two['seqs']} x 1 over {two['kv_len']} keys, {two['clients']} clients, "
              f"requests/s | {one['requests_per_s']:.1f} | {two['requests_per_s']:.1f} | "
              f"{two['requests_per_s'] / one['requests_per_s']:.2f}x | >= 1.7x |", file=log)
        print(f"| same, p50 latency | {one['p50_ms']:.2f} ms | {two['p50_ms']:.2f} ms | | |",
              file=log)
    log.flush()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--bin", required=True, help="the attnserve binary")
    ap.add_argument("--devices", default="0,1", help="one server per device (CUDA_VISIBLE_DEVICES)")
    ap.add_argument("--backend", default="cuda")
    ap.add_argument("--prefill_len", type=int, default=32768)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--seqs", type=int, default=128)
    ap.add_argument("--kv_len", type=int, default=4096)
    ap.add_argument("--clients", type=int, default=32)
    ap.add_argument("--duration", type=float, default=15.0, help="timed decode seconds")
    ap.add_argument("--warmup", type=float, default=3.0, help="untimed decode seconds first")
    ap.add_argument("--num_pages", type=int, default=0,
                    help="pages per server (0: room for every decode sequence on one server "
                         "at 4x its prompt, and for the prefill twice over)")
    ap.add_argument("--out", default=".", help="directory for the server logs")
    ap.add_argument("--json", default="")
    ap.add_argument("--skip", default="", help="'prefill' or 'decode' to leave one out")
    a = ap.parse_args()
    if a.seqs % a.clients:
        sys.exit("--seqs must be a multiple of --clients")
    devices = [d for d in a.devices.split(",") if d != ""]
    if len(devices) != 2:
        sys.exit("--devices needs two devices")
    page_size = 16
    if a.num_pages == 0:
        a.num_pages = max(-(-a.seqs * a.kv_len * 4 // page_size),
                          -(-a.prefill_len * 2 // page_size)) + 64
    os.makedirs(a.out, exist_ok=True)
    log = sys.stdout
    print(f"servers: --num_layers=1 --num_pages={a.num_pages} (page_size {page_size}), the same "
          f"flags for every server; fresh servers for each decode configuration", file=log)

    def start_servers(n, tag):
        return [Server(a.bin, d if a.backend == "cuda" else None, a.backend, a.num_pages,
                       os.path.join(a.out, f"server{i}-{tag}.log"))
                for i, d in enumerate(devices[:n])]

    def stop_all(servers):
        for s in servers:
            s.stop()

    # A timeout's SIGTERM unwinds through the finally blocks that stop the servers.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    results = {"args": vars(a)}
    if a.skip != "prefill":
        servers = start_servers(2, "prefill")
        try:
            results["prefill"] = prefill_bench(a, servers, log)
        finally:
            stop_all(servers)
    if a.skip != "decode":
        for n, key, label in ((1, "decode_one_server", "1 server "),
                              (2, "decode_two_servers", "2 servers")):
            servers = start_servers(n, f"decode{n}")
            try:
                results[key] = decode_bench(a, servers, label, log)
            finally:
                stop_all(servers)
    scaling_table(results, log)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
