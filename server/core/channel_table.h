// ChannelTable: the request channels open on the server (docs/transport.md,
// "Request channels"): which tenant owns each, the ring it polls in a
// system region, and the caps. It decides; the edge (server/channel/) runs
// the poller of each channel it admits, behind ChannelEndpoint.
//
// OpenChannel validates the ring's header once (common/channel_layout.h)
// and copies slot_count and slot_bytes into the ChannelRing it hands the
// edge, which never reads them from the shared memory again. A channel
// holds its region (ChannelRing::region) so that the ring stays mapped; that
// hold does not keep the region from being unregistered or reclaimed, and a
// region that goes closes its channels (RegionTable's release listener).
//
// Thread-safe.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "server/core/region_table.h"

namespace attnserve {

// An open channel's ring, as validated at OpenChannel.
struct ChannelRing {
  uint64_t id = 0;
  std::string tenant;
  // The region (a hold counted in Region::channel_holds) and the ring in it.
  std::shared_ptr<const Region> region;
  char* base = nullptr;      // the header, 64-byte aligned
  int64_t byte_size = 0;     // of the RegionRef
  int32_t slot_count = 0;    // copied from the header at open
  int32_t slot_bytes = 0;
};

// What the edge runs for an open channel.
class ChannelEndpoint {
 public:
  virtual ~ChannelEndpoint() = default;
  // Called once, when the channel closes (CloseChannel, its region
  // unregistered or reclaimed, shutdown): stop taking requests; those in
  // flight finish and are answered, then the ring is marked closed and the
  // region released. Must not block.
  virtual void Close() = 0;
};

struct ChannelLimits {
  int32_t max_channels_per_tenant = 4;  // --max_channels_per_tenant
};

class ChannelTable {
 public:
  explicit ChannelTable(ChannelLimits limits) : limits_(limits) {}
  ChannelTable(const ChannelTable&) = delete;
  ChannelTable& operator=(const ChannelTable&) = delete;
  ~ChannelTable() { CloseAll(); }

  using MakeEndpoint =
      std::function<absl::StatusOr<std::shared_ptr<ChannelEndpoint>>(const ChannelRing&)>;

  // Opens a channel for `tenant` on the ring at `ring` (a range of one of its
  // system regions), validating the header there, and starts its endpoint
  // (make). Returns the channel id (random, non-zero). Errors name the field
  // and the bound: FAILED_PRECONDITION when regions are off; NOT_FOUND /
  // PERMISSION_DENIED for an unknown / another tenant's region;
  // INVALID_ARGUMENT for a CUDA region, a range out of the region or not
  // 64-byte aligned, a bad header; FAILED_PRECONDITION for a range that
  // overlaps an open channel's ring (named by its id); RESOURCE_EXHAUSTED
  // past --max_channels_per_tenant.
  // `lease`: the channel is held under it (0: none).
  absl::StatusOr<uint64_t> Open(const std::string& tenant, const RegionTable& regions,
                                const RegionRefView& ring, const MakeEndpoint& make,
                                uint64_t lease = 0);

  // NOT_FOUND for an unknown (or already closed) id, PERMISSION_DENIED for
  // another tenant's channel.
  absl::Status Close(const std::string& tenant, uint64_t id);

  // Closes every channel on `region` (it was unregistered or reclaimed);
  // returns the tenants whose count changed.
  std::vector<std::string> CloseRegion(const Region* region);
  // Closes every channel (shutdown); returns the tenants that had any.
  std::vector<std::string> CloseAll();
  // Closes every channel `tenant` holds under `lease` (0: all of the
  // tenant's); returns their ids, ascending.
  std::vector<uint64_t> CloseHeld(const std::string& tenant, uint64_t lease);
  // The tenant's channels (lease 0: all; else that lease's) with their leases.
  std::vector<std::pair<uint64_t, uint64_t>> List(const std::string& tenant,
                                                  uint64_t lease = 0) const;

  int32_t TenantChannels(const std::string& tenant) const;

  // OK unless `slice` (an output range `field` [offset, offset + bytes) of
  // region `name`, named as the request names it) shares bytes with an
  // open channel's ring: an answer written there would overwrite the ring's
  // header or its slots while the channel's poller reads them.
  // FAILED_PRECONDITION naming the field and, for `tenant`'s own channel,
  // its id.
  absl::Status CheckNotRing(const std::string& tenant, const RegionSlice& slice, absl::string_view field,
                            absl::string_view name, int64_t offset) const;

 private:
  struct Entry {
    std::string tenant;
    uint64_t lease = 0;
    const Region* region = nullptr;
    std::shared_ptr<ChannelEndpoint> endpoint;
    // The ring's bytes: no two open channels share one (two pollers on one
    // ring would each take the other's requests), whatever names the memory
    // is registered under (SlicesOverlap: one memfd deposited twice).
    char* ring = nullptr;
    int64_t ring_bytes = 0;
  };
  // An entry's ring as a slice of its region.
  static RegionSlice RingOf(const Entry& e);
  // FAILED_PRECONDITION when `mine` (the ring OpenChannel names as `ring`)
  // shares bytes with an open channel's ring; that channel is named by its
  // id when it is `tenant`'s.
  absl::Status RingOverlapError(const std::string& tenant, const RegionSlice& mine,
                                const RegionRefView& ring) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const ChannelLimits limits_;
  mutable absl::Mutex mu_;
  absl::flat_hash_map<uint64_t, Entry> channels_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<std::string, int32_t> per_tenant_ ABSL_GUARDED_BY(mu_);
};

// Checks a ring header of `bytes` bytes at `base` (read once; the fields may
// change under it) and returns its slot_count and slot_bytes. `field` names
// the RegionRef in errors ("ring"). INVALID_ARGUMENT naming the header field
// and its bound.
struct ChannelGeometry {
  int32_t slot_count = 0;
  int32_t slot_bytes = 0;
};
absl::StatusOr<ChannelGeometry> ReadChannelHeader(const char* base, int64_t bytes,
                                                  absl::string_view field);

}  // namespace attnserve
