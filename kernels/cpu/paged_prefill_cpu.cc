// CPU kernel for paged prefill attention (see paged_prefill.h). The rules of
// attention (the keys a row sees, the soft-cap, how a row ends with a sink)
// come from kernels/variant.h, as in every CUDA family.
//
// Work items of one (sequence, KV head, block of query rows: up to
// kMaxPairs (row, head) pairs), spread over OpenMP threads. An item walks
// the keys its rows see in chunks of kKeyChunk: it gathers a chunk into
// float buffers once (following the page table; a chunk stays in the core's
// cache), then attends every row and head of the block that sees some of it,
// with an online softmax (a chunk's new maximum rescales what was
// accumulated). Each key row is so read once for all heads of the group and
// all rows of the block. Dot products keep kLanes independent partial sums,
// which the compiler turns into vector instructions; on x86-64 the item's
// code is also built for AVX2 + FMA and picked at run time.
#include <omp.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <limits>
#include <vector>

#include "common/dtype.h"
#include "kernels/fp8.h"
#include "kernels/math.h"
#include "kernels/paged_prefill.h"
#include "kernels/variant.h"

// One build of a function per instruction set, chosen when the program
// loads (GCC and Clang on x86-64 with ifunc support; elsewhere one build).
#if defined(__x86_64__) && defined(__GNUC__) && defined(__ELF__) && !defined(__SANITIZE_ADDRESS__)
#define ATTN_CPU_CLONES __attribute__((target_clones("default", "arch=x86-64-v3")))
#else
#define ATTN_CPU_CLONES
#endif
#define ATTN_CPU_INLINE inline __attribute__((always_inline))

namespace attnserve {
namespace {

constexpr int32_t kMaxRows = 16;    // query rows per work item
constexpr int32_t kMaxPairs = 128;  // (row, head) pairs per work item, at least one row
constexpr int32_t kKeyChunk = 128;  // keys gathered and attended at a time
constexpr int kLanes = 16;          // partial sums of a dot product
constexpr int32_t kPrefetchRows = 8;  // key rows prefetched ahead of the gather
constexpr int32_t kMinSplitKeys = 256;  // the fewest keys of one part of a split item

struct Item {
  int32_t seq = 0;
  int32_t kv_head = 0;
  int32_t row_begin = 0;
  int32_t row_end = 0;
  KeyRange read;  // the keys any of its rows sees: the only ones read
  int64_t Pairs(int32_t group) const { return int64_t{row_end - row_begin} * group; }
};

// A thread's scratch, reused across its items. Pairs are (row of the item,
// head of the group), row-major.
struct Scratch {
  std::vector<float> k, v;      // one chunk's rows: (kKeyChunk, d), (kKeyChunk, dv)
  std::vector<float> q;         // (pairs, d)
  std::vector<float> acc;       // (pairs, dv)
  std::vector<float> m2, l;     // (pairs): running maximum (base 2) and sum
  std::vector<float> logits;    // (group, kKeyChunk)
  std::vector<float> rescale;   // (group)
  std::vector<KeyRange> keys;   // (rows): the keys each row sees
};

ATTN_CPU_INLINE float Dot(const float* a, const float* b, int n) {
  float part[kLanes] = {};
  int c = 0;
  for (; c + kLanes <= n; c += kLanes) {
    for (int i = 0; i < kLanes; ++i) part[i] += a[c + i] * b[c + i];
  }
  float tail = 0.f;
  for (; c < n; ++c) tail += a[c] * b[c];
  for (int w = kLanes / 2; w > 0; w /= 2) {
    for (int i = 0; i < w; ++i) part[i] += part[i + w];
  }
  return part[0] + tail;
}

// acc = acc * scale + w * x, over n values.
ATTN_CPU_INLINE void ScaleAdd(float* acc, float scale, float w, const float* x, int n) {
  if (scale == 1.f) {
    for (int c = 0; c < n; ++c) acc[c] += w * x[c];
  } else {
    for (int c = 0; c < n; ++c) acc[c] = acc[c] * scale + w * x[c];
  }
}

// Gathers rows [keys.begin, keys.end) (at most kKeyChunk) of KV head
// kv_head of a sequence into s.k (keys.size(), d) and s.v (keys.size(), dv),
// following the page table. MLA's V is the first dv values of the same
// latent row: only K is gathered, and V is read from it. An FP8 pool's
// values come out as they are stored (its scales are applied by the
// caller).
ATTN_CPU_INLINE void Gather(const PagedPrefillParams& p, const PrefillSeq& seq, int kv_head,
                            KeyRange keys, Scratch& s) {
  const KvGeometry& g = p.geo;
  const int64_t d = g.head_dim;
  const int64_t dv = g.VDim();
  const bool has_v = g.HasVPool();
  auto offset_of = [&](int32_t j) {  // of key j's values of kv_head, in elements
    const int64_t page = p.kv_indices[seq.kv_start + j / g.page_size];
    const int64_t slot = page * g.page_size + j % g.page_size;
    return (seq.layer * g.SlotsPerLayer() + slot) * g.RowElems() + int64_t{kv_head} * d;
  };
  const int64_t elem_bytes = g.KvElemBytes();
  // n values at element `offset` of a pool, as floats: 16-bit ones inline
  // (so vectorized in each build of the item).
  auto to_float = [&](const void* cache, int64_t offset, float* out, int64_t n) {
    if (g.KvIsFp8()) {
      const auto* b = static_cast<const uint8_t*>(cache) + offset;
      for (int64_t c = 0; c < n; ++c) out[c] = Fp8ToFloat(g.kv_fp8, b[c]);
    } else if (g.dtype == KvDType::kBf16) {
      const auto* h = static_cast<const uint16_t*>(cache) + offset;
      for (int64_t c = 0; c < n; ++c) out[c] = Bf16ToFloat(h[c]);
    } else {
      const auto* h = static_cast<const uint16_t*>(cache) + offset;
      for (int64_t c = 0; c < n; ++c) out[c] = Fp16ToFloat(h[c]);
    }
  };
  auto prefetch = [](const void* cache, int64_t byte_offset, int64_t bytes) {
    for (int64_t b = 0; b < bytes; b += 64) {
      __builtin_prefetch(static_cast<const char*>(cache) + byte_offset + b);
    }
  };
  for (int32_t i = 0; i < keys.size(); ++i) {
    const int32_t j = keys.begin + i;
    // A KV head's values are a piece of each row, rows are spread over
    // pages: the hardware prefetcher does not follow, so ask for the rows
    // kPrefetchRows ahead (a third of the time of a long decode otherwise).
    if (i + kPrefetchRows < keys.size()) {
      const int64_t ahead = offset_of(j + kPrefetchRows) * elem_bytes;
      prefetch(p.k_cache, ahead, d * elem_bytes);
      if (has_v) prefetch(p.v_cache, ahead, dv * elem_bytes);
    }
    const int64_t offset = offset_of(j);
    to_float(p.k_cache, offset, s.k.data() + int64_t{i} * d, d);
    if (has_v) to_float(p.v_cache, offset, s.v.data() + int64_t{i} * dv, dv);
  }
}

// An FP8 pool's scale of (layer, KV head); 1 for a 16-bit pool.
float KvScale(const PagedPrefillParams& p, const float* scales, int32_t layer, int kv_head) {
  return p.geo.KvIsFp8() ? KvScaleAt(scales, layer, p.geo.num_kv_heads, kv_head) : 1.f;
}

// A softmax state of an item's pairs: per pair its running maximum (base
// 2), its sum of weights relative to it, and its unnormalized output.
struct State {
  float* acc = nullptr;  // (pairs, dv)
  float* m2 = nullptr;   // (pairs)
  float* l = nullptr;    // (pairs)
};

// Rows [it.row_begin, it.row_end) of one sequence, every head of KV head
// it.kv_head's group, over keys `part` of those they see (all of them, or
// one split's share), a chunk at a time, into `st` (initialized here).
ATTN_CPU_CLONES void Accumulate(const PagedPrefillParams& p, const Item& it, KeyRange part,
                                State st, Scratch& s) {
  const KvGeometry& g = p.geo;
  const PrefillSeq& seq = p.seqs[it.seq];
  const int d = g.head_dim;
  const int dv = g.VDim();
  const int group = g.num_qo_heads / g.num_kv_heads;
  const int head0 = it.kv_head * group;
  const int rows = it.row_end - it.row_begin;
  const int64_t pairs = it.Pairs(group);
  // K's dequantization scale folds into the logit scale (V's into the
  // output, in Finish).
  const LogitTransform transform =
      LogitTransform::Of(seq, /*positive_scale=*/false, KvScale(p, p.k_scales, seq.layer, it.kv_head));
  const auto* q = static_cast<const uint16_t*>(p.q);
  s.k.resize(static_cast<size_t>(kKeyChunk) * d);
  if (g.HasVPool()) s.v.resize(static_cast<size_t>(kKeyChunk) * dv);
  s.q.resize(static_cast<size_t>(pairs) * d);
  std::fill(st.acc, st.acc + pairs * dv, 0.f);
  std::fill(st.m2, st.m2 + pairs, -std::numeric_limits<float>::infinity());
  std::fill(st.l, st.l + pairs, 0.f);
  s.logits.resize(static_cast<size_t>(group) * kKeyChunk);
  s.rescale.resize(group);
  s.keys.resize(rows);
  for (int r = 0; r < rows; ++r) {
    const int64_t row = seq.q_start + it.row_begin + r;
    HalfToFloatN(g.dtype, q + (row * g.num_qo_heads + head0) * d, s.q.data() + int64_t{r} * group * d,
                 int64_t{group} * d);
    s.keys[r] = RowKeys(seq, it.row_begin + r);
  }
  // V rows: their own buffer, or (MLA) the first dv values of K's rows.
  const float* v_rows = g.HasVPool() ? s.v.data() : s.k.data();
  const int64_t v_stride = g.HasVPool() ? dv : d;
  float* const logits = s.logits.data();
  float* const scale = s.rescale.data();

  for (int32_t c0 = part.begin; c0 < part.end; c0 += kKeyChunk) {
    const KeyRange chunk{c0, std::min(part.end, c0 + kKeyChunk)};
    Gather(p, seq, it.kv_head, chunk, s);
    for (int r = 0; r < rows; ++r) {
      // The part of the chunk this row sees.
      const int32_t j0 = std::max(chunk.begin, s.keys[r].begin);
      const int32_t j1 = std::min(chunk.end, s.keys[r].end);
      if (j1 <= j0) continue;
      const float* qr = s.q.data() + int64_t{r} * group * d;
      float* const m2 = st.m2 + int64_t{r} * group;
      float* const l = st.l + int64_t{r} * group;
      float* const acc = st.acc + int64_t{r} * group * dv;
      for (int32_t j = j0; j < j1; ++j) {
        const float* kj = s.k.data() + int64_t{j - c0} * d;
        for (int h = 0; h < group; ++h) {
          logits[h * kKeyChunk + (j - j0)] = transform.Log2(Dot(qr + int64_t{h} * d, kj, d));
        }
      }
      // The new maximum per head, and what rescales what came before.
      for (int h = 0; h < group; ++h) {
        const float* x = logits + h * kKeyChunk;
        float m = m2[h];
        for (int32_t j = 0; j < j1 - j0; ++j) m = std::max(m, x[j]);
        scale[h] = m2[h] == m ? 1.f : std::exp2(m2[h] - m);  // 0 from -inf
        m2[h] = m;
        l[h] *= scale[h];
      }
      for (int32_t j = j0; j < j1; ++j) {
        const float* vj = v_rows + int64_t{j - c0} * v_stride;
        for (int h = 0; h < group; ++h) {
          const float w = std::exp2(logits[h * kKeyChunk + (j - j0)] - m2[h]);
          l[h] += w;
          ScaleAdd(acc + int64_t{h} * dv, j == j0 ? scale[h] : 1.f, w, vj, dv);
        }
      }
    }
  }
}

// Rescales state `b` into `a` (pair by pair: the larger maximum wins).
void MergeInto(State a, State b, int64_t pairs, int dv) {
  for (int64_t i = 0; i < pairs; ++i) {
    const float m = std::max(a.m2[i], b.m2[i]);
    if (!(m > -INFINITY)) continue;  // neither saw a key
    const float sa = a.m2[i] > -INFINITY ? std::exp2(a.m2[i] - m) : 0.f;
    const float sb = b.m2[i] > -INFINITY ? std::exp2(b.m2[i] - m) : 0.f;
    a.m2[i] = m;
    a.l[i] = a.l[i] * sa + b.l[i] * sb;
    float* x = a.acc + i * dv;
    const float* y = b.acc + i * dv;
    for (int c = 0; c < dv; ++c) x[c] = x[c] * sa + y[c] * sb;
  }
}

// Writes an item's outputs and LSEs from its state (the sinks, V's scale
// and EndRow applied).
void Finish(const PagedPrefillParams& p, const Item& it, State st) {
  const KvGeometry& g = p.geo;
  const PrefillSeq& seq = p.seqs[it.seq];
  const int dv = g.VDim();
  const int group = g.num_qo_heads / g.num_kv_heads;
  const int head0 = it.kv_head * group;
  const float v_scale = KvScale(p, p.v_scales, seq.layer, it.kv_head);
  const float* sinks = seq.sink_index >= 0 && p.sinks != nullptr
                           ? p.sinks + int64_t{seq.sink_index} * g.num_qo_heads + head0
                           : nullptr;
  auto* o = static_cast<uint16_t*>(p.o);
  for (int r = 0; r < it.row_end - it.row_begin; ++r) {
    const int64_t row = seq.q_start + it.row_begin + r;
    for (int h = 0; h < group; ++h) {
      const int64_t pair = int64_t{r} * group + h;
      // Base-2 units throughout: the sink likewise.
      const float sink2 = sinks != nullptr ? sinks[h] * kLog2e : -INFINITY;
      const RowEnd end = EndRow(st.m2[pair], st.l[pair], sink2);
      const float o_scale = end.o_scale * v_scale;
      const int64_t at = row * g.num_qo_heads + head0 + h;
      const float* a = st.acc + pair * dv;
      uint16_t* out = o + at * dv;
      for (int c = 0; c < dv; ++c) out[c] = FloatToHalf(g.dtype, a[c] * o_scale);
      p.lse[at] = seq.lse_base_e ? end.lse2 * kLn2 : end.lse2;
    }
  }
}

}  // namespace

void PagedPrefillCpu(const PagedPrefillParams& p) { PagedPrefillCpu(p, nullptr); }

bool PagedPrefillCpu(const PagedPrefillParams& p, const std::function<bool()>* stop) {
  const KvGeometry& g = p.geo;
  const int32_t group = g.num_qo_heads / g.num_kv_heads;
  const int32_t block = std::clamp(kMaxPairs / std::max(group, 1), 1, kMaxRows);
  const int dv = g.VDim();
  std::vector<Item> items;
  for (int32_t s = 0; s < p.num_seqs; ++s) {
    const PrefillSeq& seq = p.seqs[s];
    for (int32_t r = 0; r < seq.q_len; r += block) {
      const int32_t r1 = std::min(seq.q_len, r + block);
      const KeyRange read = RowsKeys(seq, r, r1 - 1).read;
      for (int32_t h = 0; h < g.num_kv_heads; ++h) items.push_back(Item{s, h, r, r1, read});
    }
  }
  // Fewer items than two per thread (a small batch's decode over a long
  // KV): each item's keys are split into parts of at least kMinSplitKeys,
  // whose states merge by their maxima before the item's outputs are
  // written.
  const int64_t n = static_cast<int64_t>(items.size());
  const int threads = omp_get_max_threads();
  const int64_t want = n < 2 * threads ? (2 * threads + n - 1) / std::max<int64_t>(n, 1) : 1;
  struct Part {
    int32_t item;
    KeyRange keys;
    int64_t state;  // offset of its state in `states`; -1: unsplit
  };
  std::vector<Part> parts;
  std::vector<int32_t> first_part(n + 1, 0);
  int64_t state_floats = 0;
  for (int32_t i = 0; i < n; ++i) {
    first_part[i] = static_cast<int32_t>(parts.size());
    const KeyRange& read = items[i].read;
    const int64_t k = std::clamp<int64_t>(read.size() / kMinSplitKeys, 1, want);
    if (k == 1) {
      parts.push_back(Part{i, read, -1});
      continue;
    }
    const int64_t pairs = items[i].Pairs(group);
    const int32_t per = static_cast<int32_t>((read.size() + k - 1) / k);
    for (int32_t b = read.begin; b < read.end; b += per) {
      parts.push_back(Part{i, KeyRange{b, std::min(read.end, b + per)}, state_floats});
      state_floats += pairs * (dv + 2);
    }
  }
  first_part[n] = static_cast<int32_t>(parts.size());
  std::vector<float> states(static_cast<size_t>(state_floats));
  auto state_at = [&](int64_t off, int64_t pairs) {
    float* base = states.data() + off;
    return State{base, base + pairs * dv, base + pairs * (dv + 1)};
  };
  const int64_t num_parts = static_cast<int64_t>(parts.size());
  // Set once `stop` says true: the parts not begun are skipped, and so are
  // the merges (their items' rows stay unwritten).
  std::atomic<bool> stopped{false};
  auto stopping = [&] {
    if (stop == nullptr) return false;
    if (stopped.load(std::memory_order_relaxed)) return true;
    if (!(*stop)()) return false;
    stopped.store(true, std::memory_order_relaxed);
    return true;
  };
#pragma omp parallel if (num_parts > 1)
  {
    Scratch scratch;
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < num_parts; ++i) {
      if (stopping()) continue;
      const Part& part = parts[i];
      const Item& it = items[part.item];
      const int64_t pairs = it.Pairs(group);
      if (part.state >= 0) {
        Accumulate(p, it, part.keys, state_at(part.state, pairs), scratch);
        continue;
      }
      scratch.acc.resize(static_cast<size_t>(pairs) * dv);
      scratch.m2.resize(pairs);
      scratch.l.resize(pairs);
      const State st{scratch.acc.data(), scratch.m2.data(), scratch.l.data()};
      Accumulate(p, it, part.keys, st, scratch);
      Finish(p, it, st);
    }
    // The split items: their parts' states merged into the first's.
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < n; ++i) {
      if (parts[first_part[i]].state < 0 || stopped.load(std::memory_order_relaxed)) continue;
      const int64_t pairs = items[i].Pairs(group);
      const State st = state_at(parts[first_part[i]].state, pairs);
      for (int32_t k = first_part[i] + 1; k < first_part[i + 1]; ++k) {
        MergeInto(st, state_at(parts[k].state, pairs), pairs, dv);
      }
      Finish(p, items[i], st);
    }
  }
  return !stopped.load();
}

}  // namespace attnserve
