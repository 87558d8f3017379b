// cpp_client: one sequence through attnserve with the installed C++ client.
//
// Connects, allocates the pages of one sequence of kKvLen tokens, writes its
// keys and values into layer 0, then runs one Prefill for its last kQLen
// tokens (causal: query row i sees tokens 0 .. kKvLen - kQLen + i) and checks
// the output and LSE against a float64 computation of the same attention.
//
//   cpp_client [HOST:PORT]        (default 127.0.0.1:50051)
//
// Exit code 0 when every call succeeded and the result matches.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include "attnserve/client/client.h"
#include "attnserve/common/dtype.h"
#include "attnserve/version.h"

namespace {

constexpr int kKvLen = 40;  // tokens of the sequence (keys and values)
constexpr int kQLen = 4;    // its last tokens, as queries

int Fail(const char* what, const absl::Status& status) {
  std::fprintf(stderr, "cpp_client: %s: %s\n", what, status.ToString().c_str());
  return 1;
}

// Random values rounded to the server's dtype: `bits` to send, `values` (the
// same numbers as floats) for the reference.
void RandomHalves(std::mt19937& gen, attnserve::KvDType dtype, size_t n,
                  std::vector<uint16_t>* bits, std::vector<float>* values) {
  std::normal_distribution<float> normal(0.f, 1.f);
  bits->resize(n);
  values->resize(n);
  for (size_t i = 0; i < n; ++i) {
    (*bits)[i] = attnserve::FloatToHalf(dtype, normal(gen));
    (*values)[i] = attnserve::HalfToFloat(dtype, (*bits)[i]);
  }
}

}  // namespace

int main(int argc, char** argv) {
  attnserve::ClientOptions options;
  options.target = argc > 1 ? argv[1] : "127.0.0.1:50051";
  auto connected = attnserve::Client::Connect(options);
  if (!connected.ok()) return Fail("connect", connected.status());
  attnserve::Client& client = **connected;
  const attnserve::v1::ServerInfo& info = client.info();
  const attnserve::KvGeometry geo = attnserve::GeometryOf(info);
  std::printf("client %s: server %s at %s, %s backend, %d of %d pages free, page_size %d, "
              "%d query heads, %d KV heads, head_dim %d, %s\n",
              ATTNSERVE_VERSION, info.version().c_str(), options.target.c_str(),
              info.backend().c_str(), info.free_pages(), info.num_pages(), geo.page_size,
              geo.num_qo_heads, geo.num_kv_heads, geo.head_dim,
              attnserve::v1::DType_Name(info.kv_dtype()).c_str());

  // The sequence's pages; token t lives in slot pages[t / page_size] * page_size + t % page_size.
  const int num_pages = (kKvLen + geo.page_size - 1) / geo.page_size;
  auto pages = client.AllocatePages(num_pages);
  if (!pages.ok()) return Fail("AllocatePages", pages.status());
  std::vector<int64_t> slots(kKvLen);
  for (int t = 0; t < kKvLen; ++t) {
    slots[t] = int64_t{(*pages)[t / geo.page_size]} * geo.page_size + t % geo.page_size;
  }

  // K and V: (kKvLen, num_kv_heads, head_dim); q: (kQLen, num_qo_heads, head_dim).
  const int hq = geo.num_qo_heads, hkv = geo.num_kv_heads, d = geo.head_dim;
  std::mt19937 gen(2024);
  std::vector<uint16_t> k, v, q;
  std::vector<float> kf, vf, qf;
  RandomHalves(gen, geo.dtype, static_cast<size_t>(kKvLen) * hkv * d, &k, &kf);
  RandomHalves(gen, geo.dtype, static_cast<size_t>(kKvLen) * hkv * d, &v, &vf);
  RandomHalves(gen, geo.dtype, static_cast<size_t>(kQLen) * hq * d, &q, &qf);
  absl::Status written = client.WriteKV(/*layer=*/0, slots, k, v);
  if (!written.ok()) return Fail("WriteKV", written);

  // One sequence: rows [0, kQLen) of q, the pages in order, and how full the last one is.
  const std::vector<int32_t> qo_indptr = {0, kQLen};
  const std::vector<int32_t> kv_indptr = {0, num_pages};
  const std::vector<int32_t> kv_last_page_len = {kKvLen - (num_pages - 1) * geo.page_size};
  attnserve::PrefillArgs args;
  args.layer = 0;
  args.q = q;
  args.qo_indptr = qo_indptr;
  args.kv_indptr = kv_indptr;
  args.kv_indices = *pages;
  args.kv_last_page_len = kv_last_page_len;
  args.expected_incarnation = info.incarnation();  // refused if the server restarted
  auto out = client.Prefill(args);
  if (!out.ok()) return Fail("Prefill", out.status());

  // float64 reference: softmax(q k^T / sqrt(d)) v over the tokens each row
  // sees; query head h reads KV head h / (hq / hkv); LSE is base 2.
  auto q_at = [&](int row, int head) { return (static_cast<size_t>(row) * hq + head) * d; };
  auto kv_at = [&](int token, int head) { return (static_cast<size_t>(token) * hkv + head) * d; };
  const double scale = 1.0 / std::sqrt(static_cast<double>(d));
  double err2 = 0, ref2 = 0, lse_err = 0;
  for (int i = 0; i < kQLen; ++i) {
    const int visible = kKvLen - kQLen + i + 1;
    for (int h = 0; h < hq; ++h) {
      const int kvh = h / (hq / hkv);
      std::vector<double> p(visible);  // logits, then exp(logit - max)
      double m = -INFINITY;
      for (int t = 0; t < visible; ++t) {
        double dot = 0;
        for (int c = 0; c < d; ++c) dot += double{qf[q_at(i, h) + c]} * kf[kv_at(t, kvh) + c];
        p[t] = dot * scale;
        m = std::max(m, p[t]);
      }
      double sum = 0;
      for (double& x : p) sum += (x = std::exp(x - m));
      for (int c = 0; c < d; ++c) {
        double ref = 0;
        for (int t = 0; t < visible; ++t) ref += p[t] * vf[kv_at(t, kvh) + c];
        ref /= sum;
        const double got = attnserve::HalfToFloat(geo.dtype, out->o[q_at(i, h) + c]);
        err2 += (got - ref) * (got - ref);
        ref2 += ref * ref;
      }
      const double lse_ref = (m + std::log(sum)) / std::log(2.0);
      lse_err = std::max(lse_err, std::abs(out->lse[static_cast<size_t>(i) * hq + h] - lse_ref));
    }
  }
  const double rel = std::sqrt(err2 / ref2);
  const bool ok = rel < 1e-2 && lse_err < 1e-3;  // docs/design.md section 3
  const size_t last = q_at(kQLen - 1, 0);
  std::printf("prefill: %d query rows x %d heads over %d tokens in %d pages\n", kQLen, hq, kKvLen,
              num_pages);
  std::printf("row %d, head 0: o[0:4] = %+.4f %+.4f %+.4f %+.4f, lse = %.4f (base 2)\n",
              kQLen - 1, attnserve::HalfToFloat(geo.dtype, out->o[last]),
              attnserve::HalfToFloat(geo.dtype, out->o[last + 1]),
              attnserve::HalfToFloat(geo.dtype, out->o[last + 2]),
              attnserve::HalfToFloat(geo.dtype, out->o[last + 3]),
              out->lse[static_cast<size_t>(kQLen - 1) * hq]);
  std::printf("against float64: o relative error %.2e, lse max error %.2e: %s\n", rel, lse_err,
              ok ? "OK" : "MISMATCH");

  absl::Status freed = client.FreePages(*pages);
  if (!freed.ok()) return Fail("FreePages", freed);
  return ok ? 0 : 2;
}
