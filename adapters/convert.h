// Whole imports and exports: the files of an SGLang or miles dump → checked ExternalSequences handed to
// a sink (the CLI's sink is ExternalTraceWriter::add_sequence), and a trace's step → SGLang JSONL or
// miles .npz files.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "adapters/r3.h"
#include "capture/trace_reader.h"

namespace dsv4 {

struct ImportProgress {
  int64_t requests = 0;    // done so far
  int64_t bytes_read = 0;  // input bytes read so far (all files)
  double seconds = 0;      // since the import started
};

struct ImportSummary {
  int64_t requests = 0;
  int64_t tokens = 0;
  int64_t input_bytes = 0;
  int64_t routing_rows = 0, indexer_rows = 0;  // rows imported, summed over layers
  double seconds = 0;
  std::vector<std::string> notes;
};

using SequenceSink = std::function<void(ExternalSequence&&)>;
using ProgressFn = std::function<void(const ImportProgress&)>;

// Every response of every file, in order, one at a time: read, checked (r3_import), handed to `sink`.
// `weights` (optional) checks the hash layers against tid2eid.
// `encoders` as for r3_import (the sink's writer's stream_indexer_layers).
// An incremental routing buffer (routed_experts_start_len > 0) takes its first rows from an earlier
// request of the import (R3RoutingPrefixes, keeping up to `prefix_budget_bytes` of routing).
ImportSummary import_sglang(const std::vector<std::string>& files, const ModelConfig& c,
                            const Weights* weights, const SequenceSink& sink,
                            const ProgressFn& progress = nullptr, const IndexerEncoders& encoders = nullptr,
                            int64_t prefix_budget_bytes = R3RoutingPrefixes::kDefaultBudgetBytes);
// Every sample of miles_sample_paths(inputs), likewise.
ImportSummary import_miles(const std::vector<std::string>& inputs, const ModelConfig& c,
                           const Weights* weights, const SequenceSink& sink,
                           const ProgressFn& progress = nullptr, const IndexerEncoders& encoders = nullptr);

// A sequence of requests read by the caller (the Python package's reader of miles' .pt dumps): fills
// the request (and adds what is worth telling to the notes) and returns true, or returns false at the end.
using RequestSource = std::function<bool(R3Request&, std::vector<std::string>& notes)>;
// Every request of `next`, checked (r3_import) and handed to `sink`, as import_miles does.
ImportSummary import_requests(const RequestSource& next, const ModelConfig& c, const Weights* weights,
                              const SequenceSink& sink, const ProgressFn& progress = nullptr,
                              const IndexerEncoders& encoders = nullptr);

// A whole import as `dsv4 import` and the Python package run it: the model, a new trace holding one
// external step, every request checked and written (the indexer rows streamed into the file), and what
// it came to.
struct ImportJob {
  std::string engine;  // "sglang" | "miles"
  std::vector<std::string> inputs;
  std::string config, model, preset;  // exactly one: config.json, a checkpoint directory, a preset
  std::string out;
  std::string kind = "rollout";
  std::string profile = "unknown";
  int64_t prefix_budget_bytes = R3RoutingPrefixes::kDefaultBudgetBytes;
};

struct ImportResult {
  ImportSummary summary;
  std::string trace;        // the file written
  int64_t trace_bytes = 0;
  int64_t int32_bytes = 0;  // the decisions as the engines' int32 buffers
};

// `requests`, when given, replaces the engine's reader of job.inputs (which then only name the
// step's source).
ImportResult run_import(const ImportJob& job, const ProgressFn& progress = nullptr,
                        const RequestSource& requests = nullptr);

// The step an export reads: `step` when >= 0 (it must be complete), else the trace's only complete step
// (InputError listing the steps when there are several).
int export_step(const TraceReader& r, int step);

// The prompt length of a sequence as the trace knows it (an external step's, a generation's request, a
// training sample's), or −1.
int64_t trace_prompt_length(const TraceReader& r, int step, int seq);

// One JSON line per sequence (sglang_response), to `out` (refused when it exists). Returns the sequences.
// `incremental`: each sequence's routed_experts starts after the rows an earlier sequence of the step
// already holds for the same tokens (r3_incremental_start), as a session server requests its turns.
int64_t export_sglang(const TraceReader& r, int step, const std::string& out, bool incremental = false);
// One .npz per sequence, DIR/sample_SSSSSS.npz (DIR is created; files that exist are refused).
int64_t export_miles(const TraceReader& r, int step, const std::string& dir);

}  // namespace dsv4
