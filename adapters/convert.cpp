#include "adapters/convert.h"

#include <fmt/core.h>

#include <chrono>
#include <filesystem>
#include <fstream>

#include "adapters/miles.h"
#include "adapters/sglang.h"
#include "model/error.h"

namespace dsv4 {

namespace fs = std::filesystem;

namespace {

double since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

void count(ImportSummary& s, const ExternalSequence& seq) {
  ++s.requests;
  s.tokens += int64_t(seq.tokens.size());
  for (const auto& r : seq.routing) s.routing_rows += r.rows;
  for (const auto& x : seq.indexer) s.indexer_rows += x.rows;
}

}  // namespace

ImportSummary import_sglang(const std::vector<std::string>& files, const ModelConfig& c,
                            const Weights* weights, const SequenceSink& sink, const ProgressFn& progress,
                            const IndexerEncoders& encoders, int64_t prefix_budget_bytes) {
  ImportSummary s;
  const auto t0 = std::chrono::steady_clock::now();
  int64_t done_bytes = 0;  // bytes of the files finished
  R3RoutingPrefixes prefixes(prefix_budget_bytes);
  for (const std::string& file : files) {
    std::error_code ec;
    const auto size = fs::file_size(file, ec);
    sglang_read(
        file,
        [&](R3Request&& q) {
          prefixes.complete(c, q, s.notes);
          std::string who = q.origin.describe();
          ExternalSequence seq = r3_import(c, std::move(q), weights, s.notes, encoders);
          prefixes.keep(c, seq, std::move(who));
          count(s, seq);
          sink(std::move(seq));
        },
        s.notes,
        [&](int64_t bytes_read) {
          s.input_bytes = done_bytes + bytes_read;
          if (progress) progress({s.requests, s.input_bytes, since(t0)});
        });
    done_bytes += ec ? 0 : int64_t(size);
    s.input_bytes = done_bytes;
  }
  s.seconds = since(t0);
  return s;
}

ImportSummary import_miles(const std::vector<std::string>& inputs, const ModelConfig& c,
                           const Weights* weights, const SequenceSink& sink, const ProgressFn& progress,
                           const IndexerEncoders& encoders) {
  ImportSummary s;
  const auto t0 = std::chrono::steady_clock::now();
  const std::vector<std::string> samples = miles_sample_paths(inputs);
  for (size_t i = 0; i < samples.size(); ++i) {
    const std::string& path = samples[i];
    std::error_code ec;
    if (fs::is_directory(path)) {
      for (const auto& e : fs::directory_iterator(path))
        if (e.is_regular_file()) s.input_bytes += int64_t(e.file_size(ec));
    } else {
      s.input_bytes += int64_t(fs::file_size(path, ec));
    }
    ExternalSequence seq = r3_import(c, miles_sample(path, int64_t(i), s.notes), weights, s.notes, encoders);
    count(s, seq);
    sink(std::move(seq));
    if (progress) progress({s.requests, s.input_bytes, since(t0)});
  }
  s.seconds = since(t0);
  return s;
}

int export_step(const TraceReader& r, int step) {
  const std::vector<TraceStepInfo> steps = r.steps();
  if (step >= 0) {
    if (step >= int(steps.size()))
      throw InputError(fmt::format("{}: --step {}: the trace has {} steps", r.path(), step, steps.size()));
    if (!steps[size_t(step)].complete)
      throw InputError(
          fmt::format("{}: step {} is {}", r.path(), step, steps[size_t(step)].why_not_complete()));
    return step;
  }
  std::vector<int> complete;
  for (const auto& s : steps)
    if (s.complete) complete.push_back(s.index);
  if (complete.size() == 1) return complete[0];
  if (complete.empty()) throw InputError(fmt::format("{}: no complete step to export", r.path()));
  throw InputError(fmt::format("{}: {} complete steps; choose one with --step N", r.path(), complete.size()));
}

int64_t trace_prompt_length(const TraceReader& r, int step, int seq) {
  if (int64_t p = r.prompt_length(step, seq); p >= 0) return p;
  if (auto g = r.generation(step); g && seq < int(g->requests.size()))
    return g->requests[size_t(seq)].prompt_length;
  if (auto t = r.training(step); t && seq < int(t->samples.size()))
    return t->samples[size_t(seq)].prompt_length;
  return -1;
}

namespace {

// The engine buffers of one sequence of the step.
R3EngineBuffers sequence_buffers(const TraceReader& r, const ModelConfig& c, int step, int seq, int64_t T) {
  const std::string what = fmt::format("{}: step {} sequence {}", r.path(), step, seq);
  return r3_export(
      c, T, [&](int layer) { return r.routing(step, seq, layer); },
      [&](int layer) { return r.indexer(step, seq, layer); }, what);
}

}  // namespace

int64_t export_sglang(const TraceReader& r, int step, const std::string& out, bool incremental) {
  if (fs::exists(out)) throw InputError(fmt::format("{}: exists; not overwritten", out));
  const ModelConfig c = r.config();
  const TraceStepInfo info = r.steps().at(size_t(step));
  const std::string tmp = out + ".incomplete";
  std::ofstream f(tmp, std::ios::binary | std::ios::trunc);
  if (!f) throw InputError(fmt::format("{}: cannot create", tmp));
  std::vector<std::vector<int32_t>> earlier;  // the sequences written so far (incremental export)
  for (int s = 0; s < int(info.seq_lengths.size()); ++s) {
    std::vector<int32_t> tokens = r.tokens(step, s);
    std::string id = r.sequence_id(step, s);
    if (id.empty()) id = fmt::format("step{}-seq{}", step, s);
    const R3EngineBuffers b = sequence_buffers(r, c, step, s, int64_t(tokens.size()));
    const int64_t P = trace_prompt_length(r, step, s);
    const int64_t start = incremental ? r3_incremental_start(earlier, tokens, P) : 0;
    f << sglang_response(id, tokens, P, b, start).dump() << '\n';
    if (incremental) earlier.push_back(std::move(tokens));
    if (!f) throw InputError(fmt::format("{}: write failed", tmp));
  }
  f.close();
  if (!f) throw InputError(fmt::format("{}: write failed", tmp));
  fs::rename(tmp, out);
  return int64_t(info.seq_lengths.size());
}

int64_t export_miles(const TraceReader& r, int step, const std::string& dir) {
  const ModelConfig c = r.config();
  const TraceStepInfo info = r.steps().at(size_t(step));
  fs::create_directories(dir);
  for (int s = 0; s < int(info.seq_lengths.size()); ++s) {
    const std::vector<int32_t> tokens = r.tokens(step, s);
    const R3EngineBuffers b = sequence_buffers(r, c, step, s, int64_t(tokens.size()));
    miles_write_npz((fs::path(dir) / fmt::format("sample_{:06d}.npz", s)).string(), tokens,
                    trace_prompt_length(r, step, s), b);
  }
  return int64_t(info.seq_lengths.size());
}

}  // namespace dsv4
