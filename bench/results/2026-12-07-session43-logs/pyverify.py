"""Session 43 (session 42's script with the queries' scale as argv[2]): the Python float64 reference against a running server, through
KvMirror.for_server (fp8_query_min_rows) and per-row LSE bounds. Batches of
sequences with q_len below and above the server's fp8_query_min_rows; prints
one line per batch and a summary (PYVERIFY ok=N/M)."""
import sys

import numpy as np

import attnserve
from attnserve.reference import KvMirror, compare, reference_prefill, within_tolerance

QSCALE = float(sys.argv[2]) if len(sys.argv) > 2 else 2.0
client = attnserve.Client(sys.argv[1], timeout=60)
g = client.server_info
print("server", g.kv_dtype, g.q_dtype, "fp8_query_min_rows", g.fp8_query_min_rows)
rng = np.random.default_rng(42)
ok = total = 0
worst_lse = {True: 0.0, False: 0.0}
worst_ratio = 0.0  # largest LSE error / the row's bound
for batch in range(12):
    q_lens = [int(x) for x in rng.choice([1, 3, 8, 9, 40, 200, 700], size=4)]
    kv_lens = [ql + int(rng.integers(0, 1500)) for ql in q_lens]
    n_pages = [(n + g.page_size - 1) // g.page_size for n in kv_lens]
    pages = client.allocate_pages(sum(n_pages))
    mirror = KvMirror.for_server(g)
    kv_indptr, at = [0], 0
    for n in n_pages:
        at += n
        kv_indptr.append(at)
    slots = []
    for b, n in enumerate(kv_lens):
        ps = pages[kv_indptr[b]:kv_indptr[b + 1]]
        slots += [ps[j // g.page_size] * g.page_size + j % g.page_size for j in range(n)]
    k = rng.standard_normal((len(slots), g.num_kv_heads, g.head_dim), np.float32)
    v = rng.standard_normal((len(slots), g.num_kv_heads, g.head_dim), np.float32)
    client.write_kv(0, slots, k, v)
    mirror.write(0, slots, k, v)
    qo = np.concatenate([[0], np.cumsum(q_lens)]).tolist()
    q = rng.standard_normal((qo[-1], g.num_qo_heads, g.head_dim), np.float32) * QSCALE
    last = [n - (p - 1) * g.page_size for n, p in zip(kv_lens, n_pages)]
    r = client.prefill(0, q, qo_indptr=qo, kv_indptr=kv_indptr, kv_indices=pages,
                       kv_last_page_len=last)
    o_ref, lse_ref, bound = reference_prefill(mirror, 0, q, qo, kv_indptr, pages, last,
                                              page_size=g.page_size, return_lse_bound=True)
    c = compare(o_ref, lse_ref, r.output, r.lse, bound)
    good = within_tolerance(c)
    err = np.abs(np.asarray(r.lse, dtype=np.float64) - lse_ref)
    worst_ratio = max(worst_ratio, float((err / bound).max()))
    for rounded in (True, False):
        sel = (bound > 1e-3) == rounded
        if sel.any():
            worst_lse[rounded] = max(worst_lse[rounded], float(err[sel].max()))
    print("batch", batch, "q_lens", q_lens, c, "ok" if good else "WRONG")
    ok += good
    total += 1
    client.free_pages(pages)
print(f"PYVERIFY qscale={QSCALE} ok={ok}/{total} worst_lse_rounded_rows={worst_lse[True]:.2e} "
      f"worst_lse_other_rows={worst_lse[False]:.2e} worst_err_over_bound={worst_ratio:.3f}")
