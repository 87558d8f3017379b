// The cluster's servers (client/cluster.h): connecting, joining and
// resolving them, their geometry and scales, their free pages, and what a
// server's failure or restart loses. The steps (Plan, Run, Finish) are in
// client/cluster.cc.
#include "client/cluster.h"

#include <netdb.h>
#include <sys/socket.h>

#include <algorithm>
#include <cstring>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"

namespace attnserve {
namespace {

constexpr char kDnsScheme[] = "dns:///";

// getaddrinfo of host:port as "ip:port" / "[ipv6]:port", sorted, distinct.
absl::StatusOr<std::vector<std::string>> GetAddrInfo(const std::string& host,
                                                     const std::string& port) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_ADDRCONFIG;
  addrinfo* res = nullptr;
  const int rc = getaddrinfo(host.c_str(), port.c_str(), &hints, &res);
  if (rc != 0) {
    return absl::UnavailableError(
        absl::StrCat("cannot resolve ", host, ":", port, ": ", gai_strerror(rc)));
  }
  std::vector<std::string> out;
  for (addrinfo* a = res; a != nullptr; a = a->ai_next) {
    char ip[NI_MAXHOST];
    if (getnameinfo(a->ai_addr, a->ai_addrlen, ip, sizeof(ip), nullptr, 0, NI_NUMERICHOST) != 0) {
      continue;
    }
    out.push_back(a->ai_family == AF_INET6 ? absl::StrCat("[", ip, "]:", port)
                                           : absl::StrCat(ip, ":", port));
  }
  freeaddrinfo(res);
  std::sort(out.begin(), out.end());
  out.erase(std::unique(out.begin(), out.end()), out.end());
  return out;
}

}  // namespace

absl::Status Cluster::LostError(absl::Span<const int64_t> ids, absl::string_view why) {
  return SequencesLostError(ids, why);
}

absl::StatusOr<std::unique_ptr<Cluster>> Cluster::Connect(const ClusterOptions& options) {
  if (options.targets.empty()) return absl::InvalidArgumentError("targets is empty");
  if (options.split_min_tokens < 0 || options.max_servers_per_sequence < 0) {
    return absl::InvalidArgumentError(
        "split_min_tokens and max_servers_per_sequence must be >= 0");
  }
  std::unique_ptr<Cluster> c(new Cluster());
  c->options_ = options;
  if (!c->options_.resolver) c->options_.resolver = GetAddrInfo;
  std::vector<std::string> addresses;
  for (const std::string& t : options.targets) {
    if (absl::StartsWith(t, kDnsScheme)) {
      if (options.targets.size() != 1) {
        return absl::InvalidArgumentError(
            absl::StrCat("a dns:/// target must be the only one, not one of ",
                         options.targets.size()));
      }
      const std::string name = t.substr(strlen(kDnsScheme));
      const size_t colon = name.rfind(':');
      if (colon == std::string::npos || colon == 0 || colon + 1 == name.size()) {
        return absl::InvalidArgumentError(
            absl::StrCat("target ", t, ": needs dns:///NAME:PORT"));
      }
      c->dns_host_ = name.substr(0, colon);
      c->dns_port_ = name.substr(colon + 1);
    } else {
      addresses.push_back(t);
    }
  }
  if (!c->dns_host_.empty()) {
    auto resolved = c->options_.resolver(c->dns_host_, c->dns_port_);
    if (!resolved.ok()) return resolved.status();
    if (resolved->empty()) {
      return absl::UnavailableError(
          absl::StrCat(options.targets[0], " resolves to no address"));
    }
    addresses = *std::move(resolved);
  }
  for (const std::string& a : addresses) {
    auto added = c->AddServer(a);
    if (!added.ok()) return added.status();
  }
  return c;
}

absl::StatusOr<int32_t> Cluster::AddServer(const std::string& address) {
  ClientOptions co = options_.client;
  co.target = address;
  co.fetch_info = true;
  auto client = Client::Connect(co);
  if (!client.ok()) {
    return absl::Status(client.status().code(),
                        absl::StrCat("server ", address, ": ", client.status().message()));
  }
  const KvGeometry g = GeometryOf((*client)->info());
  if (servers_.empty()) {
    geo_ = g;
  } else if (std::string diff = GeometryDifference(geo_, g, "the others have"); !diff.empty()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "server ", address, " has another geometry: ", diff,
        "; every server of a cluster must have the same layers, page size, heads, head_dim "
        "and dtype"));
  }
  auto s = std::make_unique<Server>();
  s->address = address;
  s->client = *std::move(client);
  s->kv = std::make_unique<KvManager>(s->client.get(), options_.kv);
  s->free_base = s->client->info().free_pages();
  servers_.push_back(std::move(s));
  const int32_t index = static_cast<int32_t>(servers_.size() - 1);
  if (absl::Status st = ApplyScales(index); !st.ok()) {
    servers_.pop_back();
    return absl::Status(st.code(), absl::StrCat("server ", address, ": ", st.message()));
  }
  return index;
}

absl::Status Cluster::ApplyScales(int32_t server) {
  Server& s = *servers_[server];
  if (kv_scales_.empty() || s.scales_incarnation == s.client->incarnation()) {
    return absl::OkStatus();
  }
  std::vector<LayerKvScales> layers;
  for (const auto& [layer, l] : kv_scales_) layers.push_back(l);
  if (absl::Status st = s.client->SetKvScales(layers); !st.ok()) return st;
  s.scales_incarnation = s.client->incarnation();
  return absl::OkStatus();
}

absl::Status Cluster::SetKvScales(absl::Span<const LayerKvScales> layers) {
  for (const auto& s : servers_) {
    if (s->gone) continue;
    absl::Status st = s->client->SetKvScales(layers);
    if (!st.ok()) {
      return absl::Status(st.code(), absl::StrCat("server ", s->address, ": ", st.message()));
    }
    s->scales_incarnation = s->client->incarnation();
  }
  for (const LayerKvScales& l : layers) kv_scales_[l.layer] = l;
  return absl::OkStatus();
}

int64_t Cluster::FreeEstimate(const Server& s) const {
  return s.free_base - (s.kv->NumPages() - s.held_base);
}

void Cluster::ReadInfo(int32_t server, const v1::ServerInfo& info) {
  Server& s = *servers_[server];
  s.free_base = info.free_pages();
  s.held_base = s.kv->NumPages();
}

std::vector<ClusterServer> Cluster::Servers() const {
  std::vector<ClusterServer> out;
  for (const auto& s : servers_) {
    ClusterServer cs;
    cs.address = s->address;
    cs.active = Usable(*s);
    cs.incarnation = s->client->incarnation();
    cs.restarts = s->epoch;
    cs.free_pages = FreeEstimate(*s);
    cs.pages_held = s->kv->NumPages();
    cs.leaked_pages = s->kv->Leaked();
    out.push_back(cs);
  }
  for (const auto& [id, seq] : seqs_) {
    for (const Shard& sh : seq.shards) ++out[sh.server].sequences;
  }
  return out;
}

std::vector<int64_t> Cluster::LoseServer(int32_t server, Loss why, bool gone) {
  Server& s = *servers_[server];
  std::vector<int64_t> lost;
  for (auto& [id, seq] : seqs_) {
    auto it = std::find_if(seq.shards.begin(), seq.shards.end(),
                           [&](const Shard& sh) { return sh.server == server; });
    if (it == seq.shards.end()) continue;
    seq.shards.erase(it);  // what it held there is gone; the rest waits for Finish()
    seq.lost = true;
    lost.push_back(id);
  }
  // An unreachable server may still hold the pages: with the lease it frees
  // them when the lease ends; without, they are counted as leaked.
  if (why == Loss::kUnreachable) {
    s.kv->Abandon();
  } else {
    // A lost lease leaves the server up: the leases the manager still has
    // to revoke (a Release()'s or Plan()'s RevokeLease that failed, or
    // abandoned while the server seemed unreachable) may live.
    s.kv->Reset(/*restarted=*/why == Loss::kRestarted);
  }
  ++s.epoch;
  s.unreachable_since.reset();
  s.gone = s.gone || gone;
  if (why == Loss::kUnreachable) s.reachable = false;
  if (why == Loss::kRestarted) {
    s.client->ForgetIncarnation();
    if (!s.gone) {
      // It answered a moment ago (with its new incarnation): it takes new
      // sequences, its free pages read here or at the next Refresh().
      s.reachable = true;
      auto info = s.client->GetServerInfo();  // learns the new incarnation
      if (info.ok()) ReadInfo(server, *info);
      // Back with another geometry: not a member any more (its client and
      // KV manager lay out requests for the old one).
      if (!info.ok() && IsAnotherGeometry(info.status())) s.gone = true;
      // No new sequences before it has the cluster's KV scales again.
      if (!info.ok() || !ApplyScales(server).ok()) s.reachable = false;
    }
  }
  std::sort(lost.begin(), lost.end());
  return lost;
}

bool Cluster::Observe(int32_t server, const absl::Status& status, std::vector<int64_t>* lost) {
  Server& s = *servers_[server];
  if (status.ok()) {
    s.unreachable_since.reset();
    return false;
  }
  std::vector<int64_t> l;
  if (IsStaleIncarnation(status)) {
    l = LoseServer(server, Loss::kRestarted);
  } else if (status.code() == absl::StatusCode::kDataLoss) {
    l = LoseServer(server, Loss::kLeaseLost);
  } else if (Unreachable(status) && options_.server_lost_after_s >= 0) {
    const absl::Time now = absl::Now();
    if (!s.unreachable_since.has_value()) s.unreachable_since = now;
    if (now - *s.unreachable_since < absl::Seconds(options_.server_lost_after_s)) return false;
    l = LoseServer(server, Loss::kUnreachable);
  } else {
    if (Unreachable(status) && !s.unreachable_since.has_value()) {
      s.unreachable_since = absl::Now();
    }
    return false;
  }
  lost->insert(lost->end(), l.begin(), l.end());
  return true;
}

absl::Status Cluster::Resolve() {
  if (dns_host_.empty()) return absl::OkStatus();
  auto resolved = options_.resolver(dns_host_, dns_port_);
  if (!resolved.ok()) return resolved.status();  // keep the servers we have
  absl::flat_hash_set<std::string> now(resolved->begin(), resolved->end());
  std::vector<std::string> problems;
  std::vector<int64_t> lost;
  for (int32_t i = 0; i < num_servers(); ++i) {
    Server& s = *servers_[i];
    if (s.gone) continue;
    s.listed = now.contains(s.address);
    if (s.listed) continue;
    // Left the name: keep it while it answers with the same incarnation (a
    // readiness blip); otherwise its KV is gone with it.
    auto info = s.client->GetServerInfo();
    if (info.ok() && info->incarnation() == s.client->incarnation()) continue;
    const bool restarted = info.ok() || IsAnotherGeometry(info.status());
    std::vector<int64_t> l = LoseServer(i, restarted ? Loss::kRestarted : Loss::kUnreachable, /*gone=*/true);
    lost.insert(lost.end(), l.begin(), l.end());
  }
  for (const std::string& a : *resolved) {
    const bool known = std::any_of(servers_.begin(), servers_.end(), [&](const auto& s) {
      return s->address == a && !s->gone;
    });
    if (known) continue;
    auto added = AddServer(a);
    if (!added.ok()) problems.push_back(std::string(added.status().message()));
  }
  if (!lost.empty()) return LostError(lost, "their server left the cluster");
  if (!problems.empty()) {
    return absl::FailedPreconditionError(
        absl::StrCat("left out: ", absl::StrJoin(problems, "; ")));
  }
  return absl::OkStatus();
}

absl::Status Cluster::Refresh() {
  refreshed_at_ = absl::Now();
  absl::Status resolved = Resolve();
  std::vector<int64_t> lost = LostSequences(resolved);
  for (int32_t i = 0; i < num_servers(); ++i) {
    Server& s = *servers_[i];
    if (s.gone) continue;
    auto info = s.client->GetServerInfo();
    s.reachable = info.ok();
    if (IsAnotherGeometry(info.status())) {
      // Restarted with another geometry: its sequences are lost and it
      // leaves the cluster.
      std::vector<int64_t> l = LoseServer(i, Loss::kRestarted, /*gone=*/true);
      lost.insert(lost.end(), l.begin(), l.end());
      continue;
    }
    if (!info.ok()) {
      Observe(i, info.status(), &lost);  // unreachable too long: its sequences are lost
      continue;
    }
    s.unreachable_since.reset();
    if (s.client->incarnation() != 0 && info->incarnation() != s.client->incarnation()) {
      std::vector<int64_t> l = LoseServer(i, Loss::kRestarted);
      lost.insert(lost.end(), l.begin(), l.end());
      continue;
    }
    ReadInfo(i, *info);
    // A server that could not take the KV scales takes no new sequences.
    if (!ApplyScales(i).ok()) s.reachable = false;
  }
  if (!lost.empty()) return LostError(lost, "their server restarted or left");
  return resolved;
}

}  // namespace attnserve
