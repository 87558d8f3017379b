// RequestChannel: Prefill requests to a server on the same host through a
// ring of slots in a registered system region instead of a gRPC call each
// (docs/transport.md, "Request channels"; the ring's layout is
// common/channel_layout.h). Same arguments, results and errors as
// Client::Prefill, plans and region tensors included.
//
//   auto shm = attnserve::SharedMemory::Create("my_client_io", 64 << 20);
//   client->RegisterSystemRegion("io", **shm, 0, (*shm)->size());
//   attnserve::ChannelOptions options;                 // 4 slots of 1 MiB
//   const int64_t ring_bytes = attnserve::ChannelBytes(options.slot_count, options.slot_bytes);
//   auto channel = client->OpenChannel("io", (*shm)->data(), /*offset=*/0, ring_bytes, options);
//   args.q_region = attnserve::RegionRef{"io", ring_bytes, q_bytes};  // tensors after the ring
//   auto out = (*channel)->Prefill(args);
//
// Each call takes a free slot (one per calling thread at a time; a caller
// waits when all are busy), writes the request there, and waits for the
// answer: it spins for spin_us, then sleeps on the slot's futex word. A
// server that restarted never polls the old ring: a call then fails
// (UNAVAILABLE, or DEADLINE_EXCEEDED at the client's per-call deadline)
// saying that the channel must be reopened, never hangs. Thread-safe.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "client/client.h"
#include "common/channel_layout.h"

namespace attnserve {

struct ChannelOptions {
  int32_t slot_count = 4;         // 1..64: requests in flight at once
  int32_t slot_bytes = 1 << 20;   // 4 KiB..16 MiB, a multiple of 64: the largest request or
                                  // response (inline tensors travel in the slot)
  int64_t spin_us = 100;          // a caller polls its slot this long before it sleeps
};

class RequestChannel {
 public:
  // CloseChannel (errors ignored: the server may be gone).
  ~RequestChannel();
  RequestChannel(const RequestChannel&) = delete;
  RequestChannel& operator=(const RequestChannel&) = delete;

  uint64_t id() const { return id_; }
  uint64_t incarnation() const { return incarnation_; }
  int32_t slot_count() const { return slot_count_; }
  int32_t slot_bytes() const { return slot_bytes_; }

  absl::StatusOr<PrefillResult> Prefill(const PrefillArgs& args);
  // As Client::PrefillInto: the result's vectors are reused.
  absl::Status PrefillInto(const PrefillArgs& args, PrefillResult* result);

  // CloseChannel now; later calls fail with FAILED_PRECONDITION. A
  // CloseChannel whose outcome is unknown (OutcomeUnknown: it timed out, or
  // never left) is sent again by the next Close() or the destructor, where
  // NOT_FOUND means the earlier one went through (OK).
  absl::Status Close();

 private:
  friend class Client;
  RequestChannel() = default;

  // A free slot, or an error when none frees up before `deadline_ns`
  // (absl::GetCurrentTimeNanos(); 0: none).
  absl::StatusOr<int32_t> Acquire(int64_t deadline_ns);
  void Release(int32_t slot);
  // Waits for slot's answer to request `seq`.
  absl::Status Wait(int32_t slot, uint64_t seq, int64_t deadline_ns);
  // Why the server will not answer (restarted, unreachable), or OK.
  absl::Status Probe();

  Client* client_ = nullptr;
  char* base_ = nullptr;  // the ring in this process
  uint64_t id_ = 0;
  uint64_t incarnation_ = 0;
  int32_t slot_count_ = 0;
  int32_t slot_bytes_ = 0;
  int64_t spin_ns_ = 0;
  double timeout_s_ = 0;
  absl::Mutex mu_;
  absl::CondVar freed_;
  bool closed_ ABSL_GUARDED_BY(mu_) = false;  // no new requests
  // The server has answered a CloseChannel (closed, or never had it); until
  // then Close() sends it (again).
  bool close_answered_ ABSL_GUARDED_BY(mu_) = false;
  bool close_sent_ ABSL_GUARDED_BY(mu_) = false;  // a CloseChannel was sent before
  std::vector<int32_t> free_ ABSL_GUARDED_BY(mu_);
  // Slots whose caller gave up waiting: free again once their answer came.
  std::vector<int32_t> abandoned_ ABSL_GUARDED_BY(mu_);
  std::vector<uint64_t> seq_;  // per slot, the last request_seq sent (its holder's)
};

}  // namespace attnserve
