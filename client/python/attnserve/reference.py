"""float64 reference of the server's math (docs/design.md section 3), in numpy.

Independent of the server: KvMirror keeps the client's own copy of every K/V
row it wrote, and reference_prefill / reference_merge compute in float64
what the server computes in fp32, for checking results:

    mirror = KvMirror(num_kv_heads, head_dim)
    mirror.write(layer, slots, k, v)             # what was sent to write_kv
    o, lse = reference_prefill(mirror, layer, q, qo_indptr, kv_indptr, kv_indices,
                               kv_last_page_len, page_size=16)
    o_err, lse_err, inf_ok = compare(o, lse, result.output, result.lse)

Multi-head latent attention (an MLA server): the mirror holds latent rows,
[kv_lora_rank | qk_rope_head_dim] values per slot (one KV head, no V); a
query of qk_head_dim values scores against the whole row and the value is the
row's first kv_lora_rank values:

    mirror = KvMirror.for_server(client.server_info)   # or KvMirror.latent(512, 64)
    mirror.write(layer, slots, latent)                 # latent [n, 1, 576]
    o, lse = reference_prefill(mirror, layer, q, ...)  # o [total_q, Hq, 512]
"""

from __future__ import annotations

import math

import numpy as np

from attnserve import dtypes as _dt


def as_float64(x, wire_dtype: int = _dt.DTYPE_BF16) -> np.ndarray:
    """The values the server sees for x (numpy float/uint16 bits or torch), in float64."""
    if _dt.is_torch(x):
        return x.detach().to("cpu").double().numpy()
    if isinstance(x, _dt.RawBits):
        wire_dtype, x = x.wire_dtype, x.bits
    arr = np.asarray(x)
    if arr.dtype == np.uint16:
        if wire_dtype == _dt.DTYPE_FP16:
            return arr.view(np.float16).astype(np.float64)
        return _dt.bf16_bits_to_float32(arr).astype(np.float64).reshape(arr.shape)
    if wire_dtype == _dt.DTYPE_FP16:
        return arr.astype(np.float16).astype(np.float64)
    return _dt.bf16_bits_to_float32(_dt.float32_to_bf16_bits(arr)).astype(np.float64).reshape(arr.shape)


# The conformance suite's LSE bounds against this reference (absolute, in the
# LSE's own units; docs/design.md section 3): every row's, and the rows of
# sequences a server computes on queries rounded to E4M3
# (ServerInfo.fp8_query_min_rows, --prefill_kernel=sm90_fp8q, whose FP8 tensor
# cores sum a step's 32 products with about 13 bits): FP8_QUERY_LSE_BOUND or
# FP8_QUERY_LSE_SLOPE times the row's largest |sm_scale| sum_d |q_d k_jd|
# over the keys it sees (in the LSE's units), whichever is larger. The C++
# reference's kLseBound, kFp8QueryLseBound and kFp8QueryLseSlope.
LSE_BOUND = 1e-3
FP8_QUERY_LSE_BOUND = 4e-3
FP8_QUERY_LSE_SLOPE = 1.0 / 1024


def round_query_rows_to_e4m3(q, wire_dtype: int = _dt.DTYPE_BF16) -> np.ndarray:
    """q [..., head_dim] (query rows, one per token and head) as a server
    under --prefill_kernel=sm90_fp8q computes with them, in float64: with a a
    row's largest finite |q| and e = 7 - floor(log2 a) clamped to [-100, 100]
    (0 when a is 0), each element x becomes E4M3(x 2^e) 2^-e, E4M3 rounding to
    the nearest of its values (ties to even) and saturating at +-448 (an
    infinity too; NaN stays NaN, a zero keeps its sign), in float64 (exact:
    the server multiplies the E4M3 values by 2^-e in fp32, so an fp16 row's
    results may lie outside fp16). The C++ reference's RoundQueryRowToE4m3."""
    x = as_float64(q, wire_dtype)
    a = np.where(np.isfinite(x), np.abs(x), 0.0).max(axis=-1, keepdims=True)
    _, k = np.frexp(a)                                   # a = m 2^k, m in [0.5, 1)
    e = np.where(a > 0, np.clip(7 - (k - 1), -100, 100), 0)
    with np.errstate(invalid="ignore", over="ignore"):   # NaN and infinities are defined above
        bits = _dt.float_to_fp8_bits(np.ldexp(x, e), "fp8_e4m3")
    y = _dt.fp8_bits_to_float32(bits, "fp8_e4m3").astype(np.float64)
    return np.ldexp(y, -e)


class KvMirror:
    """The client's copy of K/V rows by (layer, slot); unwritten slots read as 0.

    kv_dtype "fp8_e4m3" or "fp8_e5m2" (an FP8 server's): rows written are
    kept as the server stores them, quantized with the layer's scales
    (set_scales, as given to Client.set_kv_scales; 1.0 until then), and read
    back dequantized with the scales in force.

    fp8_query_min_rows (ServerInfo.fp8_query_min_rows; for_server copies it):
    reference_prefill rounds the query rows of sequences of at least that
    many rows as the server does (round_query_rows_to_e4m3); 0: none.
    """

    def __init__(self, num_kv_heads: int, head_dim: int, wire_dtype: int = _dt.DTYPE_BF16, *,
                 kv_dtype: str | None = None, v_head_dim: int | None = None,
                 fp8_query_min_rows: int = 0):
        """v_head_dim: a latent (MLA) mirror, whose rows are written as K alone
        and whose values are each row's first v_head_dim entries (KvMirror.latent)."""
        self.fp8_query_min_rows = int(fp8_query_min_rows)
        self.row_shape = (num_kv_heads, head_dim)
        self.v_head_dim = head_dim if v_head_dim is None else int(v_head_dim)
        self.mla = v_head_dim is not None
        if self.mla and (num_kv_heads != 1 or not 0 < self.v_head_dim <= head_dim):
            raise ValueError(f"a latent mirror has one KV head and 0 < v_head_dim <= head_dim, "
                             f"not {num_kv_heads} heads, v_head_dim {v_head_dim}")
        self.wire_dtype = wire_dtype
        self.kv_dtype = kv_dtype if kv_dtype in ("fp8_e4m3", "fp8_e5m2") else None
        self._k: dict = {}
        self._v: dict = {}
        self._scales: dict = {}  # layer -> (k [Hkv, 1], v [Hkv, 1])

    @staticmethod
    def latent(kv_lora_rank: int, qk_rope_head_dim: int,
               wire_dtype: int = _dt.DTYPE_BF16) -> "KvMirror":
        """A mirror of an MLA server's latent rows: [kv_lora_rank (c_kv) |
        qk_rope_head_dim (k_pe)] values per slot; values are the c_kv part."""
        return KvMirror(1, kv_lora_rank + qk_rope_head_dim, wire_dtype, v_head_dim=kv_lora_rank)

    @staticmethod
    def for_server(info) -> "KvMirror":
        """A mirror of the geometry and dtypes of a ServerInfo (GQA or MLA)."""
        if getattr(info, "mla", False):
            return KvMirror.latent(info.kv_lora_rank, info.qk_rope_head_dim, info.wire_dtype)
        return KvMirror(info.num_kv_heads, info.head_dim, info.wire_dtype,
                        kv_dtype=info.kv_dtype,
                        fp8_query_min_rows=getattr(info, "fp8_query_min_rows", 0))

    def set_scales(self, layer: int, k_scale, v_scale) -> None:
        """An FP8 layer's scales: numbers or [num_kv_heads] values."""
        hkv = self.row_shape[0]
        self._scales[layer] = tuple(
            np.broadcast_to(np.asarray(s, dtype=np.float32).reshape(-1), (hkv,))
            .astype(np.float64).reshape(hkv, 1) for s in (k_scale, v_scale))

    def _layer_scales(self, layer: int) -> tuple:
        ones = np.ones((self.row_shape[0], 1))
        return self._scales.get(layer, (ones, ones))

    def write(self, layer: int, slots, k, v=None) -> None:
        """k, v [n, num_kv_heads, head_dim] as sent to the server (16-bit
        values, or on an FP8 mirror also FP8 rows: RawBits or torch float8);
        a latent mirror takes k alone (v None)."""
        if self.mla != (v is None):
            raise ValueError("v: a latent (MLA) mirror takes k alone" if self.mla else
                             "v: missing (K and V rows go together)")
        if self.mla:
            k = as_float64(k, self.wire_dtype)
            if k.shape[1:] != self.row_shape:
                raise ValueError(f"k: rows of {list(k.shape[1:])}, the mirror's are "
                                 f"{list(self.row_shape)}")
            for i, slot in enumerate(np.asarray(slots).reshape(-1).tolist()):
                self._k[(layer, slot)] = (layer, k[i])
            return
        if self.kv_dtype is not None:
            k_s, v_s = self._layer_scales(layer)
            k = self._stored(k, k_s)
            v = self._stored(v, v_s)
        else:
            k, v = as_float64(k, self.wire_dtype), as_float64(v, self.wire_dtype)
        for i, slot in enumerate(np.asarray(slots).reshape(-1).tolist()):
            self._k[(layer, slot)] = (layer, k[i])
            self._v[(layer, slot)] = (layer, v[i])

    def _stored(self, x, scale) -> np.ndarray:
        """The FP8 bits the server stores for rows x."""
        if _dt.fp8_wire_of(x) is not None:
            if _dt.is_torch(x):
                return x.detach().to("cpu").contiguous().view(_dt.torch.uint8).numpy()
            return np.asarray(x.bits, dtype=np.uint8)
        return _dt.float_to_fp8_bits(as_float64(x, self.wire_dtype), self.kv_dtype, scale)

    def _value(self, layer: int, row, which: int) -> np.ndarray:
        if self.kv_dtype is None:
            return row
        scale = self._layer_scales(layer)[which]
        return _dt.fp8_bits_to_float32(row, self.kv_dtype).astype(np.float64) * scale

    def rows(self, layer: int, slots) -> tuple:
        """(k, v) [n, num_kv_heads, head_dim] float64 of slots (an FP8
        mirror's dequantized with the scales in force); a latent mirror's v
        is each row's first v_head_dim values, [n, 1, v_head_dim]."""
        zero = np.zeros(self.row_shape)
        if self.mla:
            ks = [self._k[(layer, s)][1] if (layer, s) in self._k else zero for s in slots]
            k = np.stack(ks) if ks else np.zeros((0, *self.row_shape))
            return k, k[..., :self.v_head_dim].copy()

        def get(rows, key, which):
            if key not in rows:
                return zero
            lay, row = rows[key]
            return self._value(lay, row, which)
        ks = [get(self._k, (layer, s), 0) for s in slots]
        vs = [get(self._v, (layer, s), 1) for s in slots]
        if not ks:
            return np.zeros((0, *self.row_shape)), np.zeros((0, *self.row_shape))
        return np.stack(ks), np.stack(vs)


def _sink_values(sinks, hq: int):
    """sinks ([Hq] list, numpy or torch) as float64 numpy, or None."""
    if sinks is None:
        return None
    if _dt.is_torch(sinks):
        sinks = sinks.detach().to("cpu").double().numpy()
    arr = np.asarray(sinks, dtype=np.float64).reshape(-1)
    if arr.size != hq:
        raise ValueError(f"sinks has {arr.size} entries, num_qo_heads is {hq}")
    return arr


def reference_prefill(mirror: KvMirror, layer: int, q, qo_indptr, kv_indptr, kv_indices,
                      kv_last_page_len, *, page_size: int, causal: bool = True,
                      sm_scale: float | None = None, lse_base: str = "2",
                      kv_keys_after=None, options=None, apply_sinks=None,
                      fp8_query_min_rows: int | None = None,
                      return_lse_bound: bool = False) -> tuple:
    """(o [total_q, Hq, Dv], lse [total_q, Hq]) in float64; -inf LSE and 0 output
    where a row sees nothing (the sink's logit with a sink). Row i of
    sequence b is at position p = i + kv_len - q_len + kv_keys_after[b]
    (default 0: bottom-right); causal, it sees positions j <= p.

    options (attnserve.AttentionOptions or a dict of its fields): a window
    drops positions j < p - window_left; a soft-cap c turns a scaled logit
    x into c * tanh(x / c); sinks [Hq] add e^sink to each row's
    denominator (and LSE) in the sequences apply_sinks [batch] allows
    (default all).

    A latent (MLA) mirror: q [total_q, Hq, qk_head_dim] scores against the
    whole latent row, the output is v_head_dim wide (the rows' first values),
    sm_scale defaults to 1/sqrt(qk_head_dim) as on the server.

    fp8_query_min_rows (default: the mirror's, ServerInfo.fp8_query_min_rows
    through KvMirror.for_server): the query rows of every sequence of at least
    that many rows are rounded as the server rounds them
    (round_query_rows_to_e4m3) before the math; 0: none. return_lse_bound:
    also return each LSE entry's bound [total_q, Hq] for compare
    (the FP8-query kernel's on those rows, at least FP8_QUERY_LSE_BOUND;
    LSE_BOUND on the others)."""
    o_window = o_cap = o_sinks = None
    if options is not None:
        get = options.get if isinstance(options, dict) else (lambda k: getattr(options, k))
        o_window, o_cap, o_sinks = get("window_left"), get("logits_soft_cap"), get("sinks")
    window = -1 if o_window is None else int(o_window)
    cap = 0.0 if o_cap is None else float(o_cap)
    q64 = np.array(as_float64(q, mirror.wire_dtype), dtype=np.float64)  # a copy: rows may be rounded
    total_q, hq, d = q64.shape
    if fp8_query_min_rows is None:
        fp8_query_min_rows = getattr(mirror, "fp8_query_min_rows", 0)
    lse_bound = np.full((total_q, hq), LSE_BOUND)
    hkv = mirror.row_shape[0]
    group = hq // hkv
    scale = 1.0 / math.sqrt(d) if sm_scale is None else float(sm_scale)
    if d != mirror.row_shape[1]:
        raise ValueError(f"q: rows of {d} values, the mirror's K rows have {mirror.row_shape[1]}")
    # A mirror without v_head_dim (any object with row_shape and rows()) has
    # values as wide as its keys.
    o = np.zeros((total_q, hq, getattr(mirror, "v_head_dim", mirror.row_shape[1])))
    lse = np.full((total_q, hq), -np.inf)
    qo = np.asarray(qo_indptr).tolist()
    kvp = np.asarray(kv_indptr).tolist()
    idx = np.asarray(kv_indices).tolist()
    last = None if kv_last_page_len is None else np.asarray(kv_last_page_len).tolist()
    after = [0] * (len(qo) - 1) if kv_keys_after is None else np.asarray(kv_keys_after).tolist()
    sinks = _sink_values(o_sinks, hq)
    apply = [True] * (len(qo) - 1) if apply_sinks is None else \
        [bool(x) for x in np.asarray(apply_sinks).reshape(-1).tolist()]
    for b in range(len(qo) - 1):
        q_len = qo[b + 1] - qo[b]
        pages = idx[kvp[b]:kvp[b + 1]]
        kv_len = 0 if not pages else (len(pages) - 1) * page_size + (last[b] if last else 1)
        slots = [pages[j // page_size] * page_size + j % page_size for j in range(kv_len)]
        k, v = mirror.rows(layer, slots)                      # [kv_len, Hkv, D]
        k = np.repeat(k, group, axis=1)                      # [kv_len, Hq, D]
        v = np.repeat(v, group, axis=1)
        sink = sinks if sinks is not None and apply[b] else None
        rounds = 0 < fp8_query_min_rows <= q_len
        if rounds:
            q64[qo[b]:qo[b + 1]] = round_query_rows_to_e4m3(q64[qo[b]:qo[b + 1]],
                                                            mirror.wire_dtype)
        for i in range(q_len):
            row = qo[b] + i
            pos = i + kv_len - q_len + after[b]
            end = min(kv_len, pos + 1) if causal else kv_len
            begin = max(0, pos - window) if window >= 0 else 0
            if end <= begin:
                if sink is not None:   # only the sink: o 0, LSE the sink
                    lse[row] = sink if lse_base == "e" else sink / math.log(2.0)
                continue
            logits = np.einsum("hd,jhd->hj", q64[row], k[begin:end]) * scale   # [Hq, keys]
            if rounds:   # the largest sum of |products|, scaled as a logit, in the LSE's units
                mag = np.einsum("hd,jhd->hj", np.abs(q64[row]), np.abs(k[begin:end])).max(axis=1)
                mag = mag * abs(scale) / (1.0 if lse_base == "e" else math.log(2.0))
                lse_bound[row] = np.maximum(FP8_QUERY_LSE_BOUND, FP8_QUERY_LSE_SLOPE * mag)
            if cap > 0:
                logits = cap * np.tanh(logits / cap)
            m = logits.max(axis=1, keepdims=True)
            if sink is not None:
                m = np.maximum(m, sink[:, None])
            w = np.exp(logits - m)
            s = w.sum(axis=1, keepdims=True)
            if sink is not None:
                s = s + np.exp(sink[:, None] - m)
            o[row] = np.einsum("hj,jhd->hd", w / s, v[begin:end])
            lse_e = (m + np.log(s))[:, 0]
            lse[row] = lse_e if lse_base == "e" else lse_e / math.log(2.0)
    return (o, lse, lse_bound) if return_lse_bound else (o, lse)


def reference_merge(states, lse_base: str = "2", wire_dtype: int = _dt.DTYPE_BF16) -> tuple:
    """Merge of [(v [n, h, d], lse [n, h]), ...] by LSE, in float64."""
    vs = np.stack([as_float64(v, wire_dtype) for v, _ in states])           # [s, n, h, d]
    lses = np.stack([np.asarray(l, dtype=np.float64) for _, l in states])  # [s, n, h]
    base = math.e if lse_base == "e" else 2.0
    m = lses.max(axis=0)
    finite = np.isfinite(m)
    m_safe = np.where(finite, m, 0.0)
    w = np.where(np.isfinite(lses), np.power(base, lses - m_safe), 0.0)      # [s, n, h]
    total = w.sum(axis=0)
    o = np.where(finite[..., None], (w[..., None] * vs).sum(axis=0) /
                 np.where(total > 0, total, 1.0)[..., None], 0.0)
    lse = np.where(finite, m_safe + np.log(np.where(total > 0, total, 1.0)) / math.log(base),
                   -np.inf)
    return o, lse


def compare(o_ref, lse_ref, o, lse, lse_bound=None) -> dict:
    """docs/design.md's measures: relative norm error of o, max LSE error on
    finite rows, -inf mismatches and NaNs; with lse_bound (each LSE entry's
    bound, reference_prefill(..., return_lse_bound=True)) also
    "lse_rows_over_bound", the finite entries at or past their bound, which
    within_tolerance then checks in place of LSE_BOUND."""
    o64 = np.asarray(as_float64(o) if not isinstance(o, np.ndarray) or o.dtype == np.uint16
                     else o, dtype=np.float64)
    lse64 = np.asarray(lse.detach().cpu().numpy() if _dt.is_torch(lse) else lse, dtype=np.float64)
    norm = np.linalg.norm(o_ref)
    err = np.linalg.norm(o64 - o_ref)
    ref_inf = np.isneginf(lse_ref)
    got_inf = np.isneginf(lse64)
    finite = ~ref_inf & ~got_inf
    lse_err = np.abs(lse64 - lse_ref)
    c = {
        "o_rel_error": float(err / norm) if norm > 0 else float(err),
        "lse_max_abs": float(lse_err[finite].max()) if finite.any() else 0.0,
        "inf_mismatches": int((ref_inf != got_inf).sum()),
        "nan": int(np.isnan(o64).sum() + np.isnan(lse64).sum()),
    }
    if lse_bound is not None:
        bound = np.broadcast_to(np.asarray(lse_bound, dtype=np.float64), lse_ref.shape)
        c["lse_rows_over_bound"] = int((finite & ~(lse_err < bound)).sum())
    return c


def within_tolerance(c: dict) -> bool:
    """docs/design.md section 3: o within 1e-2, LSE within LSE_BOUND (or each
    entry within its own bound, when compare had lse_bound), exact -inf, no NaN."""
    lse_ok = c["lse_rows_over_bound"] == 0 if "lse_rows_over_bound" in c else \
        c["lse_max_abs"] < LSE_BOUND
    return c["nan"] == 0 and c["inf_mismatches"] == 0 and c["o_rel_error"] < 1e-2 and lse_ok
