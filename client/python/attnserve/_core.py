"""The state and wire encoding that attnserve.Client and
attnserve.AsyncClient share (_Core): the channel's options and credentials,
the incarnation and lease every request names, and for each RPC a request
(its method, its serialized bytes and the function that parses the answer),
which the two clients send their own way."""

from __future__ import annotations

import random
import time
from typing import Iterable, Optional

import grpc
import numpy as np

from attnserve import _wire
from attnserve import dtypes as _dt
from attnserve import regions as _regions
from attnserve._settings import RETRY_SERVICE_CONFIG, TRANSPORT_OPTIONS
from attnserve.errors import (AttnserveError, Cancelled, DeadlineExceeded, FailedPrecondition,
                              StaleIncarnation, Unavailable, connect_cause)
from attnserve.layout import (PrefillLayout, _extend, _floats, _index, _int32, _lse_base,
                              _options, _ttl_ms, _uint64, fill_layout)
from attnserve.regions import RegionTensor
from attnserve.results import (Holdings, HoldingsList, LeaseGrant, LeaseInfo, PrefillResult,
                               RegionInfo, ServerInfo)
from attnserve.v1 import attention_pb2 as pb


# One request: the method's name, its serialized bytes and the function that
# turns the response bytes into the result.
_Request = tuple  # (method: str, request: bytes, parse: Callable[[bytes], Any])


def _read(path: Optional[str]) -> Optional[bytes]:
    if not path:
        return None
    with open(path, "rb") as f:
        return f.read()


def _region_ref(t: RegionTensor) -> "pb.RegionRef":
    return pb.RegionRef(name=t.region, offset=t.offset, byte_size=t.nbytes)


def _region_field(field_number: int, t: RegionTensor, wire_dtype: int, name: str) -> bytes:
    """A Tensor field naming a region: dtype, shape and the region reference."""
    if t.dtype != "fp32" and t.wire_dtype != wire_dtype:
        raise ValueError(f"{name}: a region tensor of {t.dtype} where the server takes "
                         f"{_dt.DTYPE_NAMES[wire_dtype]} values")
    body = pb.Tensor(dtype=t.wire_dtype, shape=list(t.shape),
                     region=_region_ref(t)).SerializeToString()
    return _wire.tag(field_number, 2) + _wire.varint(len(body)) + body


def _tensor_field(field_number: int, x, wire_dtype: int, name: str) -> list:
    """The pieces of a Tensor field: x's bytes, or a region reference."""
    if isinstance(x, RegionTensor):
        return [_region_field(field_number, x, wire_dtype, name)]
    shape, data = _dt.to_wire(x, wire_dtype, name)
    return [_wire.tensor_head(field_number, wire_dtype, shape, data.nbytes), data]


def _check_kv_args(info: "ServerInfo", k, v, k_name: str = "k", v_name: str = "v") -> None:
    """A GQA server takes K and V rows, an MLA server K (latent) rows alone:
    ValueError naming the argument otherwise."""
    if k is None:
        raise ValueError(f"{k_name}: the rows to write are missing")
    if info.mla and v is not None:
        raise ValueError(
            f"{v_name}: the server computes multi-head latent attention (attention=mla), whose "
            f"cache holds one latent row per slot in {k_name} [n, 1, qk_head_dim="
            f"{info.qk_head_dim}] and no V; pass {v_name}=None")
    if not info.mla and v is None:
        raise ValueError(f"{v_name}: missing; the server computes grouped-query attention "
                         f"(attention=gqa), which stores K and V rows [n, {info.num_kv_heads}, "
                         f"{info.head_dim}] each")


def _fp8_wire_of(x):
    """The FP8 wire dtype of K or V rows x (a torch float8 tensor, RawBits of
    FP8 bits, or an FP8 RegionTensor), or None."""
    if isinstance(x, RegionTensor):
        return x.wire_dtype if x.wire_dtype in _dt.FP8_DTYPES else None
    return _dt.fp8_wire_of(x)


def _kv_wire(info: "ServerInfo", k, v) -> int:
    """The wire dtype of K and V rows (K alone: v None): the q dtype, or the
    cache's FP8 dtype for rows already in FP8 (torch float8, RawBits of FP8
    bits, FP8 RegionTensors), which are stored as they are. Both of one kind."""
    fp8 = [_fp8_wire_of(x) for x in ((k, v) if v is not None else (k, k))]
    if (fp8[0] is None) != (fp8[1] is None):
        raise TypeError("k and v: both FP8 rows or neither")
    if fp8[0] is None:
        return info.wire_dtype
    if not info.kv_fp8:
        raise TypeError(f"FP8 K and V rows: the server's kv_dtype is {info.kv_dtype}, which "
                        "takes 16-bit rows only")
    return info.kv_wire_dtype


def _read_into(into, mla: bool):
    """read_kv's into: (k, v) RegionTensors; on an MLA server k alone (a
    RegionTensor, or (k, None))."""
    if into is None:
        return None
    if mla:
        if isinstance(into, RegionTensor):
            return (into, None)
        if isinstance(into, (tuple, list)) and len(into) == 2 and \
                isinstance(into[0], RegionTensor) and into[1] is None:
            return (into[0], None)
        raise ValueError("into: a RegionTensor for the latent rows (an MLA server has no V)")
    return _pair(into, "into (k, v)")


def _pair(into, names: str):
    if into is None:
        return None
    if (not isinstance(into, (tuple, list)) or len(into) != 2
            or not all(isinstance(t, RegionTensor) for t in into)):
        raise ValueError(f"{names}: a pair of RegionTensors (both or neither)")
    return into



def geometry_error(m) -> str:
    """What is wrong with a ServerInfo's geometry, or "" (common/kv_geometry.h's
    GeometryShapeError, with ServerInfo.num_pages at least 1)."""
    def rng(field, v, lo, hi):
        return f"ServerInfo.{field}={v} out of range [{lo}, {hi}]"
    if not 1 <= m.num_layers <= 1024:
        return rng("num_layers", m.num_layers, 1, 1024)
    if not 1 <= m.page_size <= 128:
        return rng("page_size", m.page_size, 1, 128)
    if m.attention == pb.ATTENTION_MLA:
        if not (16 <= m.kv_lora_rank <= 1024 and m.kv_lora_rank % 16 == 0):
            return f"ServerInfo.kv_lora_rank={m.kv_lora_rank} must be a multiple of 16 in [16, 1024]"
        if not (0 <= m.qk_rope_head_dim <= 256 and m.qk_rope_head_dim % 16 == 0):
            return (f"ServerInfo.qk_rope_head_dim={m.qk_rope_head_dim} must be a multiple of 16 in "
                    "[0, 256]")
        if m.num_kv_heads != 1 or m.head_dim != m.kv_lora_rank + m.qk_rope_head_dim:
            return (f"ServerInfo.num_kv_heads={m.num_kv_heads} and ServerInfo.head_dim={m.head_dim} "
                    f"must be 1 and kv_lora_rank + qk_rope_head_dim "
                    f"({m.kv_lora_rank + m.qk_rope_head_dim}) with MLA")
    elif m.head_dim not in (64, 128, 256):
        return f"ServerInfo.head_dim={m.head_dim} must be 64, 128 or 256"
    if not 1 <= m.num_kv_heads <= 256:
        return rng("num_kv_heads", m.num_kv_heads, 1, 256)
    if not 1 <= m.num_qo_heads <= 256 or m.num_qo_heads % m.num_kv_heads:
        return (f"ServerInfo.num_qo_heads={m.num_qo_heads} must be in [1, 256] and a multiple of "
                f"ServerInfo.num_kv_heads={m.num_kv_heads}")
    if m.num_pages < 1:
        return f"ServerInfo.num_pages={m.num_pages} < 1"
    return ""

class _Link:
    """A client's channel and its stubs, shared by the client and its forks
    (fork(): the KV managers, PagedKVCache): reconnect() and close() on any
    of them move or close all of them. `closes` counts the channels closed
    (close(), reconnect()) and `closed` says close() was called, so that a
    call cut short by either says so (_Core._closed_error)."""

    __slots__ = ("channel", "stubs", "health", "closes", "closed")

    def __init__(self):
        self.channel = None
        self.stubs: dict = {}
        self.health = None
        self.closes = 0
        self.closed = False


class _Core:
    """State and wire encoding shared by Client and AsyncClient."""

    def __init__(self, target: str, *, token: Optional[str], tls: bool, tls_ca: Optional[str],
                 tls_cert: Optional[str], tls_key: Optional[str], timeout: Optional[float],
                 max_message_bytes: int, out: str, channel_options: Iterable = (),
                 transport_tuning: bool = True):
        if out not in ("numpy", "torch", "raw"):
            raise ValueError(f"out must be 'numpy', 'torch' or 'raw', not {out!r}")
        if bool(tls_cert) != bool(tls_key):
            raise ValueError("tls_cert and tls_key go together (mTLS)")
        if not target:
            raise ValueError("target is empty: the server's HOST:PORT (e.g. 127.0.0.1:50051)")
        # HOST:PORT with a numeric port (not a gRPC URI such as unix:PATH):
        # a TCP port, as the C++ client checks (CheckOptions).
        host, _, port = target.rpartition(":")
        if (host and port.isdigit() and "://" not in target
                and not target.startswith(("unix:", "unix-abstract:")) and not 1 <= int(port) <= 65535):
            raise ValueError(f"target={target}: port {port} out of range [1, 65535]")
        self.target = target
        self.timeout = timeout
        self.out = out
        self._metadata = (("authorization", f"Bearer {token}"),) if token else ()
        max_message_bytes = _index(max_message_bytes, "max_message_bytes")
        if max_message_bytes < 1:
            raise ValueError(f"max_message_bytes={max_message_bytes} must be >= 1")
        limit = int(min(max_message_bytes + (1 << 20), (1 << 31) - 1))
        self._channel_options = [
            ("grpc.max_send_message_length", limit),
            ("grpc.max_receive_message_length", limit),
            # Each client its own connection, as the C++ client does.
            ("grpc.use_local_subchannel_pool", 1),
            # Backoff with jitter on UNAVAILABLE, idempotent methods only;
            # requests of any size (gRPC retries none larger than its
            # per-call retry buffer, 256 KiB unless raised).
            ("grpc.enable_retries", 1),
            ("grpc.service_config", RETRY_SERVICE_CONFIG),
            ("grpc.per_rpc_retry_buffer_size", limit),
            *(TRANSPORT_OPTIONS if transport_tuning else ()),
            *channel_options,
        ]
        self._tls, self._tls_ca, self._tls_cert = bool(tls or tls_ca or tls_cert), tls_ca, tls_cert
        self._credentials = None
        if tls or tls_ca or tls_cert:
            self._credentials = grpc.ssl_channel_credentials(
                root_certificates=_read(tls_ca), private_key=_read(tls_key),
                certificate_chain=_read(tls_cert))
        self._incarnation = 0
        self._lease_id = 0
        self._info: Optional[ServerInfo] = None
        # The channel, shared with this client's forks (fork()).
        self._link = _Link()
        # The holder connections of the system regions this client
        # registered, by region name (attnserve.regions).
        self._region_holders: dict = {}

    # The shared channel's parts (_Link), for reading.
    @property
    def _channel(self):
        return self._link.channel

    @property
    def _stubs(self) -> dict:
        return self._link.stubs

    @property
    def _health(self):
        return self._link.health

    @property
    def _channel_closes(self) -> int:
        return self._link.closes

    @property
    def _closed(self) -> bool:
        return self._link.closed

    def _closed_error(self, method: str, started: int):
        """The error of a call that began when the client had closed
        `started` channels, if the client has closed its channel since (or was
        closed before it), else None."""
        if self._closed:
            return Cancelled("the client is closed (close() was called): make a new Client",
                             grpc.StatusCode.CANCELLED, method)
        if self._channel_closes != started:
            return Cancelled("the call was in flight when reconnect() closed the client's "
                             "channel", grpc.StatusCode.CANCELLED, method)
        return None

    # ------------------------------------------------------------ incarnation
    @property
    def incarnation(self) -> int:
        """The server incarnation this client expects (0: not learned yet)."""
        return self._incarnation

    def forget_incarnation(self) -> None:
        """Accept whatever incarnation the next response carries."""
        self._incarnation = 0

    # ------------------------------------------------------------ leases
    @property
    def lease_id(self) -> int:
        """The lease every request that takes one names (0: none)."""
        return self._lease_id

    def use_lease(self, lease_id: int) -> None:
        """Name `lease_id` (0: none) in every later request that takes a lease:
        what allocate_pages, create_plan and register_*_region make is held
        under it, and the pages and plans a request uses must be."""
        self._lease_id = _uint64(lease_id, "lease_id")

    def _observe(self, incarnation: int, method: str) -> None:
        if not incarnation:
            return
        if not self._incarnation:
            self._incarnation = incarnation
        elif incarnation != self._incarnation:
            raise StaleIncarnation(
                f"the server's incarnation is {incarnation}, this client expected "
                f"{self._incarnation}: the server restarted and its KV cache is gone "
                "(forget_incarnation() or reconnect() after re-creating state)",
                grpc.StatusCode.FAILED_PRECONDITION, method)

    @property
    def server_info(self) -> ServerInfo:
        """The ServerInfo read at connect time (or by the last info())."""
        if self._info is None:
            raise RuntimeError("no server info yet: call info() first")
        return self._info

    def _timeout(self, timeout):
        return self.timeout if timeout is None else timeout

    def _out(self, out, like):
        if out is not None:
            return out
        kind, _ = _dt.result_like(like)
        return kind if kind in ("torch", "raw") else self.out

    @staticmethod
    def _dtype(out, like):
        """The caller's dtype, which a result computed from `like` comes back
        in (None: out's default, bits for "raw")."""
        _, dtype = _dt.result_like(like)
        return None if out == "raw" else dtype

    @staticmethod
    def _device(device, like):
        if device is not None:
            return device
        return like.device if _dt.is_torch(like) else None

    # ------------------------------------------------------------ connecting
    def _connect_wait(self) -> float:
        return self.connect_timeout if self.timeout is None else min(self.timeout,
                                                                     self.connect_timeout)

    def _cause(self, e: AttnserveError) -> Optional[str]:
        return connect_cause(e.details, self.target, self._tls, self._tls_ca, self._tls_cert)

    def _connect_retry(self, e: AttnserveError, wait: float, deadline: float,
                       attempt: int) -> float:
        """Raises the error a failed first call ends the connect with, or
        returns how long to wait before trying again."""
        if isinstance(e, DeadlineExceeded) or time.monotonic() >= deadline:
            raise Unavailable(f"cannot reach {self.target} within {wait} s (connect_timeout): no "
                              "connection completed (a host that is down, or packets dropped on "
                              "the way)", grpc.StatusCode.UNAVAILABLE, "GetServerInfo") from None
        cause = self._cause(e)
        if cause is not None:
            raise Unavailable(cause, grpc.StatusCode.UNAVAILABLE, "GetServerInfo") from None
        if "failed to connect" not in e.details:
            raise e  # the server's own answer (it is draining)
        # Another transport failure: the next connection attempt, with jitter.
        return min(random.uniform(0, 0.05 * 2 ** min(attempt, 5)),
                   max(deadline - time.monotonic(), 0))

    def _health_error(self, e: AttnserveError) -> AttnserveError:
        cause = self._cause(e) if isinstance(e, Unavailable) else None
        return Unavailable(cause, e.code, e.method) if cause else e

    # ------------------------------------------------------------ requests
    def _req_info(self) -> _Request:
        def parse(raw):
            m = pb.ServerInfo.FromString(raw)
            bad = geometry_error(m)
            if bad:
                # What the client computes with (page counts, divisions by
                # page_size and the head counts) must be a geometry
                # attnserve serves (the C++ client's check, client.cc).
                raise FailedPrecondition(
                    f"{self.target} answered GetServerInfo with a geometry no attnserve server "
                    f"has ({bad}): is it an attnserve server?", method="GetServerInfo")
            info = ServerInfo(
                version=m.version, backend=m.backend, device=m.device, num_layers=m.num_layers,
                num_pages=m.num_pages, page_size=m.page_size, num_qo_heads=m.num_qo_heads,
                num_kv_heads=m.num_kv_heads, head_dim=m.head_dim,
                kv_dtype=_dt.DTYPE_NAMES.get(m.kv_dtype, str(m.kv_dtype)), free_pages=m.free_pages,
                max_batch_tokens=m.max_batch_tokens, max_message_bytes=m.max_message_bytes,
                incarnation=m.incarnation, region_socket=m.region_socket,
                lease_default_ttl_ms=m.lease_default_ttl_ms, lease_max_ttl_ms=m.lease_max_ttl_ms,
                q_dtype=_dt.DTYPE_NAMES.get(m.q_dtype or m.kv_dtype, str(m.q_dtype)),
                kv_cache_bytes=m.kv_cache_bytes, page_bytes=m.page_bytes,
                attention="mla" if m.attention == pb.ATTENTION_MLA else "gqa",
                qk_head_dim=m.qk_head_dim, v_head_dim=m.v_head_dim,
                kv_lora_rank=m.kv_lora_rank, qk_rope_head_dim=m.qk_rope_head_dim,
                fp8_query_min_rows=m.fp8_query_min_rows)
            self._info = info
            if not self._incarnation:
                self._incarnation = info.incarnation
            return info
        return "GetServerInfo", pb.GetServerInfoRequest().SerializeToString(), parse

    def _req_allocate(self, count: int) -> _Request:
        req = pb.AllocatePagesRequest(count=_int32(count, "count"),
                                      expected_incarnation=self._incarnation,
                                      lease_id=self._lease_id)

        def parse(raw):
            resp = pb.AllocatePagesResponse.FromString(raw)
            self._observe(resp.incarnation, "AllocatePages")
            return list(resp.page_ids)
        return "AllocatePages", req.SerializeToString(), parse

    def _req_free(self, page_ids) -> _Request:
        req = pb.FreePagesRequest(expected_incarnation=self._incarnation, lease_id=self._lease_id)
        _extend(req.page_ids, page_ids, "page_ids")

        def parse(raw):
            self._observe(pb.FreePagesResponse.FromString(raw).incarnation, "FreePages")
        return "FreePages", req.SerializeToString(), parse

    def _req_write_kv(self, layer: int, slots, k, v) -> _Request:
        info = self.server_info
        _check_kv_args(info, k, v)
        wire = _kv_wire(info, k, v)
        req = pb.WriteKVRequest(layer=_int32(layer, "layer"),
                                expected_incarnation=self._incarnation, lease_id=self._lease_id)
        _extend(req.slots, slots, "slots")
        pieces = [req.SerializeToString(), *_tensor_field(3, k, wire, "k")]
        if v is not None:
            pieces += _tensor_field(4, v, wire, "v")
        body = b"".join(pieces)

        def parse(raw):
            self._observe(pb.WriteKVResponse.FromString(raw).incarnation, "WriteKV")
        return "WriteKV", body, parse

    def _req_read_kv(self, layer: int, slots, out, device, into=None,
                     dequantize: bool = False) -> _Request:
        req = pb.ReadKVRequest(layer=_int32(layer, "layer"), expected_incarnation=self._incarnation,
                               lease_id=self._lease_id, dequantize=bool(dequantize))
        _extend(req.slots, slots, "slots")
        mla = self._info is not None and self._info.mla
        into = _read_into(into, mla)
        if into is not None:
            req.k_region.CopyFrom(_region_ref(into[0]))
            if into[1] is not None:
                req.v_region.CopyFrom(_region_ref(into[1]))
        out = self._out(out, None)

        def parse(raw):
            tensors, incarnation = _wire.parse_tensor_message(raw, (1, 2), 3)
            self._observe(incarnation, "ReadKV")
            if into is not None:
                return None
            return tuple(None if not t.shape and not t.nbytes else
                         _dt.from_wire(raw, t.data_start, t.nbytes, t.shape, t.dtype, out, device)
                         for t in (tensors[1], tensors[2]))
        return "ReadKV", req.SerializeToString(), parse

    def _req_prefill(self, layer: int, q, layout: PrefillLayout, append_k, append_v, out,
                     device, output_to=None, options=None) -> _Request:
        wire = self.server_info.wire_dtype
        small = pb.PrefillRequest(layer=_int32(layer, "layer"),
                                  expected_incarnation=self._incarnation, lease_id=self._lease_id)
        options = _options(options)
        if options is not None:
            if layout.has_options:
                raise ValueError("options: the layout carries options already (pass them to "
                                 "one of PrefillLayout.encode and prefill_layout)")
            small.options.CopyFrom(options.to_proto())
        output_to = _pair(output_to, "output_to (output, lse)")
        if output_to is not None:
            small.output_region.CopyFrom(_region_ref(output_to[0]))
            small.lse_region.CopyFrom(_region_ref(output_to[1]))
        pieces = [small.SerializeToString(), layout.encoded, *_tensor_field(2, q, wire, "q")]
        if append_k is not None or append_v is not None:
            info = self.server_info
            if not info.mla and (append_k is None or append_v is None):
                missing = "append_v" if append_v is None else "append_k"
                raise ValueError(f"{missing}: missing; the server computes grouped-query "
                                 "attention (attention=gqa): append_k and append_v go together")
            _check_kv_args(info, append_k, append_v, "append_k", "append_v")
            kv_wire = _kv_wire(info, append_k, append_v)
            pieces += _tensor_field(11, append_k, kv_wire, "append_k")
            if append_v is not None:
                pieces += _tensor_field(12, append_v, kv_wire, "append_v")
        like = None if isinstance(q, RegionTensor) else q
        out_kind = self._out(out, like)
        out_device = self._device(device, like)
        out_dtype = self._dtype(out_kind, like)

        def parse(raw):
            tensors, incarnation = _wire.parse_tensor_message(raw, (1, 2), 3)
            self._observe(incarnation, "Prefill")
            if output_to is not None:
                return PrefillResult(None, None, incarnation)
            o, lse = tensors[1], tensors[2]
            output = _dt.from_wire(raw, o.data_start, o.nbytes, o.shape, o.dtype, out_kind,
                                   out_device, out_dtype)
            lse_out = _dt.from_wire(raw, lse.data_start, lse.nbytes, lse.shape, lse.dtype,
                                    "numpy" if out_kind == "raw" else out_kind, out_device)
            return PrefillResult(output, lse_out, incarnation)
        return "Prefill", b"".join(pieces), parse

    def _req_create_plan(self, qo_indptr, kv_indptr, kv_indices, kv_last_page_len,
                         append_slots, kv_keys_after=None, options=None, layer_options=None,
                         apply_sinks=None) -> _Request:
        req = pb.CreatePlanRequest(expected_incarnation=self._incarnation, lease_id=self._lease_id)
        fill_layout(req, qo_indptr, kv_indptr, kv_indices, kv_last_page_len, append_slots,
                    kv_keys_after, options, apply_sinks)
        for layer, o in (layer_options or {}).items():
            o = _options(o)
            if o is not None:
                req.layer_options[_int32(layer, "layer_options key")].CopyFrom(o.to_proto())

        def parse(raw):
            resp = pb.CreatePlanResponse.FromString(raw)
            self._observe(resp.incarnation, "CreatePlan")
            return resp.plan_id
        return "CreatePlan", req.SerializeToString(), parse

    def _req_set_kv_scales(self, scales) -> _Request:
        req = pb.SetKvScalesRequest(expected_incarnation=self._incarnation)
        for layer, (k_scale, v_scale) in dict(scales).items():
            m = req.layers.add(layer=_int32(layer, "layer"))
            m.k_scale.extend(_floats(k_scale, f"scales[{layer}] k_scale"))
            m.v_scale.extend(_floats(v_scale, f"scales[{layer}] v_scale"))

        def parse(raw):
            self._observe(pb.SetKvScalesResponse.FromString(raw).incarnation, "SetKvScales")
        return "SetKvScales", req.SerializeToString(), parse

    def _req_get_kv_scales(self) -> _Request:
        def parse(raw):
            resp = pb.GetKvScalesResponse.FromString(raw)
            self._observe(resp.incarnation, "GetKvScales")
            return {m.layer: (np.asarray(m.k_scale, dtype=np.float32),
                              np.asarray(m.v_scale, dtype=np.float32)) for m in resp.layers}
        return "GetKvScales", pb.GetKvScalesRequest().SerializeToString(), parse

    def _req_release_plan(self, plan_id: int) -> _Request:
        req = pb.ReleasePlanRequest(plan_id=_uint64(plan_id, "plan_id"),
                                    expected_incarnation=self._incarnation,
                                    lease_id=self._lease_id)

        def parse(raw):
            self._observe(pb.ReleasePlanResponse.FromString(raw).incarnation, "ReleasePlan")
        return "ReleasePlan", req.SerializeToString(), parse

    def _req_merge(self, states, lse_base, out, device, into=None) -> _Request:
        wire = self.server_info.wire_dtype
        small = pb.MergeStatesRequest(lse_base=_lse_base(lse_base))
        into = _pair(into, "into (v, lse)")
        if into is not None:
            small.v_region.CopyFrom(_region_ref(into[0]))
            small.lse_region.CopyFrom(_region_ref(into[1]))
        pieces = [small.SerializeToString()]
        like = None
        for i, (v, lse) in enumerate(states):
            if not isinstance(v, RegionTensor):
                like = v if like is None else like
            v_pieces = _tensor_field(1, v, wire, f"states[{i}].v")
            if isinstance(lse, RegionTensor):
                l_pieces = [_region_field(2, lse, wire, f"states[{i}].lse")]
            else:
                l_shape, l_data = _dt.f32_to_wire(lse, f"states[{i}].lse")
                l_pieces = [_wire.tensor_head(2, _dt.DTYPE_FP32, l_shape, l_data.nbytes), l_data]
            size = sum(len(p) if isinstance(p, bytes) else p.nbytes for p in v_pieces + l_pieces)
            pieces += [_wire.tag(1, 2) + _wire.varint(size), *v_pieces, *l_pieces]
        out_kind = self._out(out, like)
        out_device = self._device(device, like)
        out_dtype = self._dtype(out_kind, like)

        def parse(raw):
            tensors, incarnation = _wire.parse_tensor_message(raw, (1, 2), 3)
            self._observe(incarnation, "MergeStates")
            if into is not None:
                return None
            v, lse = tensors[1], tensors[2]
            return (_dt.from_wire(raw, v.data_start, v.nbytes, v.shape, v.dtype, out_kind,
                                  out_device, out_dtype),
                    _dt.from_wire(raw, lse.data_start, lse.nbytes, lse.shape, lse.dtype,
                                  "numpy" if out_kind == "raw" else out_kind, out_device))
        return "MergeStates", b"".join(pieces), parse


    def _deposit(self, fd) -> tuple:
        """(claim token, holder) of memfd `fd` sent to the server's region
        socket; (zeros, None) when the server has no socket (regions off:
        RegisterRegion then says so)."""
        name = self._info.region_socket if self._info is not None else ""
        if not name:
            return bytes(_regions.CLAIM_TOKEN_BYTES), None
        fileno = fd.fileno() if hasattr(fd, "fileno") else int(fd)
        return _regions.deposit_region_fd(
            name, fileno, expected_incarnation=self._incarnation or self._info.incarnation,
            timeout=self.timeout or 10.0)

    def _keep_region_holder(self, name: str, holder) -> None:
        old = self._region_holders.pop(name, None)
        if old is not None:
            old.close()
        if holder is not None:
            self._region_holders[name] = holder

    def _drop_region_holder(self, name: str) -> None:
        """Closes the holder of region `name`: the server reclaims the region
        once it is idle."""
        self._keep_region_holder(name, None)

    def _close_region_holders(self) -> None:
        for holder in self._region_holders.values():
            holder.close()
        self._region_holders.clear()

    def _req_register_region(self, name: str, system=None, cuda=None) -> _Request:
        req = pb.RegisterRegionRequest(name=name, lease_id=self._lease_id)
        if system is not None:
            token, offset, byte_size = system
            req.system.CopyFrom(pb.SystemRegion(claim_token=token, offset=int(offset),
                                                byte_size=int(byte_size)))
        else:
            handle, device_id, byte_size = cuda
            req.cuda.CopyFrom(pb.CudaRegion(ipc_handle=bytes(handle), device_id=int(device_id),
                                            byte_size=int(byte_size)))

        def parse(raw):
            self._observe(pb.RegisterRegionResponse.FromString(raw).incarnation, "RegisterRegion")
        return "RegisterRegion", req.SerializeToString(), parse

    def _req_unregister_region(self, name: str) -> _Request:
        def parse(raw):
            self._observe(pb.UnregisterRegionResponse.FromString(raw).incarnation,
                          "UnregisterRegion")
            self._drop_region_holder(name)
        return "UnregisterRegion", pb.UnregisterRegionRequest(name=name).SerializeToString(), parse

    def _req_list_regions(self) -> _Request:
        def parse(raw):
            resp = pb.ListRegionsResponse.FromString(raw)
            self._observe(resp.incarnation, "ListRegions")
            return [RegionInfo(r.name, r.kind, r.key, r.offset, r.byte_size, r.device_id,
                               r.in_use, r.registered, r.key_exists) for r in resp.regions]
        return "ListRegions", pb.ListRegionsRequest().SerializeToString(), parse

    def _req_open_channel(self, name: str, offset: int, byte_size: int) -> _Request:
        req = pb.OpenChannelRequest(expected_incarnation=self._incarnation,
                                    lease_id=self._lease_id)
        req.ring.CopyFrom(pb.RegionRef(name=name, offset=int(offset), byte_size=int(byte_size)))

        def parse(raw):
            resp = pb.OpenChannelResponse.FromString(raw)
            self._observe(resp.incarnation, "OpenChannel")
            return resp
        return "OpenChannel", req.SerializeToString(), parse

    def _req_close_channel(self, channel_id: int) -> _Request:
        def parse(raw):
            self._observe(pb.CloseChannelResponse.FromString(raw).incarnation, "CloseChannel")
        return ("CloseChannel",
                pb.CloseChannelRequest(channel_id=int(channel_id)).SerializeToString(), parse)


    def _req_grant_lease(self, ttl) -> _Request:
        ttl_ms = _ttl_ms(ttl)
        req = pb.GrantLeaseRequest(ttl_ms=ttl_ms, expected_incarnation=self._incarnation)

        def parse(raw):
            resp = pb.GrantLeaseResponse.FromString(raw)
            self._observe(resp.incarnation, "GrantLease")
            return LeaseGrant(resp.lease_id, resp.ttl_ms / 1000.0)
        return "GrantLease", req.SerializeToString(), parse

    def _req_keep_alive(self, lease_id: int) -> _Request:
        req = pb.KeepAliveRequest(lease_id=_uint64(lease_id, "lease_id"),
                                  expected_incarnation=self._incarnation)

        def parse(raw):
            resp = pb.KeepAliveResponse.FromString(raw)
            self._observe(resp.incarnation, "KeepAlive")
            return resp.ttl_ms / 1000.0
        return "KeepAlive", req.SerializeToString(), parse

    def _req_revoke_lease(self, lease_id: int) -> _Request:
        req = pb.RevokeLeaseRequest(lease_id=_uint64(lease_id, "lease_id"),
                                    expected_incarnation=self._incarnation)

        def parse(raw):
            resp = pb.RevokeLeaseResponse.FromString(raw)
            self._observe(resp.incarnation, "RevokeLease")
            return Holdings._from(resp.released)
        return "RevokeLease", req.SerializeToString(), parse

    def _req_list_holdings(self, lease_id: int) -> _Request:
        req = pb.ListHoldingsRequest(lease_id=_uint64(lease_id, "lease_id"))

        def parse(raw):
            resp = pb.ListHoldingsResponse.FromString(raw)
            self._observe(resp.incarnation, "ListHoldings")
            return HoldingsList(
                tuple(LeaseInfo(l.lease_id, l.ttl_ms, l.remaining_ms, Holdings._from(l.holdings))
                      for l in resp.leases), Holdings._from(resp.unleased))
        return "ListHoldings", req.SerializeToString(), parse

    def _req_release_holdings(self) -> _Request:
        req = pb.ReleaseHoldingsRequest(expected_incarnation=self._incarnation)

        def parse(raw):
            resp = pb.ReleaseHoldingsResponse.FromString(raw)
            self._observe(resp.incarnation, "ReleaseHoldings")
            return Holdings._from(resp.released)
        return "ReleaseHoldings", req.SerializeToString(), parse
