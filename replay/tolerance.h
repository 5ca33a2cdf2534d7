// Replay of a fast-numerics step within tolerances (`dsv4 replay --tolerance`; docs/NUMERICS.md "Fast
// numerics"). A step recorded with `--numerics fast` holds the bits of one GPU architecture's tensor
// cores; anywhere else (another architecture, the CPU) it cannot be replayed bit for bit. Asked to, the
// replay re-executes it in exact numerics (the recorded profile with its tensor_core sites put back to
// an exact order) with the recorded decisions forced (indexer selections, expert ids), so that only the
// numerics differ, and compares the values within the bounds below: every recorded full tensor by
// rel-L2, and the log-probs. Records the trace holds as row digests only cannot be compared within a
// tolerance: they are counted as such, never as passed.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "model/collect.h"
#include "model/profile.h"

namespace dsv4 {

class TraceReader;
struct TensorRecord;

// ---- the bounds (written once: the CLI's default and help, the report and docs/NUMERICS.md) -------
// Measured on the H200 with the GEMM, expert, indexer and attention sites in the tensor_core order,
// fast against exact numerics with the decisions forced (docs/GPU_RESULTS.md "Fast numerics"):
// per-tensor rel-L2 5e-3 .. 1.6e-2 in the train profile and up to 3.5e-2 (GPU against GPU) and 4.5e-2
// (GPU against the CPU's replay) in the rollout profile, whose FP8-simulated KV and indexer inputs
// turn a one-ulp bf16 change of a GEMM output into a whole FP8 step; log-prob rel-L2 4.5e-4 .. 1.2e-3.
// The tensor bound, which GpuFast.CloseToExact holds on the GPU too, is about 2x the largest measured
// value; the log-prob bound leaves about 4x, for models deeper than the tiny presets measured (the
// rounding adds up over the layers), and stays at the log-prob rel-L2 that free decisions already
// cause (2.9e-3 .. 7.0e-3). Beyond them a difference is not the tensor-core order's rounding.
inline constexpr double kDefaultTensorRelL2 = 1e-1;   // every recorded full tensor
inline constexpr double kDefaultLogprobRelL2 = 5e-3;  // the log-probs of all sequences of the step

struct ToleranceBounds {
  double tensor_rel_l2 = kDefaultTensorRelL2;    // `--tolerance X` sets this one
  double logprob_rel_l2 = kDefaultLogprobRelL2;  // `--tolerance-logprobs Y` this one
};

// `--tolerance X` and `--tolerance-logprobs Y`: "" keeps a default bound; otherwise X is the per-tensor
// rel-L2 bound and Y the log-probs' rel-L2 bound, each a finite number >= 0. Throws InputError naming
// the option and the value for anything else.
ToleranceBounds parse_tolerance(const std::string& value, const std::string& logprobs = "");

// ---- the comparison of values -----------------------------------------------------------------------
// rel-L2 of a replayed tensor b against the recorded a: ||b − a|| / ||a|| over the elements finite on
// both sides (0 when equal, +inf when ||a|| = 0 < ||b − a||); the non-finite elements (masked scores
// hold −inf) must be the same on both sides (same infinity, or NaN against NaN): each one that is not
// counts in `nonfinite_mismatches` and makes rel_l2 +inf. max_abs over the finite pairs. Accumulates
// over several add() calls (the log-probs of every sequence of a step).
class RelL2 {
 public:
  void add(double recorded, double replayed);
  void add(const float* recorded, const float* replayed, int64_t n);
  double rel_l2() const;
  double max_abs() const { return max_abs_; }
  int64_t elements() const { return n_; }
  int64_t nonfinite_mismatches() const { return nonfinite_mismatches_; }

 private:
  double num_ = 0, den_ = 0, max_abs_ = 0;
  int64_t n_ = 0, nonfinite_mismatches_ = 0;
};

// A value within a bound: NaN never is.
inline bool within_bound(double value, double bound) {
  return value <= bound;
}

// ---- the exact numerics a fast step is re-executed in -----------------------------------------------
struct ExactReplayProfile {
  NumericsProfile profile;
  std::string note;  // how it was made, for the report
};
// `fast` with its tensor_core sites put back to an exact order. A profile made by with_numerics from a
// built-in ("rollout.fast") gets the built-in's order on those sites (and is the built-in when nothing
// else differs); one made from a profile file ("my-engine.fast"), or a profile file that set
// tensor_core itself, has no known order of its own there: those sites get the default exact order
// (0: one chain of kernels/reduce.h), and the note says so. Throws Error for an exact profile.
ExactReplayProfile exact_replay_profile(const NumericsProfile& fast);

// ---- the report ---------------------------------------------------------------------------------------
struct ToleranceTensor {
  int seq = 0, layer = -1;
  std::string tensor;
  double rel_l2 = 0, max_abs = 0;
  int64_t nonfinite_mismatches = 0;
};

// Free decisions: a second exact run with nothing forced, its indexer and routing rows against the
// recorded ones (learned layers; hash layers follow the tokens). A row that chose another set is a tie
// flip when the recorded or the replayed margin is below the layer's relative tie threshold
// (model/decision_sets.h, the rule of `dsv4 diff`), else a confident flip.
struct FreeDecisionKind {
  int64_t rows = 0, same = 0, tie_flips = 0, confident_flips = 0;
  double largest_flip_margin = 0;  // the largest recorded margin of a row that flipped (0: none flipped)
};
struct FreeDecisionAgreement {
  FreeDecisionKind indexer, routing;
  double tie_factor = 0;  // the relative factor f of the threshold f x median |margin|
};
// Recorded decisions (the trace's, keyed (seq, layer)) against a free run's.
FreeDecisionAgreement free_decision_agreement(const std::map<std::pair<int, int>, IndexerRecord>& rec_indexer,
                                              const std::map<std::pair<int, int>, RoutingRecord>& rec_routing,
                                              const DecisionLog& free, double tie_factor);

// One step compared within tolerance.
struct ToleranceReplay {
  ToleranceBounds bounds;
  std::string why_not_bitwise;  // why this step could not be replayed bit for bit here
  std::string recorded_profile, replay_profile, profile_note;
  // Recorded full tensors compared by value (the capture policy kept them), and those over the bound.
  int64_t tensors_compared = 0, tensors_over = 0;
  std::optional<ToleranceTensor> worst;       // the largest rel-L2 among them
  std::optional<ToleranceTensor> first_over;  // the first over the bound, in execution order
  // Records the trace holds as row digests only: not comparable within a tolerance, and how many of
  // them the replay reproduced bit for bit anyway.
  int64_t digest_only = 0, digest_only_equal = 0;
  // Records (full or digest-only) whose every row digest equals the recorded one.
  int64_t records_bitwise_equal = 0;
  // The log-probs of every sequence, recorded against replayed.
  int64_t logprobs = 0;
  double logprob_rel_l2 = 0, logprob_max_abs = 0;
  int64_t logprob_nonfinite_mismatches = 0;
  std::optional<FreeDecisionAgreement> free;  // nullopt: not measured (notes say why)
  std::vector<std::string> notes;             // what the reader must know about this comparison

  bool tensors_within() const { return tensors_over == 0; }
  bool logprobs_within() const { return within_bound(logprob_rel_l2, bounds.logprob_rel_l2); }
  bool within() const { return tensors_within() && logprobs_within(); }
};

// Compares a step's reported tensors with its recorded full tensors, record by record (the replay's
// Verifier hands it each record it aligned with the trace, and whether its row digests all matched).
class ToleranceJudge {
 public:
  ToleranceJudge(const TraceReader& r, int step, ToleranceReplay& out) : r_(r), step_(step), out_(out) {}
  void record(const TensorRecord& t, bool bitwise_equal);
  // Every sequence's log-probs, recorded against replayed (TraceError when their counts differ).
  void logprobs(int seq, const std::vector<float>& recorded, const std::vector<float>& replayed);
  void finish();

 private:
  const TraceReader& r_;
  int step_;
  ToleranceReplay& out_;
  RelL2 logprobs_;
};

}  // namespace dsv4
