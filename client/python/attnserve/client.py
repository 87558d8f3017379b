"""The attnserve client (sync); attnserve.aio.AsyncClient is its asyncio twin.

    import attnserve
    client = attnserve.Client("127.0.0.1:50051")           # reads info() at once
    pages = client.allocate_pages(2)
    slots = [p * client.server_info.page_size + i for p in pages for i in range(16)]
    client.write_kv(0, slots, k, v)                        # k, v: [32, kv_heads, head_dim]
    r = client.prefill(0, q, qo_indptr=[0, 4], kv_indptr=[0, 2], kv_indices=pages,
                       kv_last_page_len=[16])
    r.output, r.lse                                        # [4, qo_heads, head_dim], [4, qo_heads]

Tensors go in as numpy or torch (see attnserve.dtypes) and come out as numpy
(default) or torch: `out="torch"` (and `device=`), or automatically when the
query is a torch tensor. Every failure raises a subclass of
attnserve.AttnserveError with the server's code and message.

Incarnation: the client learns the server's incarnation from its first
response and sends it as `expected_incarnation` on every later request that
names pages or slots; it also checks the incarnation of every response. After
a server restart each such call raises StaleIncarnation instead of touching
pages that now belong to someone else. Re-create the state after
forget_incarnation() (same channel) or reconnect() (new channel, fresh info).
"""

from __future__ import annotations

import itertools
import time
from typing import Iterable, Optional

import grpc

from attnserve import _wire
from attnserve._core import _Core, _Request
# The names below were this module's before _core, _settings and results
# took them; attnserve.client goes on exporting them.
from attnserve._settings import (DEFAULT_MAX_MESSAGE_BYTES, HEALTH_CHECK,  # noqa: F401
                                 METHODS as _METHODS, RETAIN_MMAP_THRESHOLD,
                                 RETAIN_TRIM_THRESHOLD, RETRY_SERVICE_CONFIG, SERVICE,
                                 TRANSPORT_OPTIONS, method_path as _method_path,
                                 retain_freed_memory)
from attnserve.channel import RequestChannel
from attnserve.errors import Cancelled, DeadlineExceeded, NotFound, Unavailable, from_rpc_error
from attnserve.layout import AttentionOptions, PrefillLayout  # noqa: F401
from attnserve.results import (Holdings, HoldingsList, LeaseGrant, LeaseInfo,  # noqa: F401
                               PrefillResult, RegionInfo, ServerInfo)


class CallFuture:
    """A call in flight (Client._call_future): result() waits for the answer
    and returns what the blocking call would, or raises its error."""

    def __init__(self, future, method: str, parse, closed=lambda: None):
        self._future, self._method, self._parse = future, method, parse
        self._closed = closed  # () -> the error when the client closed the call's channel

    def done(self) -> bool:
        return self._future.done()

    def cancel(self) -> bool:
        """Cancels the call if it has not finished; result() then raises
        Cancelled."""
        return self._future.cancel()

    def result(self, timeout: Optional[float] = None):
        try:
            raw = self._future.result(timeout=timeout)
        except grpc.FutureTimeoutError:
            raise TimeoutError(f"{self._method}: no answer within {timeout} s of waiting (the "
                               "call goes on; result() again waits for it)") from None
        except grpc.FutureCancelledError:
            raise Cancelled("cancelled by the client", grpc.StatusCode.CANCELLED,
                            self._method) from None
        except grpc.RpcError as e:
            raise (self._closed() or from_rpc_error(e, self._method)) from None
        return self._parse(raw)


class DoneCall:
    """A call already made blocking (Client._call_now), behind CallFuture's
    interface: result() returns its answer or raises its error."""

    def __init__(self, value=None, error: Optional[BaseException] = None):
        self._value, self._error = value, error

    def done(self) -> bool:
        return True

    def result(self, timeout: Optional[float] = None):
        if self._error is not None:
            raise self._error
        return self._value


class Client(_Core):
    """Blocking client. Thread-safe: calls from several threads share one channel.

    Args:
      target: "host:port" of the server.
      token: sent as "authorization: Bearer TOKEN" on every call.
      tls: use TLS (implied by tls_ca / tls_cert); tls_ca: PEM file of the CA
        that signed the server's certificate (default: the system's roots);
        tls_cert, tls_key: PEM client certificate and key (mTLS).
      timeout: default per-call deadline in seconds (None: none); every
        method also takes timeout=.
      max_message_bytes: largest request or response (default 512 MiB, as the
        server's default --max_message_bytes).
      out: default result format, "numpy" or "torch" ("raw": 16-bit patterns).
        A query given as a torch tensor gets torch results, RawBits raw ones;
        a numpy or torch query gets its output in its own dtype.
      fetch_info: read the server's geometry now (health checks need none).
      connect_timeout: with fetch_info, wait at most this long (at most
        `timeout`) for the server's first answer. A cause gRPC names
        (connection refused, a host that does not resolve, a TLS mismatch, an
        HTTP/1 port such as the metrics one) raises Unavailable at once,
        saying so; only a connection still in progress, or one that failed
        for no named cause, is waited for.
      transport_tuning: gRPC settings for large tensors (TRANSPORT_OPTIONS);
        False: gRPC's defaults. channel_options are applied after them.
      interceptors: grpc.UnaryUnaryClientInterceptor objects that see every
        call (grpc.intercept_channel), or a function of the target that
        returns them; for tests that inject failures (tests/python/faults.py).
        Forks share them with the channel.
    """

    def __init__(self, target: str = "127.0.0.1:50051", *, token: Optional[str] = None,
                 tls: bool = False, tls_ca: Optional[str] = None, tls_cert: Optional[str] = None,
                 tls_key: Optional[str] = None, timeout: Optional[float] = None,
                 max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES, out: str = "numpy",
                 fetch_info: bool = True, channel_options: Iterable = (),
                 connect_timeout: float = 10.0, transport_tuning: bool = True,
                 interceptors: Iterable = ()):
        super().__init__(target, token=token, tls=tls, tls_ca=tls_ca, tls_cert=tls_cert,
                         tls_key=tls_key, timeout=timeout, max_message_bytes=max_message_bytes,
                         out=out, channel_options=channel_options,
                         transport_tuning=transport_tuning)
        self.connect_timeout = connect_timeout
        self._interceptors = tuple(interceptors(target) if callable(interceptors)
                                   else interceptors)
        self._open()
        if fetch_info:
            try:
                self._connect()
            except BaseException:
                self.close()
                raise

    def _connect(self) -> ServerInfo:
        """info(), fail-fast: a cause gRPC names (refused, unresolvable, TLS, an
        HTTP/1 port) raises Unavailable at once; a connection still in
        progress, or one that failed for no named cause, is tried again up to
        connect_timeout (at most timeout)."""
        wait = self._connect_wait()
        deadline = time.monotonic() + wait
        for attempt in itertools.count():
            try:
                return self.info(timeout=max(deadline - time.monotonic(), 1e-3))
            except (Unavailable, DeadlineExceeded) as e:
                backoff = self._connect_retry(e, wait, deadline, attempt)
            time.sleep(backoff)

    def _open(self) -> None:
        link = self._link
        if self._credentials is not None:
            link.channel = grpc.secure_channel(self.target, self._credentials,
                                               options=self._channel_options)
        else:
            link.channel = grpc.insecure_channel(self.target, options=self._channel_options)
        calls = link.channel
        if self._interceptors:
            calls = grpc.intercept_channel(link.channel, *self._interceptors)
        link.stubs = {name: calls.unary_unary(_method_path(name)) for name in _METHODS}
        link.health = link.channel.unary_unary(HEALTH_CHECK)

    def close(self) -> None:
        """Closes the channel: calls still in flight raise Cancelled, and so
        does every later call."""
        self._link.closed = True
        self._link.closes += 1
        self._close_region_holders()
        self._link.channel.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def reconnect(self) -> ServerInfo:
        """New channel, incarnation forgotten, geometry read again. The
        holders of registered regions stay. Forks (the KV managers,
        PagedKVCache) move to the new channel too and keep the incarnation
        they knew, so that they learn of a restart from their next call."""
        self._link.closes += 1
        self._link.channel.close()
        self._link.closed = False
        self.forget_incarnation()
        self._open()
        return self._connect()

    def _invoke(self, start, method: str, started: int):
        """start() (a stub call) with its failures typed: a call cut short, or
        refused ("Cannot invoke RPC on closed channel!", a ValueError), by
        this client's close() or reconnect() raises Cancelled saying so."""
        try:
            return start()
        except grpc.RpcError as e:
            raise (self._closed_error(method, started) or from_rpc_error(e, method)) from None
        except ValueError:
            closed = self._closed_error(method, started)
            if closed is None:
                raise
            raise closed from None

    def _call(self, request: _Request, timeout):
        method, body, parse = request
        raw = self._invoke(lambda: self._stubs[method](body, timeout=self._timeout(timeout),
                                                       metadata=self._metadata),
                           method, self._channel_closes)
        return parse(raw)

    def _call_future(self, request: _Request, timeout) -> "CallFuture":
        """Starts the call and returns at once; CallFuture.result() waits."""
        method, body, parse = request
        started = self._channel_closes
        future = self._invoke(lambda: self._stubs[method].future(
            body, timeout=self._timeout(timeout), metadata=self._metadata), method, started)
        return CallFuture(future, method, parse, lambda: self._closed_error(method, started))

    def _call_now(self, request: _Request, timeout) -> DoneCall:
        """The call made blocking, its outcome kept for result(): for a caller
        that would wait for a future at once. (A gRPC future's answer passes
        through a helper thread that grpcio starts for it; with a large
        answer that costs more than the call itself.)"""
        try:
            return DoneCall(self._call(request, timeout))
        except BaseException as e:  # delivered by result(), as a future's would be
            return DoneCall(error=e)

    # ------------------------------------------------------------ the API
    def info(self, *, timeout: Optional[float] = None) -> ServerInfo:
        """GetServerInfo: geometry, free pages, incarnation."""
        return self._call(self._req_info(), timeout)

    def allocate_pages(self, count: int, *, timeout: Optional[float] = None) -> list:
        """count new pages owned by this client's tenant; their ids."""
        return self._call(self._req_allocate(count), timeout)

    def free_pages(self, page_ids, *, timeout: Optional[float] = None) -> None:
        """Returns pages to the server (only their owner may)."""
        return self._call(self._req_free(page_ids), timeout)

    def write_kv(self, layer: int, slots, k, v=None, *,
                 timeout: Optional[float] = None) -> None:
        """Scatters rows: k, v [n, num_kv_heads, head_dim] into slots [n] of layer.
        An MLA server (server_info.mla) takes the latent rows alone: k
        [n, 1, qk_head_dim] ([c_kv after its RMSNorm | k_pe after rope]), v None.

        A slot is page_id * page_size + offset. On an FP8 server, 16-bit
        (or float) rows are quantized by the server with the layer's scales;
        FP8 rows (torch float8, RawBits of FP8 bits) are stored as they are.
        """
        return self._call(self._req_write_kv(layer, slots, k, v), timeout)

    def read_kv(self, layer: int, slots, *, out: Optional[str] = None, device=None,
                into=None, dequantize: bool = False, timeout: Optional[float] = None):
        """(k, v), each [n, num_kv_heads, head_dim], of slots [n] in layer; on an
        MLA server (k [n, 1, qk_head_dim], None): the latent rows, no V.

        An FP8 server's rows come as stored: uint8 bit patterns (torch float8
        with out="torch"); dequantize=True returns their values (stored value
        x scale) in the q dtype instead.
        into=(k, v) RegionTensors (MLA: k alone): the rows are written there;
        returns None.
        """
        return self._call(self._req_read_kv(layer, slots, out, device, into, dequantize),
                          timeout)

    def set_kv_scales(self, scales, *, timeout: Optional[float] = None) -> None:
        """An FP8 server's KV scales (real = fp8 value x scale): {layer: (k_scale,
        v_scale)}, each a number (the whole layer) or [num_kv_heads] values,
        finite and positive, k_scale at most 1e8, v_scale at most 1e30. All
        layers given or none change; layers not given keep theirs (1.0 from
        the start). Writes after this quantize
        with them and reads dequantize with them (docs/design.md, "FP8 KV
        cache")."""
        return self._call(self._req_set_kv_scales(scales), timeout)

    def kv_scales(self, *, timeout: Optional[float] = None) -> dict:
        """{layer: (k_scale, v_scale)}, each [num_kv_heads] float32, of every
        layer of an FP8 server; {} for a 16-bit one."""
        return self._call(self._req_get_kv_scales(), timeout)

    def prefill(self, layer: int, q, qo_indptr, kv_indptr, kv_indices, kv_last_page_len=None, *,
                sm_scale: Optional[float] = None, causal: Optional[bool] = None,
                lse_base: str = "2", append_slots=None, append_k=None, append_v=None,
                kv_keys_after=None, options=None, apply_sinks=None, out: Optional[str] = None,
                device=None, output_to=None, timeout: Optional[float] = None) -> PrefillResult:
        """Paged attention over a ragged batch (docs/design.md sections 3-4).

        q [total_q, num_qo_heads, head_dim]; qo_indptr, kv_indptr [batch + 1];
        kv_indices: page ids; kv_last_page_len [batch] in 1..page_size.
        sm_scale defaults to 1/sqrt(head_dim), causal to True (bottom-right),
        lse_base to "2" ("e": natural log). append_slots [n] with append_k,
        append_v [n, num_kv_heads, head_dim] are written before attention.
        An MLA server (server_info.mla): q [total_q, num_qo_heads, qk_head_dim]
        in the absorbed form (q_nope @ W_UK per head | q_pe), append_k
        [n, 1, qk_head_dim] latent rows with append_v None, output
        [total_q, num_qo_heads, v_head_dim]; pass the model's sm_scale.
        kv_keys_after [batch]: keys of each sequence held after this range
        (a sequence spread over servers; default none).
        options: attnserve.AttentionOptions (sliding window, soft-cap,
        sinks); apply_sinks [batch] of bools: False keeps the sinks out of
        that sequence (default: in every one).
        Returns output [total_q, num_qo_heads, head_dim] and lse
        [total_q, num_qo_heads] (float32; -inf where a row sees nothing, the
        sink's logit with a sink).
        q, append_k and append_v may be RegionTensors (attnserve.regions);
        output_to=(output, lse) RegionTensors: the results are written there
        and the returned PrefillResult's output and lse are None.
        """
        layout = PrefillLayout.encode(qo_indptr, kv_indptr, kv_indices, kv_last_page_len,
                                      sm_scale=sm_scale, causal=causal, lse_base=lse_base,
                                      append_slots=append_slots, kv_keys_after=kv_keys_after,
                                      options=options, apply_sinks=apply_sinks)
        return self.prefill_layout(layer, q, layout, append_k, append_v, out=out, device=device,
                                   output_to=output_to, timeout=timeout)

    def prefill_layout(self, layer: int, q, layout: PrefillLayout, append_k=None, append_v=None,
                       *, options=None, out: Optional[str] = None, device=None, output_to=None,
                       timeout: Optional[float] = None) -> PrefillResult:
        """prefill() with a layout encoded once (PrefillLayout.encode) for many
        layers; options: this layer's attnserve.AttentionOptions (when the
        layout carries none)."""
        return self._call(self._req_prefill(layer, q, layout, append_k, append_v, out, device,
                                            output_to, options), timeout)

    def create_plan(self, qo_indptr, kv_indptr, kv_indices, kv_last_page_len=None,
                    append_slots=None, kv_keys_after=None, *, options=None, layer_options=None,
                    apply_sinks=None, timeout: Optional[float] = None) -> int:
        """Registers a step's layout once (docs/design.md section 4); its id.

        Every layer's Prefill then names it: prefill_layout(layer, q,
        PrefillLayout.for_plan(plan_id, total_q, len(append_slots)), k, v).
        The plan pins its pages until release_plan() (or the server's idle
        timeout): free_pages() of them fails meanwhile.
        options: the attnserve.AttentionOptions of every layer's Prefill;
        layer_options {layer: AttentionOptions} replace them for those layers
        (e.g. the windowed layers of a model). A Prefill naming the plan may
        set what they leave unset. apply_sinks as in prefill().
        """
        return self._call(self._req_create_plan(qo_indptr, kv_indptr, kv_indices,
                                                kv_last_page_len, append_slots, kv_keys_after,
                                                options, layer_options, apply_sinks),
                          timeout)

    def release_plan(self, plan_id: int, *, timeout: Optional[float] = None) -> None:
        """Drops a plan; its pages are unpinned once no request uses it."""
        return self._call(self._req_release_plan(plan_id), timeout)

    def merge_states(self, states, *, lse_base: str = "2", out: Optional[str] = None,
                     device=None, into=None, timeout: Optional[float] = None):
        """Merges partial attention states [(v [n, h, d], lse [n, h]), ...] by LSE.

        Returns (v, lse) of the same shapes. Any v or lse may be a
        RegionTensor; into=(v, lse) RegionTensors: the result is written
        there and None is returned.
        """
        return self._call(self._req_merge(states, lse_base, out, device, into), timeout)

    # ------------------------------------------------------------ regions
    def register_system_region(self, name: str, fd, byte_size: int, *, offset: int = 0,
                               timeout: Optional[float] = None) -> None:
        """Registers [offset, offset + byte_size) of memfd `fd` (an int or an
        object with fileno(); sealed with at least F_SEAL_SHRINK) as region
        `name` (docs/transport.md; the server needs --allow_shared_memory and
        runs on this host). The descriptor goes to the server's region socket,
        then RegisterRegion names it; the client keeps the region's holder
        connection until unregister_region() or close().
        attnserve.regions.SharedMemoryRegion makes such a memfd."""
        # Its socket and incarnation as the server says now: after
        # forget_incarnation() (a restarted server) those read at connect
        # are another server's.
        if self._info is None or not self._info.region_socket or not self._incarnation:
            self.info(timeout=timeout)
        token, holder = self._deposit(fd)
        try:
            self._call(self._req_register_region(name, system=(token, offset, byte_size)),
                       timeout)
        except BaseException:
            if holder is not None:
                holder.close()
            raise
        self._keep_region_holder(name, holder)

    def register_cuda_region(self, name: str, ipc_handle: bytes, device_id: int, byte_size: int,
                             *, timeout: Optional[float] = None) -> None:
        """Registers the first byte_size bytes of the CUDA allocation exported by
        `ipc_handle` (64 bytes of cudaIpcMemHandle_t; attnserve.regions.cuda_ipc_handle,
        or register_cuda_tensor for a torch tensor) on device `device_id`. Needs a
        CUDA-backend server on the same host whose GPU is that device or a peer of it;
        the CPU backend answers FailedPrecondition."""
        return self._call(self._req_register_region(name, cuda=(ipc_handle, device_id, byte_size)),
                          timeout)

    def unregister_region(self, name: str, *, timeout: Optional[float] = None) -> None:
        """The name goes at once; requests in flight keep the memory until they finish."""
        try:
            return self._call(self._req_unregister_region(name), timeout)
        except NotFound:
            self._drop_region_holder(name)
            raise

    def list_regions(self, *, timeout: Optional[float] = None) -> list:
        """This tenant's regions: a list of RegionInfo."""
        return self._call(self._req_list_regions(), timeout)

    # ------------------------------------------------------------ channels
    def open_channel(self, region, offset: int = 0, *, slot_count: int = 4,
                     slot_bytes: int = 64 << 10, spin_us: float = 50,
                     timeout: Optional[float] = None):
        """Opens a request channel (docs/transport.md, "Request channels") on
        the ring at `offset` of `region`, a SharedMemoryRegion registered
        with this client: Prefills then travel through the ring's slots
        instead of a gRPC call each. Returns an attnserve.channel.RequestChannel
        (its prefill() and prefill_layout() are this client's). Needs a
        server on this host with --allow_shared_memory."""
        return RequestChannel._open(self, region, offset, slot_count=slot_count,
                                    slot_bytes=slot_bytes, spin_us=spin_us, timeout=timeout)

    def close_channel(self, channel_id: int, *, timeout: Optional[float] = None) -> None:
        """CloseChannel: the server answers what the channel took, then stops polling it."""
        return self._call(self._req_close_channel(channel_id), timeout)

    # ------------------------------------------------------------ leases
    def grant_lease(self, ttl: Optional[float] = None, *,
                    timeout: Optional[float] = None) -> LeaseGrant:
        """A new lease (docs/security.md, "Leases") living `ttl` seconds (None
        or 0: the server's default) unless renewed; attnserve.Lease keeps one
        alive."""
        return self._call(self._req_grant_lease(ttl), timeout)

    def keep_alive(self, lease_id: int, *, timeout: Optional[float] = None) -> float:
        """Renews a lease; the seconds it now lives. LeaseExpired when it is gone."""
        return self._call(self._req_keep_alive(lease_id), timeout)

    def revoke_lease(self, lease_id: int, *, timeout: Optional[float] = None) -> Holdings:
        """Ends a lease now; what it released (nothing when it was gone already)."""
        return self._call(self._req_revoke_lease(lease_id), timeout)

    def list_holdings(self, lease_id: int = 0, *,
                      timeout: Optional[float] = None) -> HoldingsList:
        """What this tenant holds: per lease and unleased (or one lease's)."""
        return self._call(self._req_list_holdings(lease_id), timeout)

    def release_holdings(self, *, timeout: Optional[float] = None) -> Holdings:
        """Releases everything this tenant holds, its leases included."""
        return self._call(self._req_release_holdings(), timeout)

    def fork(self) -> "Client":
        """A client over the same channel, with this one's server info and
        incarnation and no lease: for a component that holds state under a
        lease of its own (the KV managers). Closing either closes the channel;
        reconnect() on either moves both to the new one."""
        c = object.__new__(type(self))
        c.__dict__.update(self.__dict__)
        c._lease_id = 0
        return c

    def health(self, service: str = "", *, timeout: Optional[float] = None) -> str:
        """grpc.health.v1 Check: "SERVING", "NOT_SERVING", "UNKNOWN" or "SERVICE_UNKNOWN".

        service "" is the server as a whole; "attnserve.v1.AttentionService"
        the API. The deadline defaults to 5 s when the client has none.
        """
        t = self._timeout(timeout)
        try:
            raw = self._health(_wire.health_request(service), timeout=5.0 if t is None else t,
                               metadata=self._metadata)
        except grpc.RpcError as e:
            raise self._health_error(from_rpc_error(e, "Health/Check")) from None
        return _wire.health_status(raw)
