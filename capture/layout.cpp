#include "capture/layout.h"

#include "capture/errors.h"
#include "capture/h5.h"

namespace dsv4::trace_layout {

bool is_step_kind(const std::string& kind) {
  return kind == "train" || kind == "rollout" || kind == kKindGenerate || kind == kKindTrainStep;
}

std::string step_kinds_text() {
  return fmt::format("'train', 'rollout', '{}' or '{}'", kKindGenerate, kKindTrainStep);
}

int step_format_version(const std::string& kind) {
  if (kind == kKindTrainStep) return kTrainingFormatVersion;
  if (kind == kKindGenerate) return kGenerationFormatVersion;
  return kPrefillFormatVersion;
}

int check_trace_root(const h5::Object& root, const std::string& path, std::string* producer) {
  if (!h5::has_attr(root, kFormat))
    throw NotATrace(fmt::format("{}: an HDF5 file but not a dsv4 trace (no format attribute)", path));
  std::string format;
  try {
    format = h5::read_attr_string(root, kFormat);
  } catch (const TraceCorrupt&) {
    throw;  // a damaged heap behind it, named as such
  } catch (const TraceError&) {
    throw NotATrace(
        fmt::format("{}: an HDF5 file but not a dsv4 trace (its format attribute is not a string)", path));
  }
  if (format != kFormatValue)
    throw NotATrace(fmt::format("{}: an HDF5 file but not a dsv4 trace (format = '{}')", path, format));
  const std::string by =
      h5::has_attr(root, kProducer) ? h5::read_attr_string(root, kProducer) : "an unknown producer";
  if (producer) *producer = by;
  if (!h5::has_attr(root, kFormatVersion))
    throw TraceError(fmt::format("{}: no format_version attribute", path));
  const int64_t v = h5::read_attr_int(root, kFormatVersion);
  if (v > kTraceFormatVersion)
    throw UnsupportedTraceVersion(
        fmt::format("{}: format_version {} is newer than this dsv4 reads ({}); upgrade "
                    "dsv4 — the file was written by {}",
                    path, v, kTraceFormatVersion, by));
  return int(v);
}

}  // namespace dsv4::trace_layout
