"""Many attnserve servers behind one client: placement, routing and context
parallelism.

docs/cluster.md is the guide; client/cluster.h is the C++ twin with the
same semantics. The servers themselves (joining, their info, what a failed
call says about them) are in _cluster_servers.py; where a step's tokens go
in _cluster_placement.py.

    cluster = attnserve.Cluster("dns:///attnserve-pods.attnserve.svc.cluster.local:50051")
    step = cluster.plan([7, 9], [5, 3])          # places 7 and 9
    for layer in range(num_layers):
        q, k, v = project(layer, x, step.positions)    # [8, heads, head_dim] each
        out = cluster.run(layer, q, k, v).output       # one round trip per server
    cluster.finish(7)

One server owns one GPU and its KV cache is local state, so the cluster
keeps each sequence's keys on the servers it placed them on. Every server
has its own attnserve.KvManager (its pages, plans and layouts, exactly as
for a single server); the cluster sits on top with the same plan / run /
finish API. A new sequence goes to the server with the most free pages. A
sequence is spread over several servers, each holding a contiguous range of
its positions, when its server runs out of pages or one step appends at
least split_min_tokens tokens to it; every server holding part of it gets
the sequence's query rows (with kv_keys_after, so the causal mask is the
whole sequence's), and attnserve.merge.merge_states combines the partial
results by LSE.

A server whose incarnation changed has lost its KV: every sequence with keys
there is lost, the call that finds out raises SequencesLost naming them, and
the rest of the cluster keeps working. So is every sequence of a server whose
KvManager's lease expired, or that stayed unreachable for server_lost_after
seconds. finish() forgets every sequence it names whatever happens, and says
which servers could not confirm freeing their pages (docs/cluster.md, "When a
call fails").
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Callable, Hashable, Optional, Sequence

import grpc
import numpy as np

from attnserve import dtypes as _dt
from attnserve.errors import (AttnserveError, DataLoss, DeadlineExceeded, ResourceExhausted,
                              SequencesLost, StaleIncarnation, Unavailable)
from attnserve._interrupts import held_interrupt
from attnserve._cluster_servers import (ClusterServer, _ServerSet,  # noqa: F401
                                        getaddrinfo_resolver)
from attnserve._cluster_placement import (Shard, causal_spread, place_tokens,  # noqa: F401
                                          share_step)
from attnserve._kv_state import _MAX_STEP_TOKENS, _checked_layer, _explained
from attnserve.kv_manager import Plan
from attnserve.merge import merge_states
from attnserve.results import PrefillResult

_DNS = "dns:///"
_LOST_WHY = "a server holding them restarted, lost their pages or could not be reached"


@dataclass
class _Part:
    server: int
    epoch: int              # the server's restart count at plan()
    plan: Plan              # that server's KvManager step
    q_rows: np.ndarray      # [plan rows] the caller's row of each
    append_rows: np.ndarray  # [plan appends] the caller's row of each


def _wait_out(future) -> None:
    """Waits until future has ended, through any further interruptions (a
    part of a step still in flight could append its rows into pages the
    caller frees next and someone else is given)."""
    while not future.done():
        try:
            wait([future])
        except BaseException:  # noqa: B036 - the first interruption is the one raised
            pass


@dataclass
class ClusterStep:
    """One step in the caller's terms.

    seq_ids, q_lens [batch], kv_lens [batch] (lengths after the step),
    qo_indptr [batch + 1] (rows of q, k_new, v_new), positions [total_q]
    (each new token's position in its sequence).
    """

    step: int
    seq_ids: tuple
    q_lens: np.ndarray
    kv_lens: np.ndarray
    qo_indptr: np.ndarray
    positions: np.ndarray
    parts: list = field(default_factory=list, repr=False)
    # [batch]: (part, row, skip) of every server holding part of the
    # sequence: its rows [skip, q_len) come back at `row` of that part's
    # output (a causal row sees nothing of a range that starts after it, so
    # it is not sent there). More than one server means a merge.
    sources: list = field(default_factory=list, repr=False)
    valid: bool = True

    @property
    def total_q(self) -> int:
        return int(self.qo_indptr[-1])


class _Sequence:
    __slots__ = ("shards", "length", "lost", "step")

    def __init__(self):
        self.shards: list = []
        self.length = 0
        self.lost = False
        self.step: Optional[ClusterStep] = None


def _rows(x, idx: np.ndarray):
    """x[idx] for numpy or torch."""
    if _dt.is_torch(x):
        import torch
        return x[torch.as_tensor(idx, dtype=torch.long, device=x.device)]
    if isinstance(x, _dt.RawBits):
        return x[idx]
    return np.asarray(x)[idx]


def _count(x) -> int:
    return int(x.shape[0]) if hasattr(x, "shape") else len(x)


class Cluster(_ServerSet):
    """Sequences over many servers with KvManager's plan / run / finish.

    Args:
      targets: "host:port" addresses, or one "dns:///NAME:PORT" whose
        addresses (socket.getaddrinfo; a Kubernetes headless Service) are
        the servers. A single string is one target.
      split_min_tokens: a step that appends at least this many tokens to one
        sequence spreads them over several servers, in ranges that share the
        causal attention work evenly (causal_spread; 0: never; a sequence
        still spills over when its server is full).
      max_servers_per_sequence: at most this many servers hold one sequence
        (0: any number).
      refresh_interval: plan() runs refresh() (a dns:/// target resolved
        again, every server's info read: free pages, restarts, unreachable
        servers back) once this many seconds have passed since the last, or
        when no server takes new sequences.
      server_lost_after: a server whose calls fail with Unavailable or
        DeadlineExceeded for this many seconds (from the first such failure,
        with no success since) has its sequences declared lost
        (SequencesLost): finish() of them then succeeds without it. 0: at its
        first such failure; None or a negative value: never. The default, 60, is twice the
        servers' default lease ttl.
      resolver: (host, port) -> ["ip:port", ...] for dns:/// (default
        getaddrinfo_resolver; tests put their own).
      causal, sm_scale, lse_base, server_plans, lease, lease_ttl, options,
        layer_options: every server's KvManager's (lease: its pages and plans
        under a lease of its own, the default; options and layer_options:
        attention variants; a sequence spread over servers takes its sinks on
        the server holding its first keys only, so that the merge counts them
        once).
      client_kwargs: for every server's attnserve.Client (token, tls_ca,
        timeout, ...).

    Not thread-safe: one thread plans, runs and finishes (run() itself calls
    the servers concurrently).
    """

    def __init__(self, targets, *, split_min_tokens: int = 0,
                 max_servers_per_sequence: int = 0, refresh_interval: float = 30.0,
                 resolver: Optional[Callable[[str, str], list]] = None, causal: bool = True,
                 sm_scale: Optional[float] = None, lse_base: str = "2",
                 server_plans: bool = True, lease: bool = True,
                 lease_ttl: Optional[float] = None, server_lost_after: Optional[float] = 60.0,
                 options=None, layer_options=None, **client_kwargs):
        if isinstance(targets, str):
            targets = [targets]
        targets = list(targets)
        if not targets:
            raise ValueError("Cluster: targets is empty")
        if split_min_tokens < 0 or max_servers_per_sequence < 0:
            raise ValueError("Cluster: split_min_tokens and max_servers_per_sequence must be >= 0")
        self.split_min_tokens = int(split_min_tokens)
        self.max_servers_per_sequence = int(max_servers_per_sequence)
        self.refresh_interval = float(refresh_interval)
        # None or a negative value: never (as C++'s negative server_lost_after_s).
        self.server_lost_after = (None if server_lost_after is None or float(server_lost_after) < 0
                                  else float(server_lost_after))
        self.lse_base = lse_base
        self._kv_options = dict(causal=causal, sm_scale=sm_scale, lse_base=lse_base,
                                server_plans=server_plans, lease=lease, lease_ttl=lease_ttl,
                                options=options, layer_options=layer_options)
        self._client_kwargs = client_kwargs
        self._resolver = resolver or getaddrinfo_resolver
        self._dns: Optional[tuple] = None
        self._refreshed_at = time.monotonic()
        self._servers: list = []
        self._geometry: Optional[dict] = None
        self._first_info = None  # the first server's ServerInfo, as it joined
        # FP8 servers: the KV scales set through set_kv_scales, given again to
        # a server that joins or restarts (its scales start at 1.0).
        self._kv_scales: dict = {}
        self._seqs: dict = {}
        self._step = 0
        self._latest: Optional[ClusterStep] = None
        self._pool: Optional[ThreadPoolExecutor] = None
        self._pool_size = 0
        addresses = []
        for t in targets:
            if t.startswith(_DNS):
                if len(targets) != 1:
                    raise ValueError(f"Cluster: a dns:/// target must be the only one, not one "
                                     f"of {len(targets)}")
                host, sep, port = t[len(_DNS):].rpartition(":")
                if not sep or not host or not port:
                    raise ValueError(f"Cluster: target {t}: needs dns:///NAME:PORT")
                self._dns = (host, port)
            else:
                addresses.append(t)
        if self._dns is not None:
            addresses = list(self._resolver(*self._dns))
            if not addresses:
                raise AttnserveError(f"{targets[0]} resolves to no address",
                                     grpc.StatusCode.UNAVAILABLE)
        try:
            for a in addresses:
                self._add_server(a)
        except BaseException:
            self.close()
            raise

    def __enter__(self) -> "Cluster":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------ steps
    def plan(self, seq_ids: Sequence, q_lens) -> ClusterStep:
        """As KvManager.plan: seq_ids[b] grows by q_lens[b] tokens.

        New sequences are placed on the server with the most free pages;
        appended tokens go to each sequence's last server (spilling to others
        when it is full, or spread when split_min_tokens says so). Atomic: on
        any error nothing changes. SequencesLost for lost sequences among
        seq_ids; ResourceExhausted when the cluster has too few free pages;
        FailedPrecondition for a sequence whose last run() of some layer
        failed on a server (run it again first).
        """
        again = []
        try:
            return self._plan_once(seq_ids, q_lens, again)
        except AttnserveError:
            if not again:
                raise
        # A server found restarted (or its lease gone) that held none of these
        # sequences starts afresh: the plan can go there now.
        return self._plan_once(seq_ids, q_lens, [])

    def _plan_once(self, seq_ids: Sequence, q_lens, again: list) -> ClusterStep:
        seq_ids = list(seq_ids)
        if not seq_ids:
            raise ValueError("plan: seq_ids is empty")
        lens = np.asarray(q_lens)
        if lens.ndim != 1 or len(lens) != len(seq_ids):
            raise ValueError(f"plan: {len(seq_ids)} seq_ids but {lens.size} q_lens")
        if lens.dtype.kind not in "iu":
            raise TypeError(f"plan: q_lens must be integers, not {lens.dtype}")
        if len(set(seq_ids)) != len(seq_ids):
            raise ValueError("plan: seq_ids has duplicates")
        if (lens < 0).any():
            raise ValueError(f"plan: q_lens[{int(np.argmax(lens < 0))}] is negative")
        if lens.sum(dtype=np.float64) > _MAX_STEP_TOKENS:  # before a cast could wrap them
            raise ValueError(f"plan: q_lens add up to {int(lens.sum(dtype=np.float64))} tokens, "
                             f"more than a step's {_MAX_STEP_TOKENS} (2^31 - 1)")
        lens = lens.astype(np.int64)
        # Now and then: new servers join, free pages and restarts are read (the
        # sequences a restart lost are reported when they are named).
        # Also when no server takes new sequences: one that failed a call may
        # answer now.
        if (not any(s.usable for s in self._servers)
                or time.monotonic() - self._refreshed_at >= self.refresh_interval):
            try:
                self.refresh()
            except (AttnserveError, ValueError):
                pass
        lost = [sid for sid in seq_ids if sid in self._seqs and self._seqs[sid].lost]
        if lost:
            raise SequencesLost(lost, "a server holding them restarted or left", method="plan")
        # A sequence whose last run() of some layer failed on a server is
        # refused until that layer has run again (KvManager.check_written),
        # and so is every other sequence of that step, as a KvManager's
        # failed run() holds up its whole plan: planning one of them would
        # make the step stale, and the layer could not run again.
        ids, listed, steps = list(seq_ids), set(seq_ids), set()
        for sid in seq_ids:
            seq = self._seqs.get(sid)
            if seq is not None and seq.step is not None and seq.step.valid and id(seq.step) not in steps:
                steps.add(id(seq.step))
                ids += [o for o in seq.step.seq_ids if o not in listed]
                listed.update(seq.step.seq_ids)
        for i, server in enumerate(self._servers):
            here = [sid for sid in ids if sid in self._seqs
                    and any(sh.server == i for sh in self._seqs[sid].shards)]
            if here:
                try:
                    server.kv.check_written(*here)
                except AttnserveError as e:
                    raise _explained(e, f"server {server.address}: ") from None

        free = [s.free_estimate() if s.usable else -1 for s in self._servers]
        chunks = place_tokens(seq_ids, lens.tolist(), self._seqs, free, self._geometry["page_size"],
                              self.split_min_tokens, self.max_servers_per_sequence)
        per_server, shards_after, length_after = share_step(
            seq_ids, lens.tolist(), self._seqs, chunks, len(self._servers), self._kv_options["causal"])

        step = ClusterStep(step=self._step + 1, seq_ids=tuple(seq_ids),
                           q_lens=lens.astype(np.int32),
                           kv_lens=np.asarray(length_after, dtype=np.int64),
                           qo_indptr=np.concatenate([[0], np.cumsum(lens)]).astype(np.int32),
                           positions=np.concatenate(
                               [np.arange(e - n, e, dtype=np.int64)
                                for e, n in zip(length_after, lens.tolist())]))
        done = []
        wanted = set(seq_ids)
        for srv, entries in enumerate(per_server):
            if not entries:
                continue
            s = self._servers[srv]
            try:
                plan = s.kv.plan_rows([seq_ids[e[0]] for e in entries],
                                      [e[1] for e in entries],
                                      [int(lens[e[0]]) - e[4] for e in entries],
                                      [length_after[e[0]] - e[3] for e in entries],
                                      [e[5] for e in entries])
            except BaseException as e:
                lost, interrupted = [], None
                for i, p in reversed(done):
                    # undo takes the bookkeeping back whatever happens; a free
                    # it could not confirm is its manager's to settle.
                    try:
                        self._servers[i].kv.undo(p)
                    except (DataLoss, StaleIncarnation) as u:
                        self._observe(i, u, lost)
                    except AttnserveError:
                        pass
                    except BaseException as u:  # interrupted: the other undos still run
                        interrupted = interrupted or u
                    # The server's previous plan of these sequences went
                    # stale when this one was made, and undo does not bring
                    # it back: the cluster steps that ran them there cannot
                    # run again.
                    for sid in p.seq_ids:
                        prev = self._seqs.get(sid)
                        if prev is not None and prev.step is not None:
                            prev.step.valid = False
                if isinstance(e, ResourceExhausted):
                    # Its free pages were fewer than the estimate (others took
                    # them, or a failed free left some held): read them again.
                    try:
                        self._read_info(srv, s.client.info())
                    except AttnserveError:
                        pass
                accounted = isinstance(e, AttnserveError) and self._observe(srv, e, lost)
                # Lost sequences of the step fail it; others lost now are
                # reported when a call names them, and the step can be planned
                # again at once.
                if interrupted is not None and isinstance(e, AttnserveError):
                    raise interrupted
                named = [sid for sid in lost if sid in wanted]
                if named:
                    raise SequencesLost(named, f"server {s.address}: {e.details}" if accounted
                                        else _LOST_WHY, method="plan") from None
                if accounted and not isinstance(e, (Unavailable, DeadlineExceeded)):
                    again.append(srv)
                if isinstance(e, AttnserveError):
                    raise _explained(e, f"server {s.address}: ") from None
                raise
            done.append((srv, plan))
            q_rows, append_rows = [], []
            for b, a, off, _, skip, _ in entries:
                first = int(step.qo_indptr[b])
                q_rows.append(np.arange(first + skip, first + int(lens[b])))
                append_rows.append(np.arange(first + off, first + off + a))
            step.parts.append(_Part(srv, s.epoch, plan,
                                    np.concatenate(q_rows).astype(np.int64),
                                    np.concatenate(append_rows).astype(np.int64)))
        step.sources = [[] for _ in seq_ids]
        for pi, part in enumerate(step.parts):
            for j, (b, _, _, _, skip, _) in enumerate(per_server[part.server]):
                step.sources[b].append((pi, int(part.plan.qo_indptr[j]), skip))

        for srv, _ in done:
            self._observe(srv, None, [])
        # Commit.
        self._step = step.step
        for b, sid in enumerate(seq_ids):
            seq = self._seqs.get(sid)
            if seq is None:
                seq = self._seqs[sid] = _Sequence()
            seq.shards, seq.length = shards_after[b], length_after[b]
            if seq.step is not None:
                seq.step.valid = False
            seq.step = step
        self._latest = step
        return step

    def _executor(self) -> ThreadPoolExecutor:
        """Threads for the Prefills in flight at once: one per server."""
        if self._pool is None or self._pool_size < len(self._servers):
            if self._pool is not None:
                self._pool.shutdown(wait=False)
            self._pool_size = max(1, len(self._servers))
            self._pool = ThreadPoolExecutor(max_workers=self._pool_size,
                                            thread_name_prefix="attnserve-cluster")
        return self._pool

    def run(self, layer: int, q, k_new, v_new=None, *, step: Optional[ClusterStep] = None,
            timeout: Optional[float] = None, out: str = "numpy",
            device=None) -> PrefillResult:
        """One layer: q [total_q, qo_heads, head_dim] and k_new, v_new
        [total_q, kv_heads, head_dim] (numpy or torch) in the caller's order
        (MLA servers: q [total_q, qo_heads, qk_head_dim], k_new the latent rows
        [total_q, 1, qk_head_dim], v_new None, output v_head_dim wide);
        one Prefill per server touched, all in flight at once. Returns output
        [total_q, qo_heads, head_dim] and lse [total_q, qo_heads] in the
        caller's order: out="numpy" (default), float32; out="torch", tensors
        in the server's dtype (LSE float32) on `device` (default CPU), where
        the rows of spread sequences are merged (attnserve.merge: on the GPU
        for a CUDA device). SequencesLost (with .partial) when a server turns
        out to have restarted; the step stays runnable for the other
        sequences."""
        step = self._latest if step is None else step
        if step is None:
            raise RuntimeError("run: no step; call plan() first")
        if not step.valid:
            raise RuntimeError(f"run: the step {step.step} is stale (a later plan or finish() "
                               "changed one of its sequences)")
        first = self._seqs.get(step.seq_ids[0]) if step.seq_ids else None
        if first is None or first.step is not step:
            raise RuntimeError(f"run: the step {step.step} was planned by another Cluster: run "
                               "it there")
        g = self._geometry
        layer = _checked_layer(layer, g["num_layers"], "the servers'")
        if k_new is None:
            raise ValueError("run: k_new is None: every step appends its new tokens' keys "
                             "(MLA: their latent rows)")
        total = step.total_q
        for name, x in (("q", q), ("k_new", k_new), ("v_new", v_new)):
            if x is not None and _count(x) != total:
                raise ValueError(f"run: {name} has {_count(x)} rows, the step has {total}")

        if out not in ("numpy", "torch"):
            raise ValueError(f"run: out must be 'numpy' or 'torch', not {out!r}")

        def run_part(part: _Part) -> PrefillResult:
            s = self._servers[part.server]
            return s.kv.run(layer, _rows(q, part.q_rows), _rows(k_new, part.append_rows),
                            None if v_new is None else _rows(v_new, part.append_rows),
                            plan=part.plan, out=out,
                            device=device, timeout=timeout)

        live = [pi for pi, p in enumerate(step.parts)
                if self._servers[p.server].epoch == p.epoch]
        skipped = set(range(len(step.parts))) - set(live)
        # All but the first in the pool, the first on this thread.
        futures = {pi: self._executor().submit(run_part, step.parts[pi]) for pi in live[1:]}
        results, errors = {}, {}
        unexpected = None
        for j, pi in enumerate(live):
            # Every part is waited for before anything is raised: a Prefill
            # still in flight when run() returned could append its rows into
            # pages the caller frees and someone else is given next.
            try:
                results[pi] = run_part(step.parts[pi]) if j == 0 else futures[pi].result()
            except AttnserveError as e:
                errors[pi] = e
            except BaseException as e:
                if unexpected is None:
                    unexpected = e
                if j > 0:
                    # Interrupted (KeyboardInterrupt) while this part runs on
                    # its own thread: it is still waited out.
                    _wait_out(futures[pi])
        if unexpected is not None:
            raise unexpected
        # Restarts, lost leases and servers unreachable for too long lose
        # their sequences (their rows come back empty, with SequencesLost);
        # any other failure is the answer.
        failure = None
        for pi in live:
            server = step.parts[pi].server
            e = errors.get(pi)
            if self._observe(server, e, []):
                skipped.add(pi)
            elif e is not None and failure is None:
                failure = _explained(e, f"server {self._servers[server].address}: ")
        if failure is not None:
            raise failure

        hq, d = g["num_qo_heads"], g["v_head_dim"]
        if out == "torch":
            import torch
            wire = torch.float16 if g["q_dtype"] == "fp16" else torch.bfloat16
            o_all = torch.zeros((total, hq, d), dtype=wire, device=device)
            lse = torch.full((total, hq), float("-inf"), dtype=torch.float32, device=device)
        else:
            o_all = np.zeros((total, hq, d), np.float32)
            lse = np.full((total, hq), -np.inf, np.float32)
        lost = []
        for b, sid in enumerate(step.seq_ids):
            sources = step.sources[b]
            if any(pi in skipped for pi, _, _ in sources):
                lost.append(sid)
                continue
            n, row0 = int(step.q_lens[b]), int(step.qo_indptr[b])
            # Rows [lo, hi) between two servers' first rows have the same
            # servers: copy from one, or merge.
            cuts = sorted({n} | {skip for _, _, skip in sources})
            for lo, hi in zip(cuts, cuts[1:]):
                here = [(pi, r + lo - skip) for pi, r, skip in sources if skip <= lo]
                vs = [results[pi].output[at:at + hi - lo] for pi, at in here]
                ls = [results[pi].lse[at:at + hi - lo] for pi, at in here]
                if len(vs) == 1:
                    o_all[row0 + lo:row0 + hi], lse[row0 + lo:row0 + hi] = vs[0], ls[0]
                elif vs:
                    # numpy: merged straight into the output rows.
                    o_at = o_all[row0 + lo:row0 + hi]
                    o_m, lse[row0 + lo:row0 + hi] = merge_states(
                        vs, ls, self.lse_base, out=o_at if out == "numpy" else None)
                    if out == "torch":
                        o_at.copy_(o_m)
        incarnation = next((r.incarnation for r in results.values()), 0)
        result = PrefillResult(o_all, lse, incarnation)
        if lost:
            raise SequencesLost(lost, _LOST_WHY, partial=result, method="run")
        return result

    def finish(self, *seq_ids: Hashable) -> None:
        """Frees the sequences' pages on every server and forgets them (lost
        ones too). Unknown ids (KeyError) or duplicates (ValueError) change
        nothing; otherwise every named sequence is gone from the cluster
        afterwards, whatever happens, and an error names the servers that
        could not confirm freeing their pages and the sequences concerned
        (their KvManagers free them later: docs/cluster.md). SequencesLost
        names other sequences found lost meanwhile."""
        if len(set(seq_ids)) != len(seq_ids):
            raise ValueError("finish: seq_ids has duplicates")
        missing = [sid for sid in seq_ids if sid not in self._seqs]
        if missing:
            raise KeyError(f"finish: unknown sequence(s) {missing}")
        per_server: dict = {}
        for sid in seq_ids:
            for sh in self._seqs[sid].shards:
                # A manager that forgot it (lost with its lease, reset) holds
                # nothing of it.
                if self._servers[sh.server].kv.has(sid):
                    per_server.setdefault(sh.server, []).append(sid)
        # Every named sequence goes, whatever the servers answer.
        with held_interrupt() as hold:
            for sid in seq_ids:
                seq = self._seqs.pop(sid)
                if seq.step is not None:
                    seq.step.valid = False
        lost, unconfirmed, first = [], [], None
        interrupted = KeyboardInterrupt() if hold.got else None
        for srv, ids in sorted(per_server.items()):
            try:
                self._servers[srv].kv.finish(*ids)
                error = None
            except AttnserveError as e:
                error = e
            except BaseException as e:
                # Interrupted (KeyboardInterrupt): that manager forgot the
                # sequences (its finish settles what it left in doubt), and
                # the other servers' are still asked to, before the
                # interruption goes on: a manager still holding one of them
                # would extend its old rows if its id were planned again.
                interrupted = interrupted or e
                continue
            # A restart, a lost lease, or an unreachability declared a loss:
            # the pages are gone (or freed when the lease ends).
            if self._observe(srv, error, lost) or error is None:
                continue
            first = first or error
            unconfirmed.append(f"server {self._servers[srv].address} (sequences "
                               f"{', '.join(map(repr, ids))}): {error.details}")
        if interrupted is not None:
            raise interrupted
        if first is not None:
            raise type(first)(
                f"finish: sequences {', '.join(map(repr, seq_ids))} are finished (forgotten by "
                "the cluster), but freeing their pages was not confirmed on "
                + "; ".join(unconfirmed), first.code, "finish")
        others = [sid for sid in lost if sid not in seq_ids]
        if others:
            raise SequencesLost(others, _LOST_WHY, method="finish")

    def release(self) -> None:
        """finish() of every sequence, then every server's KvManager.release()
        (its lease revoked), best effort."""
        try:
            if self._seqs:
                self.finish(*list(self._seqs))
        finally:
            for s in self._servers:
                if not s.gone:
                    try:
                        s.kv.release()
                    except AttnserveError:
                        pass

    # ------------------------------------------------------------ queries
    def kv_len(self, seq_id: Hashable) -> int:
        return self._seqs[seq_id].length

    def shards_of(self, seq_id: Hashable) -> list:
        return [Shard(sh.server, sh.start, sh.length) for sh in self._seqs[seq_id].shards]

    @property
    def sequences(self) -> list:
        """Known sequences that are not lost."""
        return [sid for sid, s in self._seqs.items() if not s.lost]

    @property
    def lost(self) -> list:
        """Lost sequences not yet finished."""
        return [sid for sid, s in self._seqs.items() if s.lost]
