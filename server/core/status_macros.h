// RETURN_IF_ERROR / ASSIGN_OR_RETURN for absl::Status (Abseil 20220623 has none).
#pragma once

#include "absl/status/status.h"
#include "absl/status/statusor.h"

#define ATTN_RETURN_IF_ERROR(expr)                 \
  do {                                             \
    ::absl::Status attn_status_ = (expr);          \
    if (!attn_status_.ok()) return attn_status_;   \
  } while (0)

#define ATTN_CONCAT_INNER_(a, b) a##b
#define ATTN_CONCAT_(a, b) ATTN_CONCAT_INNER_(a, b)
#define ATTN_ASSIGN_OR_RETURN(lhs, expr) \
  ATTN_ASSIGN_OR_RETURN_IMPL_(ATTN_CONCAT_(attn_statusor_, __LINE__), lhs, expr)
#define ATTN_ASSIGN_OR_RETURN_IMPL_(var, lhs, expr) \
  auto var = (expr);                                \
  if (!var.ok()) return std::move(var).status();    \
  lhs = std::move(var).value()
