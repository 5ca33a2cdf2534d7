#include "adapters/convert.h"

#include <fmt/core.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <optional>

#include "adapters/miles.h"
#include "adapters/sglang.h"
#include "capture/digest.h"
#include "capture/h5.h"
#include "model/checkpoint.h"
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

ImportSummary import_requests(const RequestSource& next, const ModelConfig& c, const Weights* weights,
                              const SequenceSink& sink, const ProgressFn& progress,
                              const IndexerEncoders& encoders) {
  ImportSummary s;
  const auto t0 = std::chrono::steady_clock::now();
  for (R3Request q; next(q, s.notes); q = R3Request{}) {
    ExternalSequence seq = r3_import(c, std::move(q), weights, s.notes, encoders);
    count(s, seq);
    sink(std::move(seq));
    if (progress) progress({s.requests, s.input_bytes, since(t0)});
  }
  s.seconds = since(t0);
  return s;
}

namespace {

std::string read_text(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  if (!f) throw InputError(fmt::format("{}: cannot open", path));
  return std::string((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
}

// The model the engine ran. --model loads the weights too, for the hash layers' tid2eid check.
struct ImportModel {
  ModelConfig config;
  std::optional<Weights> weights;
  ExternalModel external;
};

ImportModel import_model(const ImportJob& a) {
  const int given = int(!a.config.empty()) + int(!a.model.empty()) + int(!a.preset.empty());
  if (given != 1) throw InputError("give exactly one of --config FILE, --model DIR or --preset NAME");
  ImportModel m;
  if (!a.model.empty()) {
    m.weights = open_checkpoint(a.model);
    m.config = m.weights->config();
    m.external.config_json = read_text((fs::path(a.model) / "config.json").string());
    m.external.weights_path = a.model;
    const ModelDigest d = model_digest(*m.weights);
    m.external.model_digest = hex16(d.whole);
    m.external.tensor_names = d.names;
    m.external.tensor_digests = d.digests;
  } else if (!a.config.empty()) {
    m.external.config_json = read_text(a.config);
    m.config = config_from_json(m.external.config_json, a.config);
  } else {
    m.config = preset(a.preset);
    m.external.config_json = config_to_json(m.config);
  }
  return m;
}

}  // namespace

ImportResult run_import(const ImportJob& a, const ProgressFn& progress, const RequestSource& requests) {
  if (a.engine != "sglang" && a.engine != "miles")
    throw InputError(fmt::format("import: engine '{}': expected sglang or miles", a.engine));
  ImportModel m = import_model(a);
  // The import has the machine to itself: the trace's chunks are compressed on every core.
  h5::encode_on_all_cores(true);
  auto w = ExternalTraceWriter::create(a.out, m.external);
  ExternalStepSpec spec;
  spec.kind = a.kind;
  spec.engine = a.engine;
  spec.profile = a.profile;
  spec.source = a.inputs.empty()       ? std::string()
                : a.inputs.size() == 1 ? a.inputs[0]
                                       : fmt::format("{} and {} more", a.inputs[0], a.inputs.size() - 1);
  w->begin_step(spec);
  const Weights* weights = m.weights ? &*m.weights : nullptr;
  auto sink = [&](ExternalSequence&& s) { w->add_sequence(s); };
  // The indexer rows go into the trace as they are checked, never held (a Flash response of 32k tokens
  // has 1.4 GB of them).
  auto encoders = [&](int64_t T, int n) { return w->stream_indexer_layers(T, n, true); };
  ImportResult r;
  r.summary = requests               ? import_requests(requests, m.config, weights, sink, progress, encoders)
              : a.engine == "sglang" ? import_sglang(a.inputs, m.config, weights, sink, progress, encoders,
                                                     a.prefix_budget_bytes)
                                     : import_miles(a.inputs, m.config, weights, sink, progress, encoders);
  w->end_step();
  w->close();
  r.trace = w->final_path();
  std::error_code ec;
  r.trace_bytes = int64_t(fs::file_size(r.trace, ec));
  r.int32_bytes = r.summary.routing_rows * m.config.num_experts_per_tok * 4 +
                  r.summary.indexer_rows * m.config.index_topk * 4;
  return r;
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
