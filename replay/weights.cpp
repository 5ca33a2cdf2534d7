// Resolving the recorded model and weights of a trace (replay/replay.h): --model, the recorded path
// (beside the trace first, as bundles record it) or "init:seed=N", checked against the recorded config
// and digests.
#include "replay/replay.h"

#include <fmt/format.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <map>
#include <nlohmann/json.hpp>

#include "capture/digest.h"
#include "capture/errors.h"
#include "model/checkpoint.h"

namespace dsv4 {

namespace fs = std::filesystem;

namespace {

constexpr const char* kInitPrefix = "init:seed=";

// The first config.json field whose value differs, or "" when both configs are equal.
std::string first_config_difference(const ModelConfig& a, const ModelConfig& b) {
  const nlohmann::json ja = nlohmann::json::parse(config_to_json(a));
  const nlohmann::json jb = nlohmann::json::parse(config_to_json(b));
  if (ja == jb) return "";
  for (const auto& [k, v] : ja.items())
    if (!jb.contains(k) || jb[k] != v) return k;
  for (const auto& [k, v] : jb.items())
    if (!ja.contains(k)) return k;
  return "?";
}

// Where a recorded (non-init) weights path is found: absolute paths as they are; relative ones
// beside the trace first (bundles), then in the working directory. "" when none exists.
std::string resolve_recorded_path(const TraceReader& r, const std::string& recorded) {
  std::error_code ec;
  const fs::path p(recorded);
  if (p.is_absolute()) return fs::exists(p, ec) ? recorded : "";
  const fs::path beside = fs::path(r.path()).parent_path() / p;
  if (fs::exists(beside, ec)) return beside.string();
  if (fs::exists(p, ec)) return recorded;
  return "";
}

}  // namespace

std::optional<uint64_t> init_seed(const std::string& source) {
  if (source.rfind(kInitPrefix, 0) != 0) return std::nullopt;
  const std::string num = source.substr(std::strlen(kInitPrefix));
  if (num.empty() || num.find_first_not_of("0123456789") != std::string::npos) return std::nullopt;
  return std::stoull(num);
}

Weights weights_for_trace(const TraceReader& r, const std::string& model_dir, const WeightFilter& keep) {
  const ModelConfig recorded = r.config();
  const TraceModelMeta meta = r.model();
  std::string path = model_dir;
  if (path.empty()) {
    if (const auto seed = init_seed(meta.weights_path)) {
      Weights w = Weights::init(recorded, *seed);
      if (keep) w.keep_only(keep);
      return w;
    }
    if (meta.weights_path.empty())
      throw InputError(fmt::format("{}: the trace records no weights path; pass --model DIR", r.path()));
    path = resolve_recorded_path(r, meta.weights_path);
    if (path.empty())
      throw InputError(
          fmt::format("{}: the recorded weights '{}' are not found here (looked beside the trace and in "
                      "the working directory); pass --model DIR",
                      r.path(), meta.weights_path));
  }
  Weights w = open_checkpoint(path, keep);
  const std::string field = first_config_difference(recorded, w.config());
  if (!field.empty())
    throw InputError(
        fmt::format("{}: its config.json differs from the one recorded in {} (field '{}'); this is "
                    "not the recorded model",
                    path, r.path(), field));
  return w;
}

std::vector<std::string> weight_mismatches(const TraceReader& r, const Weights& w) {
  const TraceModelMeta meta = r.model();
  if (meta.tensor_names.size() != meta.tensor_digests.size())
    throw TraceError(fmt::format("{}: /meta/model holds {} tensor names but {} digests", r.path(),
                                 meta.tensor_names.size(), meta.tensor_digests.size()));
  const ModelDigest here = model_digest(w);
  std::map<std::string, uint64_t> recorded, mine;
  for (size_t i = 0; i < meta.tensor_names.size(); ++i)
    recorded[meta.tensor_names[i]] = meta.tensor_digests[i];
  for (size_t i = 0; i < here.names.size(); ++i) mine[here.names[i]] = here.digests[i];
  std::vector<std::string> out;
  for (const auto& [name, d] : recorded) {
    const auto it = mine.find(name);
    if (it == mine.end() || it->second != d) out.push_back(name);
  }
  for (const auto& [name, d] : mine)
    if (!recorded.count(name)) out.push_back(name);
  std::sort(out.begin(), out.end());
  return out;
}

}  // namespace dsv4
