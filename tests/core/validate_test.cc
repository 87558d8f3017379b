// Validation of Prefill, WriteKV, ReadKV and MergeStates: one case per
// malformed field, each asserting the code and that the message names the
// field; and what a valid request turns into.
#include "server/core/validate.h"

#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace attnserve {
namespace {

using ::testing::HasSubstr;

constexpr uint64_t kIncarnation = 0x1234567890abcdefull;

KvGeometry Geo(int32_t page_size = 16) {
  KvGeometry g;
  g.num_layers = 2;
  g.num_pages = 10;
  g.page_size = page_size;
  g.num_qo_heads = 4;
  g.num_kv_heads = 2;
  g.head_dim = 64;
  g.dtype = KvDType::kBf16;
  return g;
}

RequestLimits Limits() {
  RequestLimits l;
  l.max_message_bytes = 1 << 20;
  l.max_request_rows = 64;
  l.max_request_kv_indices = 32;
  return l;
}

std::string Bytes(int64_t n) { return std::string(static_cast<size_t>(n), '\x3c'); }

// A valid Prefill: 2 sequences (5 rows over 2 pages with 20 tokens; 3 rows
// over 1 page with 7 tokens) and a fused append of 2 rows into page 9. The
// struct owns every buffer the call's views point into.
struct PrefillFixture {
  KvGeometry geo = Geo();
  std::string q_bytes, k_bytes, v_bytes;
  std::vector<int32_t> qo_indptr{0, 5, 8}, kv_indptr{0, 2, 3}, kv_indices{4, 1, 7},
      kv_last_page_len{4, 7};
  std::vector<int64_t> append_slots{9 * 16 + 3, 9 * 16};
  PrefillCall call;

  PrefillFixture() {
    q_bytes = Bytes(8 * 4 * 64 * 2);
    k_bytes = Bytes(2 * 2 * 64 * 2);
    v_bytes = Bytes(2 * 2 * 64 * 2);
    Rebind();
  }
  // Points the call's views at the (possibly edited) buffers.
  void Rebind() {
    call.tenant = "default";
    call.layer = 1;
    call.q.dtype = TensorDType::kBf16;
    call.q.shape = {8, 4, 64};
    call.q.data = q_bytes;
    call.qo_indptr = qo_indptr;
    call.kv_indptr = kv_indptr;
    call.kv_indices = kv_indices;
    call.kv_last_page_len = kv_last_page_len;
    call.append_slots = append_slots;
    call.append_k = {TensorDType::kBf16, {2, 2, 64}, k_bytes};
    call.append_v = {TensorDType::kBf16, {2, 2, 64}, v_bytes};
  }
  absl::StatusOr<ValidatedPrefill> Validate() const {
    return ValidatePrefill(call, geo, Limits(), kIncarnation);
  }
};

TEST(ValidatePrefillTest, ValidRequestBecomesATask) {
  PrefillFixture f;
  auto v = f.Validate();
  ASSERT_TRUE(v.ok()) << v.status();
  EXPECT_EQ(v->task.layer, 1);
  EXPECT_EQ(v->task.total_q, 8);
  EXPECT_EQ(v->task.num_kv_indices, 3);
  EXPECT_EQ(v->task.num_append, 2);
  ASSERT_EQ(v->task.seqs.size(), 2u);
  EXPECT_EQ(v->task.seqs[0].q_start, 0);
  EXPECT_EQ(v->task.seqs[0].q_len, 5);
  EXPECT_EQ(v->task.seqs[0].kv_start, 0);
  EXPECT_EQ(v->task.seqs[0].kv_len, 16 + 4);
  EXPECT_EQ(v->task.seqs[1].q_start, 5);
  EXPECT_EQ(v->task.seqs[1].q_len, 3);
  EXPECT_EQ(v->task.seqs[1].kv_start, 2);
  EXPECT_EQ(v->task.seqs[1].kv_len, 7);
  for (const PrefillSeq& s : v->task.seqs) {
    EXPECT_EQ(s.layer, 1);
    EXPECT_FLOAT_EQ(s.sm_scale, 1.f / 8.f) << "default sm_scale is 1/sqrt(head_dim)";
    EXPECT_EQ(s.causal, 1) << "causal defaults to true";
    EXPECT_EQ(s.lse_base_e, 0) << "LSE is base 2 by default";
  }
  // Pages to pin: every kv_indices entry, then each append slot's page, in
  // order (a repeat is pinned twice; not sorted, which costs ~1 ms at 16k).
  EXPECT_EQ(v->pages, (std::vector<int32_t>{4, 1, 7, 9, 9}));
  EXPECT_EQ(v->out_bytes, 8 * 4 * 64 * 2);
  EXPECT_EQ(v->lse_bytes, 8 * 4 * 4);
}

TEST(ValidatePrefillTest, ExplicitSettingsArePassedThrough) {
  PrefillFixture f;
  f.call.sm_scale = 0.25f;
  f.call.causal = false;
  f.call.lse_base = 1;
  f.call.expected_incarnation = kIncarnation;
  auto v = f.Validate();
  ASSERT_TRUE(v.ok()) << v.status();
  for (const PrefillSeq& s : v->task.seqs) {
    EXPECT_FLOAT_EQ(s.sm_scale, 0.25f);
    EXPECT_EQ(s.causal, 0);
    EXPECT_EQ(s.lse_base_e, 1);
  }
}

TEST(ValidatePrefillTest, EdgeCasesThatAreValid) {
  // Empty sequences, sequences without pages, repeated page ids, no append.
  PrefillFixture f;
  f.qo_indptr = {0, 0, 4, 4, 8};
  f.kv_indptr = {0, 1, 1, 4, 4};
  f.kv_indices = {3, 3, 0, 3};
  f.kv_last_page_len = {16, 0, 1, 0};
  f.append_slots.clear();
  f.k_bytes.clear();
  f.v_bytes.clear();
  f.Rebind();
  f.call.append_k = {};
  f.call.append_v = {};
  auto v = f.Validate();
  ASSERT_TRUE(v.ok()) << v.status();
  ASSERT_EQ(v->task.seqs.size(), 4u);
  EXPECT_EQ(v->task.seqs[0].q_len, 0);
  EXPECT_EQ(v->task.seqs[0].kv_len, 16);
  EXPECT_EQ(v->task.seqs[1].kv_len, 0);
  EXPECT_EQ(v->task.seqs[2].kv_len, 2 * 16 + 1);
  EXPECT_EQ(v->task.seqs[3].kv_len, 0);
  EXPECT_EQ(v->task.num_append, 0);
  EXPECT_EQ(v->pages, (std::vector<int32_t>{3, 3, 0, 3}));
  // An empty batch (qo_indptr = {0}) is valid too.
  PrefillFixture e;
  e.qo_indptr = {0};
  e.kv_indptr = {0};
  e.kv_indices.clear();
  e.kv_last_page_len.clear();
  e.q_bytes.clear();
  e.Rebind();
  e.call.q.shape = {0, 4, 64};
  e.call.append_slots = {};
  e.call.append_k = {};
  e.call.append_v = {};
  auto ev = e.Validate();
  ASSERT_TRUE(ev.ok()) << ev.status();
  EXPECT_TRUE(ev->task.seqs.empty());
}

TEST(ValidatePrefillTest, LastPageLenMayBeOmittedOnlyAtPageSizeOne) {
  PrefillFixture f;
  f.geo = Geo(1);
  f.kv_last_page_len.clear();
  f.append_slots = {9, 3};
  f.Rebind();
  auto v = f.Validate();
  ASSERT_TRUE(v.ok()) << v.status();
  EXPECT_EQ(v->task.seqs[0].kv_len, 2);
  EXPECT_EQ(v->task.seqs[1].kv_len, 1);
}

// One malformed field: how to break the valid fixture, the expected code and
// what the message must contain (the field's name).
struct PrefillCase {
  std::string name;
  std::function<void(PrefillFixture&)> mutate;
  absl::StatusCode code;
  std::string field;
};

void PrintTo(const PrefillCase& c, std::ostream* os) { *os << c.name; }

class ValidatePrefillFieldTest : public ::testing::TestWithParam<PrefillCase> {};

TEST_P(ValidatePrefillFieldTest, RejectsWithCodeNamingTheField) {
  const PrefillCase& c = GetParam();
  PrefillFixture f;
  c.mutate(f);
  auto v = f.Validate();
  ASSERT_FALSE(v.ok()) << c.name << " was accepted";
  EXPECT_EQ(v.status().code(), c.code) << v.status();
  EXPECT_THAT(std::string(v.status().message()), HasSubstr(c.field));
}

using F = PrefillFixture;
const absl::StatusCode kInvalid = absl::StatusCode::kInvalidArgument;

INSTANTIATE_TEST_SUITE_P(
    Fields, ValidatePrefillFieldTest,
    ::testing::Values(
        PrefillCase{"ExpectedIncarnation", [](F& f) { f.call.expected_incarnation = 77; },
                    absl::StatusCode::kFailedPrecondition, "expected_incarnation"},
        PrefillCase{"LayerNegative", [](F& f) { f.call.layer = -1; }, kInvalid, "layer=-1"},
        PrefillCase{"LayerTooLarge", [](F& f) { f.call.layer = 2; }, kInvalid, "layer=2"},
        PrefillCase{"QRank", [](F& f) { f.call.q.shape = {8, 256}; }, kInvalid, "q.shape"},
        PrefillCase{"QRowsNegative", [](F& f) { f.call.q.shape[0] = -1; }, kInvalid,
                    "q.shape[0]"},
        PrefillCase{"QRowsOverLimit", [](F& f) { f.call.q.shape[0] = 65; }, kInvalid,
                    "q.shape[0]"},
        PrefillCase{"QHeads", [](F& f) { f.call.q.shape = {16, 2, 64}; }, kInvalid,
                    "q.shape[1]"},
        PrefillCase{"QHeadDim", [](F& f) { f.call.q.shape = {4, 4, 128}; }, kInvalid,
                    "q.shape[2]"},
        PrefillCase{"QDTypeFp16", [](F& f) { f.call.q.dtype = TensorDType::kFp16; }, kInvalid, "q.dtype"},
        PrefillCase{"QDTypeUnspecified", [](F& f) { f.call.q.dtype = TensorDType::kUnspecified; }, kInvalid,
                    "q.dtype"},
        PrefillCase{"QDTypeUnknown", [](F& f) { f.call.q.dtype = TensorDType::kUnknown; }, kInvalid, "q.dtype"},
        PrefillCase{"QDataShort",
                    [](F& f) { f.call.q.data = absl::string_view(f.q_bytes).substr(2); },
                    kInvalid, "q.data"},
        PrefillCase{"QoIndptrEmpty", [](F& f) { f.call.qo_indptr = {}; }, kInvalid,
                    "qo_indptr"},
        PrefillCase{"QoIndptrStart", [](F& f) { f.qo_indptr = {1, 5, 8}; f.Rebind(); },
                    kInvalid, "qo_indptr[0]"},
        PrefillCase{"QoIndptrDecreasing", [](F& f) { f.qo_indptr = {0, 9, 8}; f.Rebind(); },
                    kInvalid, "qo_indptr[2]"},
        PrefillCase{"QoIndptrEnd", [](F& f) { f.qo_indptr = {0, 5, 7}; f.Rebind(); },
                    kInvalid, "qo_indptr[2]"},
        PrefillCase{"KvIndptrSize", [](F& f) { f.kv_indptr = {0, 3}; f.Rebind(); }, kInvalid,
                    "kv_indptr"},
        PrefillCase{"KvIndptrStart", [](F& f) { f.kv_indptr = {1, 2, 3}; f.Rebind(); },
                    kInvalid, "kv_indptr[0]"},
        PrefillCase{"KvIndptrDecreasing", [](F& f) { f.kv_indptr = {0, 3, 2}; f.Rebind(); },
                    kInvalid, "kv_indptr[2]"},
        PrefillCase{"KvIndptrEnd", [](F& f) { f.kv_indptr = {0, 2, 2}; f.Rebind(); },
                    kInvalid, "kv_indptr[2]"},
        PrefillCase{"KvIndicesOverLimit",
                    [](F& f) {
                      f.kv_indices.assign(33, 0);
                      f.kv_indptr = {0, 2, 33};
                      f.Rebind();
                    },
                    kInvalid, "kv_indices"},
        PrefillCase{"KvIndexNegative", [](F& f) { f.kv_indices[1] = -1; f.Rebind(); },
                    kInvalid, "kv_indices[1]=-1"},
        PrefillCase{"KvIndexTooLarge", [](F& f) { f.kv_indices[2] = 10; f.Rebind(); },
                    kInvalid, "kv_indices[2]=10"},
        PrefillCase{"LastPageLenSize", [](F& f) { f.kv_last_page_len = {4}; f.Rebind(); },
                    kInvalid, "kv_last_page_len"},
        PrefillCase{"LastPageLenMissing", [](F& f) { f.kv_last_page_len = {}; f.Rebind(); },
                    kInvalid, "kv_last_page_len"},
        PrefillCase{"LastPageLenZero", [](F& f) { f.kv_last_page_len[1] = 0; f.Rebind(); },
                    kInvalid, "kv_last_page_len[1]=0"},
        PrefillCase{"LastPageLenOverPage",
                    [](F& f) { f.kv_last_page_len[0] = 17; f.Rebind(); }, kInvalid,
                    "kv_last_page_len[0]=17"},
        PrefillCase{"LastPageLenNegativeWithoutPages",
                    [](F& f) {
                      f.kv_indptr = {0, 3, 3};
                      f.kv_last_page_len = {4, -1};
                      f.Rebind();
                    },
                    kInvalid, "kv_last_page_len[1]=-1"},
        PrefillCase{"SmScaleNaN",
                    [](F& f) { f.call.sm_scale = std::numeric_limits<float>::quiet_NaN(); },
                    kInvalid, "sm_scale"},
        PrefillCase{"SmScaleInf",
                    [](F& f) { f.call.sm_scale = std::numeric_limits<float>::infinity(); },
                    kInvalid, "sm_scale"},
        PrefillCase{"LseBase", [](F& f) { f.call.lse_base = 2; }, kInvalid, "lse_base"},
        PrefillCase{"AppendSlotTooLarge",
                    [](F& f) { f.append_slots[1] = 10 * 16; f.Rebind(); }, kInvalid,
                    "append_slots[1]=160"},
        PrefillCase{"AppendSlotNegative", [](F& f) { f.append_slots[0] = -3; f.Rebind(); },
                    kInvalid, "append_slots[0]=-3"},
        PrefillCase{"AppendSlotRepeated",
                    [](F& f) { f.append_slots[1] = f.append_slots[0]; f.Rebind(); }, kInvalid,
                    "append_slots[1]"},
        PrefillCase{"AppendSlotsOverLimit",
                    [](F& f) {
                      f.append_slots.assign(65, 0);
                      f.Rebind();
                    },
                    kInvalid, "append_slots"},
        PrefillCase{"AppendKMissing", [](F& f) { f.call.append_k = {}; }, kInvalid,
                    "append_k"},
        PrefillCase{"AppendKShape", [](F& f) { f.call.append_k.shape = {2, 4, 32}; },
                    kInvalid, "append_k.shape[1]"},
        PrefillCase{"AppendKDType", [](F& f) { f.call.append_k.dtype = TensorDType::kFp32; }, kInvalid,
                    "append_k.dtype"},
        PrefillCase{"AppendVData",
                    [](F& f) { f.call.append_v.data = absl::string_view(f.v_bytes).substr(1); },
                    kInvalid, "append_v.data"},
        PrefillCase{"AppendRowsWithoutSlots", [](F& f) { f.call.append_slots = {}; },
                    kInvalid, "append_k.shape[0]"},
        // 65 empty sequences (the limit is max_request_rows = 64): refused
        // before anything is sized by their count.
        PrefillCase{"TooManySequences",
                    [](F& f) {
                      static const std::vector<int32_t> kMany = [] {
                        std::vector<int32_t> v(66, 0);
                        v.back() = 8;
                        return v;
                      }();
                      f.call.qo_indptr = kMany;
                    },
                    kInvalid, "qo_indptr has 66 entries: at most 65"}),
    [](const ::testing::TestParamInfo<PrefillCase>& info) { return info.param.name; });

// A response over max_message_bytes is RESOURCE_EXHAUSTED, one byte under is fine.
TEST(ValidatePrefillTest, ResponseSizeUsesMaxMessageBytes) {
  PrefillFixture f;
  RequestLimits limits = Limits();
  limits.max_message_bytes = 8 * 4 * 64 * 2 + 8 * 4 * 4 - 1;  // one byte short
  auto v = ValidatePrefill(f.call, f.geo, limits, kIncarnation);
  EXPECT_EQ(v.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(std::string(v.status().message()), HasSubstr("max_message_bytes"));
  limits.max_message_bytes += 1;
  EXPECT_TRUE(ValidatePrefill(f.call, f.geo, limits, kIncarnation).ok());
}

// ------------------------------------------------------------ WriteKV / ReadKV

struct KvFixture {
  KvGeometry geo = Geo();
  std::vector<int64_t> slots{0, 17, 159, 16};
  std::string k_bytes = Bytes(4 * 2 * 64 * 2), v_bytes = Bytes(4 * 2 * 64 * 2);
  TensorView k{TensorDType::kBf16, {4, 2, 64}, k_bytes}, v{TensorDType::kBf16, {4, 2, 64}, v_bytes};
  int32_t layer = 0;
  RequestLimits limits = Limits();
  absl::StatusOr<std::vector<int32_t>> Write() const {
    return ValidateKvRows(layer, slots, &k, &v, geo, limits);
  }
  absl::StatusOr<std::vector<int32_t>> Read() const {
    return ValidateKvRows(layer, slots, nullptr, nullptr, geo, limits);
  }
};

TEST(ValidateKvTest, ValidWriteAndReadReturnTheirPages) {
  KvFixture f;
  auto w = f.Write();
  ASSERT_TRUE(w.ok()) << w.status();
  EXPECT_EQ(*w, (std::vector<int32_t>{0, 1, 9, 1}));  // each slot's page, in order
  auto r = f.Read();
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(*r, (std::vector<int32_t>{0, 1, 9, 1}));
}

struct KvCase {
  std::string name;
  std::function<void(KvFixture&)> mutate;
  bool read;  // ReadKV (else WriteKV)
  absl::StatusCode code;
  std::string field;
};

void PrintTo(const KvCase& c, std::ostream* os) { *os << c.name; }

class ValidateKvFieldTest : public ::testing::TestWithParam<KvCase> {};

TEST_P(ValidateKvFieldTest, RejectsWithCodeNamingTheField) {
  const KvCase& c = GetParam();
  KvFixture f;
  c.mutate(f);
  auto r = c.read ? f.Read() : f.Write();
  ASSERT_FALSE(r.ok()) << c.name << " was accepted";
  EXPECT_EQ(r.status().code(), c.code) << r.status();
  EXPECT_THAT(std::string(r.status().message()), HasSubstr(c.field));
}

INSTANTIATE_TEST_SUITE_P(
    Fields, ValidateKvFieldTest,
    ::testing::Values(
        KvCase{"WriteLayer", [](KvFixture& f) { f.layer = 2; }, false, kInvalid, "layer=2"},
        KvCase{"WriteLayerNegative", [](KvFixture& f) { f.layer = -5; }, false, kInvalid,
               "layer=-5"},
        KvCase{"WriteSlotTooLarge", [](KvFixture& f) { f.slots[2] = 160; }, false, kInvalid,
               "slots[2]=160"},
        KvCase{"WriteSlotNegative", [](KvFixture& f) { f.slots[0] = -1; }, false, kInvalid,
               "slots[0]=-1"},
        KvCase{"WriteSlotRepeated", [](KvFixture& f) { f.slots[3] = 17; }, false, kInvalid,
               "slots[3]=17"},
        KvCase{"WriteSlotsOverLimit", [](KvFixture& f) { f.limits.max_request_rows = 3; },
               false, kInvalid, "slots"},
        KvCase{"WriteKDType", [](KvFixture& f) { f.k.dtype = TensorDType::kFp16; }, false, kInvalid,
               "k.dtype"},
        KvCase{"WriteKRows", [](KvFixture& f) { f.k.shape[0] = 3; }, false, kInvalid,
               "k.shape[0]"},
        KvCase{"WriteKHeads", [](KvFixture& f) { f.k.shape[1] = 4; }, false, kInvalid,
               "k.shape[1]"},
        KvCase{"WriteKRank", [](KvFixture& f) { f.k.shape = {4, 128}; }, false, kInvalid,
               "k.shape"},
        KvCase{"WriteKData", [](KvFixture& f) { f.k.data = f.k.data.substr(2); }, false,
               kInvalid, "k.data"},
        KvCase{"WriteVHeadDim", [](KvFixture& f) { f.v.shape[2] = 32; }, false, kInvalid,
               "v.shape[2]"},
        KvCase{"WriteVData", [](KvFixture& f) { f.v.data = f.v.data.substr(0, 10); }, false,
               kInvalid, "v.data"},
        KvCase{"ReadLayer", [](KvFixture& f) { f.layer = 7; }, true, kInvalid, "layer=7"},
        KvCase{"ReadSlotTooLarge", [](KvFixture& f) { f.slots[1] = 1 << 20; }, true, kInvalid,
               "slots[1]"},
        KvCase{"ReadSlotRepeated", [](KvFixture& f) { f.slots[2] = 0; }, true, kInvalid,
               "slots[2]=0"},
        KvCase{"ReadResponseTooLarge", [](KvFixture& f) { f.limits.max_message_bytes = 1000; },
               true, absl::StatusCode::kResourceExhausted, "max_message_bytes"}),
    [](const ::testing::TestParamInfo<KvCase>& info) { return info.param.name; });

// ------------------------------------------------------------ MergeStates

struct MergeFixture {
  KvGeometry geo = Geo();
  RequestLimits limits = Limits();
  std::vector<std::string> v_bytes, lse_bytes;
  MergeStatesCall call;
  // Three states of (n=3, h=2, d=8).
  MergeFixture() {
    for (int i = 0; i < 3; ++i) {
      v_bytes.push_back(Bytes(3 * 2 * 8 * 2));
      std::vector<float> lse(6, 1.5f);
      lse[i] = -std::numeric_limits<float>::infinity();
      std::string b(6 * 4, '\0');
      std::memcpy(b.data(), lse.data(), b.size());
      lse_bytes.push_back(b);
    }
    for (int i = 0; i < 3; ++i) {
      call.v.push_back({TensorDType::kBf16, {3, 2, 8}, v_bytes[i]});
      call.lse.push_back({TensorDType::kFp32, {3, 2}, lse_bytes[i]});
    }
  }
  void SetLse(int state, int index, float value) {
    std::memcpy(lse_bytes[state].data() + 4 * index, &value, 4);
  }
  absl::StatusOr<MergeShape> Validate() const { return ValidateMerge(call, geo, limits); }
};

TEST(ValidateMergeTest, ValidStatesWithMinusInfGiveTheShape) {
  MergeFixture f;
  auto s = f.Validate();
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_EQ(s->n, 3);
  EXPECT_EQ(s->h, 2);
  EXPECT_EQ(s->d, 8);
}

struct MergeCase {
  std::string name;
  std::function<void(MergeFixture&)> mutate;
  absl::StatusCode code;
  std::string field;
};

void PrintTo(const MergeCase& c, std::ostream* os) { *os << c.name; }

class ValidateMergeFieldTest : public ::testing::TestWithParam<MergeCase> {};

TEST_P(ValidateMergeFieldTest, RejectsWithCodeNamingTheField) {
  const MergeCase& c = GetParam();
  MergeFixture f;
  c.mutate(f);
  auto s = f.Validate();
  ASSERT_FALSE(s.ok()) << c.name << " was accepted";
  EXPECT_EQ(s.status().code(), c.code) << s.status();
  EXPECT_THAT(std::string(s.status().message()), HasSubstr(c.field));
}

INSTANTIATE_TEST_SUITE_P(
    Fields, ValidateMergeFieldTest,
    ::testing::Values(
        MergeCase{"NoStates",
                  [](MergeFixture& f) {
                    f.call.v.clear();
                    f.call.lse.clear();
                  },
                  kInvalid, "states"},
        MergeCase{"LseBase", [](MergeFixture& f) { f.call.lse_base = 5; }, kInvalid,
                  "lse_base"},
        MergeCase{"FirstVRank", [](MergeFixture& f) { f.call.v[0].shape = {3, 16}; }, kInvalid,
                  "states[0].v.shape"},
        MergeCase{"FirstVHeadsZero", [](MergeFixture& f) { f.call.v[0].shape = {3, 0, 8}; },
                  kInvalid, "states[0].v.shape"},
        MergeCase{"FirstVDimTooLarge",
                  [](MergeFixture& f) { f.call.v[0].shape = {3, 2, 2048}; }, kInvalid,
                  "states[0].v.shape"},
        MergeCase{"FirstVTokensNegative",
                  [](MergeFixture& f) { f.call.v[0].shape = {-1, 2, 8}; }, kInvalid,
                  "states[0].v.shape"},
        // n * h * d * 2 wraps around int64 to exactly the bytes sent: must not pass.
        MergeCase{"TokensOverflow",
                  [](MergeFixture& f) {
                    const int64_t n = (int64_t{1} << 53) + 1;
                    f.v_bytes.assign(3, Bytes(4096));
                    f.lse_bytes.assign(3, std::string(4096, '\0'));
                    for (int i = 0; i < 3; ++i) {
                      f.call.v[i] = {TensorDType::kBf16, {n, 1024, 2}, f.v_bytes[i]};
                      f.call.lse[i] = {TensorDType::kFp32, {n, 1024}, f.lse_bytes[i]};
                    }
                  },
                  kInvalid, "states[0].v.shape"},
        MergeCase{"LaterVShape", [](MergeFixture& f) { f.call.v[2].shape = {3, 2, 4}; },
                  kInvalid, "states[2].v.shape[2]"},
        MergeCase{"LaterVDType", [](MergeFixture& f) { f.call.v[1].dtype = TensorDType::kFp16; }, kInvalid,
                  "states[1].v.dtype"},
        MergeCase{"VData",
                  [](MergeFixture& f) {
                    f.call.v[1].data = absl::string_view(f.v_bytes[1]).substr(2);
                  },
                  kInvalid, "states[1].v.data"},
        MergeCase{"LseDType", [](MergeFixture& f) { f.call.lse[0].dtype = TensorDType::kBf16; }, kInvalid,
                  "states[0].lse.dtype"},
        MergeCase{"LseShape", [](MergeFixture& f) { f.call.lse[2].shape = {2, 3}; }, kInvalid,
                  "states[2].lse.shape[0]"},
        MergeCase{"LseData",
                  [](MergeFixture& f) {
                    f.call.lse[1].data = absl::string_view(f.lse_bytes[1]).substr(4);
                  },
                  kInvalid, "states[1].lse.data"},
        MergeCase{"LseNaN",
                  [](MergeFixture& f) {
                    f.SetLse(1, 4, std::numeric_limits<float>::quiet_NaN());
                  },
                  kInvalid, "states[1].lse[4]"},
        MergeCase{"LsePlusInf",
                  [](MergeFixture& f) {
                    f.SetLse(2, 5, std::numeric_limits<float>::infinity());
                  },
                  kInvalid, "states[2].lse[5]"},
        MergeCase{"ResponseTooLarge", [](MergeFixture& f) { f.limits.max_message_bytes = 100; },
                  absl::StatusCode::kResourceExhausted, "max_message_bytes"}),
    [](const ::testing::TestParamInfo<MergeCase>& info) { return info.param.name; });

}  // namespace
}  // namespace attnserve
