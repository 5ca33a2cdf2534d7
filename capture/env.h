// The environment fingerprint recorded in a trace and compared by replay: host, CPU, GPU stack,
// compiler and flags, build id, library versions. Keys are those of traces/FORMAT.md /meta/env.
#pragma once

#include <map>
#include <string>

namespace dsv4 {

using EnvFingerprint = std::map<std::string, std::string>;
EnvFingerprint environment_fingerprint();
// The current UTC time as ISO-8601 to the second ("2026-11-29T10:31:00Z"): the traces' `created`.
std::string utc_now_iso8601();

}  // namespace dsv4
