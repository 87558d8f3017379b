// The standard process series every Prometheus client library exports
// (process_cpu_seconds_total, process_resident_memory_bytes,
// process_virtual_memory_bytes, process_open_fds, process_max_fds,
// process_start_time_seconds), read from /proc at scrape time.
// prometheus-cpp has no process collector; the names, types and units are
// those of client_golang's and client_python's.
//
//   std::vector<prometheus::MetricFamily> families = registry->Collect();
//   AppendProcessMetrics(&families);
#pragma once

#include <vector>

#include "prometheus/metric_family.h"

namespace attnserve {

// Appends this process's series to `families`. A value /proc does not give
// (another OS, a failed read) is left out, never reported as 0.
void AppendProcessMetrics(std::vector<prometheus::MetricFamily>* families);

}  // namespace attnserve
