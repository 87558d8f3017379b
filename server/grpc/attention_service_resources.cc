// AttentionServiceImpl's handlers of the calls that manage what a tenant
// holds: plans, regions, channels, leases and holdings, and FP8 KV scales
// (attention_service.cc has the data path: pages, rows, Prefill, merges).
#include <utility>

#include "server/grpc/attention_service.h"
#include "server/grpc/attention_service_call.h"

namespace attnserve {

void AttentionServiceImpl::CreatePlan(Call* call) {
  v1::CreatePlanRequest parsed;
  CallContext c;
  if (!call->Open(limits_.create_plan, &parsed, &c)) return;
  auto id = core_->CreatePlan(c, ToLayout(parsed), ToPlanOptions(parsed));
  v1::CreatePlanResponse out;
  if (id.ok()) {
    out.set_plan_id(*id);
    out.set_incarnation(core_->incarnation());
  }
  if (call->Claim()) call->Finish(id.status(), &out);
}

void AttentionServiceImpl::ReleasePlan(Call* call) {
  v1::ReleasePlanRequest parsed;
  CallContext c;
  if (!call->Open(limits_.release_plan, &parsed, &c)) return;
  const absl::Status status = core_->ReleasePlan(c, parsed.plan_id());
  v1::ReleasePlanResponse out;
  out.set_incarnation(core_->incarnation());
  if (call->Claim()) call->Finish(status, &out);
}

void AttentionServiceImpl::RegisterRegion(Call* call) {
  v1::RegisterRegionRequest parsed;
  if (!call->Parse(limits_.register_region, &parsed)) return;
  CallContext c;
  call->Bind(&c);
  c.lease_id = parsed.lease_id();
  const absl::Status status = core_->RegisterRegion(c, ToSpec(parsed));
  v1::RegisterRegionResponse out;
  out.set_incarnation(core_->incarnation());
  if (call->Claim()) call->Finish(status, &out);
}

void AttentionServiceImpl::UnregisterRegion(Call* call) {
  v1::UnregisterRegionRequest parsed;
  if (!call->Parse(limits_.unregister_region, &parsed)) return;
  CallContext c;
  call->Bind(&c);
  const absl::Status status = core_->UnregisterRegion(c, parsed.name());
  v1::UnregisterRegionResponse out;
  out.set_incarnation(core_->incarnation());
  if (call->Claim()) call->Finish(status, &out);
}

void AttentionServiceImpl::ListRegions(Call* call) {
  v1::ListRegionsRequest parsed;
  if (!call->Parse(limits_.list_regions, &parsed)) return;
  CallContext c;
  call->Bind(&c);
  v1::ListRegionsResponse out;
  for (const RegionInfoData& info : core_->ListRegions(c)) ToProto(info, out.add_regions());
  out.set_incarnation(core_->incarnation());
  if (call->Claim()) call->Finish(absl::OkStatus(), &out);
}

void AttentionServiceImpl::OpenChannel(Call* call) {
  v1::OpenChannelRequest parsed;
  CallContext c;
  if (!call->Open(limits_.open_channel, &parsed, &c)) return;
  auto opened = channels_->Open(c, ToRingRef(parsed));
  v1::OpenChannelResponse out;
  if (opened.ok()) {
    out.set_channel_id(opened->id);
    out.set_slot_count(static_cast<uint32_t>(opened->slot_count));
    out.set_slot_bytes(static_cast<uint32_t>(opened->slot_bytes));
    out.set_incarnation(core_->incarnation());
  }
  if (call->Claim()) call->Finish(opened.status(), &out);
}

void AttentionServiceImpl::CloseChannel(Call* call) {
  v1::CloseChannelRequest parsed;
  CallContext c;
  if (!call->Open(limits_.close_channel, &parsed, &c)) return;
  const absl::Status status = channels_->Close(c, parsed.channel_id());
  v1::CloseChannelResponse out;
  out.set_incarnation(core_->incarnation());
  if (call->Claim()) call->Finish(status, &out);
}

namespace {

void ToProto(const HoldingsData& h, v1::Holdings* out) {
  out->mutable_page_ids()->Assign(h.pages.begin(), h.pages.end());
  out->mutable_plan_ids()->Assign(h.plans.begin(), h.plans.end());
  for (const std::string& name : h.regions) out->add_region_names(name);
  out->mutable_channel_ids()->Assign(h.channels.begin(), h.channels.end());
}

}  // namespace

void AttentionServiceImpl::GrantLease(Call* call) {
  v1::GrantLeaseRequest parsed;
  CallContext c;
  if (!call->Open(limits_.grant_lease, &parsed, &c)) return;
  auto granted = core_->GrantLease(c, parsed.ttl_ms());
  v1::GrantLeaseResponse out;
  if (granted.ok()) {
    out.set_lease_id(granted->id);
    out.set_ttl_ms(absl::ToInt64Milliseconds(granted->ttl));
    out.set_incarnation(core_->incarnation());
  }
  if (call->Claim()) call->Finish(granted.status(), &out);
}

void AttentionServiceImpl::KeepAlive(Call* call) {
  v1::KeepAliveRequest parsed;
  CallContext c;
  if (!call->Open(limits_.keep_alive, &parsed, &c)) return;
  auto ttl = core_->KeepAlive(c, parsed.lease_id());
  v1::KeepAliveResponse out;
  if (ttl.ok()) {
    out.set_ttl_ms(*ttl);
    out.set_incarnation(core_->incarnation());
  }
  if (call->Claim()) call->Finish(ttl.status(), &out);
}

void AttentionServiceImpl::RevokeLease(Call* call) {
  v1::RevokeLeaseRequest parsed;
  CallContext c;
  if (!call->Open(limits_.revoke_lease, &parsed, &c)) return;
  // Answered once the pages it freed are zeroed (AttentionCore::RevokeLease).
  call->Ref();
  const uint64_t incarnation = core_->incarnation();
  core_->RevokeLease(c, parsed.lease_id(), [call, incarnation](absl::StatusOr<HoldingsData> released) {
    if (call->Claim()) {
      v1::RevokeLeaseResponse out;
      if (released.ok()) {
        ToProto(*released, out.mutable_released());
        out.set_incarnation(incarnation);
      }
      call->Finish(released.status(), &out);
    }
    call->Unref();
  });
}

void AttentionServiceImpl::ListHoldings(Call* call) {
  v1::ListHoldingsRequest parsed;
  CallContext c;
  if (!call->Open(limits_.list_holdings, &parsed, &c)) return;
  auto held = core_->ListHoldings(c, parsed.lease_id());
  v1::ListHoldingsResponse out;
  if (held.ok()) {
    for (const LeaseData& l : held->leases) {
      v1::LeaseInfo* info = out.add_leases();
      info->set_lease_id(l.id);
      info->set_ttl_ms(l.ttl_ms);
      info->set_remaining_ms(l.remaining_ms);
      ToProto(l.holdings, info->mutable_holdings());
    }
    ToProto(held->unleased, out.mutable_unleased());
    out.set_incarnation(core_->incarnation());
  }
  if (call->Claim()) call->Finish(held.status(), &out);
}

void AttentionServiceImpl::ReleaseHoldings(Call* call) {
  v1::ReleaseHoldingsRequest parsed;
  CallContext c;
  if (!call->Open(limits_.release_holdings, &parsed, &c)) return;
  // Answered once the pages it freed are zeroed (AttentionCore::RevokeLease).
  call->Ref();
  const uint64_t incarnation = core_->incarnation();
  core_->ReleaseHoldings(c, [call, incarnation](absl::StatusOr<HoldingsData> released) {
    if (call->Claim()) {
      v1::ReleaseHoldingsResponse out;
      if (released.ok()) {
        ToProto(*released, out.mutable_released());
        out.set_incarnation(incarnation);
      }
      call->Finish(released.status(), &out);
    }
    call->Unref();
  });
}

void AttentionServiceImpl::SetKvScales(Call* call) {
  auto parsed = std::make_shared<v1::SetKvScalesRequest>();
  CallContext context;
  if (!call->Open(limits_.set_kv_scales, parsed.get(), &context)) return;
  SetKvScalesCall c = ToCall(*parsed);  // views `parsed`, which the callback keeps
  static_cast<CallContext&>(c) = context;
  call->Ref();
  const uint64_t incarnation = core_->incarnation();
  core_->SetKvScales(c, [call, parsed, incarnation](absl::Status status) {
    if (call->Claim()) {
      v1::SetKvScalesResponse out;
      out.set_incarnation(incarnation);
      call->Finish(status, &out);
    }
    call->Unref();
  });
}

void AttentionServiceImpl::GetKvScales(Call* call) {
  v1::GetKvScalesRequest parsed;
  if (!call->Open(limits_.get_kv_scales, &parsed, nullptr)) return;
  v1::GetKvScalesResponse out;
  for (const LayerScales& l : core_->KvScales()) {
    v1::LayerKvScales* m = out.add_layers();
    m->set_layer(l.layer);
    m->mutable_k_scale()->Assign(l.k_scale.begin(), l.k_scale.end());
    m->mutable_v_scale()->Assign(l.v_scale.begin(), l.v_scale.end());
  }
  out.set_incarnation(core_->incarnation());
  if (call->Claim()) call->Finish(absl::OkStatus(), &out);
}

}  // namespace attnserve
