// Writes the seed corpus for request_fuzz: valid requests of every RPC for
// the fuzz harness's geometry (2 layers, 16 pages of 4, 4 query heads,
// 2 KV heads, head_dim 64, bf16; tenant "a" owns pages 0..7).
//   make_corpus DIR
#include <fstream>
#include <iostream>
#include <random>
#include <string>

#include "attnserve/v1/attention.pb.h"

namespace {

using namespace attnserve;

void Write(const std::string& dir, const std::string& name, uint8_t rpc,
           const google::protobuf::Message& m) {
  std::ofstream out(dir + "/" + name, std::ios::binary);
  out.put(static_cast<char>(rpc));
  m.SerializeToOstream(&out);
}

void Fill(v1::Tensor* t, v1::DType dtype, std::initializer_list<int64_t> shape, std::mt19937& gen) {
  t->set_dtype(dtype);
  int64_t n = dtype == v1::DTYPE_FP32 ? 4 : 2;
  for (int64_t d : shape) {
    t->add_shape(d);
    n *= d;
  }
  std::string bytes(n, 0);
  // bf16 values in about [-2, 2]: high byte 0x3f/0xbf/0x40/0xc0.
  for (int64_t i = 0; i < n; i += 2) {
    bytes[i] = static_cast<char>(gen());
    bytes[i + 1] = static_cast<char>(0x3f | (gen() & 0x80));
  }
  t->set_data(bytes);
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::cerr << "usage: make_corpus DIR\n";
    return 2;
  }
  const std::string dir = argv[1];
  std::mt19937 gen(7);
  for (int variant = 0; variant < 4; ++variant) {
    v1::PrefillRequest p;
    p.set_layer(variant % 2);
    const int q0 = 1 + variant, q1 = 3;
    Fill(p.mutable_q(), v1::DTYPE_BF16, {q0 + q1, 4, 64}, gen);
    for (int x : {0, q0, q0 + q1}) p.add_qo_indptr(x);
    for (int x : {0, 2, 3}) p.add_kv_indptr(x);
    for (int x : {3, 1, 6}) p.add_kv_indices(x);
    for (int x : {variant % 4 + 1, 2}) p.add_kv_last_page_len(x);
    if (variant == 1) p.set_causal(false);
    if (variant == 2) p.set_lse_base(v1::LSE_BASE_E);
    if (variant == 3) {
      p.set_sm_scale(0.3f);
      for (int s : {4, 5}) p.add_append_slots(s);
      Fill(p.mutable_append_k(), v1::DTYPE_BF16, {2, 2, 64}, gen);
      Fill(p.mutable_append_v(), v1::DTYPE_BF16, {2, 2, 64}, gen);
    }
    Write(dir, "prefill" + std::to_string(variant), 0, p);
  }
  v1::WriteKVRequest w;
  w.set_layer(1);
  for (int s : {0, 9, 31}) w.add_slots(s);
  Fill(w.mutable_k(), v1::DTYPE_BF16, {3, 2, 64}, gen);
  Fill(w.mutable_v(), v1::DTYPE_BF16, {3, 2, 64}, gen);
  Write(dir, "writekv", 1, w);
  v1::ReadKVRequest r;
  for (int s : {1, 2, 30}) r.add_slots(s);
  Write(dir, "readkv", 2, r);
  v1::MergeStatesRequest m;
  for (int i = 0; i < 3; ++i) {
    auto* s = m.add_states();
    Fill(s->mutable_v(), v1::DTYPE_BF16, {2, 4, 64}, gen);
    Fill(s->mutable_lse(), v1::DTYPE_FP32, {2, 4}, gen);
  }
  Write(dir, "merge", 3, m);
  v1::FreePagesRequest f;
  for (int x : {14, 15}) f.add_page_ids(x);  // not tenant a's: PERMISSION_DENIED path
  Write(dir, "free", 4, f);
  return 0;
}
