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

Leases (the default): the manager holds its pages and plans under a lease of
its own (a client.fork() and an attnserve.Lease, granted at the first plan()).
If the process dies, the server frees them within the lease's ttl; close()
or release() revokes it. A failed call never leaves a sequence usable whose
pages may have been freed: finish() forgets its sequences whatever happens,
and pages whose fate a failed call left unknown are reconciled against the
lease's holdings (ListHoldings) before the next plan(), finish() or
release(). A lease that expired loses every sequence (SequencesLost).
docs/kv_manager.md, "When a call fails".

The RPC sequences of plan, finish and release are written once, as
generators that yield the calls they make (_Flows); KvManager runs them
with the blocking client, AsyncKvManager awaits them.
"""

from __future__ import annotations

import asyncio
import weakref
from dataclasses import dataclass, field
from typing import Hashable, Optional, Sequence

import numpy as np

from attnserve.layout import PrefillLayout
from attnserve.layout import _options as _as_options
from attnserve.errors import (AttnserveError, Cancelled, FailedPrecondition, LeaseExpired,
                              NotFound, SequencesLost, StaleIncarnation, Unimplemented,
                              outcome_unknown)
from attnserve.lease import AsyncLease, Lease
from attnserve.results import PrefillResult

_MAX_STEP_TOKENS = 2**31 - 1  # a step's rows: the server's qo_indptr is int32


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


_LEASE_GONE = "the KV manager's lease expired or was revoked: the server released its pages"


def _call(method: str, *args, **kwargs) -> tuple:
    """An RPC a flow yields: the client method's name and its arguments."""
    return (method, args, kwargs)


_START_LEASE = ("<start lease>", (), {})


def _explained(e: AttnserveError, prefix: str) -> AttnserveError:
    """e's class, code and method, with `prefix` before its details."""
    if isinstance(e, SequencesLost):
        return e
    return type(e)(prefix + e.details, e.code, e.method)


class _Sequence:
    __slots__ = ("pages", "length", "plan", "unwritten")

    def __init__(self):
        self.pages: list = []
        self.length = 0
        self.plan: Optional[Plan] = None
        self.unwritten: set = set()  # layers of `plan` whose run() failed


class _Bookkeeping:
    """Everything but the RPCs: sequences, their pages, the layout of a step,
    the lease and what failed calls left in doubt; the flows of plan, finish
    and release as generators of the calls they make."""

    def __init__(self, client, *, causal: bool = True, sm_scale: Optional[float] = None,
                 lse_base: str = "2", server_plans: bool = True, lease: bool = True,
                 lease_ttl: Optional[float] = None, options=None, layer_options=None):
        self.client = client
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
        # Hold pages and plans under a lease of the manager's own (False: the
        # client's requests as they are, as before leases; also for a server
        # without leases).
        self.leases = lease
        self.lease_ttl = lease_ttl
        self._rpc = client              # lease mode: a fork holding the lease
        self._lease = None              # attnserve.Lease / AsyncLease
        self._seqs: dict = {}
        self._lost: set = set()         # lost with a lease, not yet finished
        self._step = 0
        self._latest: Optional[Plan] = None
        self._unreleased: list = []     # server plans gone stale, still to release
        self._unrevoked: list = []      # ended leases whose revocation is not confirmed
        self._dirty = False             # lease: holdings may differ from the bookkeeping
        self._to_free: list = []        # no lease: pages surely held, owned by no sequence
        self._leaked = 0
        self._interrupting = False      # _interrupted() is settling a flow: no more calls

    # ------------------------------------------------------------ queries
    @property
    def sequences(self) -> list:
        """The live sequences."""
        return list(self._seqs)

    @property
    def lost(self) -> list:
        """Sequences lost with an expired lease, not yet finished."""
        return sorted(self._lost, key=repr)

    def has(self, seq_id: Hashable) -> bool:
        """True for a sequence the manager knows: live, or lost and not finished."""
        return seq_id in self._seqs or seq_id in self._lost

    def kv_len(self, seq_id: Hashable) -> int:
        return self._seqs[seq_id].length

    def pages_of(self, seq_id: Hashable) -> list:
        return list(self._seqs[seq_id].pages)

    @property
    def num_pages(self) -> int:
        """Pages this manager's live sequences hold on the server."""
        return sum(len(s.pages) for s in self._seqs.values())

    @property
    def leaked_pages(self) -> int:
        """Pages given up without a lease: a free or an allocation whose outcome
        is unknown (they may still be held on the server; never reused)."""
        return self._leaked

    @property
    def lease_id(self) -> int:
        """The manager's lease (0: none yet, or leases off)."""
        return 0 if self._lease is None else self._lease.lease_id

    def check_written(self, *seq_ids: Hashable) -> None:
        """Raises FailedPrecondition naming the sequences among seq_ids whose
        last run() of some layer failed (plan() refuses them until that layer
        of that plan runs again)."""
        groups: dict = {}  # (step, layers) -> sequences
        stale: dict = {}   # the same, for plans gone stale: no run() writes them again
        for sid in seq_ids:
            s = self._seqs.get(sid)
            if s is not None and s.unwritten:
                key = (s.plan.step if s.plan is not None else 0, tuple(sorted(s.unwritten)))
                live = s.plan is not None and s.plan.valid
                (groups if live else stale).setdefault(key, []).append(sid)

        def describe(of: dict) -> str:
            return "; ".join(f"sequences {', '.join(map(repr, ids))}: "
                             f"layer{'s' if len(layers) > 1 else ''} "
                             f"{', '.join(map(str, layers))} of step {step}"
                             for (step, layers), ids in of.items())
        says = []
        if groups:
            says.append(describe(groups) + ": a run() of that layer failed or was interrupted, "
                        "and it may or may not have appended the step's K/V rows; run that "
                        "layer of that plan again (with the same q, k_new, v_new) or finish() "
                        "the sequences")
        if stale:
            says.append(describe(stale) + ": a run() of that layer failed or was interrupted, "
                        "and that plan can no longer run (finish() of another of its sequences "
                        "made it stale), so their K/V of that step may never be written: "
                        "finish() the sequences")
        if says:
            raise FailedPrecondition("; and ".join(says), method="plan")

    def _clear(self) -> None:
        for s in self._seqs.values():
            if s.plan is not None:
                s.plan.valid = False
        self._seqs.clear()
        self._lost.clear()
        self._latest = None
        self._unreleased.clear()
        self._to_free.clear()
        self._dirty = False

    def _end_lease(self) -> None:
        if self._lease is not None:
            self._lease.abandon()
        self._lease = None

    def reset(self) -> None:
        """Forgets every sequence and plan without an RPC (after a server restart)."""
        self._clear()
        self._end_lease()
        self._unrevoked.clear()  # the server that restarted has none of them

    def abandon(self) -> None:
        """reset() for a server that cannot be reached: with the lease, the
        server frees everything within the lease's ttl; without, the pages
        the manager held are counted as leaked."""
        if self._lease is None:
            self._leaked += self.num_pages + len(self._to_free)
        else:
            self._unrevoked.append(self._lease.lease_id)  # if the server answers again
        self._clear()
        self._end_lease()

    def _lose_all(self) -> list:
        """Every sequence is lost (the lease is gone); returns them."""
        lost = list(self._seqs)
        for s in self._seqs.values():
            if s.plan is not None:
                s.plan.valid = False
        self._lost.update(lost)
        self._seqs.clear()
        self._latest = None
        self._unreleased.clear()
        self._to_free.clear()
        self._dirty = False
        self._end_lease()
        return lost

    def _failed(self, e: AttnserveError, leak: int = 0) -> AttnserveError:
        """The error to raise for a failed call: a lease that expired loses
        every sequence (SequencesLost); an outcome that is unknown marks the
        lease's holdings for reconciliation (without a lease, `leak` pages
        are counted as leaked)."""
        if isinstance(e, LeaseExpired):
            lost = self._lose_all()
            return SequencesLost(lost, _LEASE_GONE, method=e.method) if lost else e
        if isinstance(e, StaleIncarnation):
            return e  # the server restarted: nothing is held there
        if outcome_unknown(e):
            if self._lease is not None:
                self._dirty = True
            else:
                self._leaked += leak
        return e

    # ------------------------------------------------------------ planning
    def _validate(self, seq_ids: Sequence, q_lens) -> np.ndarray:
        if len(seq_ids) == 0:
            raise ValueError("plan: seq_ids is empty")
        lens = np.asarray(q_lens)
        if lens.ndim != 1:
            raise ValueError(f"plan: q_lens must be one integer per sequence (1-D), not of "
                             f"shape {lens.shape}")
        if len(seq_ids) != len(lens):
            raise ValueError(f"plan: {len(seq_ids)} seq_ids but {len(lens)} q_lens")
        if len(set(seq_ids)) != len(seq_ids):
            raise ValueError("plan: seq_ids has duplicates")
        if lens.dtype.kind not in "iu":
            raise TypeError(f"plan: q_lens must be integers, not {lens.dtype}")
        if (lens < 0).any():
            raise ValueError(f"plan: q_lens[{int(np.argmax(lens < 0))}] is negative")
        if lens.sum(dtype=np.float64) > _MAX_STEP_TOKENS:
            raise ValueError(f"plan: q_lens add up to {int(lens.sum(dtype=np.float64))} tokens, "
                             f"more than a step's {_MAX_STEP_TOKENS} (2^31 - 1)")
        return lens.astype(np.int64)

    def _pages_needed(self, page_size: int, seq_ids: Sequence, lens: np.ndarray) -> list:
        needs = []
        for sid, q_len in zip(seq_ids, lens.tolist()):
            s = self._seqs.get(sid)
            length = s.length if s is not None else 0
            held = len(s.pages) if s is not None else 0
            needs.append(max(0, -(-(length + q_len) // page_size) - held))
        return needs

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
            s.unwritten = set()
        self._latest = plan

    def _retire(self, plan: Optional[Plan]) -> None:
        if plan is not None and plan.valid:
            plan.valid = False
            if plan.plan_id:
                self._unreleased.append(plan.plan_id)

    def _live_plan_ids(self) -> set:
        return {s.plan.plan_id for s in self._seqs.values()
                if s.plan is not None and s.plan.valid and s.plan.plan_id}

    def _plan_for_run(self, plan: Optional[Plan]) -> Plan:
        plan = self._latest if plan is None else plan
        if plan is None:
            raise RuntimeError("run: no plan; call plan() first")
        if not plan.valid:
            lost = [sid for sid in plan.seq_ids if sid in self._lost]
            if lost:
                raise SequencesLost(lost, _LEASE_GONE, method="run")
            raise RuntimeError(f"run: the plan of step {plan.step} is stale (a later plan or "
                               "finish() changed one of its sequences)")
        return plan

    def _run_failed(self, plan: Plan, layer: int, e: AttnserveError, lease) -> AttnserveError:
        """A run() of `plan` failed with e (under `lease`, the lease then)."""
        if isinstance(e, LeaseExpired):
            if lease is not None and lease is self._lease:
                return self._failed(e)
            lost = [sid for sid in plan.seq_ids if sid in self._lost]
            return SequencesLost(lost, _LEASE_GONE, method="run") if lost else e
        self._mark_unwritten(plan, layer)
        return e

    def _mark_unwritten(self, plan: Plan, layer: int) -> None:
        """A run() of `plan` failed or was interrupted: it may or may not have
        appended this layer's rows."""
        if plan.valid:  # the latest plan of each of its sequences
            appended = plan.append_lens if plan.append_lens is not None else plan.q_lens
            for sid, n in zip(plan.seq_ids, appended.tolist()):
                if n:
                    self._seqs[sid].unwritten.add(layer)

    def _check_layer(self, layer) -> int:
        """run()'s layer, before anything is sent: a layer the server does not
        have is refused here, without marking the plan's sequences."""
        num_layers = self.client.server_info.num_layers
        if isinstance(layer, bool) or not isinstance(layer, (int, np.integer)):
            raise TypeError(f"run: layer must be an int, not {type(layer).__name__}")
        if not 0 <= layer < num_layers:
            raise ValueError(f"run: layer={int(layer)} is outside [0, {num_layers}) "
                             "(the server's num_layers)")
        return int(layer)

    def _interrupted(self, flow) -> None:
        """A call of `flow` was interrupted (a cancelled task, KeyboardInterrupt):
        its outcome is unknown. The flow settles its bookkeeping as for a call
        whose reply was lost, but makes no further call: what it would have
        freed is left to the next call (the lease's reconciliation; without a
        lease, _to_free)."""
        self._interrupting = True
        try:
            flow.throw(Cancelled("the call was interrupted; its outcome is unknown"))
        except BaseException:  # noqa: B036 - the interruption is what the caller sees
            pass
        finally:
            flow.close()
            self._interrupting = False
            if self._lease is not None:
                self._dirty = True

    def _run_ok(self, plan: Plan, layer: int) -> None:
        if plan.valid:
            for sid in plan.seq_ids:
                self._seqs[sid].unwritten.discard(layer)

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
            s.unwritten = set()
            if s.length == 0 and not s.pages:
                del self._seqs[sid]
        if self._latest is plan:
            self._latest = None
        return freed

    # ------------------------------------------------------------ flows
    # Generators that yield the calls they make (_call(...), or _START_LEASE)
    # and get their results back; a failed call is thrown into them.

    def _prepare(self):
        """Before a call that allocates: the lease (a new one when there is
        none, every sequence lost when it expired) and the reconciliation of
        what a failed call left in doubt."""
        if not self.leases:
            if self._to_free:
                yield from self._free_pending()
            return
        if self._lease is not None and self._lease.expired:
            lost = self._lose_all()
            if lost:
                raise SequencesLost(lost, _LEASE_GONE, method="plan")
        if self._lease is not None and self._dirty:
            try:
                yield from self._reconcile()
            except (SequencesLost, StaleIncarnation):
                raise
            except AttnserveError:
                # Still in doubt: the lease's, which no one else can be
                # given; a later call reconciles them. A lease found gone
                # with no sequence under it: a new one below.
                pass
        if self._lease is None:
            try:
                yield from self._revoke_ended()  # best effort: they also end by themselves
            except AttnserveError:
                pass
            # A fresh fork takes the client's incarnation as it is now.
            self._rpc = self.client.fork()
            try:
                self._lease = yield _START_LEASE
            except Unimplemented:
                self.leases = False  # a server without leases: as before them
                self._rpc = self.client

    def _reconcile(self):
        """Frees what the lease holds that no live sequence owns and releases
        the plans the manager does not know (ListHoldings)."""
        lease_id = self._lease.lease_id
        try:
            listed = yield _call("list_holdings", lease_id)
        except AttnserveError as e:
            raise self._failed(e) from None
        held_pages, held_plans = set(), ()
        for info in listed.leases:
            if info.lease_id == lease_id:
                held_pages, held_plans = set(info.holdings.pages), info.holdings.plans
        # Plans first: a plan pins its pages.
        live = self._live_plan_ids()
        for plan_id in held_plans:
            if plan_id in live:
                continue
            try:
                yield _call("release_plan", plan_id)
            except NotFound:
                pass
            except AttnserveError as e:
                raise self._failed(e) from None
        self._unreleased.clear()
        owned, missing = set(), []
        for sid, s in self._seqs.items():
            owned.update(s.pages)
            if not held_pages.issuperset(s.pages):
                missing.append(sid)
        unowned = sorted(held_pages - owned)
        if unowned:
            try:
                yield _call("free_pages", unowned)
            except AttnserveError as e:
                raise self._failed(e) from None
        self._dirty = False
        if missing:
            # Pages of a live sequence the lease no longer holds: freed behind
            # the manager's back. Never attend over them again.
            for sid in missing:
                self._retire(self._seqs.pop(sid).plan)
                self._lost.add(sid)
            raise SequencesLost(missing, "pages of theirs are no longer held under the lease")

    def _release_stale(self):
        """ReleasePlan of the stale server plans; the first failure raises.
        NOT_FOUND counts as released; plan ids are random and never reused,
        so a release whose outcome is unknown is simply tried again."""
        while self._unreleased:
            try:
                yield _call("release_plan", self._unreleased[-1])
            except NotFound:
                pass
            self._unreleased.pop()

    def _revoke_ended(self):
        while self._unrevoked:
            try:
                yield _call("revoke_lease", self._unrevoked[-1])
            except StaleIncarnation:
                self._unrevoked.clear()  # the server restarted: none of them is left
                return
            self._unrevoked.pop()

    def _free_pending(self):
        """Without a lease: FreePages of _to_free, best effort."""
        pages, self._to_free = self._to_free, []
        try:
            yield from self._release_stale()
        except AttnserveError:
            self._to_free = pages
            return
        try:
            yield _call("free_pages", pages)
        except (StaleIncarnation, LeaseExpired):
            pass  # gone with the server or the lease
        except AttnserveError as e:
            if not outcome_unknown(e) and isinstance(e, FailedPrecondition):
                self._to_free = pages  # still pinned by a plan: the next call tries again
            else:
                self._leaked += len(pages)  # never freed twice

    def _free_unowned(self, pages: list):
        """Frees pages no sequence owns any more (and the stale plans first)."""
        if self.leases and self._lease is None:
            return  # what a lease-mode manager held went with its lease
        if self._interrupting:
            # No call now: the lease's next reconciliation frees them, or
            # (without a lease) the next call's _free_pending.
            if self._lease is not None:
                self._dirty = True
            else:
                self._to_free.extend(pages)
            return
        if self._lease is not None:
            # With the lease every failure is settled by the next
            # reconciliation: what the lease still holds and no sequence
            # owns is freed then.
            try:
                if self._dirty:
                    yield from self._reconcile()  # frees `pages` too
                else:
                    yield from self._release_stale()
                    if pages:
                        yield _call("free_pages", pages)
            except SequencesLost:
                raise
            except (LeaseExpired, StaleIncarnation) as e:
                raise self._failed(e) from None
            except AttnserveError as e:
                self._dirty = True
                raise _explained(e, "the manager frees what its lease still holds and no "
                                    "sequence owns at its next plan(), finish() or release() "
                                    "(the server, when the lease ends): ") from None
            return
        # Without a lease, a FreePages whose outcome is unknown is never
        # tried again: the pages may belong to another client of the tenant.
        try:
            yield from self._release_stale()
        except (LeaseExpired, StaleIncarnation) as e:
            raise self._failed(e) from None
        except AttnserveError as e:
            self._to_free.extend(pages)  # pinned by the stale plans, surely held
            raise _explained(e, "the pages are freed at a later call, once their plans are "
                                "released: ") from None
        if pages:
            try:
                yield _call("free_pages", pages)
            except (LeaseExpired, StaleIncarnation) as e:
                raise self._failed(e) from None
            except AttnserveError as e:
                if not outcome_unknown(e) and isinstance(e, FailedPrecondition):
                    # Pinned by a plan whose CreatePlan reply was lost: the
                    # server drops it after --plan_idle_timeout_s.
                    self._to_free.extend(pages)
                    raise _explained(e, "the pages are freed at a later call, once the plans "
                                        "that pin them are gone: ") from None
                self._leaked += len(pages)
                raise _explained(e, "pages that may or may not have been freed are leaked "
                                    "(leaked_pages), never freed or reused: ") from None
        if self._to_free:
            yield from self._free_pending()

    def _plan_flow(self, page_size: int, seq_ids: Sequence, append_lens, q_rows=None,
                   kv_keys_after=None, apply_sinks=None):
        lens = self._validate(seq_ids, append_lens)
        rows = after = None
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
        lost = [sid for sid in seq_ids if sid in self._lost]
        if lost:
            raise SequencesLost(lost, _LEASE_GONE, method="plan")
        self.check_written(*seq_ids)
        yield from self._prepare()
        # _prepare may have waited on the server (a reconciliation, a new
        # lease) while a run() lost the sequences: they stay lost until
        # finish(), which waits for the lock this flow holds.
        lost = [sid for sid in seq_ids if sid in self._lost]
        if lost:
            raise SequencesLost(lost, _LEASE_GONE, method="plan")
        lease = self._lease
        needs = self._pages_needed(page_size, seq_ids, lens)
        total = sum(needs)
        new_pages = []
        if total:
            try:
                new_pages = yield _call("allocate_pages", total)
            except AttnserveError as e:
                raise self._failed(e, leak=total) from None
            self._check_unchanged(seq_ids, lease)
        plan, grown = self._lay_out(page_size, seq_ids, lens, needs, new_pages, rows,
                                    kv_keys_after, apply_sinks)
        registered = False
        if self.server_plans:
            try:
                self._plan_layout(plan, (yield _call("create_plan", *self._create_args(plan),
                                                     **self._create_kwargs(plan))))
                registered = True
            except Unimplemented:
                self.server_plans = False  # a server without plans: send the layout
            except (LeaseExpired, StaleIncarnation) as e:
                raise self._failed(e) from None
            except AttnserveError as e:
                if self._lease is not None and outcome_unknown(e):
                    # The plan may exist, pinning the new pages: the next call
                    # releases it and frees them (the lease lists both).
                    self._dirty = True
                elif new_pages:
                    try:
                        yield from self._free_unowned(new_pages)
                    except AttnserveError:
                        pass  # the first error is the one to report
                raise
        self._check_unchanged(seq_ids, lease)
        if not registered:
            plan.layout = self._layout_bytes(plan)
        self._apply(plan, grown)
        try:  # a failed release stays queued for the next plan or finish
            yield from self._release_stale()
        except LeaseExpired as e:
            raise self._failed(e) from None  # the plan just made went with the lease
        except AttnserveError:
            pass
        return plan

    def _check_unchanged(self, seq_ids, lease) -> None:
        """A flow that waited on the server checks, before it lays out or
        applies anything, that the lease it started under is still the
        manager's: an AsyncKvManager's run() does not wait for the lock, and
        one whose lease expired loses every sequence (and ends the lease)
        while a plan() waits. Laying out a lost sequence again would start it
        afresh, empty, under its old id: its next run would attend over the
        new rows alone, with no error. The pages just allocated went with the
        old lease."""
        if self._lease is lease:
            return
        lost = [sid for sid in seq_ids if sid in self._lost]
        if lost:
            raise SequencesLost(lost, _LEASE_GONE, method="plan")
        raise LeaseExpired("the lease ended while the plan waited on the server",
                           method="plan")  # plan() tries once more, under a new lease

    def _undo_flow(self, plan: Plan):
        yield from self._free_unowned(self._undo(plan))

    def _finish_flow(self, seq_ids):
        if len(set(seq_ids)) != len(seq_ids):
            raise ValueError("finish: seq_ids has duplicates")
        missing = [sid for sid in seq_ids if not self.has(sid)]
        if missing:
            raise KeyError(f"finish: unknown sequence(s) {missing}")
        # From here on the sequences are gone, whatever the server answers.
        pages = []
        unreleased_before = len(self._unreleased)
        for sid in seq_ids:
            if sid in self._lost:
                self._lost.discard(sid)  # its pages went with the lease
                continue
            s = self._seqs.pop(sid)
            pages.extend(s.pages)
            self._retire(s.plan)  # the plans pin the pages: released first
        if self._latest is not None and not self._latest.valid:
            self._latest = None
        if not pages and len(self._unreleased) == unreleased_before:
            # Nothing of these sequences to free (lost ones, or empty): no RPC;
            # what earlier calls left pending waits for the next call.
            return
        if self._lease is not None and self._lease.expired:
            lost = self._lose_all()  # these sequences' pages went with it
            if lost:
                raise SequencesLost(lost, _LEASE_GONE, method="finish")
            return
        try:
            yield from self._free_unowned(pages)
        except SequencesLost:
            raise
        except LeaseExpired:
            return  # their pages went with it, and no other sequence was lost
        except StaleIncarnation as e:
            raise _explained(e, "finish: the sequences are forgotten (the server restarted: "
                                "their pages are gone): ") from None
        except AttnserveError as e:
            raise _explained(e, "finish: the sequences are forgotten, but freeing their pages "
                                "was not confirmed; ") from None

    def _release_flow(self):
        # finish() first: FreePages answers once the pages are zeroed and free.
        error = None
        every = list(self._seqs) + list(self._lost)
        try:
            if every:
                yield from self._finish_flow(every)
            else:
                yield from self._free_unowned([])
        except AttnserveError as e:
            error = e
        if not self.leases:
            if error is not None:
                raise error
            return
        # Then the lease ends: revoking it releases whatever a failure left under it.
        self._clear()
        if self._lease is not None:
            self._unrevoked.append(self._lease.lease_id)
            self._end_lease()
        try:
            yield from self._revoke_ended()
        except AttnserveError as e:
            raise error or _explained(e, "release: every sequence is forgotten, but revoking "
                                         "the manager's lease was not confirmed; it is tried "
                                         "again at the next call, and the server frees "
                                         "everything under the lease when it ends, within its "
                                         "ttl: ") from None
        # Revoked: nothing is left held, whatever finish() said.


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
      lease: hold the pages and plans under a lease of the manager's own
        (default; a client.fork() with an attnserve.Lease). False: the
        client's requests as they are, as before leases.
      lease_ttl: the lease's time-to-live in seconds (None: the server's
        --lease_default_ttl_s).

    close() (or the with block's end) revokes the lease: everything the
    manager still holds is freed.
    """

    def __init__(self, client, *, causal: bool = True, sm_scale: Optional[float] = None,
                 lse_base: str = "2", server_plans: bool = True, lease: bool = True,
                 lease_ttl: Optional[float] = None, options=None, layer_options=None):
        super().__init__(client, causal=causal, sm_scale=sm_scale, lse_base=lse_base,
                         server_plans=server_plans, lease=lease, lease_ttl=lease_ttl,
                         options=options, layer_options=layer_options)
        self.page_size = client.server_info.page_size

    def _drive(self, flow):
        """Runs a flow with the blocking client."""
        result, error = None, None
        while True:
            try:
                op = flow.send(result) if error is None else flow.throw(error)
            except StopIteration as stop:
                return stop.value
            result, error = None, None
            try:
                if op is _START_LEASE:
                    result = Lease(self._rpc, self.lease_ttl)
                    # A manager dropped without close(): the lease stops being
                    # renewed, and the server frees what it holds within its ttl.
                    weakref.finalize(self, result.abandon)
                else:
                    method, args, kwargs = op
                    result = getattr(self._rpc, method)(*args, **kwargs)
            except AttnserveError as e:
                error = e
            except BaseException:
                self._interrupted(flow)
                raise

    def plan(self, seq_ids: Sequence, q_lens) -> Plan:
        """Grows seq_ids[b] by q_lens[b] tokens and lays the step out.

        A sequence not seen before starts empty. Allocates the pages the step
        needs in one call and registers the layout; on failure nothing
        changes: ValueError/TypeError for bad arguments, ResourceExhausted,
        FailedPrecondition for a sequence whose last run() of some layer
        failed (run it again first), SequencesLost for lost sequences, or the
        failed call's error. Lengths advance here, once per step: every
        layer's run() then appends at the same positions.
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
        seq_ids = list(seq_ids)
        try:
            return self._drive(self._plan_flow(self.page_size, seq_ids, append_lens, q_rows,
                                               kv_keys_after, apply_sinks))
        except LeaseExpired:
            # The lease was found gone with no sequence under it: once more,
            # with a new one.
            return self._drive(self._plan_flow(self.page_size, seq_ids, append_lens, q_rows,
                                               kv_keys_after, apply_sinks))

    def run(self, layer: int, q, k_new, v_new=None, *, plan: Optional[Plan] = None,
            **kwargs) -> PrefillResult:
        """One layer of the step: appends k_new, v_new [total_q, kv_heads, head_dim]
        at the plan's slots, then attends with q [total_q, qo_heads, head_dim].
        An MLA server (server_info.mla): k_new the latent rows [total_q, 1,
        qk_head_dim], v_new None; the output is v_head_dim wide.

        plan defaults to the latest; any plan whose sequences no later plan or
        finish() touched may run (e.g. two micro-batches). kwargs go to
        Client.prefill_layout (out, device, timeout). A run() that fails may
        or may not have appended that layer's rows: until that layer of that
        plan has run again successfully, plan() refuses its sequences.
        """
        p = self._plan_for_run(plan)
        layer = self._check_layer(layer)
        lease = self._lease
        try:
            r = self._rpc.prefill_layout(layer, q, p.layout, k_new, v_new,
                                         options=self._layer_options(p, layer), **kwargs)
        except AttnserveError as e:
            raise self._run_failed(p, layer, e, lease) from None
        except BaseException:  # interrupted (KeyboardInterrupt, ...): it may have appended
            self._mark_unwritten(p, layer)
            raise
        self._run_ok(p, layer)
        return r

    def undo(self, plan: Plan) -> None:
        """Takes back plan, the latest plan of each of its sequences: their
        lengths go back, the pages it allocated are freed, its server plan is
        released and it goes stale (as do the plans it had made stale). For a
        cluster whose step failed on another server. The bookkeeping is taken
        back whatever happens; an error says the frees failed (as finish())."""
        self._drive(self._undo_flow(plan))

    def finish(self, *seq_ids: Hashable) -> None:
        """Releases the sequences' plans, frees their pages (one FreePages) and
        forgets them. Unknown ids (KeyError) or duplicates (ValueError) change
        nothing; otherwise the sequences are forgotten whatever happens (lost
        ones without an RPC), and an error says that freeing their pages could
        not be confirmed (with the lease, they are freed at the next call or
        when the lease ends; without, pages that may or may not have been
        freed count in leaked_pages)."""
        self._drive(self._finish_flow(seq_ids))

    def release(self) -> None:
        """Forgets every sequence (lost ones too) and frees everything the
        manager holds: finish() of every sequence (FreePages answers once the
        pages are zeroed and free), then, with the lease, its revocation,
        which releases whatever a failure left under it (no error once that
        succeeds; if it fails, it is tried again at the next call, and the
        lease ends within its ttl anyway). The next plan() starts a new
        lease."""
        self._drive(self._release_flow())

    def close(self) -> None:
        """release(), best effort: errors are swallowed."""
        try:
            self.release()
        except AttnserveError:
            pass

    def __enter__(self) -> "KvManager":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class AsyncKvManager(_Bookkeeping):
    """KvManager over an attnserve.aio.AsyncClient: plan, run and finish are awaited.

    plan(), finish() and release() are serialized by a lock; run() calls may
    overlap (two micro-batches' plans in flight at once). `await close()`
    (or `async with`) revokes the lease.
    """

    def __init__(self, client, *, causal: bool = True, sm_scale: Optional[float] = None,
                 lse_base: str = "2", server_plans: bool = True, lease: bool = True,
                 lease_ttl: Optional[float] = None, options=None, layer_options=None):
        super().__init__(client, causal=causal, sm_scale=sm_scale, lse_base=lse_base,
                         server_plans=server_plans, lease=lease, lease_ttl=lease_ttl,
                         options=options, layer_options=layer_options)
        self._lock_made: Optional[asyncio.Lock] = None  # made in the loop that uses it

    @property
    def page_size(self) -> int:
        return self.client.server_info.page_size

    @property
    def _lock(self) -> asyncio.Lock:
        if self._lock_made is None:
            self._lock_made = asyncio.Lock()
        return self._lock_made

    async def _drive(self, flow):
        """Runs a flow with the asyncio client."""
        result, error = None, None
        while True:
            try:
                op = flow.send(result) if error is None else flow.throw(error)
            except StopIteration as stop:
                return stop.value
            result, error = None, None
            try:
                if op is _START_LEASE:
                    result = await AsyncLease.start(self._rpc, self.lease_ttl)
                else:
                    method, args, kwargs = op
                    result = await getattr(self._rpc, method)(*args, **kwargs)
            except AttnserveError as e:
                error = e
            except BaseException:
                self._interrupted(flow)
                raise

    async def plan(self, seq_ids: Sequence, q_lens) -> Plan:
        seq_ids = list(seq_ids)
        async with self._lock:
            await self.client._ensure_info()
            try:
                return await self._drive(self._plan_flow(self.page_size, seq_ids, q_lens))
            except LeaseExpired:
                return await self._drive(self._plan_flow(self.page_size, seq_ids, q_lens))

    async def run(self, layer: int, q, k_new, v_new=None, *, plan: Optional[Plan] = None,
                  **kwargs) -> PrefillResult:
        p = self._plan_for_run(plan)
        layer = self._check_layer(layer)
        lease = self._lease
        try:
            r = await self._rpc.prefill_layout(layer, q, p.layout, k_new, v_new,
                                               options=self._layer_options(p, layer), **kwargs)
        except AttnserveError as e:
            raise self._run_failed(p, layer, e, lease) from None
        except BaseException:  # cancelled (asyncio.wait_for, task.cancel()): it may have appended
            self._mark_unwritten(p, layer)
            raise
        self._run_ok(p, layer)
        return r

    async def finish(self, *seq_ids: Hashable) -> None:
        async with self._lock:
            await self._drive(self._finish_flow(seq_ids))

    async def release(self) -> None:
        async with self._lock:
            await self._drive(self._release_flow())

    async def close(self) -> None:
        try:
            await self.release()
        except AttnserveError:
            pass

    async def __aenter__(self) -> "AsyncKvManager":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()
