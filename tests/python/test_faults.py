"""attnserve.KvManager, AsyncKvManager and Cluster under injected failures.

Random workloads (plan, run every layer, finish, release over many sequences)
against real CPU servers, while faults.FaultInjector fails calls at random
(unreachable, or completed on the server with the reply lost), the test
revokes a manager's lease now and then (as an expiry would) and restarts
servers. Every run() that returns attention (and the partial result of
SequencesLost) is compared, sequence by sequence, with the float64 reference
over the K/V the test believes each sequence has: a wrong result is counted,
and there must be none. At the end nothing may be left held. Then the
partial failures of issue #29 one at a time.
"""

import asyncio
import os
import random
import signal
import time

import grpc
import grpc.aio
import numpy as np
import pytest

# The servers run OpenMP over a few rows: one thread that sleeps when idle
# instead of spinning on a loaded host (set before any server starts).
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import attnserve  # noqa: E402
from attnserve.aio import AsyncClient  # noqa: E402
from faults import REPLY_LOST, UNREACHABLE, FaultInjector, SequenceModel  # noqa: E402
from server import TestServer  # noqa: E402

GEOMETRY = dict(num_layers=2, page_size=4, num_qo_heads=2, num_kv_heads=1, head_dim=64)
# Fast reconnection to a restarted server (the default first backoff is 1 s).
RECONNECT = [("grpc.initial_reconnect_backoff_ms", 20), ("grpc.min_reconnect_backoff_ms", 20),
             ("grpc.max_reconnect_backoff_ms", 100)]
RARE = (attnserve.InvalidArgument, attnserve.NotFound, attnserve.PermissionDenied)


def held(client, lease_id=None):
    """(pages, plans) the tenant holds under lease_id (None: under no lease;
    0: under any lease)."""
    h = client.list_holdings()
    if lease_id is None:
        return list(h.unleased.pages), list(h.unleased.plans)
    pages, plans = [], []
    for info in h.leases:
        if lease_id in (0, info.lease_id):
            pages += info.holdings.pages
            plans += info.holdings.plans
    return pages, plans


def release_orphan_plans(admin):
    """Without a lease, plans whose CreatePlan reply was lost are nobody's (the
    server drops them after --plan_idle_timeout_s) and pin pages the managers
    wait to free: gone now."""
    for plan_id in held(admin)[1]:
        try:
            admin.release_plan(plan_id)
        except attnserve.NotFound:
            pass


class Workload:
    """What both workloads share: the model, the counts, the steps' data, the
    rounds of faults (run)."""

    def __init__(self, seed: int, info):
        self.rng = np.random.default_rng(seed)
        self.pick = random.Random(seed)
        self.g = info
        self.model = SequenceModel(info.num_layers, info.num_kv_heads, info.head_dim,
                                   info.wire_dtype)
        self.lens = {}  # the sequences the test knows, and their lengths
        self.next_id = 1
        self.wrong = self.runs_checked = self.seqs_checked = self.partial_checked = 0
        self.refusals = self.lost = self.revocations = self.restarts = 0
        self.restart_due = False

    def batch(self):
        known = sorted(self.lens)
        self.pick.shuffle(known)
        ids = known[:4]
        q_lens = [self.pick.randint(1, 3) for _ in ids]
        starts = self.pick.randint(0, 2) if len(self.lens) < 8 else 0
        while starts > 0 or not ids:
            ids.append(self.next_id)
            q_lens.append(self.pick.randint(1, 12))
            self.next_id += 1
            starts -= 1
        return ids, q_lens

    def layer_data(self, n: int):
        g = self.g
        return (self.rng.standard_normal((n, g.num_qo_heads, g.head_dim), np.float32),
                self.rng.standard_normal((n, g.num_kv_heads, g.head_dim), np.float32),
                self.rng.standard_normal((n, g.num_kv_heads, g.head_dim), np.float32))

    def check(self, layer, parts, q, k, v, result, partial=False):
        """parts: (seq, row, q_len, kv_len) of the rows `result` holds."""
        for seq, row, q_len, kv_len in parts:
            self.model.write(seq, layer, kv_len - q_len, k[row:row + q_len], v[row:row + q_len])
        wrong = self.model.check(layer, parts, q, result.output, result.lse)
        self.wrong += len(wrong)
        assert not wrong, f"wrong results at layer {layer}: {wrong}"
        self.runs_checked += 1
        self.seqs_checked += len(parts)
        if partial:
            self.partial_checked += len(parts)

    def forget(self, ids):
        for sid in ids:
            self.lens.pop(sid, None)
            self.model.erase(sid)

    # run()'s settings and hooks, each workload's own: the rates of both
    # faults, how many restarts spread over the rounds, restart_one() (a
    # server restarted), the holder release() empties (a KvManager or a
    # Cluster) and the admin clients of the servers a lease bounds.
    FAULT_RATE = 0.2
    RESTART_SPREAD = 3

    def run(self, rounds: int, min_injected: int = 0):
        """rounds rounds with the restarts spread over them, then more rounds
        (no restarts, at most `rounds` more) until min_injected faults were
        injected: how many calls a round makes, and so how many faults it
        draws, depends on the machine's timing."""
        self.faults.set_rates(unreachable=self.FAULT_RATE, reply_lost=self.FAULT_RATE)
        for round_ in _rounds(rounds, lambda: self.faults.injected < min_injected):
            if round_ < rounds and round_ and round_ % (rounds // self.RESTART_SPREAD + 1) == 0:
                if self.restart_due:
                    self.restart_one()
                self.restart_due = True
            action = self.pick.randrange(100)
            if action < 2:
                holder = self.holder()
                try:
                    holder.release()
                    error = None
                except attnserve.AttnserveError as e:
                    error = e
                assert not holder.sequences and not holder.lost
                self.model.clear()
                self.lens.clear()
                if error is not None:
                    self.settle(error)
            elif action < 25 and self.lens:
                ids = [sid for sid in self.lens if self.pick.randrange(3) == 0]
                if ids:
                    self.finish(ids)
            else:
                self.step()
            if self.lease:  # a lease bounds what the servers hold for it
                for admin in self.lease_admins():
                    assert held(admin) == ([], []), round_

    def report(self, name, faults):
        print(f"[faults] {name}: injected {faults.injected} (unreachable "
              f"{faults.counts[UNREACHABLE]}, reply lost {faults.counts[REPLY_LOST]}), lease "
              f"revocations {self.revocations}, restarts {self.restarts}; runs checked "
              f"{self.runs_checked} (sequences {self.seqs_checked}, in partial results "
              f"{self.partial_checked}), runs refused after a failed run {self.refusals}, "
              f"sequences lost {self.lost}, wrong results {self.wrong}")


def _rounds(rounds: int, more):
    """Round numbers 0 .. rounds - 1, then rounds, rounds + 1, ... while more()
    holds, at most `rounds` of them."""
    round_ = 0
    while round_ < rounds or (round_ < 2 * rounds and more()):
        yield round_
        round_ += 1


class ManagerWorkload(Workload):
    def __init__(self, lease: bool, server_plans: bool, seed: int):
        self.server = TestServer(num_pages=1024, **GEOMETRY)
        self.faults = FaultInjector(seed)
        self.client = attnserve.Client(self.server.address, timeout=30, channel_options=RECONNECT,
                                       interceptors=self.faults.interceptors)
        self.admin = attnserve.Client(self.server.address, timeout=30, channel_options=RECONNECT)
        self.mgr = attnserve.KvManager(self.client, lease=lease, server_plans=server_plans)
        self.lease = lease
        self.leaked_before_restart = 0
        super().__init__(seed, self.client.server_info)

    def close(self):
        self.client.close()
        self.admin.close()
        self.server.stop()

    def restart(self):
        address = self.server.address
        assert self.server.stop() == 0
        self.server = TestServer(num_pages=1024, extra_flags=[f"--listen={address}"], **GEOMETRY)
        self.admin.forget_incarnation()
        self.restarts += 1

    def on_restart(self):
        """What docs/kv_manager.md says to do after a restart."""
        self.mgr.reset()
        self.client.forget_incarnation()
        self.model.clear()
        self.lens.clear()
        self.leaked_before_restart = self.mgr.leaked_pages

    def settle(self, e) -> bool:
        """A call's error: losses and restarts handled; True when the
        sequences the test knows are still as it knows them."""
        if isinstance(e, attnserve.SequencesLost):
            for sid in e.seq_ids:
                assert sid in self.lens and self.mgr.has(sid), e
            self.forget(e.seq_ids)
            self.lost += len(e.seq_ids)
            self.mgr.finish(*e.seq_ids)  # needs no server
            assert not any(self.mgr.has(sid) for sid in e.seq_ids)
            return False
        if isinstance(e, attnserve.StaleIncarnation):
            self.on_restart()
            return False
        assert not isinstance(e, RARE), e
        return True

    def finish(self, ids):
        try:
            self.mgr.finish(*ids)
            error = None
        except attnserve.AttnserveError as e:
            error = e
        for sid in ids:  # forgotten whatever happened
            assert not self.mgr.has(sid), (sid, error)
        self.forget(ids)
        if error is not None:
            self.settle(error)

    def disturb(self):
        """Between the layers of a step: a restart, or the lease revoked."""
        if self.restart_due:
            self.restart_due = False
            self.restart()
        elif self.lease and self.mgr.lease_id and self.pick.randrange(50) == 0:
            self.admin.revoke_lease(self.mgr.lease_id)  # as its expiry would
            self.revocations += 1

    def step(self):
        ids, q_lens = self.batch()
        try:
            plan = self.mgr.plan(ids, q_lens)
        except attnserve.AttnserveError as e:
            if self.settle(e):
                assert not isinstance(e, attnserve.FailedPrecondition), e
                live = set(self.mgr.sequences)
                for sid in ids:  # atomic
                    assert (self.mgr.kv_len(sid) if sid in live else None) == self.lens.get(sid)
            return
        parts = []
        for b, sid in enumerate(ids):
            assert plan.kv_lens[b] == self.lens.get(sid, 0) + q_lens[b]
            self.lens[sid] = int(plan.kv_lens[b])
            parts.append((sid, int(plan.qo_indptr[b]), q_lens[b], int(plan.kv_lens[b])))
        for layer in range(self.g.num_layers):
            q, k, v = self.layer_data(plan.total_q)
            for _ in range(3):
                try:
                    r = self.mgr.run(layer, q, k, v, plan=plan)
                except attnserve.AttnserveError as e:
                    if not self.settle(e):
                        return
                    continue
                self.check(layer, parts, q, k, v, r)
                break
            else:
                # Refused until that layer runs again (or they finish).
                with pytest.raises(attnserve.FailedPrecondition, match=f"layer {layer}"):
                    self.mgr.plan(ids, [1] * len(ids))
                self.refusals += 1
                self.finish(ids)
                return
            self.disturb()

    def restart_one(self):
        self.restart()

    def holder(self):
        return self.mgr

    def lease_admins(self):
        return [self.admin]

    def check_nothing_held(self):
        if self.restart_due:
            self.restart()  # no step reached its layers since it was due
        self.faults.set_rates()
        if not self.lease:
            release_orphan_plans(self.admin)
        try:
            self.mgr.release()
        except attnserve.StaleIncarnation:
            self.on_restart()
            self.mgr.release()
        assert held(self.admin, 0) == ([], [])
        pages, plans = held(self.admin)
        assert plans == []
        if self.lease:
            assert pages == []
        else:
            assert len(pages) <= self.mgr.leaked_pages - self.leaked_before_restart


@pytest.mark.parametrize("lease,server_plans,rounds,min_injected", [
    (True, True, 700, 850), (False, True, 800, 800), (True, False, 600, 650)])
def test_manager_no_wrong_result_under_injected_failures(lease, server_plans, rounds,
                                                         min_injected):
    w = ManagerWorkload(lease, server_plans, seed=rounds + lease)
    try:
        w.run(rounds, min_injected)
        w.check_nothing_held()
    finally:
        w.report(f"KvManager lease={lease} server_plans={server_plans} rounds={rounds}", w.faults)
        w.close()
    assert w.wrong == 0
    assert w.faults.injected >= min_injected  # this test's share of issue #29's 10,000
    assert w.runs_checked >= rounds // 3 and w.refusals > 0 and w.restarts == 2
    if lease:
        assert w.lost > 0 and w.revocations > 0


def test_async_manager_no_wrong_result_under_injected_failures():
    """AsyncKvManager: two micro-batches of disjoint sequences in flight at once."""
    server = TestServer(num_pages=1024, **GEOMETRY)
    faults = FaultInjector(31)
    admin = attnserve.Client(server.address, timeout=30)
    w = Workload(31, admin.server_info)
    new_ids = iter(range(1, 1 << 30))

    async def micro_batch(mgr, parity: int, steps: int):
        async def lose(e):
            mine = [sid for sid in e.seq_ids if sid % 2 == parity]
            w.forget(mine)
            w.lost += len(mine)
            await mgr.finish(*mine)  # needs no server

        for _ in range(steps):
            batch = sorted(sid for sid in w.lens if sid % 2 == parity)[:3]
            q_lens = [w.pick.randint(1, 3) for _ in batch]
            while not batch or w.pick.randrange(3) == 0:
                batch.append(next(new_ids) * 2 + parity)
                q_lens.append(w.pick.randint(1, 12))
            try:
                plan = await mgr.plan(batch, q_lens)
            except attnserve.SequencesLost as e:
                await lose(e)
                continue
            except attnserve.AttnserveError as e:
                assert not isinstance(e, RARE + (attnserve.FailedPrecondition,)), e
                continue
            parts = []
            for b, sid in enumerate(batch):
                w.lens[sid] = int(plan.kv_lens[b])
                parts.append((sid, int(plan.qo_indptr[b]), q_lens[b], int(plan.kv_lens[b])))
            ok = True
            for layer in range(w.g.num_layers):
                q, k, v = w.layer_data(plan.total_q)
                for _ in range(3):
                    try:
                        r = await mgr.run(layer, q, k, v, plan=plan)
                    except attnserve.SequencesLost as e:
                        await lose(e)
                        ok = False
                        break
                    except attnserve.AttnserveError as e:
                        assert not isinstance(e, RARE), e
                        continue
                    w.check(layer, parts, q, k, v, r)
                    break
                else:
                    # Refused until the layer runs again; or, where the other
                    # micro-batch revoked the lease meanwhile, lost.
                    try:
                        await mgr.plan(batch, [1] * len(batch))
                    except attnserve.SequencesLost as e:
                        await lose(e)
                    except attnserve.FailedPrecondition as e:
                        assert f"layer {layer}" in str(e), e
                        w.refusals += 1
                    else:
                        pytest.fail(f"a plan after layer {layer} failed was not refused")
                    ok = False
                if not ok:
                    break
            if not ok or w.pick.randrange(4) == 0:
                done = [sid for sid in batch if mgr.has(sid)]
                w.forget(batch)
                try:
                    await mgr.finish(*done)
                except attnserve.SequencesLost as e:
                    await lose(e)
                except attnserve.AttnserveError as e:
                    assert not isinstance(e, RARE), e
                assert not any(mgr.has(sid) for sid in done)
            if mgr.lease_id and w.pick.randrange(60) == 0:
                admin.revoke_lease(mgr.lease_id)  # as its expiry would
                w.revocations += 1

    async def body():
        async with AsyncClient(server.address, timeout=30,
                               interceptors=faults.aio_interceptors) as c:
            mgr = attnserve.AsyncKvManager(c)
            faults.set_rates(unreachable=0.2, reply_lost=0.2)
            await asyncio.gather(micro_batch(mgr, 0, 150), micro_batch(mgr, 1, 150))
            faults.set_rates()
            await mgr.release()

    try:
        asyncio.run(body())
        assert held(admin, 0) == ([], []) and held(admin) == ([], [])
    finally:
        w.report("AsyncKvManager", faults)
        admin.close()
        server.stop()
    assert w.wrong == 0
    assert faults.injected >= 400  # this test's share of issue #29's 10,000
    assert w.runs_checked >= 100


class ClusterWorkload(Workload):
    SERVERS = 3
    FAULT_RATE = 0.1
    RESTART_SPREAD = 4

    def __init__(self, lease: bool, seed: int):
        # Without a lease, pages leak: room for them.
        self.servers = [TestServer(num_pages=2048, **GEOMETRY) for _ in range(self.SERVERS)]
        self.faults = FaultInjector(seed)
        self.lease = lease
        self.cluster = attnserve.Cluster([s.address for s in self.servers], split_min_tokens=10,
                                         refresh_interval=1.0, lease=lease, timeout=30,
                                         channel_options=RECONNECT,
                                         interceptors=self.faults.interceptors)
        self.admins = [attnserve.Client(s.address, timeout=30, channel_options=RECONNECT)
                       for s in self.servers]
        self.spread = 0
        super().__init__(seed, self.cluster.server_info)

    def close(self):
        self.cluster.close()
        for a in self.admins:
            a.close()
        for s in self.servers:
            s.stop()

    def restart(self, i: int):
        address = self.servers[i].address
        assert self.servers[i].stop() == 0
        self.servers[i] = TestServer(num_pages=2048, extra_flags=[f"--listen={address}"],
                                     **GEOMETRY)
        self.admins[i].forget_incarnation()
        self.restarts += 1

    def settle(self, e) -> bool:
        if isinstance(e, attnserve.SequencesLost):
            for sid in e.seq_ids:
                assert sid in self.lens, e
            self.forget(e.seq_ids)
            self.lost += len(e.seq_ids)
            self.finish(e.seq_ids)
            return False
        assert not isinstance(e, RARE + (attnserve.StaleIncarnation,)), e
        return True

    def finish(self, ids):
        try:
            self.cluster.finish(*ids)
            error = None
        except attnserve.AttnserveError as e:
            error = e
        for sid in ids:
            assert sid not in self.cluster.sequences and sid not in self.cluster.lost, error
        self.forget(ids)
        if error is not None:
            self.settle(error)

    def disturb(self):
        if self.restart_due:
            self.restart_due = False
            self.restart(self.pick.randrange(self.SERVERS))
        elif self.lease and self.pick.randrange(50) == 0:
            i = self.pick.randrange(self.SERVERS)
            lease_id = self.cluster.kv_manager(i).lease_id
            if lease_id:
                self.admins[i].revoke_lease(lease_id)
                self.revocations += 1

    def step(self):
        ids, q_lens = self.batch()
        try:
            step = self.cluster.plan(ids, q_lens)
        except attnserve.AttnserveError as e:
            if self.settle(e):
                assert not isinstance(e, attnserve.FailedPrecondition), e
            return
        parts = []
        for b, sid in enumerate(ids):
            assert step.kv_lens[b] == self.lens.get(sid, 0) + q_lens[b]
            self.lens[sid] = int(step.kv_lens[b])
            parts.append((sid, int(step.qo_indptr[b]), q_lens[b], int(step.kv_lens[b])))
            self.spread += len(self.cluster.shards_of(sid)) > 1
        gone = set()
        for layer in range(self.g.num_layers):
            q, k, v = self.layer_data(step.total_q)
            live = [p for p in parts if p[0] not in gone]
            for _ in range(3):
                try:
                    r = self.cluster.run(layer, q, k, v, step=step)
                except attnserve.SequencesLost as e:
                    # The other sequences' rows are there, and right.
                    gone.update(e.seq_ids)
                    self.check(layer, [p for p in live if p[0] not in gone], q, k, v, e.partial,
                               partial=True)
                    self.settle(e)
                    break
                except attnserve.AttnserveError as e:
                    self.settle(e)
                    continue
                self.check(layer, live, q, k, v, r)
                break
            else:
                left = [sid for sid in ids if sid in self.lens]
                if not left:
                    return
                try:
                    self.cluster.plan(left, [1] * len(left))
                except attnserve.FailedPrecondition as e:
                    assert f"layer {layer}" in str(e), e
                    self.refusals += 1
                except attnserve.AttnserveError as e:
                    # The part that failed appended nothing (a shard before the
                    # new tokens), or this plan failed too.
                    self.settle(e)
                left = [sid for sid in ids if sid in self.lens]
                if left:
                    self.finish(left)
                return
            self.disturb()

    def restart_one(self):
        self.restart(self.pick.randrange(self.SERVERS))

    def holder(self):
        return self.cluster

    def lease_admins(self):
        return self.admins

    def check_nothing_held(self):
        if self.restart_due:
            self.restart(self.pick.randrange(self.SERVERS))  # none since it was due
        self.faults.set_rates()
        if not self.lease:
            for admin in self.admins:
                release_orphan_plans(admin)
        try:
            self.cluster.release()
        except attnserve.AttnserveError as e:
            self.settle(e)
        assert not self.cluster.sequences and not self.cluster.lost
        self.cluster.release()  # ends the leases a failure left
        for i, admin in enumerate(self.admins):
            assert held(admin, 0) == ([], []), i
            pages, plans = held(admin)
            if self.lease:
                assert (pages, plans) == ([], []), i
            else:
                assert len(pages) <= self.cluster.servers()[i].leaked_pages, i


@pytest.mark.parametrize("lease,rounds,min_injected", [(True, 1000, 900), (False, 1000, 900)])
def test_cluster_no_wrong_result_under_injected_failures(lease, rounds, min_injected):
    w = ClusterWorkload(lease, seed=rounds + 7 * lease)
    try:
        w.run(rounds, min_injected)
        w.check_nothing_held()
    finally:
        w.report(f"Cluster lease={lease} rounds={rounds}", w.faults)
        w.close()
    assert w.wrong == 0
    assert w.faults.injected >= min_injected  # this test's share of issue #29's 10,000
    assert w.runs_checked >= rounds // 3 and w.spread > 0 and w.restarts == 3


# ---------------------------------------------------------------- one at a time

def _layers(model, g, rng, run, seq, q_len, kv_len) -> list:
    """Every layer of a one-sequence step through `run(layer, q, k, v)`,
    checked; the mismatches."""
    wrong = []
    for layer in range(g.num_layers):
        q = rng.standard_normal((q_len, g.num_qo_heads, g.head_dim), np.float32)
        k = rng.standard_normal((q_len, g.num_kv_heads, g.head_dim), np.float32)
        v = rng.standard_normal((q_len, g.num_kv_heads, g.head_dim), np.float32)
        r = run(layer, q, k, v)
        model.write(seq, layer, kv_len - q_len, k, v)
        wrong += model.check(layer, [(seq, 0, q_len, kv_len)], q, r.output, r.lse)
    return wrong


def test_a_finish_whose_reply_is_lost_never_leaves_a_sequence_over_freed_pages():
    """Issue #29, item 1: FreePages times out on the client while the server
    completes it. The old manager kept the sequence; the next sequence was
    given its pages, and the old one then attended over the new one's KV."""
    faults = FaultInjector(1)
    with TestServer(num_pages=64, **GEOMETRY) as server:
        client = attnserve.Client(server.address, timeout=30, interceptors=faults.interceptors)
        g = client.server_info
        model = SequenceModel(g.num_layers, g.num_kv_heads, g.head_dim, g.wire_dtype)
        rng = np.random.default_rng(291)
        mgr = attnserve.KvManager(client)

        def run(layer, q, k, v):
            return mgr.run(layer, q, k, v)

        mgr.plan([1], [8])
        assert _layers(model, g, rng, run, 1, 8, 8) == []
        faults.fail_next("FreePages", REPLY_LOST)  # the server frees them; the reply is lost
        with pytest.raises(attnserve.DeadlineExceeded):
            mgr.finish(1)
        forgotten = 1 not in mgr.sequences
        mgr.plan([2], [8])                          # gets the pages the server freed
        assert _layers(model, g, rng, run, 2, 8, 8) == []
        if not forgotten:                           # decoding 1 must not read 2's KV
            mgr.plan([1], [1])
            assert _layers(model, g, rng, run, 1, 1, 9) == []
        assert forgotten, "sequence 1 outlived a finish() whose outcome is unknown"
        mgr.release()
        client.close()


def _two_servers(**cluster_kwargs):
    servers = [TestServer(num_pages=64, **GEOMETRY) for _ in range(2)]
    return servers, attnserve.Cluster([s.address for s in servers], timeout=30,
                                      **cluster_kwargs)


def test_a_cluster_finish_that_fails_on_one_server_forgets_every_sequence_it_names():
    """Issue #29, item 2: finish(a, b) while b's server is briefly unreachable.
    The old cluster had a's server free and forget `a` but kept listing it,
    and decoding `a` attended over a fresh one-token sequence."""
    faults = FaultInjector(2)
    servers, cluster = _two_servers(interceptors=faults.interceptors)
    try:
        g = cluster.server_info
        model = SequenceModel(g.num_layers, g.num_kv_heads, g.head_dim, g.wire_dtype)
        rng = np.random.default_rng(292)

        def run(layer, q, k, v):
            return cluster.run(layer, q, k, v)

        cluster.plan(["a"], [8])
        assert _layers(model, g, rng, run, "a", 8, 8) == []
        cluster.plan(["b"], [8])                     # the other server: more free pages
        assert _layers(model, g, rng, run, "b", 8, 8) == []
        (sa,), (sb,) = cluster.shards_of("a"), cluster.shards_of("b")
        assert sa.server != sb.server
        b_server = servers[sb.server].address
        faults.set_down(b_server, True)
        with pytest.raises(attnserve.AttnserveError) as failed:
            cluster.finish("a", "b")
        faults.set_down(b_server, False)
        forgotten = "a" not in cluster.sequences and "b" not in cluster.sequences
        if "a" in cluster.sequences:                 # decoding `a` must read a's KV only
            cluster.plan(["a"], [1])
            assert _layers(model, g, rng, run, "a", 1, 9) == []
        assert forgotten, "a sequence outlived a finish() that freed it"
        assert b_server in str(failed.value)         # the server that could not confirm
        cluster.release()
    finally:
        cluster.close()
        for s in servers:
            s.stop()


def test_a_server_that_never_comes_back_does_not_block_finish_or_release():
    """Issue #29, item 3: a server of a fixed target list that never comes
    back. The old cluster never declared its sequences lost, and finish()
    and release() raised Unavailable for ever."""
    servers, cluster = _two_servers()
    try:
        cluster.plan([1, 2, 3, 4], [8, 8, 8, 8])
        on_dead = [sid for sid in (1, 2, 3, 4) if cluster.shards_of(sid)[0].server == 1]
        assert len(on_dead) == 2
        servers[1].stop()                             # for good
        try:
            cluster.finish(on_dead[0])
        except attnserve.AttnserveError:
            pass
        assert on_dead[0] not in cluster.sequences
        try:
            cluster.release()
        except attnserve.AttnserveError:
            cluster.release()                         # the first may report the dead server
        assert cluster.sequences == [] and cluster.lost == []
    finally:
        cluster.close()
        for s in servers:
            s.stop()


def test_a_server_unreachable_past_the_deadline_loses_its_sequences():
    servers, cluster = _two_servers(server_lost_after=0)
    try:
        g = cluster.server_info
        step = cluster.plan([1, 2, 3, 4], [8, 8, 8, 8])
        dead = [sid for sid in (1, 2, 3, 4) if cluster.shards_of(sid)[0].server == 1]
        alive = [sid for sid in (1, 2, 3, 4) if sid not in dead]
        servers[1].stop()
        rng = np.random.default_rng(293)
        q = rng.standard_normal((32, g.num_qo_heads, g.head_dim), np.float32)
        k = rng.standard_normal((32, g.num_kv_heads, g.head_dim), np.float32)
        with pytest.raises(attnserve.SequencesLost) as lost:
            cluster.run(0, q, k, k, step=step)
        assert lost.value.seq_ids == dead and cluster.lost == dead
        model = SequenceModel(g.num_layers, g.num_kv_heads, g.head_dim, g.wire_dtype)
        parts = [(sid, b * 8, 8, 8) for b, sid in enumerate(step.seq_ids) if sid in alive]
        for sid, row, _, _ in parts:
            model.write(sid, 0, 0, k[row:row + 8], k[row:row + 8])
        assert model.check(0, parts, q, lost.value.partial.output, lost.value.partial.lse) == []
        assert not cluster.servers()[1].active
        with pytest.raises(attnserve.SequencesLost):
            cluster.plan([dead[0]], [1])
        cluster.finish(dead[0])                       # succeeds without the server
        cluster.plan([alive[0], 5], [1, 3])
        assert cluster.shards_of(5)[0].server == 0
        cluster.release()
        assert cluster.sequences == [] and cluster.lost == []
    finally:
        cluster.close()
        for s in servers:
            s.stop()


@pytest.mark.parametrize("never", [None, -1.0])
def test_a_server_is_never_declared_lost_with_none_or_a_negative_deadline(never):
    """server_lost_after None or negative (as C++'s negative
    server_lost_after_s): an unreachable server's calls fail as
    Unavailable, its sequences stay the cluster's."""
    servers, cluster = _two_servers(server_lost_after=never)
    try:
        assert cluster.server_lost_after is None
        g = cluster.server_info
        step = cluster.plan([1, 2, 3, 4], [8, 8, 8, 8])
        servers[1].stop()
        rng = np.random.default_rng(294)
        q = rng.standard_normal((32, g.num_qo_heads, g.head_dim), np.float32)
        k = rng.standard_normal((32, g.num_kv_heads, g.head_dim), np.float32)
        for _ in range(2):
            with pytest.raises(attnserve.Unavailable):
                cluster.run(0, q, k, k, step=step)
        assert cluster.lost == [] and sorted(cluster.sequences) == [1, 2, 3, 4]
    finally:
        cluster.close()
        for s in servers:
            s.stop()


def test_the_lease_reconciles_what_a_failed_call_left_in_doubt():
    faults = FaultInjector(3)
    with TestServer(num_pages=64, **GEOMETRY) as server:
        client = attnserve.Client(server.address, timeout=30, interceptors=faults.interceptors)
        admin = attnserve.Client(server.address, timeout=30)
        with attnserve.KvManager(client) as mgr:
            mgr.plan([1, 2], [8, 8])
            lease = mgr.lease_id
            assert lease
            faults.fail_next("FreePages", UNREACHABLE)    # never reaches the server
            with pytest.raises(attnserve.Unavailable, match="finish: the sequences are forgotten"):
                mgr.finish(1)
            assert not mgr.has(1) and len(held(admin, lease)[0]) == 4
            faults.fail_next("AllocatePages", REPLY_LOST)  # done there, the reply lost
            with pytest.raises(attnserve.DeadlineExceeded):
                mgr.plan([3], [4])
            assert len(held(admin, lease)[0]) == 3        # 2's, and one nobody knows
            faults.fail_next("CreatePlan", REPLY_LOST)
            with pytest.raises(attnserve.DeadlineExceeded):
                mgr.plan([2], [4])
            assert mgr.kv_len(2) == 8 and len(held(admin, lease)[1]) == 1
            plan = mgr.plan([4], [4])                     # reconciles first
            pages, plans = held(admin, lease)
            assert sorted(pages) == sorted(mgr.pages_of(2) + mgr.pages_of(4))
            assert plans == [plan.plan_id]
        assert held(admin, 0) == ([], []) and held(admin) == ([], [])  # closed: revoked
        client.close()
        admin.close()


def test_a_sequence_lost_mid_step_leaves_the_rest_of_its_plan_to_be_finished():
    """The reconciliation finds a sequence's pages freed behind the manager's
    back between two layers of its step: that sequence is lost, and the
    others of the plan keep their rows, but the layers of that step that had
    not run can no longer run for them, so plan() refuses them until they
    are finished (a later step would attend over rows never written)."""
    faults = FaultInjector(8)
    with TestServer(num_pages=64, **GEOMETRY) as server:
        client = attnserve.Client(server.address, timeout=30, interceptors=faults.interceptors)
        admin = attnserve.Client(server.address, timeout=30)
        g = client.server_info
        with attnserve.KvManager(client) as mgr:
            plan = mgr.plan([1, 2], [4, 4])
            rng = np.random.default_rng(12)
            q = rng.standard_normal((8, g.num_qo_heads, g.head_dim), np.float32)
            k = rng.standard_normal((8, g.num_kv_heads, g.head_dim), np.float32)
            mgr.run(0, q, k, k)
            faults.fail_next("AllocatePages", REPLY_LOST)  # the holdings are in doubt
            with pytest.raises(attnserve.DeadlineExceeded):
                mgr.plan([3], [4])
            admin.release_plan(plan.plan_id)               # a client without the lease
            admin.free_pages(mgr.pages_of(1))
            with pytest.raises(attnserve.SequencesLost) as lost:
                mgr.plan([4], [4])
            assert lost.value.seq_ids == [1]
            with pytest.raises(attnserve.FailedPrecondition,
                               match="sequences 2: layer 1 of step 1: .*never completed, and that "
                                     "plan can no longer run"):
                mgr.plan([2], [1])
            assert mgr.kv_len(2) == 4
            mgr.finish(1, 2)
            mgr.plan([2], [2])                             # a new sequence under the same id
        client.close()
        admin.close()


def test_undo_keeps_a_sequence_that_existed_before_its_plan():
    with TestServer(num_pages=64, **GEOMETRY) as server:
        client = attnserve.Client(server.address, timeout=30)
        with attnserve.KvManager(client) as mgr:
            mgr.plan([7], [0])
            plan = mgr.plan([7, 8], [4, 4])
            mgr.undo(plan)
            assert mgr.has(7) and mgr.kv_len(7) == 0
            assert not mgr.has(8)                          # the plan undone started it
            mgr.finish(7)
        client.close()


def test_without_a_lease_a_free_whose_outcome_is_unknown_is_leaked_never_retried():
    faults = FaultInjector(4)
    with TestServer(num_pages=64, **GEOMETRY) as server:
        client = attnserve.Client(server.address, timeout=30, interceptors=faults.interceptors)
        admin = attnserve.Client(server.address, timeout=30)
        mgr = attnserve.KvManager(client, lease=False)
        mgr.plan([1, 2], [8, 8])
        assert mgr.lease_id == 0
        faults.fail_next("FreePages", UNREACHABLE)
        with pytest.raises(attnserve.Unavailable, match="leaked"):
            mgr.finish(1)
        assert not mgr.has(1) and mgr.leaked_pages == 2
        mgr.release()
        assert len(held(admin)[0]) == 2                   # attnctl release-all gets them back
        client.close()
        admin.close()


def test_an_expired_lease_loses_every_sequence_and_finish_needs_no_server():
    faults = FaultInjector(5)
    with TestServer(num_pages=64, **GEOMETRY) as server:
        client = attnserve.Client(server.address, timeout=30, interceptors=faults.interceptors)
        admin = attnserve.Client(server.address, timeout=30)
        g = client.server_info
        mgr = attnserve.KvManager(client)
        mgr.plan([1, 2], [8, 3])
        q = np.ones((11, g.num_qo_heads, g.head_dim), np.float32)
        kv = np.ones((11, g.num_kv_heads, g.head_dim), np.float32)
        mgr.run(0, q, kv, kv)
        lease = mgr.lease_id
        admin.revoke_lease(lease)                         # as its expiry would
        with pytest.raises(attnserve.SequencesLost) as lost:
            mgr.run(1, q, kv, kv)
        assert lost.value.seq_ids == [1, 2] and mgr.lost == [1, 2] and mgr.sequences == []
        with pytest.raises(attnserve.SequencesLost):
            mgr.plan([2], [1])
        faults.set_down(server.address, True)
        mgr.finish(1, 2)                                  # needs no server
        faults.set_down(server.address, False)
        assert mgr.lost == []
        mgr.plan([3], [2])
        assert mgr.lease_id not in (0, lease)
        mgr.close()
        client.close()
        admin.close()


def test_a_release_that_reaches_no_server_leaves_nothing_past_the_ttl():
    faults = FaultInjector(7)
    with TestServer(num_pages=64, **GEOMETRY) as server:
        client = attnserve.Client(server.address, timeout=30, interceptors=faults.interceptors)
        admin = attnserve.Client(server.address, timeout=30)
        mgr = attnserve.KvManager(client, lease_ttl=1.0)
        mgr.plan([1, 2], [8, 8])
        faults.set_down(server.address, True)             # the release reaches nothing
        with pytest.raises(attnserve.Unavailable):
            mgr.release()
        faults.set_down(server.address, False)
        assert mgr.sequences == []
        # No renewal any more: the server releases it all once the ttl has
        # passed (polled for up to 10 s; it takes the ttl and the reaper's 100 ms).
        for _ in range(200):
            if not admin.list_holdings().leases:
                break
            time.sleep(0.05)
        assert admin.list_holdings().leases == () and held(admin) == ([], [])
        client.close()
        admin.close()


def test_a_failed_run_refuses_the_plan_until_the_layer_runs_again():
    faults = FaultInjector(6)
    with TestServer(num_pages=64, **GEOMETRY) as server:
        client = attnserve.Client(server.address, timeout=30, interceptors=faults.interceptors)
        g = client.server_info
        mgr = attnserve.KvManager(client)
        plan = mgr.plan([7, 9], [3, 2])
        rng = np.random.default_rng(6)
        q = rng.standard_normal((5, g.num_qo_heads, g.head_dim), np.float32)
        k = rng.standard_normal((5, g.num_kv_heads, g.head_dim), np.float32)
        mgr.run(0, q, k, k, plan=plan)
        faults.fail_next("Prefill", REPLY_LOST)           # layer 1 may or may not be appended
        with pytest.raises(attnserve.DeadlineExceeded):
            mgr.run(1, q, k, k, plan=plan)
        with pytest.raises(attnserve.FailedPrecondition, match="sequences 9, 7: layer 1 of step 1"):
            mgr.plan([9, 7], [1, 1])
        assert mgr.kv_len(9) == 2
        mgr.plan([11], [1])                               # others are not held up
        mgr.run(1, q, k, k, plan=plan)                    # the layer again, the same rows
        mgr.plan([9, 7], [1, 1])
        mgr.close()
        client.close()


def test_finishing_part_of_a_plan_whose_run_failed_says_the_rest_can_only_be_finished():
    faults = FaultInjector(8)
    with TestServer(num_pages=64, **GEOMETRY) as server:
        client = attnserve.Client(server.address, timeout=30, interceptors=faults.interceptors)
        g = client.server_info
        with attnserve.KvManager(client) as mgr:
            plan = mgr.plan([7, 9], [3, 2])
            rng = np.random.default_rng(8)
            q = rng.standard_normal((5, g.num_qo_heads, g.head_dim), np.float32)
            k = rng.standard_normal((5, g.num_kv_heads, g.head_dim), np.float32)
            mgr.run(0, q, k, k, plan=plan)
            faults.fail_next("Prefill", REPLY_LOST)
            with pytest.raises(attnserve.DeadlineExceeded):
                mgr.run(1, q, k, k, plan=plan)
            mgr.finish(7)                                 # the plan goes stale
            with pytest.raises(attnserve.FailedPrecondition,
                               match=r"sequences 9: layer 1 of step 1: .*that plan can no longer "
                                     r"run .*finish\(\) the sequences"):
                mgr.plan([9], [1])
            with pytest.raises(RuntimeError, match="stale"):
                mgr.run(1, q, k, k, plan=plan)
            mgr.finish(9)
            mgr.plan([9], [2])                            # a new sequence under the same id
        client.close()


class _Interrupt(BaseException):
    """What a cancelled task or KeyboardInterrupt looks like to the manager:
    not an AttnserveError."""


def _interrupt_after(obj, method, when=lambda n: True):
    """Makes obj.method run on the server, then raise _Interrupt (the
    caller's task cancelled while the reply was on its way) on the calls
    `when` picks (1, 2, ...); returns a function that restores it."""
    real, count = getattr(obj, method), [0]

    def call(*args, **kwargs):
        count[0] += 1
        result = real(*args, **kwargs)
        if when(count[0]):
            raise _Interrupt()
        return result
    setattr(obj, method, call)
    return lambda: setattr(obj, method, real)


def _sigint_inside(obj, method):
    """obj.method first sends this process SIGINT (Ctrl-C landing while the
    manager's own bookkeeping runs, between its calls to the server);
    returns a function that restores it."""
    real = getattr(obj, method)

    def call(*args, **kwargs):
        signal.raise_signal(signal.SIGINT)
        return real(*args, **kwargs)
    setattr(obj, method, call)
    return lambda: delattr(obj, method)


def _lease_pages(client, lease_id):
    return sorted(p for info in client.list_holdings(lease_id).leases
                  if info.lease_id == lease_id for p in info.holdings.pages)


def test_ctrl_c_while_a_plan_lays_out_its_step_leaves_nothing_held():
    """Ctrl-C after plan()'s AllocatePages, while it lays out the step: plan()
    raises KeyboardInterrupt before its CreatePlan leaves, the manager knows
    nothing new, and the next call frees the pages it had been given."""
    with TestServer(num_pages=64, **GEOMETRY) as server:
        client = attnserve.Client(server.address, timeout=30)
        with attnserve.KvManager(client) as mgr:
            mgr.plan([1], [3])
            restore = _sigint_inside(mgr, "_lay_out")
            with pytest.raises(KeyboardInterrupt):
                mgr.plan([2, 3], [40, 40])
            restore()
            assert sorted(mgr.sequences) == [1]
            mgr.plan([4], [1])
            mgr.finish(4)
            assert _lease_pages(client, mgr.lease_id) == sorted(mgr.pages_of(1))
        client.close()


def test_ctrl_c_while_a_plan_commits_comes_out_of_the_next_call():
    """Ctrl-C while plan() commits its step (no call left to make): the step
    commits whole and plan() returns it; the interruption comes out of the
    manager's next call before it does anything. Raised by plan() itself, it
    would say the step had failed, and the same step planned again would
    grow the sequences twice over rows never written."""
    with TestServer(num_pages=64, **GEOMETRY) as server:
        client = attnserve.Client(server.address, timeout=30)
        g = client.server_info
        with attnserve.KvManager(client) as mgr:
            restore = _sigint_inside(mgr, "_apply")
            try:
                plan = mgr.plan([1, 2], [3, 5])
            except KeyboardInterrupt:
                pytest.fail("plan() raised the interruption of a step it had committed")
            finally:
                restore()
            assert (mgr.kv_len(1), mgr.kv_len(2)) == (3, 5) and mgr._latest is plan
            rng = np.random.default_rng(11)
            q = rng.standard_normal((8, g.num_qo_heads, g.head_dim), np.float32)
            k = rng.standard_normal((8, g.num_kv_heads, g.head_dim), np.float32)
            with pytest.raises(KeyboardInterrupt):
                mgr.run(0, q, k, k)
            for layer in range(g.num_layers):
                mgr.run(layer, q, k, k)
            mgr.plan([1, 2], [1, 1])  # every layer of the step was written
        client.close()


def test_an_interrupted_run_is_a_run_that_may_have_appended():
    """A run() interrupted while its Prefill was in flight (here after the
    server appended) is refused by plan() until that layer runs again, as a
    failed one: never a step over rows the manager cannot vouch for."""
    with TestServer(num_pages=64, **GEOMETRY) as server:
        client = attnserve.Client(server.address, timeout=30)
        g = client.server_info
        with attnserve.KvManager(client) as mgr:
            plan = mgr.plan([7], [4])
            rng = np.random.default_rng(9)
            q = rng.standard_normal((4, g.num_qo_heads, g.head_dim), np.float32)
            k = rng.standard_normal((4, g.num_kv_heads, g.head_dim), np.float32)
            mgr.run(0, q, k, k)
            restore = _interrupt_after(mgr._rpc, "prefill_layout")
            with pytest.raises(_Interrupt):
                mgr.run(1, q, k, k)
            restore()
            with pytest.raises(attnserve.FailedPrecondition, match="sequences 7: layer 1 of step "
                                                                  "1: .*failed or was interrupted"):
                mgr.plan([7], [1])
            mgr.run(1, q, k, k, plan=plan)
            mgr.plan([7], [1])
        client.close()


def test_an_interrupted_async_run_is_a_run_that_may_have_appended():
    async def main(address):
        client = AsyncClient(address, timeout=30)
        await client.info()
        g = client.server_info
        mgr = attnserve.AsyncKvManager(client)
        plan = await mgr.plan([7], [64])
        rng = np.random.default_rng(10)
        q = rng.standard_normal((64, g.num_qo_heads, g.head_dim), np.float32)
        k = rng.standard_normal((64, g.num_kv_heads, g.head_dim), np.float32)
        await mgr.run(0, q, k, k)
        task = asyncio.ensure_future(mgr.run(1, q, k, k))
        await asyncio.sleep(0)                            # the Prefill is on its way
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        with pytest.raises(attnserve.FailedPrecondition, match="sequences 7: layer 1 of step 1"):
            await mgr.plan([7], [1])
        await mgr.run(1, q, k, k, plan=plan)
        await mgr.plan([7], [1])
        await mgr.close()
        await client.close()

    with TestServer(num_pages=64, **GEOMETRY) as server:
        asyncio.run(main(server.address))


@pytest.mark.parametrize("then", ["finish_other", "plan_again", "plan_in_flight"])
def test_an_async_run_that_fails_after_its_plan_went_stale_still_marks_its_sequences(then):
    """AsyncKvManager lets finish() and plan() overlap a run(). A run whose
    plan went stale while it was in flight (finish() of another of its
    sequences, or a later plan of the same one, committed before the run
    failed or while it failed) and then failed left its sequences unmarked:
    plan() went on over rows that may never have been written (with
    --check_kv_written=false, attention over zeros). Now plan() refuses
    them: that step can no longer run, finish() them."""
    class FailLater(grpc.aio.UnaryUnaryClientInterceptor):
        armed = False
        slow_create = False

        async def intercept_unary_unary(self, continuation, details, request):
            method = details.method.decode() if isinstance(details.method, bytes) \
                else details.method
            if self.armed and method.endswith("/Prefill"):
                self.armed = False
                await asyncio.sleep(0.3)                  # in flight, then lost, unsent
                raise grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(),
                                           grpc.aio.Metadata(), "injected: connection lost")
            if self.slow_create and method.endswith("/CreatePlan"):
                self.slow_create = False
                await asyncio.sleep(0.6)                  # the run fails meanwhile
            return await continuation(details, request)

    async def main(address):
        fault = FailLater()
        client = AsyncClient(address, timeout=30, interceptors=[fault])
        await client.info()
        g = client.server_info
        mgr = attnserve.AsyncKvManager(client)
        rng = np.random.default_rng(12)

        def rows(n):
            return (rng.standard_normal((n, g.num_qo_heads, g.head_dim), np.float32),
                    rng.standard_normal((n, g.num_kv_heads, g.head_dim), np.float32))
        plan = await mgr.plan([1, 2], [3, 3])
        q, k = rows(6)
        fault.armed = True
        run = asyncio.ensure_future(mgr.run(0, q, k, k, plan=plan))
        await asyncio.sleep(0.1)                          # the Prefill is on its way
        if then == "finish_other":
            await mgr.finish(1)
        else:
            fault.slow_create = then == "plan_in_flight"
            await mgr.plan([2], [1])                      # commits step 2 over step 1's rows
        with pytest.raises(attnserve.Unavailable):
            await run
        with pytest.raises(attnserve.FailedPrecondition,
                           match="sequences 2: layer 0 of step 1: .*can no longer run"):
            await mgr.plan([2], [1])
        await mgr.finish(2)
        await mgr.plan([2], [1])                          # a new sequence 2 starts clean
        await mgr.close()
        await client.close()

    with TestServer(num_pages=64, **GEOMETRY) as server:
        asyncio.run(main(server.address))


@pytest.mark.parametrize("lease", [True, False])
def test_an_interrupted_plan_leaves_nothing_held_past_the_next_call(lease):
    """plan() interrupted once its CreatePlan was done on the server (the
    pages allocated, the plan made): the manager makes no further call then;
    the next call releases the plan and frees the pages (with the lease by
    its reconciliation, without from the pages it meant to free)."""
    with TestServer(num_pages=64, **GEOMETRY) as server:
        client = attnserve.Client(server.address, timeout=30)
        admin = attnserve.Client(server.address, timeout=30)
        mgr = attnserve.KvManager(client, lease=lease)
        mgr.plan([1], [4])
        under = mgr.lease_id if lease else None
        restore = _interrupt_after(mgr._rpc, "create_plan")
        for sid in (100, 101, 102):
            with pytest.raises(_Interrupt):
                mgr.plan([sid], [16])
        restore()
        assert mgr.sequences == [1]
        mgr.plan([2], [4])
        if not lease:
            # The plans whose CreatePlan replies were cut short are nobody's
            # (the server drops them after --plan_idle_timeout_s) and pin
            # the pages the manager frees at its next calls.
            known = {s.plan.plan_id for s in mgr._seqs.values()}
            for plan_id in set(held(admin)[1]) - known:
                admin.release_plan(plan_id)
        mgr.finish(2)
        pages, plans = held(admin, under)
        assert sorted(pages) == sorted(mgr.pages_of(1)) and mgr.leaked_pages == 0
        assert len(plans) == 1                            # sequence 1's
        mgr.close()
        client.close()
        admin.close()


def test_an_interrupted_async_plan_is_reconciled_by_the_next_call():
    async def main(address, admin):
        client = AsyncClient(address, timeout=30)
        await client.info()
        mgr = attnserve.AsyncKvManager(client)
        await mgr.plan([1], [4])
        real = mgr._rpc.create_plan

        async def cancelled(*args, **kwargs):
            await real(*args, **kwargs)                   # done on the server, then
            raise asyncio.CancelledError()                # the caller's task is cancelled
        mgr._rpc.create_plan = cancelled
        for sid in (100, 101, 102):
            with pytest.raises(asyncio.CancelledError):
                await mgr.plan([sid], [16])
        mgr._rpc.create_plan = real
        await mgr.plan([2], [4])
        await mgr.finish(2)
        pages, plans = held(admin, mgr.lease_id)
        assert sorted(pages) == sorted(mgr.pages_of(1)) and len(plans) == 1
        await mgr.close()
        await client.close()

    with TestServer(num_pages=64, **GEOMETRY) as server:
        admin = attnserve.Client(server.address, timeout=30)
        asyncio.run(main(server.address, admin))
        admin.close()


def test_an_async_plan_interrupted_at_any_call_changes_nothing():
    """An AsyncKvManager.plan() bounded by asyncio.wait_for and cut short
    while a call is slow (the release of a stale plan, the allocation, the
    CreatePlan) changes nothing: the caller plans the step again and it
    attends over exactly the rows it wrote. Before, plan() committed the step
    and then released the plans it made stale: cut short there, the caller
    saw a timeout for a committed plan, planned again, and left a position
    unwritten (read as zeros with --check_kv_written=false)."""
    async def main(address):
        client = AsyncClient(address, timeout=30)
        g = await client.info()
        model = SequenceModel(g.num_layers, g.num_kv_heads, g.head_dim, g.wire_dtype)
        rng = np.random.default_rng(31)
        mgr = attnserve.AsyncKvManager(client)

        async def step(n):
            plan = await mgr.plan([7], [n])
            start = int(plan.kv_lens[0]) - n
            assert plan.positions.tolist() == list(range(start, start + n))
            for layer in range(g.num_layers):
                q = rng.standard_normal((n, g.num_qo_heads, g.head_dim)).astype(np.float32)
                k, v = (rng.standard_normal((n, g.num_kv_heads, g.head_dim)).astype(np.float32)
                        for _ in range(2))
                r = await mgr.run(layer, q, k, v)
                model.write(7, layer, start, k, v)
                assert not model.check(layer, [(7, 0, n, start + n)], q, r.output, r.lse)
        await step(5)
        await step(1)                                    # step 1's plan is stale now
        for method in ("release_plan", "allocate_pages", "create_plan"):
            real = getattr(mgr._rpc, method)

            async def slow(*args, _real=real, **kwargs):
                await asyncio.sleep(1.0)
                return await _real(*args, **kwargs)
            setattr(mgr._rpc, method, slow)
            before = mgr.kv_len(7)
            with pytest.raises(asyncio.TimeoutError):           # 4 rows: a new page
                await asyncio.wait_for(mgr.plan([7], [4]), 0.3)
            assert mgr.kv_len(7) == before, method        # nothing changed
            setattr(mgr._rpc, method, real)
            await asyncio.sleep(1.0)                     # the slow call ends meanwhile
            await step(4)
        await mgr.close()
        await client.close()

    with TestServer(num_pages=64, extra_flags=["--check_kv_written=false"], **GEOMETRY) as server:
        asyncio.run(main(server.address))


def test_a_lease_that_ends_while_a_flow_waits_frees_nothing_of_the_tenant():
    """An AsyncKvManager's finish() or reconciling plan() waits on a slow
    ReleasePlan reply while a run() finds the lease gone (revoked here, as
    an expiry would) and another client of the tenant, with no lease, is
    given every page. The flow must not go on with FreePages: without the
    lease it would name none and act for the whole tenant, freeing the
    other client's pages (before: freed, then given to the manager's next
    sequence; and finish() raised IndexError)."""
    async def main(address, admin, reconcile):
        client = AsyncClient(address, timeout=30)
        g = await client.info()
        rng = np.random.default_rng(41)
        mgr = attnserve.AsyncKvManager(client)

        def rows(n):
            return [rng.standard_normal((n, h, g.head_dim)).astype(np.float32)
                    for h in (g.num_qo_heads, g.num_kv_heads, g.num_kv_heads)]
        pa = await mgr.plan([1], [4])
        pb = await mgr.plan([3], [8])
        for layer in range(g.num_layers):
            await mgr.run(layer, *rows(4), plan=pa)
            await mgr.run(layer, *rows(8), plan=pb)
        if reconcile:                      # a plan() cut short: holdings in doubt
            real_create = mgr._rpc.create_plan

            async def cancelled(*args, **kwargs):
                await real_create(*args, **kwargs)
                raise asyncio.CancelledError()
            mgr._rpc.create_plan = cancelled
            with pytest.raises(asyncio.CancelledError):
                await mgr.plan([100], [8])
            mgr._rpc.create_plan = real_create
        real = mgr._rpc.release_plan

        async def late_reply(*args, **kwargs):
            result = await real(*args, **kwargs)
            await asyncio.sleep(0.8)
            return result
        mgr._rpc.release_plan = late_reply
        flow = asyncio.ensure_future(mgr.plan([2], [4]) if reconcile else mgr.finish(3))
        await asyncio.sleep(0.3)
        admin.revoke_lease(mgr.lease_id)
        for _ in range(100):               # the lease's pages are zeroed, then free
            if admin.info().free_pages == 32:
                break
            time.sleep(0.05)
        mine = admin.allocate_pages(32)
        with pytest.raises(attnserve.SequencesLost):
            await mgr.run(0, *rows(4), plan=pa)
        try:
            await flow
        except attnserve.AttnserveError:
            pass                           # a plan with no page left for it: refused
        mgr._rpc.release_plan = real
        assert sorted(admin.list_holdings().unleased.pages) == sorted(mine)
        await mgr.close()
        await client.close()
        admin.free_pages(mine)

    for reconcile in (False, True):
        with TestServer(num_pages=32, **GEOMETRY) as server:
            admin = attnserve.Client(server.address, timeout=30)
            asyncio.run(main(server.address, admin, reconcile))
            admin.close()


def test_a_cluster_run_waits_for_every_part_and_a_failed_plan_retires_the_step_it_undid():
    """Cluster.run() returns or raises only once every server's Prefill has
    ended, whatever a part raises: a Prefill still in flight could append
    its rows into pages the caller frees next and another sequence is given
    (before: a RuntimeError from one part returned at once). And a plan()
    that fails on one server takes back the others, whose managers' earlier
    plans of those sequences went stale with the new ones: the cluster's
    previous step is stale too, and runs nowhere (before: it stayed valid
    and failed part-way)."""
    faults = FaultInjector(3)
    made = []

    def interceptors(target):
        made.append(f"s{len(made)}")
        return faults.interceptors(made[-1])

    with TestServer(num_pages=64, **GEOMETRY) as server:
        cl = attnserve.Cluster([server.address, server.address], timeout=30,
                               interceptors=interceptors)
        g = cl.server_info
        rng = np.random.default_rng(51)

        def rows(n):
            return [rng.standard_normal((n, h, g.head_dim)).astype(np.float32)
                    for h in (g.num_qo_heads, g.num_kv_heads, g.num_kv_heads)]
        step = cl.plan(["A", "B"], [4, 4])
        assert {cl.shards_of("A")[0].server, cl.shards_of("B")[0].server} == {0, 1}
        for layer in range(g.num_layers):
            cl.run(layer, *rows(8))
        # One part raises at once, the other's Prefill is slow.
        ended = []
        kv = [cl.kv_manager(0), cl.kv_manager(1)]
        real = [kv[0].run, kv[1].run]

        def broken(*args, **kwargs):
            raise RuntimeError("a part failed")

        def slow(*args, **kwargs):
            time.sleep(0.5)
            r = real[1](*args, **kwargs)
            ended.append(True)
            return r
        first = step.parts[0].server                 # the part run on the caller's thread
        kv[first].run, kv[1 - first].run = broken, slow
        with pytest.raises(RuntimeError, match="a part failed"):
            cl.run(0, *rows(8))
        assert ended == [True], "run() raised while another part's Prefill was in flight"
        kv[first].run, kv[1 - first].run = real[first], real[1 - first]
        # The next step fails on the second server planned: the first is
        # taken back, and the step before is stale everywhere.
        calls = faults.calls.get("Prefill", 0)
        faults.fail_next("AllocatePages", UNREACHABLE, made[1])
        with pytest.raises(attnserve.AttnserveError):
            cl.plan(["A", "B"], [1, 1])
        assert not step.valid
        with pytest.raises(RuntimeError, match="stale"):
            cl.run(0, *rows(8), step=step)
        assert faults.calls.get("Prefill", 0) == calls, "a stale step sent a Prefill"
        cl.plan(["A", "B"], [1, 1])              # planned again, it runs
        for layer in range(g.num_layers):
            cl.run(layer, *rows(2))
        cl.close()


def test_run_refuses_a_layer_the_server_lacks_without_holding_up_the_sequences():
    with TestServer(num_pages=64, **GEOMETRY) as server:
        client = attnserve.Client(server.address, timeout=30)
        g = client.server_info
        with attnserve.KvManager(client) as mgr:
            mgr.plan([7], [3])
            q = np.ones((3, g.num_qo_heads, g.head_dim), np.float32)
            k = np.ones((3, g.num_kv_heads, g.head_dim), np.float32)
            for layer in (g.num_layers, -1):
                with pytest.raises(ValueError, match=rf"run: layer={layer} is outside \[0, 2\) "
                                                     r"\(the server's num_layers\)"):
                    mgr.run(layer, q, k, k)
            with pytest.raises(TypeError, match="layer must be an int, not float"):
                mgr.run(1.0, q, k, k)
            for layer in range(g.num_layers):
                mgr.run(layer, q, k, k)
            mgr.plan([7], [1])                            # nothing was marked
            for bad, text in (([[3]], r"q_lens must be one integer per sequence \(1-D\)"),
                              (3, r"q_lens must be one integer per sequence"),
                              ([2**33], r"q_lens add up to 8589934592 tokens, more than a "
                                        r"step's 2147483647")):
                with pytest.raises(ValueError, match=text):
                    mgr.plan([8], bad)
            assert not mgr.has(8)
        client.close()


def test_a_cluster_step_of_other_sequences_is_planned_at_once_on_a_restarted_server():
    """docs/cluster.md: a server found restarted holding none of the step's
    sequences is planned again at once; the sequences the restart lost are
    reported when a call names them."""
    server = TestServer(num_pages=64, **GEOMETRY)
    cluster = attnserve.Cluster([server.address], timeout=30, channel_options=RECONNECT)
    try:
        g = cluster.server_info
        cluster.plan([3], [4])
        rng = np.random.default_rng(12)
        q = rng.standard_normal((4, g.num_qo_heads, g.head_dim), np.float32)
        k = rng.standard_normal((4, g.num_kv_heads, g.head_dim), np.float32)
        for layer in range(g.num_layers):
            cluster.run(layer, q, k, k)
        address = server.address
        assert server.stop() == 0
        server = TestServer(num_pages=64, extra_flags=[f"--listen={address}"], **GEOMETRY)
        for _ in range(100):                          # while its channel reconnects
            try:
                cluster.plan([5], [2])
                break
            except attnserve.Unavailable:
                time.sleep(0.05)
        assert cluster.kv_len(5) == 2 and cluster.lost == [3]
        with pytest.raises(attnserve.SequencesLost) as lost:
            cluster.plan([3], [1])
        assert lost.value.seq_ids == [3]
        with pytest.raises(ValueError, match=r"run: layer=2 is outside \[0, 2\)"):
            cluster.run(2, q[:2], k[:2], k[:2])
        with pytest.raises(ValueError, match="run: k_new is None"):
            cluster.run(0, q[:2], None, None)
        cluster.finish(3, 5)
    finally:
        cluster.close()
        server.stop()


def test_a_lease_whose_revocation_failed_outlives_no_later_lease_loss():
    """A cluster server's manager fails to revoke its lease L1 (release()'s
    RevokeLease, and the next plan's, are lost: L1 keeps pages and plans and
    waits to be revoked), gets a new lease L2, and then loses L2 (revoked):
    the cluster forgets L2 but not L1, and release() revokes it, leaving
    nothing held. Before, losing L2 reset the manager as if its server had
    restarted, which dropped L1: its pages stayed held until its ttl (the
    cluster fault test failed so on a loaded host)."""
    server = TestServer(num_pages=256, **GEOMETRY)
    faults = FaultInjector(seed=1)
    cluster = attnserve.Cluster([server.address], lease=True, timeout=30, channel_options=RECONNECT,
                                interceptors=faults.interceptors)
    admin = attnserve.Client(server.address, timeout=30)
    g = cluster.server_info
    rng = np.random.default_rng(0)

    def step(ids, lens):
        st = cluster.plan(ids, lens)
        for layer in range(g.num_layers):
            q = rng.standard_normal((st.total_q, g.num_qo_heads, g.head_dim), np.float32)
            k = rng.standard_normal((st.total_q, g.num_kv_heads, g.head_dim), np.float32)
            cluster.run(layer, q, k, k, step=st)
    try:
        kv = cluster.kv_manager(0)
        step([1], [9])
        step([1], [2])                          # a stale plan waits to be released
        first = kv.lease_id
        for method in ("ReleasePlan", "ListHoldings", "RevokeLease"):
            faults.fail_next(method, UNREACHABLE)
        with pytest.raises(attnserve.AttnserveError):
            cluster.release()
        assert held(admin, first) != ([], []), "the test needs L1 to hold something"
        faults.fail_next("RevokeLease", UNREACHABLE)
        step([2], [3])                          # the best-effort revocation fails: a new lease
        second = kv.lease_id
        assert second not in (0, first)
        admin.revoke_lease(second)
        with pytest.raises(attnserve.SequencesLost) as lost:
            step([2], [1])
        cluster.finish(*lost.value.seq_ids)
        cluster.release()
        assert held(admin, 0) == ([], []), admin.list_holdings()
    finally:
        cluster.close()
        admin.close()
        server.stop()
