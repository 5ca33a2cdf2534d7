// The environment fingerprint recorded in a trace and compared by replay: host, CPU, GPU stack,
// compiler and flags, build id, library versions. Keys are those of traces/FORMAT.md /meta/env.
#pragma once

#include <map>
#include <string>

namespace dsv4 {

using EnvFingerprint = std::map<std::string, std::string>;

// The key of a parallel run's layout in words ("expert parallel over 2 MPI ranks": parallel_layout in
// model/communicator.h); a trace recorded in one process has none.
inline constexpr char kEnvParallel[] = "parallel";
// The layout a trace was recorded with: its "parallel" value, else "one process".
inline std::string recorded_layout(const EnvFingerprint& env) {
  const auto it = env.find(kEnvParallel);
  return it == env.end() ? "one process" : it->second;
}
EnvFingerprint environment_fingerprint();
// The current UTC time as ISO-8601 to the second ("2026-11-29T10:31:00Z"): the traces' `created`.
std::string utc_now_iso8601();

}  // namespace dsv4
