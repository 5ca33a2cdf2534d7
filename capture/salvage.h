// Salvaging the whole steps of a trace whose recorder died.
#pragma once

#include <string>

namespace dsv4 {

// Copies /meta and every complete step of `in` into a new trace `out` (steps renumbered from 0).
// Returns the number of steps copied; throws TraceError when none can be read.
int salvage_trace(const std::string& in, const std::string& out);

}  // namespace dsv4
