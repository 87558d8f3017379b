// Hostile and careless clients against the real server (docs/security.md,
// "What hostile input costs", and docs/operations.md, "Shutdown"): memory a
// message may cost before and after authentication, cancelled requests,
// shutdown under load, and the codes of the edge's own errors.
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "client/client.h"
#include "client/workload.h"
#include "gmock/gmock.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/generic/generic_stub.h"
#include "gtest/gtest.h"
#include "tests/integration/test_server.h"

namespace attnserve {
namespace {

using ::testing::HasSubstr;

constexpr char kService[] = "/attnserve.v1.AttentionService/";

// A value of /proc/PID/status in bytes ("VmHWM", "VmRSS").
int64_t ProcStatusBytes(pid_t pid, const std::string& key) {
  std::ifstream in(absl::StrCat("/proc/", pid, "/status"));
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind(key + ":", 0) == 0) return std::atoll(line.c_str() + key.size() + 1) * 1024;
  }
  return -1;
}

std::shared_ptr<grpc::Channel> Channel(const std::string& target) {
  grpc::ChannelArguments args;
  args.SetMaxSendMessageSize(1 << 30);
  args.SetMaxReceiveMessageSize(1 << 30);
  args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
  return grpc::CreateCustomChannel(target, grpc::InsecureChannelCredentials(), args);
}

// Sends `bytes` as the request of `method` (an AttentionService RPC, or a full
// method path starting with '/').
grpc::Status SendRaw(const std::shared_ptr<grpc::Channel>& channel, const std::string& method,
                     const std::string& bytes, const std::string& token = "",
                     grpc::ByteBuffer* response = nullptr) {
  grpc::GenericStub stub(channel);
  grpc::ClientContext ctx;
  if (!token.empty()) ctx.AddMetadata("authorization", "Bearer " + token);
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(120));
  grpc::Slice slice(bytes.data(), bytes.size());
  grpc::ByteBuffer request(&slice, 1), ignored;
  absl::Notification done;
  grpc::Status status;
  const std::string path = method[0] == '/' ? method : absl::StrCat(kService, method);
  stub.UnaryCall(&ctx, path, grpc::StubOptions(), &request,
                 response != nullptr ? response : &ignored, [&](grpc::Status s) {
                   status = std::move(s);
                   done.Notify();
                 });
  done.WaitForNotification();
  return status;
}

std::string Varint(uint64_t v) {
  std::string out;
  while (v >= 0x80) {
    out.push_back(static_cast<char>((v & 0x7f) | 0x80));
    v >>= 7;
  }
  out.push_back(static_cast<char>(v));
  return out;
}

// A length-delimited field.
std::string Field(uint32_t number, const std::string& payload) {
  return Varint(uint64_t{number} << 3 | 2) + Varint(payload.size()) + payload;
}

std::string TokensFile() {
  auto path = WriteTokensFile("tok-alice alice\n");
  EXPECT_TRUE(path.ok()) << path.status();
  return path.ok() ? *path : "";
}

double Metric(const TestServer& server, const std::string& name, const std::string& labels) {
  auto text = HttpGet(server.metrics_address(), "/metrics");
  if (!text.ok()) return -1;
  auto value = MetricValue(*text, name, labels);
  return value.ok() ? *value : 0;
}

// ------------------------------------------------------------ memory

struct Hostile {
  const char* name;
  const char* method;
  std::string bytes;
};

// 64 MiB messages that cost far more memory than their size once parsed.
std::vector<Hostile> HostileMessages() {
  constexpr size_t kSize = size_t{64} << 20;
  const std::string zeros(kSize, '\0');
  std::string empty_states;
  empty_states.reserve(kSize);
  while (empty_states.size() < kSize) empty_states += Field(1, "");
  return {
      {"ReadKV slots of packed zeros", "ReadKV", Field(2, zeros)},
      {"FreePages page ids of packed zeros", "FreePages", Field(1, zeros)},
      {"WriteKV k.shape of packed zeros", "WriteKV", Field(3, Field(2, zeros))},
      {"MergeStates of empty states", "MergeStates", empty_states},
      {"Prefill q.shape of packed zeros", "Prefill", Field(2, Field(2, zeros))},
  };
}

TEST(HostileInputTest, NoMessageCostsMoreThanAboutTwiceItsSizeWithOrWithoutAToken) {
#ifdef ATTNSERVE_SANITIZED
  GTEST_SKIP() << "peak RSS under AddressSanitizer measures its shadow memory and quarantine; "
                  "this test runs in the plain build";
#endif
  const std::string tokens = TokensFile();
  for (const Hostile& h : HostileMessages()) {
    for (const std::string token : {"tok-mallory", "tok-alice"}) {
      SCOPED_TRACE(absl::StrCat(h.name, ", token ", token));
      TestServerOptions options;
      options.extra_flags = {"--auth_tokens_file=" + tokens};
      auto server = TestServer::Start(options);
      ASSERT_TRUE(server.ok()) << server.status();
      auto channel = Channel((*server)->grpc_address());
      // Warm up: connection, gRPC's threads and buffers, one small request.
      ASSERT_TRUE(SendRaw(channel, "GetServerInfo", "", "tok-alice").ok());
      const int64_t before = ProcStatusBytes((*server)->pid(), "VmHWM");
      const grpc::Status s = SendRaw(channel, h.method, h.bytes, token);
      const int64_t after = ProcStatusBytes((*server)->pid(), "VmHWM");
      EXPECT_FALSE(s.ok());
      EXPECT_EQ(s.error_code(), token == "tok-alice" ? grpc::StatusCode::INVALID_ARGUMENT
                                                     : grpc::StatusCode::UNAUTHENTICATED)
          << s.error_message();
      const double growth = static_cast<double>(after - before) / h.bytes.size();
      std::printf("%-40s token %-12s peak RSS growth %.2fx of %zu bytes\n", h.name,
                  token.c_str(), growth, h.bytes.size());
      EXPECT_LE(growth, 2.25);
      EXPECT_TRUE(SendRaw(channel, "GetServerInfo", "", "tok-alice").ok()) << "still serving";
    }
  }
  unlink(tokens.c_str());
}

// ------------------------------------------------------------ cancellation

// A Prefill of `rows` query rows over `kv_pages` pages of layer 0, random
// data; slow enough on the CPU backend to keep the worker busy.
v1::PrefillRequest SlowPrefill(const KvGeometry& g, const std::vector<int32_t>& pages,
                               int64_t rows, std::mt19937_64& gen) {
  v1::PrefillRequest r;
  const std::vector<uint16_t> q = RandomHalves(gen, g.dtype, rows * g.num_qo_heads * g.head_dim);
  r.mutable_q()->set_dtype(g.dtype == KvDType::kFp16 ? v1::DTYPE_FP16 : v1::DTYPE_BF16);
  for (int64_t d : {rows, int64_t{g.num_qo_heads}, int64_t{g.head_dim}}) r.mutable_q()->add_shape(d);
  r.mutable_q()->set_data(q.data(), q.size() * sizeof(uint16_t));
  r.add_qo_indptr(0);
  r.add_qo_indptr(static_cast<int32_t>(rows));
  r.add_kv_indptr(0);
  r.add_kv_indptr(static_cast<int32_t>(pages.size()));
  r.mutable_kv_indices()->Add(pages.begin(), pages.end());
  r.add_kv_last_page_len(g.page_size);
  r.set_causal(false);
  return r;
}

TEST(HostileInputTest, CancelledRequestsLeaveTheQueueAndGiveTheirMemoryBack) {
  TestServerOptions options;
  options.num_pages = 64;
  auto server = TestServer::Start(options);
  ASSERT_TRUE(server.ok()) << server.status();
  ClientOptions copts;
  copts.target = (*server)->grpc_address();
  auto client = Client::Connect(copts);
  ASSERT_TRUE(client.ok()) << client.status();
  const KvGeometry g = GeometryOf((*client)->info());
  auto pages = (*client)->AllocatePages(64);
  ASSERT_TRUE(pages.ok());
  std::mt19937_64 gen(11);
  // 16 MiB of queries each: 16384 rows of 8 heads x 64 dims in bf16.
  const int64_t rows =
      (int64_t{16} << 20) / (int64_t{g.num_qo_heads} * g.head_dim * KvDTypeBytes(g.dtype));
  const std::string bytes = SlowPrefill(g, *pages, rows, gen).SerializeAsString();
  const int64_t rss_start = ProcStatusBytes((*server)->pid(), "VmRSS");

  // Polls the in-flight gauge while the bursts run.
  std::atomic<bool> stop{false};
  std::atomic<int> max_inflight{0};
  std::thread watcher([&] {
    while (!stop) {
      const double v = Metric(**server, "attnserve_inflight_requests", "");
      max_inflight = std::max(max_inflight.load(), static_cast<int>(v));
      absl::SleepFor(absl::Milliseconds(10));
    }
  });
  auto channel = Channel((*server)->grpc_address());
  std::uniform_int_distribution<int> delay_ms(0, 300);
  for (int burst = 0; burst < 10; ++burst) {
    std::vector<std::thread> clients;
    for (int i = 0; i < 10; ++i) {
      const int delay = delay_ms(gen);
      clients.emplace_back([&, delay] {
        grpc::GenericStub stub(channel);
        grpc::ClientContext ctx;
        grpc::Slice slice(bytes.data(), bytes.size());
        grpc::ByteBuffer request(&slice, 1), response;
        absl::Notification done;
        stub.UnaryCall(&ctx, absl::StrCat(kService, "Prefill"), grpc::StubOptions(), &request,
                       &response, [&](grpc::Status) { done.Notify(); });
        if (!done.WaitForNotificationWithTimeout(absl::Milliseconds(delay))) ctx.TryCancel();
        done.WaitForNotification();
      });
    }
    for (std::thread& t : clients) t.join();
  }
  // Everything was cancelled; only a batch already running may still finish.
  const absl::Time deadline = absl::Now() + absl::Seconds(60);
  while (Metric(**server, "attnserve_inflight_requests", "") > 0 && absl::Now() < deadline) {
    absl::SleepFor(absl::Milliseconds(20));
  }
  stop = true;
  watcher.join();
  EXPECT_EQ(Metric(**server, "attnserve_inflight_requests", ""), 0);
  EXPECT_EQ(Metric(**server, "attnserve_queue_depth", ""), 0);
  // 10 outstanding at a time, plus the one batch the worker cannot abandon.
  EXPECT_LE(max_inflight.load(), 12);
  const int64_t rss_end = ProcStatusBytes((*server)->pid(), "VmRSS");
  std::printf("in flight at most %d; RSS %.0f MiB at the start, %.0f MiB after 100 cancelled "
              "16 MiB prefills\n",
              max_inflight.load(), rss_start / 1048576.0, rss_end / 1048576.0);
#ifndef ATTNSERVE_SANITIZED
  // What may stay: the recycled request pool (256 MiB, attention_service.cc),
  // plus what malloc keeps of the last outstanding requests' buffers (10 x
  // 16 MiB received by gRPC and again parsed) and its arenas. The server
  // before the fix held 1.1 GB here, and 3-4.5 GB in longer runs.
  EXPECT_LE(rss_end - rss_start, int64_t{768} << 20) << "memory was not given back";
#endif
  EXPECT_TRUE((*client)->Health().ok());
}

// A call that outlives its deadline counts as what its client saw,
// DEADLINE_EXCEEDED, whether it was still queued (it leaves the queue then)
// or already running (its answer is not sent, nor counted as sent); before,
// the queued one counted CANCELLED and the running one OK, with its bytes.
TEST(HostileInputTest, CallsPastTheirDeadlineCountAsDeadlineExceeded) {
  TestServerOptions options;
  options.num_pages = 256;
  options.extra_flags = {"--check_kv_written=false"};  // the pages' zeros are data enough
  auto server = TestServer::Start(options);
  ASSERT_TRUE(server.ok()) << server.status();
  ClientOptions copts;
  copts.target = (*server)->grpc_address();
  auto client = Client::Connect(copts);
  ASSERT_TRUE(client.ok()) << client.status();
  const KvGeometry g = GeometryOf((*client)->info());
  auto pages = (*client)->AllocatePages(256);  // 4,096 keys: seconds of work
  ASSERT_TRUE(pages.ok());
  std::mt19937_64 gen(12);
  // Seconds of work for the CPU backend (tens of seconds under the
  // sanitizers): it runs past its deadline, which leaves it time to arrive
  // and be taken by the worker, and the quick call (200 ms) time to arrive
  // and expire behind it. (At 400 ms, a loaded machine took the slow call
  // late enough that the CPU backend had stopped it, given up, before the
  // quick call's deadline, which then ran and succeeded.)
#ifdef ATTNSERVE_SANITIZED
  constexpr int kSlowDeadlineMs = 3000;
#else
  constexpr int kSlowDeadlineMs = 1500;
#endif
  const std::string slow = SlowPrefill(g, *pages, 16384, gen).SerializeAsString();
  const std::string quick = SlowPrefill(g, {(*pages)[0]}, 1, gen).SerializeAsString();
  const double out_before = Metric(**server, "attnserve_transfer_bytes_total",
                                   "direction=\"out\",path=\"inline\"");
  auto channel = Channel((*server)->grpc_address());
  auto call = [&](const std::string& bytes, int deadline_ms) {
    return std::thread([&, deadline_ms] {
      grpc::GenericStub stub(channel);
      grpc::ClientContext ctx;
      ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::milliseconds(deadline_ms));
      grpc::Slice slice(bytes.data(), bytes.size());
      grpc::ByteBuffer request(&slice, 1), response;
      absl::Notification done;
      grpc::Status status;
      stub.UnaryCall(&ctx, absl::StrCat(kService, "Prefill"), grpc::StubOptions(), &request,
                     &response, [&](grpc::Status s) {
                       status = std::move(s);
                       done.Notify();
                     });
      done.WaitForNotification();
      EXPECT_EQ(status.error_code(), grpc::StatusCode::DEADLINE_EXCEEDED) << status.error_message();
    });
  };
  std::thread running = call(slow, kSlowDeadlineMs);
  // Once the worker has taken it (its queue wait observed), the next waits
  // behind it.
  const absl::Time taken_by = absl::Now() + absl::Seconds(60);
  while (Metric(**server, "attnserve_queue_wait_seconds_count", "") < 1 && absl::Now() < taken_by) {
    absl::SleepFor(absl::Milliseconds(5));
  }
  EXPECT_GE(Metric(**server, "attnserve_queue_wait_seconds_count", ""), 1)
      << "the slow Prefill never ran";
  std::thread queued = call(quick, 200);
  running.join();
  queued.join();
  const absl::Time until = absl::Now() + absl::Seconds(120);
  while (Metric(**server, "attnserve_inflight_requests", "") > 0 && absl::Now() < until) {
    absl::SleepFor(absl::Milliseconds(20));
  }
  EXPECT_EQ(Metric(**server, "attnserve_requests_total",
                   "code=\"DEADLINE_EXCEEDED\",method=\"Prefill\",shape=\"prefill\""),
            1);
  EXPECT_EQ(Metric(**server, "attnserve_requests_total",
                   "code=\"DEADLINE_EXCEEDED\",method=\"Prefill\",shape=\"decode\""),
            1);
  EXPECT_EQ(Metric(**server, "attnserve_requests_total",
                   "code=\"OK\",method=\"Prefill\",shape=\"prefill\""),
            0);
  EXPECT_EQ(Metric(**server, "attnserve_requests_total",
                   "code=\"CANCELLED\",method=\"Prefill\",shape=\"decode\""),
            0);
  EXPECT_EQ(Metric(**server, "attnserve_transfer_bytes_total",
                   "direction=\"out\",path=\"inline\""),
            out_before);
}

// ------------------------------------------------------------ shutdown

TEST(ShutdownTest, ExitsWithinTheDrainTimeoutWhateverIsRunning) {
  TestServerOptions options;
  options.num_pages = 512;
  options.extra_flags = {"--drain_timeout_s=2", "--check_kv_written=false"};  // pages never written
  auto server = TestServer::Start(options);
  ASSERT_TRUE(server.ok()) << server.status();
  ClientOptions copts;
  copts.target = (*server)->grpc_address();
  auto client = Client::Connect(copts);
  ASSERT_TRUE(client.ok()) << client.status();
  const KvGeometry g = GeometryOf((*client)->info());
  auto pages = (*client)->AllocatePages(256);  // 4096 keys at page_size 16
  ASSERT_TRUE(pages.ok()) << pages.status();
  std::mt19937_64 gen(5);
  // Three 32k-row prefills over 4096 keys: over 8 s each on two cores (one
  // 4096-row prefill took about 1 s), far past the drain timeout.
  const std::string bytes = SlowPrefill(g, *pages, 32768, gen).SerializeAsString();
  auto channel = Channel((*server)->grpc_address());
  std::vector<grpc::Status> statuses(3);
  std::vector<std::thread> callers;
  for (int i = 0; i < 3; ++i) {
    callers.emplace_back([&, i] { statuses[i] = SendRaw(channel, "Prefill", bytes); });
  }
  const absl::Time wait_until = absl::Now() + absl::Seconds(30);
  while (Metric(**server, "attnserve_inflight_requests", "") < 3 && absl::Now() < wait_until) {
    absl::SleepFor(absl::Milliseconds(10));
  }
  ASSERT_EQ(Metric(**server, "attnserve_inflight_requests", ""), 3);
  const absl::Time sigterm = absl::Now();
  kill((*server)->pid(), SIGTERM);
  // New requests during the drain are told to go elsewhere.
  absl::SleepFor(absl::Milliseconds(100));
  for (int i = 0; i < 5; ++i) {
    const grpc::Status s = SendRaw(channel, "GetServerInfo", "");
    EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAVAILABLE) << s.error_message();
  }
  const int code = (*server)->Wait();
  const double seconds = absl::ToDoubleSeconds(absl::Now() - sigterm);
  for (std::thread& t : callers) t.join();
  EXPECT_EQ(code, 0) << (*server)->Output();
  // --drain_timeout_s=2 plus the promised second; the rest is slack for a
  // loaded CI machine, far below the 12-14 s this took before.
  EXPECT_LT(seconds, 4.5) << (*server)->Output();
  for (const grpc::Status& s : statuses) {
    EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAVAILABLE) << s.error_message();
  }
  EXPECT_THAT((*server)->Output(), HasSubstr("3 requests were still running"));
}

TEST(ShutdownTest, AnIdleConnectedClientDoesNotHoldTheDrainOpen) {
  TestServerOptions options;
  options.extra_flags = {"--drain_timeout_s=20"};
  auto server = TestServer::Start(options);
  ASSERT_TRUE(server.ok()) << server.status();
  ClientOptions copts;
  copts.target = (*server)->grpc_address();
  auto client = Client::Connect(copts);  // connected, then idle
  ASSERT_TRUE(client.ok()) << client.status();
  const absl::Time start = absl::Now();
  EXPECT_EQ((*server)->Stop(), 0);
  EXPECT_LT(absl::ToDoubleSeconds(absl::Now() - start), 5.0) << (*server)->Output();
}

// ------------------------------------------------------------ edge errors

TEST(EdgeErrorTest, UnparseableRequestsGetInvalidArgumentAndAreCounted) {
  auto server = TestServer::Start(TestServerOptions{});
  ASSERT_TRUE(server.ok()) << server.status();
  auto channel = Channel((*server)->grpc_address());
  const std::string garbage("\x0a\x7f\x01", 3);  // field 1 claims 127 bytes, 1 follows
  for (const char* method :
       {"GetServerInfo", "AllocatePages", "FreePages", "WriteKV", "ReadKV", "Prefill",
        "MergeStates"}) {
    SCOPED_TRACE(method);
    const grpc::Status s = SendRaw(channel, method, garbage);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
    EXPECT_THAT(s.error_message(), HasSubstr("does not parse as attnserve.v1."));
    const std::string shape = std::string(method) == "Prefill" ? "prefill" : "none";  // unparsed: prefill
    EXPECT_EQ(Metric(**server, "attnserve_requests_total",
                     absl::StrCat("code=\"INVALID_ARGUMENT\",method=\"", method,
                                  "\",shape=\"", shape, "\"")),
              1);
  }
}

TEST(EdgeErrorTest, TooManyEntriesAreRefusedBeforeParsingAndNamed) {
  auto server = TestServer::Start(TestServerOptions{});
  ASSERT_TRUE(server.ok()) << server.status();
  auto channel = Channel((*server)->grpc_address());
  std::string states;
  for (int i = 0; i < 257; ++i) states += Field(1, "");
  grpc::Status s = SendRaw(channel, "MergeStates", states);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(s.error_message(), HasSubstr("states has more than 256 entries"));
  // 256 pages of 16 slots: no request may name more than the pool's pages.
  s = SendRaw(channel, "FreePages", Field(1, std::string(300, '\x01')));
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(s.error_message(), HasSubstr("page_ids has more than 256 entries (num_pages=256)"));
  s = SendRaw(channel, "Prefill", Field(2, Field(2, std::string(9, '\x01'))));
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(s.error_message(), HasSubstr("q.shape has more than 8 entries"));
  s = SendRaw(channel, "WriteKV", Field(3, "") + Field(3, ""));
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(s.error_message(), HasSubstr("k appears more than once"));
}

TEST(EdgeErrorTest, ReflectionIsOffWhenAuthIsOn) {
  // ServerReflectionRequest{list_services: ""}.
  const std::string list = Field(7, "");
  const std::string method = "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo";
  {
    auto server = TestServer::Start(TestServerOptions{});
    ASSERT_TRUE(server.ok()) << server.status();
    grpc::ByteBuffer response;
    const grpc::Status s = SendRaw(Channel((*server)->grpc_address()), method, list, "", &response);
    EXPECT_TRUE(s.ok()) << s.error_message();
    EXPECT_GT(response.Length(), 0u);
    // The service is listed, though a generic handler serves its methods.
    grpc::Slice all;
    ASSERT_TRUE(response.DumpToSingleSlice(&all).ok());
    EXPECT_THAT(std::string(reinterpret_cast<const char*>(all.begin()), all.size()),
                HasSubstr("attnserve.v1.AttentionService"));
  }
  const std::string tokens = TokensFile();
  TestServerOptions options;
  options.extra_flags = {"--auth_tokens_file=" + tokens};
  auto server = TestServer::Start(options);
  ASSERT_TRUE(server.ok()) << server.status();
  const grpc::Status s = SendRaw(Channel((*server)->grpc_address()), method, list);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::UNIMPLEMENTED) << s.error_message();
  // It cannot be turned on beside auth (gRPC's reflection service reads a
  // caller's request whole, and with no token): tests/ops/exit_codes_test.sh.
  unlink(tokens.c_str());
}

TEST(EdgeErrorTest, APrefillAbandonedDuringUploadIsNotCountedAsBadInput) {
  TestServerOptions options;
  auto server = TestServer::Start(options);
  ASSERT_TRUE(server.ok()) << server.status();
  auto channel = Channel((*server)->grpc_address());
  ASSERT_TRUE(SendRaw(channel, "GetServerInfo", "").ok());
  // 256 MiB with a 20 ms deadline: the client gives up while sending.
  const std::string bytes = Field(2, Field(3, std::string(size_t{256} << 20, 'q')));
  for (int i = 0; i < 3; ++i) {
    grpc::GenericStub stub(channel);
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::milliseconds(20));
    grpc::Slice slice(bytes.data(), bytes.size());
    grpc::ByteBuffer request(&slice, 1), response;
    absl::Notification done;
    grpc::Status status;
    stub.UnaryCall(&ctx, absl::StrCat(kService, "Prefill"), grpc::StubOptions(), &request,
                   &response, [&](grpc::Status s) {
                     status = std::move(s);
                     done.Notify();
                   });
    done.WaitForNotification();
    EXPECT_EQ(status.error_code(), grpc::StatusCode::DEADLINE_EXCEEDED);
  }
  absl::SleepFor(absl::Milliseconds(500));  // whatever the server saw has been counted
  const double bad = Metric(**server, "attnserve_requests_total",
                            "code=\"INVALID_ARGUMENT\",method=\"Prefill\",shape=\"prefill\"");
  EXPECT_EQ(bad, 0) << "a client's own timeout was counted as its bad input";
}

// Invalid UTF-8 in a string field: each request is refused, and protobuf's
// complaint about it reaches the log at most once a second (before, one
// unthrottled "[libprotobuf ERROR ...]" line per request).
TEST(EdgeErrorTest, AFloodOfMalformedStringsWritesALogLineASecondAtMost) {
  auto server = TestServer::Start(TestServerOptions{});
  ASSERT_TRUE(server.ok()) << server.status();
  auto channel = Channel((*server)->grpc_address());
  const absl::Time start = absl::Now();
  constexpr int kRequests = 1500;
  int refused = 0;
  for (int i = 0; i < kRequests; ++i) {
    // UnregisterRegionRequest{name: "\xff\xfe"}
    const grpc::Status s = SendRaw(channel, "UnregisterRegion", Field(1, "\xff\xfe"));
    refused += s.error_code() == grpc::StatusCode::INVALID_ARGUMENT;
  }
  const double seconds = absl::ToDoubleSeconds(absl::Now() - start);
  EXPECT_EQ(refused, kRequests);
  absl::SleepFor(absl::Milliseconds(100));
  const std::string out = (*server)->Output();
  int lines = 0;
  for (size_t at = out.find("UTF-8"); at != std::string::npos; at = out.find("UTF-8", at + 1)) {
    ++lines;
  }
  EXPECT_GE(lines, 1) << "protobuf's complaint was not logged at all:\n" << out;
  EXPECT_LE(lines, 2 + static_cast<int>(seconds)) << kRequests << " requests in " << seconds
                                                  << " s wrote " << lines << " lines";
  EXPECT_THAT(out, HasSubstr("protobuf ("));
  EXPECT_TRUE(SendRaw(channel, "GetServerInfo", "").ok());
}

TEST(EdgeErrorTest, TheBearerSchemeIsCaseInsensitiveAndOtherSchemesSaySo) {
  const std::string tokens = TokensFile();
  TestServerOptions options;
  options.extra_flags = {"--auth_tokens_file=" + tokens};
  auto server = TestServer::Start(options);
  ASSERT_TRUE(server.ok()) << server.status();
  auto channel = Channel((*server)->grpc_address());
  auto call = [&](const std::string& authorization) {
    grpc::GenericStub stub(channel);
    grpc::ClientContext ctx;
    if (!authorization.empty()) ctx.AddMetadata("authorization", authorization);
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
    grpc::Slice slice("", 0);
    grpc::ByteBuffer request(&slice, 1), response;
    absl::Notification done;
    grpc::Status status;
    stub.UnaryCall(&ctx, absl::StrCat(kService, "GetServerInfo"), grpc::StubOptions(), &request,
                   &response, [&](grpc::Status s) {
                     status = std::move(s);
                     done.Notify();
                   });
    done.WaitForNotification();
    return status;
  };
  EXPECT_TRUE(call("Bearer tok-alice").ok());
  EXPECT_TRUE(call("bearer tok-alice").ok()) << "a lowercase scheme was refused";
  EXPECT_TRUE(call("BEARER tok-alice").ok());
  grpc::Status s = call("Basic dG9rOmFsaWNl");
  EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAUTHENTICATED);
  EXPECT_THAT(s.error_message(), HasSubstr("not 'Bearer TOKEN'"));
  s = call("");
  EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAUTHENTICATED);
  EXPECT_THAT(s.error_message(), HasSubstr("missing"));
  s = call("bearer wrong");
  EXPECT_THAT(s.error_message(), HasSubstr("unknown bearer token"));
  unlink(tokens.c_str());
}

TEST(ShutdownTest, ARepeatedSigtermKeepsTheDrainClean) {
  TestServerOptions options;
  options.num_pages = 512;
  options.extra_flags = {"--drain_timeout_s=2", "--check_kv_written=false"};  // pages never written
  auto server = TestServer::Start(options);
  ASSERT_TRUE(server.ok()) << server.status();
  ClientOptions copts;
  copts.target = (*server)->grpc_address();
  auto client = Client::Connect(copts);
  ASSERT_TRUE(client.ok()) << client.status();
  auto pages = (*client)->AllocatePages(256);
  ASSERT_TRUE(pages.ok());
  std::mt19937_64 gen(7);
  // A prefill that runs past the drain, so that the drain is still going
  // when the signal comes again.
  const std::string bytes =
      SlowPrefill(GeometryOf((*client)->info()), *pages, 32768, gen).SerializeAsString();
  auto channel = Channel((*server)->grpc_address());
  grpc::Status slow;
  std::thread caller([&] { slow = SendRaw(channel, "Prefill", bytes); });
  const absl::Time wait_until = absl::Now() + absl::Seconds(30);
  while (Metric(**server, "attnserve_inflight_requests", "") < 1 && absl::Now() < wait_until) {
    absl::SleepFor(absl::Milliseconds(10));
  }
  kill((*server)->pid(), SIGTERM);
  absl::SleepFor(absl::Milliseconds(20));
  kill((*server)->pid(), SIGTERM);
  kill((*server)->pid(), SIGTERM);
  EXPECT_EQ((*server)->Wait(), 0) << (*server)->Output();
  caller.join();
  EXPECT_EQ(slow.error_code(), grpc::StatusCode::UNAVAILABLE) << slow.error_message();
  EXPECT_THAT((*server)->Output(), HasSubstr("already draining"));
}

// A client that dies while its request is arriving is counted as CANCELLED
// (or DEADLINE_EXCEEDED), never as INVALID_ARGUMENT: the server did not get
// a malformed request, it got half of one.
TEST(EdgeErrorTest, AClientKilledWhileSendingIsCountedCancelled) {
  auto server = TestServer::Start(TestServerOptions{});
  ASSERT_TRUE(server.ok()) << server.status();
  // Four calls whose bodies stop one byte short; the sender then exits.
  std::string output;
  const int code = RunProgram({"/usr/bin/python3", H2_FLOOD_PY, (*server)->grpc_address(),
                               "--connections", "1", "--streams", "4", "--claim", "1048576",
                               "--send_for", "0.5", "--hold", "0"},
                              &output);
  ASSERT_EQ(code, 0) << output;
  const absl::Time until = absl::Now() + absl::Seconds(10);
  while (Metric(**server, "attnserve_inflight_requests", "") > 0 && absl::Now() < until) {
    absl::SleepFor(absl::Milliseconds(20));
  }
  EXPECT_EQ(Metric(**server, "attnserve_requests_total",
                   "code=\"CANCELLED\",method=\"Prefill\",shape=\"prefill\""),
            4);
  EXPECT_EQ(Metric(**server, "attnserve_requests_total",
                   "code=\"INVALID_ARGUMENT\",method=\"Prefill\",shape=\"prefill\""),
            0);
}

// Calls that arrive during a drain, up to the very end, are told UNAVAILABLE
// ("go elsewhere"): a client that retries on UNAVAILABLE loses nothing to a
// drain. The server answers them itself while it drains; a call that reaches
// it in the last moments, after gRPC's shutdown began, gRPC cancels, and
// the clients report that as UNAVAILABLE too (gRPC's CANCELLED before).
TEST(ShutdownTest, EveryCallDuringADrainIsOkOrUnavailable) {
  for (int round = 0; round < 3; ++round) {
    auto server = TestServer::Start(TestServerOptions{});
    ASSERT_TRUE(server.ok()) << server.status();
    std::atomic<bool> stop{false};
    std::atomic<int> ok{0}, unavailable{0}, other{0};
    std::vector<std::string> others;
    absl::Mutex mu;
    std::vector<std::thread> callers;
    for (int t = 0; t < 4; ++t) {
      callers.emplace_back([&] {
        ClientOptions copts;
        copts.target = (*server)->grpc_address();
        copts.timeout_s = 10;
        auto client = Client::Connect(copts);
        ASSERT_TRUE(client.ok()) << client.status();
        while (!stop) {
          const absl::Status s = (*client)->GetServerInfo().status();
          if (s.ok()) {
            ++ok;
          } else if (s.code() == absl::StatusCode::kUnavailable) {
            ++unavailable;
          } else {
            ++other;
            absl::MutexLock lock(&mu);
            others.push_back(s.ToString());
          }
        }
      });
    }
    absl::SleepFor(absl::Milliseconds(200));
    kill((*server)->pid(), SIGTERM);
    EXPECT_EQ((*server)->Wait(), 0);
    absl::SleepFor(absl::Milliseconds(100));  // calls after the exit: refused connections
    stop = true;
    for (std::thread& t : callers) t.join();
    EXPECT_GT(ok, 0);
    EXPECT_GT(unavailable, 0);
    EXPECT_EQ(other, 0) << (others.empty() ? "" : others[0]);
  }
}

// A request over --max_message_bytes is refused naming the flag and the way
// around it (gRPC's own "Received message larger than max (N vs. M)" before),
// and counted as RESOURCE_EXHAUSTED, not as a malformed request.
TEST(EdgeErrorTest, ARequestOverMaxMessageBytesNamesTheFlag) {
  TestServerOptions options;
  options.extra_flags = {"--max_message_bytes=1048576"};
  auto server = TestServer::Start(options);
  ASSERT_TRUE(server.ok()) << server.status();
  auto channel = Channel((*server)->grpc_address());
  const grpc::Status s =
      SendRaw(channel, "Prefill", Field(2, Field(3, std::string(size_t{2} << 20, 'q'))));
  EXPECT_EQ(s.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << s.error_message();
  EXPECT_THAT(s.error_message(), HasSubstr("more than --max_message_bytes=1048576"));
  EXPECT_THAT(s.error_message(), HasSubstr("shared-memory region"));
  EXPECT_EQ(Metric(**server, "attnserve_requests_total",
                   "code=\"RESOURCE_EXHAUSTED\",method=\"Prefill\",shape=\"prefill\""),
            1);
  EXPECT_TRUE(SendRaw(channel, "GetServerInfo", "").ok());
}

}  // namespace
}  // namespace attnserve
