#include "server/channel/channel_server.h"

#include <algorithm>
#include <cstring>
#include <string>
#include <system_error>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/channel_layout.h"
#include "grpcpp/support/slice.h"
#include "server/grpc/convert.h"
#include "spdlog/spdlog.h"

namespace attnserve {
namespace {

// Channel requests' ids (CallContext::request_id) have the top bit set, so
// that a gRPC call's cancellation (AttentionCore::Cancel by request id)
// never names one.
constexpr uint64_t kChannelRequestIdBit = uint64_t{1} << 63;

}  // namespace

// One request taken from a slot, until it is answered and its done callback
// has run (whichever is last deletes it: the done callback, or the taker
// when the core never saw it).
struct ChannelServer::Request {
  // Keeps the ring mapped until the request is deleted (the poller's thread
  // ends once every request it took is answered; the poller goes with the
  // last of them).
  std::shared_ptr<Poller> poller;
  int32_t slot = 0;
  uint64_t seq = 0;
  absl::Time start;
  absl::Time last_mark;
  int64_t bytes_in = 0;
  Metrics::Shape shape = Metrics::Shape::kPrefill;  // until the request is parsed
  // The slot's bytes, copied out once; the parsed request's in-place tensor
  // data points into them.
  std::shared_ptr<std::string> bytes;
  RecyclingPool<v1::PrefillRequest>::Ptr message;
  InPlaceTensors tensors;
  PrefillOutput out;
  std::atomic<bool> answered{false};
};

// The endpoint of one channel: its thread polls the ring until Close.
class ChannelServer::Poller final : public ChannelEndpoint,
                                    public std::enable_shared_from_this<Poller> {
 public:
  Poller(ChannelServer* server, ChannelRing ring)
      : server_(server),
        ring_(std::move(ring)),
        header_(reinterpret_cast<ChannelHeader*>(ring_.base)),
        taken_(static_cast<size_t>(ring_.slot_count)),
        busy_(new std::atomic<bool>[static_cast<size_t>(ring_.slot_count)]),
        copies_(static_cast<size_t>(ring_.slot_count)) {
    for (int32_t i = 0; i < ring_.slot_count; ++i) {
      // What the client left there: the next change is a request.
      taken_[i] = Slot(i)->request_seq.load(std::memory_order_acquire);
      busy_[i].store(false, std::memory_order_relaxed);
      copies_[i] = std::make_shared<std::string>();
    }
  }

  void Close() override {
    closing_.store(true, std::memory_order_release);
    header_->server_wake.fetch_add(1, std::memory_order_seq_cst);
    FutexWakeAll(&header_->server_wake);
  }

  const ChannelRing& ring() const { return ring_; }

  // The poller thread: takes requests until closed, then waits for the
  // requests it took and marks the ring closed.
  void Run() {
    const int64_t spin_ns = server_->options_.spin_us * 1000;
    const int64_t sleep_ns = absl::ToInt64Nanoseconds(server_->options_.sleep_timeout);
    int64_t last_request_ns = absl::GetCurrentTimeNanos();
    while (!closing_.load(std::memory_order_acquire)) {
      if (Scan()) {
        last_request_ns = absl::GetCurrentTimeNanos();
        continue;
      }
      if (absl::GetCurrentTimeNanos() - last_request_ns < spin_ns) {
        CpuRelax();
        continue;
      }
      // Sleep. The client reads server_sleeping after publishing a request
      // (both sequentially consistent): either it sees 1 and wakes us, or
      // the check below sees its request.
      header_->server_sleeping.store(1, std::memory_order_seq_cst);
      const uint32_t word = header_->server_wake.load(std::memory_order_seq_cst);
      if (!closing_.load(std::memory_order_acquire) && !Pending()) {
        FutexWait(&header_->server_wake, word, sleep_ns);
      }
      header_->server_sleeping.store(0, std::memory_order_relaxed);
    }
    {
      absl::MutexLock lock(&mu_);
      mu_.Await(absl::Condition(
          +[](int* n) { return *n == 0; }, &inflight_));
    }
    // Everything taken is answered: a client waiting on a slot whose request
    // was never taken learns that the channel is gone.
    header_->closed_channel_id.store(ring_.id, std::memory_order_seq_cst);
    for (int32_t i = 0; i < ring_.slot_count; ++i) WakeClient(Slot(i));
  }

  // Writes the answer to slot `slot`'s request into the slot, where the
  // client does not look until Publish. `status` OK: `response` is the
  // serialized response, which must fit the slot (else RESOURCE_EXHAUSTED is
  // written instead). Returns the code and the payload bytes written.
  std::pair<absl::StatusCode, int64_t> Write(int32_t slot, absl::Status status,
                                             grpc::ByteBuffer* response) {
    SlotControl* control = Slot(slot);
    char* payload = ChannelPayload(ring_.base, ring_.slot_bytes, slot);
    size_t n = 0;
    if (status.ok()) {
      n = response->Length();
      if (n > static_cast<size_t>(ring_.slot_bytes)) {
        status = absl::ResourceExhaustedError(absl::StrCat(
            "the response needs ", n, " bytes, more than the ring's slot_bytes=", ring_.slot_bytes,
            ": open the channel with slots of at least ", n,
            " bytes, or have output and LSE written to a region (output_region, lse_region)"));
      } else {
        std::vector<grpc::Slice> slices;
        if (n > 0 && response->Dump(&slices).ok()) {
          size_t at = 0;
          for (const grpc::Slice& s : slices) {
            std::memcpy(payload + at, s.begin(), s.size());
            at += s.size();
          }
        }
      }
    }
    if (!status.ok()) {
      const absl::string_view message = status.message();
      n = std::min(message.size(), static_cast<size_t>(ring_.slot_bytes));
      std::memcpy(payload, message.data(), n);
    }
    control->response_bytes.store(static_cast<uint32_t>(n), std::memory_order_relaxed);
    control->status_code.store(static_cast<int32_t>(status.code()), std::memory_order_relaxed);
    return {status.code(), static_cast<int64_t>(n)};
  }

  // Publishes the answer Write put in slot `slot` as request `seq`'s: the
  // client may read it from now on.
  void Publish(int32_t slot, uint64_t seq) {
    SlotControl* control = Slot(slot);
    busy_[slot].store(false, std::memory_order_release);
    control->response_seq.store(seq, std::memory_order_seq_cst);
    WakeClient(control);
  }

  // A request of this poller was answered (the last thing Finish does).
  void Done() {
    absl::MutexLock lock(&mu_);
    --inflight_;
  }

 private:
  SlotControl* Slot(int32_t i) const { return ChannelSlot(ring_.base, ring_.slot_bytes, i); }

  // The client's thread sleeping on this slot's answer, if any, wakes.
  static void WakeClient(SlotControl* control) {
    if (control->client_waiting.load(std::memory_order_seq_cst) != 0) {
      control->client_wake.fetch_add(1, std::memory_order_seq_cst);
      FutexWakeAll(&control->client_wake);
    }
  }

  // Takes every new request; true if any.
  bool Scan() {
    bool took = false;
    for (int32_t i = 0; i < ring_.slot_count; ++i) {
      if (closing_.load(std::memory_order_acquire)) break;
      const uint64_t seq = Slot(i)->request_seq.load(std::memory_order_acquire);
      if (seq == taken_[i] || busy_[i].load(std::memory_order_acquire)) continue;
      taken_[i] = seq;
      busy_[i].store(true, std::memory_order_relaxed);
      Take(i, seq);
      took = true;
    }
    return took;
  }

  // Whether a request waits to be taken.
  bool Pending() const {
    for (int32_t i = 0; i < ring_.slot_count; ++i) {
      const uint64_t seq = Slot(i)->request_seq.load(std::memory_order_seq_cst);
      if (seq != taken_[i] && !busy_[i].load(std::memory_order_acquire)) return true;
    }
    return false;
  }

  void Take(int32_t slot, uint64_t seq);

  ChannelServer* const server_;
  const ChannelRing ring_;  // holds the region: the ring stays mapped
  ChannelHeader* const header_;
  std::vector<uint64_t> taken_;  // per slot, the last request_seq taken (poller thread only)
  std::unique_ptr<std::atomic<bool>[]> busy_;  // per slot: a request in flight
  std::vector<std::shared_ptr<std::string>> copies_;  // per slot: where its bytes are copied
  // What a slot's copy keeps between requests (above: the request's own).
  static constexpr uint32_t kKeptCopyBytes = 256 << 10;
  std::atomic<bool> closing_{false};
  absl::Mutex mu_;
  int inflight_ ABSL_GUARDED_BY(mu_) = 0;

  friend class ChannelServer;
};

void ChannelServer::Poller::Take(int32_t slot, uint64_t seq) {
  ChannelServer* const server = server_;
  auto* r = new Request();
  r->poller = shared_from_this();
  r->slot = slot;
  r->seq = seq;
  r->start = absl::Now();
  r->last_mark = r->start;
  {
    absl::MutexLock lock(&mu_);
    ++inflight_;
  }
  server->inflight_.fetch_add(1);
  server->metrics_->inflight().Increment();
  SlotControl* control = Slot(slot);
  const uint32_t method = control->method.load(std::memory_order_relaxed);
  const uint32_t request_bytes = control->request_bytes.load(std::memory_order_relaxed);
  absl::Status status;
  if (server->draining_.load()) {
    status = absl::UnavailableError("server is draining");
  } else if (method != static_cast<uint32_t>(ChannelMethod::kPrefill)) {
    status = absl::InvalidArgumentError(absl::StrCat(
        "slot ", slot, " method=", method, ": a channel serves only method 1 (Prefill)"));
  } else if (request_bytes > static_cast<uint32_t>(ring_.slot_bytes)) {
    status = absl::InvalidArgumentError(absl::StrCat("slot ", slot, " request_bytes=",
                                                     request_bytes, " exceeds the ring's slot_bytes=",
                                                     ring_.slot_bytes));
  }
  r->bytes_in = status.ok() ? request_bytes : 0;
  PrefillCall c;
  if (status.ok()) {
    // One copy out of the slot: the client may write it at any time, so the
    // server reads the request only from here.
    // (A request abandoned at shutdown may still hold the slot's last copy.)
    // A slot keeps its copy for the next request only up to kKeptCopyBytes:
    // a larger one is the request's alone and goes with it, so that an idle
    // channel holds at most slot_count * kKeptCopyBytes (a client that once
    // filled every 16 MiB slot would otherwise leave 1 GiB a channel held,
    // counted by no cap).
    if (request_bytes > kKeptCopyBytes) {
      r->bytes = std::make_shared<std::string>();
    } else {
      if (copies_[slot].use_count() > 1) copies_[slot] = std::make_shared<std::string>();
      r->bytes = copies_[slot];
    }
    r->bytes->resize(request_bytes);
    std::memcpy(r->bytes->data(), ChannelPayload(ring_.base, ring_.slot_bytes, slot),
                request_bytes);
    grpc::Slice piece(r->bytes->data(), r->bytes->size(), grpc::Slice::STATIC_SLICE);
    grpc::ByteBuffer wire(&piece, 1);
    r->message = server->requests_->Get();
    status = ParseInto(wire, server->limits_->prefill, kPrefillInPlace, r->message.get(),
                       &r->tensors);
  }
  if (!status.ok()) {
    server->Finish(r, status, nullptr);
    delete r;
    return;
  }
  const v1::PrefillRequest& parsed = *r->message;
  r->shape = PrefillShape(parsed);
  ToCall(parsed, r->tensors, &c);
  c.tenant = ring_.tenant;
  c.request_id = kChannelRequestIdBit | server->next_request_id_.fetch_add(1);
  c.expected_incarnation = parsed.expected_incarnation();
  c.lease_id = parsed.lease_id();
  c.message_bytes = request_bytes;  // the slot's copy
  c.out = &r->out;
  server->ObserveStage(r, Metrics::RequestStage::kParse);
  {
    absl::MutexLock lock(&server->mu_);
    server->taken_.insert(r);
  }
  const uint64_t incarnation = server->core_->incarnation();
  // The admit stage (validation, regions, pages, queueing) is timed apart
  // from r, which the done callback may delete before Prefill returns.
  const absl::Time admit_start = absl::Now();
  server->core_->Prefill(c, [server, r, incarnation](absl::Status status) {
    {
      absl::MutexLock lock(&server->mu_);
      server->taken_.erase(r);
    }
    if (!r->answered.load(std::memory_order_acquire)) {
      const absl::Time done_at = absl::Now();
      if (r->out.max_seq_q_rows >= 0) r->shape = ShapeOfRows(r->out.max_seq_q_rows);
      grpc::ByteBuffer bytes;
      if (status.ok()) bytes = EncodePrefillResponse(std::move(r->out), incarnation);
      server->metrics_->ObserveRequestStage(Metrics::RequestStage::kRespond,
                                            absl::ToDoubleSeconds(absl::Now() - done_at));
      server->Finish(r, status, &bytes);
    }
    delete r;
  });
  server->metrics_->ObserveRequestStage(Metrics::RequestStage::kAdmit,
                                        absl::ToDoubleSeconds(absl::Now() - admit_start));
}

ChannelServer::ChannelServer(AttentionCore* core, Metrics* metrics,
                             const RequestWireLimits* limits,
                             RecyclingPool<v1::PrefillRequest>* requests,
                             ChannelServerOptions options)
    : core_(core), metrics_(metrics), limits_(limits), requests_(requests), options_(options) {}

ChannelServer::~ChannelServer() {
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
  }
  core_->CloseAllChannels();
  absl::MutexLock lock(&mu_);
  mu_.Await(absl::Condition(+[](int* n) { return *n == 0; }, &live_threads_));
}

void ChannelServer::ObserveStage(Request* r, Metrics::RequestStage stage) {
  const absl::Time now = absl::Now();
  metrics_->ObserveRequestStage(stage, absl::ToDoubleSeconds(now - r->last_mark));
  r->last_mark = now;
}

absl::StatusOr<ChannelServer::Opened> ChannelServer::Open(const CallContext& ctx,
                                                          const RegionRefView& ring) {
  Opened opened;
  auto id = core_->OpenChannel(
      ctx, ring,
      [this, &opened](const ChannelRing& r) -> absl::StatusOr<std::shared_ptr<ChannelEndpoint>> {
        {
          absl::MutexLock lock(&mu_);
          if (stopping_) return absl::UnavailableError("server is shutting down");
          ++live_threads_;
        }
        auto poller = std::make_shared<Poller>(this, r);
        opened.slot_count = r.slot_count;
        opened.slot_bytes = r.slot_bytes;
        try {
          std::thread([poller]() mutable {
            ChannelServer* server = poller->server_;
            poller->Run();
            poller.reset();  // the ring's region is released before the server may go
            server->ThreadDone();
          }).detach();
        } catch (const std::system_error& e) {
          // The host has no thread left to give (RLIMIT_NPROC, memory): the
          // channel is refused, and the server goes on serving.
          ThreadDone();
          return absl::ResourceExhaustedError(
              absl::StrCat("the server cannot start the channel's poller thread (", e.what(),
                           "): close other channels, or use gRPC Prefill calls"));
        }
        return std::shared_ptr<ChannelEndpoint>(poller);
      });
  if (!id.ok()) return id.status();
  opened.id = *id;
  return opened;
}

absl::Status ChannelServer::Close(const CallContext& ctx, uint64_t channel_id) {
  return core_->CloseChannel(ctx, channel_id);
}

void ChannelServer::ThreadDone() {
  absl::MutexLock lock(&mu_);
  --live_threads_;
}

bool ChannelServer::Finish(Request* r, const absl::Status& status, grpc::ByteBuffer* response) {
  if (r->answered.exchange(true, std::memory_order_acq_rel)) return false;
  const auto [code, bytes_out] = r->poller->Write(r->slot, status, response);
  // The request's metrics are recorded before its answer is published, as
  // the gRPC path records them before the response is written: a client
  // that has its answer finds the request counted.
  const double seconds = absl::ToDoubleSeconds(absl::Now() - r->start);
  metrics_->ObserveRequest(Metrics::Rpc::kPrefill, code, r->shape, seconds);
  metrics_->AddTransferBytes(r->bytes_in, bytes_out, Metrics::Path::kSystem);
  metrics_->inflight().Decrement();
  r->poller->Publish(r->slot, r->seq);
  if (options_.access_log) {
    spdlog::info(
        "access method=Prefill tenant={} peer=channel:{} request_id={} code={} seconds={:.6f} "
        "bytes_in={} bytes_out={} error=\"{}\"",
        r->poller->ring().tenant, r->poller->ring().id, r->seq, absl::StatusCodeToString(code),
        seconds, r->bytes_in, bytes_out, std::string(status.message()));
  }
  inflight_.fetch_sub(1);
  r->poller->Done();
  return true;
}

int ChannelServer::AbandonInflight(const absl::Status& status) {
  absl::MutexLock lock(&mu_);
  int abandoned = 0;
  for (Request* r : taken_) {
    if (Finish(r, status, nullptr)) ++abandoned;
  }
  return abandoned;
}

}  // namespace attnserve
