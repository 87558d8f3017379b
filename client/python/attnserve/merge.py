"""The N-way merge of attention states by LSE, in numpy (float32 math).

docs/design.md section 3: for states (o_i, lse_i) of the same rows,
m = max lse_i, w_i = base^(lse_i - m), o = sum w_i o_i / sum w_i,
lse = m + log_base(sum w_i). A -inf state contributes nothing; when every
state is -inf the row is (0, -inf). It is what the server's MergeStates
computes, here for the cluster client (attnserve.cluster), which merges
the partial results of a sequence spread over several servers.
attnserve.reference.reference_merge is the independent float64 reference.
"""

from __future__ import annotations

import numpy as np


def merge_states(vs, lses, lse_base: str = "2") -> tuple:
    """Merges states: vs, each [..., d] (any float dtype), and lses, each [...]
    (float32 LSEs of the same rows). Returns (v [..., d] float32, lse [...] float32)."""
    if len(vs) == 0 or len(vs) != len(lses):
        raise ValueError(f"merge_states: {len(vs)} values and {len(lses)} LSEs")
    v = np.stack([np.asarray(x, dtype=np.float32) for x in vs])      # [s, ..., d]
    lse = np.stack([np.asarray(x, dtype=np.float32) for x in lses])  # [s, ...]
    m = lse.max(axis=0)
    seen = np.isfinite(m)                     # False: every state saw nothing
    m_safe = np.where(seen, m, np.float32(0))
    with np.errstate(invalid="ignore", over="ignore"):
        # A -inf state's weight is exactly 0 (base^-inf).
        w = np.exp2(lse - m_safe) if lse_base != "e" else np.exp(lse - m_safe)
    total = w.sum(axis=0)
    safe_total = np.where(total > 0, total, np.float32(1))
    out = (w[..., None] * v).sum(axis=0) / safe_total[..., None]
    out = np.where(seen[..., None], out, np.float32(0)).astype(np.float32)
    log = np.log2 if lse_base != "e" else np.log
    out_lse = np.where(seen, m_safe + log(safe_total), np.float32(-np.inf)).astype(np.float32)
    return out, out_lse
