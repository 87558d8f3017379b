// The geometry a server reports, as the clients compute with it
// (declared in client/client.h).
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "client/client.h"

namespace attnserve {

KvGeometry GeometryOf(const v1::ServerInfo& info) {
  KvGeometry g;
  g.num_layers = info.num_layers();
  g.num_pages = info.num_pages();
  g.page_size = info.page_size();
  g.num_qo_heads = info.num_qo_heads();
  g.num_kv_heads = info.num_kv_heads();
  g.head_dim = info.head_dim();
  if (info.attention() == v1::ATTENTION_MLA) {
    g.attention = AttentionKind::kMla;
    g.kv_lora_rank = info.kv_lora_rank();
    g.qk_rope_head_dim = info.qk_rope_head_dim();
  }
  g.dtype = QueryDType(info) == v1::DTYPE_FP16 ? KvDType::kFp16 : KvDType::kBf16;
  g.kv_fp8 = info.kv_dtype() == v1::DTYPE_FP8_E4M3   ? Fp8Format::kE4m3
             : info.kv_dtype() == v1::DTYPE_FP8_E5M2 ? Fp8Format::kE5m2
                                                     : Fp8Format::kNone;
  return g;
}

std::string GeometryDifference(const KvGeometry& a, const KvGeometry& b, absl::string_view a_is) {
  std::vector<std::string> diffs;
  auto cmp = [&](const char* name, int64_t x, int64_t y) {
    if (x != y) diffs.push_back(absl::StrCat(name, "=", y, " (", a_is, " ", x, ")"));
  };
  cmp("num_layers", a.num_layers, b.num_layers);
  cmp("page_size", a.page_size, b.page_size);
  cmp("num_qo_heads", a.num_qo_heads, b.num_qo_heads);
  cmp("num_kv_heads", a.num_kv_heads, b.num_kv_heads);
  cmp("head_dim", a.head_dim, b.head_dim);
  if (a.attention != b.attention) {
    diffs.push_back(absl::StrCat("attention=", AttentionKindName(b.attention), " (", a_is, " ",
                                 AttentionKindName(a.attention), ")"));
  }
  cmp("kv_lora_rank", a.kv_lora_rank, b.kv_lora_rank);
  cmp("qk_rope_head_dim", a.qk_rope_head_dim, b.qk_rope_head_dim);
  auto q_name = [](const KvGeometry& g) { return g.dtype == KvDType::kBf16 ? "bf16" : "fp16"; };
  auto kv_name = [&](const KvGeometry& g) {
    return g.KvIsFp8() ? Fp8FormatName(g.kv_fp8) : q_name(g);
  };
  if (std::string(kv_name(a)) != kv_name(b)) {
    diffs.push_back(absl::StrCat("kv_dtype=", kv_name(b), " (", a_is, " ", kv_name(a), ")"));
  }
  if (a.dtype != b.dtype) {
    diffs.push_back(absl::StrCat("q_dtype=", q_name(b), " (", a_is, " ", q_name(a), ")"));
  }
  return absl::StrJoin(diffs, ", ");
}

v1::DType QueryDType(const v1::ServerInfo& info) {
  return info.q_dtype() != v1::DTYPE_UNSPECIFIED ? info.q_dtype() : info.kv_dtype();
}

}  // namespace attnserve
