#include "server/core/channel_table.h"

#include <algorithm>
#include <utility>
#include <vector>

#include "absl/random/random.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/channel_layout.h"

namespace attnserve {
namespace {

// A channel's hold on its region: counted in Region::channel_holds while it
// lives, so that the hold keeps the mapping but not the region.
struct RegionHold {
  explicit RegionHold(std::shared_ptr<const Region> r) : region(std::move(r)) {
    region->channel_holds.fetch_add(1);
  }
  ~RegionHold() { region->channel_holds.fetch_sub(1); }
  std::shared_ptr<const Region> region;
};

// One word of the header, read once (the client may be writing it).
uint32_t ReadWord(const uint32_t* word) { return __atomic_load_n(word, __ATOMIC_RELAXED); }

}  // namespace

absl::StatusOr<ChannelGeometry> ReadChannelHeader(const char* base, int64_t bytes,
                                                  absl::string_view field) {
  if (bytes < static_cast<int64_t>(sizeof(ChannelHeader))) {
    return absl::InvalidArgumentError(absl::StrCat(field, ".byte_size=", bytes,
                                                   " is less than the ring's header (",
                                                   sizeof(ChannelHeader), " bytes)"));
  }
  const auto* header = reinterpret_cast<const ChannelHeader*>(base);
  const uint32_t magic = ReadWord(&header->magic);
  const uint32_t version = ReadWord(&header->version);
  const uint32_t slot_count = ReadWord(&header->slot_count);
  const uint32_t slot_bytes = ReadWord(&header->slot_bytes);
  if (magic != kChannelMagic) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "ring header magic=0x%08x, expected 0x%08x: write the header (common/channel_layout.h) "
        "before OpenChannel",
        magic, kChannelMagic));
  }
  if (version != kChannelVersion) {
    return absl::InvalidArgumentError(absl::StrCat("ring header version=", version,
                                                   ": this server reads version ",
                                                   kChannelVersion));
  }
  if (slot_count < kChannelMinSlots || slot_count > kChannelMaxSlots) {
    return absl::InvalidArgumentError(absl::StrCat("ring header slot_count=", slot_count,
                                                   " out of range [", kChannelMinSlots, ", ",
                                                   kChannelMaxSlots, "]"));
  }
  if (slot_bytes < kChannelMinSlotBytes || slot_bytes > kChannelMaxSlotBytes ||
      slot_bytes % kChannelAlign != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "ring header slot_bytes=", slot_bytes, " out of range [", kChannelMinSlotBytes, ", ",
        kChannelMaxSlotBytes, "] or not a multiple of ", kChannelAlign));
  }
  const int64_t needed = ChannelBytes(slot_count, slot_bytes);
  if (needed > bytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        field, ".byte_size=", bytes, " is less than the ring's layout: 64 + slot_count * (64 + "
        "slot_bytes) = 64 + ", slot_count, " * (64 + ", slot_bytes, ") = ", needed));
  }
  return ChannelGeometry{static_cast<int32_t>(slot_count), static_cast<int32_t>(slot_bytes)};
}

RegionSlice ChannelTable::RingOf(const Entry& e) {
  // A view of the ring's region (no reference taken: the entry's channel
  // holds the region).
  return RegionSlice{std::shared_ptr<const Region>(std::shared_ptr<const Region>(), e.region), e.ring, e.ring_bytes};
}

absl::Status ChannelTable::RingOverlapError(const std::string& tenant, const RegionSlice& mine,
                                            const RegionRefView& ring) const {
  for (const auto& [id, other] : channels_) {
    if (!SlicesOverlap(mine, RingOf(other))) continue;
    // Another tenant's channel (the same memory registered by both) is not
    // named: its id is that tenant's.
    return absl::FailedPreconditionError(absl::StrCat(
        "ring: bytes [", ring.offset, ", ", ring.offset + mine.bytes, ") of region '", ring.name,
        "' overlap the ring of ",
        other.tenant == tenant
            ? absl::StrCat("open channel ", absl::Hex(id, absl::kZeroPad16),
                           ": CloseChannel it, or open the channel on bytes no open channel uses")
            : "another tenant's open channel (the same memory, registered by both): open the "
              "channel on bytes no open channel uses"));
  }
  return absl::OkStatus();
}

absl::StatusOr<uint64_t> ChannelTable::Open(const std::string& tenant, const RegionTable& regions,
                                            const RegionRefView& ring, const MakeEndpoint& make,
                                            uint64_t lease) {
  if (!regions.enabled()) {
    return absl::FailedPreconditionError(
        "request channels live in shared-memory regions, which are off on this server (start "
        "it with --allow_shared_memory)");
  }
  auto slice = regions.Resolve(tenant, ring, /*elem_bytes=*/1, "ring");
  if (!slice.ok()) return slice.status();
  if (slice->region->kind != RegionKind::kSystem) {
    return absl::InvalidArgumentError(absl::StrCat(
        "ring.name: region '", ring.name,
        "' is a CUDA region: a channel needs a system region (the server polls it from the host)"));
  }
  if (reinterpret_cast<uintptr_t>(slice->data) % kChannelAlign != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "ring.offset=", ring.offset, ": the ring's address in region '", ring.name,
        "' must be a multiple of ", kChannelAlign, " bytes"));
  }
  {
    absl::MutexLock lock(&mu_);
    const int32_t open = per_tenant_[tenant];
    if (open >= limits_.max_channels_per_tenant) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "tenant has ", open, " open channels: at most ", limits_.max_channels_per_tenant,
          " (--max_channels_per_tenant); CloseChannel one"));
    }
    // Checked before the header is read: bytes inside an open channel's
    // ring are that ring's header or slots, changing under its poller.
    if (auto s = RingOverlapError(tenant, *slice, ring); !s.ok()) return s;
  }
  auto geometry = ReadChannelHeader(slice->data, slice->bytes, "ring");
  if (!geometry.ok()) return geometry.status();
  ChannelRing r;
  r.tenant = tenant;
  auto hold = std::make_shared<RegionHold>(slice->region);
  r.region = std::shared_ptr<const Region>(hold, hold->region.get());
  r.base = slice->data;
  r.byte_size = slice->bytes;
  r.slot_count = geometry->slot_count;
  r.slot_bytes = geometry->slot_bytes;
  slice->region.reset();  // the ring holds it now, through the hold
  {
    absl::BitGen gen;
    absl::MutexLock lock(&mu_);
    do {
      r.id = absl::Uniform<uint64_t>(gen);
    } while (r.id == 0 || channels_.contains(r.id));
    // Counted now, so that concurrent opens cannot pass the cap.
    if (per_tenant_[tenant] >= limits_.max_channels_per_tenant) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "tenant has ", per_tenant_[tenant], " open channels: at most ",
          limits_.max_channels_per_tenant, " (--max_channels_per_tenant); CloseChannel one"));
    }
    // A region dropped since Resolve: its release listener (CloseRegion)
    // may have run before this channel was listed, and would not close it.
    // (Dropped after this check, the listener finds it listed.)
    if (r.region->released.load()) {
      return absl::NotFoundError(absl::StrCat("ring.name: region '", ring.name,
                                              "' was unregistered while the channel opened"));
    }
    // A ring already polled: the second poller would take the first's
    // requests and write answers into its slots. (Checked again: a channel
    // may have opened on these bytes since the check above.)
    if (auto s = RingOverlapError(tenant, RegionSlice{r.region, r.base, r.byte_size}, ring); !s.ok()) {
      return s;
    }
    per_tenant_[tenant] += 1;
    channels_[r.id] = Entry{tenant, lease, r.region.get(), nullptr, r.base, r.byte_size};
  }
  auto endpoint = make(r);
  absl::MutexLock lock(&mu_);
  auto it = channels_.find(r.id);
  if (!endpoint.ok() || it == channels_.end()) {
    // The endpoint did not start, or its region went meanwhile (the close
    // found no endpoint to stop: this one is stopped now).
    if (it != channels_.end()) {
      channels_.erase(it);
      per_tenant_[tenant] -= 1;
    }
    if (endpoint.ok()) (*endpoint)->Close();
    if (!endpoint.ok()) return endpoint.status();
    return absl::NotFoundError(absl::StrCat("ring.name: region '", ring.name,
                                            "' was unregistered while the channel opened"));
  }
  it->second.endpoint = *std::move(endpoint);
  return r.id;
}

absl::Status ChannelTable::Close(const std::string& tenant, uint64_t id) {
  std::shared_ptr<ChannelEndpoint> endpoint;
  {
    absl::MutexLock lock(&mu_);
    auto it = channels_.find(id);
    if (it == channels_.end()) {
      return absl::NotFoundError(absl::StrCat("channel_id=", id,
                                              " names no open channel (closed, its region "
                                              "unregistered, or from before a restart)"));
    }
    if (it->second.tenant != tenant) {
      return absl::PermissionDeniedError(
          absl::StrCat("channel_id=", id, " belongs to another tenant"));
    }
    endpoint = std::move(it->second.endpoint);
    per_tenant_[tenant] -= 1;
    channels_.erase(it);
  }
  if (endpoint != nullptr) endpoint->Close();
  return absl::OkStatus();
}

std::vector<std::string> ChannelTable::CloseRegion(const Region* region) {
  std::vector<std::shared_ptr<ChannelEndpoint>> closing;
  std::vector<std::string> tenants;
  {
    absl::MutexLock lock(&mu_);
    for (auto it = channels_.begin(); it != channels_.end();) {
      if (it->second.region != region) {
        ++it;
        continue;
      }
      if (it->second.endpoint != nullptr) closing.push_back(std::move(it->second.endpoint));
      per_tenant_[it->second.tenant] -= 1;
      tenants.push_back(it->second.tenant);
      channels_.erase(it++);
    }
  }
  for (const auto& endpoint : closing) endpoint->Close();
  return tenants;
}

std::vector<std::string> ChannelTable::CloseAll() {
  std::vector<std::shared_ptr<ChannelEndpoint>> closing;
  std::vector<std::string> tenants;
  {
    absl::MutexLock lock(&mu_);
    for (auto& [id, entry] : channels_) {
      if (entry.endpoint != nullptr) closing.push_back(std::move(entry.endpoint));
    }
    for (auto& [tenant, count] : per_tenant_) {
      if (count > 0) tenants.push_back(tenant);
      count = 0;
    }
    channels_.clear();
  }
  for (const auto& endpoint : closing) endpoint->Close();
  return tenants;
}

std::vector<uint64_t> ChannelTable::CloseHeld(const std::string& tenant, uint64_t lease) {
  std::vector<std::shared_ptr<ChannelEndpoint>> closing;
  std::vector<uint64_t> ids;
  {
    absl::MutexLock lock(&mu_);
    for (auto it = channels_.begin(); it != channels_.end();) {
      if (it->second.tenant != tenant || (lease != 0 && it->second.lease != lease)) {
        ++it;
        continue;
      }
      if (it->second.endpoint != nullptr) closing.push_back(std::move(it->second.endpoint));
      per_tenant_[tenant] -= 1;
      ids.push_back(it->first);
      channels_.erase(it++);
    }
  }
  for (const auto& endpoint : closing) endpoint->Close();
  std::sort(ids.begin(), ids.end());
  return ids;
}

std::vector<std::pair<uint64_t, uint64_t>> ChannelTable::List(const std::string& tenant,
                                                              uint64_t lease) const {
  absl::MutexLock lock(&mu_);
  std::vector<std::pair<uint64_t, uint64_t>> out;
  for (const auto& [id, e] : channels_) {
    if (e.tenant == tenant && (lease == 0 || e.lease == lease)) out.emplace_back(id, e.lease);
  }
  std::sort(out.begin(), out.end());
  return out;
}

absl::Status ChannelTable::CheckNotRing(const std::string& tenant, const RegionSlice& slice,
                                        absl::string_view field, absl::string_view name,
                                        int64_t offset) const {
  absl::MutexLock lock(&mu_);
  for (const auto& [id, other] : channels_) {
    if (!SlicesOverlap(slice, RingOf(other))) continue;
    return absl::FailedPreconditionError(absl::StrCat(
        field, " [", offset, ", ", offset + slice.bytes, ") of region '", name, "' overlaps the ring of ",
        other.tenant == tenant ? absl::StrCat("open channel ", absl::Hex(id, absl::kZeroPad16))
                               : std::string("another tenant's open channel (the same memory, registered by both)"),
        ": an answer may not be written over a channel's ring; use bytes no open channel uses"));
  }
  return absl::OkStatus();
}

int32_t ChannelTable::TenantChannels(const std::string& tenant) const {
  absl::MutexLock lock(&mu_);
  auto it = per_tenant_.find(tenant);
  return it == per_tenant_.end() ? 0 : it->second;
}

}  // namespace attnserve
