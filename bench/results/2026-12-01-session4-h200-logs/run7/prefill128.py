#!/usr/bin/env python3
"""One attnserve --backend=cuda, attnbench 128 MiB inline prefills, stage means from /metrics."""
import os, sys, json
sys.path.insert(0, "bench")
from serving import GEOMETRY, bench, scrape, start  # noqa: E402
from transport import stage_means, kernel_ms  # noqa: E402
inst, out = sys.argv[1], sys.argv[2]
os.makedirs(out, exist_ok=True)
b = os.path.join(inst, "bin")
for tag, extra in (("tuned", ["--transport_tuning=true"]), ("defaults", ["--transport_tuning=false"])):
    srv, m = start([f"{b}/attnserve", f"--backend={os.environ.get('BACKEND', 'cuda')}", "--listen=127.0.0.1:0", "--metrics_listen=127.0.0.1:0",
                    "--num_layers=2", "--num_pages=40000"] + extra + GEOMETRY,
                   os.path.join(out, f"server_{tag}.log"), r"listening grpc=(\S+) metrics=(\S+)")
    addr, metrics = m.group(1), m.group(2)
    before = scrape(metrics)
    res = bench(b, addr, ["--workload=prefill", "--batch=1", f"--q_len={os.environ.get('QLEN', '16384')}", "--concurrency=1", "--requests=10",
                          f"--metrics={metrics}"] + extra,
                os.path.join(out, f"prefill_{tag}.json"), os.path.join(out, f"prefill_{tag}.log"))
    after = scrape(metrics)
    st = stage_means(before, after)
    print(tag, "p50", res["latency_ms"]["p50"] if res else None, "p99", res["latency_ms"]["p99"] if res else None,
          "kernel", round(kernel_ms(before, after), 3), {k: (round(v, 3) if v is not None else None) for k, v in st.items()})
    srv.terminate(); srv.wait(timeout=60)
