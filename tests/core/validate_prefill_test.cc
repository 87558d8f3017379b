// Validation of Prefill: one case per malformed field, each asserting the
// code and that the message names the field; and what a valid request turns
// into.
#include "server/core/validate.h"

#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/core/validate_test_util.h"

namespace attnserve {
namespace validate_test {
namespace {

// A valid Prefill: 2 sequences (5 rows over 2 pages with 20 tokens; 3 rows
// over 1 page with 7 tokens) and a fused append of 2 rows into page 9. The
// struct owns every buffer the call's views point into.
struct PrefillFixture {
  KvGeometry geo = Geo();
  std::string q_bytes, k_bytes, v_bytes;
  std::vector<int32_t> qo_indptr{0, 5, 8}, kv_indptr{0, 2, 3}, kv_indices{4, 1, 7},
      kv_last_page_len{4, 7};
  std::vector<int64_t> append_slots{9 * 16 + 3, 9 * 16};
  std::vector<int32_t> kv_keys_after;  // none: every causal_shift 0
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
    call.kv_keys_after = kv_keys_after;
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
    EXPECT_EQ(s.causal_shift, 0) << "no kv_keys_after: bottom-right";
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

TEST(ValidatePrefillTest, KvKeysAfterBecomesTheCausalShift) {
  PrefillFixture f;
  // Sequence 0 holds 20 keys of a longer sequence, 5 more of which follow
  // elsewhere; the largest shift keeps the whole length within int32.
  f.kv_keys_after = {5, INT32_MAX - 7};
  f.Rebind();
  auto v = f.Validate();
  ASSERT_TRUE(v.ok()) << v.status();
  EXPECT_EQ(v->task.seqs[0].causal_shift, 5);
  EXPECT_EQ(v->task.seqs[1].causal_shift, INT32_MAX - 7);
  // A plan carries it: a CreatePlan layout with kv_keys_after.
  const PrefillLayout layout{f.qo_indptr, f.kv_indptr, f.kv_indices, f.kv_last_page_len,
                             f.append_slots, f.kv_keys_after};
  auto plan = ValidatePlanLayout(layout, f.geo, Limits());
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_EQ(plan->seqs[0].causal_shift, 5);
  // ...and a Prefill naming the plan gets it from there, and must not send its own.
  PrefillFixture planned;
  planned.call.qo_indptr = {};
  planned.call.kv_indptr = {};
  planned.call.kv_indices = {};
  planned.call.kv_last_page_len = {};
  planned.call.append_slots = {};
  planned.call.plan_id = 1;
  auto run = ValidatePlannedPrefill(planned.call, *plan, f.kv_indices.data(),
                                    f.append_slots.data(), f.geo, Limits(), kIncarnation);
  ASSERT_TRUE(run.ok()) << run.status();
  EXPECT_EQ(run->task.seqs[0].causal_shift, 5);
  EXPECT_EQ(run->task.seqs[1].causal_shift, INT32_MAX - 7);
  const std::vector<int32_t> own = {1, 1};
  planned.call.kv_keys_after = own;
  auto refused = ValidatePlannedPrefill(planned.call, *plan, f.kv_indices.data(),
                                        f.append_slots.data(), f.geo, Limits(), kIncarnation);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(refused.status().message()), HasSubstr("kv_keys_after"));
  // The plan's layout is checked like a Prefill's.
  const std::vector<int32_t> bad = {0, -2};
  const PrefillLayout bad_layout{f.qo_indptr, f.kv_indptr, f.kv_indices, f.kv_last_page_len,
                                 f.append_slots, bad};
  auto bad_plan = ValidatePlanLayout(bad_layout, f.geo, Limits());
  EXPECT_EQ(bad_plan.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(bad_plan.status().message()),
              HasSubstr("kv_keys_after[1]=-2 out of range [0, 2147483640]"));
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
        PrefillCase{"KvKeysAfterSize", [](F& f) { f.kv_keys_after = {3}; f.Rebind(); },
                    kInvalid, "kv_keys_after has 1 entries, must have batch = 2"},
        PrefillCase{"KvKeysAfterNegative",
                    [](F& f) { f.kv_keys_after = {0, -1}; f.Rebind(); }, kInvalid,
                    "kv_keys_after[1]=-1 out of range [0, 2147483640]"},
        // Sequence 0 has 20 keys: 20 + 2147483628 > 2^31 - 1.
        PrefillCase{"KvKeysAfterPastInt32",
                    [](F& f) { f.kv_keys_after = {INT32_MAX - 19, 0}; f.Rebind(); },
                    kInvalid, "kv_keys_after[0]=2147483628 out of range [0, 2147483627]"},
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

}  // namespace
}  // namespace validate_test
}  // namespace attnserve
