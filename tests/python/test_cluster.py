"""attnserve.Cluster against two and three real servers (CPU backend, free
ports): placement by free pages, routing in the caller's order, context
parallelism (sequences spread at page and non-page boundaries, page_size 1
and 16) checked layer by layer against the float64 reference over the whole
sequence, a restart that loses exactly that server's sequences, mixed
geometries refused, DNS discovery; the numpy merge and kv_keys_after."""

import os
import signal
import threading
import time

import numpy as np
import pytest

import attnserve
from attnserve.cluster import causal_spread
from attnserve.merge import merge_states
from attnserve.reference import (KvMirror, compare, reference_merge, reference_prefill,
                                 within_tolerance)
from server import TestServer


def start(n, **kw):
    """n servers; kw's values may be lists (one per server)."""
    servers = []
    for i in range(n):
        servers.append(TestServer(**{k: (v[i] if isinstance(v, list) else v)
                                     for k, v in kw.items()}))
    return servers


def stop(servers):
    for s in servers:
        s.stop()


class Reference:
    """The whole sequences as one server would hold them: every appended row,
    each sequence at its own slot range (page_size 1)."""

    def __init__(self, info, causal=True, lse_base="2"):
        self.g = info
        self.causal, self.lse_base = causal, lse_base
        self.mirror = KvMirror(info.num_kv_heads, info.head_dim)
        self.base = {}

    def _base(self, sid):
        return self.base.setdefault(sid, len(self.base) * 100_000)

    def append(self, layer, step, k, v):
        slots = [self._base(sid) + int(step.kv_lens[b]) - int(step.q_lens[b]) + i
                 for b, sid in enumerate(step.seq_ids) for i in range(int(step.q_lens[b]))]
        self.mirror.write(layer, slots, k, v)

    def check(self, layer, step, q, got, skip=()):
        rows, qo, kvp, idx = [], [0], [0], []
        for b, sid in enumerate(step.seq_ids):
            if sid in skip:
                continue
            idx += [self._base(sid) + p for p in range(int(step.kv_lens[b]))]
            kvp.append(len(idx))
            qo.append(qo[-1] + int(step.q_lens[b]))
            rows += list(range(int(step.qo_indptr[b]), int(step.qo_indptr[b + 1])))
        rows = np.asarray(rows, dtype=np.int64)
        o_ref, lse_ref = reference_prefill(self.mirror, layer, q[rows], qo, kvp, idx, None,
                                           page_size=1, causal=self.causal,
                                           lse_base=self.lse_base)
        return compare(o_ref, lse_ref, got.output[rows], got.lse[rows])


def run_and_check(cluster, ref, step, rng, torch_too=False):
    g = cluster.server_info
    for layer in range(g.num_layers):
        n = step.total_q
        q = rng.standard_normal((n, g.num_qo_heads, g.head_dim), np.float32)
        k, v = rng.standard_normal((2, n, g.num_kv_heads, g.head_dim), np.float32)
        ref.append(layer, step, k, v)
        out = cluster.run(layer, q, k, v, step=step)
        assert out.output.shape == (n, g.num_qo_heads, g.head_dim)
        c = ref.check(layer, step, q, out)
        assert within_tolerance(c), (step.step, layer, c)
        if torch_too:
            # The same layer again (its appends rewrite the same slots with the
            # same rows), the result as torch bf16, merged by torch.
            import torch
            tout = cluster.run(layer, q, k, v, step=step, out="torch")
            assert tout.output.dtype == torch.bfloat16 and tout.lse.dtype == torch.float32
            c = ref.check(layer, step, q, tout)
            assert within_tolerance(c), ("torch", step.step, layer, c)


def retry_while_unavailable(call, seconds=30):
    deadline = time.monotonic() + seconds
    while True:
        try:
            return call()
        except attnserve.Unavailable:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def test_causal_spread_shares_the_causal_work_of_the_new_tokens():
    assert causal_spread(37, 2) == [11, 26]
    assert causal_spread(37, 3) == [7, 9, 21]
    assert causal_spread(32768, 2) == [9598, 23170]
    assert causal_spread(0, 3) == [0, 0, 0]
    for k in (2, 3, 4):
        n, a, work = 4000, 0, []
        for size in causal_spread(n, k):
            b = a + size
            r = np.arange(n)
            work.append(int(np.clip(np.minimum(r + 1, b) - a, 0, None).sum()))
            a = b
        assert a == n and (max(work) - min(work)) / max(work) < 0.01


def test_places_new_sequences_on_the_server_with_the_most_free_pages():
    servers = start(3, num_pages=[40, 100, 70])
    try:
        with attnserve.Cluster([s.address for s in servers], timeout=120) as c:
            c.plan([1, 2, 3, 4], [800, 640, 16, 16])
            assert [c.shards_of(i)[0].server for i in (1, 2, 3, 4)] == [1, 2, 1, 1]
            assert [s.pages_held for s in c.servers()] == [0, 52, 40]
            c.plan([4, 2], [1, 1])  # placement sticks
            assert c.shards_of(4)[0].server == 1 and c.shards_of(2)[0].server == 2
            c.release()
            assert [s.pages_held for s in c.servers()] == [0, 0, 0]
    finally:
        stop(servers)


def test_routes_a_batch_and_answers_in_the_callers_order():
    servers = start(3)
    try:
        with attnserve.Cluster([s.address for s in servers], timeout=120) as c:
            ref, rng = Reference(c.server_info), np.random.default_rng(7)
            step = c.plan([10, 11, 12, 13, 14, 15], [37, 5, 64, 1, 17, 30])
            assert {c.shards_of(i)[0].server for i in range(10, 16)} == {0, 1, 2}
            run_and_check(c, ref, step, rng)
            for _ in range(3):
                run_and_check(c, ref, c.plan([15, 12, 10, 13, 11, 14], [1, 1, 2, 1, 1, 3]), rng)
            assert c.kv_len(10) == 37 + 6
            last = c.plan([11, 13], [1, 1])
            assert len(last.parts) <= 2  # one Prefill per server touched
            run_and_check(c, ref, last, rng)
            c.release()
    finally:
        stop(servers)


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("num_servers", [2, 3])
def test_spread_sequences_match_the_reference(page_size, num_servers):
    servers = start(num_servers, page_size=page_size, num_pages=4096 // page_size)
    try:
        with attnserve.Cluster([s.address for s in servers], split_min_tokens=24,
                               timeout=120) as c:
            ref, rng = Reference(c.server_info), np.random.default_rng(page_size + num_servers)
            # 37 and 55 spread (causal_spread: 11 + 26 or 7 + 9 + 21, never at a
            # page boundary of 16; 55 over 2 -> 16 + 39, at one), 5 whole.
            step = c.plan([1, 2, 3], [37, 5, 55])
            assert len(c.shards_of(1)) == num_servers and len(c.shards_of(2)) == 1
            assert len(c.shards_of(3)) == num_servers
            pos = 0
            for sh in c.shards_of(1):  # contiguous ranges, in order
                assert sh.start == pos
                pos += sh.length
            assert pos == 37
            # A causal row goes only to the servers whose range starts at or before it.
            expected = 5 + sum(37 - sh.start for sh in c.shards_of(1)) + \
                sum(55 - sh.start for sh in c.shards_of(3))
            assert sum(len(p.q_rows) for p in step.parts) == expected
            run_and_check(c, ref, step, rng, torch_too=True)
            for i in range(4):  # decode: the token to the last server, the query to all
                run_and_check(c, ref, c.plan([3, 1, 2], [1, 1, 1]), rng, torch_too=i == 0)
            assert c.shards_of(1)[-1].length == causal_spread(37, num_servers)[-1] + 4
            if num_servers == 2:
                assert c.shards_of(3)[0].length == 16
            run_and_check(c, ref, c.plan([1], [30]), rng)  # a causal chunk on a spread sequence
            c.release()
    finally:
        stop(servers)


@pytest.mark.parametrize("causal,lse_base", [(False, "2"), (True, "e")])
def test_spread_sequences_without_the_mask_and_in_natural_log(causal, lse_base):
    servers = start(2)
    try:
        with attnserve.Cluster([s.address for s in servers], split_min_tokens=16,
                               causal=causal, lse_base=lse_base, timeout=120) as c:
            ref = Reference(c.server_info, causal=causal, lse_base=lse_base)
            rng = np.random.default_rng(9)
            step = c.plan([1, 2], [40, 3])
            assert len(c.shards_of(1)) == 2
            # Without the mask every row sees every range: all rows go everywhere.
            assert sum(len(p.q_rows) for p in step.parts) == (80 if not causal else
                                                              40 + 40 - c.shards_of(1)[1].start) + 3
            run_and_check(c, ref, step, rng)
            run_and_check(c, ref, c.plan([2, 1], [1, 2]), rng)
            c.release()
    finally:
        stop(servers)


def test_a_sequence_spills_to_the_next_server_when_its_server_is_full():
    servers = start(2, num_pages=[8, 6])
    try:
        with attnserve.Cluster([s.address for s in servers], timeout=120) as c:
            ref, rng = Reference(c.server_info), np.random.default_rng(3)
            run_and_check(c, ref, c.plan([5], [120]), rng)
            run_and_check(c, ref, c.plan([5], [50]), rng)
            assert c.shards_of(5) == [attnserve.Shard(0, 0, 128), attnserve.Shard(1, 128, 42)]
            run_and_check(c, ref, c.plan([5], [1]), rng)
            with pytest.raises(attnserve.ResourceExhausted, match="sequence 6"):
                c.plan([5, 6], [1, 200])
            assert c.kv_len(5) == 171 and 6 not in c.sequences
            run_and_check(c, ref, c.plan([5], [1]), rng)
            c.release()
    finally:
        stop(servers)


def test_a_restart_loses_exactly_that_servers_sequences():
    servers = start(2)
    try:
        with attnserve.Cluster([s.address for s in servers], split_min_tokens=40,
                               timeout=120) as c:
            ref, rng = Reference(c.server_info), np.random.default_rng(11)
            step = c.plan([1, 2, 3], [20, 20, 50])
            assert len(c.shards_of(3)) == 2
            gone = c.shards_of(2)[0].server
            keep = 2 if c.shards_of(1)[0].server == gone else 1
            lose = 3 - keep
            run_and_check(c, ref, step, rng)
            address = servers[gone].address
            servers[gone].stop()
            servers[gone] = TestServer(extra_flags=[f"--listen={address}"])

            g = c.server_info
            try:
                decode = retry_while_unavailable(lambda: c.plan([keep, lose, 3], [1, 1, 1]))
            except attnserve.SequencesLost as e:  # the plan found out
                assert sorted(e.seq_ids) == sorted([lose, 3])
            else:  # or the run does, with the others' rows
                for layer in range(g.num_layers):
                    q = rng.standard_normal((3, g.num_qo_heads, g.head_dim), np.float32)
                    k, v = rng.standard_normal((2, 3, g.num_kv_heads, g.head_dim), np.float32)
                    ref.append(layer, decode, k, v)
                    with pytest.raises(attnserve.SequencesLost) as info:
                        retry_while_unavailable(lambda: c.run(layer, q, k, v, step=decode))
                    assert sorted(info.value.seq_ids) == sorted([lose, 3])
                    assert isinstance(info.value, attnserve.DataLoss)
                    assert "sequences lost" in str(info.value)
                    cmp = ref.check(layer, decode, q, info.value.partial, skip=(lose, 3))
                    assert within_tolerance(cmp), cmp
            assert sorted(c.lost) == sorted([lose, 3])
            with pytest.raises(attnserve.SequencesLost) as info:
                c.plan([keep, 3], [1, 1])
            assert info.value.seq_ids == [3]
            c.finish(lose, 3)
            assert c.lost == []
            length = c.kv_len(keep)
            nxt = c.plan([keep, 20, 21], [1, 30, 30])
            assert c.kv_len(keep) == length + 1
            run_and_check(c, ref, nxt, rng)
            assert gone in {c.shards_of(20)[0].server, c.shards_of(21)[0].server}
            assert c.servers()[gone].restarts == 1
            c.release()
            assert [s.pages_held for s in c.servers()] == [0, 0]
    finally:
        stop(servers)


def refresh_until_lost(c) -> list:
    """refresh() until it raises SequencesLost (a restart found), while the
    restarted server's channel reconnects; returns the lost sequences."""
    deadline = time.monotonic() + 30
    while True:
        try:
            c.refresh()
        except attnserve.SequencesLost as e:
            return e.seq_ids
        assert time.monotonic() < deadline, "the restart was never seen"
        time.sleep(0.05)  # unreachable while its channel reconnects


def test_a_server_back_with_another_geometry_leaves_the_cluster():
    """Its sequences are lost, as at any restart, and it takes no new ones
    (as in the C++ cluster); the other server keeps serving."""
    servers = start(2)
    try:
        with attnserve.Cluster([s.address for s in servers], timeout=120) as c:
            c.plan([1, 2], [16, 16])
            gone = c.shards_of(1)[0].server
            assert c.shards_of(2)[0].server != gone
            address = servers[gone].address
            servers[gone].stop()
            servers[gone] = TestServer(page_size=8, extra_flags=[f"--listen={address}"])
            assert refresh_until_lost(c) == [1]
            assert not c.servers()[gone].active
            c.finish(1)
            ref, rng = Reference(c.server_info), np.random.default_rng(5)
            step = c.plan([3, 4], [16, 16])
            assert gone not in {c.shards_of(3)[0].server, c.shards_of(4)[0].server}
            run_and_check(c, ref, step, rng)
            c.refresh()
            c.release()
    finally:
        stop(servers)


def test_a_server_whose_restart_was_seen_while_down_is_checked_when_it_answers():
    """A restart found while the server could not answer leaves its client's
    incarnation forgotten, so the next refresh() cannot compare incarnations:
    it compares geometries, and one back with another leaves the cluster.
    The cluster's server_info stays the members' geometry."""
    servers = start(2)
    try:
        with attnserve.Cluster([s.address for s in servers], timeout=30) as c:
            c.plan([1, 2], [16, 16])
            address = servers[0].address
            servers[0].stop()
            # As a run that found it restarted would, while it is down again.
            assert c._lose_server(0, "restarted") in ([1], [2])
            assert c.client(0).incarnation == 0
            servers[0] = TestServer(page_size=8, extra_flags=[f"--listen={address}"])
            deadline = time.monotonic() + 30
            while c.servers()[0].active or not c._servers[0].gone:
                try:
                    c.refresh()
                except attnserve.AttnserveError:
                    pass
                assert time.monotonic() < deadline, "never refreshed"
                time.sleep(0.05)
            assert not c.servers()[0].active
            assert c.server_info.page_size == 16
            c.refresh()  # nothing more to say
            for seq in c.sequences:
                c.finish(seq)
            step = c.plan([3], [16])
            assert c.shards_of(3)[0].server == 1 and step.total_q == 16
            c.release()
    finally:
        stop(servers)


def test_refresh_sees_a_restart_before_any_call():
    servers = start(2)
    try:
        with attnserve.Cluster([s.address for s in servers], timeout=120) as c:
            c.plan([1, 2], [16, 16])
            gone = c.shards_of(1)[0].server
            address = servers[gone].address
            servers[gone].stop()
            servers[gone] = TestServer(extra_flags=[f"--listen={address}"])
            assert refresh_until_lost(c) == [1]
            assert c.sequences == [2]
            c.finish(1)
            c.release()
    finally:
        stop(servers)


def test_refuses_servers_with_another_geometry():
    servers = start(2, page_size=[16, 8], num_pages=[256, 512])
    try:
        with pytest.raises(ValueError, match=r"page_size=8 \(the others have 16\)") as info:
            attnserve.Cluster([s.address for s in servers])
        assert servers[1].address in str(info.value)
    finally:
        stop(servers)
    servers = start(2, num_pages=[256, 100])  # num_pages may differ
    try:
        attnserve.Cluster([s.address for s in servers]).close()
    finally:
        stop(servers)


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="targets is empty"):
        attnserve.Cluster([])
    with pytest.raises(ValueError, match="dns:///NAME:PORT"):
        attnserve.Cluster("dns:///no-port")
    servers = start(1)
    try:
        with attnserve.Cluster(servers[0].address) as c:
            with pytest.raises(ValueError):
                c.plan([], [])
            with pytest.raises(ValueError):
                c.plan([1, 1], [1, 1])
            with pytest.raises(ValueError):
                c.plan([1], [-1])
            step = c.plan([1], [3])
            with pytest.raises(ValueError, match="q has 2 rows"):
                c.run(0, np.zeros((2, 8, 64)), np.zeros((3, 2, 64)), np.zeros((3, 2, 64)))
            with pytest.raises(KeyError):
                c.finish(99)
            c.plan([1], [1])
            with pytest.raises(RuntimeError, match="stale"):
                c.run(0, np.zeros((3, 8, 64)), np.zeros((3, 2, 64)), np.zeros((3, 2, 64)),
                      step=step)
            c.release()
    finally:
        stop(servers)


def test_discovers_servers_through_dns_and_resolves_again():
    servers = start(2)
    try:
        port = servers[0].address.rsplit(":", 1)[1]
        with attnserve.Cluster(f"dns:///127.0.0.1:{port}") as one:  # getaddrinfo
            assert [s.address for s in one.servers()] == [servers[0].address]
        answer = [servers[0].address]

        def resolver(host, p):
            assert (host, p) == ("attnserve-pods.test", "50051")
            return list(answer)

        with attnserve.Cluster("dns:///attnserve-pods.test:50051", resolver=resolver,
                               refresh_interval=0) as c:  # every plan() refreshes
            assert c.num_servers == 1
            c.plan([1], [16])
            answer.append(servers[1].address)
            c.plan([2], [16])  # joins at the plan's refresh
            assert c.num_servers == 2
            assert c.shards_of(2)[0].server == 1  # the new, emptier server
            answer.pop()
            servers[1].stop()
            with pytest.raises(attnserve.SequencesLost) as info:
                c.refresh()
            assert info.value.seq_ids == [2]
            assert not c.servers()[1].active
            c.finish(2)
            c.plan([3], [16])
            assert c.shards_of(3)[0].server == 0
            c.release()
    finally:
        stop(servers)


def test_merge_states_matches_the_float64_reference():
    rng = np.random.default_rng(5)
    states = []
    for s in range(4):
        v = rng.standard_normal((6, 3, 8)).astype(np.float32)
        v = attnserve.bf16_bits_to_float32(attnserve.float32_to_bf16_bits(v)).reshape(v.shape)
        lse = (rng.standard_normal((6, 3)) * 4).astype(np.float32)
        lse[s, :] = -np.inf  # rows some states did not see
        states.append((v, lse))
    for base in ("2", "e"):
        o, lse = merge_states([v for v, _ in states], [l for _, l in states], base)
        o_ref, lse_ref = reference_merge(states, base)  # v is bf16-exact
        assert np.abs(lse - lse_ref).max() < 1e-5
        assert np.linalg.norm(o - o_ref) / np.linalg.norm(o_ref) < 1e-5
    nothing = [np.ones((2, 1, 4), np.float32)] * 2
    o, lse = merge_states(nothing, [np.full((2, 1), -np.inf, np.float32)] * 2)
    assert (o == 0).all() and np.isneginf(lse).all()


def _float64(x):
    import torch
    return x.double().numpy() if isinstance(x, torch.Tensor) else np.asarray(x, np.float64)


@pytest.mark.parametrize("dtype", ["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("kind", ["numpy", "torch"])
@pytest.mark.parametrize("base", ["2", "e"])
def test_the_vectorized_merge_matches_the_float64_reference(dtype, kind, base, monkeypatch):
    # The threaded numpy path in blocks of 512 rows (not at a row of the
    # [n, h] grid); rows that one state, the other or both did not see (LSE
    # -inf, output 0 as the server returns it), and LSEs far apart.
    import torch
    import attnserve.merge
    monkeypatch.setattr(attnserve.merge, "_THREADED_ELEMS", 0)
    monkeypatch.setattr(attnserve.merge, "_BLOCK_ELEMS", 512 * 128)
    monkeypatch.setenv("ATTNSERVE_MERGE_THREADS", "3")
    rng = np.random.default_rng({"bf16": 1, "fp16": 2, "fp32": 3}[dtype])
    n, h, d = 700, 8, 128
    states = []
    for s in range(2):
        v = torch.from_numpy(rng.standard_normal((n, h, d)).astype(np.float32))
        lse = (rng.standard_normal((n, h)) * 6).astype(np.float32)
        lse[s * 50:s * 50 + 100] = -np.inf  # rows 0-49: only state 1; 100-149: only state 0
        lse[200:230] = -np.inf              # rows 200-229: neither
        lse[300:310, 3] = -np.inf
        lse[400:420] += 40 * (1 if s else -1)
        v[torch.from_numpy(np.isneginf(lse))] = 0
        v = {"bf16": v.bfloat16(), "fp16": v.half(), "fp32": v}[dtype]
        states.append((v, lse))
    # The float64 reference over the exact input values.
    o_ref, lse_ref = reference_merge([(v.double(), l) for v, l in states], base)
    if kind == "numpy":
        vs = [(v.float() if dtype == "bf16" else v).numpy() for v, _ in states]
        o, lse = merge_states(vs, [l for _, l in states], base)
        assert o.dtype == np.float32 and lse.dtype == np.float32
        out = np.full((n + 5, h, d), 7, np.float32)  # into a view of a larger array
        o2, _ = merge_states(vs, [l for _, l in states], base, out=out[5:])
        assert o2 is out[5:] or np.shares_memory(o2, out)
        assert np.array_equal(out[5:], o) and (out[:5] == 7).all()
    else:
        o, lse = merge_states([v for v, _ in states], [torch.from_numpy(l) for _, l in states],
                              base)
        assert o.dtype == states[0][0].dtype and lse.dtype == torch.float32
    o64, lse64 = _float64(o), _float64(lse)
    assert not np.isnan(o64).any() and not np.isnan(lse64).any()
    nothing = np.isneginf(lse_ref)
    assert (np.isneginf(lse64) == nothing).all()
    assert (o64[nothing] == 0).all() and nothing[200:230].all()
    assert np.abs(lse64[~nothing] - lse_ref[~nothing]).max() < 1e-5 * max(
        1.0, np.abs(lse_ref[~nothing]).max())
    # float32 math; the torch path rounds the output once to its dtype.
    tol = {"bf16": 8e-3, "fp16": 1e-3, "fp32": 1e-6}[dtype] if kind == "torch" else 1e-6
    assert np.linalg.norm(o64 - o_ref) / np.linalg.norm(o_ref) < tol
    # Rows only one state saw are that state's rows.
    only = _float64(states[1][0])[0:50]
    assert np.abs(o64[0:50] - only).max() <= (0 if kind == "numpy" else 1e-7 + np.abs(only).max() * tol)


def test_the_merge_into_one_of_its_inputs():
    """merge_states(..., out=vs[1]) wrote state 0's share into out before
    reading state 1 from it: wrong values (off by up to 2.35), no error. An
    out that is any input now gets the result through a buffer."""
    rng = np.random.default_rng(31)
    vs = list(rng.standard_normal((3, 4, 8, 64)).astype(np.float32))
    lses = list(rng.standard_normal((3, 4, 8)).astype(np.float32))
    want, want_lse = merge_states([v.copy() for v in vs], [x.copy() for x in lses])
    for i in range(3):
        ins = [v.copy() for v in vs]
        got, got_lse = merge_states(ins, [x.copy() for x in lses], out=ins[i])
        assert got is ins[i]
        assert np.array_equal(got, want) and np.array_equal(got_lse, want_lse), i


def test_the_merge_refuses_mismatched_states():
    v = np.zeros((4, 2, 8), np.float32)
    lse = np.zeros((4, 2), np.float32)
    with pytest.raises(ValueError, match="vs\\[1\\] has shape"):
        merge_states([v, v[:3]], [lse, lse])
    with pytest.raises(ValueError, match="lses\\[0\\] has shape"):
        merge_states([v, v], [lse[:, :1], lse])
    with pytest.raises(ValueError, match="lse_base"):
        merge_states([v, v], [lse, lse], "10")
    with pytest.raises(ValueError, match="out must be float32"):
        merge_states([v, v], [lse, lse], out=np.zeros((4, 2, 8), np.float16))


def test_kv_keys_after_through_the_python_client(client):
    g = client.server_info
    rng = np.random.default_rng(2)
    pages = client.allocate_pages(4)
    slots = [p * g.page_size + i for p in pages for i in range(g.page_size)]
    k, v = rng.standard_normal((2, len(slots), g.num_kv_heads, g.head_dim), np.float32)
    client.write_kv(0, slots, k, v)
    mirror = KvMirror(g.num_kv_heads, g.head_dim)
    mirror.write(0, slots, k, v)
    q = rng.standard_normal((30, g.num_qo_heads, g.head_dim), np.float32)
    layout = dict(qo_indptr=[0, 10, 30], kv_indptr=[0, 2, 4], kv_indices=pages,
                  kv_last_page_len=[7, 16])
    o_ref, lse_ref = reference_prefill(mirror, 0, q, *layout.values(), page_size=g.page_size,
                                       kv_keys_after=[4, 11])
    r = client.prefill(0, q, **layout, kv_keys_after=[4, 11])
    assert within_tolerance(compare(o_ref, lse_ref, r.output, r.lse))
    plan = client.create_plan(*layout.values(), kv_keys_after=[4, 11])
    r = client.prefill_layout(0, q, attnserve.PrefillLayout.for_plan(plan, 30, 0))
    assert within_tolerance(compare(o_ref, lse_ref, r.output, r.lse))
    client.release_plan(plan)
    with pytest.raises(attnserve.InvalidArgument, match=r"kv_keys_after\[1\]=-1 out of range"):
        client.prefill(0, q, **layout, kv_keys_after=[0, -1])
    with pytest.raises(attnserve.InvalidArgument, match="kv_keys_after has 1 entries"):
        client.create_plan(*layout.values(), kv_keys_after=[3])
    client.free_pages(pages)


def test_docs_cluster_md_python_blocks(capsys):
    """Every Python block of docs/cluster.md, as written, against two servers
    with the default flags' geometry; each print must print its comment."""
    import os
    import re
    doc = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "docs",
                       "cluster.md")
    blocks = re.findall(r"```python\n(.*?)```", open(doc).read(), re.S)
    assert blocks
    servers = start(2, num_layers=4, num_pages=1024, page_size=16, num_qo_heads=32,
                    num_kv_heads=4, head_dim=128)
    try:
        for i, code in enumerate(blocks):
            expected = [m.group(1).strip() for m in
                        (re.match(r"^\s*print\(.*\)\s+#\s*(.+)$", line)
                         for line in code.splitlines()) if m]
            code = code.replace("127.0.0.1:50051", servers[0].address)
            code = code.replace("127.0.0.1:50052", servers[1].address)
            exec(compile(code, f"docs/cluster.md block {i}", "exec"), {"__name__": "__main__"})
            printed = [line.strip() for line in capsys.readouterr().out.splitlines()]
            assert printed == expected
    finally:
        stop(servers)


def test_a_step_runs_only_on_the_cluster_that_planned_it():
    """Two clusters number their steps alike: another cluster's step names its
    own servers and is refused before anything is sent."""
    servers = start(2)
    try:
        with attnserve.Cluster([servers[0].address], timeout=120) as x, \
                attnserve.Cluster([s.address for s in servers], timeout=120,
                                  split_min_tokens=2) as y:
            ref, rng = Reference(x.server_info), np.random.default_rng(8)
            mine = x.plan([1], [4])
            theirs = y.plan([2], [8])
            assert theirs.step == mine.step == 1 and len(theirs.parts) == 2
            g = x.server_info
            q = rng.standard_normal((8, g.num_qo_heads, g.head_dim), np.float32)
            kv = rng.standard_normal((8, g.num_kv_heads, g.head_dim), np.float32)
            with pytest.raises(RuntimeError, match="the step 1 was planned by another Cluster"):
                x.run(0, q, kv, kv, step=theirs)
            run_and_check(x, ref, mine, rng)
            x.release()
            y.release()
    finally:
        stop(servers)


def test_a_finish_interrupted_on_one_server_still_forgets_the_sequence_on_the_others():
    """Ctrl-C while one server's part of finish() is on its way (here: that
    server's manager forgot the sequence, the reply was still coming): the
    other servers' managers still forget it before the interruption goes on.
    A manager still holding the old rows would extend them when the id is
    planned again: attention over the old sequence's keys with no error."""
    servers = start(2, page_size=1, num_pages=4096)
    try:
        with attnserve.Cluster([s.address for s in servers], split_min_tokens=8, timeout=60) as c:
            rng = np.random.default_rng(35)
            run_and_check(c, Reference(c.server_info), c.plan(["B"], [32]), rng)
            assert len(c.shards_of("B")) == 2
            first = min(sh.server for sh in c.shards_of("B"))
            kv = c.kv_manager(first)
            real = kv.finish

            def finish_then_interrupted(*ids):
                real(*ids)
                raise KeyboardInterrupt

            kv.finish = finish_then_interrupted
            with pytest.raises(KeyboardInterrupt):
                c.finish("B")
            del kv.finish
            assert "B" not in c.sequences
            assert not c.kv_manager(0).has("B") and not c.kv_manager(1).has("B")
            # The id again: only its new rows.
            run_and_check(c, Reference(c.server_info), c.plan(["B"], [4]), rng)
            c.release()
    finally:
        stop(servers)


def test_a_run_interrupted_while_another_server_works_returns_once_that_part_ends():
    """Ctrl-C while run() waits for a part of the step on another server (the
    server stopped): run() still waits that part out before the interruption
    goes on, as for any failure (a Prefill still in flight could append into
    pages the caller frees next)."""
    servers = start(2, page_size=1, num_pages=4096)
    try:
        with attnserve.Cluster([s.address for s in servers], timeout=60) as c:
            g = c.server_info
            step = c.plan(["A", "B"], [4, 4])
            assert len(step.parts) == 2
            slow = step.parts[1].server  # the part a pool thread runs
            kv = c.kv_manager(slow)
            real, ended = kv.run, []

            def run_recorded(*args, **kwargs):
                try:
                    return real(*args, **kwargs)
                finally:
                    ended.append(time.monotonic())

            kv.run = run_recorded
            rng = np.random.default_rng(36)
            q = rng.standard_normal((8, g.num_qo_heads, g.head_dim), np.float32)
            k = rng.standard_normal((8, g.num_kv_heads, g.head_dim), np.float32)
            servers[slow].pause()
            interrupt = threading.Timer(0.5, lambda: os.kill(os.getpid(), signal.SIGINT))
            resume = threading.Timer(2.0, servers[slow].resume)
            interrupt.start()
            resume.start()
            try:
                with pytest.raises(KeyboardInterrupt):
                    c.run(0, q, k, k, step=step)
                raised = time.monotonic()
            finally:
                interrupt.join()
                resume.join()
            del kv.run
            assert ended and ended[0] <= raised
            c.release()
    finally:
        stop(servers)


def test_a_layer_that_failed_on_one_server_holds_up_every_sequence_of_its_step():
    """A layer whose part failed on one server holds up every sequence of the
    step, not only that server's: planning one whose part ran would make the
    step stale, and the failed layer could then never run again for the
    others. plan() says so until the layer has run again."""
    from faults import UNREACHABLE, FaultInjector
    servers = start(2, page_size=4, num_pages=64)
    faults = FaultInjector(35)
    try:
        with attnserve.Cluster([s.address for s in servers], timeout=30,
                               interceptors=faults.interceptors) as c:
            g = c.server_info
            step = c.plan([1, 2, 3, 4], [8, 8, 8, 8])
            on = {0: [], 1: []}
            for sid in (1, 2, 3, 4):
                on[c.shards_of(sid)[0].server].append(sid)
            assert on[0] and on[1]
            rng = np.random.default_rng(37)
            q = rng.standard_normal((32, g.num_qo_heads, g.head_dim), np.float32)
            k = rng.standard_normal((32, g.num_kv_heads, g.head_dim), np.float32)
            faults.fail_next("Prefill", UNREACHABLE)  # one server's part, not the other's
            with pytest.raises(attnserve.Unavailable) as failed:
                c.run(0, q, k, k, step=step)
            bad = 0 if servers[0].address in str(failed.value) else 1
            ran = on[1 - bad][0]  # its part of layer 0 ran
            with pytest.raises(attnserve.FailedPrecondition, match="run that layer of that plan again"):
                c.plan([ran], [1])
            for layer in range(g.num_layers):  # the layer again: the step goes on
                c.run(layer, q, k, k, step=step)
            c.plan([ran], [1])
            c.release()
    finally:
        stop(servers)


def test_a_ctrl_c_held_by_a_manager_does_not_keep_a_finish_from_it():
    """A manager holds a KeyboardInterrupt that came while it recorded a
    layer's run (raised at its next call). A cluster's finish() still has
    that manager forget the sequence before the interruption comes out;
    raised before the manager's finish ran, it kept the old rows for the id."""
    servers = start(2, page_size=1, num_pages=4096)
    try:
        with attnserve.Cluster([s.address for s in servers], split_min_tokens=8, timeout=60) as c:
            g = c.server_info
            step = c.plan(["B"], [32])
            assert len(c.shards_of("B")) == 2
            rng = np.random.default_rng(38)
            q = rng.standard_normal((32, g.num_qo_heads, g.head_dim), np.float32)
            k = rng.standard_normal((32, g.num_kv_heads, g.head_dim), np.float32)
            first = step.parts[0].server                    # the part run on this thread
            kv = c.kv_manager(first)
            real = kv._run_ok

            def run_ok_then_ctrl_c(plan, layer):
                signal.raise_signal(signal.SIGINT)
                return real(plan, layer)

            for layer in range(g.num_layers):
                if layer == g.num_layers - 1:
                    kv._run_ok = run_ok_then_ctrl_c
                c.run(layer, q, k, k, step=step)
            del kv._run_ok
            with pytest.raises(KeyboardInterrupt):
                c.finish("B")
            assert not c.kv_manager(0).has("B") and not c.kv_manager(1).has("B")
            run_and_check(c, Reference(c.server_info), c.plan(["B"], [4]), rng)
            c.release()
    finally:
        stop(servers)


def test_a_full_last_server_names_the_servers_holding_earlier_positions():
    """A sequence spread over two servers whose last server is full cannot
    grow on the first, which has room (its positions on one server are one
    range): the error says so and names that server (as client/
    cluster_placement.cc does)."""
    from attnserve._cluster_placement import Shard, place_tokens

    class Seq:
        shards = [Shard(0, 0, 4), Shard(1, 4, 12)]

    with pytest.raises(attnserve.ResourceExhausted,
                       match=r"sequence 'a': 1 of its 1 new tokens fit on no server \(too few free "
                             r"pages\); the servers with free pages \(0, as servers\(\) lists them\) "
                             r"hold earlier positions of it"):
        place_tokens(["a"], [1], {"a": Seq()}, [7, 0], 4, 0, 0)
    with pytest.raises(attnserve.ResourceExhausted) as e:
        place_tokens(["a"], [1], {"a": Seq()}, [0, 0], 4, 0, 0)
    assert e.value.details.endswith("(too few free pages)")
