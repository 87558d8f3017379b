// The health service's Watch caps (server/grpc/health_service.h): callers
// without a token may keep Watch calls open, so at most so many per
// connection and in all; Check is not counted.
#include "server/grpc/health_service.h"

#include <memory>
#include <string>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "absl/time/clock.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/security/credentials.h"
#include "grpcpp/security/server_credentials.h"
#include "grpcpp/server.h"
#include "grpcpp/server_builder.h"
#include "grpcpp/support/channel_arguments.h"

namespace attnserve {
namespace {

using grpc::health::v1::Health;
using grpc::health::v1::HealthCheckRequest;
using grpc::health::v1::HealthCheckResponse;
using ::testing::HasSubstr;

class HealthWatchCapTest : public ::testing::Test {
 protected:
  void SetUp() override {
    service_ = std::make_unique<HealthService>(absl::Seconds(60), /*max_watching=*/3,
                                               /*max_watching_per_connection=*/2);
    grpc::ServerBuilder builder;
    builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port_);
    builder.RegisterService(service_.get());
    server_ = builder.BuildAndStart();
    ASSERT_TRUE(server_ != nullptr);
    ASSERT_GT(port_, 0);
  }
  void TearDown() override {
    service_->Shutdown();
    server_->Shutdown();
    server_.reset();
    service_.reset();
  }

  // A stub on a connection of its own.
  std::unique_ptr<Health::Stub> Connection() {
    grpc::ChannelArguments args;
    args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
    return Health::NewStub(grpc::CreateCustomChannel("127.0.0.1:" + std::to_string(port_),
                                                     grpc::InsecureChannelCredentials(), args));
  }

  struct Watch {
    grpc::ClientContext context;
    std::unique_ptr<grpc::ClientReader<HealthCheckResponse>> reader;
  };
  // A Watch of the server's status; `first`: its first answer, if any.
  std::unique_ptr<Watch> StartWatch(Health::Stub* stub, bool* answered, HealthCheckResponse* first) {
    auto w = std::make_unique<Watch>();
    w->context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
    w->reader = stub->Watch(&w->context, HealthCheckRequest());
    *answered = w->reader->Read(first);
    return w;
  }
  // A Watch refused: its status.
  grpc::Status Refused(Health::Stub* stub) {
    bool answered = false;
    HealthCheckResponse first;
    auto w = StartWatch(stub, &answered, &first);
    EXPECT_FALSE(answered) << "a Watch past the cap was answered " << first.status();
    return w->reader->Finish();
  }

  int port_ = 0;
  std::unique_ptr<HealthService> service_;
  std::unique_ptr<grpc::Server> server_;
};

TEST_F(HealthWatchCapTest, AtMostSoManyPerConnectionAndInAll) {
  auto a = Connection();
  auto b = Connection();
  std::vector<std::unique_ptr<Watch>> open;
  for (int i = 0; i < 2; ++i) {
    bool answered = false;
    HealthCheckResponse first;
    open.push_back(StartWatch(a.get(), &answered, &first));
    ASSERT_TRUE(answered);
    EXPECT_EQ(first.status(), HealthCheckResponse::SERVING);
  }
  grpc::Status s = Refused(a.get());
  EXPECT_EQ(s.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << s.error_message();
  EXPECT_THAT(s.error_message(), HasSubstr("at most 2 per connection"));

  // Another connection may, up to the cap in all.
  bool answered = false;
  HealthCheckResponse first;
  open.push_back(StartWatch(b.get(), &answered, &first));
  ASSERT_TRUE(answered);
  EXPECT_EQ(service_->watching(), 3);
  s = Refused(b.get());
  EXPECT_EQ(s.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << s.error_message();
  EXPECT_THAT(s.error_message(), HasSubstr("the server has 3 health Watch calls open: at most 3"));

  // Check is not counted.
  grpc::ClientContext check_context;
  HealthCheckResponse checked;
  ASSERT_TRUE(b->Check(&check_context, HealthCheckRequest(), &checked).ok());
  EXPECT_EQ(checked.status(), HealthCheckResponse::SERVING);

  // A Watch that ends frees its place, on its connection and in all.
  open[0]->context.TryCancel();
  EXPECT_EQ(open[0]->reader->Finish().error_code(), grpc::StatusCode::CANCELLED);
  const absl::Time until = absl::Now() + absl::Seconds(30);
  while (service_->watching() != 2 && absl::Now() < until) absl::SleepFor(absl::Milliseconds(5));
  ASSERT_EQ(service_->watching(), 2);
  open.push_back(StartWatch(a.get(), &answered, &first));
  ASSERT_TRUE(answered);
  EXPECT_EQ(service_->watching(), 3);

  // The open ones still hear a change.
  service_->SetServing(false);
  for (size_t i = 1; i < open.size(); ++i) {
    HealthCheckResponse next;
    ASSERT_TRUE(open[i]->reader->Read(&next));
    EXPECT_EQ(next.status(), HealthCheckResponse::NOT_SERVING);
  }
  service_->Shutdown();
  for (size_t i = 1; i < open.size(); ++i) {
    EXPECT_EQ(open[i]->reader->Finish().error_code(), grpc::StatusCode::UNAVAILABLE);
  }
}

}  // namespace
}  // namespace attnserve
