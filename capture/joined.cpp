#include "capture/joined.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <filesystem>

#include "capture/errors.h"
#include "capture/trace_reader.h"
#include "capture/trace_seal.h"

namespace dsv4 {

namespace fs = std::filesystem;

std::string part_trace_name(const std::string& joined, int rank) {
  const fs::path p(joined);
  return fmt::format("{}.rank{}{}", p.stem().string(), rank, p.extension().string());
}

std::string part_trace_path(const std::string& joined, int rank) {
  return (fs::path(joined).parent_path() / part_trace_name(joined, rank)).string();
}

void write_joined_step(const std::string& path, const ModelConfig& c, const TraceHeader& h, int index,
                       const StepSpec& s, const CapturePolicy& policy,
                       const std::vector<StepLayout::PartSeq>& where, bool append) {
  if (h.parts.empty()) throw Error(fmt::format("{}: a joined trace needs its parts", path));
  if (!append) {
    if (fs::exists(path))
      throw InputError(fmt::format("{}: exists; refusing to overwrite it (choose another name, or append to it)", path));
    if (index != 0) throw Error(fmt::format("{}: a new joined trace starts at step 0, not {}", path, index));
    const std::string tmp = path + ".incomplete";
    StepLayout layout(tmp, c);
    layout.write_header(h);
    layout.write_joined_step(index, s, policy, h.parts, where);
    publish_trace(tmp, path);
    return;
  }
  {
    const TraceReader r = TraceReader::open(path);
    std::vector<std::string> names;
    for (const TracePart& p : r.parts()) names.push_back(p.name);
    if (names != h.parts)
      throw InputError(fmt::format("{}: its parts are [{}], this run's would be [{}]: append with the same rank count "
                                   "to the same names",
                                   path, fmt::join(names, ", "), fmt::join(h.parts, ", ")));
    if (int(r.steps().size()) != index)
      throw InputError(fmt::format("{}: holds {} steps, but the ranks' traces are at step {}: they were changed apart "
                                   "from the joined trace",
                                   path, r.steps().size(), index));
  }
  mark_trace_open(path);
  StepLayout layout(path, c);
  layout.write_joined_step(index, s, policy, h.parts, where);
  publish_trace(path, path);
}

}  // namespace dsv4
