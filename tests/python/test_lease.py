"""Leases from Python (docs/security.md, "Leases"): Lease keeps one alive and
revokes it on exit, a lease that expires under a client raises LeaseExpired
on its next call (never silent reuse of pages someone else now holds), a
killed process's pages come back within the lease's ttl and a second, and
list_holdings / release_holdings see and release what a tenant holds."""

import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

import attnserve
from server import TestServer


@pytest.fixture(scope="module")
def server():
    with TestServer(num_pages=64) as s:
        yield s


def _wait(cond, limit=10.0):
    end = time.monotonic() + limit
    while not cond():
        if time.monotonic() > end:
            return False
        time.sleep(0.02)
    return True


def _decode(client, pages):
    """Random K/V into every row of `pages` (layer 0), then one decode row over them."""
    g = client.server_info
    rng = np.random.default_rng(0)
    slots = [p * g.page_size + i for p in pages for i in range(g.page_size)]
    kv = rng.standard_normal((len(slots), g.num_kv_heads, g.head_dim))
    client.write_kv(0, slots, kv, kv)
    q = rng.standard_normal((1, g.num_qo_heads, g.head_dim))
    return client.prefill(0, q, [0, 1], [0, len(pages)], pages, [g.page_size])


def test_a_lease_kept_alive_outlives_its_ttl_and_is_revoked_on_exit(server):
    client = attnserve.Client(server.address, timeout=60)
    free = client.info().free_pages
    with attnserve.Lease(client, ttl=2.0) as lease:
        assert client.lease_id == lease.lease_id and lease.ttl == 2.0
        pages = client.allocate_pages(3)
        time.sleep(5.0)  # two and a half ttls
        assert not lease.expired, lease.error
        held = client.list_holdings(lease.lease_id)
        assert sorted(held.leases[0].holdings.pages) == sorted(pages)
        _decode(client, pages)
    assert client.lease_id == 0
    assert client.info().free_pages == free
    client.close()


def test_an_expired_lease_raises_lease_expired_and_its_pages_go(server):
    client = attnserve.Client(server.address, timeout=60)
    free = client.info().free_pages
    grant = client.grant_lease(1.0)
    client.use_lease(grant.lease_id)
    pages = client.allocate_pages(4)
    plan = client.create_plan([0, 1], [0, 4], pages, [16])
    assert _wait(lambda: client.info().free_pages == free)
    with pytest.raises(attnserve.LeaseExpired) as e:
        _decode(client, pages)
    assert isinstance(e.value, attnserve.FailedPrecondition)
    for call in (lambda: client.allocate_pages(1), lambda: client.free_pages(pages),
                 lambda: client.keep_alive(grant.lease_id), lambda: client.release_plan(plan)):
        with pytest.raises(attnserve.LeaseExpired):
            call()
    assert client.revoke_lease(grant.lease_id) == attnserve.Holdings()
    client.close()


def test_listing_a_lease_does_not_keep_it_alive(server):
    """ListHoldings names a lease without renewing it (docs/security.md): a
    monitor listing a dead client's lease does not keep its pages."""
    client = attnserve.Client(server.address, timeout=60)
    free = client.info().free_pages
    grant = client.grant_lease(1.0)
    watcher = attnserve.Client(server.address, timeout=60)
    client.use_lease(grant.lease_id)
    pages = client.allocate_pages(2)

    def listed_then_gone():
        try:
            watcher.list_holdings(grant.lease_id)
        except attnserve.LeaseExpired:
            return True
        return False

    start = time.monotonic()
    assert _wait(listed_then_gone, 10.0)
    assert time.monotonic() - start < 8.0
    assert _wait(lambda: client.info().free_pages == free)
    with pytest.raises(attnserve.LeaseExpired):
        client.free_pages(pages)
    watcher.close()
    client.close()


def test_a_killed_process_pages_come_back_within_the_ttl_and_a_second(server):
    client = attnserve.Client(server.address, timeout=60)
    free = client.info().free_pages
    code = (
        "import sys, time, attnserve\n"
        f"c = attnserve.Client({server.address!r})\n"
        "lease = attnserve.Lease(c, ttl=2.0)\n"
        "c.allocate_pages(8)\n"
        "print('ready', flush=True)\n"
        "time.sleep(600)\n")
    env = dict(os.environ)
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                             env=env)
    try:
        assert child.stdout.readline().strip() == "ready"
        held = client.list_holdings()
        assert len(held.leases) == 1 and len(held.leases[0].holdings.pages) == 8
        child.send_signal(signal.SIGKILL)
        child.wait()
        killed = time.monotonic()
        assert _wait(lambda: client.info().free_pages == free, 30)
        took = time.monotonic() - killed
        assert took <= 2.0 + 1.0, f"pages came back {took:.2f} s after the kill"
        assert client.list_holdings().leases == ()
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    client.close()


def test_a_failed_renewal_is_in_error_until_one_succeeds(server):
    """Renewals that fail (the server unreachable) are retried and say why
    in `error`, which a renewal that succeeds clears."""
    from faults import FaultInjector
    faults = FaultInjector(1)
    client = attnserve.Client(server.address, timeout=60, interceptors=faults.interceptors)
    with attnserve.Lease(client, ttl=3.0) as lease:
        assert lease.error is None
        faults.set_down(server.address, True)
        assert _wait(lambda: isinstance(lease.error, attnserve.Unavailable))
        faults.set_down(server.address, False)
        assert _wait(lambda: lease.error is None)
        assert not lease.expired
    client.close()


def test_list_and_release_holdings(server):
    client = attnserve.Client(server.address, timeout=60)
    unleased = client.allocate_pages(2)
    with attnserve.Lease(client) as lease:
        leased = client.allocate_pages(3)
        held = client.list_holdings()
        assert [l.lease_id for l in held.leases] == [lease.lease_id]
        assert held.leases[0].remaining_ms > 0
        assert sorted(held.leases[0].holdings.pages) == sorted(leased)
        assert sorted(held.unleased.pages) == sorted(unleased)
        released = client.release_holdings()
        assert sorted(released.pages) == sorted(unleased + leased)
        assert client.list_holdings() == attnserve.HoldingsList((), attnserve.Holdings())
        with pytest.raises(attnserve.LeaseExpired):
            client.allocate_pages(1)
    client.close()


def test_fork_gives_a_lease_of_its_own_over_the_same_channel(server):
    client = attnserve.Client(server.address, timeout=60)
    forked = client.fork()
    with attnserve.Lease(forked):
        assert client.lease_id == 0 and forked.lease_id != 0
        pages = forked.allocate_pages(1)
        # The parent names no lease: it may still use the tenant's pages.
        _decode(client, pages)
    client.close()


def test_bad_lease_arguments_name_the_field(server):
    client = attnserve.Client(server.address, timeout=60)
    with pytest.raises(attnserve.InvalidArgument, match="ttl_ms"):
        client.grant_lease(0.5)
    with pytest.raises(attnserve.InvalidArgument, match="lease_id"):
        client.keep_alive(0)
    for ttl in (float("inf"), float("nan")):
        with pytest.raises(ValueError, match="ttl=.* is not a finite number of seconds"):
            client.grant_lease(ttl)
    with pytest.raises(ValueError, match="does not fit in int64 milliseconds"):
        client.grant_lease(1e17)
    # Under half a millisecond is not 0 (the server's default): it is refused.
    for ttl in (0.0004, -0.0004):
        with pytest.raises(attnserve.InvalidArgument, match=r"ttl_ms=(1 out of range|-1 is negative)"):
            client.grant_lease(ttl)
    with pytest.raises(ValueError, match=r"lease_id=-1 out of range \[0, 2\^64\)"):
        client.keep_alive(-1)
    info = client.info()
    assert info.lease_default_ttl_ms == 30000 and info.lease_max_ttl_ms == 3600000
    client.close()


def test_async_lease(server):
    import asyncio

    async def run():
        async with attnserve.AsyncClient(server.address, timeout=60) as client:
            lease = await attnserve.AsyncLease.start(client, ttl=2.0)
            pages = await client.allocate_pages(2)
            await asyncio.sleep(5.0)
            assert not lease.expired
            held = await client.list_holdings(lease.lease_id)
            assert sorted(held.leases[0].holdings.pages) == sorted(pages)
            await lease.close()
            assert client.lease_id == 0
            assert (await client.list_holdings()).leases == ()

    asyncio.run(run())


def test_abandon_cancels_a_renewal_in_flight():
    """A lease abandoned while its renewal waits on a server that does not
    answer (stopped here) cancels that renewal instead of waiting up to the
    ttl: a cluster abandons the leases of servers it found unreachable."""
    with TestServer() as server:
        client = attnserve.Client(server.address, timeout=60)
        lease = attnserve.Lease(client, ttl=6.0)              # renewed every 2 s
        server.pause()
        try:
            for _ in range(400):
                if lease._renewal is not None:
                    break
                time.sleep(0.025)
            call = lease._renewal
            assert call is not None, "no renewal began"
            time.sleep(0.2)                                     # on its way, unanswered
            lease.abandon()
            assert call._future.cancelled()
            assert not lease._thread.is_alive() and client.lease_id == 0
        finally:
            server.resume()
        client.close()


def test_a_server_restart_stops_the_keeper():
    """A renewal answered by a restarted server (StaleIncarnation: every
    lease ended with the old one) stops the keeper, which says why, sync and
    async (before, both renewed every quarter period for ever)."""
    import asyncio
    from attnserve.aio import AsyncClient
    first = TestServer(num_pages=16)
    address = first.address
    client = attnserve.Client(address, timeout=10)
    lease = attnserve.Lease(client, ttl=1)

    async def start():
        aclient = AsyncClient(address, timeout=10)
        await aclient.info()
        return aclient, await attnserve.AsyncLease.start(aclient, 1)
    loop = asyncio.new_event_loop()
    aclient, alease = loop.run_until_complete(start())
    assert first.stop() == 0
    with TestServer(num_pages=16, extra_flags=[f"--listen={address}"]):
        for _ in range(300):
            loop.run_until_complete(asyncio.sleep(0.05))
            if (isinstance(lease.error, attnserve.StaleIncarnation)
                    and isinstance(alease.error, attnserve.StaleIncarnation)):
                break
        assert isinstance(lease.error, attnserve.StaleIncarnation), lease.error
        assert isinstance(alease.error, attnserve.StaleIncarnation), alease.error
        assert not lease.expired and not alease.expired
        lease._thread.join(10)
        assert not lease._thread.is_alive()
        assert alease._task.done()
    lease.abandon()
    alease.abandon()
    loop.run_until_complete(aclient.close())
    loop.close()
    client.close()
