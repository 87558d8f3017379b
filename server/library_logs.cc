#include "server/library_logs.h"

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "google/protobuf/stubs/logging.h"
#include "grpc/support/log.h"
#include "spdlog/spdlog.h"

namespace attnserve {

bool LogLimiter::Allow(absl::string_view cause, absl::Time now, int64_t* dropped) {
  absl::MutexLock lock(&mu_);
  // A bounded table: causes are source locations of the libraries, a few
  // hundred at most; past that, every cause shares one entry.
  if (causes_.size() >= 4096 && !causes_.contains(cause)) cause = "(other)";
  Cause& c = causes_[cause];
  if (now - c.last_written < period_) {
    ++c.dropped;
    return false;
  }
  c.last_written = now;
  *dropped = c.dropped;
  c.dropped = 0;
  return true;
}

namespace {

LogLimiter& Limiter() {
  static auto* limiter = new LogLimiter();
  return *limiter;
}

void Write(spdlog::level::level_enum level, const char* library, const char* file, int line,
           const std::string& message) {
  const std::string cause = absl::StrCat(library, ":", file, ":", line);
  int64_t dropped = 0;
  if (!Limiter().Allow(cause, absl::Now(), &dropped)) return;
  if (dropped > 0) {
    spdlog::log(level, "{} ({}:{}): {} [{} more like this in the last second or more]", library,
                file, line, message, dropped);
  } else {
    spdlog::log(level, "{} ({}:{}): {}", library, file, line, message);
  }
}

void ProtobufLog(google::protobuf::LogLevel level, const char* file, int line,
                 const std::string& message) {
  spdlog::level::level_enum l = spdlog::level::info;
  switch (level) {
    case google::protobuf::LOGLEVEL_INFO: l = spdlog::level::info; break;
    case google::protobuf::LOGLEVEL_WARNING: l = spdlog::level::warn; break;
    case google::protobuf::LOGLEVEL_ERROR: l = spdlog::level::err; break;
    case google::protobuf::LOGLEVEL_FATAL: l = spdlog::level::critical; break;
  }
  Write(l, "protobuf", file, line, message);
}

// gRPC's errors (while it binds a port, a client's failed TLS handshake,
// ...) go to the log at debug level: the server's own message says what
// failed, naming the flag. Its info and debug lines at trace.
void GrpcLog(gpr_log_func_args* args) {
  const spdlog::level::level_enum l =
      args->severity == GPR_LOG_SEVERITY_ERROR ? spdlog::level::debug : spdlog::level::trace;
  if (!spdlog::should_log(l)) return;
  Write(l, "grpc", args->file, args->line, std::string(args->message));
}

}  // namespace

void RouteLibraryLogs() {
  google::protobuf::SetLogHandler(&ProtobufLog);
  gpr_set_log_function(&GrpcLog);
}

}  // namespace attnserve
