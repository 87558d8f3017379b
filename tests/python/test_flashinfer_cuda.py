"""attnserve.flashinfer with torch CUDA tensors and a CUDA-backend server on
this host: every transport ("grpc", "shm", "channel": the tensors cross to
the host and the results come back to the GPU; "cuda": they stay on the GPU,
in a CUDA region, the calls through a request channel) against the float64
reference over random K/V and queries; out=/lse= written in place on the
device (poisoned first); futures; the ordering with the caller's CUDA stream
(a query still being written on the caller's stream, on the default stream
and on a side stream, is read only once written); a killed client's CUDA
region released with its lease.

Needs a CUDA GPU here and ATTNSERVE_BIN built with the CUDA backend: the
module is skipped where torch sees no GPU (CI's CPU machines); it runs on the
GPU machine (bench/results/2026-12-02-flashinfer-h200.md)."""

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
from server import TestServer
from test_flashinfer import BF16, Batch, decode_qo, matches, plan_decode, plan_prefill

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="needs a CUDA GPU and a CUDA-backend attnserve")

TRANSPORTS = ["grpc", "shm", "channel", "cuda"]
DEV = torch.device("cuda", 0)


@pytest.fixture(scope="module")
def server():
    with TestServer(backend="cuda", extra_flags=["--allow_shared_memory"]) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    c = attnserve.Client(server.address, timeout=60)
    assert c.info().backend == "cuda"
    yield c
    c.close()


@pytest.fixture(params=TRANSPORTS)
def cache(request, client):
    with fi.PagedKVCache(client, 48, transport=request.param) as c:
        yield c


class CudaBatch(Batch):
    """Batch, with the appended K/V and every index tensor on the GPU (the
    mirror keeps host copies for the reference)."""

    def append(self, layer, rows_per_seq=None, upto=None):
        rows = self.kv_lens if rows_per_seq is None else rows_per_seq
        indptr = torch.tensor([0] + np.cumsum(rows).tolist(), dtype=torch.int32)
        nnz = int(indptr[-1])
        lens = (fi.get_seq_lens(self.indptr, self.last, self.cache.page_size) if upto is None
                else torch.tensor(upto))
        bi, pos = fi.get_batch_indices_positions(indptr, lens, nnz)
        c = self.cache
        k = self.randn(nnz, c.num_kv_heads, c.head_dim)
        v = self.randn(nnz, c.num_kv_heads, c.head_dim)
        fi.append_paged_kv_cache(k.to(DEV), v.to(DEV), bi.to(DEV), pos.to(DEV), c[layer],
                                 self.indices.to(DEV), self.indptr.to(DEV), self.last.to(DEV))
        slots = self.slots(bi, pos)
        self.mirror.write(layer, slots, k, v)
        return k, v, slots


def on_device(got):
    o, lse = got
    assert o.device == DEV and lse.device == DEV, (o.device, lse.device)
    return o.cpu(), lse.cpu()


def test_decode_with_cuda_tensors_matches_reference(cache):
    b = CudaBatch(cache, [1, 17, 40, 100, 33], seed=21)
    b.fill()
    w = fi.BatchDecodeWithPagedKVCacheWrapper(cache, "NHD")
    # FlashInfer engines pass the layout on the GPU as often as on the host.
    c = cache
    w.plan(b.indptr.to(DEV), b.indices.to(DEV), b.last.to(DEV), c.num_qo_heads,
           c.num_kv_heads, c.head_dim, c.page_size, q_data_type=BF16)
    for layer in range(cache.num_layers):
        q = b.randn(5, cache.num_qo_heads, cache.head_dim, scale=2.0)
        got = on_device(w.run(q.to(DEV), cache[layer], return_lse=True))
        assert got[0].dtype == BF16 and got[0].shape == q.shape
        matches(got, b.reference(layer, q, decode_qo(5), causal=False))
    w.close()


def test_prefill_with_fused_appends_from_the_gpu_matches_reference(cache):
    kv_lens, q_lens = [12, 40, 7], [5, 16, 7]
    b = CudaBatch(cache, kv_lens, seed=22)
    b.fill([n - q for n, q in zip(kv_lens, q_lens)])
    qo = [0] + np.cumsum(q_lens).tolist()
    w = fi.BatchPrefillWithPagedKVCacheWrapper(cache, "NHD")
    plan_prefill(w, b, qo, causal=True)
    for layer in range(cache.num_layers):
        b.append(layer, q_lens)
        q = b.randn(qo[-1], cache.num_qo_heads, cache.head_dim, scale=2.0)
        got = on_device(w.run(q.to(DEV), cache[layer], return_lse=True))
        assert cache.pending_rows(layer) == 0
        matches(got, b.reference(layer, q, qo, causal=True),
                b.reference(layer, q, qo, causal=False))
    w.close()


def test_out_and_lse_on_the_gpu_are_written_in_place(cache):
    b = CudaBatch(cache, [30, 9, 64], seed=23)
    b.fill()
    w = fi.BatchDecodeWithPagedKVCacheWrapper(cache)
    plan_decode(w, b)
    q = b.randn(3, cache.num_qo_heads, cache.head_dim)
    out = torch.full((3, cache.num_qo_heads, cache.head_dim), float("nan"), dtype=BF16,
                     device=DEV)
    lse = torch.full((3, cache.num_qo_heads), float("nan"), dtype=torch.float32, device=DEV)
    o, l = w.run(q.to(DEV), cache[1], out=out, lse=lse, return_lse=True)
    assert o.data_ptr() == out.data_ptr() and l.data_ptr() == lse.data_ptr()
    matches(on_device((out, lse)), b.reference(1, q, decode_qo(3), causal=False))
    w.close()


@pytest.mark.parametrize("side_stream", [False, True])
def test_a_query_still_being_written_on_the_callers_stream_is_read_once_written(
        cache, side_stream):
    """run() takes q as the caller's current stream leaves it: a q that a
    kernel on that stream has yet to write (queued behind a long sleep
    kernel) is read after that write, on the default stream and on a side
    stream alike; the output is ready for the caller's stream."""
    b = CudaBatch(cache, [50, 3, 77, 16], seed=24 + side_stream)
    b.fill()
    w = fi.BatchDecodeWithPagedKVCacheWrapper(cache)
    plan_decode(w, b)
    stream = torch.cuda.Stream(DEV) if side_stream else torch.cuda.current_stream(DEV)
    for layer in range(cache.num_layers):
        want = b.randn(4, cache.num_qo_heads, cache.head_dim, scale=2.0)
        src = want.to(DEV)
        torch.cuda.synchronize(DEV)
        with torch.cuda.stream(stream):
            q = torch.full_like(src, float("nan"))      # poison: what a too-early read sees
            torch.cuda._sleep(50_000_000)               # tens of ms of GPU time first
            q.copy_(src)
            future = w.run_async(q, cache[layer], return_lse=True)
            o, lse = future.result()
            o2 = o * 1                                  # the caller's stream reads the output
        torch.cuda.synchronize(DEV)
        matches(on_device((o2, lse)), b.reference(layer, want, decode_qo(4), causal=False))
    w.close()


def test_futures_of_every_layer_in_flight_at_once(cache):
    b = CudaBatch(cache, [20, 45], seed=26)
    b.fill()
    w = fi.BatchDecodeWithPagedKVCacheWrapper(cache)
    plan_decode(w, b)
    qs = [b.randn(2, cache.num_qo_heads, cache.head_dim) for _ in range(cache.num_layers)]
    futures = [w.run_async(q.to(DEV), cache[layer], return_lse=True)
               for layer, q in enumerate(qs)]
    for layer, (q, f) in enumerate(zip(qs, futures)):
        matches(on_device(f.result()), b.reference(layer, q, decode_qo(2), causal=False))
    w.close()


KILLED_CUDA_CLIENT = textwrap.dedent("""
    import sys, torch
    import attnserve, attnserve.flashinfer as fi
    client = attnserve.Client(sys.argv[1], timeout=30)
    cache = fi.PagedKVCache(client, 10, transport="cuda", lease_ttl=1)
    w = fi.BatchDecodeWithPagedKVCacheWrapper(cache)
    w.plan(torch.tensor([0, 1], dtype=torch.int32), torch.tensor([0], dtype=torch.int32),
           torch.tensor([1], dtype=torch.int32), 8, 2, 64, 16, q_data_type=torch.bfloat16)
    k = torch.randn(1, 2, 64, device="cuda").bfloat16()
    fi.append_paged_kv_cache(k, k, torch.tensor([0]), torch.tensor([0]), cache[0],
                             torch.tensor([0]), torch.tensor([0, 1]), torch.tensor([1]))
    w.run(torch.randn(1, 8, 64, device="cuda").bfloat16(), cache[0])
    print(cache.lease_id, flush=True)
    while True:
        w.run(torch.randn(1, 8, 64, device="cuda").bfloat16(), cache[0])
""")


def test_a_killed_cuda_client_leaves_the_server_serving_and_its_region_released(server,
                                                                                 client):
    free = client.info().free_pages
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    proc = subprocess.Popen([sys.executable, "-c", KILLED_CUDA_CLIENT, server.address],
                            stdout=subprocess.PIPE, text=True, env=env)
    try:
        lease = int(proc.stdout.readline())
        assert lease != 0
        os.kill(proc.pid, signal.SIGKILL)          # in the middle of its channel calls
    finally:
        proc.wait()
    assert client.health() == "SERVING"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if all(l.lease_id != lease for l in client.list_holdings().leases):
            break
        time.sleep(0.2)
    assert all(l.lease_id != lease for l in client.list_holdings().leases)
    assert client.info().free_pages == free
    assert not [r for r in client.list_regions() if r.name.startswith("attnserve-fi-")]
    with fi.PagedKVCache(client, 8, transport="cuda") as c:
        b = CudaBatch(c, [5], seed=27)
        b.fill()
        w = fi.BatchDecodeWithPagedKVCacheWrapper(c)
        plan_decode(w, b)
        q = b.randn(1, c.num_qo_heads, c.head_dim)
        matches(on_device(w.run(q.to(DEV), c[0], return_lse=True)),
                b.reference(0, q, decode_qo(1), causal=False))
        w.close()
