"""The KV managers' flows (attnserve.kv_manager): plan, undo, finish and
release as generators that yield the calls they make (_call(...), or
_START_LEASE) and get their results back, a failed call thrown into them;
KvManager runs them with the blocking client, AsyncKvManager awaits them."""

from __future__ import annotations

from typing import Sequence

import numpy as np

from attnserve._kv_state import _LEASE_GONE, _START_LEASE, Plan, _call, _explained, _State
from attnserve.errors import (AttnserveError, FailedPrecondition, LeaseExpired, NotFound,
                              SequencesLost, StaleIncarnation, Unimplemented, outcome_unknown)
from attnserve.layout import _ints

_INT32_MAX = (1 << 31) - 1


class _Bookkeeping(_State):
    """_State and the flows of plan, undo, finish and release."""

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
            # the manager's back. Never attend over them again. The other
            # sequences of their plans keep their rows, but the layers of that
            # step that had not run can no longer run for them.
            gone = set(missing)
            for sid in missing:
                self._mark_unrun(self._seqs[sid].plan, gone)
            for sid in missing:
                self._retire(self._seqs.pop(sid).plan)
                self._lost.add(sid)
            raise SequencesLost(missing, "pages of theirs are no longer held under the lease")

    def _release_stale(self):
        """ReleasePlan of the stale server plans; the first failure raises.
        NOT_FOUND counts as released; plan ids are random and never reused,
        so a release whose outcome is unknown is simply tried again."""
        while self._unreleased:
            plan_id = self._unreleased[-1]
            try:
                yield _call("release_plan", plan_id)
            except NotFound:
                pass
            # While the call waited, a lost lease may have cleared the list.
            if self._unreleased and self._unreleased[-1] == plan_id:
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
            rows = np.asarray(_ints(q_rows, "plan_rows: q_rows"), dtype=np.int64)
            if len(rows) != len(lens) or (rows < lens).any():
                raise ValueError("plan_rows: q_rows must have one entry per sequence, each "
                                 ">= its append_lens")
            if rows.sum(dtype=np.float64) > _INT32_MAX:
                raise ValueError(f"plan_rows: q_rows add up to {int(rows.sum(dtype=np.float64))} "
                                 f"rows, more than {_INT32_MAX} (2^31 - 1)")
        if kv_keys_after is not None:
            after = np.asarray(_ints(kv_keys_after, "plan_rows: kv_keys_after"), dtype=np.int64)
            if len(after) != len(lens) or (after < 0).any() or (after > _INT32_MAX).any():
                raise ValueError("plan_rows: kv_keys_after must have one entry in [0, 2^31 - 1] "
                                 "per sequence")
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
        # The server plans the last plan() or finish() left stale: released
        # here, before anything changes, so that no call is left after the
        # commit below (one interrupted there would leave the caller thinking
        # a committed plan had failed).
        try:
            yield from self._release_stale()
        except (LeaseExpired, StaleIncarnation) as e:
            raise self._failed(e) from None
        except AttnserveError:
            pass  # stays queued for the next plan or finish
        self._check_unchanged(seq_ids, lease)
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
                                    after, apply_sinks)
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
        self._apply(plan, grown)  # the plans it makes stale: released by the next call
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
