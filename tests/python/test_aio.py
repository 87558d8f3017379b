"""attnserve.aio.AsyncClient against a real CPU server: every method, many
calls in flight at once, errors."""

import asyncio

import numpy as np
import pytest
import torch

import attnserve
from attnserve.aio import AsyncClient
from test_client import heavy_prefill_args
from attnserve.reference import (KvMirror, compare, reference_merge, reference_prefill,
                                 within_tolerance)


def run(coro):
    return asyncio.run(coro)


def test_every_method(server):
    async def body():
        async with AsyncClient(server.address, timeout=60) as c:
            g = c.server_info
            assert g.num_qo_heads == 8 and c.incarnation == g.incarnation != 0
            assert await c.health() == "SERVING"
            free = (await c.info()).free_pages
            pages = await c.allocate_pages(4)
            rng = np.random.default_rng(10)
            mirror = KvMirror(g.num_kv_heads, g.head_dim)
            slots = [p * g.page_size + i for p in pages for i in range(g.page_size)]
            k = rng.standard_normal((len(slots), 2, 64)).astype(np.float32)
            v = rng.standard_normal((len(slots), 2, 64)).astype(np.float32)
            await c.write_kv(1, slots, k, v)
            mirror.write(1, slots, k, v)
            rk, rv = await c.read_kv(1, slots, out="raw")
            assert np.array_equal(rk, attnserve.float32_to_bf16_bits(k))
            q = torch.from_numpy(rng.standard_normal((9, 8, 64)).astype(np.float32))
            r = await c.prefill(1, q.to(torch.bfloat16), [0, 3, 9], [0, 1, 4], pages, [5, 16])
            assert r.output.dtype == torch.bfloat16
            o_ref, lse_ref = reference_prefill(mirror, 1, q.to(torch.bfloat16), [0, 3, 9],
                                               [0, 1, 4], pages, [5, 16], page_size=16)
            assert within_tolerance(compare(o_ref, lse_ref, r.output, r.lse))
            states = [(rng.standard_normal((3, 8, 64)).astype(np.float32),
                       rng.standard_normal((3, 8)).astype(np.float32)) for _ in range(2)]
            mv, ml = await c.merge_states(states, lse_base="e")
            assert within_tolerance(compare(*reference_merge(states, "e"), mv, ml))
            await c.free_pages(pages)
            assert (await c.info()).free_pages == free
    run(body())


def test_many_calls_in_flight(server):
    """32 Prefills of random ragged batches at once, each checked."""
    async def body():
        async with AsyncClient(server.address, timeout=120) as c:
            g = c.server_info
            rng = np.random.default_rng(11)
            mirror = KvMirror(g.num_kv_heads, g.head_dim)
            pages = await c.allocate_pages(8)
            slots = [p * g.page_size + i for p in pages for i in range(g.page_size)]
            for layer in range(g.num_layers):
                k = rng.standard_normal((len(slots), 2, 64)).astype(np.float32)
                v = rng.standard_normal((len(slots), 2, 64)).astype(np.float32)
                await c.write_kv(layer, slots, k, v)
                mirror.write(layer, slots, k, v)
            jobs = []
            for i in range(32):
                batch = int(rng.integers(1, 5))
                q_lens = rng.integers(1, 12, batch)
                kv_lens = rng.integers(1, 8 * g.page_size, batch)
                qo, kv, idx, last = [0], [0], [], []
                for ql, kl in zip(q_lens, kv_lens):
                    n = -(-int(kl) // g.page_size)
                    idx += [int(p) for p in rng.permutation(pages)[:n]]
                    qo.append(qo[-1] + int(ql))
                    kv.append(kv[-1] + n)
                    last.append(int(kl) - (n - 1) * g.page_size)
                q = rng.standard_normal((qo[-1], 8, 64)).astype(np.float32)
                jobs.append((i % g.num_layers, q, qo, kv, idx, last))
            results = await asyncio.gather(*(c.prefill(*job) for job in jobs))
            for job, r in zip(jobs, results):
                layer, q, qo, kv, idx, last = job
                o_ref, lse_ref = reference_prefill(mirror, layer, q, qo, kv, idx, last,
                                                   page_size=16)
                assert within_tolerance(compare(o_ref, lse_ref, r.output, r.lse))
            await c.free_pages(pages)
    run(body())


def test_errors_and_lazy_info(server):
    async def body():
        c = AsyncClient(server.address, timeout=30)  # no info read yet
        try:
            with pytest.raises(attnserve.InvalidArgument, match="layer"):
                await c.prefill(99, np.ones((1, 8, 64), np.float32), [0, 1], [0, 0], [], [])
            assert c.server_info.num_layers == 2        # read on first use
            pages = await c.allocate_pages(64)
            with pytest.raises(attnserve.DeadlineExceeded):
                await c.prefill(*heavy_prefill_args(c, pages), causal=False, timeout=0.001)
            await c.free_pages(pages)
            c._incarnation ^= 1                          # as if the server had restarted
            with pytest.raises(attnserve.StaleIncarnation):
                await c.prefill(0, np.ones((1, 8, 64), np.float32), [0, 1], [0, 0], [], [])
            info = await c.reconnect()
            assert c.incarnation == info.incarnation
        finally:
            await c.close()
        with pytest.raises(attnserve.Unavailable):
            async with AsyncClient("127.0.0.1:1", timeout=5):
                pass
    run(body())


def test_the_first_calls_info_read_keeps_the_calls_timeout():
    """An AsyncClient reads the server's info on the first call that needs
    it, within that call's timeout: against a peer that accepts the
    connection and never answers, write_kv(timeout=0.5) is DeadlineExceeded
    (before, the info read had no deadline and the call waited for ever);
    allocate_pages needs no info and keeps its own deadline."""
    import socket
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)
    address = "127.0.0.1:%d" % silent.getsockname()[1]

    async def main():
        client = AsyncClient(address)                  # no default timeout
        kv = np.zeros((1, 2, 64), np.float32)
        for call in (lambda: client.write_kv(0, [0], kv, kv, timeout=0.5),
                     lambda: client.allocate_pages(1, timeout=0.5)):
            with pytest.raises(attnserve.DeadlineExceeded):
                await asyncio.wait_for(call(), 30)
        await client.close()
    try:
        asyncio.run(main())
    finally:
        silent.close()


def test_a_region_registers_and_closes_through_an_async_client():
    """SharedMemoryRegion.register_async / close_async with an AsyncClient;
    the blocking register() and close(client) refuse an AsyncClient with a
    TypeError (before, they made coroutines nobody awaited: nothing was
    registered or unregistered, and no error said so)."""
    from server import TestServer

    async def main(address):
        client = AsyncClient(address, timeout=30)
        region = attnserve.SharedMemoryRegion(1 << 16)
        with pytest.raises(TypeError, match="await SharedMemoryRegion.register_async"):
            region.register(client, "io")
        await region.register_async(client, "io")
        assert [r.name for r in await client.list_regions()] == ["io"]
        with pytest.raises(TypeError, match="await SharedMemoryRegion.close_async"):
            region.close(client)
        await region.close_async(client)
        assert await client.list_regions() == []
        assert region.fd == -1
        await client.close()

    with TestServer(extra_flags=["--allow_shared_memory"]) as server:
        asyncio.run(main(server.address))


def test_close_cuts_calls_in_flight_with_cancelled_and_refuses_later_ones():
    """close() with calls in flight: they raise attnserve.Cancelled saying
    the client was closed, sync and async (before: a bare
    asyncio.CancelledError for the async call's task, which nobody had
    cancelled, and for the sync one Unavailable blaming a server shutdown);
    a call after close() raises Cancelled too (before: grpc's UsageError or
    ValueError)."""
    import threading
    import time
    from server import TestServer
    with TestServer(num_pages=1024, extra_flags=["--check_kv_written=false"]) as server:
        admin = attnserve.Client(server.address, timeout=60)
        pages = admin.allocate_pages(1024)
        q = np.random.default_rng(9).standard_normal(
            (4096, admin.server_info.num_qo_heads, admin.server_info.head_dim)).astype(np.float32)
        args = (0, q, [0, 4096], [0, 1024], pages, [16])   # seconds of the CPU server's work

        c = attnserve.Client(server.address, timeout=60)
        got = []

        def call():
            try:
                c.prefill(*args, causal=False)
                got.append(None)
            except attnserve.AttnserveError as e:
                got.append(e)
        t = threading.Thread(target=call)
        t.start()
        time.sleep(0.3)
        c.close()
        t.join()
        assert isinstance(got[0], attnserve.Cancelled), got
        assert "close()" in got[0].details
        with pytest.raises(attnserve.Cancelled, match="the client is closed"):
            c.info()

        async def main():
            ac = AsyncClient(server.address, timeout=60)
            await ac.info()
            task = asyncio.ensure_future(ac.prefill(*args, causal=False))
            await asyncio.sleep(0.3)
            await ac.close()
            with pytest.raises(attnserve.Cancelled, match="close"):
                await task
            assert not task.cancelled()
            with pytest.raises(attnserve.Cancelled, match="the client is closed"):
                await ac.info()
        asyncio.run(main())
        admin.free_pages(pages)
        admin.close()
