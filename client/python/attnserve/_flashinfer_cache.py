"""attnserve.flashinfer's KV cache (PagedKVCache, LayerCache), the server
plans its wrappers hold, and the checks of FlashInfer's paged layouts, which
the wrappers (attnserve.flashinfer, attnserve._flashinfer_mla) share. Its
transports and the futures run() returns: _flashinfer_transport."""

from __future__ import annotations

import threading
from typing import Optional

import numpy as np

import torch  # attnserve.flashinfer, which imports this module, says when it is missing

from attnserve.errors import AttnserveError, NotFound, outcome_unknown
from attnserve.lease import Lease
from attnserve._flashinfer_transport import _GrpcTransport, _RegionTransport

TRANSPORTS = ("grpc", "shm", "channel", "cuda")
_SERVER_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
# An FP8 cache's formats and torch's names for them (torch has the dtypes from 2.1).
_FP8_TORCH_NAMES = {"fp8_e4m3": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2"}


# ---------------------------------------------------------------- helpers
def _unsupported(**given) -> None:
    """NotImplementedError naming every argument given a value attnserve
    does not support; each value is (value, default, why)."""
    bad = [f"{name}={value!r} ({why})" for name, (value, default, why) in given.items()
           if not _same(value, default)]
    if bad:
        raise NotImplementedError("attnserve does not support " + "; ".join(bad))


def _same(value, default) -> bool:
    if value is None or default is None:
        return value is default
    if torch.is_tensor(value):
        return False
    return value == default


def _ints(x, name: str) -> np.ndarray:
    """x (torch tensor on any device, numpy array or sequence of integers) as
    a 1-D int64 numpy array; TypeError names the argument."""
    if torch.is_tensor(x):
        if x.is_floating_point() or x.is_complex():
            raise TypeError(f"{name}: an integer tensor expected, got {x.dtype}")
        x = x.detach().to("cpu").numpy()
    try:
        arr = np.asarray(x)
    except (TypeError, ValueError) as e:
        raise TypeError(f"{name}: {e}") from None
    if arr.size and arr.dtype.kind not in "iu":
        raise TypeError(f"{name}: integers expected, got {arr.dtype}")
    if arr.ndim != 1:
        raise ValueError(f"{name}: a 1-D array expected, got shape {list(arr.shape)}")
    # A copy, as FlashInfer's plan() takes one: the caller may refill its
    # own array or tensor before run() uses what was planned.
    return arr.astype(np.int64, copy=True)


def _torch_dtype(value, name: str):
    """A dtype given as FlashInfer takes it (a torch.dtype or its name)."""
    if isinstance(value, torch.dtype):
        return value
    if isinstance(value, str):
        dt = getattr(torch, value, None)
        if isinstance(dt, torch.dtype):
            return dt
        raise ValueError(f"{name}={value!r} is not a torch dtype name")
    raise TypeError(f"{name}: a torch.dtype or its name expected, not {type(value).__name__}")


def _kv_format(value, name: str) -> str:
    """The cache format a kv_data_type names: "bf16", "fp16", "fp8_e4m3" or
    "fp8_e5m2", from a torch.dtype, its name ("float8_e4m3fn"), or attnserve's
    name of an FP8 format (for a torch without FP8 dtypes); str() of any other
    dtype."""
    if isinstance(value, str):
        if value in _FP8_TORCH_NAMES:
            return value
        for fmt, torch_name in _FP8_TORCH_NAMES.items():
            if value == torch_name:
                return fmt
    dt = _torch_dtype(value, name)
    for fmt, torch_dt in _SERVER_DTYPES.items():
        if dt == torch_dt:
            return fmt
    for fmt, torch_name in _FP8_TORCH_NAMES.items():
        if dt == getattr(torch, torch_name, None):
            return fmt
    return str(dt)


def _check_kv_layout(kv_layout) -> None:
    if kv_layout == "HND":
        raise NotImplementedError(
            "attnserve does not support kv_layout='HND': the server's cache is NHD "
            "([pages, page_size, num_kv_heads, head_dim]) and there is no cache tensor here "
            "whose layout the caller picks; pass kv_layout='NHD'")
    if kv_layout != "NHD":
        raise ValueError(f"kv_layout={kv_layout!r} must be 'NHD' or 'HND'")


def _int_arg(value, name: str) -> int:
    """An integer argument (a Python or numpy int, or a one-element integer
    tensor), or TypeError naming it."""
    if torch.is_tensor(value) and value.numel() == 1 and not value.is_floating_point():
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name}={value!r}: an integer expected")
    return int(value)


def _float_arg(value, name: str) -> float:
    """A real-number argument, or TypeError naming it."""
    if torch.is_tensor(value) and value.numel() == 1:
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise TypeError(f"{name}={value!r}: a number expected")
    return float(value)


def _check_geometry(cache: "PagedKVCache", **given) -> None:
    for name, (value, server_name) in given.items():
        want = getattr(cache, server_name)
        if _int_arg(value, name) != want:
            raise ValueError(f"{name}={int(value)}, but the server's KV cache has {want} "
                             f"(attnserve serves the geometry it was started with: "
                             f"--{server_name})")


def _layer_of(cache: "PagedKVCache", paged_kv_cache, name: str = "paged_kv_cache") -> int:
    if not isinstance(paged_kv_cache, LayerCache):
        raise TypeError(f"{name}: an attnserve.flashinfer.LayerCache (kv_cache[layer] of a "
                        f"PagedKVCache) expected, not {type(paged_kv_cache).__name__}: the "
                        "server holds the KV cache")
    if paged_kv_cache.cache is not cache:
        raise ValueError(f"{name}: a layer of another PagedKVCache than the wrapper's "
                         "(float_workspace_buffer)")
    return paged_kv_cache.layer


def _seq_lens(kv_indptr: np.ndarray, kv_last_page_len: np.ndarray, page_size: int):
    return np.maximum(np.diff(kv_indptr) - 1, 0) * page_size + kv_last_page_len


def _check_layout(cache: "PagedKVCache", indptr, indices, last_page_len, names):
    """(indptr rebased to 0, the server's page ids, last_page_len) of a
    FlashInfer paged layout, checked; errors name FlashInfer's arguments."""
    n_indptr, n_indices, n_last = names
    indptr = _ints(indptr, n_indptr)
    indices = _ints(indices, n_indices)
    last = _ints(last_page_len, n_last)
    batch = len(last)
    if len(indptr) != batch + 1:
        raise ValueError(f"{n_indptr} has {len(indptr)} entries, must have len({n_last}) + 1 "
                         f"= {batch + 1}")
    if batch and np.any(np.diff(indptr) < 0):
        raise ValueError(f"{n_indptr} must be non-decreasing")
    if indptr[0] < 0 or indptr[-1] > len(indices):
        raise ValueError(f"{n_indptr} spans [{indptr[0]}, {indptr[-1]}), outside "
                         f"{n_indices}' {len(indices)} entries")
    used = indices[indptr[0]:indptr[-1]]
    if used.size and (used.min() < 0 or used.max() >= cache.max_num_pages):
        bad = int(used[(used < 0) | (used >= cache.max_num_pages)][0])
        raise ValueError(f"{n_indices} holds page {bad}, outside [0, {cache.max_num_pages}) "
                         "(the PagedKVCache's max_num_pages)")
    pages = np.diff(indptr)
    ps = cache.page_size
    # A request without pages has no keys whatever its last_page_len says
    # (FlashInfer's rule; engines pass ones there): taken as 0.
    wrong = ((pages > 0) & ((last < 1) | (last > ps))) | ((pages == 0) & ((last < 0) | (last > ps)))
    if np.any(wrong):
        b = int(np.nonzero(wrong)[0][0])
        raise ValueError(f"{n_last}[{b}]={int(last[b])} must be in [1, page_size={ps}] for a "
                         f"sequence with pages ({int(pages[b])} here), in [0, {ps}] for one "
                         "without")
    return indptr - indptr[0], cache.page_ids[used], np.where(pages > 0, last, 0)


# ---------------------------------------------------------------- appended rows
def _select(t, idx: np.ndarray):
    """t's rows idx (a one-byte dtype, FP8, through its bytes: torch indexes
    uint8 everywhere)."""
    index = torch.as_tensor(idx, dtype=torch.long, device=t.device)
    if t.element_size() == 1 and t.dtype != torch.uint8:
        return t.view(torch.uint8).index_select(0, index).view(t.dtype)
    return t.index_select(0, index)


def _cat(ts: list):
    """torch.cat of rows of one dtype (FP8 through its bytes)."""
    if ts[0].element_size() == 1 and ts[0].dtype != torch.uint8:
        return torch.cat([t.view(torch.uint8) for t in ts]).view(ts[0].dtype)
    return torch.cat(ts)


def _rows_of(entry: tuple, idx: np.ndarray) -> tuple:
    """Rows idx of a queued append (slots, k, v)."""
    slots, k, v = entry
    return slots[idx], _select(k, idx), None if v is None else _select(v, idx)


def _last_per_slot(entry: tuple) -> tuple:
    """A queued run (slots, k, v) with one row a slot, the last appended
    there (the server refuses a request that writes a slot twice)."""
    slots = entry[0]
    if len(slots) < 2:
        return entry
    unique, last_from_end = np.unique(slots[::-1], return_index=True)
    if len(unique) == len(slots):
        return entry
    return _rows_of(entry, np.sort(len(slots) - 1 - last_from_end))


# ---------------------------------------------------------------- the cache
class _HeldPlans:
    """The server plans a wrapper holds and the runs made under them, for its
    finalizer (which must not hold the wrapper)."""

    __slots__ = ("ids", "runs")

    def __init__(self):
        self.ids: set = set()
        self.runs: list = []


class _PlanLedger:
    """The server plans a PagedKVCache's wrappers hold under its lease. A
    CreatePlan or ReleasePlan whose reply was lost may leave a plan on the
    server that no wrapper knows of; the next create() then lists the
    lease's plans and releases those first, so that a lost reply holds no
    plan past the next step (--max_plans_per_tenant counts them)."""

    def __init__(self, cache: "PagedKVCache"):
        self._cache = cache
        self._lock = threading.Lock()
        self._known: set = set()   # made, not yet released by a wrapper
        self._in_doubt = False
        self._creating = 0         # CreatePlans in flight (their ids not known yet)
        # Plans of wrappers dropped without close(): (ids, runs), put in the
        # inbox by abandon(), released by create() once their runs are done
        # (_abandoned: taken from the inbox, runs still in flight).
        self._inbox: list = []
        self._abandoned: list = []

    def create(self, *layout) -> int:
        self._release_abandoned()
        self.settle()
        with self._lock:
            self._creating += 1
        try:
            plan_id = self._cache.rpc.create_plan(*layout)
        except BaseException as e:
            with self._lock:
                self._creating -= 1
                if not isinstance(e, AttnserveError) or outcome_unknown(e):
                    self._in_doubt = True  # it may have made the plan
            raise
        with self._lock:
            self._creating -= 1
            self._known.add(plan_id)
        return plan_id

    def abandon(self, held: "_HeldPlans") -> None:
        """A wrapper was dropped (garbage-collected) without close() while it
        held server plans (held.ids) with runs made under them (held.runs):
        the next create() releases each once those runs have their answers,
        so that a loop that makes a wrapper a step holds no more plans than
        one that reuses it. Called by weakref.finalize, on whatever thread a
        collection runs, even one inside this ledger's lock: no lock here
        (list.append is atomic), no call to the server."""
        self._inbox.append((frozenset(held.ids), list(held.runs)))

    def _release_abandoned(self) -> None:
        while self._inbox:
            self._abandoned.append(self._inbox.pop())
        if not self._abandoned:
            return
        ready, waiting = [], []
        for ids, runs in self._abandoned:
            (ready if all(f.done() for f in runs) else waiting).append((ids, runs))
        self._abandoned = waiting  # their runs still in flight: at a later create()
        for ids, _ in ready:
            with self._lock:
                ids = [p for p in ids if p in self._known]
                self._known.difference_update(ids)
            for plan_id in ids:
                try:
                    self._cache.rpc.release_plan(plan_id)
                except NotFound:
                    pass  # gone already (idle timeout, lease ended)
                except AttnserveError:
                    self.doubt()  # no wrapper knows it now: settle() releases it

    def forget(self, plan_id: int) -> None:
        """A wrapper is releasing plan_id (or found it gone)."""
        with self._lock:
            self._known.discard(plan_id)

    def doubt(self) -> None:
        with self._lock:
            self._in_doubt = True

    def settle(self) -> None:
        """After an unknown outcome: releases the lease's plans no wrapper
        knows of (not while a CreatePlan is in flight, whose plan would be
        among them)."""
        with self._lock:
            if not self._in_doubt or self._creating:
                return
            self._in_doubt = False
        rpc = self._cache.rpc
        try:
            held = rpc.list_holdings(self._cache.lease_id)
            # What the wrappers know once the list is in (a plan made while
            # it was on its way is listed and known); none while a
            # CreatePlan is in flight, whose plan the list may hold.
            with self._lock:
                if self._creating:
                    self._in_doubt = True
                    return
                known = set(self._known)
            for lease in held.leases:
                for plan_id in lease.holdings.plans:
                    if plan_id not in known:
                        try:
                            rpc.release_plan(plan_id)
                        except NotFound:
                            pass  # released meanwhile
        except AttnserveError:
            self.doubt()  # tried again at the next create()


class LayerCache:
    """One layer of a PagedKVCache: what run() and append_paged_kv_cache()
    take where FlashInfer takes that layer's cache tensor."""

    __slots__ = ("cache", "layer")

    def __init__(self, cache: "PagedKVCache", layer: int):
        self.cache, self.layer = cache, layer

    def __repr__(self) -> str:
        return f"LayerCache(layer={self.layer}, max_num_pages={self.cache.max_num_pages})"


class PagedKVCache:
    """max_num_pages pages of the server's KV cache, in every layer: what a
    FlashInfer caller allocates as its cache tensors (and its workspace).

    client: an attnserve.Client of the server (the cache forks it: a lease of
      its own on the same connection).
    max_num_pages: pages to allocate (one AllocatePages); page index i of the
      FlashInfer layout is the server's page page_ids[i].
    transport: "grpc", "shm", "channel" or "cuda" (module docstring); "shm"
      and "channel" need the server on this host with --allow_shared_memory,
      "cuda" a CUDA-backend server on this host and a GPU here.
    max_rows: the most query rows (and appended rows) of a call that travel
      through the region; larger calls go over gRPC inline ("shm",
      "channel", "cuda").
    slots: calls in flight at once through the region (the channel's slots).
    lease_ttl: seconds the server keeps the pages after this process stops
      renewing (None: the server's default, 30 s); close() frees them at once.
    device: where outputs of "cuda" stay (default: the current CUDA device).

    kv_cache[layer] (a LayerCache), len(kv_cache) == num_layers.
    close() (or the end of a `with` block) releases everything.

    dtype: the queries' and outputs' torch dtype (the server's q_dtype);
    kv_dtype: what the cache holds, plan()'s kv_data_type: dtype, or on an FP8
    server (kv_fp8; kv_format "fp8_e4m3" or "fp8_e5m2") torch.float8_e4m3fn /
    float8_e5m2, or the format's name where torch has no FP8 dtypes.
    """

    def __init__(self, client, max_num_pages: int, *, transport: str = "grpc",
                 max_rows: int = 256, slots: int = 4, lease_ttl: Optional[float] = None,
                 spin_us: float = 50, device=None):
        if transport not in TRANSPORTS:
            raise ValueError(f"transport={transport!r} must be one of {', '.join(TRANSPORTS)}")
        if int(max_num_pages) < 1:
            raise ValueError(f"max_num_pages={max_num_pages} must be >= 1")
        if int(max_rows) < 1:
            raise ValueError(f"max_rows={max_rows} must be >= 1")
        info = client.server_info if client._info is not None else client.info()
        self.info = info
        if transport == "cuda":
            self._check_cuda(info)
        self.transport_name = transport
        self.num_layers, self.page_size = info.num_layers, info.page_size
        self.num_qo_heads, self.num_kv_heads = info.num_qo_heads, info.num_kv_heads
        self.head_dim = info.head_dim
        # Multi-head latent attention (BatchMLAPagedAttentionWrapper): one
        # latent row of head_dim = kv_lora_rank + qk_rope_head_dim values per
        # slot, outputs v_head_dim (= kv_lora_rank) wide.
        self.mla = info.mla
        self.v_head_dim = info.v_head_dim
        self.kv_lora_rank, self.qk_rope_head_dim = info.kv_lora_rank, info.qk_rope_head_dim
        # Queries and outputs are the server's q_dtype; its cache holds
        # kv_format: the same, or FP8 (kv_dtype: torch's FP8 dtype, or the
        # format's name where torch has none; plan()'s kv_data_type).
        self.dtype = _SERVER_DTYPES[info.q_dtype]
        self.kv_format = info.kv_dtype
        self.kv_fp8 = info.kv_fp8
        self.kv_dtype = (getattr(torch, _FP8_TORCH_NAMES[info.kv_dtype], info.kv_dtype)
                         if info.kv_fp8 else self.dtype)
        self.max_num_pages = int(max_num_pages)
        self.device = torch.device(device) if device is not None else (
            torch.device("cuda", torch.cuda.current_device()) if transport == "cuda"
            else torch.device("cpu"))
        self.rpc = client.fork()
        self._lease = Lease(self.rpc, lease_ttl)
        self._server_plans = _PlanLedger(self)
        self._pending: dict = {}       # layer -> [(slots, k, v), ...] queued appends
        self._pending_lock = threading.Lock()
        self._closed = False
        self._transport = None
        try:
            self.page_ids = np.asarray(self.rpc.allocate_pages(self.max_num_pages),
                                       dtype=np.int64)
            self._grpc = _GrpcTransport(self)
            if transport == "grpc":
                self._transport = self._grpc
            else:
                self._transport = _RegionTransport(self, transport, int(max_rows), int(slots),
                                                   spin_us)
        except BaseException:
            self._lease.close()
            raise
        self.layers = [LayerCache(self, i) for i in range(self.num_layers)]

    @staticmethod
    def _check_cuda(info) -> None:
        if not torch.cuda.is_available():
            raise RuntimeError("transport='cuda' needs a GPU here (torch.cuda.is_available() "
                               "is False): use transport='channel' (or 'shm', 'grpc')")
        if info.backend != "cuda":
            raise RuntimeError(f"transport='cuda' needs a CUDA-backend server on this host; "
                               f"this one runs the {info.backend} backend: use "
                               "transport='channel'")

    def __getitem__(self, layer: int) -> LayerCache:
        if not -self.num_layers <= layer < self.num_layers:
            raise IndexError(f"layer {layer} is outside [0, {self.num_layers}) (the server's "
                             "num_layers)")
        return self.layers[layer]

    def __len__(self) -> int:
        return self.num_layers

    def __iter__(self):
        return iter(self.layers)

    @property
    def transport(self) -> str:
        return self.transport_name

    @property
    def lease_id(self) -> int:
        return self._lease.lease_id

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("the PagedKVCache is closed")

    # ------------------------------------------------------------ appends
    def _queue(self, layer: int, slots: np.ndarray, k, v) -> None:
        with self._pending_lock:
            self._pending.setdefault(layer, []).append((slots, k, v))

    def _requeue(self, layer: int, runs: list) -> None:
        """Puts runs _take() returned back in front of the layer's queue."""
        with self._pending_lock:
            self._pending[layer] = list(runs) + self._pending.get(layer, [])

    def _take(self, layer: int, pages: Optional[np.ndarray] = None) -> list:
        """The appends queued for `layer`, in order, as runs of rows of one
        dtype each (an FP8 cache takes q-dtype rows and FP8 rows), each run one
        (slots, k, v) with one row a slot (the last appended there, as
        FlashInfer's appends overwrite); [] when none. With `pages` (the
        server page ids a run's plan reads), only the rows of those pages:
        the others stay queued, for the run that reads them (another wrapper's
        of the same layer) or flush()."""
        with self._pending_lock:
            queued = self._pending.pop(layer, None) or []
            if pages is not None and queued:
                taken, rest = [], []
                for entry in queued:
                    inside = np.isin(entry[0] // self.page_size, pages)
                    if inside.all():
                        taken.append(entry)
                    elif not inside.any():
                        rest.append(entry)
                    else:
                        taken.append(_rows_of(entry, np.nonzero(inside)[0]))
                        rest.append(_rows_of(entry, np.nonzero(~inside)[0]))
                if rest:
                    self._pending[layer] = rest
                queued = taken
        runs: list = []
        for entry in queued:
            if runs and runs[-1][-1][1].dtype == entry[1].dtype:
                runs[-1].append(entry)
            else:
                runs.append([entry])
        return [_last_per_slot(run[0] if len(run) == 1 else
                               (np.concatenate([s for s, _, _ in run]),
                                _cat([k for _, k, _ in run]),
                                None if run[0][2] is None else _cat([v for _, _, v in run])))
                for run in runs]

    def discard_pending(self, layer: Optional[int] = None) -> int:
        """Drops the queued appends of `layer` (None: every layer) without
        writing them; returns how many rows. For rows the server refuses
        (a run() that failed keeps its rows queued)."""
        with self._pending_lock:
            layers = [layer] if layer is not None else list(self._pending)
            return sum(len(s) for l in layers for s, _, _ in self._pending.pop(l, ()))

    def _write(self, layer: int, runs: list, after: list = ()) -> None:
        """WriteKV of each run in order; on a failure every run, and the runs
        `after` them that the caller took too, go back in the queue (WriteKV is
        idempotent: a later flush() or run() writes them again)."""
        try:
            for slots, k, v in runs:
                self.rpc.write_kv(layer, slots, k, v)
        except BaseException:
            self._requeue(layer, list(runs) + list(after))
            raise

    def flush(self, layer: Optional[int] = None) -> None:
        """Writes the queued appends of `layer` (None: every layer) now (WriteKV)."""
        self._check_open()
        for l in ([layer] if layer is not None else list(self._pending)):
            self._write(l, self._take(l))

    def pending_rows(self, layer: int) -> int:
        """Appended rows of `layer` that have not reached the server yet."""
        with self._pending_lock:
            return sum(len(s) for s, _, _ in self._pending.get(layer, ()))

    # ------------------------------------------------------------ closing
    def close(self) -> None:
        """Releases everything: the region and channel, then the lease (its
        pages are freed and zeroed, the wrappers' plans released). Queued
        appends are dropped. Idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            if self._transport is not None and self._transport is not self._grpc:
                self._transport.close()
        finally:
            self._lease.close()
            with self._pending_lock:
                self._pending.clear()

    def __enter__(self) -> "PagedKVCache":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# ---------------------------------------------------------------- wrappers


def _append_slots(cache: "PagedKVCache", batch_indices, positions, kv_indices, kv_indptr,
                  kv_last_page_len, nnz: int) -> np.ndarray:
    """The server slots of nnz appended rows: row i at position positions[i]
    of request batch_indices[i] of a FlashInfer paged layout."""
    bi = _ints(batch_indices, "batch_indices")
    pos = _ints(positions, "positions")
    for name, a in (("batch_indices", bi), ("positions", pos)):
        if len(a) < nnz:
            raise ValueError(f"{name} has {len(a)} entries, fewer than the {nnz} rows appended")
    bi, pos = bi[:nnz], pos[:nnz]
    indptr, pages, last = _check_layout(cache, kv_indptr, kv_indices, kv_last_page_len,
                                        ("kv_indptr", "kv_indices", "kv_last_page_len"))
    batch = len(last)
    if nnz and (bi.min() < 0 or bi.max() >= batch):
        raise ValueError(f"batch_indices must be in [0, {batch}) (batch_size = "
                         f"len(kv_last_page_len))")
    lens = _seq_lens(indptr, last, cache.page_size)
    if nnz and (pos.min() < 0 or np.any(pos >= lens[bi])):
        i = int(np.nonzero((pos < 0) | (pos >= lens[bi]))[0][0])
        raise ValueError(f"positions[{i}]={int(pos[i])} is outside request {int(bi[i])}'s "
                         f"[0, {int(lens[bi[i]])}) (the layout must already include the "
                         "appended rows, as in FlashInfer)")
    ps = cache.page_size
    return pages[indptr[bi] + pos // ps] * ps + pos % ps
