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
  std::vector<float> sinks;            // options.sinks
  bool apply_sinks[3] = {true, true, true};
  size_t num_apply_sinks = 0;          // none: the sinks enter every sequence
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
    call.options.sinks = sinks;
    call.apply_sinks = absl::MakeConstSpan(apply_sinks, num_apply_sinks);
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
                                    f.append_slots.data(), PlanOptions{}, f.geo, Limits(),
                                    kIncarnation);
  ASSERT_TRUE(run.ok()) << run.status();
  EXPECT_EQ(run->task.seqs[0].causal_shift, 5);
  EXPECT_EQ(run->task.seqs[1].causal_shift, INT32_MAX - 7);
  const std::vector<int32_t> own = {1, 1};
  planned.call.kv_keys_after = own;
  auto refused = ValidatePlannedPrefill(planned.call, *plan, f.kv_indices.data(),
                                        f.append_slots.data(), PlanOptions{}, f.geo, Limits(),
                                        kIncarnation);
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

// The options land in every sequence; the sinks stay in the request, each
// sequence naming the task's one set (sink_index 0) where apply_sinks lets
// them in.
TEST(ValidatePrefillTest, OptionsBecomeSequenceSettings) {
  PrefillFixture f;
  f.sinks = {0.5f, -std::numeric_limits<float>::infinity(), 3.f, -1e30f};
  f.Rebind();
  f.call.options.window_left = 7;
  f.call.options.logits_soft_cap = 30.f;
  auto v = f.Validate();
  ASSERT_TRUE(v.ok()) << v.status();
  EXPECT_EQ(v->task.sinks, f.sinks.data());
  for (const PrefillSeq& s : v->task.seqs) {
    EXPECT_EQ(s.window_left, 7);
    EXPECT_EQ(s.soft_cap, 30.f);
    EXPECT_EQ(s.sink_index, 0);
  }
  f.apply_sinks[0] = false;
  f.num_apply_sinks = 2;
  f.Rebind();
  v = f.Validate();
  ASSERT_TRUE(v.ok()) << v.status();
  EXPECT_EQ(v->task.seqs[0].sink_index, -1);
  EXPECT_EQ(v->task.seqs[1].sink_index, 0);
  // No sinks: no sequence names a set, whatever apply_sinks says; the
  // defaults are no window and no soft-cap.
  f.sinks.clear();
  f.Rebind();
  f.call.options = {};
  v = f.Validate();
  ASSERT_TRUE(v.ok()) << v.status();
  EXPECT_EQ(v->task.sinks, nullptr);
  for (const PrefillSeq& s : v->task.seqs) {
    EXPECT_EQ(s.sink_index, -1);
    EXPECT_EQ(s.window_left, -1);
    EXPECT_EQ(s.soft_cap, 0.f);
  }
}

// A plan's options: per layer (replacing its options whole for that layer),
// filling what a Prefill leaves unset; a Prefill that sets one differently
// is refused naming the field.
TEST(ValidatePrefillTest, PlanOptionsFillAndMustAgree) {
  PrefillFixture f;
  const PrefillLayout fields{f.qo_indptr,        f.kv_indptr,    f.kv_indices,
                             f.kv_last_page_len, f.append_slots, f.kv_keys_after};
  auto plan = ValidatePlanLayout(fields, f.geo, Limits());
  ASSERT_TRUE(plan.ok()) << plan.status();
  const std::vector<float> plan_sinks = {1.f, 2.f, 3.f, 4.f};
  PlanOptionsView view;
  view.all.logits_soft_cap = 50.f;
  AttentionOptionsView layer1;
  layer1.window_left = 128;
  layer1.sinks = plan_sinks;
  view.layers.emplace_back(1, layer1);
  auto options = ValidatePlanOptions(view, f.geo);
  ASSERT_TRUE(options.ok()) << options.status();

  PrefillFixture planned;
  planned.call.qo_indptr = {};
  planned.call.kv_indptr = {};
  planned.call.kv_indices = {};
  planned.call.kv_last_page_len = {};
  planned.call.append_slots = {};
  planned.call.plan_id = 1;
  auto run = [&] {
    return ValidatePlannedPrefill(planned.call, *plan, f.kv_indices.data(),
                                  f.append_slots.data(), *options, f.geo, Limits(), kIncarnation);
  };
  // Layer 1: its entry, whole (no soft-cap there).
  auto v = run();
  ASSERT_TRUE(v.ok()) << v.status();
  EXPECT_EQ(v->task.seqs[0].window_left, 128);
  EXPECT_EQ(v->task.seqs[0].soft_cap, 0.f);
  EXPECT_EQ(v->task.seqs[0].sink_index, 0);
  EXPECT_NE(v->task.sinks, nullptr);
  EXPECT_EQ(v->task.sinks[3], 4.f);
  // Layer 0: the plan's options; the Prefill adds a window and sinks.
  planned.call.layer = 0;
  planned.call.options.window_left = 3;
  v = run();
  ASSERT_TRUE(v.ok()) << v.status();
  EXPECT_EQ(v->task.seqs[1].window_left, 3);
  EXPECT_EQ(v->task.seqs[1].soft_cap, 50.f);
  EXPECT_EQ(v->task.sinks, nullptr);
  // Setting what the plan sets: the same value is fine, another is refused.
  planned.call.options.logits_soft_cap = 50.f;
  EXPECT_TRUE(run().ok());
  planned.call.options.logits_soft_cap = 0.f;
  EXPECT_EQ(run().status().code(), kInvalid);
  EXPECT_THAT(std::string(run().status().message()),
              HasSubstr("options.logits_soft_cap=0 contradicts the plan's logits_soft_cap=50 "
                        "for layer 0"));
  planned.call.layer = 1;
  planned.call.options = {};
  planned.call.options.window_left = 127;
  EXPECT_THAT(std::string(run().status().message()),
              HasSubstr("options.window_left=127 contradicts the plan's window_left=128"));
  planned.call.options = {};
  const std::vector<float> other = {1.f, 2.f, 3.5f, 4.f};
  planned.call.options.sinks = other;
  EXPECT_THAT(std::string(run().status().message()),
              HasSubstr("options.sinks[2]=3.5 contradicts the plan's sinks[2]=3 for layer 1"));
  planned.call.options.sinks = plan_sinks;
  EXPECT_TRUE(run().ok());
  // A planned Prefill's own options are checked too; apply_sinks is the plan's.
  planned.call.options.window_left = -5;
  EXPECT_THAT(std::string(run().status().message()), HasSubstr("options.window_left=-5"));
  planned.call.options = {};
  const bool apply[2] = {true, false};
  planned.call.apply_sinks = apply;
  EXPECT_THAT(std::string(run().status().message()), HasSubstr("apply_sinks"));
}

TEST(ValidatePrefillTest, PlanOptionsAreValidated) {
  const KvGeometry geo = Geo();
  PlanOptionsView view;
  view.layers.emplace_back(2, AttentionOptionsView{});
  EXPECT_THAT(std::string(ValidatePlanOptions(view, geo).status().message()),
              HasSubstr("layer_options has key 2 out of range [0, 2) (num_layers)"));
  view.layers = {{1, AttentionOptionsView{}}};
  view.layers[0].second.logits_soft_cap = -3.f;
  EXPECT_THAT(std::string(ValidatePlanOptions(view, geo).status().message()),
              HasSubstr("layer_options[1].logits_soft_cap=-3"));
  view.layers.clear();
  const std::vector<float> three = {1.f, 2.f, 3.f};
  view.all.sinks = three;
  EXPECT_THAT(std::string(ValidatePlanOptions(view, geo).status().message()),
              HasSubstr("options.sinks has 3 entries, must have num_qo_heads = 4"));
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
  // Sequences 0 and 2 have no query rows: the task keeps 1 and 3 (their
  // request numbers in seq_numbers); every page is still pinned.
  ASSERT_EQ(v->task.seqs.size(), 2u);
  EXPECT_EQ(v->task.seq_numbers, (std::vector<int32_t>{1, 3}));
  EXPECT_EQ(v->task.seqs[0].q_start, 0);
  EXPECT_EQ(v->task.seqs[0].q_len, 4);
  EXPECT_EQ(v->task.seqs[0].kv_len, 0);
  EXPECT_EQ(v->task.seqs[1].q_start, 4);
  EXPECT_EQ(v->task.seqs[1].q_len, 4);
  EXPECT_EQ(v->task.seqs[1].kv_start, 4);
  EXPECT_EQ(v->task.seqs[1].kv_len, 0);
  EXPECT_EQ(v->task.num_append, 0);
  EXPECT_EQ(v->pages, (std::vector<int32_t>{3, 3, 0, 3}));
  // Without empty sequences the task keeps every one, numbered as sent.
  PrefillFixture full;
  auto fv = full.Validate();
  ASSERT_TRUE(fv.ok()) << fv.status();
  EXPECT_EQ(fv->task.seqs.size(), 2u);
  EXPECT_TRUE(fv->task.seq_numbers.empty());
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

TEST(ValidatePrefillTest, ASequenceMayHoldEveryRowOfALayer) {
  // 10 pages of 16 rows: a sequence of 10 page ids with a full last page
  // has 160 keys, the most a layer holds (here with a page repeated, as a
  // shared prefix may list its pages in several sequences).
  PrefillFixture f;
  f.kv_indptr = {0, 2, 12};
  f.kv_indices = {4, 1, 0, 1, 2, 3, 4, 5, 6, 7, 8, 8};
  f.kv_last_page_len = {4, 16};
  f.Rebind();
  auto v = f.Validate();
  ASSERT_TRUE(v.ok()) << v.status();
  EXPECT_EQ(v->task.seqs[1].kv_len, 160);
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
        PrefillCase{"SmScaleHuge", [](F& f) { f.call.sm_scale = -3.4e38f; }, kInvalid,
                    "sm_scale=-3.4e+38 must be finite with |sm_scale| <= 1e+30"},
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
        // 10 pages of 16 rows: a sequence of 11 page ids (167 keys) must
        // repeat one.
        PrefillCase{"SequencePastTheCache",
                    [](F& f) {
                      f.kv_indptr = {0, 2, 13};
                      f.kv_indices = {4, 1, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7};
                      f.Rebind();
                    },
                    kInvalid,
                    "sequence 1 has 167 KV tokens (11 kv_indices), more than the cache's "
                    "num_pages x page_size = 160 rows a layer: its kv_indices must repeat a page"},
        PrefillCase{"ApplySinksSize",
                    [](F& f) {
                      f.num_apply_sinks = 3;
                      f.Rebind();
                    },
                    kInvalid, "apply_sinks has 3 entries, must have batch = 2"},
        PrefillCase{"WindowBelowMinusOne", [](F& f) { f.call.options.window_left = -2; },
                    kInvalid, "options.window_left=-2 out of range [-1, 2147483647]"},
        PrefillCase{"SoftCapNaN",
                    [](F& f) {
                      f.call.options.logits_soft_cap = std::numeric_limits<float>::quiet_NaN();
                    },
                    kInvalid, "options.logits_soft_cap=nan must be 0 (no soft-cap) or in [1e-30, 1e+30]"},
        PrefillCase{"SoftCapNegative", [](F& f) { f.call.options.logits_soft_cap = -1.f; },
                    kInvalid, "options.logits_soft_cap=-1 must be 0 (no soft-cap) or in [1e-30, 1e+30]"},
        PrefillCase{"SoftCapSubnormal", [](F& f) { f.call.options.logits_soft_cap = 1e-31f; },
                    kInvalid, "options.logits_soft_cap=1e-31 must be 0 (no soft-cap) or in [1e-30, 1e+30]"},
        PrefillCase{"SoftCapPastItsBound", [](F& f) { f.call.options.logits_soft_cap = 2.4e38f; },
                    kInvalid, "options.logits_soft_cap=2.4e+38 must be 0 (no soft-cap) or in [1e-30, 1e+30]"},
        PrefillCase{"SoftCapInf",
                    [](F& f) {
                      f.call.options.logits_soft_cap = std::numeric_limits<float>::infinity();
                    },
                    kInvalid, "options.logits_soft_cap=inf"},
        PrefillCase{"SinksTooFew",
                    [](F& f) {
                      f.sinks = {0.f, 1.f, 2.f};
                      f.Rebind();
                    },
                    kInvalid, "options.sinks has 3 entries, must have num_qo_heads = 4"},
        PrefillCase{"SinksTooMany",
                    [](F& f) {
                      f.sinks.assign(8, 0.f);
                      f.Rebind();
                    },
                    kInvalid, "options.sinks has 8 entries"},
        PrefillCase{"SinkNaN",
                    [](F& f) {
                      f.sinks = {0.f, std::numeric_limits<float>::quiet_NaN(), 0.f, 0.f};
                      f.Rebind();
                    },
                    kInvalid, "options.sinks[1]=nan must be -inf (none) or finite"},
        PrefillCase{"SinkPlusInf",
                    [](F& f) {
                      f.sinks = {0.f, 0.f, std::numeric_limits<float>::infinity(), 0.f};
                      f.Rebind();
                    },
                    kInvalid, "options.sinks[2]=inf"},
        PrefillCase{"SinkHuge",
                    [](F& f) {
                      f.sinks = {0.f, 0.f, 0.f, -2e30f};
                      f.Rebind();
                    },
                    kInvalid, "options.sinks[3]=-2e+30"},
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
// Append tensors sent with no append rows are checked as with rows: a
// GQA server takes [0, H, D] K and V of its dtype and refuses another dtype
// or V missing; an MLA server refuses any append_v, as WriteKV refuses v.
TEST(ValidatePrefillTest, EmptyAppendTensorsAreCheckedWithoutAppendRows) {
  PrefillFixture f;
  f.append_slots.clear();
  f.k_bytes.clear();
  f.v_bytes.clear();
  f.Rebind();
  f.call.append_k.shape = {0, 2, 64};
  f.call.append_v.shape = {0, 2, 64};
  EXPECT_TRUE(f.Validate().ok()) << f.Validate().status();
  f.call.append_v = {};
  auto no_v = f.Validate();
  ASSERT_FALSE(no_v.ok());
  EXPECT_THAT(std::string(no_v.status().message()), HasSubstr("append_v is unset"));
  f.call.append_v = {TensorDType::kFp32, {0, 2, 64}, {}};
  auto fp32 = f.Validate();
  ASSERT_FALSE(fp32.ok());
  EXPECT_THAT(std::string(fp32.status().message()), HasSubstr("append_v"));

  PrefillFixture m;
  m.geo.attention = AttentionKind::kMla;
  m.geo.num_kv_heads = 1;
  m.geo.kv_lora_rank = 48;
  m.geo.qk_rope_head_dim = 16;
  m.geo.head_dim = 64;
  m.append_slots.clear();
  m.k_bytes.clear();
  m.v_bytes.clear();
  m.Rebind();
  m.call.append_k = {};
  m.call.append_v = {};
  EXPECT_TRUE(m.Validate().ok()) << m.Validate().status();
  for (const TensorView& v : {TensorView{TensorDType::kBf16, {0, 1, 64}, {}}, TensorView{TensorDType::kBf16, {}, {}}}) {
    m.call.append_v = v;
    auto with_v = m.Validate();
    ASSERT_FALSE(with_v.ok());
    EXPECT_EQ(with_v.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(std::string(with_v.status().message()), HasSubstr("append_v must be unset"));
  }
}

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
