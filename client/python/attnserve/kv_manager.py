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
needs (one AllocatePages for the whole batch), advances the lengths, and
computes the step's layout once: qo_indptr, kv_indptr, kv_indices,
kv_last_page_len, the append slots and each new token's position. run()
sends one Prefill per layer with the fused append of that layer's K/V rows.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Hashable, Optional, Sequence

import numpy as np

from attnserve.client import PrefillLayout, PrefillResult


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
    layout: PrefillLayout = field(repr=False)
    valid: bool = True

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
                 lse_base: str = "2"):
        self.causal = causal
        self.sm_scale = sm_scale
        self.lse_base = lse_base
        self._seqs: dict = {}
        self._step = 0
        self._latest: Optional[Plan] = None

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
        """Forgets every sequence without freeing (after a server restart)."""
        for s in self._seqs.values():
            if s.plan is not None:
                s.plan.valid = False
        self._seqs.clear()
        self._latest = None

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

    def _commit(self, page_size: int, seq_ids: Sequence, q_lens: np.ndarray, needs: list,
                new_pages: list) -> Plan:
        self._step += 1
        batch = len(seq_ids)
        total_q = int(q_lens.sum())
        qo_indptr = np.zeros(batch + 1, np.int32)
        kv_indptr = np.zeros(batch + 1, np.int32)
        kv_lens = np.zeros(batch, np.int32)
        last = np.zeros(batch, np.int32)
        indices, slots, positions = [], [], []
        taken = 0
        seqs = []
        for b, (sid, q_len, need) in enumerate(zip(seq_ids, q_lens.tolist(), needs)):
            s = self._seqs.get(sid)
            if s is None:
                s = self._seqs[sid] = _Sequence()
            s.pages.extend(new_pages[taken:taken + need])
            taken += need
            start = s.length
            s.length += q_len
            pos = np.arange(start, s.length, dtype=np.int64)
            pages = np.asarray(s.pages, dtype=np.int64)
            positions.append(pos)
            slots.append(pages[pos // page_size] * page_size + pos % page_size)
            indices.extend(s.pages)
            qo_indptr[b + 1] = qo_indptr[b] + q_len
            kv_indptr[b + 1] = kv_indptr[b] + len(s.pages)
            kv_lens[b] = s.length
            last[b] = s.length - (len(s.pages) - 1) * page_size if s.pages else 0
            seqs.append(s)
        append_slots = np.concatenate(slots) if slots else np.zeros(0, np.int64)
        kv_indices = np.asarray(indices, dtype=np.int32)
        layout = PrefillLayout.encode(qo_indptr, kv_indptr, kv_indices, last,
                                      sm_scale=self.sm_scale, causal=self.causal,
                                      lse_base=self.lse_base, append_slots=append_slots)
        plan = Plan(seq_ids=tuple(seq_ids), q_lens=q_lens.astype(np.int32), kv_lens=kv_lens,
                    qo_indptr=qo_indptr, kv_indptr=kv_indptr, kv_indices=kv_indices,
                    kv_last_page_len=last, append_slots=append_slots,
                    positions=np.concatenate(positions) if positions else np.zeros(0, np.int64),
                    step=self._step, layout=layout)
        assert total_q == plan.total_q
        for s in seqs:
            if s.plan is not None:
                s.plan.valid = False  # a later step moved this sequence on
            s.plan = plan
        self._latest = plan
        return plan

    def _plan_for_run(self, plan: Optional[Plan]) -> Plan:
        plan = self._latest if plan is None else plan
        if plan is None:
            raise RuntimeError("run: no plan; call plan() first")
        if not plan.valid:
            raise RuntimeError(f"run: the plan of step {plan.step} is stale (a later plan or "
                               "finish() changed one of its sequences)")
        return plan

    def _take(self, seq_ids) -> list:
        if len(set(seq_ids)) != len(seq_ids):
            raise ValueError("finish: seq_ids has duplicates")
        missing = [sid for sid in seq_ids if sid not in self._seqs]
        if missing:
            raise KeyError(f"finish: unknown sequence(s) {missing}")
        pages = []
        for sid in seq_ids:
            pages.extend(self._seqs[sid].pages)
        return pages

    def _drop(self, seq_ids) -> None:
        for sid in seq_ids:
            s = self._seqs.pop(sid)
            if s.plan is not None:
                s.plan.valid = False


class KvManager(_Bookkeeping):
    """Tracks the pages of many sequences on one server (blocking client).

    Args:
      client: an attnserve.Client (its server's page_size is used).
      causal, sm_scale, lse_base: the Prefill options of every run().
    """

    def __init__(self, client, *, causal: bool = True, sm_scale: Optional[float] = None,
                 lse_base: str = "2"):
        super().__init__(causal=causal, sm_scale=sm_scale, lse_base=lse_base)
        self.client = client
        self.page_size = client.server_info.page_size

    def plan(self, seq_ids: Sequence, q_lens) -> Plan:
        """Grows seq_ids[b] by q_lens[b] tokens and lays the step out.

        A sequence not seen before starts empty. Allocates the pages the step
        needs in one call; on failure (e.g. ResourceExhausted) nothing changes.
        Lengths advance here, once per step: every layer's run() then appends
        at the same positions.
        """
        lens, needs = self._pages_needed(self.page_size, seq_ids, q_lens)
        new_pages = self.client.allocate_pages(sum(needs)) if sum(needs) else []
        return self._commit(self.page_size, seq_ids, lens, needs, new_pages)

    def run(self, layer: int, q, k_new, v_new, *, plan: Optional[Plan] = None,
            **kwargs) -> PrefillResult:
        """One layer of the step: appends k_new, v_new [total_q, kv_heads, head_dim]
        at the plan's slots, then attends with q [total_q, qo_heads, head_dim].

        plan defaults to the latest; any plan whose sequences no later plan or
        finish() touched may run (e.g. two micro-batches). kwargs go to
        Client.prefill_layout (out, device, timeout).
        """
        p = self._plan_for_run(plan)
        return self.client.prefill_layout(layer, q, p.layout, k_new, v_new, **kwargs)

    def finish(self, *seq_ids: Hashable) -> None:
        """Frees the sequences' pages (one FreePages) and forgets them."""
        pages = self._take(seq_ids)
        if pages:
            self.client.free_pages(pages)
        self._drop(seq_ids)

    def release(self) -> None:
        """finish() for every sequence."""
        if self._seqs:
            self.finish(*self._seqs)


class AsyncKvManager(_Bookkeeping):
    """KvManager over an attnserve.aio.AsyncClient: plan, run and finish are awaited.

    plan() and finish() are serialized by a lock; run() calls may overlap (two
    micro-batches' plans in flight at once).
    """

    def __init__(self, client, *, causal: bool = True, sm_scale: Optional[float] = None,
                 lse_base: str = "2"):
        super().__init__(causal=causal, sm_scale=sm_scale, lse_base=lse_base)
        self.client = client
        self._lock_made: Optional[asyncio.Lock] = None  # made in the loop that uses it

    @property
    def _lock(self) -> asyncio.Lock:
        if self._lock_made is None:
            self._lock_made = asyncio.Lock()
        return self._lock_made

    async def _page_size(self) -> int:
        await self.client._ensure_info()
        return self.client.server_info.page_size

    async def plan(self, seq_ids: Sequence, q_lens) -> Plan:
        async with self._lock:
            page_size = await self._page_size()
            lens, needs = self._pages_needed(page_size, seq_ids, q_lens)
            new_pages = await self.client.allocate_pages(sum(needs)) if sum(needs) else []
            return self._commit(page_size, seq_ids, lens, needs, new_pages)

    async def run(self, layer: int, q, k_new, v_new, *, plan: Optional[Plan] = None,
                  **kwargs) -> PrefillResult:
        p = self._plan_for_run(plan)
        return await self.client.prefill_layout(layer, q, p.layout, k_new, v_new, **kwargs)

    async def finish(self, *seq_ids: Hashable) -> None:
        async with self._lock:
            pages = self._take(seq_ids)
            if pages:
                await self.client.free_pages(pages)
            self._drop(seq_ids)

    async def release(self) -> None:
        if self._seqs:
            await self.finish(*list(self._seqs))
