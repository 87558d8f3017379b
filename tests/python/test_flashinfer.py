"""attnserve.flashinfer: FlashInfer's wrappers on a real CPU server.

Every result is compared with the float64 reference (attnserve.reference)
over random K/V and queries; every argument is shown to mean what
FlashInfer's documentation says (defaults included) by matching the
reference computed with that meaning and NOT the one without it, so that a
wrapper that dropped the argument would fail. Transports grpc, shm and
channel each run the same checks; futures, out=/lse=, the fallback of large
calls to gRPC, plans and their release, errors that name the argument, and a
killed client are tested too."""

import asyncio
import math
import os
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest
import torch

import attnserve
import attnserve.flashinfer as fi
from attnserve.reference import (KvMirror, compare, reference_merge, reference_prefill,
                                 within_tolerance)
from server import TestServer

TRANSPORTS = ["grpc", "shm", "channel"]
BF16 = torch.bfloat16


@pytest.fixture(scope="module")
def server():
    """The tests' geometry (2 layers, 256 pages of 16, 8/2 heads of 64, bf16),
    with shared memory on."""
    with TestServer(extra_flags=["--allow_shared_memory"]) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    c = attnserve.Client(server.address, timeout=60)
    yield c
    c.close()


@pytest.fixture(params=TRANSPORTS)
def cache(request, client):
    with fi.PagedKVCache(client, 48, transport=request.param) as c:
        yield c


@pytest.fixture
def grpc_cache(client):
    with fi.PagedKVCache(client, 48) as c:
        yield c


class Batch:
    """A random FlashInfer layout over a cache's page indices (shuffled, so
    that page index and server page id differ), with every row of every
    layer written through append_paged_kv_cache and mirrored."""

    def __init__(self, cache, kv_lens, seed=0):
        self.cache, self.kv_lens = cache, list(kv_lens)
        ps = cache.page_size
        g = torch.Generator().manual_seed(seed)
        perm = torch.randperm(cache.max_num_pages, generator=g).tolist()
        pages, at = [], 0
        for n in kv_lens:
            count = -(-n // ps)
            pages.append(perm[at:at + count])
            at += count
        self.pages = pages
        i32 = dict(dtype=torch.int32)
        self.indptr = torch.tensor([0] + np.cumsum([len(p) for p in pages]).tolist(), **i32)
        self.indices = torch.tensor([x for p in pages for x in p], **i32)
        self.last = torch.tensor([n - (len(p) - 1) * ps if p else 0
                                  for n, p in zip(kv_lens, pages)], **i32)
        self.server_pages = cache.page_ids[self.indices.numpy()]
        self.mirror = KvMirror(cache.num_kv_heads, cache.head_dim)
        self.gen = torch.Generator().manual_seed(seed + 1)

    def randn(self, *shape, scale=1.0):
        return (torch.randn(*shape, generator=self.gen) * scale).to(BF16)

    def slots(self, batch_indices, positions):
        ps = self.cache.page_size
        bi, pos = np.asarray(batch_indices), np.asarray(positions)
        page = self.indices.numpy()[self.indptr.numpy()[bi] + pos // ps]
        return self.cache.page_ids[page] * ps + pos % ps

    def append(self, layer, rows_per_seq=None, upto=None):
        """Appends rows_per_seq[b] rows (default all) of each sequence in
        `layer`, the last ones of its first upto[b] (default kv_lens[b]);
        returns (k, v, slots) as queued."""
        rows = self.kv_lens if rows_per_seq is None else rows_per_seq
        indptr = torch.tensor([0] + np.cumsum(rows).tolist(), dtype=torch.int32)
        nnz = int(indptr[-1])
        lens = (fi.get_seq_lens(self.indptr, self.last, self.cache.page_size) if upto is None
                else torch.tensor(upto))
        bi, pos = fi.get_batch_indices_positions(indptr, lens, nnz)
        c = self.cache
        k = self.randn(nnz, c.num_kv_heads, c.head_dim)
        v = self.randn(nnz, c.num_kv_heads, c.head_dim)
        fi.append_paged_kv_cache(k, v, bi, pos, c[layer], self.indices, self.indptr, self.last)
        slots = self.slots(bi, pos)
        self.mirror.write(layer, slots, k, v)
        return k, v, slots

    def fill(self, rows_per_seq=None):
        """The first rows_per_seq[b] rows (default all) of every layer."""
        for layer in range(self.cache.num_layers):
            self.append(layer, rows_per_seq, rows_per_seq)
        self.cache.flush()

    def reference(self, layer, q, qo_indptr, *, causal, sm_scale=None, options=None):
        return reference_prefill(self.mirror, layer, q, np.asarray(qo_indptr),
                                 self.indptr.numpy(), self.server_pages, self.last.numpy(),
                                 page_size=self.cache.page_size, causal=causal,
                                 sm_scale=sm_scale, options=options)


def decode_qo(batch):
    return np.arange(batch + 1)


def matches(got, ref, other=None):
    """got (o, lse) within the design's tolerance of ref; and, when given,
    outside it for `other` (the meaning the argument does not have)."""
    o, lse = got
    c = compare(*ref, o.float().numpy(), lse.numpy())
    assert within_tolerance(c), c
    if other is not None:
        d = compare(*other, o.float().numpy(), lse.numpy())
        assert not within_tolerance(d), ("the result does not tell the meanings apart", d)


def plan_decode(w, b, **kw):
    c = b.cache
    kw.setdefault("q_data_type", BF16)
    w.plan(b.indptr, b.indices, b.last, c.num_qo_heads, c.num_kv_heads, c.head_dim,
           c.page_size, **kw)


def plan_prefill(w, b, qo_indptr, **kw):
    c = b.cache
    kw.setdefault("q_data_type", BF16)
    w.plan(torch.tensor(qo_indptr, dtype=torch.int32), b.indptr, b.indices, b.last,
           c.num_qo_heads, c.num_kv_heads, c.head_dim, c.page_size, **kw)


# ---------------------------------------------------------------- against the reference
def test_decode_matches_reference(cache):
    b = Batch(cache, [1, 17, 40, 100, 33], seed=1)
    b.fill()
    w = fi.BatchDecodeWithPagedKVCacheWrapper(cache, "NHD")
    plan_decode(w, b)
    for layer in range(cache.num_layers):
        q = b.randn(5, cache.num_qo_heads, cache.head_dim, scale=2.0)
        got = w.run(q, cache[layer], return_lse=True)
        assert got[0].dtype == BF16 and got[0].shape == q.shape
        assert got[1].dtype == torch.float32 and got[1].shape == q.shape[:2]
        # Base 2, FlashInfer's: a natural-log LSE would differ by a factor ln 2.
        ref = b.reference(layer, q, decode_qo(5), causal=False)
        matches(got, ref, (ref[0], ref[1] * math.log(2.0)))
    w.close()


def test_prefill_with_fused_appends_matches_reference(cache):
    """A prefill step as an engine runs it: the prompts' rows appended with
    append_paged_kv_cache, then run(): the rows reach the server in the
    run's own request, before the attention reads them."""
    kv_lens, q_lens = [20, 7, 45], [20, 3, 13]
    b = Batch(cache, kv_lens, seed=2)
    b.fill([n - q for n, q in zip(kv_lens, q_lens)])          # the earlier tokens
    qo = [0] + np.cumsum(q_lens).tolist()
    w = fi.BatchPrefillWithPagedKVCacheWrapper(cache, "NHD")
    plan_prefill(w, b, qo, causal=True)
    for layer in range(cache.num_layers):
        b.append(layer, q_lens)                                  # this step's tokens
        assert cache.pending_rows(layer) == sum(q_lens)
        q = b.randn(qo[-1], cache.num_qo_heads, cache.head_dim, scale=2.0)
        got = w.run(q, cache[layer], return_lse=True)
        assert cache.pending_rows(layer) == 0
        matches(got, b.reference(layer, q, qo, causal=True),
                b.reference(layer, q, qo, causal=False))
    w.close()


def test_appended_rows_are_at_flashinfer_slots(grpc_cache, client):
    """append_paged_kv_cache puts row i at position positions[i] of request
    batch_indices[i], in page kv_indices[kv_indptr[b] + pos // page_size]."""
    c = grpc_cache
    b = Batch(c, [3, 30, 17], seed=3)
    k, v, slots = b.append(1)
    c.flush(1)
    ps = c.page_size
    expected = []
    for seq, n in enumerate(b.kv_lens):
        for pos in range(n):
            expected.append(int(c.page_ids[b.pages[seq][pos // ps]]) * ps + pos % ps)
    assert slots.tolist() == expected
    got_k, got_v = client.read_kv(1, expected, out="torch")
    assert torch.equal(got_k, k) and torch.equal(got_v, v)


def test_get_batch_indices_positions_and_seq_lens_as_flashinfer_documents():
    # FlashInfer's docstring example.
    bi, pos = fi.get_batch_indices_positions(torch.tensor([0, 1, 3, 6, 10], dtype=torch.int32),
                                             torch.tensor([5, 5, 5, 5]), 10)
    assert bi.tolist() == [0, 1, 1, 2, 2, 2, 3, 3, 3, 3] and bi.dtype == torch.int32
    assert pos.tolist() == [4, 3, 4, 2, 3, 4, 1, 2, 3, 4] and pos.dtype == torch.int32
    # nnz past the rows: batch index -1, position 0 (FlashInfer's fill).
    bi, pos = fi.get_batch_indices_positions(torch.tensor([0, 2], dtype=torch.int32),
                                             torch.tensor([9]), 4)
    assert bi.tolist() == [0, 0, -1, -1] and pos.tolist() == [7, 8, 0, 0]
    out_bi, out_pos = torch.zeros(4, dtype=torch.int32), torch.zeros(4, dtype=torch.int32)
    r = fi.get_batch_indices_positions(torch.tensor([0, 2], dtype=torch.int32),
                                       torch.tensor([9]), 4, out_bi, out_pos)
    assert r[0] is out_bi and out_pos.tolist() == [7, 8, 0, 0]
    lens = fi.get_seq_lens(torch.tensor([0, 3, 4, 4]), torch.tensor([13, 8, 0]), 16)
    assert lens.tolist() == [45, 8, 0]


# ---------------------------------------------------------------- each argument
@pytest.fixture
def filled(grpc_cache):
    b = Batch(grpc_cache, [9, 40, 70], seed=4)
    b.fill()
    return b


def _q(b, rows):
    c = b.cache
    return b.randn(rows, c.num_qo_heads, c.head_dim, scale=3.0)


def test_prefill_causal_defaults_to_false(filled):
    b, c = filled, filled.cache
    qo = [0, 5, 9, 21]
    w = fi.BatchPrefillWithPagedKVCacheWrapper(c)
    plan_prefill(w, b, qo)                                  # causal left to its default
    q = _q(b, 21)
    matches(w.run(q, c[0], return_lse=True), b.reference(0, q, qo, causal=False),
            b.reference(0, q, qo, causal=True))
    plan_prefill(w, b, qo, causal=True)
    matches(w.run(q, c[0], return_lse=True), b.reference(0, q, qo, causal=True),
            b.reference(0, q, qo, causal=False))


def test_plan_keeps_a_copy_of_its_index_arrays(filled):
    """FlashInfer's plan() copies its arrays, so an engine may refill its own
    before run() (int64 here, torch.tensor's default, which numpy would
    otherwise share): run() attends with the layout that was planned."""
    b, c = filled, filled.cache
    qo = torch.tensor([0, 4, 6, 19])
    indptr, indices, last = b.indptr.long(), b.indices.long(), b.last.long()
    w = fi.BatchPrefillWithPagedKVCacheWrapper(c)
    w.plan(qo, indptr, indices, last, c.num_qo_heads, c.num_kv_heads, c.head_dim, c.page_size,
           causal=True, q_data_type=BF16)
    planned = qo.numpy().copy()
    qo[1], last[0] = 1, 1                                   # the engine's buffers, refilled
    q = _q(b, 19)
    matches(w.run(q, c[0], return_lse=True), b.reference(0, q, planned, causal=True),
            b.reference(0, q, qo.numpy(), causal=True))


def test_wrappers_dropped_without_close_hold_no_plans(filled):
    """A loop that makes a wrapper a step (FlashInfer's wrappers are cheap to
    make) runs past --max_plans_per_tenant (64): a dropped wrapper's server
    plans go at the cache's next plan."""
    b, c = filled, filled.cache
    q = _q(b, len(b.kv_lens))
    for _ in range(70):
        w = fi.BatchDecodeWithPagedKVCacheWrapper(c)
        plan_decode(w, b)
        matches(w.run(q, c[1], return_lse=True), b.reference(1, q, decode_qo(3), causal=False))


def test_a_dropped_wrappers_plans_go_only_once_its_runs_are_answered(filled, server):
    """A run still in flight when its wrapper is dropped keeps its plan: the
    cache releases the plan at a later CreatePlan, once the run has its
    answer (as a live wrapper's plan() does), never under the queued run."""
    import gc
    b, c = filled, filled.cache
    q = _q(b, len(b.kv_lens))
    w = fi.BatchDecodeWithPagedKVCacheWrapper(c)
    plan_decode(w, b)
    w.run(q, c[1])                                          # the server plan exists
    ledger = c._server_plans
    server.pause()
    try:
        future = w.run_async(q, c[1], return_lse=True)      # queued: the server is stopped
        plan_ids = frozenset(w._held.ids)
        del w
        gc.collect()
        ledger._release_abandoned()                         # what the next CreatePlan does first
        assert [ids for ids, _ in ledger._abandoned] == [plan_ids]
    finally:
        server.resume()
    matches(future.result(), b.reference(1, q, decode_qo(3), causal=False))
    w2 = fi.BatchDecodeWithPagedKVCacheWrapper(c)
    plan_decode(w2, b)
    w2.run(q, c[1])                                         # its CreatePlan releases them now
    assert ledger._abandoned == [] and not plan_ids & ledger._known


def test_a_collection_inside_the_plan_ledger_does_not_deadlock(grpc_cache):
    """weakref.finalize runs a dropped wrapper's abandon() on whatever thread
    a garbage collection runs, which may be inside the ledger's own lock."""
    import threading
    from attnserve._flashinfer_cache import _HeldPlans
    ledger = grpc_cache._server_plans

    def collect_inside_the_lock():
        with ledger._lock:
            ledger.abandon(_HeldPlans())

    t = threading.Thread(target=collect_inside_the_lock, daemon=True)
    t.start()
    t.join(10)
    assert not t.is_alive(), "abandon() waited for the lock its own thread held"


@pytest.mark.parametrize("kind", ["decode", "prefill"])
def test_sm_scale(filled, kind):
    b, c = filled, filled.cache
    w, qo, plan = _wrapper(kind, b)
    q = _q(b, qo[-1])
    plan(sm_scale=None)                                      # default 1/sqrt(head_dim)
    default = b.reference(1, q, qo, causal=False)
    other = b.reference(1, q, qo, causal=False, sm_scale=0.05)
    matches(w.run(q, c[1], return_lse=True), default, other)
    plan(sm_scale=0.05)
    matches(w.run(q, c[1], return_lse=True), other, default)
    # q_scale and k_scale multiply the scale (FlashInfer's calibration scales).
    plan(sm_scale=0.1)
    matches(w.run(q, c[1], return_lse=True, q_scale=0.25, k_scale=2.0), other,
            b.reference(1, q, qo, causal=False, sm_scale=0.1))


def _wrapper(kind, b):
    c = b.cache
    if kind == "decode":
        w = fi.BatchDecodeWithPagedKVCacheWrapper(c)
        return w, list(range(len(b.kv_lens) + 1)), lambda **kw: plan_decode(w, b, **kw)
    qo = [0, 4, 6, 19]
    w = fi.BatchPrefillWithPagedKVCacheWrapper(c)
    return w, qo, lambda **kw: plan_prefill(w, b, qo, **kw)


@pytest.mark.parametrize("kind", ["decode", "prefill"])
def test_window_left(filled, kind):
    b, c = filled, filled.cache
    w, qo, plan = _wrapper(kind, b)
    causal = kind == "prefill"
    q = _q(b, qo[-1])
    none = b.reference(0, q, qo, causal=causal)
    windowed = b.reference(0, q, qo, causal=causal,
                           options=attnserve.AttentionOptions(window_left=5))
    plan(causal=causal) if causal else plan()               # default -1: no window
    matches(w.run(q, c[0], return_lse=True), none, windowed)
    plan(causal=True, window_left=5) if causal else plan(window_left=5)
    matches(w.run(q, c[0], return_lse=True), windowed, none)
    if kind == "decode":   # FlashInfer: run's window_left is None or the plan's
        matches(w.run(q, c[0], return_lse=True, window_left=5), windowed)
        with pytest.raises(ValueError, match="window_left=7 differs from plan"):
            w.run(q, c[0], window_left=7)
    else:                  # FlashInfer: run's window_left overrides the plan's
        matches(w.run(q, c[0], return_lse=True, window_left=-1), none, windowed)


@pytest.mark.parametrize("kind", ["decode", "prefill"])
def test_the_deprecated_names_engines_still_call(filled, kind):
    """FlashInfer's begin_forward (plan), forward and forward_return_lse
    (their plan-time options replace the plan's, for later runs too; the
    prefill wrapper's causal defaults to False there) and end_forward."""
    b, c = filled, filled.cache
    w, qo, _ = _wrapper(kind, b)
    causal = kind == "prefill"
    q = _q(b, qo[-1]) * 4
    plain = b.reference(0, q, qo, causal=causal)
    varied = b.reference(0, q, qo, causal=causal, sm_scale=0.07,
                         options=attnserve.AttentionOptions(window_left=6, logits_soft_cap=3.0))
    geometry = (c.num_qo_heads, c.num_kv_heads, c.head_dim, c.page_size)
    if kind == "decode":
        w.begin_forward(b.indptr, b.indices, b.last, *geometry, q_data_type=BF16)
        extra = {}
    else:
        w.begin_forward(torch.tensor(qo, dtype=torch.int32), b.indptr, b.indices, b.last,
                        *geometry, causal=True, q_data_type=BF16)
        extra = dict(causal=True)
    o = w.forward(q, c[0], **extra)
    matches((o, w.run_return_lse(q, c[0])[1]), plain, varied)
    matches(w.forward_return_lse(q, c[0], window_left=6, logits_soft_cap=3.0, sm_scale=0.07,
                                 **extra), varied, plain)
    matches(w.run(q, c[0], return_lse=True), varied, plain)   # the options stay
    with pytest.raises(NotImplementedError, match="pos_encoding_mode='ROPE_LLAMA'"):
        w.forward(q, c[0], pos_encoding_mode="ROPE_LLAMA")
    with pytest.raises(ValueError, match="window_left=-3 must be >= -1"):
        w.forward(q, c[0], window_left=-3)
    assert w.end_forward() is None
    if kind == "prefill":                                     # forward's causal: False
        matches(w.forward_return_lse(q, c[0]), b.reference(0, q, qo, causal=False), plain)


def test_merges_of_attention_states():
    """flashinfer.cascade's merge_state, merge_state_in_place and
    merge_states against the float64 merge of the same states (rows some
    states never saw included)."""
    g = torch.Generator().manual_seed(21)
    n, h, d, k = 7, 4, 32, 3
    vs = [(torch.randn(n, h, d, generator=g) * 2).to(BF16) for _ in range(k)]
    ss = [torch.randn(n, h, generator=g) * 5 for _ in range(k)]
    ss[0][2, :] = float("-inf")                     # state 0 saw nothing of row 2
    for s in ss:
        s[5, 1] = float("-inf")                     # no state saw row 5, head 1

    def ref(idx):
        return reference_merge([(vs[i].float().numpy(), ss[i].numpy()) for i in idx])

    v2, s2 = fi.merge_state(vs[0], ss[0], vs[1], ss[1])
    assert v2.dtype == BF16 and s2.dtype == torch.float32 and tuple(v2.shape) == (n, h, d)
    matches((v2, s2), ref([0, 1]))
    assert torch.all(v2[5, 1] == 0) and s2[5, 1] == float("-inf")
    v3, s3 = fi.merge_states(torch.stack(vs, 1), torch.stack(ss, 1))
    matches((v3, s3), ref([0, 1, 2]))
    v, s = vs[0].clone(), ss[0].clone()
    fi.merge_state_in_place(v, s, vs[1], ss[1])
    assert torch.equal(v, v2) and torch.equal(s, s2)
    v, s = vs[0].clone(), ss[0].clone()
    mask = torch.tensor([True, False, True, True, False, True, False])
    fi.merge_state_in_place(v, s, vs[1], ss[1], mask=mask)
    assert torch.equal(v[mask], v2[mask]) and torch.equal(s[mask], s2[mask])
    assert torch.equal(v[~mask], vs[0][~mask]) and torch.equal(s[~mask], ss[0][~mask])
    with pytest.raises(ValueError, match=r"s_b has shape \[7, 3\], must be \[7, 4\]"):
        fi.merge_state(vs[0], ss[0], vs[1], ss[1][:, :3])
    with pytest.raises(ValueError, match="mask must be a bool tensor of shape"):
        fi.merge_state_in_place(v, s, vs[1], ss[1], mask=torch.ones(7))


@pytest.mark.parametrize("kind", ["decode", "prefill"])
def test_logits_soft_cap(filled, kind):
    b, c = filled, filled.cache
    w, qo, plan = _wrapper(kind, b)
    q = _q(b, qo[-1]) * 4
    none = b.reference(1, q, qo, causal=False)
    capped = b.reference(1, q, qo, causal=False,
                         options=attnserve.AttentionOptions(logits_soft_cap=2.0))
    plan(logits_soft_cap=None)                               # default: none
    matches(w.run(q, c[1], return_lse=True), none, capped)
    plan(logits_soft_cap=0.0)                                # 0: none
    matches(w.run(q, c[1], return_lse=True), none, capped)
    plan(logits_soft_cap=2.0)
    matches(w.run(q, c[1], return_lse=True), capped, none)


@pytest.mark.parametrize("kind", ["decode", "prefill"])
def test_sinks(filled, kind):
    b, c = filled, filled.cache
    w, qo, plan = _wrapper(kind, b)
    q = _q(b, qo[-1])
    sinks = torch.randn(c.num_qo_heads, generator=b.gen) * 2 + 3
    plan()
    none = b.reference(0, q, qo, causal=False)
    with_sinks = b.reference(0, q, qo, causal=False,
                             options=attnserve.AttentionOptions(sinks=sinks))
    matches(w.run(q, c[0], return_lse=True), none, with_sinks)
    matches(w.run(q, c[0], return_lse=True, sinks=sinks), with_sinks, none)
    with pytest.raises(ValueError, match="sinks has 3 entries, must have num_qo_heads = 8"):
        w.run(q, c[0], sinks=torch.zeros(3))


def test_v_scale_and_return_lse(filled):
    b, c = filled, filled.cache
    w = fi.BatchDecodeWithPagedKVCacheWrapper(c)
    plan_decode(w, b)
    q = _q(b, 3)
    plain = w.run(q, c[0])
    assert torch.is_tensor(plain)                            # return_lse=False: the output only
    o, lse = w.run(q, c[0], return_lse=True)
    assert torch.equal(o, plain)
    scaled = w.run(q, c[0], v_scale=0.5)
    assert torch.allclose(scaled.float(), plain.float() * 0.5, rtol=1e-2, atol=1e-3)
    o2, lse2 = w.run_return_lse(q, c[0], v_scale=0.5)        # the LSE is the logits'
    assert torch.equal(lse2, lse)


def test_out_and_lse_are_written_in_place(cache):
    b = Batch(cache, [30, 4], seed=5)
    b.fill()
    w = fi.BatchDecodeWithPagedKVCacheWrapper(cache)
    plan_decode(w, b)
    q = b.randn(2, cache.num_qo_heads, cache.head_dim, scale=2.0)
    out = torch.full_like(q, 7.0)
    lse = torch.full((2, cache.num_qo_heads), 7.0)
    o, l = w.run(q, cache[1], out=out, lse=lse, return_lse=True)
    assert o is out and l is lse
    matches((out, lse), b.reference(1, q, decode_qo(2), causal=False))
    # lse= is filled even without return_lse.
    lse.fill_(7.0)
    assert w.run(q, cache[1], out=out, lse=lse) is out
    matches((out, lse), b.reference(1, q, decode_qo(2), causal=False))
    with pytest.raises(ValueError, match=r"out has shape \[2, 8\], must be \[2, 8, 64\]"):
        w.run(q, cache[1], out=torch.empty(2, 8, dtype=BF16))
    with pytest.raises(ValueError, match="lse has dtype torch.bfloat16, must be torch.float32"):
        w.run(q, cache[1], lse=torch.empty(2, 8, dtype=BF16))


def test_q_len_per_req(filled):
    """Decode of several rows per request (speculative decoding): causal
    within the request, as FlashInfer's."""
    b, c = filled, filled.cache
    w = fi.BatchDecodeWithPagedKVCacheWrapper(c, use_tensor_cores=True)
    plan_decode(w, b, q_len_per_req=3)
    q = _q(b, 9)
    qo = [0, 3, 6, 9]
    matches(w.run(q, c[1], return_lse=True), b.reference(1, q, qo, causal=True),
            b.reference(1, q, qo, causal=False))
    with pytest.raises(ValueError, match="does not match batch_size"):
        w.run(q, c[1], q_len_per_req=2)
    short = Batch(c, [2, 40], seed=6)
    with pytest.raises(ValueError, match="q_len_per_req=3 requires kv_len >= q_len_per_req"):
        plan_decode(w, short, q_len_per_req=3)


def test_arguments_that_change_no_result(filled):
    """Arguments that in FlashInfer pick a kernel or a copy mode, or that only
    matter with RoPE in the kernel, give the same result here."""
    b, c = filled, filled.cache
    q = _q(b, 3)
    w = fi.BatchDecodeWithPagedKVCacheWrapper(c)
    plan_decode(w, b)
    base = w.run(q, c[0])
    t = fi.BatchDecodeWithPagedKVCacheWrapper(c, use_tensor_cores=True)
    plan_decode(t, b, non_blocking=False, rope_scale=2.0, rope_theta=5e5)
    assert torch.equal(t.run(q, c[0], enable_pdl=True), base)
    assert t.use_tensor_cores and not t.is_cuda_graph_enabled


def test_data_types(filled):
    """q_data_type defaults to float16 (FlashInfer's); kv_data_type to
    q_data_type; the deprecated data_type fills what is None."""
    b, c = filled, filled.cache
    w = fi.BatchDecodeWithPagedKVCacheWrapper(c)
    with pytest.raises(ValueError, match="kv_data_type=torch.float16, but the server's KV cache "
                                         "holds torch.bfloat16"):
        w.plan(b.indptr, b.indices, b.last, 8, 2, 64, 16)   # q_data_type's default: float16
    w.plan(b.indptr, b.indices, b.last, 8, 2, 64, 16, q_data_type=None, data_type="bfloat16")
    q = _q(b, 3)
    w.run(q, c[0])
    with pytest.raises(ValueError, match="q has dtype torch.float16, which does not match the "
                                         "q_data_type torch.bfloat16"):
        w.run(q.half(), c[0])
    with pytest.raises(NotImplementedError, match="o_data_type"):
        plan_decode(w, b, o_data_type=torch.float32)
    with pytest.raises(NotImplementedError, match="q_data_type=torch.float16 with "
                                                  "kv_data_type=torch.bfloat16"):
        plan_decode(w, b, q_data_type=torch.float16, kv_data_type=torch.bfloat16)
    fp8 = getattr(torch, "float8_e4m3fn", torch.float32)     # torch 2.1+
    with pytest.raises(ValueError, match=f"kv_data_type={fp8}, but the server's KV cache"):
        plan_decode(w, b, kv_data_type=fp8)


@pytest.mark.parametrize("call, name", [
    (lambda c: fi.BatchDecodeWithPagedKVCacheWrapper(c, use_cuda_graph=True), "use_cuda_graph"),
    (lambda c: fi.BatchDecodeWithPagedKVCacheWrapper(c, backend="fa2"), "backend='fa2'"),
    (lambda c: fi.BatchDecodeWithPagedKVCacheWrapper(c, jit_args=[1]), "jit_args"),
    (lambda c: fi.BatchDecodeWithPagedKVCacheWrapper(c, "HND"), "kv_layout='HND'"),
    (lambda c: fi.BatchPrefillWithPagedKVCacheWrapper(c, custom_mask_buf=torch.zeros(1)),
     "custom_mask_buf"),
    (lambda c: fi.BatchPrefillWithPagedKVCacheWrapper(c, use_cuda_graph=True,
                                                      qo_indptr_buf=torch.zeros(2)),
     "use_cuda_graph=True"),
])
def test_unsupported_constructor_options_are_named(grpc_cache, call, name):
    with pytest.raises(NotImplementedError, match=name.replace("(", r"\(")):
        call(grpc_cache)


@pytest.mark.parametrize("kind, kwargs, name", [
    ("decode", dict(pos_encoding_mode="ROPE_LLAMA"), "pos_encoding_mode='ROPE_LLAMA'"),
    ("decode", dict(window_right=3), "window_right=3"),
    ("decode", dict(fixed_split_size=4), "fixed_split_size=4"),
    ("decode", dict(disable_split_kv=True), "disable_split_kv=True"),
    ("decode", dict(block_tables=torch.zeros(1, 1)), "block_tables"),
    ("prefill", dict(custom_mask=torch.ones(10, dtype=torch.bool)), "custom_mask"),
    ("prefill", dict(pos_encoding_mode="ALIBI"), "pos_encoding_mode='ALIBI'"),
    ("prefill", dict(use_fp16_qk_reduction=True), "use_fp16_qk_reduction=True"),
    ("prefill", dict(head_dim_vo=32), "head_dim_vo=32"),
    ("prefill", dict(prefix_len_ptr=torch.zeros(3)), "prefix_len_ptr"),
])
def test_unsupported_plan_options_are_named(filled, kind, kwargs, name):
    w, qo, plan = _wrapper(kind, filled)
    with pytest.raises(NotImplementedError, match=name):
        plan(**kwargs)


@pytest.mark.parametrize("kind", ["decode", "prefill"])
def test_flashinfers_no_split_and_workspace_reset_are_taken(filled, client, kind):
    """fixed_split_size=-1 is FlashInfer's "no fixed split" (engines pass it
    by default); reset_workspace_buffer takes torch tensors (the server keeps
    the workspace) or the wrapper's own cache, and refuses another cache."""
    w, qo, plan = _wrapper(kind, filled)
    plan(fixed_split_size=-1)
    q = _q(filled, qo[-1])
    want = w.run(q, filled.cache[0])
    w.reset_workspace_buffer(torch.empty(1024, dtype=torch.uint8),
                             torch.empty(1024, dtype=torch.uint8))
    w.reset_workspace_buffer(filled.cache, torch.empty(8, dtype=torch.uint8))
    assert torch.equal(w.run(q, filled.cache[0]), want)
    other = fi.PagedKVCache(client, max_num_pages=1)
    try:
        with pytest.raises(ValueError, match="a PagedKVCache other than this wrapper's"):
            w.reset_workspace_buffer(other, torch.empty(8))
    finally:
        other.close()
    with pytest.raises(TypeError, match="int_workspace_buffer: a torch tensor expected"):
        w.reset_workspace_buffer(filled.cache, None)


@pytest.mark.parametrize("kind, kwargs, name", [
    ("decode", dict(skip_softmax_threshold_scale_factor=0.5), "skip_softmax_threshold"),
    ("decode", dict(kv_cache_sf=torch.zeros(1)), "kv_cache_sf"),
    ("prefill", dict(use_fp16_softmax=True), "use_fp16_softmax=True"),
    ("prefill", dict(uses_spcompress=True), "uses_spcompress=True"),
    ("decode", dict(k_scale=torch.ones(2)), "k_scale of 2 values"),
])
def test_unsupported_run_options_are_named(filled, kind, kwargs, name):
    w, qo, plan = _wrapper(kind, filled)
    plan()
    with pytest.raises(NotImplementedError, match=name):
        w.run(_q(filled, qo[-1]), filled.cache[0], **kwargs)
    with pytest.raises(NotImplementedError, match=r"run\(\)'s \*args"):
        w.run(_q(filled, qo[-1]), filled.cache[0], torch.zeros(1))


def test_bad_inputs_name_the_argument(filled, client):
    b, c = filled, filled.cache
    w = fi.BatchDecodeWithPagedKVCacheWrapper(c)
    q = _q(b, 3)
    with pytest.raises(RuntimeError, match=r"run\(\) before plan\(\)"):
        w.run(q, c[0])
    bad = [
        (dict(num_qo_heads=16), "num_qo_heads=16, but the server's KV cache has 8"),
        (dict(page_size=32), "page_size=32, but the server's KV cache has 16"),
        (dict(indices=torch.cat([b.indices[:2], torch.tensor([48], dtype=torch.int32),
                                 b.indices[3:]])),
         r"indices holds page 48, outside \[0, 48\)"),
        (dict(last_page_len=torch.tensor([9, 17, 6], dtype=torch.int32)),
         r"last_page_len\[1\]=17 must be in \[1, page_size=16\]"),
        (dict(indptr=torch.tensor([0, 1, 4], dtype=torch.int32)),
         r"indptr has 3 entries, must have len\(last_page_len\) \+ 1 = 4"),
        (dict(indptr=torch.tensor([0, 3, 1, 8], dtype=torch.int32)), "must be non-decreasing"),
        (dict(window_left=-2), "window_left=-2 must be >= -1"),
        (dict(logits_soft_cap=-1.0), r"logits_soft_cap=-1.0 must be None or 0 \(no soft-cap\) or in \[1e-30, 1e30\]"),
        (dict(logits_soft_cap=2.4e38), r"logits_soft_cap=2.4e\+38 must be None or 0 \(no soft-cap\) or in \[1e-30, 1e30\]"),
        (dict(sm_scale=float("nan")), r"sm_scale=nan must be finite with \|sm_scale\| <= 1e30"),
        (dict(sm_scale=-3e38), r"sm_scale=-3e\+38 must be finite with \|sm_scale\| <= 1e30"),
        (dict(indices=torch.zeros(8)), "indices: an integer tensor expected"),
    ]
    for change, message in bad:
        args = dict(indptr=b.indptr, indices=b.indices, last_page_len=b.last, num_qo_heads=8,
                    num_kv_heads=2, head_dim=64, page_size=16, q_data_type=BF16)
        args.update(change)
        with pytest.raises((ValueError, TypeError), match=message):
            w.plan(**args)
    plan_decode(w, b)
    with pytest.raises(ValueError, match=r"q has shape \[4, 8, 64\], the plan needs \[3, 8, 64\]"):
        w.run(_q(b, 4), c[0])
    with pytest.raises(TypeError, match="paged_kv_cache: an attnserve.flashinfer.LayerCache"):
        w.run(q, torch.zeros(1))
    with fi.PagedKVCache(client, 1) as other:
        with pytest.raises(ValueError, match="a layer of another PagedKVCache"):
            w.run(q, other[0])
        with pytest.raises(TypeError, match="float_workspace_buffer: an attnserve.flashinfer."
                                            "PagedKVCache expected"):
            fi.BatchDecodeWithPagedKVCacheWrapper(torch.empty(16, dtype=torch.uint8))
    with pytest.raises(ValueError, match="transport='udp' must be one of"):
        fi.PagedKVCache(client, 4, transport="udp")
    with pytest.raises(ValueError, match="max_num_pages=0 must be >= 1"):
        fi.PagedKVCache(client, 0)
    with pytest.raises(attnserve.InvalidArgument, match="count=100000"):
        fi.PagedKVCache(client, 100000)
    with pytest.raises(RuntimeError, match="transport='cuda' needs a GPU here"):
        fi.PagedKVCache(client, 4, transport="cuda")


def test_append_errors_name_the_argument(filled):
    b, c = filled, filled.cache
    k = b.randn(2, c.num_kv_heads, c.head_dim)
    bi = torch.tensor([0, 1], dtype=torch.int32)
    pos = torch.tensor([8, 39], dtype=torch.int32)
    args = (bi, pos, c[0], b.indices, b.indptr, b.last)
    fi.append_paged_kv_cache(k, k, *args)
    assert c.pending_rows(0) == 2
    c.flush()
    with pytest.raises(ValueError, match=r"positions\[1\]=40 is outside request 1's \[0, 40\)"):
        fi.append_paged_kv_cache(k, k, bi, torch.tensor([8, 40], dtype=torch.int32), c[0],
                                 b.indices, b.indptr, b.last)
    with pytest.raises(ValueError, match=r"batch_indices must be in \[0, 3\)"):
        fi.append_paged_kv_cache(k, k, torch.tensor([0, 3], dtype=torch.int32), pos, c[0],
                                 b.indices, b.indptr, b.last)
    with pytest.raises(ValueError, match="append_key has dtype torch.float32"):
        fi.append_paged_kv_cache(k.float(), k, *args)
    with pytest.raises(ValueError, match=r"append_value has shape \[2, 2, 32\]"):
        fi.append_paged_kv_cache(k, k[..., :32], *args)
    with pytest.raises(TypeError, match="paged_kv_cache: an attnserve.flashinfer.LayerCache"):
        fi.append_paged_kv_cache(k, k, bi, pos, torch.zeros(4), b.indices, b.indptr, b.last)
    with pytest.raises(NotImplementedError, match="kv_layout='HND'"):
        fi.append_paged_kv_cache(k, k, *args, kv_layout="HND")
    assert c.pending_rows(0) == 0


# ---------------------------------------------------------------- plans and leases
def test_a_plan_per_step_released_at_the_next(grpc_cache, client):
    c = grpc_cache
    b = Batch(c, [12, 30], seed=7)
    b.fill()
    w = fi.BatchDecodeWithPagedKVCacheWrapper(c)

    def held():
        return client.list_holdings(c.lease_id).leases[0].holdings
    assert held().pages == tuple(sorted(c.page_ids.tolist()))
    previous = None
    for step in range(3):
        plan_decode(w, b)
        for layer in range(c.num_layers):
            w.run(_q(b, 2), c[layer])
        w._settle_releases()               # the last step's ReleasePlan has been answered
        plans = held().plans
        # One server plan for every layer of the step; the last step's is gone.
        assert len(plans) == 1 and plans[0] != previous, (step, plans, previous)
        previous = plans[0]
    plan_decode(w, b)
    w._settle_releases()
    assert held().plans == ()              # released by the next plan()
    w.run(_q(b, 2), c[0])
    assert len(held().plans) == 1
    w.close()
    assert held().plans == ()


@pytest.mark.parametrize("lost", ["CreatePlan", "ReleasePlan"])
def test_a_lost_plan_reply_holds_no_server_plan_past_the_next_step(server, client, lost):
    """A CreatePlan whose reply was lost made a plan the wrapper never
    learned of, and a ReleasePlan that failed UNAVAILABLE may have left one:
    both stayed under the cache's lease until cache.close() or the idle
    timeout (300 s), and counted against --max_plans_per_tenant. The next
    CreatePlan now lists the lease's plans and releases those no wrapper
    knows of."""
    from faults import REPLY_LOST, UNREACHABLE, FaultInjector
    faults = FaultInjector(1)
    c_rpc = attnserve.Client(server.address, timeout=60, interceptors=faults.interceptors)
    cache = fi.PagedKVCache(c_rpc, 8)
    try:
        b = Batch(cache, [12, 30], seed=21)
        b.fill()
        w = fi.BatchDecodeWithPagedKVCacheWrapper(cache)

        def held():
            return client.list_holdings(cache.lease_id).leases[0].holdings.plans
        plan_decode(w, b)
        if lost == "CreatePlan":
            faults.fail_next("CreatePlan", REPLY_LOST)
            with pytest.raises(attnserve.DeadlineExceeded):
                w.run(_q(b, 2), cache[0])
            assert len(held()) == 1 and not w._plans   # the orphan
        else:
            w.run(_q(b, 2), cache[0])
            faults.fail_next("ReleasePlan", UNREACHABLE)  # UNAVAILABLE: not released
            plan_decode(w, b)                            # releases the last step's plan
            w._settle_releases()
            assert len(held()) == 1 and not w._plans     # the orphan
        w.run(_q(b, 2), cache[1])
        assert held() == tuple(w._plans.values())        # only this step's plan
        w.close()
        assert held() == ()
    finally:
        cache.close()
        c_rpc.close()


def test_settling_a_lost_plan_reply_spares_the_plans_other_threads_make(server, client):
    """The release of plans no wrapper knows of (after a lost CreatePlan
    reply) compares the lease's plans with those the wrappers know once the
    list is in: a plan another thread's wrapper made while ListHoldings was
    on its way is known by then and stays (before, it was released and that
    wrapper's next run() failed NotFound)."""
    import threading

    import grpc
    from faults import REPLY_LOST, FaultInjector

    class SlowList(grpc.UnaryUnaryClientInterceptor):
        armed = False

        def intercept_unary_unary(self, continuation, details, request):
            if self.armed and details.method.endswith("/ListHoldings"):
                self.armed = False
                time.sleep(0.5)
            return continuation(details, request)
    faults, slow = FaultInjector(1), SlowList()
    rpc = attnserve.Client(server.address, timeout=60,
                           interceptors=lambda t: faults.interceptors(t) + [slow])
    cache = fi.PagedKVCache(rpc, 8)
    try:
        b = Batch(cache, [12, 30], seed=22)
        b.fill()
        wa = fi.BatchDecodeWithPagedKVCacheWrapper(cache)
        wb = fi.BatchDecodeWithPagedKVCacheWrapper(cache)
        plan_decode(wa, b)
        plan_decode(wb, b)
        faults.fail_next("CreatePlan", REPLY_LOST)
        with pytest.raises(attnserve.DeadlineExceeded):
            wa.run(_q(b, 2), cache[0])
        slow.armed = True
        t = threading.Thread(target=lambda: wa.run(_q(b, 2), cache[0]))
        t.start()                       # settles: its ListHoldings is slow
        time.sleep(0.1)
        wb.run(_q(b, 2), cache[0])      # wb's CreatePlan lands meanwhile
        t.join()
        wb.run(_q(b, 2), cache[1])
        held = client.list_holdings(cache.lease_id).leases[0].holdings.plans
        assert sorted(held) == sorted([*wa._plans.values(), *wb._plans.values()])
        wa.close()
        wb.close()
    finally:
        cache.close()
        rpc.close()


def test_close_frees_everything(client):
    free = client.info().free_pages
    for transport in TRANSPORTS:
        cache = fi.PagedKVCache(client, 20, transport=transport)
        b = Batch(cache, [30], seed=8)
        b.fill()
        w = fi.BatchDecodeWithPagedKVCacheWrapper(cache)
        plan_decode(w, b)
        w.run(_q(b, 1), cache[0])
        assert client.info().free_pages == free - 20
        lease = cache.lease_id
        cache.close()
        assert client.info().free_pages == free
        assert all(l.lease_id != lease for l in client.list_holdings().leases)
        with pytest.raises(RuntimeError, match="closed"):
            w.run(_q(b, 1), cache[0])


# ---------------------------------------------------------------- futures
def test_futures_overlap_and_agree(cache):
    b = Batch(cache, [50, 3, 17, 29], seed=9)
    b.fill()
    w = fi.BatchDecodeWithPagedKVCacheWrapper(cache)
    plan_decode(w, b)
    qs = [_q(b, 4) for _ in range(10)]
    # More calls in flight than the transport's slots (4): the oldest is
    # waited for to free its slot; every result still comes out right.
    futures = [w.run_async(q, cache[i % 2], return_lse=True) for i, q in enumerate(qs)]
    for i, (q, f) in enumerate(zip(qs, futures)):
        got = f.result()
        assert f.done()
        matches(got, b.reference(i % 2, q, decode_qo(4), causal=False))
        assert f.result() is not None  # a second result() returns it again

    async def main():
        fs = [w.run_async(q, cache[0]) for q in qs[:3]]
        return await asyncio.gather(*fs)
    outs = asyncio.run(main())
    for q, o in zip(qs[:3], outs):
        assert torch.equal(o, w.run(q, cache[0]))


def test_plan_while_runs_are_in_flight(cache, client):
    """The next step's plan() may come while the last step's runs are still
    queued (run_async, then plan(), then the results): each run keeps the
    plan it was made under until it has its answer; then that plan is
    released. Before, plan() released the server plans at once, and queued
    runs failed with NOT_FOUND naming their plan_id."""
    def plans_held():
        h = client.list_holdings()
        return len(h.unleased.plans) + sum(len(x.holdings.plans) for x in h.leases)
    held_before = plans_held()
    b = Batch(cache, [120, 47, 190, 96, 80, 33, 100, 60], seed=12)   # all 48 pages
    b.fill()
    w = fi.BatchDecodeWithPagedKVCacheWrapper(cache)
    for step in range(10):
        plan_decode(w, b)
        qs = [_q(b, 8) for _ in range(8)]
        futures = [w.run_async(q, cache[i % 2], return_lse=True) for i, q in enumerate(qs)]
        plan_decode(w, b)                    # the next step's plan, runs still in flight
        for i, (q, f) in enumerate(zip(qs, futures)):
            matches(f.result(), b.reference(i % 2, q, decode_qo(8), causal=False))
    # The earlier steps' plans are released as their runs are answered, and
    # close() releases the rest: the wrapper holds none.
    w.close()
    assert plans_held() == held_before


def test_future_errors_and_timeouts(grpc_cache):
    c = grpc_cache
    b = Batch(c, [20], seed=10)
    b.fill()
    w = fi.BatchPrefillWithPagedKVCacheWrapper(c)
    plan_prefill(w, b, [0, 25])          # 25 query rows over 20 keys, causal off: fine
    f = w.run_async(_q(b, 25), c[0])
    assert f.result(timeout=60).shape == (25, 8, 64)
    # A server refusal arrives typed, from result().
    w2 = fi.BatchDecodeWithPagedKVCacheWrapper(c)
    plan_decode(w2, b)
    fake = w2.run_async(_q(b, 1), c[0], sinks=torch.full((8,), float("nan")))
    with pytest.raises(attnserve.InvalidArgument, match="options.sinks"):
        fake.result()


def test_run_over_grpc_is_one_blocking_call(grpc_cache):
    # run() waits at once, so it makes the blocking call (no gRPC future and
    # its helper thread); run_async() starts a future. Both deliver a
    # server's refusal typed.
    c = grpc_cache
    b = Batch(c, [20, 9], seed=16)
    b.fill()
    w = fi.BatchDecodeWithPagedKVCacheWrapper(c)
    plan_decode(w, b)
    q = _q(b, 2)
    real_future, real_now = c.rpc._call_future, c.rpc._call_now

    def refuse(*args, **kwargs):
        raise AssertionError("the other kind of call was made")
    c.rpc._call_future = refuse
    try:
        matches(w.run(q, c[1], return_lse=True), b.reference(1, q, decode_qo(2), causal=False))
        with pytest.raises(attnserve.InvalidArgument, match="options.sinks"):
            w.run(q, c[0], sinks=torch.full((8,), float("nan")))
    finally:
        c.rpc._call_future = real_future
    c.rpc._call_now = refuse
    try:
        f = w.run_async(q, c[0], return_lse=True)
        matches(f.result(), b.reference(0, q, decode_qo(2), causal=False))
    finally:
        c.rpc._call_now = real_now


def test_a_refused_blocking_run_over_a_region_frees_its_area(client):
    # run() over a system region without a channel makes its call blocking;
    # a refusal (a known outcome) must give its area back, as a future's
    # does, so more refusals than areas leave every area free and usable.
    with fi.PagedKVCache(client, 16, transport="shm") as c:
        b = Batch(c, [12, 7], seed=17)
        b.fill()
        w = fi.BatchDecodeWithPagedKVCacheWrapper(c)
        plan_decode(w, b)
        q = _q(b, 2)
        t = c._transport
        for _ in range(len(t.areas) + 3):
            with pytest.raises(attnserve.InvalidArgument, match="options.sinks"):
                w.run(q, c[0], sinks=torch.full((8,), float("nan")))
        assert sorted(t._free) == list(range(len(t.areas)))
        assert not t._in_flight
        matches(w.run(q, c[0], return_lse=True), b.reference(0, q, decode_qo(2), causal=False))


def test_large_calls_fall_back_to_grpc(client):
    with fi.PagedKVCache(client, 16, transport="channel", max_rows=4) as c:
        b = Batch(c, [40, 33], seed=11)
        b.fill()
        w = fi.BatchPrefillWithPagedKVCacheWrapper(c)
        plan_prefill(w, b, [0, 10, 20], causal=True)
        for layer in range(c.num_layers):
            q = _q(b, 20)
            matches(w.run(q, c[layer], return_lse=True),
                    b.reference(layer, q, [0, 10, 20], causal=True))


# ---------------------------------------------------------------- channels
def test_shared_memory_needs_the_servers_flag():
    with TestServer() as plain:
        with attnserve.Client(plain.address, timeout=30) as c:
            with pytest.raises(attnserve.FailedPrecondition, match="allow_shared_memory"):
                fi.PagedKVCache(c, 4, transport="channel")
            assert c.info().free_pages == plain.geometry["num_pages"]   # nothing left held


KILLED_CLIENT = textwrap.dedent("""
    import sys, torch
    import attnserve, attnserve.flashinfer as fi
    client = attnserve.Client(sys.argv[1], timeout=30)
    cache = fi.PagedKVCache(client, 10, transport="channel", lease_ttl=1)
    w = fi.BatchDecodeWithPagedKVCacheWrapper(cache)
    w.plan(torch.tensor([0, 1], dtype=torch.int32), torch.tensor([0], dtype=torch.int32),
           torch.tensor([1], dtype=torch.int32), 8, 2, 64, 16, q_data_type=torch.bfloat16)
    k = torch.randn(1, 2, 64).bfloat16()
    fi.append_paged_kv_cache(k, k, torch.tensor([0]), torch.tensor([0]), cache[0],
                             torch.tensor([0]), torch.tensor([0, 1]), torch.tensor([1]))
    w.run(torch.randn(1, 8, 64).bfloat16(), cache[0])
    print(cache.lease_id, flush=True)
    while True:
        w.run(torch.randn(1, 8, 64).bfloat16(), cache[0])
""")


def test_a_killed_client_leaves_the_server_serving(server, client):
    free = client.info().free_pages
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    proc = subprocess.Popen([sys.executable, "-c", KILLED_CLIENT, server.address],
                            stdout=subprocess.PIPE, text=True, env=env)
    try:
        lease = int(proc.stdout.readline())
        assert lease != 0
        os.kill(proc.pid, signal.SIGKILL)          # in the middle of its channel calls
    finally:
        proc.wait()
    assert client.health() == "SERVING"
    # Its lease lapses (ttl 1 s): pages, plan, region and channel released.
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if all(l.lease_id != lease for l in client.list_holdings().leases):
            break
        time.sleep(0.2)
    assert all(l.lease_id != lease for l in client.list_holdings().leases)
    assert client.info().free_pages == free
    assert not [r for r in client.list_regions() if r.name.startswith("attnserve-fi-")]
    # The server serves the next client through a channel as before.
    with fi.PagedKVCache(client, 8, transport="channel") as c:
        b = Batch(c, [5], seed=13)
        b.fill()
        w = fi.BatchDecodeWithPagedKVCacheWrapper(c)
        plan_decode(w, b)
        q = _q(b, 1)
        matches(w.run(q, c[0], return_lse=True), b.reference(0, q, decode_qo(1), causal=False))


def test_appends_of_a_run_that_was_not_sent_stay_queued(grpc_cache):
    c = grpc_cache
    kv_lens, q_lens = [10, 25], [2, 5]
    b = Batch(c, kv_lens, seed=14)
    b.fill([n - q for n, q in zip(kv_lens, q_lens)])
    qo = [0, 2, 7]
    w = fi.BatchPrefillWithPagedKVCacheWrapper(c)
    plan_prefill(w, b, qo, causal=True)
    b.append(0, q_lens)
    q = _q(b, 7)
    with pytest.raises(ValueError, match="options.window_left=1099511627776 does not fit"):
        w.run(q, c[0], window_left=1 << 40)
    assert c.pending_rows(0) == 7                 # not sent: still queued
    matches(w.run(q, c[0], return_lse=True), b.reference(0, q, qo, causal=True))
    assert c.pending_rows(0) == 0


def test_a_flush_that_fails_keeps_its_appends_queued(grpc_cache, client):
    c = grpc_cache
    b = Batch(c, [6, 11], seed=15)
    k, v, slots = b.append(1)
    real = c.rpc.write_kv

    def failing(*args, **kwargs):
        raise ConnectionError("write_kv failed")
    c.rpc.write_kv = failing
    try:
        with pytest.raises(ConnectionError, match="write_kv failed"):
            c.flush(1)
    finally:
        c.rpc.write_kv = real
    assert c.pending_rows(1) == 17                 # requeued, not dropped
    c.flush(1)
    assert c.pending_rows(1) == 0
    got_k, got_v = client.read_kv(1, slots.tolist(), out="torch")
    assert torch.equal(got_k, k) and torch.equal(got_v, v)


# FlashInfer 0.6's public signatures (flashinfer/decode.py, prefill.py,
# page.py): every parameter's name, kind and default, in order.
_E = "<required>"
FLASHINFER_SIGNATURES = {
    "BatchDecodeWithPagedKVCacheWrapper.__init__": [
        ("float_workspace_buffer", _E), ("kv_layout", "NHD"), ("use_cuda_graph", False),
        ("use_tensor_cores", False), ("paged_kv_indptr_buffer", None),
        ("paged_kv_indices_buffer", None), ("paged_kv_last_page_len_buffer", None),
        ("backend", "auto"), ("jit_args", None)],
    "BatchDecodeWithPagedKVCacheWrapper.plan": [
        ("indptr", _E), ("indices", _E), ("last_page_len", _E), ("num_qo_heads", _E),
        ("num_kv_heads", _E), ("head_dim", _E), ("page_size", _E),
        ("pos_encoding_mode", "NONE"), ("window_left", -1), ("logits_soft_cap", None),
        ("q_data_type", "float16"), ("kv_data_type", None), ("o_data_type", None),
        ("data_type", None), ("sm_scale", None), ("rope_scale", None), ("rope_theta", None),
        ("non_blocking", True), ("block_tables", None), ("seq_lens", None),
        ("fixed_split_size", None), ("disable_split_kv", False), ("q_len_per_req", 1),
        ("*window_right", 0)],
    "BatchDecodeWithPagedKVCacheWrapper.run": [
        ("q", _E), ("paged_kv_cache", _E), ("*args", _E), ("*q_scale", None),
        ("*k_scale", None), ("*v_scale", None), ("*out", None), ("*lse", None),
        ("*return_lse", False), ("*enable_pdl", None), ("*window_left", None),
        ("*sinks", None), ("*q_len_per_req", None),
        ("*skip_softmax_threshold_scale_factor", None), ("*kv_cache_sf", None)],
    "BatchPrefillWithPagedKVCacheWrapper.__init__": [
        ("float_workspace_buffer", _E), ("kv_layout", "NHD"), ("use_cuda_graph", False),
        ("qo_indptr_buf", None), ("paged_kv_indptr_buf", None), ("paged_kv_indices_buf", None),
        ("paged_kv_last_page_len_buf", None), ("custom_mask_buf", None),
        ("mask_indptr_buf", None), ("backend", "auto"), ("jit_args", None),
        ("jit_kwargs", None)],
    "BatchPrefillWithPagedKVCacheWrapper.plan": [
        ("qo_indptr", _E), ("paged_kv_indptr", _E), ("paged_kv_indices", _E),
        ("paged_kv_last_page_len", _E), ("num_qo_heads", _E), ("num_kv_heads", _E),
        ("head_dim_qk", _E), ("page_size", _E), ("head_dim_vo", None), ("custom_mask", None),
        ("packed_custom_mask", None), ("causal", False), ("pos_encoding_mode", "NONE"),
        ("use_fp16_qk_reduction", False), ("sm_scale", None), ("window_left", -1),
        ("logits_soft_cap", None), ("rope_scale", None), ("rope_theta", None),
        ("q_data_type", "float16"), ("kv_data_type", None), ("o_data_type", None),
        ("non_blocking", True), ("prefix_len_ptr", None), ("token_pos_in_items_ptr", None),
        ("token_pos_in_items_len", 0), ("max_item_len_ptr", None), ("seq_lens", None),
        ("seq_lens_q", None), ("block_tables", None), ("max_token_per_sequence", None),
        ("max_sequence_kv", None), ("fixed_split_size", None), ("disable_split_kv", False)],
    "BatchPrefillWithPagedKVCacheWrapper.run": [
        ("q", _E), ("paged_kv_cache", _E), ("*args", _E), ("*q_scale", None),
        ("*k_scale", None), ("*v_scale", None), ("*out", None), ("*lse", None),
        ("*return_lse", False), ("*enable_pdl", None), ("*window_left", None),
        ("*sinks", None), ("*kv_cache_sf", None),
        ("*skip_softmax_threshold_scale_factor", None), ("*use_fp16_softmax", None),
        ("*uses_spcompress", None)],
    "BatchDecodeWithPagedKVCacheWrapper.reset_workspace_buffer": [
        ("float_workspace_buffer", _E), ("int_workspace_buffer", _E)],
    "BatchPrefillWithPagedKVCacheWrapper.reset_workspace_buffer": [
        ("float_workspace_buffer", _E), ("int_workspace_buffer", _E)],
    "append_paged_kv_cache": [
        ("append_key", _E), ("append_value", _E), ("batch_indices", _E), ("positions", _E),
        ("paged_kv_cache", _E), ("kv_indices", _E), ("kv_indptr", _E),
        ("kv_last_page_len", _E), ("kv_layout", "NHD")],
    "get_batch_indices_positions": [
        ("append_indptr", _E), ("seq_lens", _E), ("nnz", _E), ("batch_indices", None),
        ("positions", None)],
    "get_seq_lens": [("kv_indptr", _E), ("kv_last_page_len", _E), ("page_size", _E)],
}


@pytest.mark.parametrize("name", sorted(FLASHINFER_SIGNATURES))
def test_signatures_are_flashinfers(name):
    import inspect
    obj = fi
    for part in name.split("."):
        obj = getattr(obj, part)
    got = []
    for p in inspect.signature(obj).parameters.values():
        if p.name == "self":
            continue
        star = "*" if p.kind in (p.KEYWORD_ONLY, p.VAR_POSITIONAL) else ""
        default = _E if p.default is p.empty else p.default
        got.append((star + p.name, default))
    assert got == FLASHINFER_SIGNATURES[name]
    # run_async takes run's arguments.
    if name.endswith(".run"):
        asynchronous = getattr(getattr(fi, name.split(".")[0]), "run_async")
        assert list(inspect.signature(asynchronous).parameters) == \
            list(inspect.signature(obj).parameters)


# ---------------------------------------------------------------- queued appends
def test_appends_to_one_position_keep_the_last_as_flashinfer_does(cache):
    """Two appends to the same position before a run: FlashInfer's later write
    wins. The queue sends one row a slot (the server refuses a request that
    writes a slot twice; before, the layer's runs failed for good)."""
    b = Batch(cache, [5, 9], seed=40)
    b.fill([4, 9])
    w = fi.BatchDecodeWithPagedKVCacheWrapper(cache)
    plan_decode(w, b)
    bi, pos = torch.tensor([0], dtype=torch.int32), torch.tensor([4], dtype=torch.int32)
    for k in (b.randn(1, 2, 64), b.randn(1, 2, 64)):
        fi.append_paged_kv_cache(k, k, bi, pos, cache[0], b.indices, b.indptr, b.last)
    b.mirror.write(0, b.slots(bi, pos), k, k)             # the second
    q = b.randn(2, 8, 64)
    matches(w.run(q, cache[0], return_lse=True), b.reference(0, q, decode_qo(2), causal=False))
    assert cache.pending_rows(0) == 0
    w.close()


def test_a_run_that_fails_keeps_its_rows_queued_for_the_next(cache, client):
    """A run() the server refuses (or whose outcome is unknown) queues its
    appended rows again, in front: the next run() of the layer writes them.
    Appending them again as well is harmless (one row a slot)."""
    kv_lens, q_lens = [10, 25], [2, 5]
    b = Batch(cache, kv_lens, seed=41)
    b.fill([n - q for n, q in zip(kv_lens, q_lens)])
    qo = [0, 2, 7]
    w = fi.BatchPrefillWithPagedKVCacheWrapper(cache)
    plan_prefill(w, b, qo, causal=True)
    k, v, slots = b.append(0, q_lens)
    q = b.randn(7, 8, 64)
    for run in (lambda **kw: w.run(q, cache[0], **kw),
                lambda **kw: w.run_async(q, cache[0], **kw).result()):
        with pytest.raises(attnserve.InvalidArgument, match=r"options.sinks\[0\]=nan"):
            run(sinks=torch.full((8,), float("nan")))
        assert cache.pending_rows(0) == 7
    fi.append_paged_kv_cache(k, v, *fi.get_batch_indices_positions(
        torch.tensor(qo, dtype=torch.int32), torch.tensor(kv_lens), 7), cache[0], b.indices,
        b.indptr, b.last)                                 # as the docs once advised
    assert cache.pending_rows(0) == 14
    matches(w.run(q, cache[0], return_lse=True), b.reference(0, q, qo, causal=True))
    assert cache.pending_rows(0) == 0
    k_back, v_back = client.read_kv(0, slots.tolist(), out="torch")
    assert torch.equal(k_back, k) and torch.equal(v_back, v)
    w.close()


def test_each_wrapper_of_a_layer_takes_its_own_rows(client):
    """A mixed step: a prefill wrapper and a decode wrapper on one layer, each
    batch with its own appends, run at once (run_async). Each run writes the
    rows of the pages it reads; the others wait for their own run. Before, the
    prefill took the decode rows too, and the decode could read them first."""
    with fi.PagedKVCache(client, 64, transport="channel") as c:
        pre = Batch(c, [120], seed=42)
        dec = Batch(c, [30, 30], seed=43)
        free = [p for p in range(64) if p not in set(pre.indices.tolist())]
        dec.indices = torch.tensor(free[:len(dec.indices)], dtype=torch.int32)
        dec.server_pages = c.page_ids[dec.indices.numpy()]
        dec.fill([29, 29])
        pw = fi.BatchPrefillWithPagedKVCacheWrapper(c)
        dw = fi.BatchDecodeWithPagedKVCacheWrapper(c)
        plan_prefill(pw, pre, [0, 120], causal=True)
        plan_decode(dw, dec)
        for layer in range(c.num_layers):
            pre.append(layer)
            dec.append(layer, [1, 1], [30, 30])
            qp, qd = pre.randn(120, 8, 64), dec.randn(2, 8, 64)
            fp = pw.run_async(qp, c[layer], return_lse=True)
            assert c.pending_rows(layer) == 2                 # the decode rows
            fd = dw.run_async(qd, c[layer], return_lse=True)
            assert c.pending_rows(layer) == 0
            matches(fd.result(), dec.reference(layer, qd, decode_qo(2), causal=False))
            matches(fp.result(), pre.reference(layer, qp, [0, 120], causal=True))
        # Rows no run reads wait for flush(), or are dropped by discard_pending().
        dec.append(0, [1, 1], [30, 30])
        pre_only = pw.run(pre.randn(120, 8, 64), c[0])
        assert pre_only.shape == (120, 8, 64) and c.pending_rows(0) == 2
        assert c.discard_pending(0) == 2 and c.pending_rows(0) == 0
        pw.close()
        dw.close()


def test_a_refused_plan_changes_nothing_and_requests_without_pages_are_empty(grpc_cache):
    c = grpc_cache
    b = Batch(c, [20, 9], seed=44)
    b.fill()
    w = fi.BatchDecodeWithPagedKVCacheWrapper(c, use_tensor_cores=True)
    plan_decode(w, b, q_len_per_req=3)
    qo = [0, 3, 6]
    with pytest.raises(ValueError, match="logits_soft_cap"):
        plan_decode(w, b, q_len_per_req=1, logits_soft_cap=-1.0)
    q = b.randn(6, 8, 64)
    matches(w.run(q, c[1], return_lse=True), b.reference(1, q, qo, causal=True),
            b.reference(1, q, qo, causal=False))       # still the 3-row plan's causal mask
    # A request without pages has no keys, whatever its last_page_len (as in
    # FlashInfer, where engines pass ones).
    e = Batch(c, [20, 0], seed=45)
    e.fill()
    e.last = torch.tensor([int(e.last[0]), 1], dtype=torch.int32)
    plan_decode(w, e)
    q = e.randn(2, 8, 64)
    out, lse = w.run(q, c[0], return_lse=True)
    e.last = torch.tensor([int(e.last[0]), 0], dtype=torch.int32)
    matches((out, lse), e.reference(0, q, decode_qo(2), causal=False))
    assert torch.all(out[1] == 0) and torch.all(torch.isinf(lse[1]))
    for kw, text in ((dict(window_left=None), r"window_left=None: an integer expected"),
                     (dict(sm_scale="x"), r"sm_scale='x': a number expected"),
                     (dict(logits_soft_cap="x"), r"logits_soft_cap='x': a number expected")):
        with pytest.raises(TypeError, match=text):
            plan_decode(w, b, **kw)
    with pytest.raises(TypeError, match=r"num_qo_heads=None: an integer expected"):
        w.plan(b.indptr, b.indices, b.last, None, 2, 64, 16, q_data_type=BF16)
    with pytest.raises(IndexError, match=r"layer 2 is outside \[0, 2\)"):
        c[2]
    w.close()
