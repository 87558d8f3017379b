#include "server/grpc/attention_service.h"

#include <algorithm>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "grpcpp/support/proto_buffer_writer.h"
#include "spdlog/spdlog.h"
#include "server/grpc/attention_service_call.h"
#include "server/grpc/convert.h"
#include "server/grpc/status_mapping.h"

namespace attnserve {
namespace {

// Requests kept for reuse, and the most buffer capacity they may hold: enough
// for 256 in-flight decode requests of 64 sequences. (Their tensors' data is
// read in place, never into the message: what they keep is the layout's
// arrays.)
constexpr size_t kPooledPrefillRequests = 256;
constexpr int64_t kPooledPrefillBytes = int64_t{256} << 20;

}  // namespace

AttentionServiceImpl::AttentionServiceImpl(AttentionCore* core, const TokenAuth* auth,
                                           Metrics* metrics, ServiceOptions options)
    : core_(core),
      auth_(auth),
      metrics_(metrics),
      access_log_(options.access_log),
      read_timeout_(options.read_timeout),
      limits_(core->limits().max_request_rows, core->limits().max_request_kv_indices,
              core->geometry().num_pages, kMaxMergeStates, core->geometry().num_qo_heads,
              core->geometry().num_layers, core->geometry().num_kv_heads),
      prefill_requests_(kPooledPrefillRequests, kPooledPrefillBytes,
                        [](v1::PrefillRequest* r) { return ResetForReuse(r); }) {
  options.channels.access_log = options.access_log;
  channels_ = std::make_unique<ChannelServer>(core, metrics, &limits_, &prefill_requests_,
                                              options.channels);
  RegisterMethods();
  sweeper_ = std::make_unique<ReadSweeper>(ReadSweeper::TickFor(read_timeout_, absl::Milliseconds(100)),
                                           [this](absl::Time now) { return SweepReads(now); });
}

void AttentionServiceImpl::RegisterMethods() {
  using R = Metrics::Rpc;
  using S = AttentionServiceImpl;
  const std::pair<R, Handler> methods[] = {
      {R::kGetServerInfo, &S::GetServerInfo}, {R::kAllocatePages, &S::AllocatePages},
      {R::kFreePages, &S::FreePages},         {R::kWriteKV, &S::WriteKV},
      {R::kReadKV, &S::ReadKV},               {R::kPrefill, &S::Prefill},
      {R::kMergeStates, &S::MergeStates},     {R::kCreatePlan, &S::CreatePlan},
      {R::kReleasePlan, &S::ReleasePlan},     {R::kRegisterRegion, &S::RegisterRegion},
      {R::kUnregisterRegion, &S::UnregisterRegion}, {R::kListRegions, &S::ListRegions},
      {R::kOpenChannel, &S::OpenChannel},     {R::kCloseChannel, &S::CloseChannel},
      {R::kGrantLease, &S::GrantLease},       {R::kKeepAlive, &S::KeepAlive},
      {R::kRevokeLease, &S::RevokeLease},     {R::kListHoldings, &S::ListHoldings},
      {R::kReleaseHoldings, &S::ReleaseHoldings}, {R::kSetKvScales, &S::SetKvScales},
      {R::kGetKvScales, &S::GetKvScales},
  };
  static_assert(sizeof(methods) / sizeof(methods[0]) == static_cast<size_t>(R::kCount));
  method_names_.reserve(std::size(methods));  // gRPC keeps pointers into them
  int index = 0;
  for (const auto& [rpc, handler] : methods) {
    method_names_.push_back(absl::StrCat("/", kServiceName, "/", Metrics::RpcName(rpc)));
    AddMethod(new grpc::internal::RpcServiceMethod(method_names_.back().c_str(),
                                                   grpc::internal::RpcMethod::BIDI_STREAMING,
                                                   nullptr));
    MarkMethodRawCallback(
        index++, new grpc::internal::CallbackBidiHandler<grpc::ByteBuffer, grpc::ByteBuffer>(
                     [this, rpc = rpc, handler = handler](grpc::CallbackServerContext* ctx) {
                       auto* call = new Call(this, ctx, rpc, handler);
                       call->Start();
                       return call;
                     }));
  }
}

AttentionServiceImpl::~AttentionServiceImpl() { sweeper_.reset(); }

bool AttentionServiceImpl::SweepReads(absl::Time now) {
  std::vector<Call*> overdue;
  {
    absl::MutexLock lock(&calls_mu_);
    for (Call* call : calls_) {
      if (call->ReadOverdue(now)) {
        call->Ref();  // alive until finished here, whoever finishes first
        overdue.push_back(call);
      }
    }
  }
  for (Call* call : overdue) {
    call->FinishReadOverdue();
    call->Unref();
  }
  return true;  // keeps looking: most calls read
}

int AttentionServiceImpl::AbandonInflight(const absl::Status& status) {
  std::vector<Call*> calls;
  {
    absl::MutexLock lock(&calls_mu_);
    for (Call* call : calls_) {
      call->Ref();  // alive until we are done with it, whoever finishes first
      calls.push_back(call);
    }
  }
  int abandoned = channels_->AbandonInflight(status);
  for (Call* call : calls) {
    if (call->Claim()) {
      call->Finish(status);
      ++abandoned;
    }
    call->Unref();
  }
  return abandoned;
}

void AttentionServiceImpl::GetServerInfo(Call* call) {
  v1::GetServerInfoRequest parsed;
  if (!call->Open(limits_.get_server_info, &parsed, nullptr)) return;
  const ServerInfoData info = core_->Info();
  v1::ServerInfo out;
  out.set_version(info.version);
  out.set_backend(info.backend);
  out.set_device(info.device);
  out.set_num_layers(info.num_layers);
  out.set_num_pages(info.num_pages);
  out.set_page_size(info.page_size);
  out.set_num_qo_heads(info.num_qo_heads);
  out.set_num_kv_heads(info.num_kv_heads);
  out.set_head_dim(info.head_dim);
  out.set_attention(info.attention == AttentionKind::kMla ? v1::ATTENTION_MLA : v1::ATTENTION_GQA);
  out.set_qk_head_dim(info.head_dim);
  out.set_v_head_dim(info.v_head_dim);
  out.set_kv_lora_rank(info.kv_lora_rank);
  out.set_qk_rope_head_dim(info.qk_rope_head_dim);
  out.set_kv_dtype(info.kv_fp8 != Fp8Format::kNone ? ToProto(TensorDTypeOf(info.kv_fp8))
                                                   : ToProto(info.kv_dtype));
  out.set_q_dtype(ToProto(info.kv_dtype));
  out.set_kv_cache_bytes(info.kv_cache_bytes);
  out.set_page_bytes(info.page_bytes);
  out.set_free_pages(info.free_pages);
  out.set_max_batch_tokens(info.max_batch_tokens);
  out.set_max_message_bytes(info.max_message_bytes);
  out.set_incarnation(info.incarnation);
  out.set_lease_default_ttl_ms(info.lease_default_ttl_ms);
  out.set_lease_max_ttl_ms(info.lease_max_ttl_ms);
  out.set_fp8_query_min_rows(info.fp8_query_min_rows);
  {
    absl::MutexLock lock(&region_socket_mu_);
    out.set_region_socket(region_socket_);
  }
  if (call->Claim()) call->Finish(absl::OkStatus(), &out);
}

void AttentionServiceImpl::AllocatePages(Call* call) {
  v1::AllocatePagesRequest parsed;
  CallContext c;
  if (!call->Open(limits_.allocate_pages, &parsed, &c)) return;
  auto pages = core_->AllocatePages(c, parsed.count());
  v1::AllocatePagesResponse out;
  if (pages.ok()) {
    out.mutable_page_ids()->Assign(pages->begin(), pages->end());
    out.set_incarnation(core_->incarnation());
  }
  if (call->Claim()) call->Finish(pages.status(), &out);
}

void AttentionServiceImpl::FreePages(Call* call) {
  auto parsed = std::make_shared<v1::FreePagesRequest>();
  CallContext c;
  if (!call->Open(limits_.free_pages, parsed.get(), &c)) return;
  call->Ref();
  const uint64_t incarnation = core_->incarnation();
  core_->FreePages(c,
                   absl::MakeConstSpan(parsed->page_ids().data(),
                                       static_cast<size_t>(parsed->page_ids_size())),
                   [call, parsed, incarnation](absl::Status status) {
                     if (call->Claim()) {
                       v1::FreePagesResponse out;
                       out.set_incarnation(incarnation);
                       call->Finish(status, &out);
                     }
                     call->Unref();
                   });
}

void AttentionServiceImpl::WriteKV(Call* call) {
  // The request, and its k and v data left in gRPC's slices, until the
  // core is done with them.
  struct State {
    v1::WriteKVRequest request;
    InPlaceTensors tensors;
  };
  auto state = std::make_shared<State>();
  WriteKvCall c;
  if (!call->Open(limits_.write_kv, &state->request, &c, kWriteKvInPlace, &state->tensors)) {
    return;
  }
  ToCall(state->request, state->tensors, &c);
  call->Ref();
  const uint64_t incarnation = core_->incarnation();
  core_->WriteKv(c, [call, state, incarnation](absl::Status status) {
    if (call->Claim()) {
      v1::WriteKVResponse out;
      out.set_incarnation(incarnation);
      call->Finish(status, &out);
    }
    call->Unref();
  });
}

void AttentionServiceImpl::ReadKV(Call* call) {
  struct State {
    v1::ReadKVRequest request;
    // The backend writes the rows into its k and v data; sent from there.
    std::unique_ptr<v1::ReadKVResponse> response = std::make_unique<v1::ReadKVResponse>();
    TensorDType dtype = TensorDType::kUnspecified;  // of the rows, set by the core
  };
  auto state = std::make_shared<State>();
  ReadKvCall c;
  if (!call->Open(limits_.read_kv, &state->request, &c)) return;
  ToCall(state->request, state->response.get(), &c);
  c.out_dtype = &state->dtype;
  const KvGeometry& g = core_->geometry();
  call->Ref();
  const uint64_t incarnation = core_->incarnation();
  core_->ReadKv(c, [call, state, g, incarnation](absl::Status status) {
    if (call->Claim()) {
      grpc::ByteBuffer bytes;
      if (status.ok()) {
        v1::ReadKVResponse& out = *state->response;
        const v1::DType dtype = ToProto(state->dtype);
        const int64_t n = state->request.slots_size();
        SetTensorHeader(out.mutable_k(), dtype, {n, g.num_kv_heads, g.head_dim});
        if (g.HasVPool()) SetTensorHeader(out.mutable_v(), dtype, {n, g.num_kv_heads, g.head_dim});
        out.set_incarnation(incarnation);
        bytes = EncodeTensorResponse(std::move(state->response));
      }
      call->Finish(status, nullptr, &bytes);
    }
    call->Unref();
  });
}

void AttentionServiceImpl::Prefill(Call* call) {
  // What the request and its output need until the response is encoded:
  // the request's small fields, its tensors' data (left in gRPC's slices)
  // and the output.
  struct State {
    RecyclingPool<v1::PrefillRequest>::Ptr request;
    InPlaceTensors tensors;
    PrefillOutput out;
  };
  auto* state = new State{prefill_requests_.Get(), {}, {}};
  PrefillCall c;
  if (!call->Open(limits_.prefill, state->request.get(), &c, kPrefillInPlace, &state->tensors)) {
    delete state;
    return;
  }
  const v1::PrefillRequest& parsed = *state->request;
  call->set_shape(PrefillShape(parsed));
  ToCall(parsed, state->tensors, &c);
  c.out = &state->out;
  const uint64_t incarnation = core_->incarnation();
  call->MarkStage(Metrics::RequestStage::kParse);
  call->Ref();
  // The done callback may run before Prefill returns (an error found at
  // once, or a batch that finished first): the admit mark is taken before
  // the call can be finished, under the reference held for the callback.
  call->Ref();
  core_->Prefill(c, [call, state, incarnation](absl::Status status) {
    if (call->Claim()) {
      const absl::Time done_at = absl::Now();
      if (state->out.max_seq_q_rows >= 0) call->set_shape(ShapeOfRows(state->out.max_seq_q_rows));
      grpc::ByteBuffer bytes;
      if (status.ok()) bytes = EncodePrefillResponse(std::move(state->out), incarnation);
      call->ObserveRespond(done_at);
      call->Finish(status, nullptr, &bytes);
      // Only then does the request go back to the pool and its slices to
      // gRPC (the output lives in `bytes`): releasing a large request's
      // slices took milliseconds, which the response no longer waits for.
      delete state;
    } else {
      delete state;
    }
    call->Unref();
  });
  call->MarkStage(Metrics::RequestStage::kAdmit);
  call->Unref();
}

void AttentionServiceImpl::MergeStates(Call* call) {
  struct State {
    v1::MergeStatesRequest request;
    // The backend writes the merged state into its v and lse data.
    std::unique_ptr<v1::MergeStatesResponse> response =
        std::make_unique<v1::MergeStatesResponse>();
  };
  auto state = std::make_shared<State>();
  MergeStatesCall c;
  if (!call->Open(limits_.merge_states, &state->request, &c)) return;
  ToCall(state->request, state->response.get(), &c);
  std::vector<int64_t> shape;
  if (!c.v.empty()) shape = c.v[0].shape;  // validated rank 3 when the merge succeeds
  const v1::DType dtype = ToProto(core_->geometry().dtype);
  const uint64_t incarnation = core_->incarnation();
  call->Ref();
  core_->MergeStates(c, [call, state, dtype, shape, incarnation](absl::Status status) {
    if (call->Claim()) {
      grpc::ByteBuffer bytes;
      if (status.ok()) {
        v1::MergeStatesResponse& out = *state->response;
        SetTensorHeader(out.mutable_v(), dtype, shape);
        SetTensorHeader(out.mutable_lse(), v1::DTYPE_FP32, absl::MakeConstSpan(shape.data(), 2));
        out.set_incarnation(incarnation);
        bytes = EncodeTensorResponse(std::move(state->response));
      }
      call->Finish(status, nullptr, &bytes);
    }
    call->Unref();
  });
}

}  // namespace attnserve
