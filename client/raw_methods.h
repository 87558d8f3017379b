// The Client's tensor-carrying methods, called with wire bytes
// (Client::CallRaw): client.cc makes them at Connect, client_tensors.cc
// calls them. Internal to the client library.
#pragma once

#include <memory>

#include "client/client.h"
#include "grpcpp/channel.h"
#include "grpcpp/impl/rpc_method.h"

namespace attnserve {

struct Client::RawMethods {
  static constexpr char kWriteKv[] = "/attnserve.v1.AttentionService/WriteKV";
  static constexpr char kReadKv[] = "/attnserve.v1.AttentionService/ReadKV";
  static constexpr char kPrefill[] = "/attnserve.v1.AttentionService/Prefill";
  static constexpr char kMergeStates[] = "/attnserve.v1.AttentionService/MergeStates";

  explicit RawMethods(const std::shared_ptr<grpc::Channel>& channel)
      : write_kv(kWriteKv, grpc::internal::RpcMethod::NORMAL_RPC, channel),
        read_kv(kReadKv, grpc::internal::RpcMethod::NORMAL_RPC, channel),
        prefill(kPrefill, grpc::internal::RpcMethod::NORMAL_RPC, channel),
        merge_states(kMergeStates, grpc::internal::RpcMethod::NORMAL_RPC, channel) {}
  grpc::internal::RpcMethod write_kv;
  grpc::internal::RpcMethod read_kv;
  grpc::internal::RpcMethod prefill;
  grpc::internal::RpcMethod merge_states;
};

}  // namespace attnserve
