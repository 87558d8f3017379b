"""attnserve.KvManager (and AsyncKvManager) against a real CPU server.

Many steps with sequences starting (prefill), decoding and finishing; every
layer's result is checked against the float64 reference over the client's
own mirror of every K/V row appended, and the server's free pages against
the manager's count, back to the start at the end.
"""

import asyncio

import numpy as np
import pytest

import attnserve
from attnserve.aio import AsyncClient
from attnserve.reference import KvMirror, compare, reference_prefill, within_tolerance
from server import TestServer


def check_layout(mgr, plan, before):
    """The plan against the rules of docs/kv_manager.md."""
    ps = mgr.page_size
    for b, sid in enumerate(plan.seq_ids):
        q_len = int(plan.q_lens[b])
        start = before.get(sid, 0)
        assert plan.kv_lens[b] == start + q_len == mgr.kv_len(sid)
        rows = slice(plan.qo_indptr[b], plan.qo_indptr[b + 1])
        assert plan.positions[rows].tolist() == list(range(start, start + q_len))
        pages = mgr.pages_of(sid)
        assert len(pages) == -(-mgr.kv_len(sid) // ps)            # no page more than needed
        assert plan.kv_indices[plan.kv_indptr[b]:plan.kv_indptr[b + 1]].tolist() == pages
        want_last = mgr.kv_len(sid) - (len(pages) - 1) * ps if pages else 0
        assert plan.kv_last_page_len[b] == want_last
        want_slots = [pages[p // ps] * ps + p % ps for p in range(start, start + q_len)]
        assert plan.append_slots[rows].tolist() == want_slots


def run_and_compare(mgr, mirror, plan, layer, rng):
    """Runs the plan's layer on random rows (kept in the mirror) and compares
    the result with the float64 reference over the mirror."""
    g = mgr.client.server_info
    q = rng.standard_normal((plan.total_q, g.num_qo_heads, g.head_dim)).astype(np.float32)
    k = rng.standard_normal((plan.total_q, g.num_kv_heads, g.head_dim)).astype(np.float32)
    v = rng.standard_normal((plan.total_q, g.num_kv_heads, g.head_dim)).astype(np.float32)
    r = mgr.run(layer, q, k, v)
    mirror.write(layer, plan.append_slots, k, v)
    o_ref, lse_ref = reference_prefill(mirror, layer, q, plan.qo_indptr, plan.kv_indptr,
                                       plan.kv_indices, plan.kv_last_page_len,
                                       page_size=g.page_size)
    return compare(o_ref, lse_ref, r.output, r.lse)


@pytest.mark.parametrize("server_plans", [True, False])
def test_many_steps_with_sequences_finishing_and_starting(server, client, server_plans):
    g = client.server_info
    rng = np.random.default_rng(20)
    mirror = KvMirror(g.num_kv_heads, g.head_dim)
    start_free = client.info().free_pages
    mgr = attnserve.KvManager(client, server_plans=server_plans)
    active, next_id, steps_checked, finished = [], 0, 0, 0
    for step in range(30):
        # Start 0-2 sequences (a prompt each), finish some, decode the rest.
        for _ in range(int(rng.integers(0, 3)) if len(active) < 6 else 0):
            active.append(next_id)
            next_id += 1
        if active and step % 4 == 3:
            done = [s for s in active if s in mgr.sequences and rng.random() < 0.4]
            if done:
                mgr.finish(*done)
                finished += len(done)
                active = [s for s in active if s not in done]
                assert all(s not in mgr.sequences for s in done)
        if not active:
            continue
        known = set(mgr.sequences)  # new ones get a prompt, the others decode
        q_lens = [int(rng.choice([1, 1, 1, 3])) if s in known else int(rng.integers(5, 40))
                  for s in active]
        before = {s: mgr.kv_len(s) for s in active if s in mgr.sequences}
        plan = mgr.plan(active, q_lens)
        check_layout(mgr, plan, before)
        assert (plan.plan_id != 0) == server_plans
        assert client.info().free_pages == start_free - mgr.num_pages
        for layer in range(g.num_layers):
            c = run_and_compare(mgr, mirror, plan, layer, rng)
            assert within_tolerance(c), (step, layer, c)
            steps_checked += 1
    assert steps_checked >= 40 and finished >= 3 and next_id >= 8
    assert max(mgr.kv_len(s) for s in mgr.sequences) > 2 * g.page_size  # crossed pages
    mgr.release()                       # plans released first: else FreePages fails
    assert mgr.sequences == [] and mgr.num_pages == 0
    assert client.info().free_pages == start_free


def test_plan_is_atomic_when_pages_run_out():
    with TestServer(num_layers=1, num_pages=6) as server:
        client = attnserve.Client(server.address, timeout=60)
        mgr = attnserve.KvManager(client)
        mgr.plan(["a", "b"], [20, 30])                          # 2 + 2 pages
        assert mgr.num_pages == 4 and client.info().free_pages == 2
        with pytest.raises(attnserve.ResourceExhausted):
            mgr.plan(["a", "b", "c"], [16, 16, 1])              # needs 1 + 1 + 1 > 2
        assert (mgr.kv_len("a"), mgr.kv_len("b"), mgr.num_pages) == (20, 30, 4)
        assert "c" not in mgr.sequences
        assert client.info().free_pages == 2
        plan = mgr.plan(["a", "b"], [1, 1])                     # still fits in held pages
        assert plan.kv_lens.tolist() == [21, 31] and client.info().free_pages == 2
        mgr.finish("a")
        assert client.info().free_pages == 4
        mgr.release()
        assert client.info().free_pages == 6
        client.close()


def test_plan_is_atomic_when_the_server_refuses_the_plan():
    with TestServer(num_layers=1, num_pages=16, extra_flags=["--max_plans_per_tenant=2"]) as server:
        client = attnserve.Client(server.address, timeout=60)
        mgr = attnserve.KvManager(client)
        mgr.plan(["a"], [20])                                  # live plans: 1
        mgr.plan(["b"], [3])                                   # live plans: 2
        free = client.info().free_pages
        with pytest.raises(attnserve.ResourceExhausted):
            mgr.plan(["c"], [40])                              # a third: over the cap
        assert "c" not in mgr.sequences
        assert client.info().free_pages == free                # its 3 new pages went back
        mgr.finish("b")                                        # releases b's plan
        plan = mgr.plan(["c"], [40])
        assert plan.plan_id != 0 and mgr.kv_len("c") == 40
        mgr.release()
        assert client.info().free_pages == 16
        client.close()


def test_plans_go_stale_and_micro_batches_coexist(client):
    mgr = attnserve.KvManager(client)
    start_free = client.info().free_pages
    q = np.ones((1, 8, 64), np.float32)
    kv = np.ones((1, 2, 64), np.float32)
    with pytest.raises(RuntimeError, match="no plan"):
        mgr.run(0, q, kv, kv)
    a = mgr.plan([1], [1])
    b = mgr.plan([2], [1])                                      # disjoint: both runnable
    mgr.run(0, q, kv, kv, plan=a)
    mgr.run(0, q, kv, kv, plan=b)
    a2 = mgr.plan([1], [1])                                     # moves sequence 1 on
    with pytest.raises(RuntimeError, match="stale"):
        mgr.run(0, q, kv, kv, plan=a)
    mgr.run(0, q, kv, kv, plan=a2)
    mgr.finish(2)
    with pytest.raises(RuntimeError, match="stale"):
        mgr.run(0, q, kv, kv, plan=b)
    with pytest.raises(KeyError, match="unknown"):
        mgr.finish(2)
    for bad, match in ((([], []), "empty"), (([1, 1], [1, 1]), "duplicates"),
                       (([1], [1, 2]), "1 seq_ids but 2 q_lens"), (([1], [-1]), "negative"),
                       (([1], [0.5]), "integers")):
        with pytest.raises((ValueError, TypeError), match=match):
            mgr.plan(*bad)
    assert mgr.kv_len(1) == 2
    # The server's own checks still apply: a wrong row count names the field.
    mgr.plan([1], [2])
    with pytest.raises(attnserve.InvalidArgument, match="append_k"):
        mgr.run(0, np.ones((2, 8, 64), np.float32), kv, kv)
    mgr.release()
    assert client.info().free_pages == start_free


def test_a_server_without_plans_gets_the_layout(client):
    """CreatePlan answered UNIMPLEMENTED (an older server): the manager sends
    the layout with every layer from then on."""
    class NoPlans:
        def __init__(self, inner):
            self.inner, self.server_info = inner, inner.server_info

        def create_plan(self, *args, **kwargs):
            raise attnserve.Unimplemented("unknown method CreatePlan")

        def fork(self):  # the manager's own client, for its lease
            return NoPlans(self.inner.fork())

        def __getattr__(self, name):
            return getattr(self.inner, name)

    g = client.server_info
    mgr = attnserve.KvManager(NoPlans(client))
    rng = np.random.default_rng(22)
    mirror = KvMirror(g.num_kv_heads, g.head_dim)
    plan = mgr.plan([1, 2], [20, 3])
    assert plan.plan_id == 0 and not mgr.server_plans
    q = rng.standard_normal((23, 8, 64)).astype(np.float32)
    k = rng.standard_normal((23, 2, 64)).astype(np.float32)
    r = mgr.run(0, q, k, k)
    mirror.write(0, plan.append_slots, k, k)
    ref = reference_prefill(mirror, 0, q, plan.qo_indptr, plan.kv_indptr, plan.kv_indices,
                            plan.kv_last_page_len, page_size=g.page_size)
    assert within_tolerance(compare(*ref, r.output, r.lse))
    mgr.release()


def test_finish_releases_the_plans_that_pin_the_pages(client):
    start_free = client.info().free_pages
    mgr = attnserve.KvManager(client)
    a = mgr.plan(["x", "y"], [5, 40])
    pages_x = mgr.pages_of("x")
    # The live plan pins its pages: freeing them behind the manager's back fails.
    with pytest.raises(attnserve.FailedPrecondition):
        client.free_pages(pages_x)
    mgr.finish("x")                       # releases plan a (it includes x), then frees
    assert client.info().free_pages == start_free - len(mgr.pages_of("y"))
    with pytest.raises(RuntimeError, match="stale"):
        mgr.run(0, np.ones((45, 8, 64), np.float32), np.ones((45, 2, 64), np.float32),
                np.ones((45, 2, 64), np.float32), plan=a)
    b = mgr.plan(["y"], [1])
    assert b.plan_id not in (0, a.plan_id)
    mgr.release()
    assert client.info().free_pages == start_free


def test_async_manager_two_micro_batches(server):
    """Two micro-batches' steps in flight at once on one AsyncKvManager."""
    async def body():
        async with AsyncClient(server.address, timeout=120) as c:
            g = c.server_info
            start_free = (await c.info()).free_pages
            mgr = attnserve.AsyncKvManager(c)
            mirror = KvMirror(g.num_kv_heads, g.head_dim)
            rng = np.random.default_rng(21)

            async def micro_batch(ids, steps):
                for step in range(steps):
                    plan = await mgr.plan(ids, [17 if step == 0 else 1] * len(ids))
                    for layer in range(g.num_layers):
                        q = rng.standard_normal((plan.total_q, 8, 64)).astype(np.float32)
                        k = rng.standard_normal((plan.total_q, 2, 64)).astype(np.float32)
                        v = rng.standard_normal((plan.total_q, 2, 64)).astype(np.float32)
                        mirror.write(layer, plan.append_slots, k, v)
                        r = await mgr.run(layer, q, k, v, plan=plan)
                        ref = reference_prefill(mirror, layer, q, plan.qo_indptr, plan.kv_indptr,
                                                plan.kv_indices, plan.kv_last_page_len,
                                                page_size=g.page_size)
                        assert within_tolerance(compare(*ref, r.output, r.lse))
                await mgr.finish(*ids)

            await asyncio.gather(micro_batch([0, 1, 2], 6), micro_batch([3, 4], 6))
            assert mgr.num_pages == 0
            assert (await c.info()).free_pages == start_free
    asyncio.run(body())


def test_async_plan_waiting_while_a_run_loses_the_lease_never_restarts_a_sequence(server):
    """An AsyncKvManager's run() does not wait for the manager's lock: a run
    that finds the lease gone loses every sequence while a plan() of one of
    them waits on the server. That plan raises SequencesLost naming it; it
    never lays the sequence out again, empty, under its old id (whose next run
    would attend over the new rows alone), and finish() forgets it."""
    async def body():
        async with AsyncClient(server.address, timeout=60) as c:
            g = c.server_info
            mgr = attnserve.AsyncKvManager(c)
            rng = np.random.default_rng(5)

            def data(n):
                return (rng.standard_normal((n, 8, 64)).astype(np.float32),
                        rng.standard_normal((n, 2, 64)).astype(np.float32),
                        rng.standard_normal((n, 2, 64)).astype(np.float32))

            first = await mgr.plan(["a"], [3])
            for layer in range(g.num_layers):
                await mgr.run(layer, *data(3), plan=first)
            # The next plan of "a" needs a page; its AllocatePages answers only
            # once a run has been told that the lease is gone.
            rpc = mgr._rpc
            allocate, prefill = rpc.allocate_pages, rpc.prefill_layout
            entered, gate = asyncio.Event(), asyncio.Event()

            async def held_allocate(*args, **kwargs):
                entered.set()
                await gate.wait()
                return await allocate(*args, **kwargs)

            async def lease_gone(*args, **kwargs):
                raise attnserve.LeaseExpired("lease 1 expired", method="Prefill")

            rpc.allocate_pages, rpc.prefill_layout = held_allocate, lease_gone
            planning = asyncio.ensure_future(mgr.plan(["a"], [g.page_size]))
            await entered.wait()
            with pytest.raises(attnserve.SequencesLost) as by_run:
                await mgr.run(0, *data(3), plan=first)
            assert by_run.value.seq_ids == ["a"]
            rpc.prefill_layout = prefill
            gate.set()
            with pytest.raises(attnserve.SequencesLost) as by_plan:
                await planning
            assert by_plan.value.seq_ids == ["a"]
            assert mgr.has("a") and mgr.lost == ["a"]
            await mgr.finish("a")
            assert not mgr.has("a") and mgr.num_pages == 0
            await mgr.release()
    asyncio.run(body())


def test_async_plan_whose_new_lease_starts_while_a_run_loses_the_old_one(server):
    """The same while the plan waits for its reconciliation (ListHoldings,
    after a call whose outcome was unknown): the run loses the sequence and
    ends the lease, the plan's preparation starts a new lease, and the plan
    still raises SequencesLost rather than starting the sequence afresh."""
    async def body():
        async with AsyncClient(server.address, timeout=60) as c:
            g = c.server_info
            mgr = attnserve.AsyncKvManager(c)
            rng = np.random.default_rng(6)

            def data(n):
                return (rng.standard_normal((n, 8, 64)).astype(np.float32),
                        rng.standard_normal((n, 2, 64)).astype(np.float32),
                        rng.standard_normal((n, 2, 64)).astype(np.float32))

            first = await mgr.plan(["b"], [2])
            for layer in range(g.num_layers):
                await mgr.run(layer, *data(2), plan=first)
            rpc = mgr._rpc
            create, listing, prefill = rpc.create_plan, rpc.list_holdings, rpc.prefill_layout
            entered, gate = asyncio.Event(), asyncio.Event()

            async def unknown_outcome(*args, **kwargs):
                raise attnserve.Unavailable("connection reset", method="CreatePlan")

            async def held_listing(*args, **kwargs):
                entered.set()
                await gate.wait()
                return await listing(*args, **kwargs)

            async def lease_gone(*args, **kwargs):
                raise attnserve.LeaseExpired("lease expired", method="Prefill")

            # A CreatePlan whose outcome is unknown: the next plan reconciles.
            rpc.create_plan = unknown_outcome
            with pytest.raises(attnserve.Unavailable):
                await mgr.plan(["b"], [1])
            rpc.create_plan = create
            rpc.list_holdings, rpc.prefill_layout = held_listing, lease_gone
            planning = asyncio.ensure_future(mgr.plan(["b"], [1]))
            await asyncio.wait_for(entered.wait(), 30)
            with pytest.raises(attnserve.SequencesLost):
                await mgr.run(0, *data(2), plan=first)
            rpc.prefill_layout = prefill
            gate.set()
            with pytest.raises(attnserve.SequencesLost) as by_plan:
                await asyncio.wait_for(planning, 30)
            assert by_plan.value.seq_ids == ["b"]
            await mgr.finish("b")
            assert not mgr.has("b")
            await mgr.release()
    asyncio.run(body())


def test_a_plan_runs_only_on_the_manager_that_made_it(client):
    """Two managers number their steps alike: another manager's plan is
    refused before anything is sent (without leases and server plans it would
    write and read that manager's pages), and leaves nothing behind."""
    g = client.server_info
    a = attnserve.KvManager(client, lease=False, server_plans=False)
    b = attnserve.KvManager(client, lease=False, server_plans=False)
    a.plan([1], [1])
    theirs = b.plan([2], [1])
    assert theirs.step == 1
    q = np.ones((1, g.num_qo_heads, g.head_dim), np.float32)
    kv = np.ones((1, g.num_kv_heads, g.head_dim), np.float32)
    with pytest.raises(RuntimeError, match="the plan of step 1 was made by another KvManager"):
        a.run(0, q, kv, kv, plan=theirs)
    assert a.sequences == [1] and not a.has(2)
    for layer in range(g.num_layers):
        a.run(layer, q, kv, kv)
        b.run(layer, q, kv, kv)
    a.release()
    b.release()


def test_a_lost_lease_keeps_the_earlier_leases_to_revoke():
    """A manager that abandoned its lease (its server seemed unreachable;
    the server, alive, still holds the lease's pages and plan) and later
    loses its next lease forgets that one, but still revokes the first:
    release() leaves nothing held. Before, the lost lease's reset() dropped
    the leases left to revoke, and the server held their pages until their
    ttl (the cluster's fault test saw it)."""
    with TestServer() as server:
        client = attnserve.Client(server.address, timeout=30)
        admin = attnserve.Client(server.address, timeout=30)
        mgr = attnserve.KvManager(client)
        mgr.plan(["a"], [40])
        first = mgr.lease_id
        mgr.abandon()                                   # as the cluster does for an unreachable server
        assert [lease.lease_id for lease in admin.list_holdings().leases] == [first]
        mgr.reset(restarted=False)                      # the next lease found gone, the server up
        mgr.release()
        h = admin.list_holdings()
        assert not h.leases and not h.unleased.pages, h
        client.close()
        admin.close()


def test_values_that_a_cast_would_change_are_refused(client):
    """A value that would reach the server as another valid value after a
    narrowing cast (kv_keys_after 2^32 as 0, 2.5 query rows as 2, a uint64
    length as -1, layer 0.9 as 0) is refused before anything is sent."""
    import torch
    import attnserve.flashinfer as fi
    g = client.server_info
    mgr = attnserve.KvManager(client)
    free = client.info().free_pages
    with pytest.raises(ValueError, match=r"kv_keys_after must have one entry in \[0, 2\^31 - 1\]"):
        mgr.plan_rows([1], [2], kv_keys_after=np.array([1 << 32], np.int64))
    with pytest.raises(TypeError, match="q_rows: integers expected"):
        mgr.plan_rows([1], [2], q_rows=[2.5])
    with pytest.raises(ValueError, match="more than a step's"):
        mgr.plan([1], np.array([(1 << 64) - 1], np.uint64))
    assert mgr.sequences == [] and client.info().free_pages == free   # nothing was allocated
    with pytest.raises(TypeError, match="layer: an integer expected, got float"):
        client.write_kv(0.9, [0], np.zeros((1, g.num_kv_heads, g.head_dim), np.float32),
                        np.zeros((1, g.num_kv_heads, g.head_dim), np.float32))
    with pytest.raises(ValueError, match=r"seq_lens\[0\]=4294967306 is past int32"):
        fi.get_batch_indices_positions(torch.tensor([0, 2], dtype=torch.int32),
                                       torch.tensor([(1 << 32) + 10]), 2)
    with pytest.raises(ValueError, match="max_message_bytes=-1048577 must be >= 1"):
        attnserve.Client(client.target, max_message_bytes=-(1 << 20) - 1)
    cluster = attnserve.Cluster([client.target], lease=False)
    try:
        with pytest.raises(ValueError, match="more than a step's"):
            cluster.plan([1], np.array([(1 << 64) - 1], np.uint64))
        assert cluster.sequences == []
    finally:
        cluster.close()


def test_after_reset_and_reconnect_the_managers_use_a_restarted_servers_page_size():
    """A server back with another --page_size: once the application resets
    its managers and reconnects its client (docs/python.md, "Incarnation and
    restarts"), both managers lay out steps in the new page size (the
    blocking one kept the first one's, and ran attention over unwritten rows
    on a server without --check_kv_written)."""
    first = TestServer(page_size=4, num_pages=64)
    address = first.address
    client = attnserve.Client(address, timeout=30)
    mgr = attnserve.KvManager(client)
    mgr.plan(["x"], [3])
    first.stop()
    second = TestServer(page_size=8, num_pages=64,
                        extra_flags=[f"--listen={address}", "--check_kv_written=false"])
    try:
        mgr.reset()
        client.reconnect()
        assert mgr.page_size == client.server_info.page_size == 8
        g = client.server_info
        rng = np.random.default_rng(3)
        mirror = KvMirror(g.num_kv_heads, g.head_dim)
        plan = mgr.plan(["y"], [13])
        assert len(plan.kv_indices) == 2 and list(plan.kv_last_page_len) == [5]
        for layer in range(g.num_layers):
            c = run_and_compare(mgr, mirror, plan, layer, rng)
            assert within_tolerance(c), (layer, c)
        mgr.release()

        async def async_side():
            async with AsyncClient(address, timeout=30) as ac:
                m = attnserve.AsyncKvManager(ac)
                p = await m.plan(["z"], [13])
                assert m.page_size == 8 and len(p.kv_indices) == 2
                await m.release()
        asyncio.run(async_side())
    finally:
        mgr.close()
        client.close()
        second.stop()
