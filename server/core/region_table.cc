#include "server/core/region_table.h"

#include <fcntl.h>
#include <linux/magic.h>
#include <poll.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/vfs.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "absl/time/clock.h"
#include "common/region_socket.h"

namespace attnserve {
namespace {

constexpr size_t kMaxNameChars = 128;
constexpr size_t kMaxKeyChars = 255;  // NAME_MAX
constexpr size_t kIpcHandleBytes = 64;  // sizeof(cudaIpcMemHandle_t)

absl::Status CheckName(absl::string_view name, absl::string_view field) {
  if (name.empty() || name.size() > kMaxNameChars) {
    return absl::InvalidArgumentError(absl::StrCat(field, " has ", name.size(),
                                                   " characters: 1 to ", kMaxNameChars));
  }
  for (char c : name) {
    const bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
                    c == '_' || c == '.' || c == '-';
    if (!ok) {
      return absl::InvalidArgumentError(
          absl::StrCat(field, " '", name, "' may hold only [A-Za-z0-9_.-]"));
    }
  }
  return absl::OkStatus();
}

// What a RegisterRegion with system.key gets: the field is no longer served.
constexpr char kKeyRemoved[] =
    "system.key: registration by POSIX shm name was removed in attnserve 0.2.0 (any process "
    "could name another's object, and shrink it under the server); send a sealed memfd over the "
    "server's region socket (ServerInfo.region_socket) and name it by system.claim_token: "
    "docs/transport.md, \"Shared-memory regions\" (the clients' RegisterSystemRegion and "
    "register_system_region do both)";

// A memfd the server may map for good: a regular file on the kernel's
// shmem (not hugetlbfs, whose faults may fail), open read-write, that can
// never shrink (so no access through the mapping can fault past its end)
// and may be written.
absl::Status CheckDepositFd(int fd) {
  // F_GET_SEALS first: it answers only for the kernel's shmem and hugetlbfs
  // files and fails at once for anything else, without asking the file's
  // filesystem. fstat and fstatfs on a file of a FUSE mount wait for its
  // daemon, which a hostile one never answers, and this runs on the region
  // socket's one thread.
  const int seals = fcntl(fd, F_GET_SEALS);
  if (seals < 0) {
    return absl::InvalidArgumentError(
        "the file descriptor is not a memfd: create the region's memory with "
        "memfd_create(name, MFD_CLOEXEC | MFD_ALLOW_SEALING) (no MFD_HUGETLB; files on disk and "
        "sockets are refused)");
  }
  struct stat st {};
  if (fstat(fd, &st) != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("the file descriptor cannot be read (fstat: ", std::strerror(errno), ")"));
  }
  struct statfs fs {};
  if (!S_ISREG(st.st_mode) || fstatfs(fd, &fs) != 0 || fs.f_type != TMPFS_MAGIC) {
    return absl::InvalidArgumentError(
        "the file descriptor is not a memfd: create the region's memory with "
        "memfd_create(name, MFD_CLOEXEC | MFD_ALLOW_SEALING) (no MFD_HUGETLB; files on disk and "
        "sockets are refused)");
  }
  const int flags = fcntl(fd, F_GETFL);
  if (flags < 0 || (flags & O_ACCMODE) != O_RDWR) {
    return absl::InvalidArgumentError(
        "the memfd is not open read-write: send the descriptor memfd_create returned (the "
        "server writes outputs into regions)");
  }
  if ((seals & F_SEAL_SHRINK) == 0) {
    return absl::InvalidArgumentError(
        "the memfd is not sealed against shrinking: create it with memfd_create(name, "
        "MFD_CLOEXEC | MFD_ALLOW_SEALING), size it, then add F_SEAL_SHRINK (fcntl(fd, "
        "F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL)) before sending it; memory "
        "that can shrink under the server's mapping is refused");
  }
#ifdef F_SEAL_FUTURE_WRITE
  constexpr int kWriteSeals = F_SEAL_WRITE | F_SEAL_FUTURE_WRITE;
#else
  constexpr int kWriteSeals = F_SEAL_WRITE;
#endif
  if ((seals & kWriteSeals) != 0) {
    return absl::InvalidArgumentError(
        "the memfd is sealed against writing (F_SEAL_WRITE or F_SEAL_FUTURE_WRITE): the server "
        "writes outputs into regions");
  }
  return absl::OkStatus();
}

// True when the depositor's end of `holder` is closed (or shut down).
bool HolderGone(const ClientFd& holder) {
  if (!holder.valid()) return true;
  pollfd p{holder.get(), POLLRDHUP, 0};
  if (poll(&p, 1, 0) < 0) return false;
  return (p.revents & (POLLHUP | POLLRDHUP | POLLERR | POLLNVAL)) != 0;
}

// The name memfd_create was given ("/memfd:NAME (deleted)" in /proc), or
// "" when it cannot be read.
std::string MemfdName(int fd) {
  char link[64];
  char target[512];
  snprintf(link, sizeof(link), "/proc/self/fd/%d", fd);
  const ssize_t n = readlink(link, target, sizeof(target));
  if (n <= 0) return "";
  absl::string_view t(target, static_cast<size_t>(n));
  constexpr absl::string_view kPrefix = "/memfd:", kSuffix = " (deleted)";
  if (!absl::ConsumePrefix(&t, kPrefix)) return "";
  absl::ConsumeSuffix(&t, kSuffix);
  return std::string(t);
}

// Regions the table dropped under its lock, handed to the release listener
// when this goes out of scope (declared before the lock, so after it is
// released).
class DroppedRegions {
 public:
  explicit DroppedRegions(const std::function<void(const Region*)>& listener)
      : listener_(listener) {}
  ~DroppedRegions() {
    for (const auto& r : regions) r->released.store(true);
    if (listener_) {
      for (const auto& r : regions) listener_(r.get());
    }
  }
  std::vector<std::shared_ptr<Region>> regions;

 private:
  const std::function<void(const Region*)>& listener_;
};

}  // namespace

Region::~Region() {
  if (kind == RegionKind::kSystem) {
    if (registered && device != nullptr) device->UnregisterHost(map_base);
    if (map_base != nullptr) munmap(map_base, static_cast<size_t>(map_bytes));
  } else if (data != nullptr && device != nullptr) {
    device->CloseIpc(data);
  }
}

RegionTable::RegionTable(RegionLimits limits, RegionDevice* device)
    : limits_(limits), device_(device) {}

bool SlicesOverlap(const RegionSlice& a, const RegionSlice& b) {
  if (a.bytes <= 0 || b.bytes <= 0) return false;
  const Region& ra = *a.region;
  const Region& rb = *b.region;
  if (ra.kind != rb.kind) return false;
  // Where each slice starts, in one address space: the process's (one
  // region; CUDA regions, whose device addresses are unique) or the memfd's.
  int64_t a0 = 0, b0 = 0;
  if (&ra == &rb || ra.kind == RegionKind::kCuda) {
    a0 = static_cast<int64_t>(reinterpret_cast<uintptr_t>(a.data));
    b0 = static_cast<int64_t>(reinterpret_cast<uintptr_t>(b.data));
  } else {
    if (ra.file_ino == 0 || ra.file_ino != rb.file_ino || ra.file_dev != rb.file_dev) return false;
    a0 = ra.offset + (a.data - ra.data);
    b0 = rb.offset + (b.data - rb.data);
  }
  return a0 < b0 + b.bytes && b0 < a0 + a.bytes;
}

absl::StatusOr<std::shared_ptr<Region>> RegionTable::MapSystem(const RegionSpec& spec,
                                                               RegionDeposit deposit) const {
  struct stat st {};
  if (fstat(deposit.memfd.get(), &st) != 0) {
    return absl::InternalError(absl::StrCat("system.claim_token: fstat of the memfd failed: ",
                                            std::strerror(errno)));
  }
  // Sealed against shrinking: the size read now only ever grows.
  const int64_t object_bytes = static_cast<int64_t>(st.st_size);
  if (spec.offset > object_bytes || spec.byte_size > object_bytes - spec.offset) {
    return absl::InvalidArgumentError(absl::StrCat(
        "system.offset + system.byte_size = ", spec.offset, " + ", spec.byte_size,
        " exceeds the size of the memfd (", object_bytes, " bytes); deposit it again"));
  }
  const int64_t page = sysconf(_SC_PAGESIZE);
  const int64_t start = spec.offset / page * page;
  const int64_t map_bytes = spec.offset - start + spec.byte_size;
  void* base = mmap(nullptr, static_cast<size_t>(map_bytes), PROT_READ | PROT_WRITE, MAP_SHARED,
                    deposit.memfd.get(), static_cast<off_t>(start));
  if (base == MAP_FAILED) {
    const int err = errno;
    const std::string why = absl::StrCat("system.claim_token: cannot map ", map_bytes,
                                         " bytes of the memfd read-write: ", std::strerror(err));
    return err == ENOMEM ? absl::ResourceExhaustedError(why) : absl::InvalidArgumentError(why);
  }
  auto region = std::make_shared<Region>();
  region->kind = RegionKind::kSystem;
  region->map_base = base;
  region->map_bytes = map_bytes;
  region->data = static_cast<char*>(base) + (spec.offset - start);
  region->byte_size = spec.byte_size;
  region->key = MemfdName(deposit.memfd.get());
  region->offset = spec.offset;
  region->file_dev = static_cast<uint64_t>(st.st_dev);
  region->file_ino = static_cast<uint64_t>(st.st_ino);
  region->holder = std::move(deposit.holder);
  region->device = device_;
  if (device_ != nullptr) region->registered = device_->RegisterHost(base, map_bytes);
  return region;  // the memfd closes; the mapping keeps the memory
}

absl::StatusOr<std::shared_ptr<Region>> RegionTable::OpenCuda(const RegionSpec& spec) const {
  if (spec.ipc_handle.size() != kIpcHandleBytes) {
    return absl::InvalidArgumentError(absl::StrCat("cuda.ipc_handle has ", spec.ipc_handle.size(),
                                                   " bytes: a cudaIpcMemHandle_t has ",
                                                   kIpcHandleBytes));
  }
  if (spec.device_id < 0) {
    return absl::InvalidArgumentError(absl::StrCat("cuda.device_id=", spec.device_id,
                                                   " is negative"));
  }
  RegionDevice fallback;
  RegionDevice* device = device_ != nullptr ? device_ : &fallback;
  auto opened = device->OpenIpc(spec.ipc_handle, spec.device_id, spec.byte_size);
  if (!opened.ok()) return opened.status();
  auto region = std::make_shared<Region>();
  region->kind = RegionKind::kCuda;
  region->data = static_cast<char*>(*opened);
  region->byte_size = spec.byte_size;
  region->device_id = spec.device_id;
  region->device = device_;
  return region;
}

absl::Status RegionTable::Deposit(RegionDeposit deposit) {
  if (!limits_.enabled) {
    return absl::FailedPreconditionError(
        "shared-memory regions are off on this server (start it with --allow_shared_memory)");
  }
  if (deposit.claim_token.size() != kClaimTokenBytes) {
    return absl::InvalidArgumentError(absl::StrCat("the claim token has ",
                                                   deposit.claim_token.size(), " bytes: ",
                                                   kClaimTokenBytes));
  }
  if (!deposit.memfd.valid()) {
    return absl::InvalidArgumentError("a deposit carries one file descriptor, the memfd");
  }
  if (absl::Status s = CheckDepositFd(deposit.memfd.get()); !s.ok()) return s;
  std::vector<RegionDeposit> closed;  // closed after the lock
  absl::MutexLock lock(&mu_);
  const absl::Time now = absl::Now();
  ExpireDepositsLocked(now, &closed);
  if (static_cast<int64_t>(deposits_.size()) >= limits_.max_deposits) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "the server holds ", deposits_.size(), " deposits not yet claimed: at most ",
        limits_.max_deposits, "; each goes when RegisterRegion claims it, when its connection "
        "closes, or ", absl::FormatDuration(limits_.deposit_ttl), " after it arrived"));
  }
  if (deposits_.contains(deposit.claim_token)) {
    return absl::AlreadyExistsError(
        "a deposit holds this claim token already: draw 16 fresh random bytes for each deposit");
  }
  std::string token = deposit.claim_token;
  deposits_.emplace(std::move(token), HeldDeposit{std::move(deposit), now + limits_.deposit_ttl});
  return absl::OkStatus();
}

void RegionTable::ExpireDepositsLocked(absl::Time now, std::vector<RegionDeposit>* closed) {
  for (auto it = deposits_.begin(); it != deposits_.end();) {
    if (now >= it->second.deadline || HolderGone(it->second.deposit.holder)) {
      closed->push_back(std::move(it->second.deposit));
      deposits_.erase(it++);
    } else {
      ++it;
    }
  }
}

void RegionTable::ExpireDeposits() {
  std::vector<RegionDeposit> closed;  // closed after the lock
  absl::MutexLock lock(&mu_);
  ExpireDepositsLocked(absl::Now(), &closed);
}

int32_t RegionTable::PendingDeposits() const {
  absl::MutexLock lock(&mu_);
  return static_cast<int32_t>(deposits_.size());
}

absl::Status RegionTable::Register(const std::string& tenant, const RegionSpec& spec) {
  if (!limits_.enabled) {
    return absl::FailedPreconditionError(
        "shared-memory regions are off on this server (start it with --allow_shared_memory)");
  }
  if (absl::Status s = CheckName(spec.name, "name"); !s.ok()) return s;
  const bool system = spec.kind == RegionKind::kSystem;
  if (system) {
    if (!spec.key.empty()) return absl::InvalidArgumentError(kKeyRemoved);
    if (spec.claim_token.size() != kClaimTokenBytes) {
      return absl::InvalidArgumentError(absl::StrCat(
          "system.claim_token has ", spec.claim_token.size(), " bytes: ", kClaimTokenBytes,
          " (the token sent with the memfd over the region socket, ServerInfo.region_socket)"));
    }
    if (spec.offset < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("system.offset=", spec.offset, " is negative"));
    }
  }
  const char* size_field = system ? "system.byte_size" : "cuda.byte_size";
  if (spec.byte_size < 1 || spec.byte_size > limits_.max_bytes_per_tenant) {
    return absl::InvalidArgumentError(
        absl::StrCat(size_field, "=", spec.byte_size, " out of range [1, ",
                     limits_.max_bytes_per_tenant, "] (--max_region_bytes_per_tenant)"));
  }
  RegionDeposit claimed;
  {
    std::vector<RegionDeposit> expired;  // closed after the lock
    DroppedRegions dropped(release_listener_);
    absl::MutexLock lock(&mu_);
    ReclaimAbandoned(tenant, &dropped.regions);
    auto it = regions_.find(spec.name);
    if (it != regions_.end()) {
      if (it->second->tenant != tenant) {
        return absl::AlreadyExistsError(
            absl::StrCat("name '", spec.name, "' is taken by another tenant's region"));
      }
      return absl::AlreadyExistsError(absl::StrCat(
          "name '", spec.name, "' is already registered (UnregisterRegion it first)"));
    }
    const Usage used = usage_[tenant];
    if (used.count >= limits_.max_regions_per_tenant) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "tenant holds ", used.count, " regions: at most ", limits_.max_regions_per_tenant,
          " (--max_regions_per_tenant); UnregisterRegion one (ListRegions shows them)"));
    }
    if (spec.byte_size > limits_.max_bytes_per_tenant - used.bytes) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "tenant holds ", used.bytes, " bytes of regions; ", spec.byte_size, " more exceed ",
          limits_.max_bytes_per_tenant, " (--max_region_bytes_per_tenant)"));
    }
    if (system) {
      ExpireDepositsLocked(absl::Now(), &expired);
      auto held = deposits_.find(spec.claim_token);
      if (held == deposits_.end()) {
        return absl::NotFoundError(absl::StrCat(
            "system.claim_token: no memfd is deposited under this token (never sent over the "
            "region socket, claimed already, its connection closed, or unclaimed for ",
            absl::FormatDuration(limits_.deposit_ttl), ")"));
      }
      claimed = std::move(held->second.deposit);
      deposits_.erase(held);
    }
  }
  // Mapping (and page-locking) may take a while: not under the lock.
  auto mapped = system ? MapSystem(spec, std::move(claimed)) : OpenCuda(spec);
  if (!mapped.ok()) return mapped.status();
  std::shared_ptr<Region> region = *std::move(mapped);
  region->name = spec.name;
  region->tenant = tenant;
  region->lease = spec.lease;
  absl::MutexLock lock(&mu_);
  // Checked again: another call may have taken the name or the room meanwhile
  // (the region unmaps as it goes out of scope).
  Usage& used = usage_[tenant];
  if (regions_.contains(spec.name)) {
    return absl::AlreadyExistsError(absl::StrCat("name '", spec.name, "' is already registered"));
  }
  if (used.count >= limits_.max_regions_per_tenant ||
      spec.byte_size > limits_.max_bytes_per_tenant - used.bytes) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "tenant's regions are at --max_regions_per_tenant=", limits_.max_regions_per_tenant,
        " or --max_region_bytes_per_tenant=", limits_.max_bytes_per_tenant));
  }
  used.count += 1;
  used.bytes += spec.byte_size;
  regions_.emplace(spec.name, std::move(region));
  return absl::OkStatus();
}

absl::Status RegionTable::Unregister(const std::string& tenant, absl::string_view name) {
  if (!limits_.enabled) {
    return absl::FailedPreconditionError(
        "shared-memory regions are off on this server (start it with --allow_shared_memory)");
  }
  DroppedRegions dropped(release_listener_);  // unmapped after the lock, if nothing else holds it
  absl::MutexLock lock(&mu_);
  auto it = regions_.find(name);
  if (it == regions_.end()) {
    return absl::NotFoundError(absl::StrCat("region '", name, "' is not registered"));
  }
  if (it->second->tenant != tenant) {
    return absl::PermissionDeniedError(
        absl::StrCat("region '", name, "' belongs to another tenant"));
  }
  Usage& used = usage_[tenant];
  used.count -= 1;
  used.bytes -= it->second->byte_size;
  dropped.regions.push_back(std::move(it->second));
  regions_.erase(it);
  return absl::OkStatus();
}

std::vector<std::string> RegionTable::TakeHeld(const std::string& tenant, uint64_t lease) {
  std::vector<std::string> names;
  if (!limits_.enabled) return names;
  DroppedRegions dropped(release_listener_);  // unmapped after the lock, if nothing else holds it
  absl::MutexLock lock(&mu_);
  for (auto it = regions_.begin(); it != regions_.end();) {
    const Region& r = *it->second;
    if (r.tenant == tenant && (lease == 0 || r.lease == lease)) {
      Usage& used = usage_[tenant];
      used.count -= 1;
      used.bytes -= r.byte_size;
      names.push_back(it->first);
      dropped.regions.push_back(std::move(it->second));
      regions_.erase(it++);
    } else {
      ++it;
    }
  }
  std::sort(names.begin(), names.end());
  return names;
}

void RegionTable::ReclaimAbandoned(const std::string& tenant,
                                   std::vector<std::shared_ptr<Region>>* dropped) {
  for (auto it = regions_.begin(); it != regions_.end();) {
    const Region& r = *it->second;
    // Only the table and request channels hold it: no request is using it.
    // (A channel of a client that died closes with its region.)
    if (r.tenant == tenant && r.kind == RegionKind::kSystem &&
        it->second.use_count() - r.channel_holds.load() == 1 && HolderGone(r.holder)) {
      Usage& used = usage_[tenant];
      used.count -= 1;
      used.bytes -= r.byte_size;
      dropped->push_back(std::move(it->second));
      regions_.erase(it++);
    } else {
      ++it;
    }
  }
}

std::vector<RegionInfoData> RegionTable::List(const std::string& tenant) {
  std::vector<RegionInfoData> out;
  if (!limits_.enabled) return out;
  DroppedRegions dropped(release_listener_);
  absl::MutexLock lock(&mu_);
  ReclaimAbandoned(tenant, &dropped.regions);
  for (const auto& [name, region] : regions_) {
    if (region->tenant != tenant) continue;
    RegionInfoData info;
    info.name = name;
    info.kind = region->kind;
    info.key = region->key;
    info.offset = region->offset;
    info.byte_size = region->byte_size;
    info.device_id = region->device_id;
    info.in_use = static_cast<int32_t>(region.use_count() - 1 - region->channel_holds.load());
    info.registered = region->registered;
    info.lease = region->lease;
    info.key_exists = region->kind == RegionKind::kSystem && !HolderGone(region->holder);
    out.push_back(std::move(info));
  }
  std::sort(out.begin(), out.end(),
            [](const RegionInfoData& a, const RegionInfoData& b) { return a.name < b.name; });
  return out;
}

absl::StatusOr<RegionSlice> RegionTable::Resolve(const std::string& tenant,
                                                 const RegionRefView& ref, int64_t elem_bytes,
                                                 absl::string_view field) const {
  if (!limits_.enabled) {
    return absl::FailedPreconditionError(absl::StrCat(
        field, " names a region, but shared-memory regions are off on this server "
        "(--allow_shared_memory)"));
  }
  std::shared_ptr<const Region> region;
  {
    absl::MutexLock lock(&mu_);
    auto it = regions_.find(ref.name);
    if (it == regions_.end()) {
      return absl::NotFoundError(absl::StrCat(field, ".name: region '", ref.name,
                                              "' is not registered"));
    }
    if (it->second->tenant != tenant) {
      return absl::PermissionDeniedError(absl::StrCat(field, ".name: region '", ref.name,
                                                      "' belongs to another tenant"));
    }
    region = it->second;
  }
  if (ref.offset < 0 || ref.offset > region->byte_size) {
    return absl::InvalidArgumentError(absl::StrCat(field, ".offset=", ref.offset,
                                                   " out of range [0, ", region->byte_size,
                                                   "] (the size of region '", ref.name, "')"));
  }
  if (ref.byte_size < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, ".byte_size=", ref.byte_size, " is negative (a tensor's bytes, >= 0)"));
  }
  if (ref.byte_size > region->byte_size - ref.offset) {
    return absl::InvalidArgumentError(absl::StrCat(
        field, ".offset + ", field, ".byte_size = ", ref.offset, " + ", ref.byte_size,
        " exceeds the size of region '", ref.name, "' (", region->byte_size, " bytes)"));
  }
  char* data = region->data + ref.offset;
  if (elem_bytes > 1 && reinterpret_cast<uintptr_t>(data) % static_cast<uintptr_t>(elem_bytes)) {
    return absl::InvalidArgumentError(absl::StrCat(
        field, ".offset=", ref.offset, " misaligns the tensor: its address in region '",
        ref.name, "' must be a multiple of ", elem_bytes, " bytes (the element size)"));
  }
  RegionSlice slice;
  slice.region = std::move(region);
  slice.data = data;
  slice.bytes = ref.byte_size;
  return slice;
}

RegionTable::Usage RegionTable::TenantUsage(const std::string& tenant) const {
  absl::MutexLock lock(&mu_);
  auto it = usage_.find(tenant);
  return it == usage_.end() ? Usage{} : it->second;
}

}  // namespace attnserve
