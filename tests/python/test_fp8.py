"""FP8 KV caches from Python (docs/design.md, "FP8 KV cache"): the numpy
quantizer against the formats' definitions, ServerInfo's dtypes and page
counts, writes quantized by the server or stored as they are, read_kv's
stored bytes and dequantized rows, KV scales, prefill and the KV manager
against the float64 reference over the dequantized values, the cluster's
scales, and the errors."""

import math
import re

import numpy as np
import pytest

import attnserve
from attnserve import dtypes as dt
from attnserve.reference import (FP8_QUERY_LSE_BOUND, FP8_QUERY_LSE_SLOPE, LSE_BOUND, KvMirror,
                                 compare, reference_prefill, round_query_rows_to_e4m3,
                                 within_tolerance)
from server import TestServer

FORMATS = ("fp8_e4m3", "fp8_e5m2")


def _definition(fmt):
    """(positive finite values, their bits) from the format's definition."""
    exp_bits = 4 if fmt == "fp8_e4m3" else 5
    man_bits = 7 - exp_bits
    bias = (1 << (exp_bits - 1)) - 1
    values, bits = [], []
    for b in range(128):
        e, m = b >> man_bits, b & ((1 << man_bits) - 1)
        top = (1 << exp_bits) - 1
        if fmt == "fp8_e5m2" and e == top:
            break
        if fmt == "fp8_e4m3" and e == top and m == (1 << man_bits) - 1:
            break
        frac = m / (1 << man_bits)
        values.append(2.0 ** (1 - bias) * frac if e == 0 else 2.0 ** (e - bias) * (1 + frac))
        bits.append(b)
    return np.array(values), np.array(bits)


def _nearest(a, fmt):
    """Index into _definition(fmt) of the value nearest each magnitude a (of
    two equally near, the even bit pattern; the largest at or past it)."""
    values, bits = _definition(fmt)
    with np.errstate(invalid="ignore"):   # NaN magnitudes: their callers' own answer
        dist = np.abs(a[:, None] - values[None, :])
        best = dist.min(axis=1, keepdims=True)
        tie_even = np.where(dist == best, np.where(bits % 2 == 0, 0, 1), 2)
        return np.where(a >= values[-1], len(values) - 1, np.argmin(tie_even, axis=1))


@pytest.mark.parametrize("fmt", FORMATS)
def test_quantizer_matches_the_definition_on_every_bf16_pattern(fmt):
    values, bits = _definition(fmt)
    x = dt.bf16_bits_to_float32(np.arange(65536, dtype=np.uint32).astype(np.uint16))
    got = dt.float_to_fp8_bits(x, fmt)
    want = bits[_nearest(np.abs(x.astype(np.float64)), fmt)]
    want = (want | np.where(np.signbit(x), 0x80, 0)).astype(np.uint8)
    want = np.where(np.isnan(x), 0x7F, want)
    np.testing.assert_array_equal(got, want)
    # Every finite pattern decodes to its value and encodes back.
    table = dt.fp8_bits_to_float32(np.arange(256, dtype=np.uint8), fmt)
    np.testing.assert_array_equal(table[:len(values)], values.astype(np.float32))
    finite = np.isfinite(table)
    np.testing.assert_array_equal(dt.float_to_fp8_bits(table[finite], fmt),
                                  np.arange(256)[finite])


def test_scales_divide_before_rounding():
    x = np.array([1.0, -3.0, 448.0 * 0.5, 1e6, np.inf, -np.inf, np.nan, 0.0, -0.0])
    np.testing.assert_array_equal(dt.float_to_fp8_bits(x, "fp8_e4m3", 0.5),
                                  dt.float_to_fp8_bits(x / 0.5, "fp8_e4m3"))
    per_head = dt.float_to_fp8_bits(np.ones((2, 4)), "fp8_e4m3", np.array([[1.0], [0.25]]))
    assert per_head[0].tolist() == [0x38] * 4 and per_head[1].tolist() == [0x48] * 4  # 1, 4


def _round_rows_by_definition(x):
    """Each row of x (float64 [n, d]) as an sm90_fp8q server rounds it, from
    E4M3's values: e such that the row's largest finite |x| times 2^e lies in
    [128, 256) (clamped to [-100, 100]; 0 for a zero row), then the nearest
    E4M3 value of x 2^e (ties to the even pattern, +-448 past it), times 2^-e."""
    values, _ = _definition("fp8_e4m3")
    out = np.empty_like(x)
    for r, row in enumerate(x):
        finite = row[np.isfinite(row)]
        a = np.abs(finite).max() if finite.size else 0.0
        e = 0
        if a > 0:
            while a * 2.0 ** e >= 256:
                e -= 1
            while a * 2.0 ** e < 128:
                e += 1
            e = min(max(e, -100), 100)
        nearest = values[_nearest(np.abs(row) * 2.0 ** e, "fp8_e4m3")]   # NaN elements: NaN below
        out[r] = np.where(np.isnan(row), np.nan, np.copysign(nearest, row) * 2.0 ** -e)
    return out


@pytest.mark.parametrize("wire", [dt.DTYPE_BF16, dt.DTYPE_FP16])
def test_query_rounding_matches_e4m3_on_every_16_bit_pattern(wire):
    """round_query_rows_to_e4m3 (what reference_prefill does to the rows an
    sm90_fp8q server rounds) against the definition, on every 16-bit pattern
    in rows of 128 shuffled, plus rows of zeros, of the smallest values (the
    exponent clamped at 100), and with an infinity or a NaN in them."""
    rng = np.random.default_rng(7)
    patterns = rng.permutation(np.arange(65536, dtype=np.uint32).astype(np.uint16))
    with np.errstate(invalid="ignore"):   # the NaN patterns
        x = dt.bf16_bits_to_float32(patterns).astype(np.float64) if wire == dt.DTYPE_BF16 else \
            patterns.view(np.float16).astype(np.float64)
    x = x.reshape(-1, 128)
    tiny = 2.0 ** -133 if wire == dt.DTYPE_BF16 else 2.0 ** -24
    extra = np.stack([np.zeros(128), np.where(np.arange(128) % 2, -tiny, tiny),
                      np.where(np.arange(128) == 3, np.inf, rng.normal(size=128)),
                      np.where(np.arange(128) == 5, np.nan, rng.normal(size=128) * 1e-3)])
    x = np.concatenate([x, dt.bf16_bits_to_float32(dt.float32_to_bf16_bits(extra)).astype(np.float64)
                        if wire == dt.DTYPE_BF16 else extra.astype(np.float16).astype(np.float64)])
    got = round_query_rows_to_e4m3(x, wire)
    want = _round_rows_by_definition(x)
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    ok = ~np.isnan(want)
    np.testing.assert_array_equal(got[ok], want[ok])
    np.testing.assert_array_equal(np.signbit(got[ok]), np.signbit(want[ok]))
    if wire == dt.DTYPE_BF16:   # 2^-133 would want e = 140: at 100 every element rounds to zero
        assert (got[-3] == 0).all() and np.signbit(got[-3]).sum() == 64
    assert np.isfinite(got[-2]).all() and (got[-2] != 0).all()   # the infinity saturated


def test_reference_rounds_the_rows_a_server_rounds_and_holds_them_to_their_bound():
    """A mirror of a server whose fp8_query_min_rows is 9: a sequence of 12
    rows is computed on rounded queries and held to the FP8-query kernel's
    bound (FP8_QUERY_LSE_BOUND or FP8_QUERY_LSE_SLOPE times the row's largest
    scaled sum of |q_d k_d|), one of 3 rows on the queries as sent and held
    to LSE_BOUND."""
    rng = np.random.default_rng(11)
    info = attnserve.ServerInfo(version="", backend="cuda", device="", num_layers=1, num_pages=8,
                                page_size=16, num_qo_heads=4, num_kv_heads=2, head_dim=64,
                                kv_dtype="fp8_e4m3", free_pages=8, max_batch_tokens=0,
                                max_message_bytes=0, incarnation=1, q_dtype="bf16",
                                fp8_query_min_rows=9)
    mirror = KvMirror.for_server(info)
    assert mirror.fp8_query_min_rows == 9
    slots = np.arange(64)
    mirror.write(0, slots, rng.normal(size=(64, 2, 64)), rng.normal(size=(64, 2, 64)))
    q = rng.normal(size=(15, 4, 64)) * 3
    q_sent = q.copy()
    args = ([0, 3, 15], [0, 2, 4], [0, 1, 2, 3], [16, 16])
    o, lse, bound = reference_prefill(mirror, 0, q, *args, page_size=16, return_lse_bound=True)
    np.testing.assert_array_equal(q, q_sent)                  # the caller's queries untouched
    assert (bound[:3] == LSE_BOUND).all() and (bound[3:] >= FP8_QUERY_LSE_BOUND).all()
    # Row 14 (the last, at position 31 of its 32 keys), from the definition.
    k_rows = mirror.rows(0, list(range(32, 64)))[0]             # [32, Hkv, D], dequantized
    q14 = round_query_rows_to_e4m3(q[14])
    for h in range(4):
        mag = max(sum(abs(q14[h, c] * k_rows[j, h // 2, c]) for c in range(64)) for j in range(32))
        want = max(FP8_QUERY_LSE_BOUND, FP8_QUERY_LSE_SLOPE * mag / 8 / math.log(2.0))
        assert bound[14, h] == pytest.approx(want, rel=1e-12)
    assert (bound[3:] > FP8_QUERY_LSE_BOUND).any()
    # Queries twice as large round to twice the values: every bound past the floor doubles.
    _, _, bound2 = reference_prefill(mirror, 0, 2 * q, *args, page_size=16, return_lse_bound=True)
    past = bound[3:] > FP8_QUERY_LSE_BOUND
    np.testing.assert_allclose(bound2[3:][past], 2 * bound[3:][past], rtol=1e-12)
    o_sent, lse_sent = reference_prefill(mirror, 0, q, *args, page_size=16, fp8_query_min_rows=0)
    rounded = q.copy()
    rounded[3:] = round_query_rows_to_e4m3(q[3:])
    o_r, lse_r = reference_prefill(mirror, 0, rounded, *args, page_size=16, fp8_query_min_rows=0)
    np.testing.assert_array_equal(o[:3], o_sent[:3])
    np.testing.assert_array_equal(lse[:3], lse_sent[:3])
    np.testing.assert_array_equal(o[3:], o_r[3:])
    np.testing.assert_array_equal(lse[3:], lse_r[3:])
    assert np.abs(lse[3:] - lse_sent[3:]).max() > 1e-3       # the rounding moved them

    def check(row, delta):
        got = lse.copy()
        got[row, 1] += delta
        return within_tolerance(compare(o, lse, o.astype(np.float32), got, bound))
    assert check(5, 2e-3)            # a rounded row, within its bound
    assert check(5, 0.5 * bound[5, 1])
    assert not check(1, 2e-3)        # a row of the short sequence, past 1e-3
    assert not check(5, 1.5 * bound[5, 1])   # past its bound
    c = compare(o, lse, o.astype(np.float32), lse + 2e-3, bound)
    assert c["lse_rows_over_bound"] == 3 * 4 and not within_tolerance(c)
    # Without bounds, compare and within_tolerance hold every row to 1e-3.
    assert not within_tolerance(compare(o, lse, o.astype(np.float32), lse + 2e-3))


@pytest.fixture(scope="module")
def fp8_server():
    with TestServer(kv_dtype="fp8_e4m3", extra_flags=["--kv_cache_bytes=4194304"]) as s:
        yield s


def test_server_info_and_twice_the_pages(fp8_server):
    with TestServer(kv_dtype="bf16", extra_flags=["--kv_cache_bytes=4194304"]) as bf16:
        with attnserve.Client(bf16.address) as a, attnserve.Client(fp8_server.address) as b:
            ia, ib = a.server_info, b.server_info
            assert (ia.kv_dtype, ia.q_dtype, ib.kv_dtype, ib.q_dtype) == \
                ("bf16", "bf16", "fp8_e4m3", "bf16")
            assert ib.kv_fp8 and not ia.kv_fp8
            assert ib.page_bytes * 2 == ia.page_bytes
            assert ib.num_pages == 2 * ia.num_pages
            assert ib.kv_cache_bytes == ib.num_pages * ib.page_bytes
            # The CPU backend never rounds queries (sm90_fp8q is CUDA's).
            assert ia.fp8_query_min_rows == 0 and ib.fp8_query_min_rows == 0
            assert a.kv_scales() == {}


def _rows(rng, n, scale=1.0):
    return (rng.standard_normal((n, 2, 64)) * scale).astype(np.float32)


def test_writes_quantize_and_reads_return_stored_or_values(fp8_server):
    rng = np.random.default_rng(1)
    with attnserve.Client(fp8_server.address) as c:
        c.set_kv_scales({1: ([0.02, 0.5], 0.25)})
        scales = c.kv_scales()
        np.testing.assert_array_equal(scales[1][0], np.float32([0.02, 0.5]))
        np.testing.assert_array_equal(scales[1][1], np.float32([0.25, 0.25]))
        np.testing.assert_array_equal(scales[0][0], np.float32([1, 1]))
        pages = c.allocate_pages(2)
        slots = [p * 16 + i for p in pages for i in range(16)]
        k, v = _rows(rng, 32, 4.0), _rows(rng, 32, 100.0)
        k[0, 0, :4] = [np.inf, -np.inf, 1e6, 0.0]
        c.write_kv(1, slots, k, v)
        k8, v8 = c.read_kv(1, slots)
        assert k8.dtype == np.uint8 and k8.shape == (32, 2, 64)
        # The bf16 rows the client sent, quantized per head as the server does.
        kb = dt.bf16_bits_to_float32(dt.float32_to_bf16_bits(k))
        vb = dt.bf16_bits_to_float32(dt.float32_to_bf16_bits(v))
        head = np.float32([[0.02], [0.5]])  # as the server holds them (float32)
        np.testing.assert_array_equal(k8, dt.float_to_fp8_bits(kb, "fp8_e4m3", head))
        np.testing.assert_array_equal(v8, dt.float_to_fp8_bits(vb, "fp8_e4m3", 0.25))
        assert not np.isnan(dt.fp8_bits_to_float32(k8, "fp8_e4m3")).any()
        kd, vd = c.read_kv(1, slots, dequantize=True)
        want = dt.fp8_bits_to_float32(k8, "fp8_e4m3") * np.float32([[0.02], [0.5]])
        np.testing.assert_array_equal(kd, dt.bf16_bits_to_float32(dt.float32_to_bf16_bits(want)))
        assert kd.dtype == np.float32
        # FP8 rows as stored.
        raw_k = rng.integers(0, 256, (32, 2, 64), dtype=np.uint8)
        raw_k[raw_k & 0x7F == 0x7F] = 0x01
        raw_v = rng.integers(0, 126, (32, 2, 64), dtype=np.uint8)
        c.write_kv(0, slots, attnserve.RawBits(raw_k, "fp8_e4m3"),
                   attnserve.RawBits(raw_v, "fp8_e4m3"))
        got_k, got_v = c.read_kv(0, slots)
        np.testing.assert_array_equal(got_k, raw_k)
        np.testing.assert_array_equal(got_v, raw_v)
        c.free_pages(pages)


def test_prefill_matches_the_reference_over_dequantized_values(fp8_server):
    rng = np.random.default_rng(2)
    with attnserve.Client(fp8_server.address) as c:
        info = c.server_info
        c.set_kv_scales({0: ([0.01, 0.03], [0.02, 0.005])})
        mirror = KvMirror(2, 64, kv_dtype=info.kv_dtype)
        for layer, (ks, vs) in c.kv_scales().items():
            mirror.set_scales(layer, ks, vs)
        pages = c.allocate_pages(6)
        slots = [p * 16 + i for p in pages for i in range(16)]
        k, v = _rows(rng, 96), _rows(rng, 96)
        c.write_kv(0, slots[:48], k[:48], v[:48])
        mirror.write(0, slots[:48], k[:48], v[:48])
        k_bits = dt.float_to_fp8_bits(k[48:], "fp8_e4m3", np.array([[0.01], [0.03]]))
        v_bits = dt.float_to_fp8_bits(v[48:], "fp8_e4m3", np.array([[0.02], [0.005]]))
        raw = (attnserve.RawBits(k_bits, "fp8_e4m3"), attnserve.RawBits(v_bits, "fp8_e4m3"))
        c.write_kv(0, slots[48:], *raw)
        mirror.write(0, slots[48:], *raw)
        q = rng.standard_normal((9, 8, 64)).astype(np.float32)
        args = dict(qo_indptr=[0, 1, 9], kv_indptr=[0, 3, 6], kv_indices=pages,
                    kv_last_page_len=[16, 7])
        r = c.prefill(0, q, **args)
        o, lse = reference_prefill(mirror, 0, q, page_size=16, **args)
        cmp = compare(o, lse, r.output, r.lse)
        assert within_tolerance(cmp), cmp
        # The comparison can fail: the same stored bytes without their scales
        # are far off.
        plain = KvMirror(2, 64, kv_dtype=info.kv_dtype)
        stored = c.read_kv(0, slots)
        plain.write(0, slots, attnserve.RawBits(stored[0], "fp8_e4m3"),
                    attnserve.RawBits(stored[1], "fp8_e4m3"))
        o2, lse2 = reference_prefill(plain, 0, q, page_size=16, **args)
        assert not within_tolerance(compare(o2, lse2, r.output, r.lse))
        c.free_pages(pages)


def test_kv_manager_appends_through_an_fp8_server(fp8_server):
    rng = np.random.default_rng(3)
    with attnserve.Client(fp8_server.address) as c:
        c.set_kv_scales({0: (0.05, 0.02), 1: (0.05, 0.02)})
        mirror = KvMirror(2, 64, kv_dtype="fp8_e4m3")
        for layer, (ks, vs) in c.kv_scales().items():
            mirror.set_scales(layer, ks, vs)
        with attnserve.KvManager(c) as mgr:
            for q_lens in ([5, 20], [1, 1], [1, 1]):
                plan = mgr.plan([7, 9], q_lens)
                total = sum(q_lens)
                for layer in (0, 1):
                    q = rng.standard_normal((total, 8, 64)).astype(np.float32)
                    k, v = _rows(rng, total), _rows(rng, total)
                    r = mgr.run(layer, q, k, v)
                    mirror.write(layer, plan.append_slots, k, v)
                    o, lse = reference_prefill(
                        mirror, layer, q, plan.qo_indptr, plan.kv_indptr, plan.kv_indices,
                        plan.kv_last_page_len, page_size=16)
                    cmp = compare(o, lse, r.output, r.lse)
                    assert within_tolerance(cmp), (q_lens, layer, cmp)
            mgr.finish(7, 9)


def test_cluster_gives_its_scales_to_every_server(fp8_server):
    with TestServer(kv_dtype="fp8_e4m3") as other:
        cluster = attnserve.Cluster([fp8_server.address, other.address], lease=False)
        try:
            cluster.set_kv_scales({1: ([0.5, 0.25], 2.0)})
            for i in range(cluster.num_servers):
                ks, vs = cluster.client(i).kv_scales()[1]
                np.testing.assert_array_equal(ks, np.float32([0.5, 0.25]))
                np.testing.assert_array_equal(vs, np.float32([2, 2]))
        finally:
            cluster.close()
    # A bf16 server does not join an FP8 cluster.
    with TestServer(kv_dtype="bf16") as bf16:
        with pytest.raises(ValueError, match="kv_dtype=bf16"):
            attnserve.Cluster([fp8_server.address, bf16.address], lease=False)


def test_bad_scales_and_rows_name_the_field(fp8_server):
    with attnserve.Client(fp8_server.address) as c:
        before = c.kv_scales()
        for scales, field in [({0: (0.0, 1.0)}, "layers[0].k_scale[0]=0"),
                              ({0: (1.0, -2.0)}, "layers[0].v_scale[0]=-2"),
                              ({0: (float("inf"), 1.0)}, "layers[0].k_scale[0]=inf"),
                              ({0: (float("nan"), 1.0)}, "layers[0].k_scale[0]=nan"),
                              ({5: (1.0, 1.0)}, "layers[0].layer=5 out of range"),
                              # K's bound keeps |sm_scale| x k_scale x log2(e) finite.
                              ({0: (1.5e8, 1e30)}, "layers[0].k_scale[0]=1.5e+08 must be finite and in (0, 1e+08]"),
                              # Past num_kv_heads the wire limit answers, before parsing.
                              ({0: ([1.0, 2.0, 3.0], 1.0)},
                               "layers[0].k_scale has more than 2 entries (num_kv_heads=2)"),
                              ({}, "layers is empty")]:
            with pytest.raises(attnserve.InvalidArgument, match=re.escape(field)):
                c.set_kv_scales(scales)
        # A finite value beyond float32 is refused by the client as given, not
        # sent as an infinity or 0.
        for value in (1e39, 1e-50):
            with pytest.raises(ValueError, match=re.escape(f"scales[0] k_scale: {value!r} does not fit a float32")):
                c.set_kv_scales({0: (value, 1.0)})
        after = c.kv_scales()
        assert after.keys() == before.keys()
        for layer in after:
            np.testing.assert_array_equal(after[layer][0], before[layer][0])
            np.testing.assert_array_equal(after[layer][1], before[layer][1])
        pages = c.allocate_pages(1)
        bits = np.zeros((16, 2, 64), np.uint8)
        with pytest.raises(TypeError, match="fp8_e4m3"):  # the server's is E4M3
            c.write_kv(0, [pages[0] * 16 + i for i in range(16)],
                       attnserve.RawBits(bits, "fp8_e5m2"), attnserve.RawBits(bits, "fp8_e5m2"))
        with pytest.raises(TypeError, match="both FP8 rows or neither"):
            c.write_kv(0, [pages[0] * 16 + i for i in range(16)],
                       attnserve.RawBits(bits, "fp8_e4m3"), np.zeros((16, 2, 64), np.float32))
        c.free_pages(pages)


def test_fp8_rows_and_scales_to_a_bf16_server(server):
    with attnserve.Client(server.address) as c:
        pages = c.allocate_pages(1)
        bits = np.zeros((16, 2, 64), np.uint8)
        with pytest.raises(TypeError, match="takes 16-bit rows only"):
            c.write_kv(0, [pages[0] * 16 + i for i in range(16)],
                       attnserve.RawBits(bits, "fp8_e4m3"), attnserve.RawBits(bits, "fp8_e4m3"))
        with pytest.raises(attnserve.InvalidArgument, match="KV scales apply to an FP8 KV cache"):
            c.set_kv_scales({0: (0.5, 0.5)})
        c.free_pages(pages)


def test_fp8_rows_travel_through_a_region():
    """FP8 rows as RegionTensors ("fp8_e4m3"): WriteKV's and a Prefill's
    fused append read them from the region and store them as they are; the
    attention matches the reference over them; a region tensor of FP8 where
    the server takes 16-bit values is refused by the client, naming it."""
    rng = np.random.default_rng(5)
    with TestServer(kv_dtype="fp8_e4m3", extra_flags=["--allow_shared_memory"]) as s, \
            attnserve.Client(s.address) as c, attnserve.SharedMemoryRegion(1 << 16) as region:
        c.set_kv_scales({0: (0.05, 0.02)})
        region.register(c, "fp8-rows")
        pages = c.allocate_pages(4)
        slots = [p * 16 + i for p in pages for i in range(16)]
        row = 2 * 64                                            # bytes of one FP8 row
        k_bits = dt.float_to_fp8_bits(_rows(rng, 64, 0.3), "fp8_e4m3", 0.05)
        v_bits = dt.float_to_fp8_bits(_rows(rng, 64, 0.1), "fp8_e4m3", 0.02)
        region.array(0, (64, 2, 64), "fp8_e4m3")[:] = k_bits
        region.array(64 * row, (64, 2, 64), "fp8_e4m3")[:] = v_bits
        c.write_kv(0, slots[:32], region.tensor(0, (32, 2, 64), "fp8_e4m3"),
                   region.tensor(64 * row, (32, 2, 64), "fp8_e4m3"))
        q = rng.standard_normal((3, 8, 64)).astype(np.float32)
        args = dict(qo_indptr=[0, 1, 3], kv_indptr=[0, 2, 4], kv_indices=pages,
                    kv_last_page_len=[16, 16])
        r = c.prefill(0, q, **args, append_slots=slots[32:],
                      append_k=region.tensor(32 * row, (32, 2, 64), "fp8_e4m3"),
                      append_v=region.tensor(96 * row, (32, 2, 64), "fp8_e4m3"))
        k8, v8 = c.read_kv(0, slots)
        np.testing.assert_array_equal(k8, k_bits)
        np.testing.assert_array_equal(v8, v_bits)
        mirror = KvMirror(2, 64, kv_dtype="fp8_e4m3")
        mirror.set_scales(0, 0.05, 0.02)
        mirror.write(0, slots, attnserve.RawBits(k_bits, "fp8_e4m3"),
                     attnserve.RawBits(v_bits, "fp8_e4m3"))
        o, lse = reference_prefill(mirror, 0, q, page_size=16, **args)
        cmp = compare(o, lse, r.output, r.lse)
        assert within_tolerance(cmp), cmp
        with pytest.raises(ValueError, match="q: a region tensor of fp8_e4m3 where the server "
                                             "takes bf16 values"):
            c.prefill(0, region.tensor(0, (3, 8, 64), "fp8_e4m3"), **args)
        with pytest.raises(TypeError, match="k and v: both FP8 rows or neither"):
            c.write_kv(0, slots[:4], region.tensor(0, (4, 2, 64), "fp8_e4m3"),
                       region.tensor(0, (4, 2, 64), "bf16"))
        c.free_pages(pages)
