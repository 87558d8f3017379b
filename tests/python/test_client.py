"""Every method of attnserve.Client against a real CPU server.

Numerics are checked against attnserve.reference (float64 numpy) on random
data with docs/design.md's tolerances; KV round trips bit for bit.
"""

import numpy as np
import pytest
import torch

import attnserve
from attnserve import dtypes as dt
from attnserve.reference import (KvMirror, as_float64, compare, reference_merge,
                                 reference_prefill, within_tolerance)
from server import TestServer


def slots_of(pages, page_size):
    return [p * page_size + i for p in pages for i in range(page_size)]


def fill(client, mirror, rng, layer, pages):
    """Random K/V in every slot of pages; returns the slots."""
    g = client.server_info
    slots = slots_of(pages, g.page_size)
    k = rng.standard_normal((len(slots), g.num_kv_heads, g.head_dim)).astype(np.float32)
    v = rng.standard_normal((len(slots), g.num_kv_heads, g.head_dim)).astype(np.float32)
    client.write_kv(layer, slots, k, v)
    mirror.write(layer, slots, k, v)
    return slots


def ragged(rng, g, pages, lens):
    """Layout of sequences with (q_len, kv_len) each, pages drawn from `pages`."""
    qo, kv, idx, last = [0], [0], [], []
    for q_len, kv_len in lens:
        n = -(-kv_len // g.page_size)
        idx += [int(pages[i]) for i in rng.integers(0, len(pages), n)]
        qo.append(qo[-1] + q_len)
        kv.append(kv[-1] + n)
        last.append(kv_len - (n - 1) * g.page_size if n else 0)
    q = rng.standard_normal((qo[-1], g.num_qo_heads, g.head_dim)).astype(np.float32)
    return q, qo, kv, idx, last


# Every edge the layout has: no query rows, no KV, neither, more rows than KV
# (rows that see nothing), an exactly full last page, a decode row, random.
EDGE_LENS = [(0, 40), (5, 0), (0, 0), (30, 25), (7, 32), (1, 77), (12, 150), (33, 61)]


def test_info_health_and_pages(client):
    info = client.info()
    assert (info.backend, info.num_layers, info.page_size) == ("cpu", 2, 16)
    assert (info.num_qo_heads, info.num_kv_heads, info.head_dim, info.kv_dtype) == (8, 2, 64,
                                                                                  "bf16")
    assert info.incarnation != 0 and client.incarnation == info.incarnation
    assert info.max_message_bytes == 512 << 20
    assert client.health() == "SERVING"
    assert client.health("attnserve.v1.AttentionService") == "SERVING"
    with pytest.raises(attnserve.NotFound):  # gRPC's health service: unknown name
        client.health("no.such.Service")
    free = info.free_pages
    pages = client.allocate_pages(5)
    assert len(set(pages)) == 5 and all(0 <= p < info.num_pages for p in pages)
    assert client.info().free_pages == free - 5
    client.free_pages(pages)
    assert client.info().free_pages == free


def test_write_read_round_trip_bit_exact(client):
    g = client.server_info
    rng = np.random.default_rng(1)
    pages = client.allocate_pages(2)
    slots = slots_of(pages, g.page_size)[5:27]
    k = rng.integers(0, 1 << 16, (len(slots), 2, 64), dtype=np.uint16)
    k[k & 0x7F80 == 0x7F80] = 0x3F80  # no NaN / inf patterns: they need not round-trip
    v = dt.float32_to_bf16_bits(rng.standard_normal((len(slots), 2, 64)))
    client.write_kv(1, slots, attnserve.RawBits(k, "bf16"), attnserve.RawBits(v, "bf16"))
    rk, rv = client.read_kv(1, slots, out="raw")
    assert np.array_equal(rk, k) and np.array_equal(rv, v)
    fk, _ = client.read_kv(1, slots)                     # numpy: bf16 widened to float32
    assert fk.dtype == np.float32 and np.array_equal(fk, dt.bf16_bits_to_float32(k))
    tk, tv = client.read_kv(1, slots, out="torch")
    assert tk.dtype == torch.bfloat16 and tuple(tk.shape) == (len(slots), 2, 64)
    assert np.array_equal(tv.view(torch.int16).numpy().view(np.uint16), v)
    client.free_pages(pages)


@pytest.mark.parametrize("causal,lse_base,sm_scale", [(True, "2", None), (False, "e", 0.07),
                                                      (True, "e", 0.2)])
def test_prefill_matches_float64_reference(client, causal, lse_base, sm_scale):
    g = client.server_info
    rng = np.random.default_rng(2)
    mirror = KvMirror(g.num_kv_heads, g.head_dim)
    pages = client.allocate_pages(12)
    for layer in range(g.num_layers):
        fill(client, mirror, rng, layer, pages)
    for layer in range(g.num_layers):
        q, qo, kv, idx, last = ragged(rng, g, pages, EDGE_LENS)
        r = client.prefill(layer, q, qo, kv, idx, last, causal=causal, lse_base=lse_base,
                           sm_scale=sm_scale)
        assert r.output.shape == (qo[-1], 8, 64) and r.lse.shape == (qo[-1], 8)
        assert r.incarnation == client.incarnation
        o_ref, lse_ref = reference_prefill(mirror, layer, q, qo, kv, idx, last,
                                           page_size=g.page_size, causal=causal,
                                           sm_scale=sm_scale, lse_base=lse_base)
        c = compare(o_ref, lse_ref, r.output, r.lse)
        assert within_tolerance(c), c
        # Rows that see nothing: output exactly 0, LSE -inf (and some exist).
        blind = np.isneginf(lse_ref)
        assert blind.any()
        assert np.all(r.output[blind] == 0) and np.all(np.isneginf(r.lse[blind]))
    client.free_pages(pages)


def test_prefill_fused_append(client):
    g = client.server_info
    rng = np.random.default_rng(3)
    mirror = KvMirror(g.num_kv_heads, g.head_dim)
    pages = client.allocate_pages(3)
    fill(client, mirror, rng, 0, pages[:2])
    # Sequence of 32 + 9 tokens: 9 new rows go to page 2, slots 0..8.
    new_slots = [pages[2] * g.page_size + i for i in range(9)]
    k = rng.standard_normal((9, 2, 64)).astype(np.float32)
    v = rng.standard_normal((9, 2, 64)).astype(np.float32)
    q = rng.standard_normal((9, 8, 64)).astype(np.float32)
    r = client.prefill(0, q, [0, 9], [0, 3], pages, [9], append_slots=new_slots, append_k=k,
                       append_v=v)
    mirror.write(0, new_slots, k, v)
    o_ref, lse_ref = reference_prefill(mirror, 0, q, [0, 9], [0, 3], pages, [9], page_size=16)
    assert within_tolerance(compare(o_ref, lse_ref, r.output, r.lse))
    rk, rv = client.read_kv(0, new_slots)
    assert np.array_equal(rk, as_float64(k).astype(np.float32))
    assert np.array_equal(rv, as_float64(v).astype(np.float32))
    client.free_pages(pages)


def test_server_plans(client):
    """A layout registered once (create_plan) and named by every layer's
    Prefill gives what the layout itself gives."""
    g = client.server_info
    rng = np.random.default_rng(9)
    mirror = KvMirror(g.num_kv_heads, g.head_dim)
    pages = client.allocate_pages(6)
    for layer in range(g.num_layers):
        fill(client, mirror, rng, layer, pages[:5])
    q_lens_kv = [(3, 40), (1, 17), (6, 33)]
    q, qo, kv, idx, last = ragged(rng, g, pages[:5], q_lens_kv)
    append = [pages[5] * g.page_size + i for i in range(qo[-1])]
    plan_id = client.create_plan(qo, kv, idx, last, append)
    assert plan_id != 0
    layout = attnserve.PrefillLayout.for_plan(plan_id, qo[-1], len(append), lse_base="e")
    for layer in range(g.num_layers):
        k = rng.standard_normal((qo[-1], 2, 64)).astype(np.float32)
        v = rng.standard_normal((qo[-1], 2, 64)).astype(np.float32)
        r = client.prefill_layout(layer, q, layout, k, v)
        mirror.write(layer, append, k, v)
        want = client.prefill(layer, q, qo, kv, idx, last, lse_base="e")
        assert np.array_equal(r.output, want.output) and np.array_equal(r.lse, want.lse)
        ref = reference_prefill(mirror, layer, q, qo, kv, idx, last, page_size=16,
                                lse_base="e")
        assert within_tolerance(compare(*ref, r.output, r.lse))
    with pytest.raises(attnserve.FailedPrecondition):   # pinned while the plan lives
        client.free_pages(pages)
    client.release_plan(plan_id)
    client.free_pages(pages)
    with pytest.raises(attnserve.NotFound):
        client.release_plan(plan_id)


def test_torch_in_torch_out(client):
    g = client.server_info
    rng = np.random.default_rng(4)
    mirror = KvMirror(g.num_kv_heads, g.head_dim)
    pages = client.allocate_pages(4)
    slots = slots_of(pages, g.page_size)
    k = torch.from_numpy(rng.standard_normal((len(slots), 2, 64)).astype(np.float32))
    v = torch.from_numpy(rng.standard_normal((len(slots), 2, 64)).astype(np.float32))
    client.write_kv(0, slots, k.to(torch.bfloat16), v.to(torch.float16))  # fp16 -> bf16 by torch
    mirror.write(0, slots, k.to(torch.bfloat16), v.to(torch.float16).to(torch.bfloat16))
    q = torch.from_numpy(rng.standard_normal((20, 8, 64)).astype(np.float32)).to(torch.bfloat16)
    lay = ([0, 20], [0, 4], pages, [16])
    r = client.prefill(0, q, *lay)
    assert isinstance(r.output, torch.Tensor) and r.output.dtype == torch.bfloat16
    assert r.lse.dtype == torch.float32 and tuple(r.lse.shape) == (20, 8)
    o_ref, lse_ref = reference_prefill(mirror, 0, q, *lay, page_size=16)
    assert within_tolerance(compare(o_ref, lse_ref, r.output, r.lse))
    # The same query as numpy float32 asks for numpy; out= overrides either way.
    r_np = client.prefill(0, q.float().numpy(), *lay)
    assert isinstance(r_np.output, np.ndarray) and r_np.output.dtype == np.float32
    assert np.array_equal(r_np.output, r.output.float().numpy())
    r_t = client.prefill(0, q.float().numpy(), *lay, out="torch")
    assert torch.equal(r_t.output, r.output)
    client.free_pages(pages)


def test_merge_states_matches_reference(server, client):
    merges = 'attnserve_kernel_launches_total{kernel="merge"}'
    merges_before = server.metric(merges)
    rng = np.random.default_rng(5)
    n, h, d = 6, 8, 64
    states = []
    for s in range(3):
        v = rng.standard_normal((n, h, d)).astype(np.float32)
        lse = (rng.standard_normal((n, h)) * 3).astype(np.float32)
        states.append((v, lse))
    states[1][1][2, :] = -np.inf          # a state that contributes nothing to row 2
    for s in states:                      # row 4 sees nothing anywhere
        s[1][4, 3] = -np.inf
    for base in ("2", "e"):
        v, lse = client.merge_states(states, lse_base=base)
        v_ref, lse_ref = reference_merge(states, lse_base=base)
        c = compare(v_ref, lse_ref, v, lse)
        assert within_tolerance(c), c
        assert v[4, 3].tolist() == [0.0] * d and np.isneginf(lse[4, 3])
    tv, tl = client.merge_states([(torch.from_numpy(v).to(torch.bfloat16), torch.from_numpy(l))
                                  for v, l in states])
    assert tv.dtype == torch.bfloat16
    assert np.array_equal(tv.float().numpy(), client.merge_states(states)[0])
    # Each MergeStates is one `merge` launch in the kernel metrics.
    assert server.metric(merges) == merges_before + 4


def heavy_prefill_args(client, pages):
    """A Prefill that takes the CPU server far more than a millisecond: 4096
    query rows over 64 pages of keys, 2 GFLOP and 4 MiB of queries."""
    g = client.server_info
    q = np.random.default_rng(8).standard_normal((4096, g.num_qo_heads, g.head_dim))
    return (0, q.astype(np.float32), [0, 4096], [0, len(pages)], pages, [16])


def test_deadline_and_unavailable(client):
    pages = client.allocate_pages(64)
    with pytest.raises(attnserve.DeadlineExceeded) as e:
        client.prefill(*heavy_prefill_args(client, pages), causal=False, timeout=0.001)
    assert e.value.code.name == "DEADLINE_EXCEEDED"
    client.free_pages(pages)
    with pytest.raises(attnserve.Unavailable):
        attnserve.Client("127.0.0.1:1", timeout=5)


def test_fp16_server():
    with TestServer(kv_dtype="fp16", num_layers=1, num_pages=16) as server:
        with attnserve.Client(server.address, timeout=60) as c:
            g = c.server_info
            assert g.kv_dtype == "fp16"
            rng = np.random.default_rng(6)
            mirror = KvMirror(g.num_kv_heads, g.head_dim, dt.DTYPE_FP16)
            pages = c.allocate_pages(3)
            fill(c, mirror, rng, 0, pages)
            q, qo, kv, idx, last = ragged(rng, g, pages, [(4, 40), (1, 48), (6, 3)])
            r = c.prefill(0, q.astype(np.float16), qo, kv, idx, last)
            assert r.output.dtype == np.float16
            o_ref, lse_ref = reference_prefill(mirror, 0, q.astype(np.float16), qo, kv, idx,
                                               last, page_size=16)
            assert within_tolerance(compare(o_ref, lse_ref, r.output.astype(np.float64), r.lse))
            rt = c.prefill(0, torch.from_numpy(q).half(), qo, kv, idx, last)
            assert rt.output.dtype == torch.float16
            assert np.array_equal(rt.output.numpy(), r.output)


def test_large_message(client):
    """A 16 MiB query: past gRPC's 4 MiB default, inside the client's 512 MiB."""
    g = client.server_info
    rng = np.random.default_rng(7)
    mirror = KvMirror(g.num_kv_heads, g.head_dim)
    pages = client.allocate_pages(1)
    fill(client, mirror, rng, 0, pages)
    rows = (16 << 20) // (g.num_qo_heads * g.head_dim * 2)
    q = rng.standard_normal((rows, g.num_qo_heads, g.head_dim)).astype(np.float32)
    r = client.prefill(0, q, [0, rows], [0, 1], pages, [16], causal=False)
    assert r.output.shape == (rows, 8, 64)
    # Without the mask every row attends alike: check a few against the reference.
    pick = rng.integers(0, rows, 8)
    o_ref, lse_ref = reference_prefill(mirror, 0, q[pick], [0, 8], [0, 1], pages, [16],
                                       page_size=16, causal=False)
    assert within_tolerance(compare(o_ref, lse_ref, r.output[pick], r.lse[pick]))
    client.free_pages(pages)


def test_connect_names_the_cause_at_once(server):
    """A cause gRPC names fails the constructor at once, though connect_timeout
    allows ten minutes (a client that waited anyway would fail the test by
    its timeout, not by a timing bound here)."""
    import socket
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cases = [
        (f"127.0.0.1:{port}", f"connection refused: nothing listens on 127.0.0.1:{port}"),
        ("no-such-host.invalid:50051", "cannot resolve the host of no-such-host.invalid:50051"),
        (server.metrics_address, f"{server.metrics_address} answers HTTP/1, not gRPC: is it "
                                 "attnserve's metrics port"),
    ]
    for target, says in cases:
        with pytest.raises(attnserve.Unavailable) as e:
            attnserve.Client(target, connect_timeout=600)
        assert says in e.value.details, e.value.details
    with pytest.raises(attnserve.Unavailable) as e:  # health names it too
        attnserve.Client(f"127.0.0.1:{port}", fetch_info=False).health()
    assert "connection refused" in e.value.details


def test_connect_waits_for_an_address_that_answers_nothing():
    """A port that accepts TCP connections and never speaks (a server not
    ready, a stuck process) is waited for until connect_timeout."""
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(8)  # the kernel completes the handshakes; nobody answers
        with pytest.raises(attnserve.Unavailable, match="within 0.5 s"):
            attnserve.Client(f"127.0.0.1:{s.getsockname()[1]}", connect_timeout=0.5)


def test_results_come_back_in_the_callers_dtype(client):
    g = client.server_info
    rng = np.random.default_rng(9)
    pages = client.allocate_pages(1)
    kv = rng.standard_normal((16, g.num_kv_heads, g.head_dim)).astype(np.float32)
    client.write_kv(0, slots_of(pages, g.page_size), kv, kv)
    q = rng.standard_normal((3, g.num_qo_heads, g.head_dim)).astype(np.float32)
    lay = ([0, 3], [0, 1], pages, [16])
    ref = client.prefill(0, q, *lay).output
    for x in (q.astype(np.float16), q, q.astype(np.float64)):
        out = client.prefill(0, x, *lay).output
        assert isinstance(out, np.ndarray) and out.dtype == x.dtype
    for t in (torch.from_numpy(q).half(), torch.from_numpy(q), torch.from_numpy(q).bfloat16()):
        out = client.prefill(0, t, *lay).output
        assert torch.is_tensor(out) and out.dtype == t.dtype
    # An fp16 query on this bf16 server: fp16 back, the server's bf16 values exactly.
    half = client.prefill(0, torch.from_numpy(q).half(), *lay).output
    wire = client.prefill(0, torch.from_numpy(q).half(), *lay, out="raw").output
    assert torch.equal(half, torch.from_numpy(attnserve.bf16_bits_to_float32(wire)).half())
    # Bit patterns: only as RawBits; a bare uint16 array is refused, naming RawBits.
    bits = attnserve.float32_to_bf16_bits(q)
    raw = client.prefill(0, attnserve.RawBits(bits, "bf16"), *lay).output
    assert raw.dtype == np.uint16 and np.array_equal(raw, attnserve.float32_to_bf16_bits(ref))
    with pytest.raises(TypeError, match=r"q: numpy uint16 holds integers.*RawBits"):
        client.prefill(0, bits, *lay)
    with pytest.raises(TypeError, match="RawBits of fp16, but the server takes bf16 values here"):
        client.prefill(0, attnserve.RawBits(bits, "fp16"), *lay)
    v, _ = client.merge_states([(q.astype(np.float16), np.zeros((3, g.num_qo_heads), np.float32))])
    assert v.dtype == np.float16
    client.free_pages(pages)


def test_a_request_over_max_message_bytes_names_it(server):
    with attnserve.Client(server.address, max_message_bytes=4096, timeout=60) as c:
        g = c.server_info
        rows = (2 << 20) // (g.num_qo_heads * g.head_dim * 2)  # 2 MiB: past 4 KiB + 1 MiB
        q = np.zeros((rows, g.num_qo_heads, g.head_dim), np.float32)
        with pytest.raises(attnserve.ResourceExhausted) as e:
            c.prefill(0, q, [0, rows], [0, 0], [], [])
        assert "more than this client's max_message_bytes allows" in e.value.details
        assert "shared-memory region" in e.value.details
        assert "Sent message larger than max" not in e.value.details
