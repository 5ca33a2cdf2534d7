// Replay: re-execute recorded steps and compare every recomputed digest with the recorded one, in
// execution order (DESIGN.md §6). Exit semantics for the CLI: 0 bit-identical, 1 divergence,
// 2 bad input.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "capture/env.h"
#include "capture/trace_reader.h"
#include "model/weights.h"

namespace dsv4 {

struct ReplayOptions {
  std::optional<int> step;        // nullopt: every complete step
  std::string model_dir;          // empty: the recorded weights path ("init:seed=N" re-creates preset weights)
  int threads = 0;                // 0: as recorded (the recorded thread count does not change results)
  bool force_indexer = false;     // indexer replay: feed the recorded indexer selections via Overrides
  bool force_routing = false;     // routing replay: feed the recorded expert ids (learned layers)
  std::string take_decisions_from;  // counterfactual: force the decisions of this other trace
  int take_step = -1;             // step of that trace (-1: same index as the replayed step)
};

// Where two computations first differ.
struct Divergence {
  int step = 0, seq = 0, layer = -1;
  std::string tensor;  // named tensor, or "decision:indexer" / "decision:routing" / "weights"
  int64_t row = 0;     // token row (or compressed-group row)
  // Element level, when both values are available (recorded full tensor, or a recorded decision):
  bool has_elements = false;
  int64_t first_index = -1;      // within the row
  double recorded = 0, replayed = 0;
  int64_t ulp = 0;
  double max_abs = 0, max_rel = 0;  // over the row
  std::vector<float> replayed_row;  // the recomputed row (always available: replay computes it fully)
};

struct DecisionChange {
  int layer = 0;
  std::string kind;         // "indexer" | "routing"
  int64_t rows_changed = 0;
  int64_t first_row = -1;
};

struct EnvDifference {
  std::string key, recorded, here;
  int rank = 0;  // 0 = most likely culprit (compile flags, compiler, cpu flags ... ), larger = less likely
};

struct StepReplay {
  int step = 0;
  bool identical = true;
  int64_t records_compared = 0, rows_compared = 0;
  std::optional<Divergence> first;
  std::vector<DecisionChange> decision_changes;  // recomputed vs recorded, per layer (free replay)
  double seconds = 0;
  // Counterfactual (take_decisions_from): log-prob mismatch between the two traces before and after
  // forcing A's decisions into B.
  std::optional<double> mean_abs_dlogprob_before, mean_abs_dlogprob_after, kl_before, kl_after;
};

struct ReplayReport {
  std::string trace;
  std::string model_source;
  std::vector<StepReplay> steps;
  std::vector<EnvDifference> env_differences;  // sorted by rank
  std::vector<std::string> weight_mismatches;  // tensor names whose digest differs from the recorded
  bool identical() const;
};

// Throws InputError for bad input (unreadable trace, missing weights, step out of range, a
// counterfactual trace of other tokens). A weights digest mismatch is reported, not thrown.
ReplayReport replay_trace(const std::string& trace, const ReplayOptions& opt);
// Weights for a recorded trace: --model dir, or the recorded path, or "init:seed=N".
Weights weights_for_trace(const TraceReader& r, const std::string& model_dir);
std::vector<EnvDifference> compare_env(const EnvFingerprint& recorded, const EnvFingerprint& here);

// `dsv4 trace bundle`: copies the trace and its weights directory into `out_dir` with a manifest
// (MANIFEST.json: file names, sizes and XXH3 digests; the model digest) so both move together.
void bundle_trace(const std::string& trace, const std::string& model_dir, const std::string& out_dir);

}  // namespace dsv4
