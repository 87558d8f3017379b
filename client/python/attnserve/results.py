"""What the client's calls return: the server's geometry (ServerInfo), a
Prefill's output and LSE (PrefillResult), leases and holdings, and the
regions a tenant registered. attnserve.Client and attnserve.AsyncClient
return the same types; the package exports them all."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from attnserve import dtypes as _dt


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
    # Non-zero under --prefill_kernel=sm90_fp8q: sequences of at least this
    # many query rows are computed with each query row rounded to E4M3
    # (docs/design.md section 3, "FP8 KV cache"); 0: no query is rounded.
    fp8_query_min_rows: int = 0

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
