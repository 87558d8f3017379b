// RegionTable (server/core/region_table.h): registration and its errors,
// resolution of ranges, ownership, caps, and the lifetime rules: a region
// unregistered while a request holds it stays mapped for that request, and
// an idle region whose shm key vanished is reclaimed.
#include "server/core/region_table.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/core/test_shm.h"

namespace attnserve {
namespace {

using ::testing::HasSubstr;

// A POSIX shm object of `bytes` random bytes, unlinked at the end.
struct Shm : TestShm {
  explicit Shm(int64_t bytes, uint64_t seed = 1) : TestShm(bytes, seed) {}
};

RegionSpec System(const std::string& name, const std::string& key, int64_t offset, int64_t bytes) {
  RegionSpec spec;
  spec.name = name;
  spec.kind = RegionKind::kSystem;
  spec.key = key;
  spec.offset = offset;
  spec.byte_size = bytes;
  return spec;
}

RegionRefView Ref(absl::string_view name, int64_t offset, int64_t bytes) {
  RegionRefView ref;
  ref.set = true;
  ref.name = name;
  ref.offset = offset;
  ref.byte_size = bytes;
  return ref;
}

RegionLimits On(int32_t count = 4, int64_t bytes = 1 << 20) {
  RegionLimits limits;
  limits.enabled = true;
  limits.max_regions_per_tenant = count;
  limits.max_bytes_per_tenant = bytes;
  return limits;
}

TEST(RegionTableTest, ResolvesRangesOfTheMappedObject) {
  Shm shm(3 * 4096);
  RegionTable table(On(), nullptr);
  // Offset 4096 + 100 into the object: the region's byte 0 is object byte 4196.
  ASSERT_TRUE(table.Register("alice", System("r", shm.key(), 4196, 5000)).ok());
  auto slice = table.Resolve("alice", Ref("r", 8, 64), 2, "q.region");
  ASSERT_TRUE(slice.ok()) << slice.status();
  EXPECT_EQ(slice->bytes, 64);
  EXPECT_EQ(std::memcmp(slice->data, shm.data() + 4196 + 8, 64), 0);
  // Writes through the server's mapping reach the client's.
  slice->data[0] = static_cast<char>(~shm.data()[4196 + 8]);
  EXPECT_EQ(slice->data[0], shm.data()[4196 + 8]);
  EXPECT_FALSE(slice->registered());
  EXPECT_FALSE(slice->on_device());
  const RegionTable::Usage used = table.TenantUsage("alice");
  EXPECT_EQ(used.count, 1);
  EXPECT_EQ(used.bytes, 5000);
}

TEST(RegionTableTest, BadRangesNameTheFieldAndTheBound) {
  Shm shm(8192);
  RegionTable table(On(), nullptr);
  ASSERT_TRUE(table.Register("alice", System("r", shm.key(), 0, 8192)).ok());
  auto past = table.Resolve("alice", Ref("r", 8000, 200), 2, "q.region");
  EXPECT_EQ(past.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(past.status().message()),
              HasSubstr("q.region.offset + q.region.byte_size = 8000 + 200 exceeds the size of "
                        "region 'r' (8192 bytes)"));
  auto negative = table.Resolve("alice", Ref("r", -2, 2), 2, "k.region");
  EXPECT_THAT(std::string(negative.status().message()),
              HasSubstr("k.region.offset=-2 out of range [0, 8192]"));
  auto beyond = table.Resolve("alice", Ref("r", 9000, 0), 2, "k.region");
  EXPECT_EQ(beyond.status().code(), absl::StatusCode::kInvalidArgument);
  auto odd = table.Resolve("alice", Ref("r", 3, 8), 4, "lse_region");
  EXPECT_THAT(std::string(odd.status().message()), HasSubstr("multiple of 4 bytes"));
  auto unknown = table.Resolve("alice", Ref("nope", 0, 2), 2, "q.region");
  EXPECT_EQ(unknown.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(std::string(unknown.status().message()), HasSubstr("q.region.name: region 'nope'"));
  auto theirs = table.Resolve("bob", Ref("r", 0, 2), 2, "q.region");
  EXPECT_EQ(theirs.status().code(), absl::StatusCode::kPermissionDenied);
}

TEST(RegionTableTest, RegistrationErrorsChangeNothing) {
  Shm shm(8192);
  RegionTable table(On(/*count=*/2, /*bytes=*/10000), nullptr);
  struct Case {
    RegionSpec spec;
    absl::StatusCode code;
    std::string text;
  } cases[] = {
      {System("", shm.key(), 0, 8), absl::StatusCode::kInvalidArgument, "name has 0 characters"},
      {System("a/b", shm.key(), 0, 8), absl::StatusCode::kInvalidArgument, "[A-Za-z0-9_.-]"},
      {System("r", "noslash", 0, 8), absl::StatusCode::kInvalidArgument, "system.key"},
      {System("r", "/a/b", 0, 8), absl::StatusCode::kInvalidArgument, "system.key"},
      {System("r", "/attn_no_such_object_x", 0, 8), absl::StatusCode::kNotFound,
       "no such shared-memory object"},
      {System("r", shm.key(), 0, 0), absl::StatusCode::kInvalidArgument,
       "system.byte_size=0 out of range [1, 10000]"},
      {System("r", shm.key(), -1, 8), absl::StatusCode::kInvalidArgument,
       "system.offset=-1 is negative"},
      {System("r", shm.key(), 4096, 8000), absl::StatusCode::kInvalidArgument,
       "exceeds the size of"},
  };
  for (const Case& c : cases) {
    absl::Status s = table.Register("alice", c.spec);
    EXPECT_EQ(s.code(), c.code) << s;
    EXPECT_THAT(std::string(s.message()), HasSubstr(c.text));
  }
  RegionSpec cuda;
  cuda.name = "gpu";
  cuda.kind = RegionKind::kCuda;
  cuda.ipc_handle = std::string(64, 'x');
  cuda.byte_size = 64;
  absl::Status no_device = table.Register("alice", cuda);
  EXPECT_EQ(no_device.code(), absl::StatusCode::kFailedPrecondition) << no_device;
  cuda.ipc_handle = "short";
  EXPECT_THAT(std::string(table.Register("alice", cuda).message()),
              HasSubstr("cuda.ipc_handle has 5 bytes"));
  EXPECT_EQ(table.TenantUsage("alice").count, 0);
  EXPECT_TRUE(table.List("alice").empty());

  // Names, caps.
  ASSERT_TRUE(table.Register("alice", System("a", shm.key(), 0, 4000)).ok());
  EXPECT_EQ(table.Register("alice", System("a", shm.key(), 0, 8)).code(),
            absl::StatusCode::kAlreadyExists);
  EXPECT_EQ(table.Register("bob", System("a", shm.key(), 0, 8)).code(),
            absl::StatusCode::kAlreadyExists);
  absl::Status bytes = table.Register("alice", System("b", shm.key(), 0, 7000));
  EXPECT_EQ(bytes.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(std::string(bytes.message()), HasSubstr("--max_region_bytes_per_tenant"));
  ASSERT_TRUE(table.Register("alice", System("b", shm.key(), 0, 6000)).ok());
  absl::Status count = table.Register("alice", System("c", shm.key(), 0, 8));
  EXPECT_EQ(count.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(std::string(count.message()), HasSubstr("--max_regions_per_tenant"));
  // Another tenant has its own caps.
  EXPECT_TRUE(table.Register("bob", System("c", shm.key(), 0, 8)).ok());
  EXPECT_EQ(table.Unregister("bob", "a").code(), absl::StatusCode::kPermissionDenied);
  EXPECT_EQ(table.Unregister("alice", "zzz").code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(table.TenantUsage("alice").bytes, 10000);
}

TEST(RegionTableTest, OffUnlessEnabled) {
  Shm shm(4096);
  RegionTable table(RegionLimits{}, nullptr);
  absl::Status s = table.Register("alice", System("r", shm.key(), 0, 8));
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(s.message()), HasSubstr("--allow_shared_memory"));
  EXPECT_EQ(table.Resolve("alice", Ref("r", 0, 2), 2, "q.region").status().code(),
            absl::StatusCode::kFailedPrecondition);
}

TEST(RegionTableTest, AnUnregisteredRegionStaysMappedForTheRequestHoldingIt) {
  auto shm = std::make_unique<Shm>(4096, 7);
  RegionTable table(On(), nullptr);
  ASSERT_TRUE(table.Register("alice", System("r", shm->key(), 0, 4096)).ok());
  auto held = table.Resolve("alice", Ref("r", 0, 4096), 2, "q.region");
  ASSERT_TRUE(held.ok());
  ASSERT_EQ(table.List("alice").size(), 1u);
  EXPECT_EQ(table.List("alice")[0].in_use, 1);
  ASSERT_TRUE(table.Unregister("alice", "r").ok());
  // The name is gone for new requests...
  EXPECT_EQ(table.Resolve("alice", Ref("r", 0, 2), 2, "q.region").status().code(),
            absl::StatusCode::kNotFound);
  EXPECT_TRUE(table.List("alice").empty());
  EXPECT_EQ(table.TenantUsage("alice").count, 0);
  // ...and the client's object itself goes too, yet the held range still
  // reads the bytes (the server's mapping keeps them).
  std::vector<char> expected(shm->data(), shm->data() + 4096);
  shm.reset();
  EXPECT_EQ(std::memcmp(held->data, expected.data(), 4096), 0);
  held->data[10] = 42;  // and may still be written
  EXPECT_EQ(held->data[10], 42);
}

TEST(RegionTableTest, IdleRegionsWhoseKeyVanishedAreReclaimed) {
  Shm kept(4096), gone(4096), busy(4096);
  RegionTable table(On(), nullptr);
  ASSERT_TRUE(table.Register("alice", System("kept", kept.key(), 0, 4096)).ok());
  ASSERT_TRUE(table.Register("alice", System("gone", gone.key(), 0, 4096)).ok());
  ASSERT_TRUE(table.Register("alice", System("busy", busy.key(), 0, 4096)).ok());
  ASSERT_TRUE(table.Register("bob", System("bobs", gone.key(), 0, 4096)).ok());
  auto holding = table.Resolve("alice", Ref("busy", 0, 8), 2, "q.region");
  ASSERT_TRUE(holding.ok());
  gone.Unlink();
  busy.Unlink();
  std::vector<RegionInfoData> list = table.List("alice");
  ASSERT_EQ(list.size(), 2u);  // "gone" reclaimed; "busy" is in use
  EXPECT_EQ(list[0].name, "busy");
  EXPECT_FALSE(list[0].key_exists);
  EXPECT_EQ(list[0].in_use, 1);
  EXPECT_EQ(list[1].name, "kept");
  EXPECT_TRUE(list[1].key_exists);
  EXPECT_EQ(table.TenantUsage("alice").count, 2);
  // Only alice's own regions are swept by alice's calls.
  EXPECT_EQ(table.TenantUsage("bob").count, 1);
  holding = absl::InternalError("released");
  EXPECT_EQ(table.List("alice").size(), 1u);
  EXPECT_EQ(table.List("bob").size(), 0u);
}

// A RegionDevice whose "IPC handles" name host buffers it owns, so the
// table's handling of CUDA regions (ownership, ranges, reference counts,
// caps, gauges, the close on the last reference) is tested without a GPU.
class FakeIpcDevice final : public RegionDevice {
 public:
  absl::StatusOr<void*> OpenIpc(absl::string_view handle, int32_t device_id,
                                int64_t bytes) override {
    if (device_id > 1) return absl::InvalidArgumentError("cuda.device_id out of range [0, 2)");
    if (handle[0] != 'h') return absl::InvalidArgumentError("cuda.ipc_handle does not open");
    buffers_.emplace_back(static_cast<size_t>(bytes), '\x11');
    ++open_;
    return buffers_.back().data();
  }
  void CloseIpc(void* device_ptr) override {
    ++closed_;
    last_closed_ = device_ptr;
  }
  int open_ = 0, closed_ = 0;
  void* last_closed_ = nullptr;

 private:
  std::vector<std::string> buffers_;
};

RegionSpec Cuda(const std::string& name, char first, int32_t device_id, int64_t bytes) {
  RegionSpec spec;
  spec.name = name;
  spec.kind = RegionKind::kCuda;
  spec.ipc_handle = std::string(64, 'x');
  spec.ipc_handle[0] = first;
  spec.device_id = device_id;
  spec.byte_size = bytes;
  return spec;
}

TEST(RegionTableTest, CudaRegionsAreOpenedOnceAndClosedWithTheLastReference) {
  FakeIpcDevice device;
  RegionTable table(On(/*count=*/3, /*bytes=*/1 << 16), &device);
  // The backend's errors come back as they are, and leave nothing behind.
  absl::Status bad = table.Register("alice", Cuda("g", 'z', 0, 4096));
  EXPECT_EQ(bad.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(bad.message()), HasSubstr("cuda.ipc_handle"));
  bad = table.Register("alice", Cuda("g", 'h', 2, 4096));
  EXPECT_THAT(std::string(bad.message()), HasSubstr("cuda.device_id"));
  bad = table.Register("alice", Cuda("g", 'h', -1, 4096));
  EXPECT_THAT(std::string(bad.message()), HasSubstr("cuda.device_id=-1 is negative"));
  bad = table.Register("alice", Cuda("g", 'h', 0, (1 << 16) + 1));
  EXPECT_THAT(std::string(bad.message()), HasSubstr("cuda.byte_size=65537 out of range"));
  EXPECT_EQ(device.open_, 0);
  EXPECT_EQ(table.TenantUsage("alice").count, 0);

  ASSERT_TRUE(table.Register("alice", Cuda("g", 'h', 1, 4096)).ok());
  EXPECT_EQ(device.open_, 1);
  EXPECT_EQ(table.TenantUsage("alice").count, 1);
  EXPECT_EQ(table.TenantUsage("alice").bytes, 4096);
  std::vector<RegionInfoData> list = table.List("alice");
  ASSERT_EQ(list.size(), 1u);
  EXPECT_EQ(list[0].kind, RegionKind::kCuda);
  EXPECT_EQ(list[0].device_id, 1);
  EXPECT_EQ(list[0].byte_size, 4096);
  EXPECT_FALSE(list[0].key_exists);

  // Ranges, ownership, alignment: as for system regions.
  auto slice = table.Resolve("alice", Ref("g", 128, 256), 2, "q.region");
  ASSERT_TRUE(slice.ok()) << slice.status();
  EXPECT_TRUE(slice->on_device());
  EXPECT_FALSE(slice->registered());
  EXPECT_EQ(slice->bytes, 256);
  EXPECT_EQ(table.Resolve("bob", Ref("g", 0, 2), 2, "q.region").status().code(),
            absl::StatusCode::kPermissionDenied);
  EXPECT_EQ(table.Unregister("bob", "g").code(), absl::StatusCode::kPermissionDenied);
  EXPECT_THAT(std::string(table.Resolve("alice", Ref("g", 4000, 200), 2, "output_region")
                              .status().message()),
              HasSubstr("output_region.offset + output_region.byte_size = 4000 + 200 exceeds the "
                        "size of region 'g' (4096 bytes)"));
  EXPECT_THAT(std::string(table.Resolve("alice", Ref("g", 4097, 0), 2, "k.region")
                              .status().message()),
              HasSubstr("k.region.offset=4097 out of range [0, 4096]"));
  EXPECT_THAT(std::string(table.Resolve("alice", Ref("g", 3, 4), 4, "lse_region")
                              .status().message()),
              HasSubstr("multiple of 4 bytes"));
  EXPECT_EQ(table.Resolve("alice", Ref("h", 0, 2), 2, "q.region").status().code(),
            absl::StatusCode::kNotFound);

  // A vanished key reclaims only system regions: a CUDA region stays.
  EXPECT_EQ(table.List("alice").size(), 1u);
  // Unregistered while a request holds it: the name goes, the handle stays
  // open until the request lets go, then it is closed exactly once.
  ASSERT_TRUE(table.Unregister("alice", "g").ok());
  EXPECT_EQ(table.TenantUsage("alice").count, 0);
  EXPECT_EQ(table.Resolve("alice", Ref("g", 0, 2), 2, "q.region").status().code(),
            absl::StatusCode::kNotFound);
  EXPECT_EQ(device.closed_, 0);
  void* data = slice->region->data;
  slice = absl::InternalError("released");
  EXPECT_EQ(device.closed_, 1);
  EXPECT_EQ(device.last_closed_, data);

  // Caps count CUDA regions too.
  for (int i = 0; i < 3; ++i) ASSERT_TRUE(table.Register("alice", Cuda(absl::StrCat("c", i), 'h', 0, 64)).ok());
  EXPECT_EQ(table.Register("alice", Cuda("c3", 'h', 0, 64)).code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(device.open_, 4);
}

}  // namespace
}  // namespace attnserve
