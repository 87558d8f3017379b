// The ring of a request channel (docs/design.md section 4, docs/transport.md
// "Request channels"): the bytes a same-host client and the server share in
// a registered system region, through which the client sends Prefill
// requests without a socket. Shared, word for word, by the server's poller
// (server/channel/) and the C++ client (client/channel.h).
//
// Layout, at a 64-byte aligned address of the region (little-endian):
//
//   ChannelHeader                       64 bytes
//   slot 0: SlotControl                 64 bytes
//           payload                     slot_bytes (a multiple of 64)
//   slot 1: ...                         up to slot slot_count - 1
//
// so ChannelBytes(slot_count, slot_bytes) = 64 + slot_count * (64 + slot_bytes).
//
// The client fills the header (magic, version, slot_count, slot_bytes),
// zeroes every word and control block, then calls OpenChannel. The server
// validates the header once and copies slot_count and slot_bytes: it never
// reads them again, so a client that changes them later only confuses
// itself.
//
// One request in slot i: the client writes the payload (the serialized
// request) and method / request_bytes, then store-releases request_seq =
// previous + 1 and, when the header's server_sleeping is set, bumps
// server_wake and FUTEX_WAKEs it. The server copies the payload out, runs
// the request, writes the response payload, response_bytes and status_code,
// then store-releases response_seq = the request_seq it took and, when the
// slot's client_waiting is set, bumps client_wake and FUTEX_WAKEs it.
//
// Every word the two sides both touch is a lock-free std::atomic placed in
// the mapping (standard layout, the same size as the integer it holds), so
// that it works across processes. The futex words are used without
// FUTEX_PRIVATE_FLAG (shared mappings).
#pragma once

#include <linux/futex.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <type_traits>

namespace attnserve {

inline constexpr uint32_t kChannelMagic = 0x4e484341;  // "ACHN" in little-endian bytes
inline constexpr uint32_t kChannelVersion = 1;
inline constexpr uint32_t kChannelMinSlots = 1;
inline constexpr uint32_t kChannelMaxSlots = 64;
inline constexpr uint32_t kChannelMinSlotBytes = 4 << 10;   // 4 KiB
inline constexpr uint32_t kChannelMaxSlotBytes = 16 << 20;  // 16 MiB
inline constexpr int64_t kChannelAlign = 64;                // header, control blocks, payloads

// SlotControl::method.
enum class ChannelMethod : uint32_t { kUnspecified = 0, kPrefill = 1 };

struct ChannelHeader {
  uint32_t magic;         // kChannelMagic (client, before OpenChannel)
  uint32_t version;       // kChannelVersion
  uint32_t slot_count;    // [kChannelMinSlots, kChannelMaxSlots]
  uint32_t slot_bytes;    // payload bytes per slot: [4 KiB, 16 MiB], a multiple of 64
  // 1 while the server's poller sleeps (or is about to) on server_wake.
  std::atomic<uint32_t> server_sleeping;
  // Futex word the server's poller sleeps on; the client bumps it and wakes
  // it after posting a request when server_sleeping is 1.
  std::atomic<uint32_t> server_wake;
  // The id of the channel once the server has closed it (CloseChannel,
  // UnregisterRegion, reclaim, shutdown) and answered everything it took;
  // 0 while open. A client waiting on a slot of channel `id` gives up when
  // it reads `id` here.
  std::atomic<uint64_t> closed_channel_id;
  uint8_t reserved[32];
};

struct SlotControl {
  std::atomic<uint64_t> request_seq;     // client: store-release after the request is written
  std::atomic<uint64_t> response_seq;    // server: store-release after the response is written
  std::atomic<uint32_t> method;          // client: ChannelMethod
  std::atomic<uint32_t> request_bytes;   // client: payload bytes of the request (<= slot_bytes)
  std::atomic<uint32_t> response_bytes;  // server: payload bytes of the response
  std::atomic<int32_t> status_code;      // server: absl/gRPC status code; 0 (OK): the payload
                                         // is the serialized response, else the error message
  std::atomic<uint32_t> client_waiting;  // client: 1 while a thread sleeps on client_wake
  std::atomic<uint32_t> client_wake;     // futex word: the server bumps it and wakes the client
  uint32_t flags;                        // reserved: 0
  uint8_t reserved[20];
};

static_assert(std::is_standard_layout_v<ChannelHeader> && sizeof(ChannelHeader) == 64);
static_assert(std::is_standard_layout_v<SlotControl> && sizeof(SlotControl) == 64);
static_assert(std::atomic<uint32_t>::is_always_lock_free && std::atomic<int32_t>::is_always_lock_free &&
              std::atomic<uint64_t>::is_always_lock_free);
static_assert(sizeof(std::atomic<uint32_t>) == 4 && sizeof(std::atomic<uint64_t>) == 8);
static_assert(offsetof(ChannelHeader, server_sleeping) == 16 &&
              offsetof(ChannelHeader, server_wake) == 20 &&
              offsetof(ChannelHeader, closed_channel_id) == 24);
static_assert(offsetof(SlotControl, response_seq) == 8 && offsetof(SlotControl, method) == 16 &&
              offsetof(SlotControl, request_bytes) == 20 &&
              offsetof(SlotControl, response_bytes) == 24 &&
              offsetof(SlotControl, status_code) == 28 &&
              offsetof(SlotControl, client_waiting) == 32 &&
              offsetof(SlotControl, client_wake) == 36 && offsetof(SlotControl, flags) == 40);

// Bytes of a ring of `slot_count` slots of `slot_bytes` payload each.
inline constexpr int64_t ChannelBytes(int64_t slot_count, int64_t slot_bytes) {
  return int64_t{sizeof(ChannelHeader)} + slot_count * (int64_t{sizeof(SlotControl)} + slot_bytes);
}

// Slot i's control block and payload in a ring at `base`.
inline SlotControl* ChannelSlot(char* base, int64_t slot_bytes, int64_t i) {
  return reinterpret_cast<SlotControl*>(base + sizeof(ChannelHeader) +
                                        i * (int64_t{sizeof(SlotControl)} + slot_bytes));
}
inline char* ChannelPayload(char* base, int64_t slot_bytes, int64_t i) {
  return reinterpret_cast<char*>(ChannelSlot(base, slot_bytes, i)) + sizeof(SlotControl);
}

// Sleeps while *word == expected, at most timeout_ns (shared futex: the word
// may be in memory another process maps). Returns early on a wake, a
// change of the word, or a signal; the caller re-checks what it waits for.
inline void FutexWait(std::atomic<uint32_t>* word, uint32_t expected, int64_t timeout_ns) {
  timespec ts;
  ts.tv_sec = static_cast<time_t>(timeout_ns / 1000000000);
  ts.tv_nsec = static_cast<long>(timeout_ns % 1000000000);
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAIT, expected, &ts, nullptr, 0);
}

// A spinning wait's pause between two polls of a ring word.
inline void CpuRelax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

// Wakes every thread (of any process) sleeping on `word`.
inline void FutexWakeAll(std::atomic<uint32_t>* word) {
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAKE, INT32_MAX, nullptr, nullptr,
          0);
}

}  // namespace attnserve
