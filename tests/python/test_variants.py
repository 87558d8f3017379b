"""Attention variants through the Python client (docs/design.md, "Variants";
docs/python.md): attnserve.AttentionOptions in prefill (sinks from lists,
numpy and torch), in plans for every layer and per layer, in the KV manager
(with and without server plans) and in the cluster, where a sequence spread
over servers takes its sinks on exactly one of them; bad values refused
naming the field. All against attnserve.reference (float64) on random data.
The merges that must count a sink once are also broken on purpose, to show
the comparison would notice."""

import math
import re

import numpy as np
import pytest
import torch

import attnserve
from attnserve import _cluster_placement as placement_mod
from attnserve.merge import merge_states
from attnserve.reference import (KvMirror, compare, reference_merge, reference_prefill,
                                 within_tolerance)
from test_client import fill, ragged
from test_cluster import Reference, start, stop


def sinks_for(rng, hq, kind):
    if kind == "-inf":
        return np.full(hq, -np.inf, np.float32)
    if kind == "zero":
        return np.zeros(hq, np.float32)
    if kind == "large":
        return np.full(hq, 20.0, np.float32)
    s = rng.normal(1.0, 1.0, hq).astype(np.float32)
    s[0] = -np.inf
    return s


OPTION_CASES = [
    dict(window_left=0),
    dict(window_left=1),
    dict(window_left=15),            # a page of keys
    dict(window_left=127),           # a kernel block of keys
    dict(window_left=10_000),        # larger than any sequence
    dict(logits_soft_cap=1.0),
    dict(logits_soft_cap=50.0, window_left=20),
    dict(sinks="-inf"),
    dict(sinks="zero"),
    dict(sinks="large", window_left=4),
    dict(sinks="mixed", logits_soft_cap=5.0, window_left=30),
]


@pytest.mark.parametrize("case", OPTION_CASES, ids=lambda c: "-".join(f"{k}={v}" for k, v in
                                                                     c.items()))
@pytest.mark.parametrize("causal", [True, False])
def test_prefill_options_match_the_reference(client, case, causal):
    g = client.server_info
    rng = np.random.default_rng(abs(hash((str(case), causal))) % 2**32)
    pages = client.allocate_pages(24)
    try:
        mirror = KvMirror(g.num_kv_heads, g.head_dim)
        fill(client, mirror, rng, 0, pages)
        q, qo, kv, idx, last = ragged(rng, g, pages, [(30, 25), (7, 32), (1, 77), (12, 150),
                                                      (5, 0)])
        kw = dict(case)
        if "sinks" in kw:
            kw["sinks"] = sinks_for(rng, g.num_qo_heads, kw["sinks"])
        options = attnserve.AttentionOptions(**kw)
        after = [0, 3, 0, 40, 0]
        scale = -0.2 if "logits_soft_cap" in kw else None  # a soft-cap with a negative scale
        r = client.prefill(0, q, qo, kv, idx, last, causal=causal, kv_keys_after=after,
                           sm_scale=scale, options=options)
        o_ref, lse_ref = reference_prefill(mirror, 0, q, qo, kv, idx, last,
                                           page_size=g.page_size, causal=causal,
                                           sm_scale=scale, kv_keys_after=after, options=options)
        c = compare(o_ref, lse_ref, r.output, r.lse)
        assert within_tolerance(c), c
    finally:
        client.free_pages(pages)


def test_sinks_from_numpy_torch_and_lists_and_apply_sinks(client):
    g = client.server_info
    rng = np.random.default_rng(2)
    pages = client.allocate_pages(8)
    try:
        mirror = KvMirror(g.num_kv_heads, g.head_dim)
        fill(client, mirror, rng, 1, pages)
        q, qo, kv, idx, last = ragged(rng, g, pages, [(9, 40), (3, 2), (4, 60)])
        sinks = rng.normal(0.0, 2.0, g.num_qo_heads).astype(np.float32)
        apply = [True, True, False]
        o_ref, lse_ref = reference_prefill(mirror, 1, q, qo, kv, idx, last,
                                           page_size=g.page_size,
                                           options=dict(sinks=sinks), apply_sinks=apply)
        for given in (sinks, torch.from_numpy(sinks), sinks.tolist()):
            r = client.prefill(1, q, qo, kv, idx, last, apply_sinks=apply,
                               options=attnserve.AttentionOptions(sinks=given))
            assert within_tolerance(compare(o_ref, lse_ref, r.output, r.lse))
        # A torch query gets torch results; a row that sees nothing with a
        # sink: o 0, LSE the sink (base 2).
        r = client.prefill(1, torch.from_numpy(q), qo, kv, idx, last, apply_sinks=apply,
                           options=attnserve.AttentionOptions(sinks=torch.from_numpy(sinks)))
        assert isinstance(r.output, torch.Tensor)
        assert within_tolerance(compare(o_ref, lse_ref, r.output, r.lse))
        blind = 9  # sequence 1's first row: 3 rows over 2 keys, causal
        assert torch.all(r.output[blind] == 0)
        np.testing.assert_allclose(r.lse[blind].numpy(), sinks / math.log(2.0), rtol=1e-5)
    finally:
        client.free_pages(pages)


def test_plans_carry_options_per_layer(client):
    g = client.server_info
    rng = np.random.default_rng(3)
    pages = client.allocate_pages(16)
    try:
        mirror = KvMirror(g.num_kv_heads, g.head_dim)
        for layer in range(g.num_layers):
            fill(client, mirror, rng, layer, pages)
        q, qo, kv, idx, last = ragged(rng, g, pages, [(20, 90), (1, 130), (6, 6)])
        sinks = rng.normal(0.5, 1.0, g.num_qo_heads).astype(np.float32)
        full = attnserve.AttentionOptions(logits_soft_cap=30.0, sinks=sinks)
        windowed = attnserve.AttentionOptions(window_left=7, sinks=sinks)
        plan = client.create_plan(qo, kv, idx, last, options=full, layer_options={1: windowed})
        try:
            layout = attnserve.PrefillLayout.for_plan(plan, len(q), 0)
            for layer, o in ((0, full), (1, windowed)):
                r = client.prefill_layout(layer, q, layout)
                o_ref, lse_ref = reference_prefill(mirror, layer, q, qo, kv, idx, last,
                                                   page_size=g.page_size, options=o)
                assert within_tolerance(compare(o_ref, lse_ref, r.output, r.lse)), layer
            # Layer 1 leaves the soft-cap unset: the Prefill may add it, not change the window.
            r = client.prefill_layout(1, q, layout,
                                      options=attnserve.AttentionOptions(logits_soft_cap=2.0))
            o_ref, lse_ref = reference_prefill(
                mirror, 1, q, qo, kv, idx, last, page_size=g.page_size,
                options=dict(window_left=7, logits_soft_cap=2.0, sinks=sinks))
            assert within_tolerance(compare(o_ref, lse_ref, r.output, r.lse))
            with pytest.raises(attnserve.InvalidArgument,
                               match=r"options.window_left=8 contradicts the plan's "
                                     r"window_left=7 for layer 1"):
                client.prefill_layout(1, q, layout, options=dict(window_left=8))
        finally:
            client.release_plan(plan)
    finally:
        client.free_pages(pages)


@pytest.mark.parametrize("options,field", [
    (dict(window_left=-2), r"options.window_left=-2 out of range \[-1, 2147483647\]"),
    (dict(logits_soft_cap=float("nan")), r"options.logits_soft_cap=nan must be 0 \(no soft-cap\) or in \[1e-30, 1e\+30\]"),
    (dict(logits_soft_cap=-1.0), r"options.logits_soft_cap=-1 must be 0 \(no soft-cap\) or in \[1e-30, 1e\+30\]"),
    (dict(logits_soft_cap=1e-31), r"options.logits_soft_cap=1e-31 must be 0 \(no soft-cap\) or in"),
    (dict(logits_soft_cap=2.4e38), r"options.logits_soft_cap=2.4e\+38 must be 0 \(no soft-cap\) or in \[1e-30, 1e\+30\]"),
    (dict(logits_soft_cap=float("inf")), r"options.logits_soft_cap=inf"),
    (dict(sinks=[0.0] * 7), r"options.sinks has 7 entries, must have num_qo_heads = 8"),
    (dict(sinks=[0.0] * 9), r"options.sinks has more than 8 entries \(num_qo_heads=8\)"),
    (dict(sinks=[0.0] * 7 + [float("nan")]), r"options.sinks\[7\]=nan must be -inf"),
    (dict(sinks=[float("inf")] + [0.0] * 7), r"options.sinks\[0\]=inf must be -inf"),
])
def test_bad_options_are_refused_naming_the_field(client, options, field):
    g = client.server_info
    rng = np.random.default_rng(4)
    pages = client.allocate_pages(2)
    try:
        fill(client, KvMirror(g.num_kv_heads, g.head_dim), rng, 0, pages)
        q, qo, kv, idx, last = ragged(rng, g, pages, [(3, 20)])
        with pytest.raises(attnserve.InvalidArgument, match=field):
            client.prefill(0, q, qo, kv, idx, last, options=options)
        with pytest.raises(attnserve.InvalidArgument, match=field):
            client.create_plan(qo, kv, idx, last, options=options)
        per_layer = re.sub(r"^options", r"layer_options\\[0\\](\\.value)?", field)
        with pytest.raises(attnserve.InvalidArgument, match=per_layer):
            client.create_plan(qo, kv, idx, last, layer_options={0: options})
    finally:
        client.free_pages(pages)


@pytest.mark.parametrize("server_plans", [True, False])
def test_kv_manager_options_per_layer(client, server_plans):
    g = client.server_info
    rng = np.random.default_rng(5)
    sinks = rng.normal(1.0, 1.0, g.num_qo_heads).astype(np.float32)
    options = attnserve.AttentionOptions(logits_soft_cap=20.0, sinks=sinks)
    windowed = attnserve.AttentionOptions(window_left=5, sinks=sinks)
    mgr = attnserve.KvManager(client, options=options, layer_options={0: windowed},
                              server_plans=server_plans)
    mirror = KvMirror(g.num_kv_heads, g.head_dim)
    try:
        for lens in ([17, 4], [1, 1], [3, 9]):
            plan = mgr.plan([7, 9], lens)
            assert (plan.plan_id != 0) == server_plans
            for layer in range(g.num_layers):
                n = plan.total_q
                q = rng.standard_normal((n, g.num_qo_heads, g.head_dim), np.float32)
                k, v = rng.standard_normal((2, n, g.num_kv_heads, g.head_dim), np.float32)
                mirror.write(layer, plan.append_slots, k, v)
                r = mgr.run(layer, q, k, v)
                o_ref, lse_ref = reference_prefill(
                    mirror, layer, q, plan.qo_indptr, plan.kv_indptr, plan.kv_indices,
                    plan.kv_last_page_len, page_size=g.page_size,
                    options=windowed if layer == 0 else options)
                assert within_tolerance(compare(o_ref, lse_ref, r.output, r.lse)), (lens, layer)
    finally:
        mgr.release()


def _spread_cluster_error(servers, rng, sinks, monkeypatch, carries):
    """The largest error, over a spread step and a decode step, of a cluster
    whose sinks go where carries(shard) says."""
    monkeypatch.setattr(placement_mod, "_carries_sinks", carries)
    options = attnserve.AttentionOptions(window_left=40, logits_soft_cap=10.0, sinks=sinks)
    worst = dict(o_rel_error=0.0, lse_max_abs=0.0, inf_mismatches=0, nan=0)
    with attnserve.Cluster([s.address for s in servers], split_min_tokens=24, options=options,
                           timeout=120) as c:
        ref = Reference(c.server_info)
        g = c.server_info
        for lens in ([70, 5], [1, 1]):
            step = c.plan([1, 2], lens)
            assert len(c.shards_of(1)) == len(servers)
            n = step.total_q
            q = rng.standard_normal((n, g.num_qo_heads, g.head_dim), np.float32)
            k, v = rng.standard_normal((2, n, g.num_kv_heads, g.head_dim), np.float32)
            ref.append(0, step, k, v)
            out = c.run(0, q, k, v, step=step)
            qo, kvp, idx = [0], [0], []
            for b, sid in enumerate(step.seq_ids):
                idx += [ref._base(sid) + p for p in range(int(step.kv_lens[b]))]
                kvp.append(len(idx))
                qo.append(qo[-1] + int(step.q_lens[b]))
            o_ref, lse_ref = reference_prefill(ref.mirror, 0, q, qo, kvp, idx, None,
                                               page_size=1, options=options)
            got = compare(o_ref, lse_ref, out.output, out.lse)
            for key in worst:
                worst[key] = max(worst[key], got[key])
        c.release()
    return worst


def test_cluster_takes_a_spread_sequences_sinks_once(monkeypatch):
    servers = start(2)
    try:
        g = attnserve.Client(servers[0].address).server_info
        rng = np.random.default_rng(6)
        sinks = rng.normal(2.0, 0.5, g.num_qo_heads).astype(np.float32)
        once = _spread_cluster_error(servers, np.random.default_rng(7), sinks, monkeypatch,
                                     lambda shard: shard.start == 0)
        assert within_tolerance(once), once
        # Broken on purpose: the sinks on every server of the sequence, or on none.
        every = _spread_cluster_error(servers, np.random.default_rng(7), sinks, monkeypatch,
                                      lambda shard: True)
        assert not within_tolerance(every), every
        none = _spread_cluster_error(servers, np.random.default_rng(7), sinks, monkeypatch,
                                     lambda shard: False)
        assert not within_tolerance(none), none
    finally:
        stop(servers)


def test_merges_count_the_sink_once():
    """Three ranges of one sequence from the float64 reference, merged by the
    numpy merge (attnserve.merge) and the float64 one: the whole sequence's
    attention exactly when one range carries the sink."""
    rng = np.random.default_rng(8)
    hq, hkv, d, total, q_len = 4, 2, 32, 60, 7
    mirror = KvMirror(hkv, d)
    k, v = rng.standard_normal((2, total, hkv, d))
    mirror.write(0, list(range(total)), k, v)
    q = rng.standard_normal((q_len, hq, d))
    sinks = rng.normal(1.5, 0.5, hq)
    options = dict(window_left=25, logits_soft_cap=4.0, sinks=sinks)
    o_whole, lse_whole = reference_prefill(mirror, 0, q, [0, q_len], [0, total],
                                           list(range(total)), None, page_size=1,
                                           options=options)
    bounds = [0, 20, 41, total]

    def ranges(carry):
        states = []
        for i in range(3):
            a, b = bounds[i], bounds[i + 1]
            o, lse = reference_prefill(mirror, 0, q, [0, q_len], [0, b - a], list(range(a, b)),
                                       None, page_size=1, kv_keys_after=[total - b],
                                       options=options, apply_sinks=[carry[i]])
            states.append((o.astype(np.float32), lse.astype(np.float32)))
        return states

    for carry, ok in (([True, False, False], True), ([False, False, True], True),
                      ([True, True, True], False), ([False, False, False], False)):
        states = ranges(carry)
        v_np, lse_np = merge_states([s[0] for s in states], [s[1] for s in states])
        v_64, lse_64 = reference_merge(states, wire_dtype=attnserve.dtypes.DTYPE_FP16)
        for v_m, lse_m in ((v_np, lse_np), (v_64, lse_64)):
            c = compare(o_whole, lse_whole, np.asarray(v_m, np.float32), lse_m)
            assert within_tolerance(c) == ok, (carry, c)
