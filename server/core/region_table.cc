#include "server/core/region_table.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"

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

absl::Status CheckKey(absl::string_view key) {
  if (key.size() < 2 || key.size() > kMaxKeyChars || key[0] != '/' ||
      key.find('/', 1) != absl::string_view::npos || key.find('\0') != absl::string_view::npos) {
    return absl::InvalidArgumentError(absl::StrCat(
        "system.key '", key.substr(0, 64),
        "' must be a POSIX shm name: '/' then 1 to 254 characters with no '/'"));
  }
  return absl::OkStatus();
}

// True when `key` still names the object (dev, ino).
bool KeyNames(const std::string& key, uint64_t dev, uint64_t ino) {
  const int fd = shm_open(key.c_str(), O_RDONLY, 0);
  if (fd < 0) return false;
  struct stat st {};
  const bool same = fstat(fd, &st) == 0 && static_cast<uint64_t>(st.st_dev) == dev &&
                    static_cast<uint64_t>(st.st_ino) == ino;
  close(fd);
  return same;
}

// Regions the table dropped under its lock, handed to the release listener
// when this goes out of scope (declared before the lock, so after it is
// released).
class DroppedRegions {
 public:
  explicit DroppedRegions(const std::function<void(const Region*)>& listener)
      : listener_(listener) {}
  ~DroppedRegions() {
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

absl::StatusOr<std::shared_ptr<Region>> RegionTable::MapSystem(const RegionSpec& spec) const {
  if (absl::Status s = CheckKey(spec.key); !s.ok()) return s;
  if (spec.offset < 0) {
    return absl::InvalidArgumentError(absl::StrCat("system.offset=", spec.offset, " is negative"));
  }
  const int fd = shm_open(spec.key.c_str(), O_RDWR, 0);
  if (fd < 0) {
    const int err = errno;
    if (err == ENOENT) {
      return absl::NotFoundError(absl::StrCat("system.key '", spec.key,
                                              "': no such shared-memory object"));
    }
    if (err == EACCES) {
      return absl::PermissionDeniedError(absl::StrCat(
          "system.key '", spec.key, "': the server may not open it read-write"));
    }
    return absl::InvalidArgumentError(
        absl::StrCat("system.key '", spec.key, "': cannot open: ", std::strerror(err)));
  }
  struct stat st {};
  if (fstat(fd, &st) != 0) {
    close(fd);
    return absl::InternalError(absl::StrCat("system.key '", spec.key, "': fstat failed"));
  }
  const int64_t object_bytes = static_cast<int64_t>(st.st_size);
  if (spec.offset > object_bytes || spec.byte_size > object_bytes - spec.offset) {
    close(fd);
    return absl::InvalidArgumentError(absl::StrCat(
        "system.offset + system.byte_size = ", spec.offset, " + ", spec.byte_size,
        " exceeds the size of '", spec.key, "' (", object_bytes, " bytes)"));
  }
  const int64_t page = sysconf(_SC_PAGESIZE);
  const int64_t start = spec.offset / page * page;
  const int64_t map_bytes = spec.offset - start + spec.byte_size;
  void* base = mmap(nullptr, static_cast<size_t>(map_bytes), PROT_READ | PROT_WRITE, MAP_SHARED,
                    fd, static_cast<off_t>(start));
  const int map_err = errno;
  close(fd);  // the mapping keeps the object
  if (base == MAP_FAILED) {
    return absl::ResourceExhaustedError(absl::StrCat("system.key '", spec.key, "': cannot map ",
                                                     map_bytes, " bytes: ",
                                                     std::strerror(map_err)));
  }
  auto region = std::make_shared<Region>();
  region->kind = RegionKind::kSystem;
  region->map_base = base;
  region->map_bytes = map_bytes;
  region->data = static_cast<char*>(base) + (spec.offset - start);
  region->byte_size = spec.byte_size;
  region->key = spec.key;
  region->offset = spec.offset;
  region->dev = static_cast<uint64_t>(st.st_dev);
  region->ino = static_cast<uint64_t>(st.st_ino);
  region->device = device_;
  if (device_ != nullptr) region->registered = device_->RegisterHost(base, map_bytes);
  return region;
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

absl::Status RegionTable::Register(const std::string& tenant, const RegionSpec& spec) {
  if (!limits_.enabled) {
    return absl::FailedPreconditionError(
        "shared-memory regions are off on this server (start it with --allow_shared_memory)");
  }
  if (absl::Status s = CheckName(spec.name, "name"); !s.ok()) return s;
  const char* size_field = spec.kind == RegionKind::kSystem ? "system.byte_size" : "cuda.byte_size";
  if (spec.byte_size < 1 || spec.byte_size > limits_.max_bytes_per_tenant) {
    return absl::InvalidArgumentError(
        absl::StrCat(size_field, "=", spec.byte_size, " out of range [1, ",
                     limits_.max_bytes_per_tenant, "] (--max_region_bytes_per_tenant)"));
  }
  {
    DroppedRegions dropped(release_listener_);
    absl::MutexLock lock(&mu_);
    ReclaimVanished(tenant, &dropped.regions);
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
  }
  // Mapping (and page-locking) may take a while: not under the lock.
  auto mapped = spec.kind == RegionKind::kSystem ? MapSystem(spec) : OpenCuda(spec);
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

void RegionTable::ReclaimVanished(const std::string& tenant,
                                  std::vector<std::shared_ptr<Region>>* dropped) {
  for (auto it = regions_.begin(); it != regions_.end();) {
    const Region& r = *it->second;
    // Only the table and request channels hold it: no request is using it.
    // (A channel of a client that died closes with its region.)
    if (r.tenant == tenant && r.kind == RegionKind::kSystem &&
        it->second.use_count() - r.channel_holds.load() == 1 && !KeyNames(r.key, r.dev, r.ino)) {
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
  ReclaimVanished(tenant, &dropped.regions);
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
    info.key_exists =
        region->kind == RegionKind::kSystem && KeyNames(region->key, region->dev, region->ino);
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
  if (ref.byte_size < 0 || ref.byte_size > region->byte_size - ref.offset) {
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
