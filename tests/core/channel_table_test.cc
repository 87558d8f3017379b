// ChannelTable (server/core/channel_table.h): the ring header's checks, each
// naming the field and its bound; a CUDA region, another tenant's region or
// channel, the per-tenant cap; and the lifetime rules: a channel holds its
// region's mapping without keeping the region from being unregistered or
// reclaimed, and a region that goes closes its channels.
#include "server/core/channel_table.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/channel_layout.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/core/test_shm.h"

namespace attnserve {
namespace {

using ::testing::HasSubstr;

// A zeroed sealed memfd of `bytes` bytes.
using Shm = TestShm;

void WriteHeader(char* at, uint32_t slot_count, uint32_t slot_bytes,
                 uint32_t magic = kChannelMagic, uint32_t version = kChannelVersion) {
  auto* h = reinterpret_cast<ChannelHeader*>(at);
  h->magic = magic;
  h->version = version;
  h->slot_count = slot_count;
  h->slot_bytes = slot_bytes;
}

RegionRefView Ref(absl::string_view name, int64_t offset, int64_t bytes) {
  RegionRefView ref;
  ref.set = true;
  ref.name = name;
  ref.offset = offset;
  ref.byte_size = bytes;
  return ref;
}

RegionSpec System(const std::string& name, const std::string& token, int64_t bytes) {
  RegionSpec spec;
  spec.name = name;
  spec.claim_token = token;
  spec.byte_size = bytes;
  return spec;
}

RegionLimits On() {
  RegionLimits limits;
  limits.enabled = true;
  limits.max_regions_per_tenant = 8;
  limits.max_bytes_per_tenant = int64_t{1} << 30;
  return limits;
}

// An endpoint that counts its closes.
class FakeEndpoint final : public ChannelEndpoint {
 public:
  explicit FakeEndpoint(std::atomic<int>* closed) : closed_(closed) {}
  void Close() override { closed_->fetch_add(1); }

 private:
  std::atomic<int>* closed_;
};

// A device whose CUDA regions open (at a host buffer), so that the table
// can be asked to put a channel in one.
class FakeCudaDevice final : public RegionDevice {
 public:
  absl::StatusOr<void*> OpenIpc(absl::string_view, int32_t, int64_t bytes) override {
    buffer_.resize(static_cast<size_t>(bytes) + 64);
    return static_cast<void*>(buffer_.data());
  }

 private:
  std::vector<char> buffer_;
};

constexpr int64_t kRing = ChannelBytes(2, 4096);

TEST(ChannelHeaderTest, EveryFieldIsCheckedAgainstItsBound) {
  alignas(64) static char ring[ChannelBytes(3, 8192)];
  struct Case {
    uint32_t magic, version, slot_count, slot_bytes;
    int64_t bytes;
    std::string text;
  } cases[] = {
      {0x12345678, 1, 2, 4096, sizeof(ring), "ring header magic=0x12345678, expected 0x4e484341"},
      {kChannelMagic, 2, 2, 4096, sizeof(ring), "ring header version=2: this server reads version 1"},
      {kChannelMagic, 1, 0, 4096, sizeof(ring), "ring header slot_count=0 out of range [1, 64]"},
      {kChannelMagic, 1, 65, 4096, sizeof(ring), "ring header slot_count=65 out of range [1, 64]"},
      {kChannelMagic, 1, 2, 4095, sizeof(ring), "slot_bytes=4095 out of range [4096, 16777216]"},
      {kChannelMagic, 1, 2, 4160 + 1, sizeof(ring), "or not a multiple of 64"},
      {kChannelMagic, 1, 2, (16 << 20) + 64, sizeof(ring), "slot_bytes=16777280 out of range"},
      {kChannelMagic, 1, 4, 8192, sizeof(ring),
       "ring.byte_size=24832 is less than the ring's layout: 64 + slot_count * (64 + slot_bytes) = "
       "64 + 4 * (64 + 8192) = 33088"},
      {kChannelMagic, 1, 2, 4096, 63, "ring.byte_size=63 is less than the ring's header (64 bytes)"},
  };
  for (const Case& c : cases) {
    WriteHeader(ring, c.slot_count, c.slot_bytes, c.magic, c.version);
    auto got = ReadChannelHeader(ring, c.bytes, "ring");
    EXPECT_EQ(got.status().code(), absl::StatusCode::kInvalidArgument) << c.text;
    EXPECT_THAT(std::string(got.status().message()), HasSubstr(c.text));
  }
  WriteHeader(ring, 3, 8192);
  auto good = ReadChannelHeader(ring, sizeof(ring), "ring");
  ASSERT_TRUE(good.ok()) << good.status();
  EXPECT_EQ(good->slot_count, 3);
  EXPECT_EQ(good->slot_bytes, 8192);
}

class ChannelTableTest : public ::testing::Test {
 protected:
  ChannelTable::MakeEndpoint Maker() {
    return [this](const ChannelRing& r) -> absl::StatusOr<std::shared_ptr<ChannelEndpoint>> {
      rings_.push_back(r);
      return std::shared_ptr<ChannelEndpoint>(std::make_shared<FakeEndpoint>(&closed_));
    };
  }

  std::atomic<int> closed_{0};
  std::vector<ChannelRing> rings_;
};

TEST_F(ChannelTableTest, OpensValidatesAndCopiesTheGeometry) {
  RegionTable regions(On(), nullptr);
  ChannelTable channels(ChannelLimits{2});
  Shm shm(1 << 16);
  ASSERT_TRUE(regions.Register("alice", System("r", shm.Deposit(regions), 1 << 16)).ok());
  WriteHeader(shm.data() + 128, 2, 4096);
  auto id = channels.Open("alice", regions, Ref("r", 128, kRing), Maker());
  ASSERT_TRUE(id.ok()) << id.status();
  EXPECT_NE(*id, 0u);
  ASSERT_EQ(rings_.size(), 1u);
  EXPECT_EQ(rings_[0].id, *id);
  // The server's own mapping of the same bytes.
  EXPECT_EQ(reinterpret_cast<const ChannelHeader*>(rings_[0].base)->slot_bytes, 4096u);
  EXPECT_EQ(rings_[0].slot_count, 2);
  EXPECT_EQ(rings_[0].slot_bytes, 4096);
  // The header changing afterwards changes nothing the table handed out.
  WriteHeader(shm.data() + 128, 64, 16 << 20);
  EXPECT_EQ(rings_[0].slot_count, 2);

  const struct {
    std::string tenant;
    RegionRefView ref;
    absl::StatusCode code;
    std::string text;
  } cases[] = {
      {"alice", Ref("nope", 0, kRing), absl::StatusCode::kNotFound,
       "ring.name: region 'nope' is not registered"},
      {"bob", Ref("r", 0, kRing), absl::StatusCode::kPermissionDenied,
       "ring.name: region 'r' belongs to another tenant"},
      {"alice", Ref("r", 8, kRing), absl::StatusCode::kInvalidArgument,
       "ring.offset=8: the ring's address in region 'r' must be a multiple of 64 bytes"},
      {"alice", Ref("r", (1 << 16) - 64, kRing), absl::StatusCode::kInvalidArgument,
       "exceeds the size of region 'r' (65536 bytes)"},
      {"alice", Ref("r", 128 + 3 * kRing, kRing - 1), absl::StatusCode::kInvalidArgument,
       "ring.byte_size=8383 is less than the ring's layout"},
  };
  WriteHeader(shm.data() + 128, 2, 4096);
  WriteHeader(shm.data() + 128 + 3 * kRing, 2, 4096);
  for (const auto& c : cases) {
    auto got = channels.Open(c.tenant, regions, c.ref, Maker());
    EXPECT_EQ(got.status().code(), c.code) << c.text << ": " << got.status();
    EXPECT_THAT(std::string(got.status().message()), HasSubstr(c.text));
  }
  EXPECT_EQ(channels.TenantChannels("alice"), 1);

  // A ring overlapping an open channel's is refused, naming it, whatever the
  // bytes there hold (they are the open ring's: no header is read).
  for (int64_t at : {int64_t{128}, int64_t{128 + 64}, int64_t{128 + kRing - 64}}) {
    auto twice = channels.Open("alice", regions, Ref("r", at, kRing), Maker());
    EXPECT_EQ(twice.status().code(), absl::StatusCode::kFailedPrecondition) << twice.status();
    EXPECT_THAT(std::string(twice.status().message()), HasSubstr("overlap the ring of open channel"));
  }
  EXPECT_EQ(channels.TenantChannels("alice"), 1);

  // The cap, and who may close what.
  WriteHeader(shm.data() + 128 + kRing, 2, 4096);
  ASSERT_TRUE(channels.Open("alice", regions, Ref("r", 128 + kRing, kRing), Maker()).ok());
  auto capped = channels.Open("alice", regions, Ref("r", 128, kRing), Maker());
  EXPECT_EQ(capped.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(std::string(capped.status().message()), HasSubstr("--max_channels_per_tenant"));
  absl::Status theirs = channels.Close("bob", *id);
  EXPECT_EQ(theirs.code(), absl::StatusCode::kPermissionDenied) << theirs;
  EXPECT_THAT(std::string(theirs.message()), HasSubstr("belongs to another tenant"));
  EXPECT_EQ(closed_, 0);
  ASSERT_TRUE(channels.Close("alice", *id).ok());
  EXPECT_EQ(closed_, 1);
  absl::Status again = channels.Close("alice", *id);
  EXPECT_EQ(again.code(), absl::StatusCode::kNotFound) << again;
  EXPECT_THAT(std::string(again.message()), HasSubstr("names no open channel"));
  EXPECT_EQ(channels.TenantChannels("alice"), 1);
}

// One memfd registered under two names is one memory: a ring opened through
// one name refuses the same bytes through the other (the server maps each
// registration apart, so their addresses differ).
TEST_F(ChannelTableTest, OneMemoryUnderTwoNamesHoldsOneRingPerRange) {
  RegionTable regions(On(), nullptr);
  ChannelTable channels(ChannelLimits{4});
  Shm shm(1 << 16);
  ASSERT_TRUE(regions.Register("alice", System("a", shm.Deposit(regions), 1 << 16)).ok());
  ASSERT_TRUE(regions.Register("alice", System("b", shm.Deposit(regions), 1 << 16)).ok());
  WriteHeader(shm.data(), 2, 4096);
  ASSERT_TRUE(channels.Open("alice", regions, Ref("a", 0, kRing), Maker()).ok());
  auto twice = channels.Open("alice", regions, Ref("b", 0, kRing), Maker());
  EXPECT_EQ(twice.status().code(), absl::StatusCode::kFailedPrecondition) << twice.status();
  EXPECT_THAT(std::string(twice.status().message()), HasSubstr("overlap the ring of open channel"));
  WriteHeader(shm.data() + kRing, 2, 4096);
  EXPECT_TRUE(channels.Open("alice", regions, Ref("b", kRing, kRing), Maker()).ok());
  EXPECT_EQ(channels.TenantChannels("alice"), 2);
  // The same memory registered by another tenant: refused too, without
  // naming alice's channel (its id is hers).
  ASSERT_TRUE(regions.Register("bob", System("c", shm.Deposit(regions), 1 << 16)).ok());
  auto bobs = channels.Open("bob", regions, Ref("c", 0, kRing), Maker());
  EXPECT_EQ(bobs.status().code(), absl::StatusCode::kFailedPrecondition) << bobs.status();
  EXPECT_THAT(std::string(bobs.status().message()),
              HasSubstr("overlap the ring of another tenant's open channel (the same memory, registered by both)"));
  EXPECT_THAT(std::string(bobs.status().message()), ::testing::Not(HasSubstr("CloseChannel")));
}

TEST_F(ChannelTableTest, RegionsOffAndCudaRegionsAreRefused) {
  RegionTable off(RegionLimits{}, nullptr);
  ChannelTable channels(ChannelLimits{4});
  auto refused = channels.Open("alice", off, Ref("r", 0, kRing), Maker());
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(refused.status().message()), HasSubstr("--allow_shared_memory"));

  FakeCudaDevice device;
  RegionTable regions(On(), &device);
  RegionSpec cuda;
  cuda.name = "g";
  cuda.kind = RegionKind::kCuda;
  cuda.ipc_handle = std::string(64, 'h');
  cuda.byte_size = 1 << 16;
  ASSERT_TRUE(regions.Register("alice", cuda).ok());
  auto got = channels.Open("alice", regions, Ref("g", 0, kRing), Maker());
  EXPECT_EQ(got.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(got.status().message()),
              HasSubstr("ring.name: region 'g' is a CUDA region: a channel needs a system region"));
  EXPECT_TRUE(rings_.empty());
  EXPECT_EQ(channels.TenantChannels("alice"), 0);
}

TEST_F(ChannelTableTest, ARegionThatGoesClosesItsChannelsAndStaysMappedForThem) {
  RegionTable regions(On(), nullptr);
  ChannelTable channels(ChannelLimits{4});
  regions.SetReleaseListener([&](const Region* r) { channels.CloseRegion(r); });
  auto a = std::make_unique<Shm>(1 << 16);
  auto b = std::make_unique<Shm>(1 << 16);
  ASSERT_TRUE(regions.Register("alice", System("a", a->Deposit(regions), 1 << 16)).ok());
  ASSERT_TRUE(regions.Register("alice", System("b", b->Deposit(regions), 1 << 16)).ok());
  WriteHeader(a->data(), 2, 4096);
  WriteHeader(b->data(), 2, 4096);
  WriteHeader(a->data() + kRing, 2, 4096);
  ASSERT_TRUE(channels.Open("alice", regions, Ref("a", 0, kRing), Maker()).ok());
  ASSERT_TRUE(channels.Open("alice", regions, Ref("a", kRing, kRing), Maker()).ok());
  ASSERT_TRUE(channels.Open("alice", regions, Ref("b", 0, kRing), Maker()).ok());
  // The channels' holds are neither "in use" nor a bar to unregistering.
  for (const RegionInfoData& info : regions.List("alice")) EXPECT_EQ(info.in_use, 0) << info.name;
  ASSERT_TRUE(regions.Unregister("alice", "a").ok());
  EXPECT_EQ(closed_, 2);
  EXPECT_EQ(channels.TenantChannels("alice"), 1);
  // The endpoints still hold the mapping: the ring is readable.
  const auto* header = reinterpret_cast<const ChannelHeader*>(rings_[0].base);
  EXPECT_EQ(header->magic, kChannelMagic);

  // Reclaimed (its client went away) although a channel is open on it.
  b->HangUp();
  EXPECT_TRUE(regions.List("alice").empty());
  EXPECT_EQ(closed_, 3);
  EXPECT_EQ(channels.TenantChannels("alice"), 0);
  EXPECT_EQ(reinterpret_cast<const ChannelHeader*>(rings_[2].base)->magic, kChannelMagic);
  rings_.clear();  // the endpoints' holds go: the regions unmap
}

// A region unregistered while a channel opens on it: the open fails
// (NOT_FOUND) or the channel closes with the region; never a channel left
// open on a region that is gone (it would keep the mapping outside the
// tenant's byte cap). The unregistration comes at delays that sweep the
// open's window, between its Resolve and its listing of the channel.
TEST_F(ChannelTableTest, ARegionUnregisteredWhileAChannelOpensLeavesNoChannelOpen) {
  RegionTable regions(On(), nullptr);
  ChannelTable channels(ChannelLimits{4});
  regions.SetReleaseListener([&](const Region* r) { channels.CloseRegion(r); });
  auto make = [](const ChannelRing&) -> absl::StatusOr<std::shared_ptr<ChannelEndpoint>> {
    static std::atomic<int> closed{0};
    return std::shared_ptr<ChannelEndpoint>(std::make_shared<FakeEndpoint>(&closed));
  };
  int opened = 0, refused = 0;
  for (int i = 0; i < 3000; ++i) {
    Shm shm(1 << 16);
    const std::string name = absl::StrCat("r", i);
    ASSERT_TRUE(regions.Register("alice", System(name, shm.Deposit(regions), 1 << 16)).ok());
    WriteHeader(shm.data(), 2, 4096);
    std::atomic<bool> ready{false}, go{false};
    absl::StatusOr<uint64_t> id;
    std::thread opener([&] {
      ready.store(true);
      while (!go.load()) {
      }
      id = channels.Open("alice", regions, Ref(name, 0, kRing), make);
    });
    while (!ready.load()) {
    }
    go.store(true);
    for (volatile int spin = 0; spin < (i % 150) * 10; spin = spin + 1) {
    }
    ASSERT_TRUE(regions.Unregister("alice", name).ok());
    opener.join();
    ASSERT_EQ(channels.TenantChannels("alice"), 0) << "round " << i << ": " << id.status();
    if (id.ok()) {
      ++opened;
    } else {
      EXPECT_EQ(id.status().code(), absl::StatusCode::kNotFound) << id.status();
      ++refused;
    }
  }
  EXPECT_EQ(opened + refused, 3000);
}

}  // namespace
}  // namespace attnserve
