// What a backend is built with: which one, on which device, the KV geometry,
// and the batch sizes its staging and workspace must hold.
#pragma once

#include <cstdint>
#include <string>

#include "common/kv_geometry.h"
#include "kernels/plan/kernel_select.h"

namespace attnserve {

struct BackendOptions {
  std::string kind = "auto";  // "auto" (CUDA when a GPU is present), "cuda", "cpu"
  int32_t device = 0;         // CUDA device ordinal
  KvGeometry geometry;        // num_pages already resolved
  // Workspace sizing: the most query rows one batch may hold (a single
  // request larger than max_batch_tokens runs alone, so this is the larger of
  // max_batch_tokens and the rows that fit in max_message_bytes).
  int32_t max_batch_rows = 0;
  // Most KV page indices / appended rows one batch may hold.
  int64_t max_batch_kv_indices = 0;
  int64_t max_batch_append_rows = 0;
  // CUDA: the prefill kernel families the packer may pick from
  // (--prefill_kernel); kSm90 on a device other than sm_90 fails Init. The
  // CPU backend ignores it.
  PrefillFamily prefill_family = PrefillFamily::kAuto;
  // CUDA: run sequences of 1..8 query rows on the decode kernel family
  // (--decode_kernel=auto); false sends everything to the prefill family
  // (--decode_kernel=off, for A/B comparisons).
  bool decode_kernel = true;
};

}  // namespace attnserve
