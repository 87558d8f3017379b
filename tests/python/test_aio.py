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
