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
generators that yield the calls they make (attnserve._kv_flows, over the
state of attnserve._kv_state); KvManager runs them with the blocking client,
AsyncKvManager awaits them.
"""

from __future__ import annotations

import asyncio
import weakref
from typing import Hashable, Optional, Sequence

from attnserve._interrupts import held_interrupt
from attnserve._kv_flows import _Bookkeeping
from attnserve._kv_state import _START_LEASE, Plan
from attnserve.errors import AttnserveError, LeaseExpired
from attnserve.lease import AsyncLease, Lease
from attnserve.results import PrefillResult

__all__ = ["AsyncKvManager", "KvManager", "Plan"]


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

    def _drive(self, flow, finishing: bool = False):
        """Runs a flow with the blocking client. A KeyboardInterrupt is taken
        while a call waits on the server, or held while the flow's own
        bookkeeping runs (held_interrupt): if the flow then has a call left,
        the call never leaves and the interruption is raised; either way the
        flow settles the interrupted call as one whose outcome is unknown.
        One held through the flow's last step (the call has committed:
        raising it would tell the caller it failed) is raised at the
        manager's next call, before that call does anything. finishing
        (finish, undo, release: they forget whatever happens, and a cluster
        counts on every server's running): one held from an earlier call is
        raised once the flow has ended, not before it starts."""
        held_before = False
        if finishing:
            held_before, self._held_interrupt = self._held_interrupt, False
        else:
            self._raise_held_interrupt()
        result, error = None, None
        lease = self._lease
        try:
            while True:
                hold = held_interrupt()
                try:
                    with hold:
                        op = flow.send(result) if error is None else flow.throw(error)
                except StopIteration as stop:
                    if finishing and (held_before or hold.got):
                        raise KeyboardInterrupt from None
                    self._held_interrupt = hold.got
                    return stop.value
                except BaseException as e:  # the flow's own error: it has ended
                    if hold.got or held_before:
                        raise KeyboardInterrupt from e
                    raise
                if hold.got:
                    raise KeyboardInterrupt
                result, error = None, None
                lease, error = self._lease_still(lease, op)
                if error is not None:
                    continue
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
            # A flow that raised has ended; one still waiting at a call was
            # interrupted there.
            if flow.gi_frame is not None:
                with held_interrupt():  # a second interrupt: the first is raised
                    self._interrupted(flow)
            raise

    def _raise_held_interrupt(self) -> None:
        if self._held_interrupt:
            self._held_interrupt = False
            raise KeyboardInterrupt

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
        self._raise_held_interrupt()
        p = self._plan_for_run(plan)
        layer = self._check_layer(layer)
        lease = self._lease
        try:
            r = self._rpc.prefill_layout(layer, q, p.layout, k_new, v_new,
                                         options=self._layer_options(p, layer), **kwargs)
        except AttnserveError as e:
            raise self._run_failed(p, layer, e, lease) from None
        except BaseException:  # interrupted (KeyboardInterrupt, ...): it may have appended
            with held_interrupt():
                self._mark_unwritten(p, layer)
            raise
        with held_interrupt() as hold:
            self._run_ok(p, layer)
        self._held_interrupt = hold.got  # the layer ran: raised at the next call
        return r

    def undo(self, plan: Plan) -> None:
        """Takes back plan, the latest plan of each of its sequences: their
        lengths go back, the pages it allocated are freed, its server plan is
        released and it goes stale (as do the plans it had made stale). For a
        cluster whose step failed on another server. The bookkeeping is taken
        back whatever happens; an error says the frees failed (as finish())."""
        self._drive(self._undo_flow(plan), finishing=True)

    def finish(self, *seq_ids: Hashable) -> None:
        """Releases the sequences' plans, frees their pages (one FreePages) and
        forgets them. Unknown ids (KeyError) or duplicates (ValueError) change
        nothing; otherwise the sequences are forgotten whatever happens (lost
        ones without an RPC), and an error says that freeing their pages could
        not be confirmed (with the lease, they are freed at the next call or
        when the lease ends; without, pages that may or may not have been
        freed count in leaked_pages)."""
        self._drive(self._finish_flow(seq_ids), finishing=True)

    def release(self) -> None:
        """Forgets every sequence (lost ones too) and frees everything the
        manager holds: finish() of every sequence (FreePages answers once the
        pages are zeroed and free), then, with the lease, its revocation,
        which releases whatever a failure left under it (no error once that
        succeeds; if it fails, it is tried again at the next call, and the
        lease ends within its ttl anyway). The next plan() starts a new
        lease."""
        self._drive(self._release_flow(), finishing=True)

    def close(self) -> None:
        """release(), best effort: errors are swallowed (an interruption held
        from an earlier call is raised once it is done)."""
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
    def _lock(self) -> asyncio.Lock:
        if self._lock_made is None:
            self._lock_made = asyncio.Lock()
        return self._lock_made

    async def _drive(self, flow):
        """Runs a flow with the asyncio client."""
        result, error = None, None
        lease = self._lease
        while True:
            try:
                op = flow.send(result) if error is None else flow.throw(error)
            except StopIteration as stop:
                return stop.value
            result, error = None, None
            lease, error = self._lease_still(lease, op)
            if error is not None:
                continue
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
