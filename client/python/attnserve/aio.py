"""asyncio client (grpc.aio): the same methods as attnserve.Client, awaited.

    async with attnserve.AsyncClient("127.0.0.1:50051") as client:   # reads info()
        pages = await client.allocate_pages(2)
        a, b = await asyncio.gather(client.prefill(0, q0, ...), client.prefill(1, q1, ...))

Many calls may be in flight at once on one client; the server batches
concurrent Prefills into one kernel launch. Methods that need the server's
geometry read info() first if the client has not yet.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from typing import Iterable, Optional

import grpc
import grpc.aio

from attnserve import _wire
from attnserve._core import _Core
from attnserve._settings import DEFAULT_MAX_MESSAGE_BYTES, HEALTH_CHECK, METHODS, method_path
from attnserve.layout import PrefillLayout
from attnserve.results import Holdings, HoldingsList, LeaseGrant, PrefillResult, ServerInfo
from attnserve.errors import DeadlineExceeded, NotFound, Unavailable, from_rpc_error


class AsyncClient(_Core):
    """asyncio twin of attnserve.Client (same arguments and results, but for
    the blocking client's request channels, open_channel / close_channel, and
    its fetch_info argument).

    Make it inside the event loop that will use it. `async with` reads the
    server's info on entry and closes the channel on exit.
    """

    def __init__(self, target: str = "127.0.0.1:50051", *, token: Optional[str] = None,
                 tls: bool = False, tls_ca: Optional[str] = None, tls_cert: Optional[str] = None,
                 tls_key: Optional[str] = None, timeout: Optional[float] = None,
                 max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES, out: str = "numpy",
                 channel_options: Iterable = (), connect_timeout: float = 10.0,
                 transport_tuning: bool = True, interceptors: Iterable = ()):
        super().__init__(target, token=token, tls=tls, tls_ca=tls_ca, tls_cert=tls_cert,
                         tls_key=tls_key, timeout=timeout, max_message_bytes=max_message_bytes,
                         out=out, channel_options=channel_options,
                         transport_tuning=transport_tuning)
        self.connect_timeout = connect_timeout
        # grpc.aio.UnaryUnaryClientInterceptor objects, or a function of the
        # target that returns them (tests that inject failures).
        self._interceptors = list(interceptors(target) if callable(interceptors)
                                  else interceptors) or None
        self._info_lock: Optional[asyncio.Lock] = None  # made in the loop that uses it
        self._open()

    def _open(self) -> None:
        link = self._link
        if self._credentials is not None:
            link.channel = grpc.aio.secure_channel(self.target, self._credentials,
                                                   options=self._channel_options,
                                                   interceptors=self._interceptors)
        else:
            link.channel = grpc.aio.insecure_channel(self.target, options=self._channel_options,
                                                     interceptors=self._interceptors)
        link.stubs = {name: link.channel.unary_unary(method_path(name)) for name in METHODS}
        link.health = link.channel.unary_unary(HEALTH_CHECK)

    async def close(self) -> None:
        """Closes the channel: calls still in flight raise Cancelled, and so
        does every later call."""
        self._link.closed = True
        self._link.closes += 1
        self._close_region_holders()
        await self._link.channel.close()

    async def _connect(self) -> ServerInfo:
        """info(), as Client's connect: a named cause fails at once, a
        connection in progress is waited for up to connect_timeout."""
        wait = self._connect_wait()
        deadline = time.monotonic() + wait
        for attempt in itertools.count():
            try:
                return await self.info(timeout=max(deadline - time.monotonic(), 1e-3))
            except (Unavailable, DeadlineExceeded) as e:
                backoff = self._connect_retry(e, wait, deadline, attempt)
            await asyncio.sleep(backoff)

    async def __aenter__(self) -> "AsyncClient":
        try:
            await self._connect()
        except BaseException:
            await self.close()
            raise
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def reconnect(self) -> ServerInfo:
        """New channel, incarnation forgotten, geometry read again. The
        holders of registered regions stay. Forks move to the new channel
        and keep their incarnation, as Client.reconnect's."""
        self._link.closes += 1
        await self._link.channel.close()
        self._link.closed = False
        self.forget_incarnation()
        self._open()
        return await self._connect()

    async def _call(self, request, timeout):
        method, body, parse = request
        started = self._channel_closes
        closed = self._closed_error(method, started)
        if closed is not None:
            raise closed
        try:
            raw = await self._stubs[method](body, timeout=self._timeout(timeout),
                                            metadata=self._metadata)
        except grpc.RpcError as e:
            raise (self._closed_error(method, started) or from_rpc_error(e, method)) from None
        except asyncio.CancelledError:
            # grpc.aio cancels the calls of a channel it closes: that is this
            # client's close() or reconnect(), not the caller's task.
            closed = self._closed_error(method, started)
            if closed is None:
                raise
            raise closed from None
        return parse(raw)

    async def _ensure_info(self, timeout: Optional[float] = None) -> Optional[float]:
        """Reads the server's info on the first call that needs it, within
        that call's timeout (the client's when None); returns what is left of
        the timeout for the call itself."""
        if self._info is not None:
            return timeout
        t = self._timeout(timeout)
        start = time.monotonic()
        if self._info_lock is None:
            self._info_lock = asyncio.Lock()

        async def read():
            async with self._info_lock:
                if self._info is None:
                    await self.info(timeout=t)
        if t is None:
            await read()
            return timeout
        try:
            await asyncio.wait_for(read(), t)
        except asyncio.TimeoutError:
            raise DeadlineExceeded(f"the server's info, read on the client's first call, did not "
                                   f"come within timeout={t} s", grpc.StatusCode.DEADLINE_EXCEEDED,
                                   "GetServerInfo") from None
        return max(t - (time.monotonic() - start), 1e-3)

    # ------------------------------------------------------------ the API
    async def info(self, *, timeout: Optional[float] = None) -> ServerInfo:
        return await self._call(self._req_info(), timeout)

    async def allocate_pages(self, count: int, *, timeout: Optional[float] = None) -> list:
        return await self._call(self._req_allocate(count), timeout)

    async def free_pages(self, page_ids, *, timeout: Optional[float] = None) -> None:
        return await self._call(self._req_free(page_ids), timeout)

    async def write_kv(self, layer: int, slots, k, v=None, *,
                       timeout: Optional[float] = None) -> None:
        timeout = await self._ensure_info(timeout)
        return await self._call(self._req_write_kv(layer, slots, k, v), timeout)

    async def read_kv(self, layer: int, slots, *, out: Optional[str] = None, device=None,
                      into=None, dequantize: bool = False, timeout: Optional[float] = None):
        timeout = await self._ensure_info(timeout)
        return await self._call(self._req_read_kv(layer, slots, out, device, into, dequantize),
                                timeout)

    async def set_kv_scales(self, scales, *, timeout: Optional[float] = None) -> None:
        """As Client.set_kv_scales."""
        return await self._call(self._req_set_kv_scales(scales), timeout)

    async def kv_scales(self, *, timeout: Optional[float] = None) -> dict:
        """As Client.kv_scales."""
        return await self._call(self._req_get_kv_scales(), timeout)

    async def prefill(self, layer: int, q, qo_indptr, kv_indptr, kv_indices,
                      kv_last_page_len=None, *, sm_scale: Optional[float] = None,
                      causal: Optional[bool] = None, lse_base: str = "2", append_slots=None,
                      append_k=None, append_v=None, kv_keys_after=None, options=None,
                      apply_sinks=None, out: Optional[str] = None, device=None,
                      output_to=None, timeout: Optional[float] = None) -> PrefillResult:
        layout = PrefillLayout.encode(qo_indptr, kv_indptr, kv_indices, kv_last_page_len,
                                      sm_scale=sm_scale, causal=causal, lse_base=lse_base,
                                      append_slots=append_slots, kv_keys_after=kv_keys_after,
                                      options=options, apply_sinks=apply_sinks)
        return await self.prefill_layout(layer, q, layout, append_k, append_v, out=out,
                                         device=device, output_to=output_to, timeout=timeout)

    async def prefill_layout(self, layer: int, q, layout: PrefillLayout, append_k=None,
                             append_v=None, *, options=None, out: Optional[str] = None,
                             device=None, output_to=None,
                             timeout: Optional[float] = None) -> PrefillResult:
        timeout = await self._ensure_info(timeout)
        return await self._call(
            self._req_prefill(layer, q, layout, append_k, append_v, out, device, output_to,
                              options),
            timeout)

    async def create_plan(self, qo_indptr, kv_indptr, kv_indices, kv_last_page_len=None,
                          append_slots=None, kv_keys_after=None, *, options=None,
                          layer_options=None, apply_sinks=None,
                          timeout: Optional[float] = None) -> int:
        timeout = await self._ensure_info(timeout)
        return await self._call(self._req_create_plan(qo_indptr, kv_indptr, kv_indices,
                                                      kv_last_page_len, append_slots,
                                                      kv_keys_after, options, layer_options,
                                                      apply_sinks), timeout)

    async def release_plan(self, plan_id: int, *, timeout: Optional[float] = None) -> None:
        return await self._call(self._req_release_plan(plan_id), timeout)

    async def merge_states(self, states, *, lse_base: str = "2", out: Optional[str] = None,
                           device=None, into=None, timeout: Optional[float] = None):
        timeout = await self._ensure_info(timeout)
        return await self._call(self._req_merge(states, lse_base, out, device, into), timeout)

    async def register_system_region(self, name: str, fd, byte_size: int, *,
                                     offset: int = 0, timeout: Optional[float] = None) -> None:
        if self._info is None or not self._info.region_socket or not self._incarnation:
            await self.info(timeout=timeout)  # as Client.register_system_region
        # The deposit is a few blocking calls on a local socket: off the loop.
        token, holder = await asyncio.get_running_loop().run_in_executor(None, self._deposit, fd)
        try:
            await self._call(self._req_register_region(name, system=(token, offset, byte_size)),
                             timeout)
        except BaseException:
            if holder is not None:
                holder.close()
            raise
        self._keep_region_holder(name, holder)

    async def register_cuda_region(self, name: str, ipc_handle: bytes, device_id: int,
                                   byte_size: int, *, timeout: Optional[float] = None) -> None:
        return await self._call(
            self._req_register_region(name, cuda=(ipc_handle, device_id, byte_size)), timeout)

    async def unregister_region(self, name: str, *, timeout: Optional[float] = None) -> None:
        try:
            return await self._call(self._req_unregister_region(name), timeout)
        except NotFound:
            self._drop_region_holder(name)
            raise

    async def list_regions(self, *, timeout: Optional[float] = None) -> list:
        return await self._call(self._req_list_regions(), timeout)

    # ------------------------------------------------------------ leases
    async def grant_lease(self, ttl: Optional[float] = None, *,
                          timeout: Optional[float] = None) -> LeaseGrant:
        return await self._call(self._req_grant_lease(ttl), timeout)

    async def keep_alive(self, lease_id: int, *, timeout: Optional[float] = None) -> float:
        return await self._call(self._req_keep_alive(lease_id), timeout)

    async def revoke_lease(self, lease_id: int, *, timeout: Optional[float] = None) -> Holdings:
        return await self._call(self._req_revoke_lease(lease_id), timeout)

    async def list_holdings(self, lease_id: int = 0, *,
                            timeout: Optional[float] = None) -> HoldingsList:
        return await self._call(self._req_list_holdings(lease_id), timeout)

    async def release_holdings(self, *, timeout: Optional[float] = None) -> Holdings:
        return await self._call(self._req_release_holdings(), timeout)

    def fork(self) -> "AsyncClient":
        """As Client.fork: same channel (reconnect() on either moves both), no lease."""
        c = object.__new__(type(self))
        c.__dict__.update(self.__dict__)
        c._lease_id = 0
        return c

    async def health(self, service: str = "", *, timeout: Optional[float] = None) -> str:
        t = self._timeout(timeout)
        try:
            raw = await self._health(_wire.health_request(service),
                                     timeout=5.0 if t is None else t, metadata=self._metadata)
        except grpc.RpcError as e:
            raise self._health_error(from_rpc_error(e, "Health/Check")) from None
        return _wire.health_status(raw)
