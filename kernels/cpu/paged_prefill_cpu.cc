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
#include <algorithm>
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

struct Item {
  int32_t seq = 0;
  int32_t kv_head = 0;
  int32_t row_begin = 0;
  int32_t row_end = 0;
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
void Gather(const PagedPrefillParams& p, const PrefillSeq& seq, int kv_head, KeyRange keys,
            Scratch& s) {
  const KvGeometry& g = p.geo;
  const int64_t d = g.head_dim;
  const int64_t dv = g.VDim();
  const bool has_v = g.HasVPool();
  auto offset_of = [&](int32_t j) {  // of key j's values of kv_head, in elements
    const int64_t page = p.kv_indices[seq.kv_start + j / g.page_size];
    const int64_t slot = page * g.page_size + j % g.page_size;
    return (seq.layer * g.SlotsPerLayer() + slot) * g.RowElems() + int64_t{kv_head} * d;
  };
  const int64_t elem_bytes = g.KvIsFp8() ? 1 : 2;
  for (int32_t i = 0; i < keys.size(); ++i) {
    const int32_t j = keys.begin + i;
    // A KV head's values are a piece of each row, rows are spread over
    // pages: the hardware prefetcher does not follow, so ask for the rows
    // kPrefetchRows ahead (a third of the time of a long decode otherwise).
    if (i + kPrefetchRows < keys.size()) {
      const int64_t ahead = offset_of(j + kPrefetchRows) * elem_bytes;
      for (int64_t b = 0; b < d * elem_bytes; b += 64) {
        __builtin_prefetch(static_cast<const char*>(p.k_cache) + ahead + b);
      }
      for (int64_t b = 0; has_v && b < dv * elem_bytes; b += 64) {
        __builtin_prefetch(static_cast<const char*>(p.v_cache) + ahead + b);
      }
    }
    const int64_t offset = offset_of(j);
    float* kf = s.k.data() + int64_t{i} * d;
    float* vf = has_v ? s.v.data() + int64_t{i} * dv : nullptr;
    if (g.KvIsFp8()) {
      const auto* kb = static_cast<const uint8_t*>(p.k_cache) + offset;
      for (int64_t c = 0; c < d; ++c) kf[c] = Fp8ToFloat(g.kv_fp8, kb[c]);
      if (has_v) {
        const auto* vb = static_cast<const uint8_t*>(p.v_cache) + offset;
        for (int64_t c = 0; c < dv; ++c) vf[c] = Fp8ToFloat(g.kv_fp8, vb[c]);
      }
    } else {
      HalfToFloatN(g.dtype, static_cast<const uint16_t*>(p.k_cache) + offset, kf, d);
      if (has_v) HalfToFloatN(g.dtype, static_cast<const uint16_t*>(p.v_cache) + offset, vf, dv);
    }
  }
}

// An FP8 pool's scale of (layer, KV head); 1 for a 16-bit pool.
float KvScale(const PagedPrefillParams& p, const float* scales, int32_t layer, int kv_head) {
  if (!p.geo.KvIsFp8() || scales == nullptr) return 1.f;
  return scales[int64_t{layer} * p.geo.num_kv_heads + kv_head];
}

// Rows [it.row_begin, it.row_end) of one sequence, every head of KV head
// it.kv_head's group, over the keys they see (`read`), a chunk at a time.
ATTN_CPU_CLONES void AttendItem(const PagedPrefillParams& p, const Item& it, KeyRange read,
                                Scratch& s) {
  const KvGeometry& g = p.geo;
  const PrefillSeq& seq = p.seqs[it.seq];
  const int d = g.head_dim;
  const int dv = g.VDim();
  const int group = g.num_qo_heads / g.num_kv_heads;
  const int head0 = it.kv_head * group;
  const int rows = it.row_end - it.row_begin;
  const int64_t pairs = int64_t{rows} * group;
  // K's dequantization scale folds into the logit scale, V's into the output.
  const LogitTransform transform =
      LogitTransform::Of(seq, /*positive_scale=*/false, KvScale(p, p.k_scales, seq.layer, it.kv_head));
  const float v_scale = KvScale(p, p.v_scales, seq.layer, it.kv_head);
  const float* sinks = seq.sink_index >= 0 && p.sinks != nullptr
                           ? p.sinks + int64_t{seq.sink_index} * g.num_qo_heads + head0
                           : nullptr;
  const auto* q = static_cast<const uint16_t*>(p.q);
  auto* o = static_cast<uint16_t*>(p.o);
  s.k.resize(static_cast<size_t>(kKeyChunk) * d);
  if (g.HasVPool()) s.v.resize(static_cast<size_t>(kKeyChunk) * dv);
  s.q.resize(static_cast<size_t>(pairs) * d);
  s.acc.assign(static_cast<size_t>(pairs) * dv, 0.f);
  s.m2.assign(pairs, -std::numeric_limits<float>::infinity());
  s.l.assign(pairs, 0.f);
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

  for (int32_t c0 = read.begin; c0 < read.end; c0 += kKeyChunk) {
    const KeyRange chunk{c0, std::min(read.end, c0 + kKeyChunk)};
    Gather(p, seq, it.kv_head, chunk, s);
    for (int r = 0; r < rows; ++r) {
      // The part of the chunk this row sees.
      const int32_t j0 = std::max(chunk.begin, s.keys[r].begin);
      const int32_t j1 = std::min(chunk.end, s.keys[r].end);
      if (j1 <= j0) continue;
      const float* qr = s.q.data() + int64_t{r} * group * d;
      float* const m2 = s.m2.data() + int64_t{r} * group;
      float* const l = s.l.data() + int64_t{r} * group;
      float* const acc = s.acc.data() + int64_t{r} * group * dv;
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
  for (int r = 0; r < rows; ++r) {
    const int64_t row = seq.q_start + it.row_begin + r;
    for (int h = 0; h < group; ++h) {
      const int64_t pair = int64_t{r} * group + h;
      // Base-2 units throughout: the sink likewise.
      const float sink2 = sinks != nullptr ? sinks[h] * kLog2e : -INFINITY;
      const RowEnd end = EndRow(s.m2[pair], s.l[pair], sink2);
      const float o_scale = end.o_scale * v_scale;
      const int64_t at = row * g.num_qo_heads + head0 + h;
      const float* a = s.acc.data() + pair * dv;
      uint16_t* out = o + at * dv;
      for (int c = 0; c < dv; ++c) out[c] = FloatToHalf(g.dtype, a[c] * o_scale);
      p.lse[at] = seq.lse_base_e ? end.lse2 * kLn2 : end.lse2;
    }
  }
}

}  // namespace

void PagedPrefillCpu(const PagedPrefillParams& p) {
  const KvGeometry& g = p.geo;
  const int32_t group = g.num_qo_heads / g.num_kv_heads;
  const int32_t block = std::clamp(kMaxPairs / std::max(group, 1), 1, kMaxRows);
  std::vector<Item> items;
  for (int32_t s = 0; s < p.num_seqs; ++s) {
    const PrefillSeq& seq = p.seqs[s];
    for (int32_t r = 0; r < seq.q_len; r += block) {
      for (int32_t h = 0; h < g.num_kv_heads; ++h) {
        items.push_back(Item{s, h, r, std::min(seq.q_len, r + block)});
      }
    }
  }
  const int64_t n = static_cast<int64_t>(items.size());
#pragma omp parallel if (n > 1)
  {
    Scratch scratch;
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < n; ++i) {
      const Item& it = items[i];
      // The keys any row of the item sees: the only ones read.
      const KeyRange read = RowsKeys(p.seqs[it.seq], it.row_begin, it.row_end - 1).read;
      AttendItem(p, it, read, scratch);
    }
  }
}

}  // namespace attnserve
