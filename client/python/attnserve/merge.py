"""The N-way merge of attention states by LSE, vectorized (float32 math).

docs/design.md section 3: for states (o_i, lse_i) of the same rows,
m = max lse_i, w_i = base^(lse_i - m), o = sum w_i o_i / sum w_i,
lse = m + log_base(sum w_i). A -inf state contributes nothing; when every
state is -inf the row is (0, -inf). It is what the server's MergeStates
computes, here for the cluster client (attnserve.cluster), which merges
the partial results of a sequence spread over several servers.
attnserve.reference.reference_merge is the independent float64 reference.

Two paths, chosen by the inputs:
  * numpy: the rows go in blocks small enough to stay in cache, each block
    in one pass of float32 ufuncs with no [states, ...] stack and no
    float64, the blocks spread over threads (numpy's ufuncs release the
    GIL). Output float32 (or into `out`).
  * torch (any state a torch tensor): on the tensors' device (CPU threads,
    or the GPU for CUDA tensors), float32 math, the output in the states'
    dtype (bf16 stays bf16, rounded once).
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from typing import Optional

import numpy as np

from attnserve import dtypes as _dt

# Rows of head_dim values per block: 2048 x 128 float32 = 1 MiB per temporary.
_BLOCK_ELEMS = 1 << 18
# Below this many output values one thread does it all.
_THREADED_ELEMS = 1 << 21
_pool: Optional[ThreadPoolExecutor] = None
_pool_threads = 0


def merge_threads() -> int:
    """Threads of the numpy merge: ATTNSERVE_MERGE_THREADS, or the CPUs this
    process may use (at most 16)."""
    env = os.environ.get("ATTNSERVE_MERGE_THREADS", "")
    if env:
        return max(1, int(env))
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        cpus = os.cpu_count() or 1
    return max(1, min(16, cpus))


def _executor(threads: int) -> ThreadPoolExecutor:
    global _pool, _pool_threads
    if _pool is None or _pool_threads != threads:
        if _pool is not None:
            _pool.shutdown(wait=False)
        _pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="attnserve-merge")
        _pool_threads = threads
    return _pool


def merge_states(vs, lses, lse_base: str = "2", out=None) -> tuple:
    """Merges states: vs, each [..., d], and lses, each [...] (float32 LSEs of
    the same rows; -inf: the state saw nothing of that row).

    numpy inputs (float32, float16, float64, ...): returns (v [..., d]
    float32, lse [...] float32); `out` (optional, float32 [..., d], may be a
    view into a larger array, and may be one of vs) receives v. Any torch input: the torch path on
    that tensor's device, v in vs[0]'s dtype."""
    if len(vs) == 0 or len(vs) != len(lses):
        raise ValueError(f"merge_states: {len(vs)} values and {len(lses)} LSEs")
    if lse_base not in ("2", "e"):
        raise ValueError(f"merge_states: lse_base must be '2' or 'e', not {lse_base!r}")
    shape = tuple(vs[0].shape)
    for i, (v, lse) in enumerate(zip(vs, lses)):
        if tuple(v.shape) != shape:
            raise ValueError(f"merge_states: vs[{i}] has shape {list(v.shape)}, vs[0] "
                             f"{list(shape)}")
        if len(shape) == 0 or tuple(lse.shape) != shape[:-1]:
            raise ValueError(f"merge_states: lses[{i}] has shape {list(lse.shape)}, expected "
                             f"{list(shape[:-1])} (vs' shape without the last axis)")
    if any(_dt.is_torch(x) for x in list(vs) + list(lses)):
        return _merge_torch(vs, lses, lse_base, out)
    return _merge_numpy(vs, lses, lse_base, out)


def _merge_numpy(vs, lses, lse_base, out):
    shape = tuple(vs[0].shape)
    d = shape[-1]
    rows = int(np.prod(shape[:-1], dtype=np.int64))
    v2 = []
    for v in vs:
        a = np.asarray(v)
        if a.dtype.kind != "f":
            raise TypeError(f"merge_states: values must be floating, not {a.dtype}")
        v2.append(a.reshape(rows, d))
    l2 = [np.asarray(x, dtype=np.float32).reshape(rows) for x in lses]
    if out is None:
        o2 = np.empty((rows, d), np.float32)
        result = o2.reshape(shape)
    else:
        if out.shape != shape or out.dtype != np.float32:
            raise ValueError(f"merge_states: out must be float32 {list(shape)}, not "
                             f"{out.dtype} {list(out.shape)}")
        o2 = out.reshape(rows, d)  # a view when out is contiguous enough
        result = out
        # Written block by block while the inputs are read: an `out` that is
        # (or overlaps) an input gets the result through a buffer instead.
        if not np.shares_memory(o2, out) or any(np.shares_memory(out, a) for a in v2 + l2):
            o2 = np.empty((rows, d), np.float32)
    lse_out = np.empty(rows, np.float32)
    exp = np.exp2 if lse_base == "2" else np.exp
    log = np.log2 if lse_base == "2" else np.log
    block = max(1, _BLOCK_ELEMS // max(d, 1))

    def merge_block(lo: int, hi: int) -> None:
        ls = [x[lo:hi] for x in l2]
        m = ls[0].copy()
        for x in ls[1:]:
            np.maximum(m, x, out=m)
        seen = m != -np.inf            # False: every state saw nothing
        m[~seen] = 0.0
        total = np.zeros(hi - lo, np.float32)
        weights = []
        with np.errstate(invalid="ignore", over="ignore"):
            for x in ls:
                w = exp(x - m)             # exactly 0 for a -inf state
                total += w
                weights.append(w)
        inv = np.divide(np.float32(1), total, out=np.zeros_like(total), where=total > 0)
        o = o2[lo:hi]
        tmp = None
        for s, (v, w) in enumerate(zip(v2, weights)):
            w *= inv
            if s == 0:
                np.multiply(v[lo:hi], w[:, None], out=o, casting="unsafe")
            else:
                if tmp is None:
                    tmp = np.empty((hi - lo, d), np.float32)
                np.multiply(v[lo:hi], w[:, None], out=tmp, casting="unsafe")
                o += tmp
        # 0 * (a state's output) is 0 unless that output is inf / NaN; a row
        # nothing saw is 0 whatever the states hold.
        if not seen.all():
            o[~seen] = 0.0
        with np.errstate(divide="ignore"):
            lse_out[lo:hi] = np.where(seen, m + log(np.where(seen, total, 1)), -np.inf)

    starts = list(range(0, rows, block))
    threads = merge_threads()
    if rows * d >= _THREADED_ELEMS and threads > 1 and len(starts) > 1:
        list(_executor(threads).map(lambda lo: merge_block(lo, min(rows, lo + block)), starts))
    else:
        for lo in starts:
            merge_block(lo, min(rows, lo + block))
    if o2 is not result and not np.shares_memory(o2, result):
        result[...] = o2.reshape(shape)
    return result, lse_out.reshape(shape[:-1])


def _merge_torch(vs, lses, lse_base, out):
    import torch
    first = next(x for x in vs if _dt.is_torch(x)) if any(_dt.is_torch(x) for x in vs) else None
    device = first.device if first is not None else next(
        x for x in lses if _dt.is_torch(x)).device
    dtype = first.dtype if first is not None else torch.float32

    def as_tensor(x):
        return x if _dt.is_torch(x) else torch.from_numpy(np.ascontiguousarray(x))

    tv = [as_tensor(v).to(device) for v in vs]
    tl = torch.stack([as_tensor(x).to(device, torch.float32) for x in lses])  # [s, ...]
    m = tl.amax(dim=0)
    seen = m != float("-inf")
    m_safe = torch.where(seen, m, torch.zeros((), device=device))
    w = torch.exp2(tl - m_safe) if lse_base == "2" else torch.exp(tl - m_safe)
    total = w.sum(dim=0)
    # Each state's share of a row (all 0 in a row nothing saw), then one pass
    # per state over the values: acc = sum_s share_s * v_s, in float32 (the
    # product of a half-precision state and a float32 share is float32).
    share = w / torch.where(total > 0, total, torch.ones((), device=device))
    acc = torch.mul(tv[0], share[0].unsqueeze(-1))
    if acc.dtype not in (torch.float32, torch.float64):
        acc = acc.to(torch.float32)
    for s in range(1, len(tv)):
        acc.addcmul_(tv[s], share[s].unsqueeze(-1))
    if out is not None:
        result = out.copy_(acc)
    else:
        result = acc if acc.dtype == dtype else acc.to(dtype)
    # A row nothing saw is 0 whatever the states hold (0 * inf is NaN), set
    # on the result (the narrower type: fewer bytes). On a GPU the mask is
    # applied unconditionally: asking whether every row was seen would wait
    # for the device.
    if len(tv) == 1 or acc.is_cuda or not bool(seen.all()):
        result.masked_fill_(~seen.unsqueeze(-1), 0)
    log = torch.log2 if lse_base == "2" else torch.log
    lse = torch.where(seen, m_safe + log(torch.where(seen, total, torch.ones((), device=device))),
                      torch.full((), float("-inf"), device=device))
    return result, lse
