"""attnserve.flashinfer's transports (gRPC, shared-memory regions, request
channels, CUDA regions) and the futures run() returns: how a wrapper's
requests reach the server (the cache that owns them: _flashinfer_cache)."""

from __future__ import annotations

import math
import secrets
import threading
from typing import TYPE_CHECKING, Optional

import numpy as np

import torch  # attnserve.flashinfer, which imports this module, says when it is missing

from attnserve.errors import AttnserveError, outcome_unknown
from attnserve.regions import RegionTensor, SharedMemoryRegion

if TYPE_CHECKING:
    from attnserve._flashinfer_cache import PagedKVCache

_REGION_DTYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}

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
        self._on_error = None         # called once with the error, when the call failed

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
                if self._on_error is not None:
                    self._on_error(e)
            self._done = True
            self._wait = self._poll = self._on_error = None  # what they hold goes now

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
        self.kv_format = cache.kv_format
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
        # An FP8 cache's rows as stored ("k8", "v8": one byte an element, in
        # the bytes of "k" and "v"), where torch has the FP8 dtype.
        if cache.kv_fp8 and isinstance(cache.kv_dtype, torch.dtype):
            for key in [k for k in ("k", "v") if k in self.offsets]:
                self.offsets[key + "8"] = self.offsets[key]
                self.tensors[key + "8"] = view(self.offsets[key], rows * hk * d,
                                               cache.kv_dtype).view((rows, hk, d))

    def ref(self, key: str, shape) -> RegionTensor:
        dtype = "fp32" if key == "lse" else self.kv_format if key in ("k8", "v8") else self.dtype
        return RegionTensor(self.region, self.offsets[key], tuple(int(s) for s in shape), dtype)


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
        # Built requests by what they depend on (area, layer, rows, layout,
        # the client's incarnation and lease): a step's requests repeat them
        # layer after layer, and building one costs as much as sending it.
        self._requests: dict = {}
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
            # FP8 rows (an FP8 cache's, stored as they are) or q-dtype rows.
            fp8 = bool(na) and r.k.dtype != self.cache.dtype
            k_key, v_key = ("k8", "v8") if fp8 else ("k", "v")
            if na:
                t[k_key][:na].copy_(r.k)
                k_ref = area.ref(k_key, r.k.shape)
                if r.v is not None:
                    t[v_key][:na].copy_(r.v)
                    v_ref = area.ref(v_key, r.v.shape)
            if self.name == "cuda":
                # The server reads q, k, v on its own stream: the caller's
                # stream must have written them first.
                torch.cuda.current_stream(self.cuda_buffer.device).synchronize()
            rpc = self.cache.rpc
            key = None if r.options is not None else (
                index, r.layer, tuple(r.q.shape), na, fp8, r.v is not None, r.layout,
                rpc._incarnation, rpc._lease_id)
            request = None if key is None else self._requests.get(key)
            if request is None:
                o_shape = (n, r.q.shape[1], self.cache.v_head_dim)
                request = rpc._req_prefill(r.layer, area.ref("q", r.q.shape), r.layout, k_ref,
                                           v_ref, None, None,
                                           (area.ref("o", o_shape), area.ref("lse", r.q.shape[:2])),
                                           r.options)
                if key is not None:
                    if len(self._requests) >= 4096:
                        self._requests.clear()
                    self._requests[key] = request
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
    return not isinstance(e, AttnserveError) or outcome_unknown(e)


class _Null:
    """Stands for a tensor while areas are only being sized."""

    def view(self, *shape):
        return self
