#!/usr/bin/env python3
"""What a server plan saves per decode step (docs/design.md section 4, "Plans").

decode64 over a model of --layers layers: 64 sequences of --kv_len keys, one
query row and one appended K/V row per sequence per layer. One step is either

  layout: every layer's Prefill carries the indptrs, page ids (64 x kv_len /
          page_size of them), last-page lengths and append slots;
  plan:   CreatePlan once, every layer's Prefill names the plan and carries
          only its tensors, then ReleasePlan.

Both modes run against the same server, KV and inputs, alternating step by
step, and are timed with a wall clock around whole steps (median and p90 over
--steps steps each, after warm-up). Every layer's output is checked against
the other mode's for the same inputs, byte for byte, in the first step.

  bench/plans.py --target 127.0.0.1:50051 [--layers 32] [--steps 20] [--json out.json]

Needs a server with at least --layers layers and 64 * (kv_len / page_size + 1)
free pages, the default geometry otherwise (32/4 heads, head_dim 128).
"""
import argparse
import json
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, __file__.rsplit("/bench/", 1)[0] + "/client/python")
import attnserve  # noqa: E402
from attnserve.client import PrefillLayout  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", default="127.0.0.1:50051")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--kv_len", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--json", default="")
    a = ap.parse_args()

    c = attnserve.Client(a.target)
    info = c.info()
    if info.num_layers < a.layers:
        sys.exit(f"the server has {info.num_layers} layers, --layers={a.layers}")
    ps, hq, hkv, d = info.page_size, info.num_qo_heads, info.num_kv_heads, info.head_dim
    pages_per_seq = (a.kv_len + 1 + ps - 1) // ps
    pages = c.allocate_pages(a.batch * pages_per_seq)
    rng = np.random.default_rng(1)
    seq_pages = [pages[b * pages_per_seq:(b + 1) * pages_per_seq] for b in range(a.batch)]

    # Random KV in every slot the steps read, every layer: one random block of
    # rows, in the server's dtype when torch is there (no conversion per call),
    # written to every chunk of slots.
    slots = np.array([p * ps + o for sp in seq_pages for p in sp for o in range(ps)],
                     dtype=np.int64)
    chunk = max(1, (64 << 20) // (hkv * d * 2 * 2))
    k = rng.standard_normal((chunk, hkv, d), dtype=np.float32)
    v = rng.standard_normal((chunk, hkv, d), dtype=np.float32)
    try:
        import torch
        k = torch.from_numpy(k).to(torch.bfloat16)
        v = torch.from_numpy(v).to(torch.bfloat16)
    except ImportError:
        pass
    t0 = time.perf_counter()
    for layer in range(a.layers):
        for i in range(0, len(slots), chunk):
            s = slots[i:i + chunk]
            c.write_kv(layer, s, k[:len(s)], v[:len(s)])
    print(f"wrote {len(slots)} KV rows in each of {a.layers} layers in "
          f"{time.perf_counter() - t0:.1f} s", flush=True)

    # One decode step: kv_len keys seen, the appended row at position kv_len.
    kv_len = a.kv_len + 1
    qo_indptr = np.arange(a.batch + 1, dtype=np.int32)
    kv_indptr = np.arange(a.batch + 1, dtype=np.int32) * pages_per_seq
    kv_indices = np.array(pages, dtype=np.int32)
    last = np.full(a.batch, kv_len - (pages_per_seq - 1) * ps, dtype=np.int32)
    append_slots = np.array([sp[(kv_len - 1) // ps] * ps + (kv_len - 1) % ps for sp in seq_pages],
                            dtype=np.int64)
    q = [rng.standard_normal((a.batch, hq, d), dtype=np.float32) for _ in range(a.layers)]
    ak = [rng.standard_normal((a.batch, hkv, d), dtype=np.float32) for _ in range(a.layers)]
    av = [rng.standard_normal((a.batch, hkv, d), dtype=np.float32) for _ in range(a.layers)]
    layout = PrefillLayout.encode(qo_indptr, kv_indptr, kv_indices, last,
                                  append_slots=append_slots)

    def step_layout():
        return [c.prefill_layout(l, q[l], layout, ak[l], av[l]) for l in range(a.layers)]

    def step_plan():
        plan_id = c.create_plan(qo_indptr, kv_indptr, kv_indices, last, append_slots)
        planned = PrefillLayout.for_plan(plan_id, a.batch, a.batch)
        out = [c.prefill_layout(l, q[l], planned, ak[l], av[l]) for l in range(a.layers)]
        c.release_plan(plan_id)
        return out

    first_layout, first_plan = step_layout(), step_plan()
    for x, y in zip(first_layout, first_plan):
        if x.output.tobytes() != y.output.tobytes() or x.lse.tobytes() != y.lse.tobytes():
            sys.exit("plan and layout steps disagree")
    times = {"layout": [], "plan": []}
    for i in range(a.warmup + a.steps):
        for mode, fn in (("layout", step_layout), ("plan", step_plan)) if i % 2 == 0 else \
                (("plan", step_plan), ("layout", step_layout)):
            t = time.perf_counter()
            fn()
            if i >= a.warmup:
                times[mode].append(time.perf_counter() - t)
    c.free_pages(pages)

    request_bytes = {
        "layout": len(layout.encoded),
        "plan": len(PrefillLayout.for_plan(1, a.batch, a.batch).encoded),
    }
    rows = []
    print(f"\ndecode{a.batch} over {a.kv_len} keys, {a.layers} layers per step, "
          f"page_size {ps}, {info.backend} backend ({info.device})")
    print(f"{'mode':8} {'step p50 ms':>12} {'step p90 ms':>12} {'per layer ms':>13} "
          f"{'layout bytes/layer':>19}")
    for mode in ("layout", "plan"):
        ts = sorted(times[mode])
        p50, p90 = statistics.median(ts), ts[int(0.9 * (len(ts) - 1))]
        rows.append({"mode": mode, "step_p50_ms": p50 * 1e3, "step_p90_ms": p90 * 1e3,
                     "layer_ms": p50 * 1e3 / a.layers, "layout_bytes": request_bytes[mode]})
        print(f"{mode:8} {p50 * 1e3:12.2f} {p90 * 1e3:12.2f} {p50 * 1e3 / a.layers:13.3f} "
              f"{request_bytes[mode]:19d}")
    saving = 1 - rows[1]["step_p50_ms"] / rows[0]["step_p50_ms"]
    print(f"plan saves {saving * 100:.1f}% of the step")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"backend": info.backend, "device": info.device, "layers": a.layers,
                       "batch": a.batch, "kv_len": a.kv_len, "rows": rows,
                       "saving": saving}, f, indent=1)


if __name__ == "__main__":
    main()
