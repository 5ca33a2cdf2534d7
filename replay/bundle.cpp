// `dsv4 trace bundle` (replay/replay.h): the trace, its weights and a manifest in one directory.
#include "replay/replay.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "capture/digest.h"
#include "capture/errors.h"
#include "capture/trace_writer.h"

namespace dsv4 {

namespace fs = std::filesystem;

namespace {

// The files that make a checkpoint directory: config.json, *.safetensors and the shard index.
bool is_checkpoint_file(const fs::path& p) {
  const std::string n = p.filename().string();
  auto ends_with = [&](const std::string& s) {
    return n.size() >= s.size() && n.compare(n.size() - s.size(), s.size(), s) == 0;
  };
  return n == "config.json" || ends_with(".safetensors") || ends_with(".safetensors.index.json");
}

}  // namespace

void bundle_trace(const std::string& trace, const std::string& model_dir, const std::string& out_dir) {
  std::error_code ec;
  const fs::path out(out_dir);
  if (fs::exists(out, ec) && !(fs::is_directory(out, ec) && fs::is_empty(out, ec)))
    throw InputError(fmt::format(
        "{}: exists and is not an empty directory; give a new directory for the bundle", out_dir));

  const TraceReader r = TraceReader::open(trace);
  const TraceModelMeta meta = r.model();
  const Weights w = weights_for_trace(r, model_dir);
  const std::vector<std::string> bad = weight_mismatches(r, w);
  if (!bad.empty())
    throw InputError(fmt::format("{}: the weights of {} do not match the trace ({} tensor{} differ: {}{})",
                                 trace, w.source(), bad.size(), bad.size() == 1 ? "" : "s",
                                 fmt::join(bad.begin(), bad.begin() + std::min<size_t>(bad.size(), 5), ", "),
                                 bad.size() > 5 ? ", ..." : ""));

  const fs::path model_out = out / "model";
  fs::create_directories(model_out, ec);
  if (ec) throw InputError(fmt::format("{}: cannot create: {}", model_out.string(), ec.message()));
  if (init_seed(w.source())) {
    // Seeded weights have no files: write them out, so the bundle does not depend on this build's
    // initialisation (the digests recorded in the trace check that the written values are the same).
    w.save(model_out.string());
  } else {
    fs::path src(w.source());
    if (!fs::is_directory(src, ec)) src = src.parent_path();
    std::vector<fs::path> files;
    for (const auto& e : fs::directory_iterator(src, ec))
      if (e.is_regular_file() && is_checkpoint_file(e.path())) files.push_back(e.path());
    if (ec) throw InputError(fmt::format("{}: cannot list: {}", src.string(), ec.message()));
    for (const fs::path& f : files) {
      fs::copy_file(f, model_out / f.filename(), ec);
      if (ec)
        throw InputError(
            fmt::format("{}: cannot copy to {}: {}", f.string(), model_out.string(), ec.message()));
    }
  }

  const fs::path trace_out = out / fs::path(trace).filename();
  fs::copy_file(trace, trace_out, ec);
  if (ec) throw InputError(fmt::format("{}: cannot copy to {}: {}", trace, trace_out.string(), ec.message()));
  // Relative weights paths resolve beside the trace (weights_for_trace), so the bundle replays as it is.
  set_trace_weights_path(trace_out.string(), "model");

  std::vector<fs::path> files{trace_out};
  // A joined trace's sequences live in its ranks' traces, which go beside it (capture/joined.h).
  for (const TracePart& p : r.parts()) {
    const std::string& part = p.name;
    const fs::path from = p.path;
    fs::copy_file(from, out / part, ec);
    if (ec) throw InputError(fmt::format("{}: cannot copy to {}: {}", from.string(), (out / part).string(), ec.message()));
    files.push_back(out / part);
  }
  std::vector<fs::path> model_files;
  for (const auto& e : fs::directory_iterator(model_out)) model_files.push_back(e.path());
  std::sort(model_files.begin(), model_files.end());
  files.insert(files.end(), model_files.begin(), model_files.end());
  nlohmann::json manifest;
  manifest["trace"] = trace_out.filename().string();
  manifest["model_digest"] = meta.model_digest;
  manifest["files"] = nlohmann::json::array();
  for (const fs::path& f : files)
    manifest["files"].push_back({{"name", fs::relative(f, out).generic_string()},
                                 {"bytes", int64_t(fs::file_size(f))},
                                 {"xxh3", hex16(file_digest(f.string()))}});
  std::ofstream m(out / "MANIFEST.json");
  m << manifest.dump(2) << "\n";
  if (!m) throw InputError(fmt::format("{}: cannot write MANIFEST.json", out_dir));
}

}  // namespace dsv4
