// RegionTable: shared-memory regions that requests name instead of carrying
// tensor bytes (docs/transport.md).
//
// A region is memory the client and the server both map: a sealed memfd the
// client handed over the region socket (system region, mapped here with
// mmap) or CUDA device memory exported by cudaIpcGetMemHandle (cuda region,
// opened by the backend). It belongs to the tenant that registered it;
// names are unique on the server, so another tenant naming it gets
// PERMISSION_DENIED rather than a region of its own by the same name.
//
// System regions come in two steps. The edge (server/region_socket/) takes
// a memfd and a claim token from a local process and Deposit()s them; the
// table accepts only a memfd sealed against shrinking (F_SEAL_SHRINK), so
// that nothing can ever cut the file under the server's mapping (which would
// end the server with SIGBUS), and holds it for deposit_ttl at most, with at
// most max_deposits held at once. RegisterRegion, authenticated, then names
// the token: the deposit is claimed (once) and mapped as the caller's
// tenant's region. Possession of the file descriptor is what lets a client
// register memory, so no tenant can map another's (memfds have no name
// anyone could open).
//
// Lifetime: the table holds one reference to each region and every request
// that resolved a range of it holds another (RegionSlice::region) until its
// done callback has run. Unregister drops the table's reference: the name
// is gone at once, and the mapping goes when the last request holding it
// finishes. So a region unregistered while in use stays valid for the
// requests already holding it, and nothing ever reads unmapped memory.
//
// Each system region keeps its depositor's connection (the holder). A
// client that exits without unregistering closes it; the server's mapping
// keeps the memory valid, and the region is reclaimed automatically when
// that tenant next registers a region or lists its regions and the region is
// not in use, or by UnregisterRegion from any connection of the same tenant
// (ListRegions shows them), or at a server restart.
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
#include "absl/time/time.h"
#include "server/core/client_fd.h"
#include "server/backend/region_device.h"

namespace attnserve {

enum class RegionKind { kSystem, kCuda };

// What RegisterRegion asks for.
struct RegionSpec {
  std::string name;
  RegionKind kind = RegionKind::kSystem;
  // kSystem: the token of a deposit (Deposit) and the mapped range
  // [offset, offset + byte_size) of its memfd. `key` is the shm_open name
  // clients sent before 0.2.0: refused when set.
  std::string claim_token;
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
  std::string key;             // the memfd's name (memfd_create's), for ListRegions
  int64_t offset = 0;          // of byte 0 in the memfd
  uint64_t file_dev = 0;       // the memfd's identity (fstat): one memfd deposited
  uint64_t file_ino = 0;       // twice maps the same memory under two names
  void* map_base = nullptr;    // what mmap returned (data - in-page offset)
  int64_t map_bytes = 0;
  ClientFd holder;             // the depositor's connection (see the banner)
  // cuda
  int32_t device_id = 0;
  RegionDevice* device = nullptr;
  // References held by open request channels (channel_table.h), which do not
  // keep a region from being reclaimed or count as in use.
  mutable std::atomic<int32_t> channel_holds{0};
  // Dropped from the table (unregistered, reclaimed, its lease ended): set
  // before the release listener runs, so that a channel opened on it
  // meanwhile (channel_table.h) finds it gone.
  mutable std::atomic<bool> released{false};
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

// Whether two slices share bytes of memory: within one region, or across
// regions over the same memory (one memfd registered under two names, or
// two ranges of it that overlap; CUDA regions by their device addresses).
bool SlicesOverlap(const RegionSlice& a, const RegionSlice& b);

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
  // Deposits not yet claimed: at most this many held at once, each for at
  // most deposit_ttl after it arrived (docs/transport.md).
  int32_t max_deposits = 64;
  absl::Duration deposit_ttl = absl::Seconds(10);
};

// A memfd handed to the server over the region socket, waiting for the
// RegisterRegion that names its token.
struct RegionDeposit {
  std::string claim_token;  // kClaimTokenBytes (common/region_socket.h)
  ClientFd memfd;           // the client's descriptor, until checked
  ClientFd holder;          // the depositor's connection
};

// ListRegions' view of one region.
struct RegionInfoData {
  std::string name;
  RegionKind kind = RegionKind::kSystem;
  std::string key;         // system: the memfd's name
  int64_t offset = 0;
  int64_t byte_size = 0;
  int32_t device_id = 0;
  int32_t in_use = 0;
  bool registered = false;
  bool key_exists = false;  // system: its holder connection is still open
  uint64_t lease = 0;
};

class RegionTable {
 public:
  RegionTable(RegionLimits limits, RegionDevice* device);
  RegionTable(const RegionTable&) = delete;
  RegionTable& operator=(const RegionTable&) = delete;

  bool enabled() const { return limits_.enabled; }

  // Holds a memfd until RegisterRegion claims it. Errors (the deposit is
  // closed): FAILED_PRECONDITION when regions are off; INVALID_ARGUMENT for
  // a token that is not kClaimTokenBytes, a descriptor that is not a memfd
  // (a regular file on the kernel's shmem, not hugetlbfs), not open
  // read-write, not sealed against shrinking (F_SEAL_SHRINK) or sealed
  // against writing; ALREADY_EXISTS for a token held already;
  // RESOURCE_EXHAUSTED when max_deposits are held. Drops expired deposits
  // first.
  absl::Status Deposit(RegionDeposit deposit);

  // Closes the deposits past deposit_ttl and those whose holder closed.
  // The region socket calls it every second.
  void ExpireDeposits();
  // Deposits held now (tests).
  int32_t PendingDeposits() const;

  // Maps the region and adds it for `tenant`. Errors (nothing changes):
  // FAILED_PRECONDITION when regions are off or the kind needs a device this
  // server lacks; INVALID_ARGUMENT naming the field and bound (name,
  // system.key (no longer served), system.claim_token, offset, byte_size,
  // ipc_handle); ALREADY_EXISTS for a name in use; RESOURCE_EXHAUSTED past
  // the tenant's count or byte cap; NOT_FOUND when no deposit holds the
  // claim token (never sent, claimed already, or expired). A system region
  // claims its deposit once the name and the caps pass: a later error
  // (offset + byte_size past the memfd, the mapping refused) closes it.
  absl::Status Register(const std::string& tenant, const RegionSpec& spec);

  // Removes the name (NOT_FOUND if unknown, PERMISSION_DENIED if another
  // tenant's). Requests holding the region keep it until they finish.
  absl::Status Unregister(const std::string& tenant, absl::string_view name);

  // The tenant's regions, by name. Reclaims the tenant's idle system regions
  // whose holder closed first.
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
  // Drops the tenant's system regions that are not in use and whose holder
  // closed; appends them to *dropped.
  void ReclaimAbandoned(const std::string& tenant, std::vector<std::shared_ptr<Region>>* dropped)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Closes the deposits past their deadline or whose holder closed (moved
  // to *closed, so that they close after the lock).
  void ExpireDepositsLocked(absl::Time now, std::vector<RegionDeposit>* closed)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::StatusOr<std::shared_ptr<Region>> MapSystem(const RegionSpec& spec,
                                                    RegionDeposit deposit) const;
  absl::StatusOr<std::shared_ptr<Region>> OpenCuda(const RegionSpec& spec) const;

  const RegionLimits limits_;
  RegionDevice* const device_;
  std::function<void(const Region*)> release_listener_;  // set before any request
  mutable absl::Mutex mu_;
  absl::flat_hash_map<std::string, std::shared_ptr<Region>> regions_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<std::string, Usage> usage_ ABSL_GUARDED_BY(mu_);
  struct HeldDeposit {
    RegionDeposit deposit;
    absl::Time deadline;
  };
  absl::flat_hash_map<std::string, HeldDeposit> deposits_ ABSL_GUARDED_BY(mu_);
};

}  // namespace attnserve
