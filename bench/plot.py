#!/usr/bin/python3
"""Charts from attnbench --json results (matplotlib).

  python3 bench/plot.py run-c1.json run-c4.json run-c16.json --out serving

writes serving-latency-cdf.png (one curve per file, from its per-request
latencies) and, when the files span more than one concurrency,
serving-throughput.png (requests/s against concurrency, one line per
backend, workload and mode; attnecho's results are the transport floor).
"""
import argparse
import json
from collections import defaultdict

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def label(r):
    mode = f"rate {r['rate']:g}/s" if r["mode"] == "open" else f"c={r['concurrency']}"
    return f"{r.get('backend', '?')}: {r['workload']} b={r['batch']} {mode}"


def latency_cdf(results, path):
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for r in results:
        xs = sorted(r.get("latencies_ms") or [])
        if xs:
            ax.plot(xs, [(i + 1) / len(xs) for i in range(len(xs))], label=label(r))
    ax.set_xscale("log")
    ax.set_xlabel("latency (ms)")
    ax.set_ylabel("fraction of requests")
    ax.set_title("attnbench latency CDF")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def throughput(results, path):
    series = defaultdict(list)
    for r in results:
        key = (r.get("backend", "?"), r["workload"], r["batch"], r["mode"])
        series[key].append((r["concurrency"], r["requests_per_s"]))
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for (backend, workload, batch, mode), points in sorted(series.items()):
        points.sort()
        ax.plot([c for c, _ in points], [t for _, t in points], marker="o",
                label=f"{backend}: {workload} b={batch} {mode} loop")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("concurrency (clients)")
    ax.set_ylabel("requests/s")
    ax.set_title("attnbench throughput vs concurrency")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("json", nargs="+", help="attnbench --json files")
    p.add_argument("--out", default="attnbench", help="prefix of the PNG files")
    args = p.parse_args()
    results = [json.load(open(f)) for f in args.json]
    latency_cdf(results, f"{args.out}-latency-cdf.png")
    print(f"wrote {args.out}-latency-cdf.png")
    if len({r["concurrency"] for r in results}) > 1:
        throughput(results, f"{args.out}-throughput.png")
        print(f"wrote {args.out}-throughput.png")


if __name__ == "__main__":
    main()
