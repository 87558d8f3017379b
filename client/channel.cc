#include "client/channel.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/tensor_wire.h"

namespace attnserve {
namespace {

// While a caller sleeps on its slot it probes the server this often
// (GetServerInfo: a restart or a dead server ends the wait), each probe
// with this deadline.
constexpr int64_t kProbeEveryNs = 1'000'000'000;
constexpr auto kProbeDeadline = std::chrono::seconds(2);
// The longest single futex sleep (the wait re-checks the ring after it).
constexpr int64_t kSleepNs = 50'000'000;

constexpr char kReopen[] =
    "the server may have restarted or closed the channel (its region unregistered): open a new "
    "channel";

}  // namespace

absl::StatusOr<std::unique_ptr<RequestChannel>> Client::OpenChannel(
    const std::string& region_name, char* region_data, int64_t offset, int64_t byte_size,
    const ChannelOptions& options) {
  if (region_data == nullptr || offset < 0 || byte_size < 0) {
    return absl::InvalidArgumentError(
        "OpenChannel: region_data must be the region's address here, offset and byte_size >= 0");
  }
  char* base = region_data + offset;
  if (reinterpret_cast<uintptr_t>(base) % kChannelAlign != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "OpenChannel: the ring's address (region + offset ", offset, ") must be a multiple of ",
        kChannelAlign, " bytes"));
  }
  // Checked here too, so that the header is never written past the range.
  if (options.slot_count < static_cast<int32_t>(kChannelMinSlots) ||
      options.slot_count > static_cast<int32_t>(kChannelMaxSlots) ||
      options.slot_bytes < static_cast<int32_t>(kChannelMinSlotBytes) ||
      options.slot_bytes > static_cast<int32_t>(kChannelMaxSlotBytes) ||
      options.slot_bytes % kChannelAlign != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "OpenChannel: slot_count=", options.slot_count, " must be in [", kChannelMinSlots, ", ",
        kChannelMaxSlots, "] and slot_bytes=", options.slot_bytes, " in [", kChannelMinSlotBytes,
        ", ", kChannelMaxSlotBytes, "], a multiple of ", kChannelAlign));
  }
  const int64_t needed = ChannelBytes(options.slot_count, options.slot_bytes);
  if (byte_size < needed) {
    return absl::InvalidArgumentError(absl::StrCat("OpenChannel: byte_size=", byte_size,
                                                   " is less than the ring needs: ", needed,
                                                   " (ChannelBytes(slot_count, slot_bytes))"));
  }
  // Bytes this client's open channel polls are not written over: the server
  // would refuse the channel (FAILED_PRECONDITION), but the header written
  // first would already have garbled the other's calls.
  {
    absl::MutexLock lock(&rings_mu_);
    for (const OpenRing& ring : open_rings_) {
      if (ring.begin < base + needed && base < ring.end) {
        return absl::InvalidArgumentError(absl::StrCat(
            "OpenChannel: bytes [", offset, ", ", offset + needed, ") of region '", region_name,
            "' overlap the ring of ", ring.channel_id == 0 ? std::string("a channel opening")
                                                           : absl::StrCat("open channel ", ring.channel_id),
            " of this client: Close it first, or open the channel on other bytes"));
      }
    }
    open_rings_.push_back({base, base + needed, 0});
  }
  // The header and every control block from scratch (payloads need not be).
  auto* header = reinterpret_cast<ChannelHeader*>(base);
  std::memset(static_cast<void*>(header), 0, sizeof(ChannelHeader));
  for (int32_t i = 0; i < options.slot_count; ++i) {
    std::memset(static_cast<void*>(ChannelSlot(base, options.slot_bytes, i)), 0,
                sizeof(SlotControl));
  }
  header->magic = kChannelMagic;
  header->version = kChannelVersion;
  header->slot_count = static_cast<uint32_t>(options.slot_count);
  header->slot_bytes = static_cast<uint32_t>(options.slot_bytes);
  std::atomic_thread_fence(std::memory_order_seq_cst);

  grpc::ClientContext ctx;
  PrepareContext(&ctx);
  v1::OpenChannelRequest req;
  req.mutable_ring()->set_name(region_name);
  req.mutable_ring()->set_offset(offset);
  req.mutable_ring()->set_byte_size(byte_size);
  if (absl::Status g = ExpectIncarnation(&req); !g.ok()) return g;
  req.set_lease_id(lease_id());
  v1::OpenChannelResponse resp;
  grpc::Status s = stub_->OpenChannel(&ctx, req, &resp);
  if (!s.ok()) {
    ForgetRing(base);
    return FromGrpc(s);
  }
  Learn(resp.incarnation());
  {
    absl::MutexLock lock(&rings_mu_);
    for (OpenRing& ring : open_rings_) {
      if (ring.begin == base) ring.channel_id = resp.channel_id();
    }
  }
  std::unique_ptr<RequestChannel> channel(new RequestChannel());
  channel->client_ = this;
  channel->base_ = base;
  channel->id_ = resp.channel_id();
  channel->incarnation_ = resp.incarnation();
  channel->slot_count_ = options.slot_count;
  channel->slot_bytes_ = options.slot_bytes;
  channel->spin_ns_ = std::max<int64_t>(options.spin_us, 0) * 1000;
  channel->timeout_s_ = options_.timeout_s;
  channel->seq_.assign(static_cast<size_t>(options.slot_count), 0);
  for (int32_t i = options.slot_count - 1; i >= 0; --i) channel->free_.push_back(i);
  return channel;
}

void Client::ForgetRing(const char* begin) {
  absl::MutexLock lock(&rings_mu_);
  open_rings_.erase(std::remove_if(open_rings_.begin(), open_rings_.end(),
                                   [begin](const OpenRing& r) { return r.begin == begin; }),
                    open_rings_.end());
}

RequestChannel::~RequestChannel() { Close().IgnoreError(); }

absl::Status RequestChannel::Close() {
  bool again = false;
  {
    absl::MutexLock lock(&mu_);
    if (close_answered_) return absl::OkStatus();
    closed_ = true;
    again = close_sent_;
    close_sent_ = true;
  }
  freed_.SignalAll();
  if (!again) client_->ForgetRing(base_);  // this client writes it no more
  grpc::ClientContext ctx;
  client_->PrepareContext(&ctx);
  ctx.set_deadline(std::chrono::system_clock::now() + kProbeDeadline);
  v1::CloseChannelRequest req;
  req.set_channel_id(id_);
  v1::CloseChannelResponse resp;
  absl::Status status = Client::FromGrpc(client_->stub()->CloseChannel(&ctx, req, &resp));
  // A second send that finds no channel: the first one closed it.
  if (again && absl::IsNotFound(status)) status = absl::OkStatus();
  if (!OutcomeUnknown(status)) {
    absl::MutexLock lock(&mu_);
    close_answered_ = true;
  }
  return status;
}

absl::StatusOr<int32_t> RequestChannel::Acquire(int64_t deadline_ns) {
  absl::MutexLock lock(&mu_);
  int64_t next_probe = 0;
  for (;;) {
    if (closed_) {
      return absl::FailedPreconditionError(absl::StrCat("channel ", id_, " is closed"));
    }
    // A slot whose caller gave up is free once its answer has come.
    for (size_t i = 0; i < abandoned_.size(); ++i) {
      const int32_t slot = abandoned_[i];
      if (ChannelSlot(base_, slot_bytes_, slot)->response_seq.load(std::memory_order_acquire) ==
          seq_[slot]) {
        free_.push_back(slot);
        abandoned_.erase(abandoned_.begin() + static_cast<ptrdiff_t>(i));
        break;
      }
    }
    if (!free_.empty()) {
      const int32_t slot = free_.back();
      free_.pop_back();
      return slot;
    }
    if (free_.empty() && abandoned_.size() == static_cast<size_t>(slot_count_) &&
        absl::GetCurrentTimeNanos() >= next_probe) {
      // Every slot waits for an answer its caller gave up on: while the
      // server answers probes those answers come and free the slots (waited
      // for below, up to the deadline); once it does not, none will.
      mu_.Unlock();
      const absl::Status here = Probe();
      mu_.Lock();
      if (!here.ok()) {
        return absl::UnavailableError(absl::StrCat("every slot of channel ", id_,
                                                   " waits for an answer that never came (",
                                                   here.message(), ")"));
      }
      next_probe = absl::GetCurrentTimeNanos() + kProbeEveryNs;
      continue;  // the lock was let go: look again
    }
    const int64_t now = absl::GetCurrentTimeNanos();
    if (deadline_ns != 0 && now >= deadline_ns) {
      return absl::DeadlineExceededError(
          absl::StrCat("no slot of channel ", id_, " freed up before the deadline"));
    }
    // Abandoned slots are re-checked every millisecond.
    const int64_t wait_ns = abandoned_.empty() ? (deadline_ns == 0 ? kSleepNs : deadline_ns - now)
                                               : 1'000'000;
    freed_.WaitWithTimeout(&mu_, absl::Nanoseconds(std::min<int64_t>(wait_ns, kSleepNs)));
  }
}

void RequestChannel::Release(int32_t slot) {
  {
    absl::MutexLock lock(&mu_);
    free_.push_back(slot);
  }
  freed_.Signal();
}

absl::Status RequestChannel::Probe() {
  grpc::ClientContext ctx;
  client_->PrepareContext(&ctx);
  ctx.set_deadline(std::chrono::system_clock::now() + kProbeDeadline);
  v1::ServerInfo info;
  grpc::Status s = client_->stub()->GetServerInfo(&ctx, v1::GetServerInfoRequest(), &info);
  if (!s.ok()) {
    if (s.error_code() == grpc::StatusCode::UNAVAILABLE ||
        s.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED) {
      return absl::UnavailableError(absl::StrCat("channel ", id_,
                                                 ": the server does not answer (",
                                                 s.error_message(), "); ", kReopen));
    }
    return absl::OkStatus();  // e.g. a draining server: its answer may still come
  }
  if (info.incarnation() != incarnation_) {
    return absl::UnavailableError(absl::StrCat(
        "channel ", id_, " was opened on server incarnation ", incarnation_,
        ", which is gone (the server restarted; it is now ", info.incarnation(), "): ", kReopen));
  }
  return absl::OkStatus();
}

absl::Status RequestChannel::Wait(int32_t slot, uint64_t seq, int64_t deadline_ns) {
  SlotControl* control = ChannelSlot(base_, slot_bytes_, slot);
  const auto* header = reinterpret_cast<const ChannelHeader*>(base_);
  const int64_t spin_until = absl::GetCurrentTimeNanos() + spin_ns_;
  while (control->response_seq.load(std::memory_order_acquire) != seq) {
    if (absl::GetCurrentTimeNanos() >= spin_until) break;
    CpuRelax();
  }
  if (control->response_seq.load(std::memory_order_acquire) == seq) return absl::OkStatus();
  // Sleep: the server reads client_waiting after publishing an answer (both
  // sequentially consistent), so either it wakes us or we see the answer.
  int64_t next_probe = absl::GetCurrentTimeNanos() + kProbeEveryNs;
  absl::Status status;
  control->client_waiting.store(1, std::memory_order_seq_cst);
  for (;;) {
    const uint32_t word = control->client_wake.load(std::memory_order_seq_cst);
    if (control->response_seq.load(std::memory_order_seq_cst) == seq) break;
    if (header->closed_channel_id.load(std::memory_order_seq_cst) == id_) {
      // Closed after answering everything it took: this was never taken.
      if (control->response_seq.load(std::memory_order_acquire) == seq) break;
      status = absl::UnavailableError(
          absl::StrCat("channel ", id_, " was closed by the server before taking the request: ",
                       kReopen));
      break;
    }
    const int64_t now = absl::GetCurrentTimeNanos();
    if (deadline_ns != 0 && now >= deadline_ns) {
      status = absl::DeadlineExceededError(absl::StrCat(
          "no answer on channel ", id_, " within the deadline (", timeout_s_, " s); if ",
          kReopen));
      break;
    }
    if (now >= next_probe) {
      status = Probe();
      if (!status.ok()) break;
      next_probe = absl::GetCurrentTimeNanos() + kProbeEveryNs;
    }
    int64_t sleep_ns = std::min(kSleepNs, next_probe - now);
    if (deadline_ns != 0) sleep_ns = std::min(sleep_ns, deadline_ns - now);
    FutexWait(&control->client_wake, word, std::max<int64_t>(sleep_ns, 1));
  }
  control->client_waiting.store(0, std::memory_order_relaxed);
  return status;
}

absl::StatusOr<PrefillResult> RequestChannel::Prefill(const PrefillArgs& args) {
  PrefillResult result;
  absl::Status s = PrefillInto(args, &result);
  if (!s.ok()) return s;
  return result;
}

absl::Status RequestChannel::PrefillInto(const PrefillArgs& args, PrefillResult* result) {
  if (args.expected_incarnation == 0) {
    if (absl::Status g = client_->CheckGeometryAfterForget(); !g.ok()) return g;
  }
  const int64_t deadline_ns =
      timeout_s_ > 0 ? absl::GetCurrentTimeNanos() + static_cast<int64_t>(timeout_s_ * 1e9) : 0;
  auto acquired = Acquire(deadline_ns);
  if (!acquired.ok()) return acquired.status();
  const int32_t slot = *acquired;
  SlotControl* control = ChannelSlot(base_, slot_bytes_, slot);
  char* payload = ChannelPayload(base_, slot_bytes_, slot);
  {
    BorrowedMemory borrowed;
    grpc::ByteBuffer bytes = client_->EncodePrefill(args, &borrowed);
    const size_t n = bytes.Length();
    if (n > static_cast<size_t>(slot_bytes_)) {
      Release(slot);
      return absl::InvalidArgumentError(absl::StrCat(
          "the request needs ", n, " bytes, more than the channel's slot_bytes=", slot_bytes_,
          ": put its tensors in a region, or open the channel with larger slots"));
    }
    std::vector<grpc::Slice> slices;
    if (n > 0 && !bytes.Dump(&slices).ok()) {
      Release(slot);
      return absl::InternalError("cannot read the encoded request");
    }
    size_t at = 0;
    for (const grpc::Slice& s : slices) {
      std::memcpy(payload + at, s.begin(), s.size());
      at += s.size();
    }
    control->method.store(static_cast<uint32_t>(ChannelMethod::kPrefill),
                          std::memory_order_relaxed);
    control->request_bytes.store(static_cast<uint32_t>(n), std::memory_order_relaxed);
  }
  const uint64_t seq = ++seq_[slot];
  control->request_seq.store(seq, std::memory_order_seq_cst);
  auto* header = reinterpret_cast<ChannelHeader*>(base_);
  if (header->server_sleeping.load(std::memory_order_seq_cst) != 0) {
    header->server_wake.fetch_add(1, std::memory_order_seq_cst);
    FutexWakeAll(&header->server_wake);
  }
  absl::Status waited = Wait(slot, seq, deadline_ns);
  if (!waited.ok()) {
    absl::MutexLock lock(&mu_);
    abandoned_.push_back(slot);  // free again if its answer still comes
    return waited;
  }
  const int32_t code = control->status_code.load(std::memory_order_relaxed);
  const uint32_t n = std::min<uint32_t>(control->response_bytes.load(std::memory_order_relaxed),
                                        static_cast<uint32_t>(slot_bytes_));
  absl::Status status;
  if (code != 0) {
    status = absl::Status(static_cast<absl::StatusCode>(code), absl::string_view(payload, n));
  } else {
    grpc::Slice piece(payload, n, grpc::Slice::STATIC_SLICE);
    grpc::ByteBuffer bytes(&piece, 1);
    status = client_->DecodePrefill(bytes, result);
  }
  Release(slot);
  return status;
}

}  // namespace attnserve
