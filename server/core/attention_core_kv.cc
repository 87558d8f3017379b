// AttentionCore's row and state requests: WriteKv, ReadKv, MergeStates,
// SetKvScales (and KvScales), each through the request paths'
// RegionUse and Submit (attention_core_requests.h).
#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "server/core/attention_core.h"
#include "server/core/attention_core_requests.h"
#include "server/core/status_macros.h"

namespace attnserve {

void AttentionCore::WriteKv(const WriteKvCall& request, DoneCallback done) {
  if (absl::Status stale = CheckIncarnation(request.expected_incarnation, incarnation_);
      !stale.ok()) {
    done(stale);
    return;
  }
  RegionUse regions(&regions_, &channels_, request.tenant);
  WriteKvCall resolved;
  const bool any_region = request.k.region.set || request.v.region.set;
  if (any_region) {
    resolved = request;
    absl::Status status = regions.Input(&resolved.k, RowElemBytes(resolved.k), "k");
    if (status.ok()) status = regions.Input(&resolved.v, RowElemBytes(resolved.v), "v");
    if (!status.ok()) {
      done(status);
      return;
    }
  }
  const WriteKvCall& call = any_region ? resolved : request;
  bool rows_fp8 = false;
  auto pages = ValidateKvRows(call.layer, call.slots, &call.k, &call.v, backend_->Geometry(),
                              limits_, &rows_fp8);
  if (!pages.ok()) {
    done(pages.status());
    return;
  }
  auto job = std::make_unique<Job>();
  if (written_ != nullptr) {
    job->on_success =
        written_->Marker(call.layer, call.slots.data(), static_cast<int64_t>(call.slots.size()), nullptr);
  }
  job->kind = Job::Kind::kWriteKv;
  job->rows.layer = call.layer;
  job->rows.slots = call.slots.data();
  job->rows.n = static_cast<int64_t>(call.slots.size());
  // The backend only reads k and v for a write.
  job->rows.k = const_cast<char*>(call.k.data.data());
  job->rows.v = const_cast<char*>(call.v.data.data());
  job->rows.k_scattered = call.k.scattered;
  job->rows.v_scattered = call.v.scattered;
  job->rows.k_on_device = call.k.on_device;
  job->rows.v_on_device = call.v.on_device;
  job->rows.rows_fp8 = rows_fp8;
  job->done = regions.Wrap(std::move(done), metrics_);
  Submit(call, *std::move(pages), {"slots", 0, "slots", call.slots.data()}, std::move(job));
}

void AttentionCore::ReadKv(const ReadKvCall& call, DoneCallback done) {
  if (absl::Status stale = CheckIncarnation(call.expected_incarnation, incarnation_);
      !stale.ok()) {
    done(stale);
    return;
  }
  const KvGeometry& g = backend_->Geometry();
  // An FP8 cache's stored bytes, unless the caller asks for its values.
  bool rows_fp8 = g.KvIsFp8() && !call.dequantize;
  auto pages = ValidateKvRows(call.layer, call.slots, nullptr, nullptr, g, limits_, &rows_fp8);
  if (!pages.ok()) {
    done(pages.status());
    return;
  }
  const int64_t n = static_cast<int64_t>(call.slots.size());
  const int64_t elem = rows_fp8 ? g.KvElemBytes() : g.QElemBytes();
  const int64_t bytes = n * g.RowElems() * elem;  // of K, and of V (none for MLA)
  if (call.out_dtype != nullptr) {
    *call.out_dtype = rows_fp8 ? TensorDTypeOf(g.kv_fp8) : TensorDTypeOf(g.dtype);
  }
  auto job = std::make_unique<Job>();
  job->kind = Job::Kind::kReadKv;
  job->rows.layer = call.layer;
  job->rows.slots = call.slots.data();
  job->rows.n = n;
  job->rows.rows_fp8 = rows_fp8;
  RegionUse regions(&regions_, &channels_, call.tenant);
  if (!g.HasVPool() && call.v_region.set) {
    done(absl::InvalidArgumentError(
        "v_region must be unset: an MLA server (--attention=mla) has no V rows; k_region "
        "receives the latent rows"));
    return;
  }
  if (g.HasVPool() && call.k_region.set != call.v_region.set) {
    done(absl::InvalidArgumentError("k_region and v_region go together: set both or neither"));
    return;
  }
  if (call.k_region.set) {
    auto k = regions.Output(call.k_region, bytes, elem, "k_region");
    if (!k.ok()) {
      done(k.status());
      return;
    }
    job->rows.k = k->data;
    job->rows.k_on_device = k->on_device;
    if (g.HasVPool()) {
      auto v = regions.Output(call.v_region, bytes, elem, "v_region");
      if (!v.ok()) {
        done(v.status());
        return;
      }
      job->rows.v = v->data;
      job->rows.v_on_device = v->on_device;
    }
  } else {
    call.out_k->resize(bytes);
    job->rows.k = call.out_k->data();
    if (g.HasVPool()) {
      call.out_v->resize(bytes);
      job->rows.v = call.out_v->data();
    }
    job->held_bytes = g.HasVPool() ? 2 * bytes : bytes;
  }
  job->done = regions.Wrap(std::move(done), metrics_);
  Submit(call, *std::move(pages), {"slots", 0, "slots", call.slots.data()}, std::move(job));
}

void AttentionCore::MergeStates(const MergeStatesCall& request, DoneCallback done) {
  RegionUse regions(&regions_, &channels_, request.tenant);
  MergeStatesCall resolved;
  bool any_region = request.v_region.set || request.lse_region.set;
  for (size_t i = 0; i < request.v.size() && !any_region; ++i) {
    any_region = request.v[i].region.set || request.lse[i].region.set;
  }
  if (any_region) {
    resolved = request;
    const int64_t elem = backend_->Geometry().QElemBytes();
    absl::Status status;
    for (size_t i = 0; i < resolved.v.size() && status.ok(); ++i) {
      status = regions.Input(&resolved.v[i], elem, absl::StrCat("states[", i, "].v"));
      if (status.ok()) {
        status = regions.Input(&resolved.lse[i], 4, absl::StrCat("states[", i, "].lse"));
      }
    }
    if (status.ok() && resolved.v_region.set != resolved.lse_region.set) {
      status = absl::InvalidArgumentError(
          "v_region and lse_region go together: set both or neither");
    }
    if (!status.ok()) {
      done(status);
      return;
    }
  }
  const MergeStatesCall& call = any_region ? resolved : request;
  auto shape = ValidateMerge(call, backend_->Geometry(), limits_);
  if (!shape.ok()) {
    done(shape.status());
    return;
  }
  const int64_t rows = shape->n * shape->h;
  const int64_t elem = backend_->Geometry().QElemBytes();
  char* v_out = nullptr;
  char* lse_out = nullptr;
  auto job = std::make_unique<Job>();
  if (call.v_region.set) {
    auto v = regions.Output(call.v_region, rows * shape->d * elem, elem, "v_region");
    if (!v.ok()) {
      done(v.status());
      return;
    }
    auto lse = regions.Output(call.lse_region, rows * 4, 4, "lse_region");
    if (!lse.ok()) {
      done(lse.status());
      return;
    }
    v_out = v->data;
    lse_out = lse->data;
    job->merge_on_device.v_out = v->on_device;
    job->merge_on_device.lse_out = lse->on_device;
  } else {
    call.out_v->resize(rows * shape->d * elem);
    call.out_lse->resize(rows * sizeof(float));
    v_out = call.out_v->data();
    lse_out = call.out_lse->data();
    job->held_bytes = rows * shape->d * elem + rows * static_cast<int64_t>(sizeof(float));
  }
  job->kind = Job::Kind::kMerge;
  for (size_t i = 0; i < call.v.size(); ++i) {
    job->merge_v.push_back(call.v[i].data.data());
    job->merge_lse.push_back(reinterpret_cast<const float*>(call.lse[i].data.data()));
    job->merge_on_device.v.push_back(call.v[i].on_device);
    job->merge_on_device.lse.push_back(call.lse[i].on_device);
  }
  MergeStatesParams& m = job->merge;
  m.v = job->merge_v.data();
  m.lse = job->merge_lse.data();
  m.num_states = static_cast<int32_t>(call.v.size());
  m.v_out = v_out;
  m.lse_out = reinterpret_cast<float*>(lse_out);
  m.n = shape->n;
  m.h = shape->h;
  m.d = shape->d;
  m.dtype = backend_->Geometry().dtype;
  m.lse_base_e = static_cast<uint8_t>(call.lse_base);
  job->done = regions.Wrap(std::move(done), metrics_);
  Submit(call, {}, "", std::move(job));
}

void AttentionCore::SetKvScales(const SetKvScalesCall& call, DoneCallback done) {
  if (absl::Status stale = CheckIncarnation(call.expected_incarnation, incarnation_);
      !stale.ok()) {
    done(stale);
    return;
  }
  const KvGeometry& g = backend_->Geometry();
  if (absl::Status bad = ValidateKvScales(call.layers, g); !bad.ok()) {
    done(bad);
    return;
  }
  // Each layer's scales per KV head (one value repeated over the heads).
  struct Update {
    int32_t layer;
    std::vector<float> k, v;
  };
  auto updates = std::make_shared<std::vector<Update>>();
  const size_t heads = static_cast<size_t>(g.num_kv_heads);
  for (const LayerScalesView& l : call.layers) {
    Update u{l.layer, std::vector<float>(heads), std::vector<float>(heads)};
    for (size_t h = 0; h < heads; ++h) {
      u.k[h] = l.k_scale.size() == 1 ? l.k_scale[0] : l.k_scale[h];
      u.v[h] = l.v_scale.size() == 1 ? l.v_scale[0] : l.v_scale[h];
    }
    updates->push_back(std::move(u));
  }
  auto job = std::make_unique<Job>();
  job->kind = Job::Kind::kRun;
  // On the worker, between batches: ordered with the writes and reads around
  // it. A change is refused while another tenant holds pages, whose KV was
  // quantized with the scales in force; setting the values already in force
  // changes nothing and is always allowed.
  job->run = [this, updates, tenant = call.tenant](Backend* backend) -> absl::Status {
    absl::MutexLock lock(&scales_mu_);
    const size_t heads = static_cast<size_t>(backend->Geometry().num_kv_heads);
    bool changes = false;
    for (const Update& u : *updates) {
      changes = changes ||
                !std::equal(u.k.begin(), u.k.end(), k_scales_.begin() + u.layer * heads) ||
                !std::equal(u.v.begin(), u.v.end(), v_scales_.begin() + u.layer * heads);
    }
    if (!changes) return absl::OkStatus();
    if (const int32_t others = pages_.OtherTenantsPages(tenant); others > 0) {
      return absl::FailedPreconditionError(absl::StrCat(
          "SetKvScales would change the scales of KV that other tenants hold (", others,
          " pages): a layer's scales are the server's, and their FP8 rows were quantized with "
          "the scales in force; change them while no other tenant holds pages"));
    }
    for (const Update& u : *updates) {
      ATTN_RETURN_IF_ERROR(backend->SetKvScales(u.layer, u.k, u.v));
      std::copy(u.k.begin(), u.k.end(), k_scales_.begin() + u.layer * heads);
      std::copy(u.v.begin(), u.v.end(), v_scales_.begin() + u.layer * heads);
    }
    return absl::OkStatus();
  };
  job->done = std::move(done);
  Submit(call, {}, "", std::move(job));
}

std::vector<LayerScales> AttentionCore::KvScales() const {
  const KvGeometry& g = backend_->Geometry();
  std::vector<LayerScales> out;
  if (!g.KvIsFp8()) return out;
  const size_t heads = static_cast<size_t>(g.num_kv_heads);
  absl::MutexLock lock(&scales_mu_);
  for (int32_t layer = 0; layer < g.num_layers; ++layer) {
    LayerScales l;
    l.layer = layer;
    l.k_scale.assign(k_scales_.begin() + layer * heads, k_scales_.begin() + (layer + 1) * heads);
    l.v_scale.assign(v_scales_.begin() + layer * heads, v_scales_.begin() + (layer + 1) * heads);
    out.push_back(std::move(l));
  }
  return out;
}

}  // namespace attnserve
