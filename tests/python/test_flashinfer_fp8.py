"""attnserve.flashinfer on an FP8 server (--kv_dtype=fp8_e4m3): planned as
FlashInfer's FP8 cache is (q_data_type the queries' dtype, kv_data_type the
cache's FP8 dtype), 16-bit rows appended and quantized by the server with
its KV scales, and every result compared with the float64 reference over
the values the server stores (and shown to differ from the same bytes read
without their scales). Over every transport a CPU server takes: gRPC, a
shared-memory region and a request channel.

Rows appended already in FP8 (torch.float8_e4m3fn) need torch 2.1 or later;
on an older torch those tests say so and skip."""

import numpy as np
import pytest
import torch

import attnserve
import attnserve.flashinfer as fi
from attnserve.reference import KvMirror, compare, within_tolerance
from server import TestServer
from test_flashinfer import BF16, TRANSPORTS, Batch, decode_qo, plan_decode, plan_prefill

FP8 = getattr(torch, "float8_e4m3fn", None)
needs_torch_fp8 = pytest.mark.skipif(FP8 is None, reason=f"torch {torch.__version__} has no "
                                     "float8_e4m3fn (torch 2.1+): FP8 rows cannot be made")
# Per layer, and per KV head in layer 1 (real value = stored FP8 value x scale).
SCALES = {0: (0.05, 0.02), 1: ([0.03, 0.08], [0.01, 0.04])}


@pytest.fixture(scope="module")
def server():
    with TestServer(kv_dtype="fp8_e4m3", extra_flags=["--allow_shared_memory"]) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    c = attnserve.Client(server.address, timeout=60)
    c.set_kv_scales(SCALES)
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


def fp8_batch(cache, kv_lens, seed):
    """A Batch whose mirror keeps rows as the server stores them."""
    b = Batch(cache, kv_lens, seed=seed)
    b.mirror = KvMirror(cache.num_kv_heads, cache.head_dim, kv_dtype="fp8_e4m3")
    for layer, (k_scale, v_scale) in cache.rpc.kv_scales().items():
        b.mirror.set_scales(layer, k_scale, v_scale)
    return b


def all_slots(b):
    bi = np.concatenate([np.full(n, i) for i, n in enumerate(b.kv_lens)])
    pos = np.concatenate([np.arange(n) for n in b.kv_lens])
    return b.slots(bi, pos)


def unscaled(b, layer):
    """A Batch view whose mirror holds the same stored bytes of `layer`
    with scales of 1.0: what a wrapper that lost the scales would compute."""
    plain = KvMirror(b.cache.num_kv_heads, b.cache.head_dim, kv_dtype="fp8_e4m3")
    slots = all_slots(b)
    k, v = b.cache.rpc.read_kv(layer, slots)
    plain.write(layer, slots, attnserve.RawBits(k, "fp8_e4m3"), attnserve.RawBits(v, "fp8_e4m3"))
    view = Batch.__new__(Batch)
    view.__dict__.update(b.__dict__)
    view.mirror = plain
    return view


def check(got, ref, other):
    o, lse = got
    c = compare(*ref, o.float().numpy(), lse.numpy())
    assert within_tolerance(c), c
    d = compare(*other, o.float().numpy(), lse.numpy())
    assert not within_tolerance(d), ("the result does not tell the scales apart", d)


def test_cache_reports_the_query_and_cache_dtypes(grpc_cache):
    c = grpc_cache
    assert c.dtype == BF16 and c.kv_fp8 and c.kv_format == "fp8_e4m3"
    assert c.kv_dtype == (FP8 if FP8 is not None else "fp8_e4m3")


def test_decode_matches_the_reference_over_stored_values(cache):
    b = fp8_batch(cache, [1, 17, 40, 100, 33], seed=21)
    b.fill()
    w = fi.BatchDecodeWithPagedKVCacheWrapper(cache, "NHD")
    plan_decode(w, b, kv_data_type=cache.kv_dtype)
    for layer in range(cache.num_layers):
        q = b.randn(5, cache.num_qo_heads, cache.head_dim, scale=2.0)
        got = w.run(q, cache[layer], return_lse=True)
        assert got[0].dtype == BF16 and got[0].shape == q.shape
        check(got, b.reference(layer, q, decode_qo(5), causal=False),
              unscaled(b, layer).reference(layer, q, decode_qo(5), causal=False))
    w.close()


def test_prefill_with_fused_appends_matches_the_reference(cache):
    """16-bit rows appended with append_paged_kv_cache reach the server in
    the run's own request and are quantized there, before the attention
    reads them."""
    kv_lens, q_lens = [20, 7, 45], [20, 3, 13]
    b = fp8_batch(cache, kv_lens, seed=22)
    b.fill([n - q for n, q in zip(kv_lens, q_lens)])
    qo = [0] + np.cumsum(q_lens).tolist()
    w = fi.BatchPrefillWithPagedKVCacheWrapper(cache, "NHD")
    plan_prefill(w, b, qo, causal=True, kv_data_type="fp8_e4m3")
    for layer in range(cache.num_layers):
        b.append(layer, q_lens)
        assert cache.pending_rows(layer) == sum(q_lens)
        q = b.randn(qo[-1], cache.num_qo_heads, cache.head_dim, scale=2.0)
        got = w.run(q, cache[layer], return_lse=True)
        assert cache.pending_rows(layer) == 0
        check(got, b.reference(layer, q, qo, causal=True),
              unscaled(b, layer).reference(layer, q, qo, causal=True))
    w.close()


def test_run_scales_multiply_on_top_of_the_servers(grpc_cache):
    """k_scale multiplies the logits and v_scale the output, as FlashInfer's
    do, over values the server has dequantized with its own scales."""
    c = grpc_cache
    b = fp8_batch(c, [9, 40, 70], seed=23)
    b.fill()
    w = fi.BatchDecodeWithPagedKVCacheWrapper(c)
    plan_decode(w, b, kv_data_type="fp8_e4m3")
    q = b.randn(3, c.num_qo_heads, c.head_dim, scale=2.0)
    o, lse = w.run(q, c[1], return_lse=True, k_scale=1.5, v_scale=0.5)
    scale = 1.5 / np.sqrt(c.head_dim)
    ref_o, ref_lse = b.reference(1, q, decode_qo(3), causal=False, sm_scale=scale)
    assert within_tolerance(compare(ref_o * 0.5, ref_lse, o.float().numpy(), lse.numpy()))
    plain_o, plain_lse = b.reference(1, q, decode_qo(3), causal=False)
    assert not within_tolerance(compare(plain_o, plain_lse, o.float().numpy(), lse.numpy()))


def test_plan_takes_flashinfers_fp8_names_and_refuses_others(grpc_cache):
    c = grpc_cache
    b = fp8_batch(c, [9, 40], seed=24)
    w = fi.BatchDecodeWithPagedKVCacheWrapper(c)
    for name in ("fp8_e4m3", "float8_e4m3fn") + ((FP8,) if FP8 is not None else ()):
        plan_decode(w, b, kv_data_type=name)
    # kv_data_type defaults to q_data_type, as FlashInfer's: not the cache's.
    with pytest.raises(ValueError, match="kv_data_type=torch.bfloat16, but the server's KV cache "
                                         "holds fp8_e4m3 .its --kv_dtype.: pass kv_data_type="):
        plan_decode(w, b)
    with pytest.raises(ValueError, match="kv_data_type=fp8_e5m2, but the server's KV cache "
                                         "holds fp8_e4m3"):
        plan_decode(w, b, kv_data_type="fp8_e5m2")
    with pytest.raises(ValueError, match="kv_data_type=float8_e5m2, but"):
        plan_decode(w, b, kv_data_type="float8_e5m2")
    with pytest.raises(NotImplementedError, match=r"q_data_type=torch.float16 here: the server "
                                                  r"takes queries in torch.bfloat16 \(its "
                                                  r"--q_dtype\)"):
        plan_decode(w, b, q_data_type=torch.float16, kv_data_type="fp8_e4m3")
    with pytest.raises(ValueError, match="is not a torch dtype name"):
        plan_decode(w, b, kv_data_type="fp8_e9m9")
    w.close()


def test_append_names_the_dtypes_an_fp8_cache_takes(grpc_cache):
    c = grpc_cache
    b = fp8_batch(c, [4], seed=25)
    rows = torch.zeros(4, c.num_kv_heads, c.head_dim)
    bi, pos = torch.zeros(4, dtype=torch.int32), torch.arange(4, dtype=torch.int32)
    with pytest.raises(ValueError, match=r"append_key has dtype torch.float32; the server's KV "
                                         r"cache holds fp8_e4m3 and takes torch.bfloat16 rows "
                                         r"\(quantized by the server"):
        fi.append_paged_kv_cache(rows, rows.to(BF16), bi, pos, c[0], b.indices, b.indptr, b.last)
    assert c.pending_rows(0) == 0


# ---------------------------------------------------------------- FP8 rows (torch 2.1+)
@needs_torch_fp8
def test_fp8_rows_are_stored_as_they_are_beside_quantized_ones(cache):
    """One layer's queue holding 16-bit rows, then FP8 rows, then 16-bit
    rows again: each kind reaches the server in order (the earlier runs
    written apart, the last fused into the run), the FP8 bytes unchanged."""
    c = cache
    kv_lens = [30, 12]
    b = fp8_batch(c, kv_lens, seed=26)
    w = fi.BatchDecodeWithPagedKVCacheWrapper(c)
    plan_decode(w, b, kv_data_type=c.kv_dtype)
    thirds = [[10, 4], [10, 4], [10, 4]]
    raw = None
    for part, rows in enumerate(thirds):
        upto = [sum(r[i] for r in thirds[:part + 1]) for i in range(2)]
        nnz = sum(rows)
        indptr = torch.tensor([0, rows[0], nnz], dtype=torch.int32)
        bi, pos = fi.get_batch_indices_positions(indptr, torch.tensor(upto), nnz)
        k = b.randn(nnz, c.num_kv_heads, c.head_dim)
        v = b.randn(nnz, c.num_kv_heads, c.head_dim)
        if part == 1:
            k, v = k.float().mul(20).to(FP8), v.float().mul(20).to(FP8)
            raw = (b.slots(bi, pos), k.view(torch.uint8).numpy(), v.view(torch.uint8).numpy())
        fi.append_paged_kv_cache(k, v, bi, pos, c[0], b.indices, b.indptr, b.last)
        b.mirror.write(0, b.slots(bi, pos), k, v)
    assert c.pending_rows(0) == sum(map(sum, thirds))
    q = b.randn(2, c.num_qo_heads, c.head_dim, scale=2.0)
    # The second of the runs written apart fails: every run stays queued,
    # in order, and the next run() writes them all.
    real, calls = c.rpc.write_kv, []

    def failing(*args, **kwargs):
        calls.append(args)
        if len(calls) == 2:
            raise ConnectionError("write_kv failed")
        return real(*args, **kwargs)
    c.rpc.write_kv = failing
    try:
        with pytest.raises(ConnectionError, match="write_kv failed"):
            w.run(q, c[0])
    finally:
        c.rpc.write_kv = real
    assert c.pending_rows(0) == sum(map(sum, thirds))
    got = w.run(q, c[0], return_lse=True)
    assert c.pending_rows(0) == 0
    check(got, b.reference(0, q, decode_qo(2), causal=False),
          unscaled(b, 0).reference(0, q, decode_qo(2), causal=False))
    k_back, v_back = c.rpc.read_kv(0, raw[0])
    np.testing.assert_array_equal(k_back, raw[1])
    np.testing.assert_array_equal(v_back, raw[2])
    w.close()


@needs_torch_fp8
def test_fp8_rows_of_another_kind_are_refused(grpc_cache):
    c = grpc_cache
    b = fp8_batch(c, [4], seed=27)
    bi, pos = torch.zeros(4, dtype=torch.int32), torch.arange(4, dtype=torch.int32)
    k8 = torch.zeros(4, c.num_kv_heads, c.head_dim).to(FP8)
    with pytest.raises(ValueError, match="append_key has dtype torch.float8_e4m3fn, "
                                         "append_value torch.bfloat16: they must match"):
        fi.append_paged_kv_cache(k8, k8.float().to(BF16), bi, pos, c[0], b.indices, b.indptr,
                                 b.last)
    e5 = torch.zeros(4, c.num_kv_heads, c.head_dim).to(torch.float8_e5m2)
    with pytest.raises(ValueError, match="append_key has dtype torch.float8_e5m2"):
        fi.append_paged_kv_cache(e5, e5, bi, pos, c[0], b.indices, b.indptr, b.last)
    assert c.pending_rows(0) == 0
