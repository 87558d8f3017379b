#!/usr/bin/python3
"""Charts from attnbench --json results (matplotlib).

  python3 bench/plot.py decode-c1.json decode-c4.json decode-c16.json --out serving

Each run is labelled by its file name (decode-c4.json: "decode-c4"). Writes:

  OUT-latency-cdf.png         per run, the CDF of its per-request latencies with
                              p50 and p99 marked, beside the tail (fraction of
                              requests slower than x) on log-log axes
  OUT-latency-throughput.png  when the files hold a sweep (runs of one workload
                              at several concurrencies or rates): p50 and p99
                              latency against achieved requests/s, one curve per
                              workload and loop mode, each point labelled by file
  OUT-throughput.png          when closed-loop runs span several concurrencies:
                              requests/s against clients (attnecho's results
                              are the transport floor)

p50 and p99 are attnbench's own (over every request); the curves use the
latency samples in the file (attnbench keeps up to 100,000).
"""
import argparse
import json
import math
import os
import sys
from collections import defaultdict

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.lines import Line2D  # noqa: E402

# Fields every attnbench --json result has, with their types (q_len is null
# for decode runs: one query row per sequence).
REQUIRED = {
    "workload": str, "mode": str, "concurrency": int, "rate": (int, float), "batch": int,
    "q_len": (int, type(None)), "kv_len": int, "requests_per_s": (int, float), "latency_ms": dict,
}


class InputError(Exception):
    """A file that is not an attnbench result; the message names the file and the field."""


def load(path):
    """One attnbench result, checked field by field."""
    try:
        with open(path) as f:
            r = json.load(f)
    except OSError as e:
        raise InputError(f"{path}: cannot read: {e.strerror}")
    except json.JSONDecodeError as e:
        raise InputError(f"{path}: not JSON: {e}")
    if not isinstance(r, dict):
        raise InputError(f"{path}: not an attnbench --json result (top level is not an object)")
    for key, kind in REQUIRED.items():
        if key not in r:
            raise InputError(f"{path}: missing field '{key}' (not an attnbench --json result?)")
        if not isinstance(r[key], kind) or isinstance(r[key], bool):
            want = " or ".join(t.__name__ for t in (kind if isinstance(kind, tuple) else (kind,)))
            raise InputError(f"{path}: field '{key}' is {type(r[key]).__name__} {r[key]!r}, want {want}")
    if r["mode"] not in ("closed", "open"):
        raise InputError(f"{path}: field 'mode' is '{r['mode']}', want 'closed' or 'open'")
    for q in ("p50", "p99"):
        v = r["latency_ms"].get(q)
        if not isinstance(v, (int, float)) or isinstance(v, bool) or v < 0 or math.isnan(v):
            raise InputError(f"{path}: field 'latency_ms.{q}' is {v!r}, want a number >= 0")
    samples = r.get("latencies_ms", [])
    if not isinstance(samples, list) or not all(
            isinstance(x, (int, float)) and not isinstance(x, bool) and x >= 0 for x in samples):
        raise InputError(f"{path}: field 'latencies_ms' must be a list of numbers >= 0")
    return r


def labels_for(paths):
    """File names without .json; where two collide, with their parent directories."""
    def name(p, depth):
        parts = os.path.normpath(p).split(os.sep)
        parts[-1] = parts[-1][:-5] if parts[-1].endswith(".json") else parts[-1]
        return "/".join(parts[-depth:])
    depth = {p: 1 for p in paths}
    while True:
        names = [name(p, depth[p]) for p in paths]
        dup = {n for n in names if names.count(n) > 1}
        grow = [p for p, n in zip(paths, names) if n in dup and depth[p] < len(os.path.normpath(p).split(os.sep))]
        if not grow:
            return names
        for p in grow:
            depth[p] += 1


def offered(r):
    """What the run was asked for: clients (closed loop) or requests/s (open loop)."""
    return r["rate"] if r["mode"] == "open" else r["concurrency"]


def describe(r):
    """The run's settings, for titles: backend, workload and shape."""
    shape = {"decode": f"kv_len={r['kv_len']}", "prefill": f"q_len={r['q_len']}"}.get(
        r["workload"], f"q_len={r['q_len']} kv_len={r['kv_len']}")
    return f"{r.get('backend', '?')}: {r['workload']} b={r['batch']} {shape}"


def fmt_ms(v):
    return f"{v:.3g}" if v < 1000 else f"{v:,.0f}"


def latency_cdf(runs, path):
    """Left: CDF, log x. Right: tail, 1 - CDF on log-log axes. p50 (o) and p99 (D) marked on both."""
    fig, (ax, tail) = plt.subplots(1, 2, figsize=(13, 5))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    drawn = 0
    smallest = 1.0
    for i, (lab, r) in enumerate(runs):
        xs = sorted(x for x in r.get("latencies_ms") or [] if x > 0)
        if not xs:
            print(f"plot.py: {lab}: no latency samples, left out of the CDF", file=sys.stderr)
            continue
        n = len(xs)
        c = colors[i % len(colors)]
        p50, p99 = r["latency_ms"]["p50"], r["latency_ms"]["p99"]
        errors = r.get("errors", 0)
        text = f"{lab}  (p50 {fmt_ms(p50)}, p99 {fmt_ms(p99)} ms, n={n}{f', {errors} errors' if errors else ''})"
        ax.plot(xs, [(k + 1) / n for k in range(n)], color=c, label=text, drawstyle="steps-post")
        # Fraction of requests that took at least x.
        tail.plot(xs, [(n - k) / n for k in range(n)], color=c, drawstyle="steps-post")
        smallest = min(smallest, 1 / n)
        for q, y_cdf, marker in ((p50, 0.5, "o"), (p99, 0.99, "D")):
            if q > 0:
                ax.plot([q], [y_cdf], marker=marker, color=c, markeredgecolor="black", zorder=3)
                tail.plot([q], [1 - y_cdf], marker=marker, color=c, markeredgecolor="black", zorder=3)
        drawn += 1
    if drawn == 0:
        plt.close(fig)
        print(f"plot.py: no file has latency samples; {path} not written", file=sys.stderr)
        return False
    for a in (ax, tail):
        a.set_xscale("log")
        a.set_xlabel("latency (ms)")
        a.grid(True, which="both", alpha=0.3)
    ax.axhline(0.5, color="gray", lw=0.6, ls=":")
    ax.axhline(0.99, color="gray", lw=0.6, ls=":")
    ax.set_ylim(0, 1.01)
    ax.set_ylabel("fraction of requests at most x")
    ax.set_title("latency CDF")
    tail.set_yscale("log")
    tail.set_ylim(max(smallest / 2, 1e-6), 1.5)
    tail.axhline(0.5, color="gray", lw=0.6, ls=":")
    tail.axhline(0.01, color="gray", lw=0.6, ls=":")
    tail.set_ylabel("fraction of requests slower than x")
    tail.set_title("latency tail (log-log)")
    handles, _ = ax.get_legend_handles_labels()
    handles += [Line2D([], [], ls="", marker="o", color="gray", markeredgecolor="black", label="p50"),
                Line2D([], [], ls="", marker="D", color="gray", markeredgecolor="black", label="p99")]
    fig.legend(handles=handles, loc="lower center", ncol=2, fontsize="small", frameon=False)
    common = {describe(r) for _, r in runs}
    fig.suptitle("attnbench latency" + (f" - {common.pop()}" if len(common) == 1 else ""))
    rows = math.ceil((drawn + 2) / 2)
    fig.tight_layout(rect=(0, 0.045 * rows + 0.02, 1, 1))
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def sweeps(runs):
    """Runs of one setting (backend, workload, shape, mode) at two or more loads, by offered load."""
    groups = defaultdict(list)
    for lab, r in runs:
        key = (r.get("backend", "?"), r["workload"], r["batch"], r["q_len"], r["kv_len"], r["mode"])
        groups[key].append((lab, r))
    out = {}
    for key, members in groups.items():
        if len({offered(r) for _, r in members}) > 1:
            out[key] = sorted(members, key=lambda m: offered(m[1]))
    return out


def latency_throughput(runs, path):
    """p50 (solid) and p99 (dashed) latency against achieved requests/s, log y."""
    groups = sweeps(runs)
    if not groups:
        return False
    fig, ax = plt.subplots(figsize=(9, 5.5))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, (key, members) in enumerate(sorted(groups.items())):
        c = colors[i % len(colors)]
        backend, workload, batch, q_len, kv_len, mode = key
        load = "rate" if mode == "open" else "clients"
        pts = [(r["requests_per_s"], r["latency_ms"]["p50"], r["latency_ms"]["p99"], lab, r)
               for lab, r in members if r["requests_per_s"] > 0]
        for lab, r in members:
            if r["requests_per_s"] <= 0:
                print(f"plot.py: {lab}: no request succeeded, left out of the sweep", file=sys.stderr)
        if not pts:
            continue
        name = f"{describe(members[0][1])}, {mode} loop (by {load})"
        ax.plot([p[0] for p in pts], [p[1] for p in pts], color=c, marker="o", label=f"{name}: p50")
        ax.plot([p[0] for p in pts], [p[2] for p in pts], color=c, marker="D", ls="--", label=f"{name}: p99")
        for x, _, y99, lab, _ in pts:
            ax.annotate(lab, (x, y99), textcoords="offset points", xytext=(4, 4), fontsize="x-small", color=c)
    ax.set_yscale("log")
    ax.set_xlabel("achieved throughput (requests/s)")
    ax.set_ylabel("latency (ms)")
    ax.set_title("attnbench latency against throughput")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def throughput(runs, path):
    """Closed-loop requests/s against clients, one line per setting."""
    series = defaultdict(list)
    for lab, r in runs:
        if r["mode"] == "closed":
            series[describe(r)].append((r["concurrency"], r["requests_per_s"]))
    series = {k: v for k, v in series.items() if len({c for c, _ in v}) > 1}
    if not series:
        return False
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, points in sorted(series.items()):
        points.sort()
        ax.plot([c for c, _ in points], [t for _, t in points], marker="o", label=f"{name}, closed loop")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("concurrency (clients)")
    ax.set_ylabel("requests/s")
    ax.set_title("attnbench throughput vs concurrency")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("json", nargs="+", help="attnbench --json files")
    p.add_argument("--out", default="attnbench", help="prefix of the PNG files (its directory must exist)")
    args = p.parse_args()
    out_dir = os.path.dirname(args.out) or "."
    if not os.path.isdir(out_dir):
        p.error(f"--out={args.out}: directory {out_dir} does not exist")
    try:
        results = [load(f) for f in args.json]
    except InputError as e:
        print(f"plot.py: {e}", file=sys.stderr)
        return 2
    runs = list(zip(labels_for(args.json), results))
    wrote = 0
    for suffix, fn in (("latency-cdf", latency_cdf), ("latency-throughput", latency_throughput),
                       ("throughput", throughput)):
        path = f"{args.out}-{suffix}.png"
        if fn(runs, path):
            print(f"wrote {path}")
            wrote += 1
    return 0 if wrote else 1


if __name__ == "__main__":
    sys.exit(main())
