// attnecho: the transport floor for attnbench. It serves
// attnserve.v1.AttentionService with the same geometry flags as attnserve
// but computes nothing: Prefill answers with the query bytes as the output
// and zero LSEs (the same sizes as a real answer), KV writes are accepted and
// dropped. attnbench run against it measures gRPC, serialization and the
// network alone, so that a report can split end-to-end time into transport
// floor + kernel time + server overhead.
//
//   attnecho --listen=127.0.0.1:50061 --num_qo_heads=32 --head_dim=128 &
//   attnbench --target=127.0.0.1:50061 --workload=decode --concurrency=16
#include <atomic>
#include <deque>
#include <memory>
#include <iostream>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "attnserve/v1/attention.grpc.pb.h"
#include "common/host_port.h"
#include "common/kv_geometry.h"
#include "common/tensor_wire.h"
#include "common/transport.h"
#include "common/usage.h"
#include "grpcpp/grpcpp.h"

ABSL_FLAG(std::string, listen, "127.0.0.1:50061", "gRPC address (port 0 picks one)");
ABSL_FLAG(int32_t, num_layers, 4, "reported layers");
ABSL_FLAG(int32_t, num_pages, 1 << 20, "reported pages (allocation never runs out)");
ABSL_FLAG(int32_t, page_size, 16, "reported tokens per page");
ABSL_FLAG(int32_t, num_qo_heads, 32, "query heads");
ABSL_FLAG(int32_t, num_kv_heads, 4, "KV heads");
ABSL_FLAG(int32_t, head_dim, 128, "head dimension");
ABSL_FLAG(std::string, kv_dtype, "bf16", "bf16 or fp16");
ABSL_FLAG(int64_t, max_message_bytes, 512ll << 20, "largest request or response in bytes");
ABSL_FLAG(bool, respond_from_worker, false,
          "answer Prefill from one worker thread, as attnserve's scheduler does, "
          "instead of inside the RPC handler (measures that hand-off)");

ABSL_FLAG(bool, transport_tuning, true,
          "gRPC HTTP/2 and TCP settings for large tensors, as attnserve's --transport_tuning; "
          "false: gRPC's defaults");
ABSL_FLAG(std::string, grpc_args, "", "extra gRPC channel arguments NAME=INT,... (experiments)");
ABSL_FLAG(bool, retain_freed_memory, true,
          "keep memory freed by malloc for the next message, as attnserve's --retain_freed_memory");

namespace attnserve {

// What is wrong with the flags (as attnserve names its own), or "": the
// geometry it reports must be one attnserve serves, since attnbench and the
// clients compute with it.
std::string CheckFlags() {
  KvGeometry g;
  g.num_layers = absl::GetFlag(FLAGS_num_layers);
  g.page_size = absl::GetFlag(FLAGS_page_size);
  g.num_qo_heads = absl::GetFlag(FLAGS_num_qo_heads);
  g.num_kv_heads = absl::GetFlag(FLAGS_num_kv_heads);
  g.head_dim = absl::GetFlag(FLAGS_head_dim);
  if (std::string bad = GeometryShapeError(g, "--"); !bad.empty()) return bad;
  if (const int32_t pages = absl::GetFlag(FLAGS_num_pages); pages < 1) {
    return absl::StrCat("--num_pages=", pages, " out of range [1, ", INT32_MAX, "]");
  }
  if (const std::string d = absl::GetFlag(FLAGS_kv_dtype); d != "bf16" && d != "fp16") {
    return absl::StrCat("--kv_dtype=", d, " must be bf16 or fp16");
  }
  if (const int64_t b = absl::GetFlag(FLAGS_max_message_bytes); b < 1 || b > INT32_MAX) {
    return absl::StrCat("--max_message_bytes=", b, " out of range [1, ", INT32_MAX, "]");
  }
  const std::string listen = absl::GetFlag(FLAGS_listen);
  const std::optional<HostPort> hp = SplitHostPort(listen);
  if (!hp || hp->host.empty() || PortNumber(hp->port, 0) < 0) {
    return absl::StrCat("--listen=", listen, " must be HOST:PORT (port in [0, 65535]; 0 picks one)");
  }
  return "";
}

namespace {

// One thread that finishes reactors handed to it, in order.
class Responder {
 public:
  Responder() : thread_([this] { Loop(); }) {}
  ~Responder() {
    {
      absl::MutexLock lock(&mu_);
      stop_ = true;
    }
    thread_.join();
  }
  void Push(grpc::ServerUnaryReactor* reactor) {
    absl::MutexLock lock(&mu_);
    queue_.push_back(reactor);
  }

 private:
  void Loop() {
    for (;;) {
      grpc::ServerUnaryReactor* reactor;
      {
        absl::MutexLock lock(&mu_);
        mu_.Await(absl::Condition(
            +[](Responder* r) { return r->stop_ || !r->queue_.empty(); }, this));
        if (queue_.empty()) return;
        reactor = queue_.front();
        queue_.pop_front();
      }
      reactor->Finish(grpc::Status::OK);
    }
  }
  absl::Mutex mu_;
  std::deque<grpc::ServerUnaryReactor*> queue_ ABSL_GUARDED_BY(mu_);
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::thread thread_;
};

// Prefill is a raw method: the request is parsed from gRPC's slices (one
// copy: attnserve's edge leaves the query in the slices, and its backend
// makes that one copy into its staging) and the response sent from the
// parsed query's memory (no copy, as attnserve sends its output), so that
// attnecho's floor costs what attnserve's host side costs.
class EchoService final
    : public v1::AttentionService::WithRawCallbackMethod_Prefill<
          v1::AttentionService::CallbackService> {
  static constexpr int64_t kLeaseTtlMs = 30000;
  std::atomic<uint64_t> next_lease_{1};

 public:
  grpc::ServerUnaryReactor* GetServerInfo(grpc::CallbackServerContext* ctx,
                                          const v1::GetServerInfoRequest*,
                                          v1::ServerInfo* info) override {
    info->set_version("echo");
    info->set_backend("echo");
    info->set_device("none (attnecho: transport floor)");
    info->set_num_layers(absl::GetFlag(FLAGS_num_layers));
    info->set_num_pages(absl::GetFlag(FLAGS_num_pages));
    info->set_page_size(absl::GetFlag(FLAGS_page_size));
    info->set_num_qo_heads(absl::GetFlag(FLAGS_num_qo_heads));
    info->set_num_kv_heads(absl::GetFlag(FLAGS_num_kv_heads));
    info->set_head_dim(absl::GetFlag(FLAGS_head_dim));
    info->set_kv_dtype(absl::GetFlag(FLAGS_kv_dtype) == "fp16" ? v1::DTYPE_FP16 : v1::DTYPE_BF16);
    info->set_free_pages(absl::GetFlag(FLAGS_num_pages));
    info->set_max_message_bytes(absl::GetFlag(FLAGS_max_message_bytes));
    info->set_incarnation(1);
    info->set_lease_default_ttl_ms(kLeaseTtlMs);
    info->set_lease_max_ttl_ms(kLeaseTtlMs);
    return Done(ctx);
  }

  grpc::ServerUnaryReactor* AllocatePages(grpc::CallbackServerContext* ctx,
                                          const v1::AllocatePagesRequest* request,
                                          v1::AllocatePagesResponse* response) override {
    const int32_t pages = absl::GetFlag(FLAGS_num_pages);
    if (request->count() <= 0 || request->count() > pages) {
      return Done(ctx, grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "count out of range"));
    }
    // Page ids cycle through the reported range; nothing is stored.
    for (int32_t i = 0; i < request->count(); ++i) {
      response->add_page_ids(static_cast<int32_t>(next_page_++ % pages));
    }
    response->set_incarnation(1);
    return Done(ctx);
  }

  grpc::ServerUnaryReactor* FreePages(grpc::CallbackServerContext* ctx, const v1::FreePagesRequest*,
                                      v1::FreePagesResponse*) override {
    return Done(ctx);
  }

  // Leases (attnbench holds its pages under one): granted and renewed;
  // attnecho holds nothing, so nothing is ever released.
  grpc::ServerUnaryReactor* GrantLease(grpc::CallbackServerContext* ctx, const v1::GrantLeaseRequest* request,
                                       v1::GrantLeaseResponse* response) override {
    response->set_lease_id(next_lease_.fetch_add(1));
    response->set_ttl_ms(request->ttl_ms() > 0 ? request->ttl_ms() : kLeaseTtlMs);
    response->set_incarnation(1);
    return Done(ctx);
  }
  grpc::ServerUnaryReactor* KeepAlive(grpc::CallbackServerContext* ctx, const v1::KeepAliveRequest*,
                                      v1::KeepAliveResponse* response) override {
    response->set_ttl_ms(kLeaseTtlMs);
    response->set_incarnation(1);
    return Done(ctx);
  }
  grpc::ServerUnaryReactor* RevokeLease(grpc::CallbackServerContext* ctx, const v1::RevokeLeaseRequest*,
                                        v1::RevokeLeaseResponse* response) override {
    response->set_incarnation(1);
    return Done(ctx);
  }

  grpc::ServerUnaryReactor* WriteKV(grpc::CallbackServerContext* ctx, const v1::WriteKVRequest*,
                                    v1::WriteKVResponse*) override {
    return Done(ctx);
  }

  grpc::ServerUnaryReactor* ReadKV(grpc::CallbackServerContext* ctx,
                                   const v1::ReadKVRequest* request,
                                   v1::ReadKVResponse* response) override {
    const int64_t bytes = int64_t{request->slots_size()} * absl::GetFlag(FLAGS_num_kv_heads) *
                          absl::GetFlag(FLAGS_head_dim) * 2;
    response->mutable_k()->mutable_data()->resize(bytes);
    response->mutable_v()->mutable_data()->resize(bytes);
    return Done(ctx);
  }

  grpc::ServerUnaryReactor* Prefill(grpc::CallbackServerContext* ctx,
                                    const grpc::ByteBuffer* request_bytes,
                                    grpc::ByteBuffer* response_bytes) override {
    auto request = std::make_unique<v1::PrefillRequest>();
    if (!grpc::SerializationTraits<v1::PrefillRequest>::Deserialize(
             const_cast<grpc::ByteBuffer*>(request_bytes), request.get())
             .ok()) {
      return Done(ctx, grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "request does not parse"));
    }
    // The output has the query's shape and size: send the query back.
    const int64_t rows = request->q().shape_size() > 0 ? request->q().shape(0) : 0;
    const int32_t heads = absl::GetFlag(FLAGS_num_qo_heads);
    auto* lse = new std::string(static_cast<size_t>(rows * heads * 4), '\0');
    const v1::Tensor& q = request->q();
    const std::vector<int64_t> shape(q.shape().begin(), q.shape().end());
    WireWriter w;
    // Each data slice owns what it points into; empty data takes no slice.
    Attach(&w, 1, q.dtype(), shape, q.data(), request.release());
    Attach(&w, 2, v1::DTYPE_FP32, {rows, heads}, *lse, lse);
    w.AppendCopy(std::string("\x19\x01\0\0\0\0\0\0\0", 9));  // fixed64 incarnation = 1
    *response_bytes = w.Finish();
    if (responder_ != nullptr) {
      grpc::ServerUnaryReactor* reactor = ctx->DefaultReactor();
      responder_->Push(reactor);
      return reactor;
    }
    return Done(ctx);
  }

  grpc::ServerUnaryReactor* MergeStates(grpc::CallbackServerContext* ctx,
                                        const v1::MergeStatesRequest* request,
                                        v1::MergeStatesResponse* response) override {
    if (request->states_size() > 0) {
      *response->mutable_v() = request->states(0).v();
      *response->mutable_lse() = request->states(0).lse();
    }
    return Done(ctx);
  }

 private:
  // Appends Tensor field `field` whose data is `data`, which `owner` holds;
  // the owner is deleted once gRPC has sent the data (or at once if empty).
  template <typename Owner>
  static void Attach(WireWriter* w, uint32_t field, int32_t dtype,
                     absl::Span<const int64_t> shape, const std::string& data, Owner* owner) {
    if (data.empty()) {
      w->AppendTensor(field, dtype, shape, grpc::Slice(), 0);
      delete owner;
      return;
    }
    w->AppendTensor(field, dtype, shape,
                    grpc::Slice(const_cast<char*>(data.data()), data.size(),
                                [](void* p) { delete static_cast<Owner*>(p); }, owner),
                    data.size());
  }

  static grpc::ServerUnaryReactor* Done(grpc::CallbackServerContext* ctx,
                                        grpc::Status status = grpc::Status::OK) {
    grpc::ServerUnaryReactor* reactor = ctx->DefaultReactor();
    reactor->Finish(status);
    return reactor;
  }

  std::atomic<int64_t> next_page_{0};
  std::unique_ptr<Responder> responder_ =
      absl::GetFlag(FLAGS_respond_from_worker) ? std::make_unique<Responder>() : nullptr;
};

}  // namespace
}  // namespace attnserve

int main(int argc, char** argv) {
  attnserve::ParseCommandLine(
      argc, argv,
      {"attnecho",
       "attnecho [flags]: attnserve's API with no compute, the transport floor for attnbench.\n"
       "Prefill answers with the query bytes as the output; KV writes are dropped.",
       {{"bench/attnecho.cc", "Flags"}}});
  if (const std::string bad = attnserve::CheckFlags(); !bad.empty()) {
    std::cerr << "attnecho: " << bad << "\n";
    return 2;
  }
  if (absl::GetFlag(FLAGS_retain_freed_memory)) attnserve::RetainFreedMemory();
  attnserve::EchoService service;
  grpc::ServerBuilder builder;
  int port = 0;
  const std::string listen = absl::GetFlag(FLAGS_listen);
  builder.AddListeningPort(listen, grpc::InsecureServerCredentials(), &port);
  builder.RegisterService(&service);
  for (const attnserve::TransportArg& arg :
       attnserve::TransportArgs(absl::GetFlag(FLAGS_transport_tuning))) {
    builder.AddChannelArgument(arg.name, arg.value);
  }
  std::vector<std::string> arg_names;
  std::string arg_error;
  for (const attnserve::TransportArg& arg :
       attnserve::ParseTransportArgs(absl::GetFlag(FLAGS_grpc_args), &arg_names, &arg_error)) {
    builder.AddChannelArgument(arg.name, arg.value);
  }
  if (!arg_error.empty()) {
    std::cerr << "attnecho: --grpc_args: " << arg_error << "\n";
    return 2;
  }
  const int max_bytes = static_cast<int>(
      std::min<int64_t>(absl::GetFlag(FLAGS_max_message_bytes) + (1 << 20), INT32_MAX));
  builder.SetMaxReceiveMessageSize(max_bytes);
  builder.SetMaxSendMessageSize(max_bytes);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (server == nullptr || port == 0) {
    std::cerr << "attnecho: cannot bind --listen=" << listen << "\n";
    return 1;
  }
  const std::string host = listen.substr(0, listen.rfind(':'));
  std::cout << "attnecho listening grpc=" << host << ":" << port << std::endl;
  server->Wait();
  return 0;
}
