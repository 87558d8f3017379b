// RegionTable (server/core/region_table.h): deposits of memfds and their
// checks (sealed against shrinking, a memfd, read-write, writable), their
// bound and expiry, claims by token, registration and its errors,
// resolution of ranges, ownership, caps, and the lifetime rules: a region
// unregistered while a request holds it stays mapped for that request, and
// an idle region whose holder connection closed is reclaimed.
#include "server/core/region_table.h"

#include <fcntl.h>
#include <poll.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/core/client_fd.h"
#include "tests/core/test_shm.h"

namespace attnserve {
namespace {

using ::testing::HasSubstr;

// A sealed memfd of `bytes` random bytes.
struct Shm : TestShm {
  explicit Shm(int64_t bytes, uint64_t seed = 1) : TestShm(bytes, seed) {}
};

RegionSpec System(const std::string& name, const std::string& token, int64_t offset,
                  int64_t bytes) {
  RegionSpec spec;
  spec.name = name;
  spec.kind = RegionKind::kSystem;
  spec.claim_token = token;
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

// True once the server's end of the holder whose client end is `client_end`
// is closed (the client reads end-of-file).
bool ServerClosed(const UniqueFd& client_end) {
  // The server closes a client's descriptors on closer threads
  // (server/core/client_fd.h): once they are idle, the close has happened.
  for (int i = 0; i < 10000 && ClientFdsClosing() > 0; ++i) absl::SleepFor(absl::Milliseconds(1));
  pollfd p{client_end.get(), POLLIN, 0};
  return poll(&p, 1, 0) == 1 && (p.revents & (POLLHUP | POLLIN)) != 0;
}

TEST(RegionTableTest, ResolvesRangesOfTheMappedObject) {
  Shm shm(3 * 4096);
  RegionTable table(On(), nullptr);
  // Offset 4096 + 100 into the memfd: the region's byte 0 is its byte 4196.
  ASSERT_TRUE(table.Register("alice", System("r", shm.Deposit(table), 4196, 5000)).ok());
  EXPECT_EQ(table.PendingDeposits(), 0);
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
  std::vector<RegionInfoData> list = table.List("alice");
  ASSERT_EQ(list.size(), 1u);
  EXPECT_EQ(list[0].key, "attn_core_test");  // the memfd's name
  EXPECT_EQ(list[0].offset, 4196);
  EXPECT_TRUE(list[0].key_exists);  // its holder is open
}

// One memfd under two names (or two ranges of it) is the same memory: an
// output's overlap with an input is found across the names, by the memfd's
// offsets; different memfds never overlap.
TEST(RegionTableTest, SlicesOverlapAcrossNamesForTheSameMemfd) {
  Shm shm(3 * 4096), other(3 * 4096, 2);
  RegionTable table(On(/*count=*/4, /*bytes=*/1 << 20), nullptr);
  ASSERT_TRUE(table.Register("alice", System("a", shm.Deposit(table), 0, 8192)).ok());
  ASSERT_TRUE(table.Register("alice", System("b", shm.Deposit(table), 4096, 8192)).ok());
  ASSERT_TRUE(table.Register("alice", System("c", other.Deposit(table), 0, 8192)).ok());
  auto slice = [&](const char* name, int64_t offset, int64_t bytes) {
    auto s = table.Resolve("alice", Ref(name, offset, bytes), 1, "x");
    EXPECT_TRUE(s.ok()) << s.status();
    return *s;
  };
  // a's bytes [4096, 8192) are b's [0, 4096), mapped twice.
  EXPECT_NE(slice("a", 4096, 16).data, slice("b", 0, 16).data);
  EXPECT_TRUE(SlicesOverlap(slice("a", 4100, 8), slice("b", 0, 16)));
  EXPECT_TRUE(SlicesOverlap(slice("b", 8, 8), slice("a", 4096, 9)));
  EXPECT_FALSE(SlicesOverlap(slice("b", 8, 8), slice("a", 4096, 8)));   // touching only
  EXPECT_FALSE(SlicesOverlap(slice("a", 0, 4096), slice("b", 0, 4096)));
  EXPECT_TRUE(SlicesOverlap(slice("a", 0, 100), slice("a", 99, 10)));    // one region
  EXPECT_FALSE(SlicesOverlap(slice("a", 0, 100), slice("a", 100, 10)));
  EXPECT_FALSE(SlicesOverlap(slice("a", 0, 8192), slice("c", 0, 8192)));  // another memfd
  EXPECT_FALSE(SlicesOverlap(slice("a", 0, 0), slice("b", 0, 8192)));     // empty
}

TEST(RegionTableTest, BadRangesNameTheFieldAndTheBound) {
  Shm shm(8192);
  RegionTable table(On(), nullptr);
  ASSERT_TRUE(table.Register("alice", System("r", shm.Deposit(table), 0, 8192)).ok());
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
  const std::string held = shm.Deposit(table);  // not consumed by the errors before its claim
  RegionSpec by_key = System("r", held, 0, 8);
  by_key.key = "/attn_someones_object";
  struct Case {
    RegionSpec spec;
    absl::StatusCode code;
    std::string text;
  } cases[] = {
      {System("", held, 0, 8), absl::StatusCode::kInvalidArgument, "name has 0 characters"},
      {System("a/b", held, 0, 8), absl::StatusCode::kInvalidArgument, "[A-Za-z0-9_.-]"},
      {by_key, absl::StatusCode::kInvalidArgument,
       "system.key: registration by POSIX shm name was removed in attnserve 0.2.0"},
      {System("r", "short", 0, 8), absl::StatusCode::kInvalidArgument,
       "system.claim_token has 5 bytes: 16"},
      {System("r", "", 0, 8), absl::StatusCode::kInvalidArgument,
       "system.claim_token has 0 bytes: 16"},
      {System("r", std::string(16, 'n'), 0, 8), absl::StatusCode::kNotFound,
       "system.claim_token: no memfd is deposited under this token"},
      {System("r", held, 0, 0), absl::StatusCode::kInvalidArgument,
       "system.byte_size=0 out of range [1, 10000]"},
      {System("r", held, -1, 8), absl::StatusCode::kInvalidArgument,
       "system.offset=-1 is negative"},
  };
  for (const Case& c : cases) {
    absl::Status s = table.Register("alice", c.spec);
    EXPECT_EQ(s.code(), c.code) << s;
    EXPECT_THAT(std::string(s.message()), HasSubstr(c.text));
  }
  EXPECT_EQ(table.PendingDeposits(), 1);
  // Past the memfd's end: the claim is made, and the deposit is gone.
  absl::Status past = table.Register("alice", System("r", held, 4096, 8000));
  EXPECT_EQ(past.code(), absl::StatusCode::kInvalidArgument) << past;
  EXPECT_THAT(std::string(past.message()),
              HasSubstr("system.offset + system.byte_size = 4096 + 8000 exceeds the size of the "
                        "memfd (8192 bytes)"));
  EXPECT_EQ(table.PendingDeposits(), 0);
  EXPECT_EQ(table.Register("alice", System("r", held, 0, 8)).code(), absl::StatusCode::kNotFound);
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

  // Names, caps: checked before the claim, which they leave for a retry.
  ASSERT_TRUE(table.Register("alice", System("a", shm.Deposit(table), 0, 4000)).ok());
  const std::string again = shm.Deposit(table);
  EXPECT_EQ(table.Register("alice", System("a", again, 0, 8)).code(),
            absl::StatusCode::kAlreadyExists);
  EXPECT_EQ(table.Register("bob", System("a", again, 0, 8)).code(),
            absl::StatusCode::kAlreadyExists);
  absl::Status bytes = table.Register("alice", System("b", again, 0, 7000));
  EXPECT_EQ(bytes.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(std::string(bytes.message()), HasSubstr("--max_region_bytes_per_tenant"));
  ASSERT_TRUE(table.Register("alice", System("b", again, 0, 6000)).ok());
  absl::Status count = table.Register("alice", System("c", shm.Deposit(table), 0, 8));
  EXPECT_EQ(count.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(std::string(count.message()), HasSubstr("--max_regions_per_tenant"));
  // Another tenant has its own caps.
  EXPECT_TRUE(table.Register("bob", System("c", shm.Deposit(table), 0, 8)).ok());
  EXPECT_EQ(table.Unregister("bob", "a").code(), absl::StatusCode::kPermissionDenied);
  EXPECT_EQ(table.Unregister("alice", "zzz").code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(table.TenantUsage("alice").bytes, 10000);
}

// Only a memfd that can never shrink, open read-write and writable is
// taken; every other descriptor is refused naming what is wrong, and
// nothing is held.
TEST(RegionTableTest, DepositsMustBeSealedWritableMemfds) {
  RegionTable table(On(), nullptr);
  std::vector<UniqueFd> client_ends;
  auto deposit = [&](int fd, const std::string& token = TestToken()) {
    client_ends.emplace_back();
    return table.Deposit(MakeDeposit(fd, token, &client_ends.back()));
  };
  struct Case {
    std::string what;
    int seals;
    std::string text;
  } sealings[] = {
      {"no seals", 0, "the memfd is not sealed against shrinking: create it with memfd_create"},
      {"grow and seal only", F_SEAL_GROW | F_SEAL_SEAL, "F_SEAL_SHRINK"},
      {"write", F_SEAL_SHRINK | F_SEAL_WRITE, "sealed against writing"},
  };
  for (const Case& c : sealings) {
    TestShm shm(4096, std::nullopt, c.seals);
    absl::Status s = deposit(shm.fd());
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << c.what << ": " << s;
    EXPECT_THAT(std::string(s.message()), HasSubstr(c.text)) << c.what;
  }
  // A POSIX shm object (what registration by key used): it cannot be sealed.
  const std::string key = absl::StrCat("/attn_core_deposit_", getpid());
  UniqueFd posix(shm_open(key.c_str(), O_RDWR | O_CREAT | O_EXCL, 0600));
  ASSERT_TRUE(posix.valid());
  shm_unlink(key.c_str());
  ASSERT_EQ(ftruncate(posix.get(), 4096), 0);
  EXPECT_THAT(std::string(deposit(posix.get()).message()), HasSubstr("F_SEAL_SHRINK"));
  // Not a memfd: a pipe, a file on disk.
  int pipe_fds[2];
  ASSERT_EQ(pipe(pipe_fds), 0);
  UniqueFd pipe_read(pipe_fds[0]), pipe_write(pipe_fds[1]);
  EXPECT_THAT(std::string(deposit(pipe_read.get()).message()),
              HasSubstr("the file descriptor is not a memfd"));
  const char* dir = std::getenv("TEST_TMPDIR");
  std::string path = absl::StrCat(dir != nullptr ? dir : "/tmp", "/attn_deposit_XXXXXX");
  UniqueFd disk(mkstemp(path.data()));
  ASSERT_TRUE(disk.valid());
  unlink(path.c_str());
  absl::Status on_disk = deposit(disk.get());
  // /tmp may itself be a tmpfs: then the file is refused for its seals.
  EXPECT_EQ(on_disk.code(), absl::StatusCode::kInvalidArgument) << on_disk;
  // The memfd reopened read-only.
  TestShm shm(4096);
  UniqueFd read_only(open(absl::StrCat("/proc/self/fd/", shm.fd()).c_str(), O_RDONLY | O_CLOEXEC));
  ASSERT_TRUE(read_only.valid());
  EXPECT_THAT(std::string(deposit(read_only.get()).message()), HasSubstr("not open read-write"));
  // The token's size; a token held already.
  EXPECT_THAT(std::string(deposit(shm.fd(), "abc").message()),
              HasSubstr("the claim token has 3 bytes: 16"));
  const std::string token = TestToken();
  ASSERT_TRUE(deposit(shm.fd(), token).ok());
  absl::Status twice = deposit(shm.fd(), token);
  EXPECT_EQ(twice.code(), absl::StatusCode::kAlreadyExists) << twice;
  // Only the good deposit is held; its client going away drops it.
  EXPECT_EQ(table.PendingDeposits(), 1);
  client_ends.clear();
  table.ExpireDeposits();
  EXPECT_EQ(table.PendingDeposits(), 0);
  // Regions off: nothing is taken.
  RegionTable off(RegionLimits{}, nullptr);
  UniqueFd client_end;
  EXPECT_EQ(off.Deposit(MakeDeposit(shm.fd(), TestToken(), &client_end)).code(),
            absl::StatusCode::kFailedPrecondition);
}

// At most max_deposits are held; a deposit goes when it is claimed (once),
// when its holder closes, or deposit_ttl after it arrived, and the server's
// descriptors of it close then.
TEST(RegionTableTest, DepositsAreBoundedClaimedOnceAndExpire) {
  RegionLimits limits = On();
  limits.max_deposits = 2;
  limits.deposit_ttl = absl::Hours(1);
  RegionTable table(limits, nullptr);
  TestShm shm(4096);
  UniqueFd end1, end2, end3;
  const std::string t1 = TestToken(), t2 = TestToken(), t3 = TestToken();
  ASSERT_TRUE(table.Deposit(MakeDeposit(shm.fd(), t1, &end1)).ok());
  ASSERT_TRUE(table.Deposit(MakeDeposit(shm.fd(), t2, &end2)).ok());
  absl::Status full = table.Deposit(MakeDeposit(shm.fd(), t3, &end3));
  EXPECT_EQ(full.code(), absl::StatusCode::kResourceExhausted) << full;
  EXPECT_THAT(std::string(full.message()),
              HasSubstr("the server holds 2 deposits not yet claimed: at most 2"));
  EXPECT_TRUE(ServerClosed(end3));  // refused: nothing of it is kept
  table.ExpireDeposits();           // within the hour: both stay
  EXPECT_EQ(table.PendingDeposits(), 2);
  EXPECT_FALSE(ServerClosed(end1));

  // Claimed once: the room is free again, and the token is spent.
  ASSERT_TRUE(table.Register("alice", System("r", t1, 0, 4096)).ok());
  EXPECT_EQ(table.PendingDeposits(), 1);
  absl::Status spent = table.Register("alice", System("s", t1, 0, 4096));
  EXPECT_EQ(spent.code(), absl::StatusCode::kNotFound) << spent;
  ASSERT_TRUE(table.Deposit(MakeDeposit(shm.fd(), t3, &end3)).ok());
  EXPECT_EQ(table.PendingDeposits(), 2);

  // A deposit whose client went away goes at the next sweep, and cannot be
  // claimed.
  end2.reset();
  table.ExpireDeposits();
  EXPECT_EQ(table.PendingDeposits(), 1);
  EXPECT_EQ(table.Register("alice", System("s", t2, 0, 4096)).code(),
            absl::StatusCode::kNotFound);

  // With no time to live, a deposit is never claimable and the sweep closes it.
  limits.deposit_ttl = absl::ZeroDuration();
  RegionTable brief(limits, nullptr);
  UniqueFd end4;
  const std::string t4 = TestToken();
  ASSERT_TRUE(brief.Deposit(MakeDeposit(shm.fd(), t4, &end4)).ok());
  absl::Status expired = brief.Register("alice", System("r", t4, 0, 4096));
  EXPECT_EQ(expired.code(), absl::StatusCode::kNotFound) << expired;
  EXPECT_THAT(std::string(expired.message()), HasSubstr("unclaimed for 0"));
  EXPECT_EQ(brief.PendingDeposits(), 0);
  EXPECT_TRUE(ServerClosed(end4));
  UniqueFd end5;
  ASSERT_TRUE(brief.Deposit(MakeDeposit(shm.fd(), TestToken(), &end5)).ok());
  brief.ExpireDeposits();
  EXPECT_EQ(brief.PendingDeposits(), 0);
  EXPECT_TRUE(ServerClosed(end5));
}

// The memfd a region maps can neither shrink nor grow: the client's
// ftruncate fails, and the server's mapping stays whole.
TEST(RegionTableTest, ARegisteredMemfdCannotShrink) {
  Shm shm(3 * 4096, 5);
  RegionTable table(On(), nullptr);
  ASSERT_TRUE(table.Register("alice", System("r", shm.Deposit(table), 0, 3 * 4096)).ok());
  EXPECT_EQ(ftruncate(shm.fd(), 0), -1);
  EXPECT_EQ(errno, EPERM);
  EXPECT_EQ(ftruncate(shm.fd(), 4096), -1);
  EXPECT_EQ(fcntl(shm.fd(), F_ADD_SEALS, 0), -1);  // and the seals are final
  auto slice = table.Resolve("alice", Ref("r", 2 * 4096, 4096), 2, "q.region");
  ASSERT_TRUE(slice.ok()) << slice.status();
  EXPECT_EQ(std::memcmp(slice->data, shm.data() + 2 * 4096, 4096), 0);  // the last page reads
}

TEST(RegionTableTest, OffUnlessEnabled) {
  Shm shm(4096);
  RegionTable table(RegionLimits{}, nullptr);
  absl::Status s = table.Register("alice", System("r", TestToken(), 0, 8));
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(s.message()), HasSubstr("--allow_shared_memory"));
  EXPECT_EQ(table.Resolve("alice", Ref("r", 0, 2), 2, "q.region").status().code(),
            absl::StatusCode::kFailedPrecondition);
}

TEST(RegionTableTest, AnUnregisteredRegionStaysMappedForTheRequestHoldingIt) {
  auto shm = std::make_unique<Shm>(4096, 7);
  RegionTable table(On(), nullptr);
  ASSERT_TRUE(table.Register("alice", System("r", shm->Deposit(table), 0, 4096)).ok());
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
  // ...and the client's memfd and mapping go too, yet the held range still
  // reads the bytes (the server's mapping keeps them).
  std::vector<char> expected(shm->data(), shm->data() + 4096);
  shm.reset();
  EXPECT_EQ(std::memcmp(held->data, expected.data(), 4096), 0);
  held->data[10] = 42;  // and may still be written
  EXPECT_EQ(held->data[10], 42);
}

TEST(RegionTableTest, IdleRegionsWhoseHolderClosedAreReclaimed) {
  Shm kept(4096), gone(4096), busy(4096);
  RegionTable table(On(), nullptr);
  ASSERT_TRUE(table.Register("alice", System("kept", kept.Deposit(table), 0, 4096)).ok());
  ASSERT_TRUE(table.Register("alice", System("gone", gone.Deposit(table), 0, 4096)).ok());
  ASSERT_TRUE(table.Register("alice", System("busy", busy.Deposit(table), 0, 4096)).ok());
  ASSERT_TRUE(table.Register("bob", System("bobs", gone.Deposit(table), 0, 4096)).ok());
  auto holding = table.Resolve("alice", Ref("busy", 0, 8), 2, "q.region");
  ASSERT_TRUE(holding.ok());
  gone.HangUp();
  busy.HangUp();
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

  // A CUDA region has no holder, and is never reclaimed by List.
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
