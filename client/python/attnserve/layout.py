"""A Prefill's request fields that do not change from layer to layer: the
attention options (AttentionOptions) and the encoded layout (PrefillLayout),
with the checked conversions of their values. attnserve.client and
attnserve.channel both build requests from them."""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np

from attnserve import dtypes as _dt
from attnserve.v1 import attention_pb2 as pb


def _floats(values, name: str) -> list:
    """values (a sequence, numpy array or torch tensor of numbers) as a flat
    list of float."""
    if _dt.is_torch(values):
        values = values.detach().to("cpu").float().numpy()
    try:
        arr = np.asarray(values, dtype=np.float64).reshape(-1)
    except (TypeError, ValueError) as e:
        raise TypeError(f"{name}: {e}") from None
    # The wire carries float32: a finite value that would become an infinity
    # or 0 there is refused here, naming the value given.
    with np.errstate(over="ignore", under="ignore"):
        narrow = arr.astype(np.float32)
    lost = np.isfinite(arr) & (~np.isfinite(narrow) | ((arr != 0) & (narrow == 0)))
    if lost.any():
        x = float(arr[np.argmax(lost)])
        raise ValueError(f"{name}: {x!r} does not fit a float32 (0, or a magnitude in "
                         "[1.4e-45, 3.4e38])")
    return arr.tolist()


@dataclass(frozen=True)
class AttentionOptions:
    """Attention variants (docs/design.md, "Variants"), FlashInfer's names.

    window_left: sliding window; a query row at position p sees no key
      before p - window_left (with the causal mask p - window_left .. p);
      -1: none.
    logits_soft_cap: c > 0 turns a scaled logit x into c * tanh(x / c)
      (Gemma 2's); 0: none; otherwise in [1e-30, 1e30].
    sinks: [num_qo_heads] logits in natural units (a list, numpy array or
      torch tensor) that enter the softmax denominator only (gpt-oss's); the
      LSE includes them; -inf is no sink for that head.

    None leaves a field unset: a Prefill naming a plan then takes the plan's
    value for its layer (and a set one must equal it), else the default.
    """

    window_left: Optional[int] = None
    logits_soft_cap: Optional[float] = None
    sinks: Any = None

    def to_proto(self) -> "pb.AttentionOptions":
        o = pb.AttentionOptions()
        if self.window_left is not None:
            o.window_left = _int32(self.window_left, "options.window_left")
        if self.logits_soft_cap is not None:
            o.logits_soft_cap = float(self.logits_soft_cap)
        if self.sinks is not None:
            o.sinks.extend(_floats(self.sinks, "options.sinks"))
        return o

    @property
    def empty(self) -> bool:
        return self.window_left is None and self.logits_soft_cap is None and self.sinks is None


def _options(options) -> Optional[AttentionOptions]:
    """options as AttentionOptions (also from a dict of its fields), or None."""
    if options is None or isinstance(options, AttentionOptions):
        return options
    if isinstance(options, dict):
        return AttentionOptions(**options)
    raise TypeError(f"options: attnserve.AttentionOptions expected, not {type(options).__name__}")


def _bools(values, name: str) -> list:
    try:
        return [bool(x) for x in np.asarray(values).reshape(-1).tolist()]
    except (TypeError, ValueError) as e:
        raise TypeError(f"{name}: {e}") from None


@dataclass(frozen=True)
class PrefillLayout:
    """A ragged batch's layout, encoded once and reused for every layer.

    It holds the Prefill fields that do not change from layer to layer
    (indptrs, page ids, last-page lengths, append slots, sm_scale, causal,
    lse_base, and the attention options when given here) as serialized
    protobuf bytes. KvManager.plan() makes one per step; run() sends it with
    each layer's tensors (and that layer's options).
    """

    encoded: bytes
    total_q: int
    num_append: int
    plan_id: int = 0  # a server plan (CreatePlan) stands for the layout fields
    has_options: bool = False  # the encoded bytes carry AttentionOptions

    @staticmethod
    def for_plan(plan_id: int, total_q: int, num_append: int, *, sm_scale=None, causal=None,
                 lse_base: str = "2") -> "PrefillLayout":
        """The layout of a plan registered with create_plan(): the plan id and
        the options; the indptrs, page ids and append slots stay on the server."""
        req = pb.PrefillRequest(plan_id=_uint64(plan_id, "plan_id"), lse_base=_lse_base(lse_base))
        if sm_scale is not None:
            req.sm_scale = float(sm_scale)
        if causal is not None:
            req.causal = bool(causal)
        return PrefillLayout(req.SerializeToString(), int(total_q), int(num_append), int(plan_id))

    @staticmethod
    def encode(qo_indptr, kv_indptr, kv_indices, kv_last_page_len=None, *, sm_scale=None,
               causal=None, lse_base: str = "2", append_slots=None,
               kv_keys_after=None, options=None, apply_sinks=None) -> "PrefillLayout":
        req = pb.PrefillRequest()
        options, slots = fill_layout(req, qo_indptr, kv_indptr, kv_indices, kv_last_page_len,
                                     append_slots, kv_keys_after, options, apply_sinks)
        if sm_scale is not None:
            req.sm_scale = float(sm_scale)
        if causal is not None:
            req.causal = bool(causal)
        req.lse_base = _lse_base(lse_base)
        total_q = req.qo_indptr[-1] if len(req.qo_indptr) else 0
        return PrefillLayout(req.SerializeToString(), int(total_q), len(slots),
                             has_options=options is not None)


def fill_layout(req, qo_indptr, kv_indptr, kv_indices, kv_last_page_len, append_slots,
                kv_keys_after, options, apply_sinks):
    """Sets the layout fields that PrefillRequest and CreatePlanRequest share
    (each checked, the error naming the field); returns (options as
    AttentionOptions or None, the append slots as a list)."""
    if kv_keys_after is not None:
        _extend(req.kv_keys_after, kv_keys_after, "kv_keys_after")
    if apply_sinks is not None:
        req.apply_sinks.extend(_bools(apply_sinks, "apply_sinks"))
    options = _options(options)
    if options is not None:
        req.options.CopyFrom(options.to_proto())
    _extend(req.qo_indptr, qo_indptr, "qo_indptr")
    _extend(req.kv_indptr, kv_indptr, "kv_indptr")
    _extend(req.kv_indices, kv_indices, "kv_indices")
    if kv_last_page_len is not None:
        _extend(req.kv_last_page_len, kv_last_page_len, "kv_last_page_len")
    slots = _extend(req.append_slots, append_slots, "append_slots") \
        if append_slots is not None else []
    return options, slots


def _ints(values, name: str) -> list:
    """values (a sequence or array of integers) as a flat list of int."""
    try:
        arr = np.asarray(values)
    except (TypeError, ValueError) as e:
        raise TypeError(f"{name}: {e}") from None
    if arr.size and arr.dtype.kind not in "iu":
        raise TypeError(f"{name}: integers expected, got {arr.dtype}")
    if arr.size and arr.dtype.kind == "u" and arr.dtype.itemsize >= 8:
        big = np.flatnonzero(arr.reshape(-1) > np.iinfo(np.int64).max)
        if big.size:  # would wrap to a negative int64
            i = int(big[0])
            raise ValueError(f"{name}[{i}]={int(arr.reshape(-1)[i])} does not fit in int64")
    return arr.astype(np.int64, copy=False).reshape(-1).tolist()


def _extend(repeated, values, name: str) -> list:
    """Appends integer values to a repeated field; ValueError names the field
    when one does not fit its type (int32 or int64)."""
    ints = _ints(values, name)
    try:
        repeated.extend(ints)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{name}: {e}") from None
    return ints


def _index(value, name: str) -> int:
    """An integer argument (int, numpy or torch integer), never a float
    truncated into one (0.9 is not layer 0); TypeError names it."""
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(f"{name}: an integer expected, got {type(value).__name__}") from None


def _int32(value, name: str) -> int:
    v = _index(value, name)
    if not -(1 << 31) <= v < (1 << 31):
        raise ValueError(f"{name}={v} does not fit in int32")
    return v


def _uint64(value, name: str) -> int:
    """An id (plan or lease): an integer in [0, 2^64)."""
    v = _index(value, name)
    if not 0 <= v < (1 << 64):
        raise ValueError(f"{name}={v} out of range [0, 2^64)")
    return v


def _ttl_ms(ttl, name: str = "ttl") -> int:
    """Seconds as whole milliseconds; None and 0 are 0, the server's default.
    Any other value stays non-zero (a ttl under half a millisecond is 1 ms,
    which the server refuses as below its minimum, not its default)."""
    if ttl is None:
        return 0
    t = float(ttl)
    if not math.isfinite(t):
        raise ValueError(f"{name}={ttl!r} is not a finite number of seconds")
    if abs(t) * 1000 >= 2.0 ** 63:
        raise ValueError(f"{name}={ttl!r} seconds does not fit in int64 milliseconds")
    ms = int(round(t * 1000))
    if ms == 0 and t != 0:
        ms = 1 if t > 0 else -1
    return ms


def _lse_base(base) -> int:
    if base in ("2", 2, pb.LSE_BASE_2):
        return pb.LSE_BASE_2
    if base in ("e", pb.LSE_BASE_E):
        return pb.LSE_BASE_E
    raise ValueError(f"lse_base must be '2' or 'e', not {base!r}")
