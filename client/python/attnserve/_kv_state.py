"""The KV managers' state (attnserve.kv_manager): sequences, their pages,
the layout of a step, the lease and what failed calls left in doubt, with
no RPC of its own. The flows that make the calls are in _kv_flows; the
managers that run them in kv_manager. docs/kv_manager.md is the contract."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Hashable, Optional, Sequence

import numpy as np

from attnserve.layout import PrefillLayout, _int32
from attnserve.layout import _options as _as_options
from attnserve.errors import (AttnserveError, Cancelled, FailedPrecondition, LeaseExpired,
                              SequencesLost, StaleIncarnation, outcome_unknown)

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
    # The manager's records of seq_ids once committed (_State._apply): a
    # failed run() marks these, not whatever sequence has the id by then.
    _sequences: tuple = field(default=(), repr=False, compare=False)
    # The layers a run() of this plan completed while it was live.
    _ran: set = field(default_factory=set, repr=False, compare=False)

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


def _checked_layer(layer, num_layers: int, whose: str) -> int:
    """run()'s layer as an int: TypeError for a non-integer, ValueError for
    one outside [0, num_layers) (`whose` num_layers: "the server's")."""
    if isinstance(layer, bool) or not isinstance(layer, (int, np.integer)):
        raise TypeError(f"run: layer must be an int, not {type(layer).__name__}")
    if not 0 <= layer < num_layers:
        raise ValueError(f"run: layer={int(layer)} is outside [0, {num_layers}) "
                         f"({whose} num_layers)")
    return int(layer)


def _explained(e: AttnserveError, prefix: str) -> AttnserveError:
    """e's class, code and method, with `prefix` before its details."""
    if isinstance(e, SequencesLost):
        return e
    return type(e)(prefix + e.details, e.code, e.method)


class _Sequence:
    __slots__ = ("pages", "length", "plan", "unwritten", "lost", "started")

    def __init__(self):
        self.pages: list = []
        self.length = 0
        self.plan: Optional[Plan] = None
        self.unwritten: set = set()  # layers of `plan` whose run() failed
        # (step, layer) of earlier plans whose run() failed after a later
        # plan of the sequence was committed: no run() writes them again.
        self.lost: set = set()
        self.started = 0  # the step of the plan that started it


class _State:
    """Everything but the RPCs: sequences, their pages, the layout of a step,
    the lease and what failed calls left in doubt (the flows that make the
    calls: _kv_flows._Bookkeeping)."""

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
        self.layer_options = {_int32(k, "layer_options key"): _as_options(v)
                              for k, v in (layer_options or {}).items()}
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
        # A KeyboardInterrupt held through a call's last step (KvManager):
        # raised at the next call, before it does anything.
        self._held_interrupt = False

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
    def page_size(self) -> int:
        """The server's page size, as the client last read it: a client
        reconnect()ed to a server restarted with another --page_size gives
        the new one (after reset())."""
        return self.client.server_info.page_size

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
            if s is None:
                continue
            if s.unwritten:
                key = (s.plan.step if s.plan is not None else 0, tuple(sorted(s.unwritten)))
                live = s.plan is not None and s.plan.valid
                (groups if live else stale).setdefault(key, []).append(sid)
            for step in sorted({step for step, _ in s.lost}):
                key = (step, tuple(sorted(layer for st, layer in s.lost if st == step)))
                stale.setdefault(key, []).append(sid)

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
            says.append(describe(stale) + ": a run() of that layer failed, was interrupted or "
                        "never completed, and that plan can no longer run (finish() of another "
                        "of its sequences, a later plan or a lost sequence made it stale), so "
                        "their K/V of that step may never be written: finish() the sequences")
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

    def _lease_still(self, lease, op):
        """Before each call of a flow (the drivers ask): (the lease the flow
        works under, an error to throw into the flow instead of the call).
        When the lease the flow started under, or started since, has ended
        behind its back (a run() found it gone while the flow waited on the
        server), the call would go out naming no lease, so for the whole
        tenant: a FreePages could free pages another client of the tenant
        has been given since. It is refused with LeaseExpired instead; only
        starting a new lease and revoking ended ones go on."""
        if lease is None or self._lease is lease:
            return self._lease, None
        if op is _START_LEASE or op[0] == "revoke_lease":
            return None, None
        return lease, LeaseExpired("the manager's lease ended while the call waited on the server",
                                   method=op[0])

    def _end_lease(self) -> None:
        if self._lease is not None:
            self._lease.abandon()
        self._lease = None

    def reset(self, restarted: bool = True) -> None:
        """Forgets every sequence and plan without an RPC: after a server
        restart, or (restarted False) once the manager's lease is found gone
        on a server that did not restart, which may still hold the earlier
        leases left to revoke (the next call or release() revokes them)."""
        if not restarted and self._lease is not None:
            # Found gone, most likely; revoking it again costs nothing if so.
            self._unrevoked.append(self._lease.lease_id)
        self._clear()
        self._end_lease()
        if restarted:
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
                s.started = plan.step
            s.pages, s.length = pages, length
            if s.plan is not None and s.unwritten:
                # A run() of the plan this one replaces failed while it was
                # being made (after plan() checked): no run() writes those
                # rows again.
                s.lost.update((s.plan.step, layer) for layer in s.unwritten)
            self._retire(s.plan)
            s.plan = plan
            s.unwritten = set()
        plan._sequences = tuple(self._seqs[sid] for sid in plan.seq_ids)
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
        first = self._seqs.get(plan.seq_ids[0]) if plan.seq_ids else None
        if first is None or first.plan is not plan:
            raise RuntimeError(f"run: the plan of step {plan.step} was made by another "
                               "KvManager: run it there")
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
        appended this layer's rows. Each of its sequences the manager still
        holds records it, whether or not the plan went stale while the run
        was in flight (a finish() of another of its sequences, a later plan
        of this one: AsyncKvManager lets them overlap a run), so that plan()
        refuses the sequence (check_written) rather than attend over rows
        that may never have been written."""
        appended = plan.append_lens if plan.append_lens is not None else plan.q_lens
        for sid, s, n in zip(plan.seq_ids, plan._sequences, appended.tolist()):
            if not n or self._seqs.get(sid) is not s:
                continue  # finished since: its pages went with it
            if s.plan is plan:
                s.unwritten.add(layer)
            else:
                s.lost.add((plan.step, layer))

    def _check_layer(self, layer) -> int:
        """run()'s layer, before anything is sent: a layer the server does not
        have is refused here, without marking the plan's sequences."""
        return _checked_layer(layer, self.client.server_info.num_layers, "the server's")

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
            plan._ran.add(layer)
            for sid in plan.seq_ids:
                self._seqs[sid].unwritten.discard(layer)

    def _mark_unrun(self, plan: Optional[Plan], gone: set) -> None:
        """`plan` goes stale with the sequences `gone` lost mid-step: its other
        sequences keep their rows, but record the layers no run() of it
        completed as lost (no run() writes them now), so that plan() refuses
        them until they are finished."""
        if plan is None or not plan.valid:
            return
        unrun = [layer for layer in range(self.client.server_info.num_layers)
                 if layer not in plan._ran]
        appended = plan.append_lens if plan.append_lens is not None else plan.q_lens
        for sid, s, n in zip(plan.seq_ids, plan._sequences, appended.tolist()):
            if n and sid not in gone and self._seqs.get(sid) is s and s.plan is plan:
                s.lost.update((plan.step, layer) for layer in unrun)

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
            if s.started == plan.step:  # this plan started it; one that existed before stays
                del self._seqs[sid]
        if self._latest is plan:
            self._latest = None
        return freed
