// What attention means, written once (docs/design.md section 3, "Variants"):
// the keys a query row sees, the keys a tile of rows reads, the transform of
// a logit, and how a row's softmax ends (with or without a sink). The host
// plans, every CUDA family and the CPU kernels include it; the float64
// reference (common/reference.h) is written apart from it, from the same
// definitions, so that tests comparing the two can fail.
//
// A sequence's settings live in its PrefillSeq (kernels/paged_prefill.h):
//  - positions: query row t of a sequence (q_len rows over kv_len keys) is at
//    key position QueryPos = t + kv_len - q_len + causal_shift (bottom-right
//    alignment; causal_shift is the keys of the sequence held after this
//    range, e.g. on other servers);
//  - causal: the row sees keys j <= QueryPos;
//  - window_left >= 0 (FlashInfer's and vLLM's convention): the row sees no
//    key j < QueryPos - window_left; with the causal mask it so sees
//    QueryPos - window_left .. QueryPos inclusive, without it the window is
//    a left bound only; -1: no window;
//  - soft_cap > 0: a scaled logit x = dot(q, k) * sm_scale becomes
//    soft_cap * tanh(x / soft_cap) (Gemma 2's), the scale applied first;
//  - sinks: one logit per query head, in natural units, that enters the
//    softmax denominator only (gpt-oss): o = sum_j e^{x_j} v_j /
//    (e^{sink} + sum_j e^{x_j}). The LSE includes it, LSE = log(e^{sink} +
//    sum_j e^{x_j}), so that merging by LSE states of which exactly one
//    carries the sink is exact. A row that sees no key gets o = 0 and LSE =
//    the sink (-inf without one).
//
//   const PrefillSeq& s = ...;
//   KeyRange r = RowKeys(s, t);          // keys [r.begin, r.end) row t sees
//   TileKeys k = RowsKeys(s, t0, t1);    // rows t0..t1: keys read, keys all see
#pragma once

#include <cmath>
#include <cstdint>

#include "kernels/math.h"

namespace attnserve {

// Keys [begin, end) of a sequence; empty when end <= begin.
struct KeyRange {
  int32_t begin = 0;
  int32_t end = 0;
  ATTN_HOST_DEVICE int32_t size() const { return end > begin ? end - begin : 0; }
};


// The key position of query row t (0-based within its sequence). Below 2^31
// - 1 for validated input (kv_keys_after <= 2^31 - 1 - kv_len).
template <typename Seq>
ATTN_HOST_DEVICE int32_t QueryPos(const Seq& s, int32_t t) {
  return t + s.kv_len - s.q_len + s.causal_shift;
}

// The keys a row at key position pos sees of a sequence of kv_len keys
// (kernels keep pos's offset, the window and the causal flag in registers
// and call this; RowKeys below for everyone else). No overflow for any
// window_left: the window's start saturates at 0.
ATTN_HOST_DEVICE KeyRange RowKeysAt(int32_t pos, int32_t window_left, bool causal,
                                   int32_t kv_len) {
  KeyRange r;
  const int32_t begin = window_left >= 0 && pos > window_left ? pos - window_left : 0;
  r.begin = begin < kv_len ? begin : kv_len;
  const int32_t end = causal && pos + 1 < kv_len ? pos + 1 : kv_len;
  r.end = end > r.begin ? end : r.begin;
  return r;
}

// The keys query row t of sequence s sees.
template <typename Seq>
ATTN_HOST_DEVICE KeyRange RowKeys(const Seq& s, int32_t t) {
  return RowKeysAt(QueryPos(s, t), s.window_left, s.causal != 0, s.kv_len);
}

// What rows t_first .. t_last (inclusive, t_first <= t_last) of a tile read:
// `read`, the keys any of them sees (a tile reads nothing outside it), and
// `full`, the keys every one of them sees (a block inside it needs no
// per-element mask). A row's range only moves right as t grows, so both
// come from the first and the last row.
struct TileKeys {
  KeyRange read;
  KeyRange full;
};
template <typename Seq>
ATTN_HOST_DEVICE TileKeys RowsKeys(const Seq& s, int32_t t_first, int32_t t_last) {
  const KeyRange a = RowKeys(s, t_first);
  const KeyRange b = RowKeys(s, t_last);
  TileKeys k;
  k.read.begin = a.begin;
  k.read.end = b.end > a.begin ? b.end : a.begin;
  k.full.begin = b.begin;
  k.full.end = a.end;
  return k;
}

// How many (query row, key) pairs of sequence s are visible: the work and
// the FLOPs of its attention, per query head.
template <typename Seq>
inline int64_t VisiblePairs(const Seq& s) {
  int64_t pairs = 0;
  for (int32_t t = 0; t < s.q_len; ++t) pairs += RowKeys(s, t).size();
  return pairs;
}

// tanh for the soft-cap: the hardware's approximation on the device (one
// MUFU op, relative error about 2^-11, under bf16's rounding of P), the
// library's on the host.
ATTN_HOST_DEVICE float SoftCapTanh(float x) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 750
  float y;
  asm("tanh.approx.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
#else
  return std::tanh(x);
#endif
}

// The smallest multiplier of an uncapped positive-scale transform: one that
// underflows to 0 makes a masked key's -inf x 0 = NaN. Float32's smallest
// normal, so that no flush-to-zero instruction drops it either.
inline constexpr float kMinLogitMul = 1.17549435e-38f;

// A sequence's logit transform in the kernels' base-2 units: Log2(d) =
// d * scale * log2(e), or, with a soft-cap c, c * log2(e) * tanh(d * scale /
// c), d the raw dot product; -inf (masked) stays -inf. Kernels that take a
// row's maximum on raw dot products flip Q's sign when sm_scale is negative
// and ask for the magnitude (positive_scale: the scale applied is
// |sm_scale|; uncapped, the multiplier is at least kMinLogitMul, so that the
// transform is increasing in d and a masked -inf stays -inf; a row's logits
// change only where |sm_scale x k_scale| is below 1.2e-38, where a logit
// that is not 0 to float precision needs |dot| above about 1e35); the others
// apply sm_scale as it is. Two floats, so that the soft-cap costs the
// kernels' main loops one register.
struct LogitTransform {
  float mul = 0.f;  // scale * log2(e); soft-capped: scale / c
  float cap = 0.f;  // soft-capped: c * log2(e); 0: no soft-cap

  // k_scale: the dequantization scale of an FP8 K (kernels/fp8.h), folded
  // into the logit scale so that d may be the dot product with the stored
  // FP8 values (1 for a 16-bit K).
  template <typename Seq>
  ATTN_HOST_DEVICE static LogitTransform Of(const Seq& s, bool positive_scale,
                                            float k_scale = 1.f) {
    LogitTransform t;
    float scale = s.sm_scale * k_scale;
    if (positive_scale) scale = scale < 0.f ? -scale : scale;
    // The multiplier stays finite, so that a zero dot product gives a zero
    // logit: scale / c overflows for a tiny cap (every logit is then within
    // c of 0, and tanh saturates for the others either way). Uncapped, the
    // server's bounds (|sm_scale| <= 1e30, an FP8 k_scale <= 1e8) keep
    // scale * log2(e) below 1.45e38; only the decode family's k_scale also
    // carries its fp16 Q's 2^-e, which exceeds 1 only for rows of |q| above
    // 2^14, whose logits at such scales overflow anyway.
    const float m = s.soft_cap > 0.f ? scale / s.soft_cap : scale * kLog2e;
    t.mul = m > 3.4028235e38f ? 3.4028235e38f : (m < -3.4028235e38f ? -3.4028235e38f : m);
    if (s.soft_cap > 0.f) t.cap = s.soft_cap * kLog2e;
    if (positive_scale) t = t.TimesPow2(1.f);
    return t;
  }
  ATTN_HOST_DEVICE bool capped() const { return cap > 0.f; }
  // A positive-scale transform for rows whose Q carries a factor 2^e (an FP8
  // kernel's fp16 Q, pow2 = 2^-e, |e| <= 100): the multiplier times pow2,
  // uncapped at least kMinLogitMul. (Capped, a multiplier of 0 only makes
  // the logits 0: the kernels mask after the tanh.)
  ATTN_HOST_DEVICE LogitTransform TimesPow2(float pow2) const {
    LogitTransform r = *this;
    r.mul *= pow2;
    if (!capped() && !(r.mul >= kMinLogitMul)) r.mul = kMinLogitMul;
    return r;
  }
  // d -> the base-2 logit.
  ATTN_HOST_DEVICE float Log2(float d) const {
    if (!capped()) return d * mul;
    return d > -INFINITY ? cap * SoftCapTanh(d * mul) : -INFINITY;
  }
  // Soft-capped, for kernels that mask after the transform: d -> tanh(d *
  // scale / c), the base-2 logit divided by cap (no test for -inf: the mask
  // that follows sets it).
  ATTN_HOST_DEVICE float Unit(float d) const { return SoftCapTanh(d * mul); }
};

// How a row's online softmax ends: o = acc * o_scale, lse2 its base-2 LSE.
// m2 is the row's running maximum (base-2 units; -inf when it saw no key),
// l the sum of 2^(logit2 - m2) over its keys, sink2 the sink in base-2
// units (sink * log2(e)), -inf for none. With a sink the denominator gains
// 2^sink2, both taken relative to max(m2, sink2) so that neither overflows.
struct RowEnd {
  float o_scale = 0.f;
  float lse2 = 0.f;
};

ATTN_HOST_DEVICE RowEnd EndRow(float m2, float l, float sink2) {
  RowEnd e;
  if (!(sink2 > -INFINITY)) {
    e.o_scale = l > 0.f ? Div(1.f, l) : 0.f;
    e.lse2 = l > 0.f ? m2 + Log2(l) : -INFINITY;
    return e;
  }
  const bool keys = l > 0.f;
  const float top = keys && m2 > sink2 ? m2 : sink2;
  const float a = keys ? Exp2(m2 - top) : 0.f;  // acc and l are relative to m2
  const float total = l * a + Exp2(sink2 - top);
  e.o_scale = Div(a, total);
  e.lse2 = top + Log2(total);
  return e;
}

}  // namespace attnserve
