// The C++ client's own error handling, against a stand-in server that
// answers every call UNAVAILABLE ("server is draining") and counts the
// attempts per method: gRPC's retry policy (common/transport.h) tries the
// idempotent methods again and never the others; and a request larger than
// the client's max_message_bytes fails naming it and the ways around it.
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "client/client.h"
#include "attnserve/v1/attention.grpc.pb.h"
#include "client/shared_memory.h"
#include "gmock/gmock.h"
#include "grpcpp/generic/async_generic_service.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"

namespace attnserve {
namespace {

using ::testing::HasSubstr;

// Answers every call UNAVAILABLE at once and counts the calls per method.
class DrainingServer final : public grpc::CallbackGenericService {
 public:
  grpc::ServerGenericBidiReactor* CreateReactor(grpc::GenericCallbackServerContext* ctx) override {
    {
      absl::MutexLock lock(&mu_);
      ++calls_[ctx->method()];
    }
    class Refuse final : public grpc::ServerGenericBidiReactor {
     public:
      Refuse() { Finish(grpc::Status(grpc::StatusCode::UNAVAILABLE, "server is draining")); }
      void OnDone() override { delete this; }
    };
    return new Refuse;
  }

  int Calls(const std::string& method) {
    absl::MutexLock lock(&mu_);
    return calls_["/attnserve.v1.AttentionService/" + method];
  }

 private:
  absl::Mutex mu_;
  std::map<std::string, int> calls_ ABSL_GUARDED_BY(mu_);
};

class ClientErrorsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    grpc::ServerBuilder builder;
    builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port_);
    builder.RegisterCallbackGenericService(&service_);
    server_ = builder.BuildAndStart();
    ASSERT_NE(server_, nullptr);
    ClientOptions options;
    options.target = "127.0.0.1:" + std::to_string(port_);
    options.fetch_info = false;  // the stand-in has no ServerInfo to give
    options.timeout_s = 60;
    auto client = Client::Connect(options);
    ASSERT_TRUE(client.ok()) << client.status();
    client_ = *std::move(client);
  }
  void TearDown() override { server_->Shutdown(); }

  DrainingServer service_;
  int port_ = 0;
  std::unique_ptr<grpc::Server> server_;
  std::unique_ptr<Client> client_;
};

TEST_F(ClientErrorsTest, OnlyIdempotentMethodsAreRetriedOnUnavailable) {
  // Each call ends UNAVAILABLE with the server's message.
  auto expect_unavailable = [](const absl::Status& s) {
    EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable) << s;
    EXPECT_THAT(s.message(), HasSubstr("server is draining"));
  };
  expect_unavailable(client_->GetServerInfo().status());
  const std::vector<int64_t> slots = {0};
  const std::vector<uint16_t> rows(0);
  expect_unavailable(client_->WriteKV(0, slots, rows, rows));
  expect_unavailable(client_->ReadKV(0, slots).status());
  expect_unavailable(client_->Prefill(PrefillArgs{}).status());
  expect_unavailable(client_->MergeStates({}, 0, 1, 64, false).status());
  expect_unavailable(client_->ListRegions().status());
  expect_unavailable(client_->AllocatePages(1).status());
  const std::vector<int32_t> pages = {0};
  expect_unavailable(client_->FreePages(pages));
  expect_unavailable(client_->CreatePlan(PlanLayout{}).status());
  expect_unavailable(client_->ReleasePlan(1));
  auto memory = SharedMemory::Create("r", 4096);
  ASSERT_TRUE(memory.ok()) << memory.status();
  expect_unavailable(client_->RegisterSystemRegion("r", **memory, 0, 4096));
  expect_unavailable(client_->UnregisterRegion("r"));
  // The channel calls through the client's own channel (its retry policy).
  for (const char* method : {"OpenChannel", "CloseChannel"}) {
    grpc::ClientContext ctx;
    client_->PrepareContext(&ctx);
    v1::OpenChannelResponse open;
    v1::CloseChannelResponse close;
    const grpc::Status s =
        std::string(method) == "OpenChannel"
            ? client_->stub()->OpenChannel(&ctx, v1::OpenChannelRequest(), &open)
            : client_->stub()->CloseChannel(&ctx, v1::CloseChannelRequest(), &close);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAVAILABLE) << method;
  }
  // 4 attempts (3 retries) of each idempotent method; 1 of the others.
  // GetServerInfo was called twice: once above, once by RegisterSystemRegion
  // (it reads the server's region socket when its info names none).
  EXPECT_EQ(service_.Calls("GetServerInfo"), 8);
  for (const char* m : {"WriteKV", "ReadKV", "Prefill", "MergeStates", "ListRegions"}) {
    EXPECT_EQ(service_.Calls(m), 4) << m;
  }
  for (const char* m : {"AllocatePages", "FreePages", "CreatePlan", "ReleasePlan",
                        "RegisterRegion", "UnregisterRegion", "OpenChannel", "CloseChannel"}) {
    EXPECT_EQ(service_.Calls(m), 1) << m;
  }
}

// Past gRPC's default per-call retry buffer (256 KiB) nothing was retried:
// a 2 MiB WriteKV is retried as a small one is.
TEST_F(ClientErrorsTest, LargeRequestsAreRetriedToo) {
  std::vector<int64_t> slots(4096);
  const std::vector<uint16_t> rows(size_t{4096} * 2 * 64 * 2);  // 2 MiB each of K and V
  const absl::Status s = client_->WriteKV(0, slots, rows, rows);
  EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable) << s;
  EXPECT_EQ(service_.Calls("WriteKV"), 4);
}

TEST_F(ClientErrorsTest, ARequestOverMaxMessageBytesNamesItAndTheWaysAround) {
  ClientOptions options;
  options.target = "127.0.0.1:" + std::to_string(port_);
  options.fetch_info = false;
  options.max_message_bytes = 4096;  // with 1 MiB for framing
  auto client = Client::Connect(options);
  ASSERT_TRUE(client.ok());
  std::vector<int64_t> slots(8192);
  const std::vector<uint16_t> rows(2 << 20);  // 4 MiB
  const absl::Status s = (*client)->WriteKV(0, slots, rows, rows);
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted) << s;
  EXPECT_THAT(s.message(), HasSubstr("more than this client's max_message_bytes allows"));
  EXPECT_THAT(s.message(), HasSubstr("shared-memory region"));
  EXPECT_THAT(s.message(), HasSubstr("--max_message_bytes"));
  EXPECT_THAT(s.message(), ::testing::Not(HasSubstr("Sent message larger than max")));
  EXPECT_EQ(service_.Calls("WriteKV"), 0) << "refused before it was sent";
}

// Options that would overflow a conversion (a deadline, the message limit)
// are refused by Connect, naming the field and its bound; an infinite
// set_timeout_s() is capped, and the calls run.
TEST_F(ClientErrorsTest, BadOptionsNameTheFieldAndTheBound) {
  const double inf = std::numeric_limits<double>::infinity();
  const double nan = std::numeric_limits<double>::quiet_NaN();
  const struct {
    std::function<void(ClientOptions&)> set;
    std::string text;
  } cases[] = {
      {[](ClientOptions& o) { o.max_message_bytes = INT64_MAX; },
       "max_message_bytes=9223372036854775807 must be in [1, 2147483647]"},
      {[](ClientOptions& o) { o.max_message_bytes = -1; }, "max_message_bytes=-1 must be in"},
      {[&](ClientOptions& o) { o.timeout_s = inf; }, "timeout_s=inf must be finite and >= 0"},
      {[&](ClientOptions& o) { o.timeout_s = nan; }, "timeout_s=nan must be finite"},
      {[](ClientOptions& o) { o.timeout_s = -1; }, "timeout_s=-1 must be finite and >= 0"},
      {[&](ClientOptions& o) { o.connect_timeout_s = inf; },
       "connect_timeout_s=inf must be finite and > 0"},
      {[](ClientOptions& o) { o.connect_timeout_s = 0; }, "connect_timeout_s=0 must be finite"},
  };
  for (const auto& c : cases) {
    ClientOptions options;
    options.target = "127.0.0.1:" + std::to_string(port_);
    options.fetch_info = false;
    c.set(options);
    auto client = Client::Connect(options);
    EXPECT_EQ(client.status().code(), absl::StatusCode::kInvalidArgument) << c.text;
    EXPECT_THAT(std::string(client.status().message()), HasSubstr(c.text));
  }
  client_->set_timeout_s(inf);
  EXPECT_EQ(client_->FreePages({1}).code(), absl::StatusCode::kUnavailable);  // the stand-in's answer
  client_->set_timeout_s(1e300);
  EXPECT_EQ(client_->FreePages({1}).code(), absl::StatusCode::kUnavailable);
}


// A stand-in whose GetServerInfo answers what the test sets.
class InfoServer final : public v1::AttentionService::Service {
 public:
  grpc::Status GetServerInfo(grpc::ServerContext*, const v1::GetServerInfoRequest*, v1::ServerInfo* out) override {
    absl::MutexLock lock(&mu_);
    *out = info_;
    return grpc::Status::OK;
  }
  void Set(const v1::ServerInfo& info) {
    absl::MutexLock lock(&mu_);
    info_ = info;
  }

 private:
  absl::Mutex mu_;
  v1::ServerInfo info_ ABSL_GUARDED_BY(mu_);
};

// What the client computes with (page counts, divisions by page_size and
// the head counts) must be a geometry attnserve serves: a server that
// reports another is refused at connect, naming the field, rather than met
// later as a division by zero or a wrong result.
TEST(ClientConnectTest, AServerReportingAGeometryNoAttnserveServesIsRefused) {
  InfoServer service;
  int port = 0;
  grpc::ServerBuilder builder;
  builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
  builder.RegisterService(&service);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  ASSERT_NE(server, nullptr);
  v1::ServerInfo good;
  good.set_num_layers(2);
  good.set_num_pages(64);
  good.set_page_size(16);
  good.set_num_qo_heads(8);
  good.set_num_kv_heads(2);
  good.set_head_dim(128);
  good.set_kv_dtype(v1::DTYPE_BF16);
  good.set_incarnation(7);
  ClientOptions options;
  options.target = "127.0.0.1:" + std::to_string(port);
  options.timeout_s = 10;
  service.Set(good);
  ASSERT_TRUE(Client::Connect(options).ok());
  const std::vector<std::pair<std::function<void(v1::ServerInfo*)>, std::string>> bad = {
      {[](v1::ServerInfo* i) { i->set_page_size(0); }, "ServerInfo.page_size=0 out of range [1, 128]"},
      {[](v1::ServerInfo* i) { i->set_num_layers(0); }, "ServerInfo.num_layers=0 out of range [1, 1024]"},
      {[](v1::ServerInfo* i) { i->set_num_kv_heads(0); }, "ServerInfo.num_kv_heads=0 out of range [1, 256]"},
      {[](v1::ServerInfo* i) { i->set_num_kv_heads(3); }, "ServerInfo.num_qo_heads=8 must be in [1, 256] and a "
                                                          "multiple of ServerInfo.num_kv_heads=3"},
      {[](v1::ServerInfo* i) { i->set_head_dim(100); }, "ServerInfo.head_dim=100 must be 64, 128 or 256"},
      {[](v1::ServerInfo* i) { i->set_num_pages(0); }, "ServerInfo.num_pages=0 < 1"},
      {[](v1::ServerInfo* i) { *i = v1::ServerInfo(); }, "ServerInfo.num_layers=0"},
  };
  for (const auto& [change, message] : bad) {
    SCOPED_TRACE(message);
    v1::ServerInfo info = good;
    change(&info);
    service.Set(info);
    auto client = Client::Connect(options);
    ASSERT_FALSE(client.ok());
    EXPECT_EQ(client.status().code(), absl::StatusCode::kFailedPrecondition) << client.status();
    EXPECT_THAT(std::string(client.status().message()), HasSubstr(message));
    EXPECT_THAT(std::string(client.status().message()), HasSubstr("is it an attnserve server?"));
  }
  server->Shutdown();
}

// Options refused before anything connects, each naming the option and its
// bound.
TEST(ClientConnectTest, BadOptionsNameTheOptionAndTheBound) {
  const std::vector<std::pair<std::function<void(ClientOptions*)>, std::string>> bad = {
      {[](ClientOptions* o) { o->target = ""; }, "target is empty"},
      {[](ClientOptions* o) { o->target = "127.0.0.1:99999"; }, "port 99999 out of range [1, 65535]"},
      {[](ClientOptions* o) { o->target = "127.0.0.1:0"; }, "port 0 out of range [1, 65535]"},
      // A CA or a client certificate means TLS, with or without tls.
      {[](ClientOptions* o) { o->tls_ca = "/nonexistent/ca.pem"; }, "tls_ca=/nonexistent/ca.pem: cannot open"},
      {[](ClientOptions* o) {
         o->tls_cert = "/nonexistent/c.pem";
         o->tls_key = "/etc/hostname";
       },
       "tls_cert=/nonexistent/c.pem: cannot open"},
      {[](ClientOptions* o) { o->tls_key = "b"; }, "tls_key=b needs tls_cert (the key's certificate)"},
      {[](ClientOptions* o) {
         o->tls_cert = "/etc/hostname";
         o->tls = true;
       },
       "tls_cert=/etc/hostname needs tls_key"},
      {[](ClientOptions* o) {
         o->tls = true;
         o->tls_ca = "/nonexistent/ca.pem";
       },
       "tls_ca=/nonexistent/ca.pem: cannot open"},
  };
  for (const auto& [change, message] : bad) {
    SCOPED_TRACE(message);
    ClientOptions options;
    options.target = "127.0.0.1:1";
    change(&options);
    auto client = Client::Connect(options);
    ASSERT_FALSE(client.ok());
    EXPECT_EQ(client.status().code(), absl::StatusCode::kInvalidArgument) << client.status();
    EXPECT_THAT(std::string(client.status().message()), HasSubstr(message));
  }
  // A gRPC URI is not a HOST:PORT.
  ClientOptions uri;
  uri.target = "unix:/nonexistent/attnserve.sock";
  uri.connect_timeout_s = 0.5;
  EXPECT_NE(Client::Connect(uri).status().code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace attnserve
