// Group names of the trace layout (traces/FORMAT.md), shared by the writer, the reader and
// validation so the three cannot drift apart.
#pragma once

#include <fmt/format.h>

#include <string>

namespace dsv4::trace_layout {

inline std::string step_name(int step) {
  return fmt::format("{:06}", step);
}  // under /steps
inline std::string seq_name(int seq) {
  return fmt::format("seq_{:03}", seq);
}  // under a step
inline std::string layer_name(int layer) {  // decisions, tensors
  return layer < 0 ? std::string("model") : fmt::format("layer_{:03}", layer);
}

}  // namespace dsv4::trace_layout
