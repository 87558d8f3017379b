"""Multi-head latent attention from Python against a real CPU server
(--attention=mla): the geometry in ServerInfo, latent rows written, read
and appended as K alone, prefill and decode (several rows and one row per
sequence), server plans, the variants, split-KV merged by LSE, regions, a
request channel, the asyncio client, KvManager and Cluster, every result
checked against the float64 reference (attnserve.reference over a latent
mirror) on random data; the errors for a V on an MLA server and a missing V
on a GQA one, Python-side and (sent raw) server-side."""

import asyncio

import numpy as np
import pytest
import torch

import attnserve
from attnserve import dtypes as dt
from attnserve.aio import AsyncClient
from attnserve.reference import (KvMirror, as_float64, compare, reference_merge,
                                 reference_prefill, within_tolerance)
from attnserve.v1 import attention_pb2 as pb
from server import TestServer

RANK, ROPE, HEADS = 64, 16, 8
QK, DV = RANK + ROPE, RANK
# DeepSeek's scale for qk_nope 32 + qk_rope 16, not the server's default 1/sqrt(80).
MODEL_SCALE = 1.0 / np.sqrt(48.0)

# Every edge the layout has: no query rows, no KV, neither, more rows than KV
# (rows that see nothing), an exactly full last page, a decode row, random.
EDGE_LENS = [(0, 40), (5, 0), (0, 0), (30, 25), (7, 32), (1, 77), (12, 150), (33, 61)]


def mla_server(**kw):
    return TestServer(attention="mla", kv_lora_rank=RANK, qk_rope_head_dim=ROPE,
                      num_qo_heads=HEADS, **kw)


@pytest.fixture(scope="module")
def server():
    with mla_server(extra_flags=["--allow_shared_memory"]) as s:
        yield s


@pytest.fixture
def client(server):
    c = attnserve.Client(server.address, timeout=120)
    yield c
    for r in c.list_regions():
        c.unregister_region(r.name)
    c.close()


def slots_of(pages, page_size):
    return [p * page_size + i for p in pages for i in range(page_size)]


def latent_rows(rng, n):
    """Random latent rows [n, 1, kv_lora_rank + qk_rope_head_dim]: c_kv of
    RMS about 1 (after its norm), k_pe larger (after rope)."""
    rows = rng.standard_normal((n, 1, QK)).astype(np.float32)
    rows[..., RANK:] *= 2.0
    return rows


def fill(client, mirror, rng, layer, pages):
    slots = slots_of(pages, client.server_info.page_size)
    rows = latent_rows(rng, len(slots))
    client.write_kv(layer, slots, rows)
    mirror.write(layer, slots, rows)
    return slots


def ragged(rng, g, pages, lens):
    qo, kv, idx, last = [0], [0], [], []
    for q_len, kv_len in lens:
        n = -(-kv_len // g.page_size)
        idx += [int(pages[i]) for i in rng.integers(0, len(pages), n)]
        qo.append(qo[-1] + q_len)
        kv.append(kv[-1] + n)
        last.append(kv_len - (n - 1) * g.page_size if n else 0)
    q = rng.standard_normal((qo[-1], g.num_qo_heads, g.qk_head_dim)).astype(np.float32)
    return q, qo, kv, idx, last


def test_server_info_reports_the_latent_geometry(client):
    g = client.info()
    assert g.attention == "mla" and g.mla
    assert (g.num_qo_heads, g.num_kv_heads, g.head_dim) == (HEADS, 1, QK)
    assert (g.qk_head_dim, g.v_head_dim, g.kv_lora_rank, g.qk_rope_head_dim) == (QK, DV, RANK,
                                                                                 ROPE)
    assert g.kv_dtype == "bf16" and g.num_layers == 2


def test_gqa_server_info_keeps_one_head_dim():
    with TestServer(num_pages=16) as s, attnserve.Client(s.address, timeout=60) as c:
        g = c.server_info
        assert g.attention == "gqa" and not g.mla
        assert (g.qk_head_dim, g.v_head_dim, g.kv_lora_rank, g.qk_rope_head_dim) == (64, 64, 0, 0)


def test_info_of_a_server_without_the_fields_reads_head_dim():
    """An older server leaves qk_head_dim and v_head_dim 0: both are head_dim."""
    g = attnserve.ServerInfo(version="0.1", backend="cpu", device="cpu", num_layers=1,
                             num_pages=1, page_size=16, num_qo_heads=8, num_kv_heads=2,
                             head_dim=128, kv_dtype="bf16", free_pages=1, max_batch_tokens=1,
                             max_message_bytes=1, incarnation=1)
    assert (g.attention, g.qk_head_dim, g.v_head_dim, g.mla) == ("gqa", 128, 128, False)


def test_latent_rows_round_trip_bit_exact(client):
    g = client.server_info
    rng = np.random.default_rng(1)
    pages = client.allocate_pages(2)
    slots = slots_of(pages, g.page_size)[3:29]
    bits = rng.integers(0, 1 << 16, (len(slots), 1, QK), dtype=np.uint16)
    bits[bits & 0x7F80 == 0x7F80] = 0x3F80  # no NaN / inf patterns
    client.write_kv(1, slots, attnserve.RawBits(bits, "bf16"))
    k, v = client.read_kv(1, slots, out="raw")
    assert v is None and np.array_equal(k, bits)
    tk, tv = client.read_kv(1, slots, out="torch")
    assert tv is None and tk.dtype == torch.bfloat16 and tuple(tk.shape) == (len(slots), 1, QK)
    assert np.array_equal(tk.view(torch.int16).numpy().view(np.uint16), bits)
    # torch in, numpy out.
    rows = torch.from_numpy(latent_rows(rng, len(slots))).to(torch.bfloat16)
    client.write_kv(1, slots, rows)
    fk, fv = client.read_kv(1, slots)
    assert fv is None and fk.dtype == np.float32 and np.array_equal(fk, rows.float().numpy())
    client.free_pages(pages)


@pytest.mark.parametrize("causal,lse_base,sm_scale", [(True, "2", None), (False, "e", 0.07),
                                                      (True, "e", MODEL_SCALE)])
def test_prefill_matches_float64_reference(client, causal, lse_base, sm_scale):
    g = client.server_info
    rng = np.random.default_rng(2)
    mirror = KvMirror.for_server(g)
    pages = client.allocate_pages(12)
    for layer in range(g.num_layers):
        fill(client, mirror, rng, layer, pages)
    for layer in range(g.num_layers):
        q, qo, kv, idx, last = ragged(rng, g, pages, EDGE_LENS)
        r = client.prefill(layer, q, qo, kv, idx, last, causal=causal, lse_base=lse_base,
                           sm_scale=sm_scale)
        assert r.output.shape == (qo[-1], HEADS, DV) and r.lse.shape == (qo[-1], HEADS)
        o_ref, lse_ref = reference_prefill(mirror, layer, q, qo, kv, idx, last,
                                           page_size=g.page_size, causal=causal,
                                           sm_scale=sm_scale, lse_base=lse_base)
        c = compare(o_ref, lse_ref, r.output, r.lse)
        assert within_tolerance(c), c
        blind = np.isneginf(lse_ref)
        assert blind.any()
        assert np.all(r.output[blind] == 0) and np.all(np.isneginf(r.lse[blind]))
    client.free_pages(pages)


def test_the_rope_part_and_the_scale_count(client):
    """The logits use all qk_head_dim values (the k_pe part too) and the
    values only the first v_head_dim: a reference that dropped the rope part
    or took the whole row as value would not match."""
    g = client.server_info
    rng = np.random.default_rng(21)
    mirror = KvMirror.for_server(g)
    pages = client.allocate_pages(3)
    fill(client, mirror, rng, 0, pages)
    q = rng.standard_normal((4, HEADS, QK)).astype(np.float32)
    q[..., RANK:] *= 3.0
    lay = ([0, 4], [0, 3], pages, [16])
    r = client.prefill(0, q, *lay, sm_scale=MODEL_SCALE)
    o_ref, lse_ref = reference_prefill(mirror, 0, q, *lay, page_size=16, sm_scale=MODEL_SCALE)
    assert within_tolerance(compare(o_ref, lse_ref, r.output, r.lse))
    no_rope = q.copy()
    no_rope[..., RANK:] = 0.0
    o_bad, lse_bad = reference_prefill(mirror, 0, no_rope, *lay, page_size=16,
                                       sm_scale=MODEL_SCALE)
    assert not within_tolerance(compare(o_bad, lse_bad, r.output, r.lse))
    o_def, lse_def = reference_prefill(mirror, 0, q, *lay, page_size=16)   # 1/sqrt(80)
    assert not within_tolerance(compare(o_def, lse_def, r.output, r.lse))
    client.free_pages(pages)


def test_decode_one_row_per_sequence(client):
    g = client.server_info
    rng = np.random.default_rng(3)
    mirror = KvMirror.for_server(g)
    pages = client.allocate_pages(10)
    fill(client, mirror, rng, 1, pages)
    lens = [(1, n) for n in (1, 16, 17, 70, 160, 33)]
    q, qo, kv, idx, last = ragged(rng, g, pages, lens)
    r = client.prefill(1, torch.from_numpy(q).to(torch.bfloat16), qo, kv, idx, last,
                       sm_scale=MODEL_SCALE)
    assert isinstance(r.output, torch.Tensor) and tuple(r.output.shape) == (6, HEADS, DV)
    ref = reference_prefill(mirror, 1, q, qo, kv, idx, last, page_size=16, sm_scale=MODEL_SCALE)
    assert within_tolerance(compare(*ref, r.output, r.lse))
    client.free_pages(pages)


def test_fused_append_takes_latent_rows_alone(client):
    g = client.server_info
    rng = np.random.default_rng(4)
    mirror = KvMirror.for_server(g)
    pages = client.allocate_pages(3)
    fill(client, mirror, rng, 0, pages[:2])
    new_slots = [pages[2] * g.page_size + i for i in range(9)]
    rows = latent_rows(rng, 9)
    q = rng.standard_normal((9, HEADS, QK)).astype(np.float32)
    r = client.prefill(0, q, [0, 9], [0, 3], pages, [9], append_slots=new_slots, append_k=rows,
                       sm_scale=MODEL_SCALE)
    mirror.write(0, new_slots, rows)
    ref = reference_prefill(mirror, 0, q, [0, 9], [0, 3], pages, [9], page_size=16,
                            sm_scale=MODEL_SCALE)
    assert within_tolerance(compare(*ref, r.output, r.lse))
    k, v = client.read_kv(0, new_slots)
    assert v is None and np.array_equal(k, as_float64(rows).astype(np.float32))
    client.free_pages(pages)


def test_server_plans_with_latent_appends(client):
    g = client.server_info
    rng = np.random.default_rng(9)
    mirror = KvMirror.for_server(g)
    pages = client.allocate_pages(6)
    for layer in range(g.num_layers):
        fill(client, mirror, rng, layer, pages[:5])
    q, qo, kv, idx, last = ragged(rng, g, pages[:5], [(3, 40), (1, 17), (6, 33)])
    append = [pages[5] * g.page_size + i for i in range(qo[-1])]
    plan_id = client.create_plan(qo, kv, idx, last, append)
    layout = attnserve.PrefillLayout.for_plan(plan_id, qo[-1], len(append), lse_base="e",
                                              sm_scale=MODEL_SCALE)
    for layer in range(g.num_layers):
        rows = latent_rows(rng, qo[-1])
        r = client.prefill_layout(layer, q, layout, rows)
        mirror.write(layer, append, rows)
        want = client.prefill(layer, q, qo, kv, idx, last, lse_base="e", sm_scale=MODEL_SCALE)
        assert np.array_equal(r.output, want.output) and np.array_equal(r.lse, want.lse)
        ref = reference_prefill(mirror, layer, q, qo, kv, idx, last, page_size=16,
                                lse_base="e", sm_scale=MODEL_SCALE)
        assert within_tolerance(compare(*ref, r.output, r.lse))
    client.release_plan(plan_id)
    client.free_pages(pages)


@pytest.mark.parametrize("options", [
    attnserve.AttentionOptions(window_left=20),
    attnserve.AttentionOptions(logits_soft_cap=5.0),
    attnserve.AttentionOptions(sinks=np.linspace(-2.0, 3.0, HEADS)),
])
def test_variants(client, options):
    g = client.server_info
    rng = np.random.default_rng(5)
    mirror = KvMirror.for_server(g)
    pages = client.allocate_pages(12)
    fill(client, mirror, rng, 0, pages)
    q, qo, kv, idx, last = ragged(rng, g, pages, EDGE_LENS)
    q *= 3.0   # logits large enough for the soft-cap to matter
    r = client.prefill(0, q, qo, kv, idx, last, options=options)
    ref = reference_prefill(mirror, 0, q, qo, kv, idx, last, page_size=16, options=options)
    assert within_tolerance(compare(*ref, r.output, r.lse))
    plain = reference_prefill(mirror, 0, q, qo, kv, idx, last, page_size=16)
    assert not within_tolerance(compare(*plain, r.output, r.lse))   # the variant matters
    client.free_pages(pages)


def test_split_kv_merged_by_lse(client):
    """A sequence's keys in two ranges (kv_keys_after on the first), each
    range's v_head_dim-wide states merged by MergeStates: the whole sequence's
    attention."""
    g = client.server_info
    rng = np.random.default_rng(6)
    mirror = KvMirror.for_server(g)
    pages = client.allocate_pages(5)
    fill(client, mirror, rng, 0, pages)
    q = rng.standard_normal((7, HEADS, QK)).astype(np.float32)
    # Whole: 80 keys over 5 pages. Ranges: pages 0-1 (32 keys, 48 after), pages 2-4.
    whole = reference_prefill(mirror, 0, q, [0, 7], [0, 5], pages, [16], page_size=16,
                              sm_scale=MODEL_SCALE)
    a = client.prefill(0, q, [0, 7], [0, 2], pages[:2], [16], kv_keys_after=[48],
                       sm_scale=MODEL_SCALE)
    b = client.prefill(0, q, [0, 7], [0, 3], pages[2:], [16], sm_scale=MODEL_SCALE)
    v, lse = client.merge_states([(a.output, a.lse), (b.output, b.lse)])
    assert v.shape == (7, HEADS, DV)
    assert within_tolerance(compare(*whole, v, lse))
    merged_ref = reference_merge([(a.output, a.lse), (b.output, b.lse)])
    assert within_tolerance(compare(*merged_ref, v, lse))
    client.free_pages(pages)


def test_regions_and_a_channel(client):
    g = client.server_info
    rng = np.random.default_rng(7)
    mirror = KvMirror.for_server(g)
    pages = client.allocate_pages(3)
    slots = slots_of(pages[:2], g.page_size)
    n, total_q = len(slots), 5
    q_shape, o_shape, lse_shape = (total_q, HEADS, QK), (total_q, HEADS, DV), (total_q, HEADS)
    bits = lambda shape: dt.float32_to_bf16_bits(rng.standard_normal(shape).astype(np.float32))
    with attnserve.SharedMemoryRegion(1 << 20) as region:
        region.register(client, "mla-io")
        region.array(0, (n, 1, QK), "bf16")[...] = rows = bits((n, 1, QK))
        client.write_kv(0, slots, region.tensor(0, (n, 1, QK), "bf16"))
        mirror.write(0, slots, rows)
        q_at, ak_at, o_at, lse_at, back_at = 65536, 131072, 196608, 262144, 327680
        region.array(q_at, q_shape, "bf16")[...] = q = bits(q_shape)
        region.array(ak_at, (2, 1, QK), "bf16")[...] = ak = bits((2, 1, QK))
        append = [pages[2] * g.page_size, pages[2] * g.page_size + 1]
        lay = ([0, 2, 5], [0, 1, 3], [pages[0], pages[1], pages[2]], [16, 2])
        r = client.prefill(0, region.tensor(q_at, q_shape, "bf16"), *lay, append_slots=append,
                           append_k=region.tensor(ak_at, (2, 1, QK), "bf16"),
                           output_to=(region.tensor(o_at, o_shape, "bf16"),
                                      region.tensor(lse_at, lse_shape, "fp32")))
        assert r.output is None
        mirror.write(0, append, ak)
        o = dt.bf16_bits_to_float32(region.array(o_at, o_shape, "bf16").copy()).reshape(o_shape)
        lse = region.array(lse_at, lse_shape, "fp32").copy()
        ref = reference_prefill(mirror, 0, q, *lay, page_size=16)
        assert within_tolerance(compare(*ref, o, lse))
        assert client.read_kv(0, append, into=region.tensor(back_at, (2, 1, QK), "bf16")) is None
        assert np.array_equal(region.array(back_at, (2, 1, QK), "bf16"), ak)
        # The same Prefill through a request channel (on a ring in the region).
        ch = client.open_channel(region, 524288, slot_count=2, slot_bytes=64 << 10)
        inline = client.prefill(0, attnserve.RawBits(q, "bf16"), *lay)
        via = ch.prefill(0, attnserve.RawBits(q, "bf16"), *lay)
        assert np.array_equal(via.output, inline.output) and np.array_equal(via.lse, inline.lse)
        assert via.output.shape == o_shape
        ch.close()
        region.close(client)
    client.free_pages(pages)


def test_asyncio_client(server):
    async def go():
        async with AsyncClient(server.address, timeout=60) as c:
            g = await c.info()
            rng = np.random.default_rng(8)
            mirror = KvMirror.for_server(g)
            pages = await c.allocate_pages(2)
            slots = slots_of(pages, g.page_size)
            rows = latent_rows(rng, len(slots))
            await c.write_kv(1, slots, rows)
            mirror.write(1, slots, rows)
            k, v = await c.read_kv(1, slots[:3])
            assert v is None and k.shape == (3, 1, QK)
            q = rng.standard_normal((3, HEADS, QK)).astype(np.float32)
            r = await c.prefill(1, q, [0, 3], [0, 2], pages, [16], sm_scale=MODEL_SCALE)
            ref = reference_prefill(mirror, 1, q, [0, 3], [0, 2], pages, [16], page_size=16,
                                    sm_scale=MODEL_SCALE)
            assert within_tolerance(compare(*ref, r.output, r.lse))
            with pytest.raises(ValueError, match="^v: the server computes multi-head latent"):
                await c.write_kv(1, slots, rows, rows)
            await c.free_pages(pages)
    asyncio.run(go())


@pytest.mark.parametrize("server_plans", [True, False])
def test_kv_manager_prefill_then_decode(client, server_plans):
    g = client.server_info
    rng = np.random.default_rng(10)
    mirror = KvMirror.for_server(g)
    free = client.info().free_pages
    with attnserve.KvManager(client, server_plans=server_plans, sm_scale=MODEL_SCALE) as mgr:
        lens = [19, 1, 40]
        for step in range(4):
            plan = mgr.plan([0, 1, 2], lens)
            for layer in range(g.num_layers):
                n = int(plan.qo_indptr[-1])
                q = rng.standard_normal((n, HEADS, QK)).astype(np.float32)
                rows = latent_rows(rng, n)
                r = mgr.run(layer, q, rows)
                mirror.write(layer, plan.append_slots, rows)
                ref = reference_prefill(mirror, layer, q, plan.qo_indptr, plan.kv_indptr,
                                        plan.kv_indices, plan.kv_last_page_len, page_size=16,
                                        sm_scale=MODEL_SCALE)
                assert within_tolerance(compare(*ref, r.output, r.lse)), (step, layer)
            lens = [1, 1, 1]
        with pytest.raises(ValueError, match="^append_v: the server computes multi-head"):
            plan = mgr.plan([0], [1])
            mgr.run(0, q[:1], rows[:1], rows[:1])
    assert client.info().free_pages == free


def test_cluster_spreads_a_sequence_over_two_mla_servers():
    servers = [mla_server(page_size=1, num_pages=1024) for _ in range(2)]
    try:
        with attnserve.Cluster([s.address for s in servers], split_min_tokens=24,
                               sm_scale=MODEL_SCALE, timeout=120) as c:
            g = c.server_info
            rng = np.random.default_rng(11)
            mirror, base = KvMirror.for_server(g), {1: 0, 2: 100_000}
            step = c.plan([1, 2], [37, 5])
            assert len(c.shards_of(1)) == 2 and len(c.shards_of(2)) == 1
            for s in range(3):
                for layer in range(g.num_layers):
                    n = step.total_q
                    q = rng.standard_normal((n, HEADS, QK)).astype(np.float32)
                    rows = latent_rows(rng, n)
                    slots = [base[sid] + int(step.kv_lens[b]) - int(step.q_lens[b]) + i
                             for b, sid in enumerate(step.seq_ids)
                             for i in range(int(step.q_lens[b]))]
                    mirror.write(layer, slots, rows)
                    out = c.run(layer, q, rows)
                    assert out.output.shape == (n, HEADS, DV)
                    idx, kvp = [], [0]
                    for b, sid in enumerate(step.seq_ids):
                        idx += [base[sid] + p for p in range(int(step.kv_lens[b]))]
                        kvp.append(len(idx))
                    ref = reference_prefill(mirror, layer, q, step.qo_indptr, kvp, idx, None,
                                            page_size=1, sm_scale=MODEL_SCALE)
                    assert within_tolerance(compare(*ref, out.output, out.lse)), (s, layer)
                step = c.plan([2, 1], [1, 1])
            c.release()
    finally:
        for s in servers:
            s.stop()


def test_cluster_refuses_mixed_attention(server):
    with TestServer(num_pages=16) as gqa:
        with pytest.raises(ValueError, match="attention=gqa"):
            attnserve.Cluster([server.address, gqa.address], timeout=60)


def test_python_side_errors_name_the_argument(client):
    g = client.server_info
    rng = np.random.default_rng(12)
    pages = client.allocate_pages(1)
    slots = slots_of(pages, g.page_size)
    rows = latent_rows(rng, len(slots))
    with pytest.raises(ValueError, match=r"^v: the server computes multi-head latent attention "
                                         r"\(attention=mla\).*qk_head_dim=80"):
        client.write_kv(0, slots, rows, rows)
    q = rng.standard_normal((2, HEADS, QK)).astype(np.float32)
    with pytest.raises(ValueError, match="^append_v: the server computes multi-head latent"):
        client.prefill(0, q, [0, 2], [0, 1], pages, [2], append_slots=slots[:2],
                       append_k=rows[:2], append_v=rows[:2])
    with pytest.raises(ValueError, match="^append_k: the rows to write are missing"):
        client.prefill(0, q, [0, 2], [0, 1], pages, [2], append_slots=slots[:2],
                       append_v=rows[:2])
    with pytest.raises(ValueError, match="^into: a RegionTensor for the latent rows"):
        client.read_kv(0, slots, into=(None, None))
    client.free_pages(pages)


def test_gqa_server_python_side_errors():
    with TestServer(num_pages=16) as s, attnserve.Client(s.address, timeout=60) as c:
        pages = c.allocate_pages(1)
        k = np.random.default_rng(13).standard_normal((2, 2, 64)).astype(np.float32)
        with pytest.raises(ValueError, match=r"^v: missing; the server computes grouped-query "
                                             r"attention \(attention=gqa\)"):
            c.write_kv(0, [pages[0] * 16, pages[0] * 16 + 1], k)
        with pytest.raises(ValueError, match=r"^append_v: missing; the server computes grouped-"
                                             r"query attention \(attention=gqa\): append_k and "
                                             r"append_v go together"):
            c.prefill(0, np.ones((2, 8, 64), np.float32), [0, 2], [0, 1], pages, [2],
                      append_slots=[pages[0] * 16, pages[0] * 16 + 1], append_k=k)
        c.write_kv(0, [pages[0] * 16, pages[0] * 16 + 1], k, k)   # GQA as before
        c.free_pages(pages)


def _raw(client, method, request):
    return client._stubs[method](request.SerializeToString(), timeout=60)


def test_server_refuses_a_v_and_a_gqa_shaped_query(client):
    """The server's own checks, with the Python ones bypassed (raw requests)."""
    import grpc
    g = client.server_info
    pages = client.allocate_pages(1)
    rows = dt.float32_to_bf16_bits(np.random.default_rng(14).standard_normal(
        (2, 1, QK)).astype(np.float32))
    t = pb.Tensor(dtype=dt.DTYPE_BF16, shape=[2, 1, QK], data=rows.tobytes())
    slots = [pages[0] * g.page_size, pages[0] * g.page_size + 1]
    with pytest.raises(grpc.RpcError) as e:
        _raw(client, "WriteKV", pb.WriteKVRequest(layer=0, slots=slots, k=t, v=t))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "v" in e.value.details()
    # A GQA-shaped query (head_dim 64) on the MLA server.
    q = dt.float32_to_bf16_bits(np.ones((2, HEADS, 64), np.float32))
    with pytest.raises(attnserve.InvalidArgument, match="q"):
        client.prefill(0, attnserve.RawBits(q, "bf16"), [0, 2], [0, 1], pages, [2])
    # ReadKV with a v_region on an MLA server (both in a registered region).
    with attnserve.SharedMemoryRegion(1 << 16) as region:
        region.register(client, "mla-read")
        with pytest.raises(grpc.RpcError) as e:
            _raw(client, "ReadKV", pb.ReadKVRequest(
                layer=0, slots=slots,
                k_region=pb.RegionRef(name="mla-read", offset=0, byte_size=2 * QK * 2),
                v_region=pb.RegionRef(name="mla-read", offset=4096, byte_size=2 * QK * 2)))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "v_region" in e.value.details()
        region.close(client)
    assert client.health() == "SERVING"
    client.free_pages(pages)


def test_gqa_server_refuses_a_missing_v():
    import grpc
    with TestServer(num_pages=16) as s, attnserve.Client(s.address, timeout=60) as c:
        pages = c.allocate_pages(1)
        k = dt.float32_to_bf16_bits(np.ones((2, 2, 64), np.float32))
        t = pb.Tensor(dtype=dt.DTYPE_BF16, shape=[2, 2, 64], data=k.tobytes())
        with pytest.raises(grpc.RpcError) as e:
            _raw(c, "WriteKV", pb.WriteKVRequest(layer=0, slots=[pages[0] * 16,
                                                                pages[0] * 16 + 1], k=t))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "v" in e.value.details()


@pytest.mark.parametrize("transport", ["grpc", "shm", "channel"])
def test_flashinfer_mla_wrapper(client, transport):
    """attnserve.flashinfer's BatchMLAPagedAttentionWrapper with FlashInfer's
    plan()/run() and append_paged_mla_kv_cache: a prefill of two prompts,
    then decode steps, each against the reference."""
    import attnserve.flashinfer as fi
    g = client.server_info
    rng = np.random.default_rng(15)
    mirror = KvMirror.for_server(g)
    bf16 = torch.bfloat16
    with fi.PagedKVCache(client, max_num_pages=8, transport=transport) as kv_cache:
        wrapper = fi.BatchMLAPagedAttentionWrapper(kv_cache)
        pages_of = [[0, 3], [5, 1, 2]]           # page indices into the cache
        kv_lens = [0, 0]
        for step, q_lens in enumerate([[13, 33], [1, 1], [2, 1]]):
            kv_lens = [a + b for a, b in zip(kv_lens, q_lens)]
            qo = torch.tensor([0, q_lens[0], sum(q_lens)], dtype=torch.int32)
            kv_indptr = torch.tensor([0, -(-kv_lens[0] // 16), -(-kv_lens[0] // 16)
                                      + -(-kv_lens[1] // 16)], dtype=torch.int32)
            kv_indices = torch.tensor([p for b in range(2)
                                       for p in pages_of[b][:-(-kv_lens[b] // 16)]],
                                      dtype=torch.int32)
            kv_len_arr = torch.tensor(kv_lens, dtype=torch.int32)
            wrapper.plan(qo, kv_indptr, kv_indices, kv_len_arr, HEADS, RANK, ROPE, 16, True,
                         MODEL_SCALE, bf16, bf16)
            n = sum(q_lens)
            batch_indices = torch.tensor([b for b in range(2) for _ in range(q_lens[b])])
            positions = torch.tensor([kv_lens[b] - q_lens[b] + i for b in range(2)
                                      for i in range(q_lens[b])])
            last = torch.tensor([k - (-(-k // 16) - 1) * 16 for k in kv_lens], dtype=torch.int32)
            for layer in range(g.num_layers):
                rows = torch.from_numpy(latent_rows(rng, n)).to(bf16)
                fi.append_paged_mla_kv_cache(rows[:, 0, :RANK], rows[:, 0, RANK:], batch_indices,
                                             positions, kv_cache[layer], kv_cache[layer],
                                             kv_indices, kv_indptr, last)
                slots = [int(kv_cache.page_ids[pages_of[b][p // 16]]) * 16 + p % 16
                         for b, p in zip(batch_indices.tolist(), positions.tolist())]
                mirror.write(layer, slots, rows)
                q = torch.from_numpy(rng.standard_normal((n, HEADS, QK)).astype(np.float32)
                                     ).to(bf16)
                out = torch.full((n, HEADS, RANK), float("nan"), dtype=bf16)   # poisoned
                o, lse = wrapper.run(q[..., :RANK], q[..., RANK:], kv_cache[layer],
                                     kv_cache[layer], out=out, return_lse=True)
                assert o is out and tuple(lse.shape) == (n, HEADS)
                server_pages = kv_cache.page_ids[kv_indices.numpy()]
                ref = reference_prefill(mirror, layer, q, qo, kv_indptr, server_pages, last,
                                        page_size=16, sm_scale=MODEL_SCALE)
                assert within_tolerance(compare(*ref, o, lse)), (transport, step, layer)
                o_e, lse_e = wrapper.run(q[..., :RANK], q[..., RANK:], kv_cache[layer],
                                         kv_cache[layer], return_lse=True,
                                         return_lse_base_on_e=True)
                assert torch.equal(o_e, o)
                assert np.allclose(lse_e.numpy(), lse.numpy() * np.log(2.0), atol=1e-5)
                # run_return_lse (ours, as the GQA wrappers'); o_scale is FlashInfer's
                # 12th positional argument, the scale of an FP8 output: 1.0 is none.
                o_r, lse_r = wrapper.run_return_lse(q[..., :RANK], q[..., RANK:],
                                                    kv_cache[layer], kv_cache[layer])
                assert torch.equal(o_r, o) and torch.equal(lse_r, lse)
                o_s = wrapper.run(q[..., :RANK], q[..., RANK:], kv_cache[layer],
                                  kv_cache[layer], None, None, False, None, None, None, False,
                                  1.0, ckv_scale=1.0, kpe_scale=1.0)
                assert torch.equal(o_s, o)
        # Pages past a request's ceil(kv_len / page_size) are not read, as in
        # FlashInfer: request 0 (16 tokens) given both its pages answers the same.
        qo1 = torch.tensor([0, 1, 2], dtype=torch.int32)
        q1 = torch.from_numpy(rng.standard_normal((2, HEADS, QK)).astype(np.float32)).to(bf16)
        answers = []
        for indptr, indices in ((kv_indptr, kv_indices),
                                (torch.tensor([0, 2, 5], dtype=torch.int32),
                                 torch.tensor(pages_of[0] + pages_of[1], dtype=torch.int32))):
            wrapper.plan(qo1, indptr, indices, kv_len_arr, HEADS, RANK, ROPE, 16, True,
                         MODEL_SCALE, bf16, bf16)
            answers.append(wrapper.run(q1[..., :RANK], q1[..., RANK:], kv_cache[0], kv_cache[0]))
        assert kv_lens == [16, 35] and torch.equal(answers[0], answers[1])
        # Spare pages with kv_indptr offset into a longer kv_indices buffer.
        wrapper.plan(qo1, torch.tensor([1, 3, 6], dtype=torch.int32),
                     torch.tensor([7] + pages_of[0] + pages_of[1] + [6, 4], dtype=torch.int32),
                     kv_len_arr, HEADS, RANK, ROPE, 16, True, MODEL_SCALE, bf16, bf16)
        assert torch.equal(wrapper.run(q1[..., :RANK], q1[..., RANK:], kv_cache[0], kv_cache[0]),
                           answers[0])
        with pytest.raises(ValueError, match=r"request 1 has 2 pages in kv_indptr for "
                                             r"kv_len_arr\[1\]=35: it needs ceil"):
            wrapper.plan(qo1, torch.tensor([0, 1, 3], dtype=torch.int32), kv_indices[:3],
                         kv_len_arr, HEADS, RANK, ROPE, 16, True, MODEL_SCALE, bf16, bf16)
        # Causal rows must already be in the cache (docs/flashinfer.md).
        with pytest.raises(ValueError, match=r"^request 0 has 17 query rows but kv_len_arr\[0\]=16: "
                                             r"causal rows must already be in the cache"):
            wrapper.plan(torch.tensor([0, 17, 18], dtype=torch.int32), kv_indptr, kv_indices,
                         kv_len_arr, HEADS, RANK, ROPE, 16, True, MODEL_SCALE, bf16, bf16)
        with pytest.raises(NotImplementedError, match=r"ckv_scale=0\.5 \(the server applies its "
                                                      r"cache's own KV scales"):
            wrapper.run(q[..., :RANK], q[..., RANK:], kv_cache[0], kv_cache[0], ckv_scale=0.5)
        for o_scale in (0.5, float("nan")):
            with pytest.raises(NotImplementedError, match=rf"o_scale={o_scale} \(the scale of an "
                                                          "FP8 output"):
                wrapper.run(q[..., :RANK], q[..., RANK:], kv_cache[0], kv_cache[0],
                            o_scale=o_scale)
        with pytest.raises(ValueError, match="head_dim_ckv=512, but the server's KV cache has "
                                             "64"):
            wrapper.plan(qo, kv_indptr, kv_indices, kv_len_arr, HEADS, 512, ROPE, 16, True,
                         MODEL_SCALE, bf16, bf16)
        with pytest.raises(ValueError, match="use BatchMLAPagedAttentionWrapper"):
            fi.BatchDecodeWithPagedKVCacheWrapper(kv_cache)
        with pytest.raises(ValueError, match="use append_paged_mla_kv_cache"):
            fi.append_paged_kv_cache(rows, rows, batch_indices, positions, kv_cache[0],
                                     kv_indices, kv_indptr, last)
