// RegionTable: shared-memory regions that requests name instead of carrying
// tensor bytes (docs/transport.md).
//
// A region is memory the client and the server both map: a POSIX shared
// memory object (system region, mapped here with shm_open + mmap) or CUDA
// device memory exported by cudaIpcGetMemHandle (cuda region, opened by the
// backend). It belongs to the tenant that registered it; names are unique
// on the server, so another tenant naming it gets PERMISSION_DENIED rather
// than a region of its own by the same name.
//
// Lifetime: the table holds one reference to each region and every request
// that resolved a range of it holds another (RegionSlice::region) until its
// done callback has run. Unregister drops the table's reference: the name
// is gone at once, and the mapping goes when the last request holding it
// finishes. So a region unregistered while in use stays valid for the
// requests already holding it, and nothing ever reads unmapped memory.
//
// A client that exits without unregistering leaves its regions in the
// table, and the server's mapping keeps their memory valid (a POSIX shm
// object lives while it is mapped, even after shm_unlink). They are
// reclaimed by UnregisterRegion from any connection of the same tenant
// (ListRegions shows them), at a server restart, or, for a system region
// whose shm key no longer names the object mapped (the owner, or Python's
// resource tracker, unlinked it), automatically when that tenant next
// registers a region or lists its regions and the region is not in use.
//
// Thread-safe.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "server/backend/region_device.h"

namespace attnserve {

enum class RegionKind { kSystem, kCuda };

// What RegisterRegion asks for.
struct RegionSpec {
  std::string name;
  RegionKind kind = RegionKind::kSystem;
  // kSystem: the shm_open name and the mapped range [offset, offset + byte_size).
  std::string key;
  int64_t offset = 0;
  // kCuda: the cudaIpcMemHandle_t bytes and the device.
  std::string ipc_handle;
  int32_t device_id = 0;
  int64_t byte_size = 0;
  uint64_t lease = 0;  // held under this lease (lease_table.h); 0: none
};

// One mapped region. Unmapped (and unregistered / closed) when the last
// reference goes.
struct Region {
  Region() = default;
  Region(const Region&) = delete;
  Region& operator=(const Region&) = delete;
  ~Region();

  std::string name;
  std::string tenant;
  uint64_t lease = 0;          // held under this lease; 0: none
  RegionKind kind = RegionKind::kSystem;
  char* data = nullptr;        // host (system) or device (cuda) address of byte 0
  int64_t byte_size = 0;
  bool registered = false;     // system: page-locked by RegionDevice::RegisterHost
  // system
  std::string key;
  int64_t offset = 0;
  void* map_base = nullptr;    // what mmap returned (data - in-page offset)
  int64_t map_bytes = 0;
  uint64_t dev = 0, ino = 0;   // the shm object mapped
  // cuda
  int32_t device_id = 0;
  RegionDevice* device = nullptr;
  // References held by open request channels (channel_table.h), which do not
  // keep a region from being reclaimed or count as in use.
  mutable std::atomic<int32_t> channel_holds{0};
};

// A range of a region, resolved for one request. Holding it keeps the
// region mapped.
struct RegionSlice {
  std::shared_ptr<const Region> region;
  char* data = nullptr;
  int64_t bytes = 0;
  bool on_device() const { return region->kind == RegionKind::kCuda; }
  bool registered() const { return region->registered; }
};

// A tensor's region reference as the edge received it (views the request).
struct RegionRefView {
  bool set = false;
  absl::string_view name;
  int64_t offset = 0;
  int64_t byte_size = 0;
};

struct RegionLimits {
  bool enabled = false;               // --allow_shared_memory
  int32_t max_regions_per_tenant = 16;
  int64_t max_bytes_per_tenant = int64_t{64} << 30;
};

// ListRegions' view of one region.
struct RegionInfoData {
  std::string name;
  RegionKind kind = RegionKind::kSystem;
  std::string key;
  int64_t offset = 0;
  int64_t byte_size = 0;
  int32_t device_id = 0;
  int32_t in_use = 0;
  bool registered = false;
  bool key_exists = false;
  uint64_t lease = 0;
};

class RegionTable {
 public:
  RegionTable(RegionLimits limits, RegionDevice* device);
  RegionTable(const RegionTable&) = delete;
  RegionTable& operator=(const RegionTable&) = delete;

  bool enabled() const { return limits_.enabled; }

  // Maps the region and adds it for `tenant`. Errors (nothing changes):
  // FAILED_PRECONDITION when regions are off or the kind needs a device this
  // server lacks; INVALID_ARGUMENT naming the field and bound (name, key,
  // offset, byte_size, ipc_handle); ALREADY_EXISTS for a name in use;
  // RESOURCE_EXHAUSTED past the tenant's count or byte cap; NOT_FOUND when
  // the shm key does not exist or is smaller than offset + byte_size.
  absl::Status Register(const std::string& tenant, const RegionSpec& spec);

  // Removes the name (NOT_FOUND if unknown, PERMISSION_DENIED if another
  // tenant's). Requests holding the region keep it until they finish.
  absl::Status Unregister(const std::string& tenant, absl::string_view name);

  // The tenant's regions, by name. Reclaims the tenant's idle system regions
  // whose shm key has vanished first.
  std::vector<RegionInfoData> List(const std::string& tenant);

  // Unregisters every region `tenant` holds under `lease` (0: every region
  // of the tenant) and returns their names, ascending.
  std::vector<std::string> TakeHeld(const std::string& tenant, uint64_t lease);

  // The range `ref` names, for a tensor of `field` (for errors, e.g.
  // "q.region") whose element size is `elem_bytes`. NOT_FOUND for an
  // unknown name, PERMISSION_DENIED for another tenant's region,
  // INVALID_ARGUMENT naming the field and bound for a range out of bounds or
  // misaligned, FAILED_PRECONDITION when regions are off.
  absl::StatusOr<RegionSlice> Resolve(const std::string& tenant, const RegionRefView& ref,
                                      int64_t elem_bytes, absl::string_view field) const;

  // Called (outside the table's lock) with each region the table drops:
  // unregistered or reclaimed. Request channels on it close (channel_table.h).
  void SetReleaseListener(std::function<void(const Region*)> listener) {
    release_listener_ = std::move(listener);
  }

  // Regions and their bytes held by `tenant` (gauges).
  struct Usage {
    int32_t count = 0;
    int64_t bytes = 0;
  };
  Usage TenantUsage(const std::string& tenant) const;

 private:
  // Drops the tenant's regions that are not in use and whose shm key no
  // longer names the object mapped; appends them to *dropped.
  void ReclaimVanished(const std::string& tenant, std::vector<std::shared_ptr<Region>>* dropped)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::StatusOr<std::shared_ptr<Region>> MapSystem(const RegionSpec& spec) const;
  absl::StatusOr<std::shared_ptr<Region>> OpenCuda(const RegionSpec& spec) const;

  const RegionLimits limits_;
  RegionDevice* const device_;
  std::function<void(const Region*)> release_listener_;  // set before any request
  mutable absl::Mutex mu_;
  absl::flat_hash_map<std::string, std::shared_ptr<Region>> regions_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<std::string, Usage> usage_ ABSL_GUARDED_BY(mu_);
};

}  // namespace attnserve
