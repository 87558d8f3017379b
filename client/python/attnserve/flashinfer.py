"""FlashInfer's paged-KV attention API on attnserve (docs/flashinfer.md).

    import attnserve
    import attnserve.flashinfer as flashinfer      # instead of `import flashinfer`

    client = attnserve.Client("127.0.0.1:50051")
    kv_cache = flashinfer.PagedKVCache(client, max_num_pages=128)   # the server's cache
    wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(kv_cache, "NHD")
    wrapper.plan(kv_indptr, kv_indices, kv_last_page_len, num_qo_heads, num_kv_heads,
                 head_dim, page_size, q_data_type=torch.bfloat16)
    for layer in range(num_layers):
        flashinfer.append_paged_kv_cache(k, v, batch_indices, positions, kv_cache[layer],
                                         kv_indices, kv_indptr, kv_last_page_len)
        o = wrapper.run(q, kv_cache[layer])

The classes and functions have FlashInfer's names, signatures and defaults
(FlashInfer 0.6, python/flashinfer/decode.py, prefill.py, page.py), and every
argument means what FlashInfer's documentation says. Two differ, because
the server owns what a FlashInfer caller owns:

  * the KV cache: FlashInfer's caller allocates a tensor of max_num_pages
    pages per layer; here PagedKVCache(client, max_num_pages) allocates
    max_num_pages pages on the server (under a lease of its own), and
    kv_cache[layer] stands wherever FlashInfer takes a layer's cache tensor
    (run's paged_kv_cache, append_paged_kv_cache's). Page indices are the
    caller's, 0..max_num_pages-1, as into a FlashInfer cache tensor; the
    cache maps them to the server's page ids.
  * the workspace: the wrappers' first argument, float_workspace_buffer, is
    the PagedKVCache (the server plans in its own workspace).

Options attnserve does not support raise NotImplementedError naming them
(docs/flashinfer.md has the table); none is silently ignored.

plan() registers the step's layout with the server (CreatePlan) when the
first run() needs it, under the cache's lease, so that every layer's run()
sends only q (and that layer's appended K/V) with the plan's id; the next
plan() releases it. append_paged_kv_cache() queues the rows: they reach the
server with the next run() of that layer, fused into its Prefill (the rows
are written before the attention reads them, as in FlashInfer), or at
kv_cache.flush().

Transports (PagedKVCache(transport=...)):
  "grpc"     every run() is a Prefill over gRPC with the tensors inline;
  "shm"      q, the appended K/V, the output and the LSE go through a
             shared-memory region of this process (server on this host with
             --allow_shared_memory); the call is still gRPC;
  "channel"  the same region, and the calls go through a request channel
             (a ring the server polls): no gRPC call per layer;
  "cuda"     torch CUDA tensors stay on the GPU: a CUDA region, through a
             channel (a CUDA-backend server on this host); the caller's
             current stream is synchronized before each request is sent and
             the outputs are copied out on it (tests/python/
             test_flashinfer_cuda.py, run on an H200).
run_async() returns an AttentionFuture at once, so that an engine can do
its own work while the server computes; run() is run_async().result().
"""

from __future__ import annotations

import math
import secrets
import threading
from typing import Any, List, Optional

import numpy as np

try:
    import torch
except ImportError as e:  # pragma: no cover - the module is torch's API
    raise ImportError("attnserve.flashinfer needs torch (FlashInfer's API takes torch "
                      "tensors): install python3-torch") from e

from attnserve.layout import AttentionOptions, PrefillLayout
from attnserve.errors import AttnserveError, NotFound, Unimplemented
from attnserve.lease import Lease
from attnserve.regions import RegionTensor, SharedMemoryRegion

__all__ = ["PagedKVCache", "LayerCache", "AttentionFuture",
           "BatchDecodeWithPagedKVCacheWrapper", "BatchPrefillWithPagedKVCacheWrapper",
           "BatchMLAPagedAttentionWrapper", "append_paged_kv_cache",
           "append_paged_mla_kv_cache", "get_batch_indices_positions", "get_seq_lens",
           "TRANSPORTS"]

TRANSPORTS = ("grpc", "shm", "channel", "cuda")
_SERVER_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
_REGION_DTYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


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
    return arr.astype(np.int64, copy=False)


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


def _check_kv_layout(kv_layout) -> None:
    if kv_layout == "HND":
        raise NotImplementedError(
            "attnserve does not support kv_layout='HND': the server's cache is NHD "
            "([pages, page_size, num_kv_heads, head_dim]) and there is no cache tensor here "
            "whose layout the caller picks; pass kv_layout='NHD'")
    if kv_layout != "NHD":
        raise ValueError(f"kv_layout={kv_layout!r} must be 'NHD' or 'HND'")


def _check_geometry(cache: "PagedKVCache", **given) -> None:
    for name, (value, server_name) in given.items():
        want = getattr(cache, server_name)
        if int(value) != want:
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
    wrong = ((pages > 0) & ((last < 1) | (last > ps))) | ((pages == 0) & (last != 0))
    if np.any(wrong):
        b = int(np.nonzero(wrong)[0][0])
        raise ValueError(f"{n_last}[{b}]={int(last[b])} must be in [1, page_size={ps}] for a "
                         f"sequence with pages ({int(pages[b])} here), 0 for one without")
    return indptr - indptr[0], cache.page_ids[used], last


# ---------------------------------------------------------------- futures
class AttentionFuture:
    """A run() in flight (run_async): result() waits and returns what run()
    returns; out= and lse= are filled when it completes. done() asks without
    waiting. `await future` waits in the event loop's default executor.

    Calls in flight at once are independent requests: the server may run
    them in any order, so a call that reads rows another call appends must be
    made after that call's result."""

    def __init__(self, wait, return_lse: bool, poll=None):
        self._wait = wait            # wait(timeout) -> (out, lse)
        self._poll = poll            # poll() -> True once the answer is there
        self._return_lse = return_lse
        self._lock = threading.Lock()
        self._done = False
        self._value = None
        self._error: Optional[BaseException] = None

    def done(self) -> bool:
        return self._done or (self._poll is not None and self._poll())

    def _complete(self, timeout: Optional[float] = None) -> None:
        with self._lock:
            if self._done:
                return
            try:
                self._value = self._wait(timeout)
            except TimeoutError:
                raise
            except BaseException as e:
                self._error = e
            self._done = True
            self._wait = self._poll = None   # what they hold (an area's tensors) goes now

    def result(self, timeout: Optional[float] = None):
        """out, or (out, lse) with return_lse. timeout: seconds to wait here
        (TimeoutError when they pass; the call goes on)."""
        self._complete(timeout)
        if self._error is not None:
            raise self._error
        out, lse = self._value
        return (out, lse) if self._return_lse else out

    def __await__(self):
        import asyncio
        return asyncio.get_running_loop().run_in_executor(None, self.result).__await__()


# ---------------------------------------------------------------- transports
class _Request:
    """What a run() sends, once checked: the layer, q, the layout, the
    fused appends, the options, and where the results go."""

    __slots__ = ("layer", "q", "layout", "k", "v", "options", "out", "lse", "want_lse",
                 "v_scale", "blocking")

    def __init__(self, **kw):
        for k, v in kw.items():
            setattr(self, k, v)


def _finish(r: _Request, o, lse):
    """The results of r from the tensors the server gave (o [n, h, d] in q's
    dtype, lse [n, h] float32), written into out= / lse= when given."""
    if r.out is not None:
        r.out.copy_(o)
        o = r.out
    if r.lse is not None:
        r.lse.copy_(lse)
        lse = r.lse
    if r.v_scale is not None and r.v_scale != 1.0:
        if r.out is not None:
            o.mul_(r.v_scale)
        else:
            o = o * r.v_scale
    return o, lse


class _GrpcTransport:
    """Inline tensors over gRPC."""

    name = "grpc"

    def __init__(self, cache: "PagedKVCache"):
        self.cache = cache

    def submit(self, r: _Request) -> AttentionFuture:
        rpc = self.cache.rpc
        request = rpc._req_prefill(r.layer, r.q, r.layout, r.k, r.v, "torch", r.q.device, None,
                                   r.options)
        call = rpc._call_now(request, None) if r.blocking else rpc._call_future(request, None)

        def wait(timeout):
            res = call.result(timeout)
            return _finish(r, res.output, res.lse)
        return AttentionFuture(wait, r.want_lse, call.done)

    def close(self) -> None:
        pass


class _Area:
    """One call's tensors in the region: q, k, v, o [rows, heads, dim] and
    lse [rows, qo_heads], as torch tensors over the region's memory and as
    the offsets a RegionTensor names."""

    def __init__(self, region_name: str, view, at: int, rows: int, cache: "PagedKVCache"):
        hq, hk, d, dv = cache.num_qo_heads, cache.num_kv_heads, cache.head_dim, cache.v_head_dim
        esize = torch.tensor([], dtype=cache.dtype).element_size()
        self.region = region_name
        self.dtype = _REGION_DTYPES[cache.dtype]
        self.offsets = {}
        self.tensors = {}
        areas = [("q", (rows, hq, d), cache.dtype), ("o", (rows, hq, dv), cache.dtype),
                 ("k", (rows, hk, d), cache.dtype), ("v", (rows, hk, d), cache.dtype),
                 ("lse", (rows, hq), torch.float32)]
        if cache.mla:   # latent rows only: no V
            areas = [a for a in areas if a[0] != "v"]
        for key, shape, dtype in areas:
            size = math.prod(shape) * (4 if dtype == torch.float32 else esize)
            self.offsets[key] = at
            self.tensors[key] = view(at, size, dtype).view(shape)
            at += (size + 63) // 64 * 64
        self.end = at

    def ref(self, key: str, shape) -> RegionTensor:
        return RegionTensor(self.region, self.offsets[key], tuple(int(s) for s in shape),
                            "fp32" if key == "lse" else self.dtype)


class _RegionTransport:
    """The tensors of each call in flight in an area of a region; the call
    over gRPC ("shm"), through a request channel ("channel"), or, with CUDA
    areas, through a channel ("cuda"). A call larger
    than an area (more than max_rows rows) goes over gRPC with its tensors
    inline. An area whose call failed with an unknown outcome (the server may
    still write its output there) is never used again."""

    def __init__(self, cache: "PagedKVCache", name: str, max_rows: int, slots: int,
                 spin_us: float, slot_bytes: int = 64 << 10):
        self.cache, self.name, self.max_rows = cache, name, max_rows
        rpc = cache.rpc
        tag = secrets.token_hex(4)
        self.region = None
        self.cuda_region = None
        self.cuda_buffer = None
        self.channel = None
        self.areas: list = []
        self._np = None
        self._lock = threading.Condition()
        self._free: list = []
        self._retired = 0
        self._in_flight: list = []      # futures holding an area, oldest first
        self._events: dict = {}         # cuda: area index -> event of its last copy out
        try:
            ring = 0
            if name in ("channel", "cuda"):
                from attnserve.channel import channel_bytes
                ring = channel_bytes(slots, slot_bytes)
            if name == "cuda":
                self.region = SharedMemoryRegion(ring).register(rpc, f"attnserve-fi-ring-{tag}")
                size = self._areas(None, 0, max_rows, slots)[-1].end   # a multiple of 64
                # float32 elements: register_cuda_tensor takes bf16, fp16 or float32.
                self.cuda_buffer = torch.empty(size // 4, dtype=torch.float32,
                                               device=cache.device)
                from attnserve.regions import register_cuda_tensor
                self.cuda_region = f"attnserve-fi-cuda-{tag}"
                ref = register_cuda_tensor(rpc, self.cuda_region, self.cuda_buffer)
                base = ref.offset      # the buffer's offset in its registered allocation
                buf = self.cuda_buffer.view(torch.uint8)

                def view(at, size, dtype):
                    return buf[at - base:at - base + size].view(dtype)
                self.areas = self._areas(view, base, max_rows, slots, self.cuda_region)
            else:
                size = self._areas(None, ring, max_rows, slots)[-1].end
                self.region = SharedMemoryRegion(size).register(rpc, f"attnserve-fi-{tag}")
                self._np = np.frombuffer(self.region.buf, dtype=np.uint8)
                u8 = self._np

                def view(at, size, dtype):
                    return torch.from_numpy(u8[at:at + size]).view(dtype)
                self.areas = self._areas(view, ring, max_rows, slots, self.region.name)
            if name in ("channel", "cuda"):
                self.channel = rpc.open_channel(self.region, 0, slot_count=slots,
                                                slot_bytes=slot_bytes, spin_us=spin_us)
        except BaseException:
            self.close()
            raise
        self._free = list(range(len(self.areas) - 1, -1, -1))

    def _areas(self, view, at: int, rows: int, count: int, region_name: str = ""):
        areas = []
        for _ in range(count):
            areas.append(_Area(region_name, view or (lambda a, s, d: _Null()), at, rows,
                               self.cache))
            at = areas[-1].end
        return areas

    def _acquire(self) -> Optional[int]:
        """A free area's index; None when every area is retired."""
        while True:
            with self._lock:
                if self._free:
                    return self._free.pop()
                if self._retired == len(self.areas):
                    return None
                oldest = self._in_flight[0] if self._in_flight else None
                if oldest is None:
                    self._lock.wait(0.01)
                    continue
            try:
                oldest._complete(None)  # every area is held: the oldest call's answer frees one
            except TimeoutError:
                pass

    def _release(self, index: int, future, retire: bool = False) -> None:
        with self._lock:
            if future in self._in_flight:
                self._in_flight.remove(future)
            if retire:
                self._retired += 1
            else:
                self._free.append(index)
            self._lock.notify_all()

    def submit(self, r: _Request) -> AttentionFuture:
        n = r.q.shape[0]
        na = 0 if r.k is None else r.k.shape[0]
        index = None if n > self.max_rows or na > self.max_rows else self._acquire()
        if index is None:
            return self.cache._grpc.submit(r)  # larger than an area (or none left): inline
        area = self.areas[index]
        t = area.tensors
        holder: list = []
        try:
            if index in self._events:
                self._events.pop(index).synchronize()  # cuda: the last copy out is done
            t["q"][:n].copy_(r.q)
            k_ref = v_ref = None
            if na:
                t["k"][:na].copy_(r.k)
                k_ref = area.ref("k", r.k.shape)
                if r.v is not None:
                    t["v"][:na].copy_(r.v)
                    v_ref = area.ref("v", r.v.shape)
            if self.name == "cuda":
                # The server reads q, k, v on its own stream: the caller's
                # stream must have written them first.
                torch.cuda.current_stream(self.cuda_buffer.device).synchronize()
            rpc = self.cache.rpc
            o_shape = (n, r.q.shape[1], self.cache.v_head_dim)
            request = rpc._req_prefill(r.layer, area.ref("q", r.q.shape), r.layout, k_ref, v_ref,
                                       None, None,
                                       (area.ref("o", o_shape), area.ref("lse", r.q.shape[:2])),
                                       r.options)
            call = (self.channel.submit(request) if self.channel is not None
                    else rpc._call_now(request, None) if r.blocking
                    else rpc._call_future(request, None))
        except BaseException:
            self._release(index, None)   # nothing was sent
            raise

        def wait(timeout):
            try:
                call.result(timeout)
            except TimeoutError:
                raise
            except BaseException as e:
                self._release(index, holder[0], retire=_unknown(e))
                raise
            o = t["o"][:n]
            lse = t["lse"][:n]
            if r.out is None:
                o = torch.empty(o.shape, dtype=o.dtype, device=r.q.device).copy_(o)
            if r.lse is None:
                lse = torch.empty(lse.shape, dtype=lse.dtype, device=r.q.device).copy_(lse)
            result = _finish(r, o, lse)
            if self.name == "cuda":
                event = torch.cuda.Event()
                event.record()
                self._events[index] = event
            self._release(index, holder[0])
            return result
        future = AttentionFuture(wait, r.want_lse, call.done)
        holder.append(future)
        with self._lock:
            self._in_flight.append(future)
        return future

    def close(self) -> None:
        with self._lock:
            pending = list(self._in_flight)
        for f in pending:
            try:
                f._complete(None)
            except TimeoutError:
                pass
        if self.channel is not None:
            self.channel.close()
            self.channel = None
        self.areas = []
        self._np = None
        rpc = self.cache.rpc
        if self.region is not None:
            try:
                self.region.close(rpc)
            except AttnserveError:
                self._let_go()        # the server reclaims it once its holder is gone
            except BufferError:
                self._let_go()
            self.region = None
        if self.cuda_region is not None:
            try:
                rpc.unregister_region(self.cuda_region)
            except AttnserveError:
                pass  # the lease ends it
            self.cuda_region = None
            self.cuda_buffer = None


    def _let_go(self) -> None:
        """Closes the region without the server; a view of it that a caller
        still holds (a future never completed) keeps the mapping alive until
        it goes, and the server reclaims the region once its holder closes."""
        import gc
        gc.collect()
        try:
            self.region.close()
        except BufferError:
            self.region._client = None


def _unknown(e: BaseException) -> bool:
    """Whether a failed call may have reached the server (so that it may
    still write into the call's area)."""
    from attnserve.errors import outcome_unknown
    return not isinstance(e, AttnserveError) or outcome_unknown(e)


class _Null:
    """Stands for a tensor while areas are only being sized."""

    def view(self, *shape):
        return self


# ---------------------------------------------------------------- the cache
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
        self.dtype = _SERVER_DTYPES[info.kv_dtype]
        self.max_num_pages = int(max_num_pages)
        self.device = torch.device(device) if device is not None else (
            torch.device("cuda", torch.cuda.current_device()) if transport == "cuda"
            else torch.device("cpu"))
        self.rpc = client.fork()
        self._lease = Lease(self.rpc, lease_ttl)
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

    def _requeue(self, layer: int, taken) -> None:
        with self._pending_lock:
            self._pending.setdefault(layer, []).insert(0, taken)

    def _take(self, layer: int):
        """The appends queued for `layer`, as one (slots, k, v), or None."""
        with self._pending_lock:
            queued = self._pending.pop(layer, None)
        if not queued:
            return None
        if len(queued) == 1:
            return queued[0]
        return (np.concatenate([s for s, _, _ in queued]), torch.cat([k for _, k, _ in queued]),
                None if queued[0][2] is None else torch.cat([v for _, _, v in queued]))

    def flush(self, layer: Optional[int] = None) -> None:
        """Writes the queued appends of `layer` (None: every layer) now (WriteKV)."""
        self._check_open()
        for l in ([layer] if layer is not None else list(self._pending)):
            taken = self._take(l)
            if taken is not None:
                slots, k, v = taken
                try:
                    self.rpc.write_kv(l, slots, k, v)
                except BaseException:
                    self._requeue(l, taken)     # WriteKV is idempotent: flush() again
                    raise

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
class _Wrapper:
    """What the two wrappers share: the step's layout, its server plans,
    and run()."""

    _kind = ""
    _mla = False   # BatchMLAPagedAttentionWrapper: the cache of an MLA server

    def __init__(self, float_workspace_buffer, kv_layout: str):
        if not isinstance(float_workspace_buffer, PagedKVCache):
            raise TypeError(
                "float_workspace_buffer: an attnserve.flashinfer.PagedKVCache expected (the "
                "server owns the KV cache and the workspace), not "
                f"{type(float_workspace_buffer).__name__}")
        if float_workspace_buffer.mla != self._mla:
            if float_workspace_buffer.mla:
                raise ValueError("float_workspace_buffer: the server computes multi-head latent "
                                 "attention (attention=mla): use BatchMLAPagedAttentionWrapper")
            raise ValueError("float_workspace_buffer: the server computes grouped-query "
                             "attention (attention=gqa): use BatchDecodeWithPagedKVCacheWrapper "
                             "or BatchPrefillWithPagedKVCacheWrapper")
        _check_kv_layout(kv_layout)
        self._cache = float_workspace_buffer
        self._kv_layout = kv_layout
        self._planned = False
        self._plans: dict = {}           # append slots (bytes) -> server plan id
        self._releases: list = []        # ReleasePlan calls in flight
        self._layouts: dict = {}
        self._tls = threading.local()    # .blocking: inside run() (see _now)

    def _now(self, start):
        """run(): run_async() started by start(), its call made blocking where
        it goes over gRPC (a blocking call costs less than a future waited for
        at once: Client._call_now), and its result."""
        self._tls.blocking = True
        try:
            future = start()
        finally:
            self._tls.blocking = False
        return future.result()

    @property
    def kv_cache(self) -> PagedKVCache:
        return self._cache

    def _set_plan(self, qo_indptr: np.ndarray, kv_indptr, kv_indices, kv_last, *,
                  causal: bool, sm_scale, window_left, logits_soft_cap, q_data_type,
                  kv_data_type, o_data_type) -> None:
        cache = self._cache
        cache._check_open()
        q_dt = _torch_dtype(q_data_type, "q_data_type")
        kv_dt = _torch_dtype(kv_data_type if kv_data_type is not None else q_dt, "kv_data_type")
        o_dt = _torch_dtype(o_data_type if o_data_type is not None else q_dt, "o_data_type")
        if kv_dt != cache.dtype:
            raise ValueError(f"kv_data_type={kv_dt}, but the server's KV cache holds "
                             f"{cache.dtype} (its --kv_dtype); FlashInfer's q_data_type "
                             f"defaults to float16: pass q_data_type={cache.dtype}")
        if q_dt != kv_dt:
            raise NotImplementedError(f"attnserve does not support q_data_type={q_dt} with "
                                      f"kv_data_type={kv_dt}: q travels in the cache's dtype")
        if o_dt != q_dt:
            raise NotImplementedError(f"attnserve does not support o_data_type={o_dt}: the "
                                      f"output has q's dtype ({q_dt})")
        if int(window_left) < -1:
            raise ValueError(f"window_left={window_left} must be >= -1 (-1: no window)")
        cap = 0.0 if logits_soft_cap is None else float(logits_soft_cap)
        if not math.isfinite(cap) or cap < 0:
            raise ValueError(f"logits_soft_cap={logits_soft_cap} must be finite and >= 0 "
                             "(None or 0: none)")
        if sm_scale is not None and not math.isfinite(float(sm_scale)):
            raise ValueError(f"sm_scale={sm_scale} must be finite")
        if len(qo_indptr) != len(kv_last) + 1:
            raise ValueError(f"qo_indptr has {len(qo_indptr)} entries, must have batch_size + 1 "
                             f"= {len(kv_last) + 1}")
        if qo_indptr[0] != 0 or np.any(np.diff(qo_indptr) < 0):
            raise ValueError("qo_indptr must start at 0 and be non-decreasing")
        self._release_plans()
        self._qo_indptr, self._kv_indptr = qo_indptr, kv_indptr
        self._kv_indices, self._kv_last = kv_indices, kv_last
        self._total_q = int(qo_indptr[-1])
        self._causal = bool(causal)
        self._sm_scale = None if sm_scale is None else float(sm_scale)
        self._window_left = int(window_left)
        self._soft_cap = cap
        self._q_dtype = q_dt
        self._planned = True

    # ------------------------------------------------------------ server plans
    def _release_plans(self) -> None:
        """Releases the last step's server plans (their answers are read at
        the next plan(), or at close())."""
        self._settle_releases()
        rpc = self._cache.rpc
        for plan_id in self._plans.values():
            try:
                self._releases.append(rpc._call_future(rpc._req_release_plan(plan_id), None))
            except AttnserveError:
                pass  # the lease holds the plan: it goes when the cache closes
        self._plans = {}
        self._layouts = {}

    def _settle_releases(self) -> None:
        for call in self._releases:
            try:
                call.result()
            except (NotFound, AttnserveError):
                pass  # gone already (idle timeout, lease ended): released either way
        self._releases = []

    def _server_plan(self, slots: Optional[np.ndarray]):
        """The plan id of this step's layout with `slots` appended, made at
        its first use; None when the appends must go apart (a third kind of
        append in one step)."""
        key = b"" if slots is None else slots.tobytes()
        plan_id = self._plans.get(key)
        if plan_id is None:
            if key and len(self._plans) >= 2:
                return None
            plan_id = self._cache.rpc.create_plan(self._qo_indptr, self._kv_indptr,
                                                  self._kv_indices, self._kv_last,
                                                  slots if slots is not None else [])
            self._plans[key] = plan_id
        return plan_id

    def close(self) -> None:
        """Releases this wrapper's server plans now (the cache's close() does too)."""
        if self._cache._closed:
            self._plans, self._releases = {}, []
            return
        self._release_plans()
        self._settle_releases()

    # ------------------------------------------------------------ run
    def _run(self, q, paged_kv_cache, args, *, q_scale, k_scale, v_scale, out, lse,
             return_lse, window_left, sinks, causal, lse_base: str = "2") -> AttentionFuture:
        cache = self._cache
        cache._check_open()
        if not self._planned:
            raise RuntimeError(f"{type(self).__name__}.run() before plan()")
        if args:
            raise NotImplementedError(f"attnserve does not support run()'s *args ({len(args)} "
                                      "given): they are a custom JIT kernel's arguments")
        layer = _layer_of(cache, paged_kv_cache)
        if not torch.is_tensor(q):
            raise TypeError(f"q: a torch tensor expected, not {type(q).__name__}")
        want = (self._total_q, cache.num_qo_heads, cache.head_dim)
        if tuple(q.shape) != want:
            raise ValueError(f"q has shape {list(q.shape)}, the plan needs {list(want)} "
                             "(total query rows, num_qo_heads, head_dim)")
        if q.dtype != self._q_dtype:
            raise ValueError(f"q has dtype {q.dtype}, which does not match the q_data_type "
                             f"{self._q_dtype} given to plan()")
        if out is not None:
            _check_tensor(out, "out", (*q.shape[:2], cache.v_head_dim), self._q_dtype, q.device)
        if lse is not None:
            _check_tensor(lse, "lse", q.shape[:2], torch.float32, q.device)
        scale = self._sm_scale if self._sm_scale is not None else 1.0 / math.sqrt(cache.head_dim)
        for name, s in (("q_scale", q_scale), ("k_scale", k_scale)):
            if s is not None:
                scale *= _scalar(s, name)
        v_scale = None if v_scale is None else _scalar(v_scale, "v_scale")
        window = self._window_left if window_left is None else int(window_left)
        if window < -1:
            raise ValueError(f"window_left={window_left} must be >= -1 (-1: no window)")
        sink_values = None
        if sinks is not None:
            sink_values = (sinks.detach().to("cpu", torch.float32).reshape(-1).numpy()
                           if torch.is_tensor(sinks) else np.asarray(sinks, np.float32).reshape(-1))
            if len(sink_values) != cache.num_qo_heads:
                raise ValueError(f"sinks has {len(sink_values)} entries, must have num_qo_heads "
                                 f"= {cache.num_qo_heads}")
        options = None
        if window != -1 or self._soft_cap != 0 or sink_values is not None:
            options = AttentionOptions(window_left=window if window != -1 else None,
                                       logits_soft_cap=self._soft_cap or None,
                                       sinks=sink_values)
        appended = cache._take(layer)
        k = v = None
        slots = None
        if appended is not None:
            slots, k, v = appended
        try:
            plan_id = self._server_plan(slots)
            if plan_id is None:                 # a third kind of append this step: apart
                cache.rpc.write_kv(layer, slots, k, v)
                appended = slots = k = v = None
                plan_id = self._server_plan(None)
            key = (plan_id, scale, lse_base)
            layout = self._layouts.get(key)
            if layout is None:
                layout = PrefillLayout.for_plan(plan_id, self._total_q,
                                                0 if slots is None else len(slots),
                                                sm_scale=scale, causal=causal, lse_base=lse_base)
                self._layouts[key] = layout
            request = _Request(layer=layer, q=q, layout=layout, k=k, v=v, options=options,
                               out=out, lse=lse, want_lse=bool(return_lse), v_scale=v_scale,
                               blocking=getattr(self._tls, "blocking", False))
            return cache._transport.submit(request)
        except BaseException:
            if appended is not None:            # not sent: queued again, first
                cache._requeue(layer, appended)
            raise


def _scalar(x, name: str) -> float:
    if torch.is_tensor(x):
        if x.numel() != 1:
            raise NotImplementedError(f"attnserve does not support a {name} of {x.numel()} "
                                      "values (per-head scales): one scale only")
        x = x.item()
    value = float(x)
    if not math.isfinite(value):
        raise ValueError(f"{name}={x} must be finite")
    return value


def _check_tensor(t, name: str, shape, dtype, device) -> None:
    if not torch.is_tensor(t):
        raise TypeError(f"{name}: a torch tensor expected, not {type(t).__name__}")
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name} has shape {list(t.shape)}, must be {list(shape)}")
    if t.dtype != dtype:
        raise ValueError(f"{name} has dtype {t.dtype}, must be {dtype}")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device}, must be on q's device {device}")


class BatchDecodeWithPagedKVCacheWrapper(_Wrapper):
    """FlashInfer's BatchDecodeWithPagedKVCacheWrapper on attnserve.

    float_workspace_buffer: the attnserve.flashinfer.PagedKVCache (the
      server owns the cache and the workspace); every other argument as in
      FlashInfer. use_tensor_cores picks FlashInfer's kernel and changes no
      result: attnserve's server picks its own. use_cuda_graph, the CUDA-graph
      buffers, a backend other than "auto" and jit_args raise
      NotImplementedError.
    """

    def __init__(self, float_workspace_buffer, kv_layout: str = "NHD",
                 use_cuda_graph: bool = False, use_tensor_cores: bool = False,
                 paged_kv_indptr_buffer=None, paged_kv_indices_buffer=None,
                 paged_kv_last_page_len_buffer=None, backend: str = "auto",
                 jit_args: Optional[List[Any]] = None) -> None:
        _unsupported(
            use_cuda_graph=(use_cuda_graph, False, "no CUDA graphs: each run is a request"),
            paged_kv_indptr_buffer=(paged_kv_indptr_buffer, None, "CUDA-graph buffers"),
            paged_kv_indices_buffer=(paged_kv_indices_buffer, None, "CUDA-graph buffers"),
            paged_kv_last_page_len_buffer=(paged_kv_last_page_len_buffer, None,
                                           "CUDA-graph buffers"),
            backend=(backend, "auto", "the server picks its kernels"),
            jit_args=(jit_args, None, "custom JIT kernels"))
        super().__init__(float_workspace_buffer, kv_layout)
        self._use_tensor_cores = bool(use_tensor_cores)

    @property
    def use_tensor_cores(self) -> bool:
        return self._use_tensor_cores

    @property
    def is_cuda_graph_enabled(self) -> bool:
        return False

    def plan(self, indptr, indices, last_page_len, num_qo_heads: int, num_kv_heads: int,
             head_dim: int, page_size: int, pos_encoding_mode: str = "NONE",
             window_left: int = -1, logits_soft_cap: Optional[float] = None,
             q_data_type="float16", kv_data_type=None, o_data_type=None, data_type=None,
             sm_scale: Optional[float] = None, rope_scale: Optional[float] = None,
             rope_theta: Optional[float] = None, non_blocking: bool = True,
             block_tables=None, seq_lens=None, fixed_split_size: Optional[int] = None,
             disable_split_kv: bool = False, q_len_per_req: int = 1, *,
             window_right: int = 0) -> None:
        """Plans a decode step (FlashInfer's arguments and defaults): indptr
        [batch + 1], indices (page indices into the PagedKVCache,
        0..max_num_pages-1), last_page_len [batch]; the geometry must be the
        server's. rope_scale and rope_theta take effect only with a
        pos_encoding_mode other than "NONE", as in FlashInfer (which raises
        NotImplementedError here); non_blocking changes nothing (no copy to a
        device is made)."""
        _unsupported(
            pos_encoding_mode=(pos_encoding_mode, "NONE", "apply RoPE / ALiBi to q and k "
                               "before the call"),
            window_right=(window_right, 0, "no right window bound"),
            block_tables=(block_tables, None, "the trtllm-gen layout: use indptr / indices"),
            seq_lens=(seq_lens, None, "the trtllm-gen layout: use indptr / last_page_len"),
            fixed_split_size=(fixed_split_size, None, "the server splits KV its own way"),
            disable_split_kv=(disable_split_kv, False, "the server splits KV its own way"))
        if int(q_len_per_req) < 1:
            raise ValueError(f"q_len_per_req must be >= 1, got {q_len_per_req}")
        cache = self._cache
        _check_geometry(cache, num_qo_heads=(num_qo_heads, "num_qo_heads"),
                        num_kv_heads=(num_kv_heads, "num_kv_heads"),
                        head_dim=(head_dim, "head_dim"), page_size=(page_size, "page_size"))
        kv_indptr, kv_indices, kv_last = _check_layout(
            cache, indptr, indices, last_page_len, ("indptr", "indices", "last_page_len"))
        if data_type is not None:        # FlashInfer's rule for the deprecated argument
            if q_data_type is None:
                q_data_type = data_type
            if kv_data_type is None:
                kv_data_type = data_type
        if q_data_type is None:
            raise ValueError("q_data_type must be a dtype (FlashInfer's default: float16)")
        q_len = int(q_len_per_req)
        if q_len > 1:
            kv_lens = _seq_lens(kv_indptr, kv_last, cache.page_size)
            if kv_lens.size and kv_lens.min() < q_len:
                raise ValueError(f"q_len_per_req={q_len} requires kv_len >= q_len_per_req for "
                                 f"every request (the rows must already be appended), but a "
                                 f"request has kv_len={int(kv_lens.min())}")
        qo_indptr = np.arange(len(kv_last) + 1, dtype=np.int64) * q_len
        self._q_len_per_req = q_len
        self._set_plan(qo_indptr, kv_indptr, kv_indices, kv_last, causal=q_len > 1,
                       sm_scale=sm_scale, window_left=window_left,
                       logits_soft_cap=logits_soft_cap, q_data_type=q_data_type,
                       kv_data_type=kv_data_type, o_data_type=o_data_type)

    def run(self, q, paged_kv_cache, *args, q_scale=None, k_scale=None, v_scale=None,
            out=None, lse=None, return_lse: bool = False, enable_pdl=None,
            window_left: Optional[int] = None, sinks=None, q_len_per_req=None,
            skip_softmax_threshold_scale_factor=None, kv_cache_sf=None):
        """Decode attention of q [batch * q_len_per_req, num_qo_heads,
        head_dim] over paged_kv_cache (kv_cache[layer]): the output [same
        shape], or (output, lse [rows, num_qo_heads], base 2) with
        return_lse. enable_pdl is a CUDA launch detail and changes nothing.
        window_left must be None or the plan's (FlashInfer's rule)."""
        return self._now(lambda: self.run_async(
            q, paged_kv_cache, *args, q_scale=q_scale, k_scale=k_scale, v_scale=v_scale, out=out,
            lse=lse, return_lse=return_lse, enable_pdl=enable_pdl, window_left=window_left,
            sinks=sinks, q_len_per_req=q_len_per_req,
            skip_softmax_threshold_scale_factor=skip_softmax_threshold_scale_factor,
            kv_cache_sf=kv_cache_sf))

    def run_return_lse(self, q, paged_kv_cache, *args, **kwargs):
        return self.run(q, paged_kv_cache, *args, return_lse=True, **kwargs)

    def run_async(self, q, paged_kv_cache, *args, q_scale=None, k_scale=None, v_scale=None,
                  out=None, lse=None, return_lse: bool = False, enable_pdl=None,
                  window_left: Optional[int] = None, sinks=None, q_len_per_req=None,
                  skip_softmax_threshold_scale_factor=None,
                  kv_cache_sf=None) -> AttentionFuture:
        """run(), returning an AttentionFuture as soon as the request is sent."""
        _unsupported(
            skip_softmax_threshold_scale_factor=(skip_softmax_threshold_scale_factor, None,
                                                 "no skip-softmax sparsity"),
            kv_cache_sf=(kv_cache_sf, None, "no NVFP4 KV cache"))
        if not self._planned:
            raise RuntimeError("BatchDecodeWithPagedKVCacheWrapper.run() before plan()")
        if window_left is not None and int(window_left) != self._window_left:
            raise ValueError(f"window_left={window_left} differs from plan()'s "
                             f"{self._window_left}: the decode wrapper's run() takes None or "
                             "the plan's value, as FlashInfer's")
        if q_len_per_req is not None and torch.is_tensor(q):
            expected = (len(self._qo_indptr) - 1) * int(q_len_per_req)
            if q.shape[0] != expected:
                raise ValueError(f"q.shape[0] ({q.shape[0]}) does not match batch_size * "
                                 f"q_len_per_req ({expected})")
        return self._run(q, paged_kv_cache, args, q_scale=q_scale, k_scale=k_scale,
                         v_scale=v_scale, out=out, lse=lse, return_lse=return_lse,
                         window_left=None, sinks=sinks, causal=self._q_len_per_req > 1)


class BatchPrefillWithPagedKVCacheWrapper(_Wrapper):
    """FlashInfer's BatchPrefillWithPagedKVCacheWrapper on attnserve.

    float_workspace_buffer: the attnserve.flashinfer.PagedKVCache (the
      server owns the cache and the workspace); every other argument as in
      FlashInfer. use_cuda_graph, its buffers, custom masks, a backend other
      than "auto", jit_args and jit_kwargs raise NotImplementedError.
    """

    def __init__(self, float_workspace_buffer, kv_layout: str = "NHD",
                 use_cuda_graph: bool = False, qo_indptr_buf=None, paged_kv_indptr_buf=None,
                 paged_kv_indices_buf=None, paged_kv_last_page_len_buf=None,
                 custom_mask_buf=None, mask_indptr_buf=None, backend: str = "auto",
                 jit_args: Optional[List[Any]] = None, jit_kwargs=None) -> None:
        graph = "CUDA-graph buffers"
        _unsupported(
            use_cuda_graph=(use_cuda_graph, False, "no CUDA graphs: each run is a request"),
            qo_indptr_buf=(qo_indptr_buf, None, graph),
            paged_kv_indptr_buf=(paged_kv_indptr_buf, None, graph),
            paged_kv_indices_buf=(paged_kv_indices_buf, None, graph),
            paged_kv_last_page_len_buf=(paged_kv_last_page_len_buf, None, graph),
            custom_mask_buf=(custom_mask_buf, None, "no custom masks"),
            mask_indptr_buf=(mask_indptr_buf, None, "no custom masks"),
            backend=(backend, "auto", "the server picks its kernels"),
            jit_args=(jit_args, None, "custom JIT kernels"),
            jit_kwargs=(jit_kwargs, None, "custom JIT kernels"))
        super().__init__(float_workspace_buffer, kv_layout)

    @property
    def is_cuda_graph_enabled(self) -> bool:
        return False

    def plan(self, qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len,
             num_qo_heads: int, num_kv_heads: int, head_dim_qk: int, page_size: int,
             head_dim_vo: Optional[int] = None, custom_mask=None, packed_custom_mask=None,
             causal: bool = False, pos_encoding_mode: str = "NONE",
             use_fp16_qk_reduction: bool = False, sm_scale: Optional[float] = None,
             window_left: int = -1, logits_soft_cap: Optional[float] = None,
             rope_scale: Optional[float] = None, rope_theta: Optional[float] = None,
             q_data_type="float16", kv_data_type=None, o_data_type=None,
             non_blocking: bool = True, prefix_len_ptr=None, token_pos_in_items_ptr=None,
             token_pos_in_items_len: int = 0, max_item_len_ptr=None, seq_lens=None,
             seq_lens_q=None, block_tables=None, max_token_per_sequence=None,
             max_sequence_kv=None, fixed_split_size: Optional[int] = None,
             disable_split_kv: bool = False) -> None:
        """Plans a prefill / append step (FlashInfer's arguments and
        defaults; causal defaults to False, as FlashInfer's; the mask is
        aligned bottom-right): qo_indptr [batch + 1], paged_kv_indptr
        [batch + 1], paged_kv_indices (page indices into the PagedKVCache),
        paged_kv_last_page_len [batch]. rope_scale and rope_theta take effect
        only with a pos_encoding_mode other than "NONE", as in FlashInfer
        (which raises NotImplementedError here); non_blocking changes nothing."""
        cache = self._cache
        _unsupported(
            head_dim_vo=(head_dim_vo if head_dim_vo != head_dim_qk else None, None,
                         "head_dim_vo must be head_dim_qk"),
            custom_mask=(custom_mask, None, "no custom masks: causal, windows"),
            packed_custom_mask=(packed_custom_mask, None, "no custom masks: causal, windows"),
            pos_encoding_mode=(pos_encoding_mode, "NONE", "apply RoPE / ALiBi to q and k "
                               "before the call"),
            use_fp16_qk_reduction=(use_fp16_qk_reduction, False, "the server accumulates in "
                                   "fp32"),
            prefix_len_ptr=(prefix_len_ptr, None, "no multi-item scoring"),
            token_pos_in_items_ptr=(token_pos_in_items_ptr, None, "no multi-item scoring"),
            token_pos_in_items_len=(token_pos_in_items_len, 0, "no multi-item scoring"),
            max_item_len_ptr=(max_item_len_ptr, None, "no multi-item scoring"),
            seq_lens=(seq_lens, None, "the trtllm-gen / cudnn layout: use the indptrs"),
            seq_lens_q=(seq_lens_q, None, "the trtllm-gen / cudnn layout: use the indptrs"),
            block_tables=(block_tables, None, "the trtllm-gen layout: use the indptrs"),
            max_token_per_sequence=(max_token_per_sequence, None, "cudnn only"),
            max_sequence_kv=(max_sequence_kv, None, "cudnn only"),
            fixed_split_size=(fixed_split_size, None, "the server splits KV its own way"),
            disable_split_kv=(disable_split_kv, False, "the server splits KV its own way"))
        _check_geometry(cache, num_qo_heads=(num_qo_heads, "num_qo_heads"),
                        num_kv_heads=(num_kv_heads, "num_kv_heads"),
                        head_dim_qk=(head_dim_qk, "head_dim"), page_size=(page_size, "page_size"))
        kv_indptr, kv_indices, kv_last = _check_layout(
            cache, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len,
            ("paged_kv_indptr", "paged_kv_indices", "paged_kv_last_page_len"))
        qo = _ints(qo_indptr, "qo_indptr")
        if q_data_type is None:
            raise ValueError("q_data_type must be a dtype (FlashInfer's default: float16)")
        self._set_plan(qo, kv_indptr, kv_indices, kv_last, causal=bool(causal),
                       sm_scale=sm_scale, window_left=window_left,
                       logits_soft_cap=logits_soft_cap, q_data_type=q_data_type,
                       kv_data_type=kv_data_type, o_data_type=o_data_type)

    def run(self, q, paged_kv_cache, *args, q_scale=None, k_scale=None, v_scale=None,
            out=None, lse=None, return_lse: bool = False, enable_pdl=None,
            window_left: Optional[int] = None, sinks=None, kv_cache_sf=None,
            skip_softmax_threshold_scale_factor=None, use_fp16_softmax=None,
            uses_spcompress=None):
        """Prefill attention of q [qo_indptr[-1], num_qo_heads, head_dim] over
        paged_kv_cache (kv_cache[layer]): the output, or (output, lse base 2)
        with return_lse. window_left overrides the plan's for this call (-1:
        none); enable_pdl is a CUDA launch detail and changes nothing."""
        return self._now(lambda: self.run_async(
            q, paged_kv_cache, *args, q_scale=q_scale, k_scale=k_scale, v_scale=v_scale, out=out,
            lse=lse, return_lse=return_lse, enable_pdl=enable_pdl, window_left=window_left,
            sinks=sinks, kv_cache_sf=kv_cache_sf,
            skip_softmax_threshold_scale_factor=skip_softmax_threshold_scale_factor,
            use_fp16_softmax=use_fp16_softmax, uses_spcompress=uses_spcompress))

    def run_return_lse(self, q, paged_kv_cache, *args, **kwargs):
        return self.run(q, paged_kv_cache, *args, return_lse=True, **kwargs)

    def run_async(self, q, paged_kv_cache, *args, q_scale=None, k_scale=None, v_scale=None,
                  out=None, lse=None, return_lse: bool = False, enable_pdl=None,
                  window_left: Optional[int] = None, sinks=None, kv_cache_sf=None,
                  skip_softmax_threshold_scale_factor=None, use_fp16_softmax=None,
                  uses_spcompress=None) -> AttentionFuture:
        """run(), returning an AttentionFuture as soon as the request is sent."""
        _unsupported(
            kv_cache_sf=(kv_cache_sf, None, "no NVFP4 KV cache"),
            skip_softmax_threshold_scale_factor=(skip_softmax_threshold_scale_factor, None,
                                                 "no skip-softmax sparsity"),
            use_fp16_softmax=(use_fp16_softmax, None, "the server's softmax is fp32"),
            uses_spcompress=(uses_spcompress, None, "trtllm-gen's sparse compression"))
        if not self._planned:
            raise RuntimeError("BatchPrefillWithPagedKVCacheWrapper.run() before plan()")
        return self._run(q, paged_kv_cache, args, q_scale=q_scale, k_scale=k_scale,
                         v_scale=v_scale, out=out, lse=lse, return_lse=return_lse,
                         window_left=window_left, sinks=sinks, causal=self._causal)


# ---------------------------------------------------------------- page.py
def append_paged_kv_cache(append_key, append_value, batch_indices, positions, paged_kv_cache,
                          kv_indices, kv_indptr, kv_last_page_len,
                          kv_layout: str = "NHD") -> None:
    """FlashInfer's append_paged_kv_cache into the server's cache:
    append_key, append_value [nnz, num_kv_heads, head_dim] in the cache's
    dtype; row i goes to position positions[i] of request batch_indices[i],
    whose pages are kv_indices[kv_indptr[b]:kv_indptr[b + 1]] (which, as in
    FlashInfer, already include the appended rows). paged_kv_cache is
    kv_cache[layer]. The rows are queued and reach the server with that
    layer's next run() (fused into its request) or kv_cache.flush()."""
    if not isinstance(paged_kv_cache, LayerCache):
        raise TypeError("paged_kv_cache: an attnserve.flashinfer.LayerCache (kv_cache[layer] of "
                        f"a PagedKVCache) expected, not {type(paged_kv_cache).__name__}")
    cache = paged_kv_cache.cache
    cache._check_open()
    _check_kv_layout(kv_layout)
    if cache.mla:
        raise ValueError("paged_kv_cache: the server computes multi-head latent attention "
                         "(attention=mla), whose cache holds latent rows and no V: use "
                         "append_paged_mla_kv_cache")
    shape = None
    for name, t in (("append_key", append_key), ("append_value", append_value)):
        if not torch.is_tensor(t):
            raise TypeError(f"{name}: a torch tensor expected, not {type(t).__name__}")
        if t.dim() != 3 or t.shape[1:] != (cache.num_kv_heads, cache.head_dim):
            raise ValueError(f"{name} has shape {list(t.shape)}, must be [nnz, "
                             f"num_kv_heads={cache.num_kv_heads}, head_dim={cache.head_dim}]")
        if t.dtype != cache.dtype:
            raise ValueError(f"{name} has dtype {t.dtype}; the server's KV cache holds "
                             f"{cache.dtype}")
        shape = shape or tuple(t.shape)
        if tuple(t.shape) != shape:
            raise ValueError(f"append_value has shape {list(t.shape)}, append_key "
                             f"{list(shape)}: they must match")
    nnz = shape[0]
    slots = _append_slots(cache, batch_indices, positions, kv_indices, kv_indptr,
                          kv_last_page_len, nnz)
    cache._queue(paged_kv_cache.layer, slots, append_key.detach().clone(),
                 append_value.detach().clone())


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


def get_seq_lens(kv_indptr, kv_last_page_len, page_size: int):
    """FlashInfer's get_seq_lens: each request's KV length,
    max(pages - 1, 0) * page_size + kv_last_page_len."""
    indptr = torch.as_tensor(kv_indptr)
    last = torch.as_tensor(kv_last_page_len)
    return torch.clamp(indptr[1:] - indptr[:-1] - 1, min=0) * page_size + last


def get_batch_indices_positions(append_indptr, seq_lens, nnz: int, batch_indices=None,
                                positions=None):
    """FlashInfer's get_batch_indices_positions: for each of the nnz rows of
    a ragged append (append_indptr [batch + 1]), its request and its position
    in it, the appended rows being the last of each request's seq_lens
    tokens. int32 tensors on append_indptr's device (filled in place when
    given)."""
    indptr = torch.as_tensor(append_indptr)
    device = indptr.device
    ind = indptr.to("cpu", torch.int64)
    lens = torch.as_tensor(seq_lens).to("cpu", torch.int64)
    batch = ind.numel() - 1
    if lens.numel() != batch:
        raise ValueError(f"seq_lens has {lens.numel()} entries, must have "
                         f"len(append_indptr) - 1 = {batch}")
    counts = ind[1:] - ind[:-1]
    if batch and (counts.min() < 0 or ind[0] != 0):
        raise ValueError("append_indptr must start at 0 and be non-decreasing")
    total = int(ind[-1]) if batch else 0
    if total > nnz:
        raise ValueError(f"append_indptr ends at {total}, past nnz={nnz}")
    b = torch.repeat_interleave(torch.arange(batch, dtype=torch.int64), counts)
    row = torch.arange(total, dtype=torch.int64) - ind[:-1][b]
    pos = lens[b] - counts[b] + row
    bi_out = torch.full((nnz,), -1, dtype=torch.int32)
    pos_out = torch.zeros((nnz,), dtype=torch.int32)
    bi_out[:total] = b.to(torch.int32)
    pos_out[:total] = pos.to(torch.int32)
    for name, given, made in (("batch_indices", batch_indices, bi_out),
                              ("positions", positions, pos_out)):
        if given is not None:
            _check_tensor(given, name, (nnz,), torch.int32, device)
    if batch_indices is not None:
        batch_indices.copy_(bi_out)
    else:
        batch_indices = bi_out.to(device)
    if positions is not None:
        positions.copy_(pos_out)
    else:
        positions = pos_out.to(device)
    return batch_indices, positions


# Multi-head latent attention (an MLA server): its wrapper and append, in a
# module of their own over the pieces above.
from attnserve._flashinfer_mla import (BatchMLAPagedAttentionWrapper,  # noqa: E402
                                       append_paged_mla_kv_cache)
