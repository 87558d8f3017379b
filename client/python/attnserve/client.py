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
import json
import random
import time
from dataclasses import dataclass
from typing import Any, Iterable, Optional

import grpc
import numpy as np

from attnserve import _wire
from attnserve import dtypes as _dt
from attnserve import regions as _regions
from attnserve.channel import RequestChannel
from attnserve.errors import (AttnserveError, DeadlineExceeded, NotFound, StaleIncarnation,
                              Unavailable, connect_cause, from_rpc_error)
# AttentionOptions and PrefillLayout are this module's names too.
from attnserve.layout import (AttentionOptions, PrefillLayout, _extend, _floats,  # noqa: F401
                              _int32, _lse_base, _options, fill_layout)
from attnserve.regions import RegionTensor
from attnserve.v1 import attention_pb2 as pb

SERVICE = "attnserve.v1.AttentionService"
HEALTH_CHECK = "/grpc.health.v1.Health/Check"
DEFAULT_MAX_MESSAGE_BYTES = 512 << 20
_METHODS = ("GetServerInfo", "AllocatePages", "FreePages", "WriteKV", "ReadKV", "Prefill",
            "MergeStates", "CreatePlan", "ReleasePlan", "RegisterRegion", "UnregisterRegion",
            "ListRegions", "GrantLease", "KeepAlive", "RevokeLease", "ListHoldings",
            "ReleaseHoldings", "OpenChannel", "CloseChannel", "SetKvScales",
            "GetKvScales")


@dataclass(frozen=True)
class LeaseGrant:
    """GrantLease's answer: the lease's id and its time-to-live in seconds."""

    lease_id: int
    ttl: float


@dataclass(frozen=True)
class Holdings:
    """What a tenant holds, or holds under one lease: page ids, plan ids,
    region names and channel ids, each ascending."""

    pages: tuple = ()
    plans: tuple = ()
    regions: tuple = ()
    channels: tuple = ()

    @staticmethod
    def _from(m) -> "Holdings":
        return Holdings(tuple(m.page_ids), tuple(m.plan_ids), tuple(m.region_names),
                        tuple(m.channel_ids))


@dataclass(frozen=True)
class LeaseInfo:
    """One lease of ListHoldings: its id, granted ttl, time left (ms) and holdings."""

    lease_id: int
    ttl_ms: int
    remaining_ms: int
    holdings: Holdings


@dataclass(frozen=True)
class HoldingsList:
    """ListHoldings' answer: each lease's holdings, and what is held under none."""

    leases: tuple
    unleased: Holdings


@dataclass(frozen=True)
class ServerInfo:
    """GetServerInfo's answer. kv_dtype: what the KV cache holds, "bf16",
    "fp16", "fp8_e4m3" or "fp8_e5m2"; q_dtype: queries and outputs, "bf16"
    or "fp16" (kv_dtype's unless that is FP8); kv_cache_bytes and page_bytes:
    the cache's bytes and one page's (K and V in every layer)."""

    version: str
    backend: str
    device: str
    num_layers: int
    num_pages: int
    page_size: int
    num_qo_heads: int
    num_kv_heads: int
    head_dim: int
    kv_dtype: str
    free_pages: int
    max_batch_tokens: int
    max_message_bytes: int
    incarnation: int
    region_socket: str = ""  # where memfds of system regions go ("" with regions off)
    lease_default_ttl_ms: int = 0
    lease_max_ttl_ms: int = 0
    q_dtype: str = ""
    kv_cache_bytes: int = 0
    page_bytes: int = 0
    # "gqa" or "mla" (docs/design.md, "Multi-head latent attention"). MLA:
    # one latent row per token slot, [kv_lora_rank | qk_rope_head_dim]
    # values, num_kv_heads 1 and no V; queries and K rows are qk_head_dim
    # wide, outputs and merged states v_head_dim (= kv_lora_rank). GQA:
    # qk_head_dim = v_head_dim = head_dim, the MLA fields 0.
    attention: str = "gqa"
    qk_head_dim: int = 0
    v_head_dim: int = 0
    kv_lora_rank: int = 0
    qk_rope_head_dim: int = 0

    def __post_init__(self):
        # A server older than the MLA fields leaves them 0: head_dim.
        if not self.qk_head_dim:
            object.__setattr__(self, "qk_head_dim", self.head_dim)
        if not self.v_head_dim:
            object.__setattr__(self, "v_head_dim", self.head_dim)

    @property
    def mla(self) -> bool:
        """Multi-head latent attention: K rows are latent rows and there is no V."""
        return self.attention == "mla"

    @property
    def wire_dtype(self) -> int:
        """The wire dtype of queries, outputs and 16-bit K/V rows."""
        q = self.q_dtype or self.kv_dtype
        return _dt.DTYPE_FP16 if q == "fp16" else _dt.DTYPE_BF16

    @property
    def kv_fp8(self) -> bool:
        """The KV cache holds FP8 (kv_dtype "fp8_e4m3" or "fp8_e5m2")."""
        return self.kv_dtype in ("fp8_e4m3", "fp8_e5m2")

    @property
    def kv_wire_dtype(self) -> int:
        """The wire dtype of rows as the cache stores them."""
        for wire, name in _dt.DTYPE_NAMES.items():
            if name == self.kv_dtype:
                return wire
        return self.wire_dtype


@dataclass
class PrefillResult:
    """output [total_q, num_qo_heads, v_head_dim]; lse [total_q, num_qo_heads] float32."""

    output: Any
    lse: Any
    incarnation: int


def _region_ref(t: RegionTensor) -> "pb.RegionRef":
    return pb.RegionRef(name=t.region, offset=t.offset, byte_size=t.nbytes)


def _region_field(field_number: int, t: RegionTensor, wire_dtype: int, name: str) -> bytes:
    """A Tensor field naming a region: dtype, shape and the region reference."""
    if t.dtype != "fp32" and t.wire_dtype != wire_dtype:
        raise ValueError(f"{name}: region tensor of {t.dtype}, the server's kv_dtype is "
                         f"{_dt.DTYPE_NAMES[wire_dtype]}")
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


def _kv_wire(info: "ServerInfo", k, v) -> int:
    """The wire dtype of K and V rows (K alone: v None): the q dtype, or the
    cache's FP8 dtype for rows already in FP8 (torch float8, RawBits of FP8
    bits), which are stored as they are. Both of one kind."""
    fp8 = [_dt.fp8_wire_of(x) for x in ((k, v) if v is not None else (k, k))]
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


@dataclass(frozen=True)
class RegionInfo:
    """ListRegions' view of one region."""

    name: str
    kind: str        # "system" or "cuda"
    key: str         # system: the memfd's name
    offset: int
    byte_size: int
    device_id: int
    in_use: int      # requests holding it now
    registered: bool  # page-locked for the device's copy engines
    # system: its holder connection is open (the registering client holds
    # it); once closed, the idle region is reclaimed
    key_exists: bool


def _read(path: Optional[str]) -> Optional[bytes]:
    if not path:
        return None
    with open(path, "rb") as f:
        return f.read()


# One request: the method's name, its serialized bytes and the function that
# turns the response bytes into the result.
_Request = tuple  # (method: str, request: bytes, parse: Callable[[bytes], Any])


# gRPC's HTTP/2 and TCP settings for large tensors: the same names and values
# as common/transport.h (docs/transport.md, "TCP").
TRANSPORT_OPTIONS = (
    ("grpc.http2.max_frame_size", 4 << 20),
    ("grpc.http2.write_buffer_size", 8 << 20),
)

# The gRPC service config of both clients (common/transport.h,
# kClientServiceConfig, has the same JSON): a call that fails with UNAVAILABLE
# is tried again up to 3 more times after random waits in [0, 0.1 s x
# 2^(n-1)], for the idempotent methods only. AllocatePages, FreePages,
# CreatePlan, ReleasePlan, RegisterRegion and UnregisterRegion are never
# retried: a repeat of one the server had already run would leave the
# client's books wrong.
RETRY_SERVICE_CONFIG = json.dumps({
    "methodConfig": [{
        "name": [{"service": SERVICE, "method": m} for m in
                 ("GetServerInfo", "Prefill", "WriteKV", "ReadKV", "MergeStates", "ListRegions")],
        "retryPolicy": {
            "maxAttempts": 4,
            "initialBackoff": "0.05s",
            "maxBackoff": "1s",
            "backoffMultiplier": 2,
            "retryableStatusCodes": ["UNAVAILABLE"],
        },
    }],
})

# glibc's mallopt parameters (malloc.h) and the values of common/transport.h's
# RetainFreedMemory.
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
RETAIN_MMAP_THRESHOLD = 32 << 20
RETAIN_TRIM_THRESHOLD = 1 << 30


def retain_freed_memory() -> bool:
    """Process-wide, once at start: glibc's malloc keeps freed memory for the
    next message instead of returning it to the kernel, as attnserve does
    (docs/transport.md, "Freed memory"). gRPC receives each large message into
    fresh malloc blocks; without this, every 128 MiB response is received
    into memory the kernel faults in and zeroes again. The process then keeps
    up to 1 GiB of freed memory mapped per malloc arena. Returns False where
    it has no effect (not glibc)."""
    import ctypes
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    return (mallopt(_M_MMAP_THRESHOLD, RETAIN_MMAP_THRESHOLD) == 1
            and mallopt(_M_TRIM_THRESHOLD, RETAIN_TRIM_THRESHOLD) == 1)


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
        self.target = target
        self.timeout = timeout
        self.out = out
        self._metadata = (("authorization", f"Bearer {token}"),) if token else ()
        limit = int(min(max_message_bytes + (1 << 20), (1 << 31) - 1))
        self._channel_options = [
            ("grpc.max_send_message_length", limit),
            ("grpc.max_receive_message_length", limit),
            # Each client its own connection, as the C++ client does.
            ("grpc.use_local_subchannel_pool", 1),
            # Backoff with jitter on UNAVAILABLE, idempotent methods only.
            ("grpc.enable_retries", 1),
            ("grpc.service_config", RETRY_SERVICE_CONFIG),
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
        # The holder connections of the system regions this client
        # registered, by region name (attnserve.regions).
        self._region_holders: dict = {}

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
        self._lease_id = int(lease_id)

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
                kv_lora_rank=m.kv_lora_rank, qk_rope_head_dim=m.qk_rope_head_dim)
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
        req = pb.ReleasePlanRequest(plan_id=int(plan_id), expected_incarnation=self._incarnation,
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
        ttl_ms = 0 if ttl is None else int(round(float(ttl) * 1000))
        req = pb.GrantLeaseRequest(ttl_ms=ttl_ms, expected_incarnation=self._incarnation)

        def parse(raw):
            resp = pb.GrantLeaseResponse.FromString(raw)
            self._observe(resp.incarnation, "GrantLease")
            return LeaseGrant(resp.lease_id, resp.ttl_ms / 1000.0)
        return "GrantLease", req.SerializeToString(), parse

    def _req_keep_alive(self, lease_id: int) -> _Request:
        req = pb.KeepAliveRequest(lease_id=int(lease_id), expected_incarnation=self._incarnation)

        def parse(raw):
            resp = pb.KeepAliveResponse.FromString(raw)
            self._observe(resp.incarnation, "KeepAlive")
            return resp.ttl_ms / 1000.0
        return "KeepAlive", req.SerializeToString(), parse

    def _req_revoke_lease(self, lease_id: int) -> _Request:
        req = pb.RevokeLeaseRequest(lease_id=int(lease_id), expected_incarnation=self._incarnation)

        def parse(raw):
            resp = pb.RevokeLeaseResponse.FromString(raw)
            self._observe(resp.incarnation, "RevokeLease")
            return Holdings._from(resp.released)
        return "RevokeLease", req.SerializeToString(), parse

    def _req_list_holdings(self, lease_id: int) -> _Request:
        req = pb.ListHoldingsRequest(lease_id=int(lease_id))

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


class CallFuture:
    """A call in flight (Client._call_future): result() waits for the answer
    and returns what the blocking call would, or raises its error."""

    def __init__(self, future, method: str, parse):
        self._future, self._method, self._parse = future, method, parse

    def done(self) -> bool:
        return self._future.done()

    def result(self, timeout: Optional[float] = None):
        try:
            raw = self._future.result(timeout=timeout)
        except grpc.FutureTimeoutError:
            raise TimeoutError(f"{self._method}: no answer within {timeout} s of waiting (the "
                               "call goes on; result() again waits for it)") from None
        except grpc.RpcError as e:
            raise from_rpc_error(e, self._method) from None
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


def _method_path(name: str) -> str:
    return f"/{SERVICE}/{name}"


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
        if self._credentials is not None:
            self._channel = grpc.secure_channel(self.target, self._credentials,
                                                options=self._channel_options)
        else:
            self._channel = grpc.insecure_channel(self.target, options=self._channel_options)
        calls = self._channel
        if self._interceptors:
            calls = grpc.intercept_channel(self._channel, *self._interceptors)
        self._stubs = {name: calls.unary_unary(_method_path(name)) for name in _METHODS}
        self._health = self._channel.unary_unary(HEALTH_CHECK)

    def close(self) -> None:
        self._close_region_holders()
        self._channel.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def reconnect(self) -> ServerInfo:
        """New channel, incarnation forgotten, geometry read again. The
        holders of registered regions stay."""
        self._channel.close()
        self.forget_incarnation()
        self._open()
        return self._connect()

    def _call(self, request: _Request, timeout):
        method, body, parse = request
        try:
            raw = self._stubs[method](body, timeout=self._timeout(timeout), metadata=self._metadata)
        except grpc.RpcError as e:
            raise from_rpc_error(e, method) from None
        return parse(raw)

    def _call_future(self, request: _Request, timeout) -> "CallFuture":
        """Starts the call and returns at once; CallFuture.result() waits."""
        method, body, parse = request
        try:
            future = self._stubs[method].future(body, timeout=self._timeout(timeout),
                                                metadata=self._metadata)
        except grpc.RpcError as e:
            raise from_rpc_error(e, method) from None
        return CallFuture(future, method, parse)

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
        finite and in (0, 1e30]. All layers given or none change; layers not
        given keep theirs (1.0 from the start). Writes after this quantize
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
        if self._info is None or not self._info.region_socket:
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
        """A new lease (docs/security.md, "Leases") living `ttl` seconds (None:
        the server's default) unless renewed; attnserve.Lease keeps one alive."""
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
        lease of its own (the KV managers). Closing either closes the channel."""
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
