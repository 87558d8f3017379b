"""Paged KV manager: plan a step once, run it for every layer.

docs/kv_manager.md is the contract; client/kv_manager.h is the C++ twin with
the same semantics.

    mgr = attnserve.KvManager(client)
    plan = mgr.plan([7, 9], [5, 3])            # new tokens per sequence this step
    for layer in range(num_layers):
        q, k, v = project(layer, x, plan.positions)     # [8, heads, head_dim] each
        r = mgr.run(layer, q, k, v)            # appends k, v, then attends
    mgr.finish(7)                              # frees sequence 7's pages

plan() grows each sequence by its q_len: it allocates the pages the step
needs (one AllocatePages for the whole batch), advances the lengths, computes
the step's layout once (qo_indptr, kv_indptr, kv_indices, kv_last_page_len,
the append slots and each new token's position) and registers it with the
server (CreatePlan). run() sends one Prefill per layer that names the plan,
with the fused append of that layer's K/V rows.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Hashable, Optional, Sequence

import numpy as np

from attnserve.client import PrefillLayout, PrefillResult
from attnserve.client import _options as _as_options
from attnserve.errors import AttnserveError, NotFound, Unimplemented


@dataclass
class Plan:
    """One step's layout (arrays int32 unless noted).

    seq_ids: the sequences, in batch order.
    q_lens [batch]: new tokens per sequence this step.
    kv_lens [batch]: lengths after the step's append.
    qo_indptr [batch + 1], kv_indptr [batch + 1], kv_indices [kv_indptr[-1]],
    kv_last_page_len [batch]: the Prefill layout (docs/design.md section 3).
    append_slots [total_q] (int64): where each new token's K/V goes.
    positions [total_q] (int64): each new token's position in its sequence.
    plan_id: the server's plan (CreatePlan), 0 when the layout travels instead.
    append_lens [batch]: tokens appended per sequence (q_lens, except for
    plan_rows(), where q_lens are the query rows).
    kv_keys_after [batch] or None: keys of each sequence beyond this server's
    range (plan_rows() only).
    apply_sinks [batch] (bool) or None: False where the attention sinks stay
    out of a sequence here (plan_rows() only: another server carries them).
    """

    seq_ids: tuple
    q_lens: np.ndarray
    kv_lens: np.ndarray
    qo_indptr: np.ndarray
    kv_indptr: np.ndarray
    kv_indices: np.ndarray
    kv_last_page_len: np.ndarray
    append_slots: np.ndarray
    positions: np.ndarray
    step: int
    layout: Optional[PrefillLayout] = field(default=None, repr=False)
    plan_id: int = 0
    valid: bool = True
    append_lens: Optional[np.ndarray] = None
    kv_keys_after: Optional[np.ndarray] = None
    apply_sinks: Optional[np.ndarray] = None

    @property
    def total_q(self) -> int:
        return int(self.qo_indptr[-1])

    @property
    def batch(self) -> int:
        return len(self.seq_ids)


class _Sequence:
    __slots__ = ("pages", "length", "plan")

    def __init__(self):
        self.pages: list = []
        self.length = 0
        self.plan: Optional[Plan] = None


class _Bookkeeping:
    """Everything but the RPCs: sequences, their pages, the layout of a step."""

    def __init__(self, *, causal: bool = True, sm_scale: Optional[float] = None,
                 lse_base: str = "2", server_plans: bool = True, options=None,
                 layer_options=None):
        self.causal = causal
        self.sm_scale = sm_scale
        self.lse_base = lse_base
        # Attention options (docs/design.md, "Variants") of every layer, and
        # per layer those that replace them (e.g. windowed layers).
        self.options = _as_options(options)
        self.layer_options = {int(k): _as_options(v) for k, v in (layer_options or {}).items()}
        # Register each step's layout with CreatePlan (False: send it with every
        # layer, as for a server without plans, which also turns this off).
        self.server_plans = server_plans
        self._seqs: dict = {}
        self._step = 0
        self._latest: Optional[Plan] = None
        self._unreleased: list = []  # server plans gone stale, still to release

    # ------------------------------------------------------------ queries
    @property
    def sequences(self) -> list:
        return list(self._seqs)

    def kv_len(self, seq_id: Hashable) -> int:
        return self._seqs[seq_id].length

    def pages_of(self, seq_id: Hashable) -> list:
        return list(self._seqs[seq_id].pages)

    @property
    def num_pages(self) -> int:
        """Pages this manager holds on the server."""
        return sum(len(s.pages) for s in self._seqs.values())

    def reset(self) -> None:
        """Forgets every sequence and plan without an RPC (after a server restart)."""
        for s in self._seqs.values():
            if s.plan is not None:
                s.plan.valid = False
        self._seqs.clear()
        self._latest = None
        self._unreleased.clear()

    # ------------------------------------------------------------ planning
    def _pages_needed(self, page_size: int, seq_ids: Sequence, q_lens) -> tuple:
        if len(seq_ids) == 0:
            raise ValueError("plan: seq_ids is empty")
        if len(seq_ids) != len(q_lens):
            raise ValueError(f"plan: {len(seq_ids)} seq_ids but {len(q_lens)} q_lens")
        if len(set(seq_ids)) != len(seq_ids):
            raise ValueError("plan: seq_ids has duplicates")
        lens = np.asarray(q_lens)
        if lens.dtype.kind not in "iu":
            raise TypeError(f"plan: q_lens must be integers, not {lens.dtype}")
        if (lens < 0).any():
            raise ValueError(f"plan: q_lens[{int(np.argmax(lens < 0))}] is negative")
        needs = []
        for sid, q_len in zip(seq_ids, lens.tolist()):
            s = self._seqs.get(sid)
            length = s.length if s is not None else 0
            held = len(s.pages) if s is not None else 0
            needs.append(max(0, -(-(length + q_len) // page_size) - held))
        return lens.astype(np.int64), needs

    def _lay_out(self, page_size: int, seq_ids: Sequence, q_lens: np.ndarray, needs: list,
                 new_pages: list, q_rows: Optional[np.ndarray] = None,
                 kv_keys_after: Optional[np.ndarray] = None,
                 apply_sinks: Optional[np.ndarray] = None) -> tuple:
        """The step's Plan and each sequence's (pages, length) after it; changes nothing.

        q_lens: tokens appended; q_rows: query rows (default q_lens)."""
        rows = q_lens if q_rows is None else q_rows
        batch = len(seq_ids)
        qo_indptr = np.zeros(batch + 1, np.int32)
        kv_indptr = np.zeros(batch + 1, np.int32)
        kv_lens = np.zeros(batch, np.int32)
        last = np.zeros(batch, np.int32)
        indices, slots, positions, after = [], [], [], []
        taken = 0
        for b, (sid, q_len, need) in enumerate(zip(seq_ids, q_lens.tolist(), needs)):
            s = self._seqs.get(sid)
            pages = (list(s.pages) if s is not None else []) + new_pages[taken:taken + need]
            taken += need
            start = s.length if s is not None else 0
            length = start + q_len
            pos = np.arange(start, length, dtype=np.int64)
            arr = np.asarray(pages, dtype=np.int64)
            positions.append(pos)
            slots.append(arr[pos // page_size] * page_size + pos % page_size)
            indices.extend(pages)
            qo_indptr[b + 1] = qo_indptr[b] + int(rows[b])
            kv_indptr[b + 1] = kv_indptr[b] + len(pages)
            kv_lens[b] = length
            last[b] = length - (len(pages) - 1) * page_size if pages else 0
            after.append((pages, length))
        plan = Plan(seq_ids=tuple(seq_ids), q_lens=np.asarray(rows).astype(np.int32),
                    kv_lens=kv_lens, qo_indptr=qo_indptr, kv_indptr=kv_indptr,
                    kv_indices=np.asarray(indices, dtype=np.int32), kv_last_page_len=last,
                    append_slots=np.concatenate(slots), positions=np.concatenate(positions),
                    step=self._step + 1, append_lens=q_lens.astype(np.int32),
                    kv_keys_after=None if kv_keys_after is None
                    else np.asarray(kv_keys_after, dtype=np.int32),
                    apply_sinks=None if apply_sinks is None
                    else np.asarray(apply_sinks, dtype=bool).reshape(-1))
        return plan, after

    def _options(self) -> dict:
        return dict(sm_scale=self.sm_scale, causal=self.causal, lse_base=self.lse_base)

    def _layout_bytes(self, plan: Plan) -> PrefillLayout:
        """The layout sent with every layer when there is no server plan (each
        layer's run() adds that layer's attention options)."""
        return PrefillLayout.encode(plan.qo_indptr, plan.kv_indptr, plan.kv_indices,
                                    plan.kv_last_page_len, append_slots=plan.append_slots,
                                    kv_keys_after=plan.kv_keys_after,
                                    apply_sinks=plan.apply_sinks, **self._options())

    def _layer_options(self, plan: Plan, layer: int):
        """What run() sends with a layer: nothing with a server plan (it holds
        them), else the layer's options."""
        if plan.plan_id:
            return None
        return self.layer_options.get(int(layer), self.options)

    def _plan_layout(self, plan: Plan, plan_id: int) -> None:
        plan.plan_id = plan_id
        plan.layout = PrefillLayout.for_plan(plan_id, plan.total_q, len(plan.append_slots),
                                             **self._options())

    def _create_args(self, plan: Plan) -> tuple:
        return (plan.qo_indptr, plan.kv_indptr, plan.kv_indices, plan.kv_last_page_len,
                plan.append_slots, plan.kv_keys_after)

    def _create_kwargs(self, plan: Plan) -> dict:
        return dict(options=self.options, layer_options=self.layer_options or None,
                    apply_sinks=plan.apply_sinks)

    def _apply(self, plan: Plan, after: list) -> None:
        """Commits the plan: lengths and pages advance; older plans of its
        sequences go stale (their server plans wait in _unreleased)."""
        self._step = plan.step
        for sid, (pages, length) in zip(plan.seq_ids, after):
            s = self._seqs.get(sid)
            if s is None:
                s = self._seqs[sid] = _Sequence()
            s.pages, s.length = pages, length
            self._retire(s.plan)
            s.plan = plan
        self._latest = plan

    def _retire(self, plan: Optional[Plan]) -> None:
        if plan is not None and plan.valid:
            plan.valid = False
            if plan.plan_id:
                self._unreleased.append(plan.plan_id)

    def _plan_for_run(self, plan: Optional[Plan]) -> Plan:
        plan = self._latest if plan is None else plan
        if plan is None:
            raise RuntimeError("run: no plan; call plan() first")
        if not plan.valid:
            raise RuntimeError(f"run: the plan of step {plan.step} is stale (a later plan or "
                               "finish() changed one of its sequences)")
        return plan

    def _take(self, seq_ids) -> list:
        """The pages of seq_ids; their plans go stale."""
        if len(set(seq_ids)) != len(seq_ids):
            raise ValueError("finish: seq_ids has duplicates")
        missing = [sid for sid in seq_ids if sid not in self._seqs]
        if missing:
            raise KeyError(f"finish: unknown sequence(s) {missing}")
        pages = []
        for sid in seq_ids:
            s = self._seqs[sid]
            pages.extend(s.pages)
            self._retire(s.plan)
        return pages

    def _undo(self, plan: Plan) -> list:
        """The bookkeeping of undo(); returns the pages to free."""
        for sid in plan.seq_ids:
            s = self._seqs.get(sid)
            if s is None or s.plan is not plan:
                raise RuntimeError(f"undo: step {plan.step} is not the latest plan of {sid!r}")
        self._retire(plan)
        appended = plan.append_lens if plan.append_lens is not None else plan.q_lens
        freed = []
        for sid, n in zip(plan.seq_ids, appended.tolist()):
            s = self._seqs[sid]
            s.length -= n
            keep = -(-s.length // self.page_size)
            freed.extend(s.pages[keep:])
            del s.pages[keep:]
            s.plan = None
            if s.length == 0 and not s.pages:
                del self._seqs[sid]
        if self._latest is plan:
            self._latest = None
        return freed

    def _drop(self, seq_ids) -> None:
        for sid in seq_ids:
            self._seqs.pop(sid)

    @staticmethod
    def _released(plan_id: int, error: Optional[AttnserveError]) -> bool:
        # NOT_FOUND: the server dropped it already (idle timeout or restart).
        return error is None or isinstance(error, NotFound)


class KvManager(_Bookkeeping):
    """Tracks the pages of many sequences on one server (blocking client).

    Args:
      client: an attnserve.Client (its server's page_size is used).
      causal, sm_scale, lse_base: the Prefill options of every run().
      options: attnserve.AttentionOptions of every layer (sliding window,
        soft-cap, sinks); layer_options {layer: AttentionOptions} replace them
        for those layers (a model whose windowed and full layers alternate).
        Each step's server plan carries them (without one, each run()).
      server_plans: register each step's layout with CreatePlan (default);
        False sends the layout with every layer instead.
    """

    def __init__(self, client, *, causal: bool = True, sm_scale: Optional[float] = None,
                 lse_base: str = "2", server_plans: bool = True, options=None,
                 layer_options=None):
        super().__init__(causal=causal, sm_scale=sm_scale, lse_base=lse_base,
                         server_plans=server_plans, options=options,
                         layer_options=layer_options)
        self.client = client
        self.page_size = client.server_info.page_size

    def plan(self, seq_ids: Sequence, q_lens) -> Plan:
        """Grows seq_ids[b] by q_lens[b] tokens and lays the step out.

        A sequence not seen before starts empty. Allocates the pages the step
        needs in one call and registers the layout; on failure (e.g.
        ResourceExhausted) nothing changes. Lengths advance here, once per
        step: every layer's run() then appends at the same positions.
        """
        return self.plan_rows(seq_ids, q_lens)

    def plan_rows(self, seq_ids: Sequence, append_lens, q_rows=None,
                  kv_keys_after=None, apply_sinks=None) -> Plan:
        """plan() for one server of a cluster (attnserve.Cluster), which holds a
        contiguous range of each sequence: seq_ids[b] grows by append_lens[b]
        tokens here, the step sends q_rows[b] >= append_lens[b] query rows (the
        sequence's new tokens, some appended on other servers), and
        kv_keys_after[b] of the sequence's keys lie beyond this range;
        apply_sinks[b] False keeps the attention sinks out of sequence b here
        (another server's range carries them).
        run() then takes k_new, v_new of the appended rows only."""
        lens, needs = self._pages_needed(self.page_size, seq_ids, append_lens)
        rows = None
        if q_rows is not None:
            rows = np.asarray(q_rows, dtype=np.int64).reshape(-1)
            if len(rows) != len(lens) or (rows < lens).any():
                raise ValueError("plan_rows: q_rows must have one entry per sequence, each "
                                 ">= its append_lens")
        if kv_keys_after is not None:
            after = np.asarray(kv_keys_after, dtype=np.int64).reshape(-1)
            if len(after) != len(lens) or (after < 0).any():
                raise ValueError("plan_rows: kv_keys_after must have one entry >= 0 per "
                                 "sequence")
        if apply_sinks is not None and len(np.asarray(apply_sinks).reshape(-1)) != len(lens):
            raise ValueError("plan_rows: apply_sinks must have one entry per sequence")
        new_pages = self.client.allocate_pages(sum(needs)) if sum(needs) else []
        plan, after = self._lay_out(self.page_size, seq_ids, lens, needs, new_pages, rows,
                                    kv_keys_after, apply_sinks)
        try:
            self._register(plan)
        except BaseException:
            if new_pages:
                try:
                    self.client.free_pages(new_pages)
                except AttnserveError:
                    pass  # the first error is the one to report
            raise
        self._apply(plan, after)
        self._release_stale(strict=False)
        return plan

    def _register(self, plan: Plan) -> None:
        if self.server_plans:
            try:
                self._plan_layout(plan, self.client.create_plan(*self._create_args(plan),
                                                                **self._create_kwargs(plan)))
                return
            except Unimplemented:
                self.server_plans = False  # a server without plans
        plan.layout = self._layout_bytes(plan)

    def _release_stale(self, strict: bool) -> None:
        """ReleasePlan for plans gone stale; with strict, the first failure raises."""
        pending, self._unreleased = self._unreleased, []
        for i, plan_id in enumerate(pending):
            try:
                self.client.release_plan(plan_id)
            except AttnserveError as e:
                if not self._released(plan_id, e):
                    self._unreleased.extend(pending[i:])
                    if strict:
                        raise
                    return

    def run(self, layer: int, q, k_new, v_new, *, plan: Optional[Plan] = None,
            **kwargs) -> PrefillResult:
        """One layer of the step: appends k_new, v_new [total_q, kv_heads, head_dim]
        at the plan's slots, then attends with q [total_q, qo_heads, head_dim].

        plan defaults to the latest; any plan whose sequences no later plan or
        finish() touched may run (e.g. two micro-batches). kwargs go to
        Client.prefill_layout (out, device, timeout).
        """
        p = self._plan_for_run(plan)
        return self.client.prefill_layout(layer, q, p.layout, k_new, v_new,
                                          options=self._layer_options(p, layer), **kwargs)

    def undo(self, plan: Plan) -> None:
        """Takes back plan, the latest plan of each of its sequences: their
        lengths go back, the pages it allocated are freed, its server plan is
        released and it goes stale (as do the plans it had made stale). For a
        cluster whose step failed on another server."""
        freed = self._undo(plan)
        self._release_stale(strict=False)
        if freed:
            self.client.free_pages(freed)

    def finish(self, *seq_ids: Hashable) -> None:
        """Releases the sequences' plans, frees their pages (one FreePages) and
        forgets them."""
        pages = self._take(seq_ids)
        self._release_stale(strict=True)
        if pages:
            self.client.free_pages(pages)
        self._drop(seq_ids)

    def release(self) -> None:
        """finish() for every sequence."""
        if self._seqs:
            self.finish(*self._seqs)
        else:
            self._release_stale(strict=True)


class AsyncKvManager(_Bookkeeping):
    """KvManager over an attnserve.aio.AsyncClient: plan, run and finish are awaited.

    plan() and finish() are serialized by a lock; run() calls may overlap (two
    micro-batches' plans in flight at once).
    """

    def __init__(self, client, *, causal: bool = True, sm_scale: Optional[float] = None,
                 lse_base: str = "2", server_plans: bool = True, options=None,
                 layer_options=None):
        super().__init__(causal=causal, sm_scale=sm_scale, lse_base=lse_base,
                         server_plans=server_plans, options=options,
                         layer_options=layer_options)
        self.client = client
        self._lock_made: Optional[asyncio.Lock] = None  # made in the loop that uses it

    @property
    def _lock(self) -> asyncio.Lock:
        if self._lock_made is None:
            self._lock_made = asyncio.Lock()
        return self._lock_made

    async def plan(self, seq_ids: Sequence, q_lens) -> Plan:
        async with self._lock:
            await self.client._ensure_info()
            page_size = self.client.server_info.page_size
            lens, needs = self._pages_needed(page_size, seq_ids, q_lens)
            new_pages = await self.client.allocate_pages(sum(needs)) if sum(needs) else []
            plan, after = self._lay_out(page_size, seq_ids, lens, needs, new_pages)
            try:
                await self._register(plan)
            except BaseException:
                if new_pages:
                    try:
                        await self.client.free_pages(new_pages)
                    except AttnserveError:
                        pass
                raise
            self._apply(plan, after)
            await self._release_stale(strict=False)
            return plan

    async def _register(self, plan: Plan) -> None:
        if self.server_plans:
            try:
                self._plan_layout(plan, await self.client.create_plan(
                    *self._create_args(plan), **self._create_kwargs(plan)))
                return
            except Unimplemented:
                self.server_plans = False
        plan.layout = self._layout_bytes(plan)

    async def _release_stale(self, strict: bool) -> None:
        pending, self._unreleased = self._unreleased, []
        for i, plan_id in enumerate(pending):
            try:
                await self.client.release_plan(plan_id)
            except AttnserveError as e:
                if not self._released(plan_id, e):
                    self._unreleased.extend(pending[i:])
                    if strict:
                        raise
                    return

    async def run(self, layer: int, q, k_new, v_new, *, plan: Optional[Plan] = None,
                  **kwargs) -> PrefillResult:
        p = self._plan_for_run(plan)
        return await self.client.prefill_layout(layer, q, p.layout, k_new, v_new,
                                                options=self._layer_options(p, layer), **kwargs)

    async def finish(self, *seq_ids: Hashable) -> None:
        async with self._lock:
            pages = self._take(seq_ids)
            await self._release_stale(strict=True)
            if pages:
                await self.client.free_pages(pages)
            self._drop(seq_ids)

    async def release(self) -> None:
        if self._seqs:
            await self.finish(*list(self._seqs))
        else:
            async with self._lock:
                await self._release_stale(strict=True)
