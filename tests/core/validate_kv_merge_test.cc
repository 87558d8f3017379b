// Validation of WriteKV, ReadKV and MergeStates: one case per malformed
// field, each asserting the code and that the message names the field; and
// what a valid request turns into.
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
        KvCase{"WriteVUnset", [](KvFixture& f) { f.v = TensorView{}; }, false, kInvalid,
               "v is unset: this GQA server takes K rows in k and V rows in v"},
        KvCase{"WriteKUnset", [](KvFixture& f) { f.k = TensorView{}; }, false, kInvalid,
               "k is unset: must be a DTYPE_BF16 tensor of shape [4, 2, 64]"},
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

// An MLA geometry (one latent pool): the rows are k alone, v must be unset,
// and a GQA-shaped k is refused naming k.shape.
TEST(ValidateKvTest, MlaWritesTakeTheLatentRowsAlone) {
  KvFixture f;
  f.geo.attention = AttentionKind::kMla;
  f.geo.num_kv_heads = 1;
  f.geo.kv_lora_rank = 64;
  f.geo.qk_rope_head_dim = 16;
  f.geo.head_dim = 80;
  const std::string latent = Bytes(4 * 80 * 2);
  f.k = TensorView{TensorDType::kBf16, {4, 1, 80}, latent};
  auto with_v = f.Write();
  ASSERT_FALSE(with_v.ok());
  EXPECT_EQ(with_v.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(with_v.status().message()), HasSubstr("v must be unset"));
  f.v = TensorView{};
  auto ok = f.Write();
  ASSERT_TRUE(ok.ok()) << ok.status();
  EXPECT_EQ(*ok, (std::vector<int32_t>{0, 1, 9, 1}));
  f.k = TensorView{TensorDType::kBf16, {4, 2, 64}, f.k_bytes};
  auto gqa_rows = f.Write();
  ASSERT_FALSE(gqa_rows.ok());
  EXPECT_THAT(std::string(gqa_rows.status().message()), HasSubstr("k.shape"));
  auto read = f.Read();
  ASSERT_TRUE(read.ok()) << read.status();
}

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
}  // namespace validate_test
}  // namespace attnserve
