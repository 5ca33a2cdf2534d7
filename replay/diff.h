// Diff of two traces of the same tokens (rollout vs training): selection agreement, numeric error,
// log-prob mismatch, the first divergence, and attribution (DESIGN.md §6). Trace A is the reference
// (usually the training step), B the candidate (usually the rollout); every ratio is B against A.
//
// Alignment is by (sequence, position, layer, tensor name). Sequence-level numbers are aggregated over
// every sequence of the two steps' batches (which must be identical).
//
// Tie flips. A position whose selected set differs is a *tie flip* when the recorded boundary margin
// (indexer_margin / router_margin, score of the k-th chosen minus the best unchosen) of either trace at
// that position is below the layer's threshold, else a *confident flip*. Default rule ("relative"):
// per layer and decision kind,
//     threshold = f × median |margin| over the finite margins of both traces at that layer,
// with f = 2^-4 (the relative rounding step of FP8 e4m3) when either step's numerics profile
// simulates FP8 (`rollout`, or a profile this build does not know), else f = 2^-7 (the relative
// precision of bf16). A flip whose margin is below the noise the engines' number formats can cause
// is a tie; anything larger is not explained by rounding. DiffOptions::tie_threshold >= 0 replaces
// this by one absolute threshold for every layer ("absolute"). The thresholds used are reported
// (DiffReport::tie_rule / tie_threshold and per layer).
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "model/profile.h"
#include "replay/training_diff.h"

namespace dsv4 {

class TraceReader;

struct DiffOptions {
  int step_a = 0, step_b = 0;
  bool allow_model_mismatch = false;
  double tie_threshold = -1;  // absolute margin threshold for tie flips; < 0: the relative rule above
};

struct LayerDiff {
  int layer = 0;
  int compress_ratio = 0;  // of trace A's config (0 dense, 4 indexed, 128)
  // Indexer (C4 layers): overlap = |A ∩ B| / max(|A|, 1) per position (1 where both sets are empty);
  // mean and min over every position of every sequence.
  bool has_indexer = false;
  double indexer_overlap_mean = 1, indexer_overlap_min = 1;
  int64_t indexer_rows_differing = 0;
  int64_t indexer_tie_flips = 0, indexer_confident_flips = 0;
  double indexer_tie_threshold = 0;  // the absolute threshold applied to this layer's indexer
  // Routing: exact = share of positions with identical expert sets; Jaccard = |A ∩ B| / |A ∪ B|.
  bool hashed = false;
  double routing_exact = 1, routing_jaccard = 1;
  int64_t routing_rows_differing = 0;
  int64_t routing_tie_flips = 0, routing_confident_flips = 0;
  double routing_tie_threshold = 0;  // the absolute threshold applied to this layer's router
  bool hash_disagreement = false;    // a hash layer that disagrees: always a bug
  // mHC: max |A − B| over both sublayers (attn, ffn) and every position.
  double mhc_pre_max_abs = 0, mhc_post_max_abs = 0, mhc_comb_max_abs = 0;
  // Attribution: the share of this layer's output difference (the per-row squared difference of
  // ffn.hc_post where both traces hold it in full, else the count of digest-differing rows) that
  // appears at positions whose selections (indexer and routing) agree. 0 when nothing differs.
  double same_selection_share = 0;
  int64_t rows_out_differing = 0;  // ffn.hc_post rows whose digests differ
  int64_t rows = 0;                // positions compared (all sequences)
};

struct TensorDiff {
  std::string name;
  int layer = -1;
  bool full = false;  // both traces hold the full tensor (in every sequence)
  // Over the full tensors: rel_l2 = ||a − b|| / ||a|| (0 when equal, +inf when ||a|| = 0 < ||a − b||),
  // max |a − b|, and max distance in units in the last place of the storage dtype (bf16 values
  // count bf16 steps; i32 the integer difference). Element pairs that differ with a NaN or Inf on
  // either side are counted in nonfinite_differing and left out of the three.
  double rel_l2 = 0, max_abs = 0;
  int64_t max_ulp = 0;
  int64_t nonfinite_differing = 0;
  int64_t first_digest_seq = -1;         // sequence of the first row whose digests differ (-1: none)
  int64_t first_digest_row = -1;         // first row whose digests differ (-1: none)
  int64_t rows_differing = 0, rows = 0;  // digest rows, summed over sequences
};

struct TokenDiff {
  int seq = 0;
  int64_t position = 0;  // row of the log-probs: the prediction of token position + 1
  double logprob_a = 0, logprob_b = 0, abs_diff = 0;
  double ratio = 1;  // exp(logprob_b - logprob_a): importance ratio of B (candidate) against A
};

struct DiffReport {
  std::string trace_a, trace_b;
  int step_a = 0, step_b = 0, seq_count = 0;
  std::string profile_a, profile_b;  // numerics profiles of the two steps
  // The sites where the two steps' recorded profiles differ (model/profile.h profile_diff), in site
  // order; profile_sites_known is false when a step's profile is not known to this build (an engine's
  // name without a stored text), and the list is then empty.
  std::vector<ProfileSiteDiff> profile_sites;
  bool profile_sites_known = false;
  std::string model_digest_a, model_digest_b;
  bool model_mismatch = false;
  std::vector<LayerDiff> layers;    // sequence-aggregated, one per layer of A's config
  std::vector<TensorDiff> tensors;  // execution order (A's digest records), sequence-aggregated
  std::vector<TokenDiff> tokens;    // all sequences concatenated
  // Over the tokens, with samples from A and r = p_B / p_A: k1 = mean(−log r), k3 = mean((r − 1) −
  // log r); both estimate KL(A ‖ B).
  double k1 = 0, k3 = 0;
  double ratio_mean = 1, ratio_max = 1, ratio_min = 1, ratio_outside = 0;  // outside [0.8, 1.25]
  double logprob_abs_mean = 0, logprob_abs_max = 0;
  std::string tie_rule;      // "relative" (the default rule above) or "absolute"
  double tie_threshold = 0;  // relative: the factor f; absolute: the threshold
  struct First {
    int seq = 0, layer = -1;
    std::string tensor;
    int64_t row = 0;
  };
  std::optional<First> first_divergence;  // execution order
  // Digest records or decisions present in one trace only ("seq 0 layer 3 attn.q: only in A"), and
  // records whose row counts differ. Empty for traces of one config and the same tokens.
  std::vector<std::string> unmatched;
  // Training steps (kind "train-step"): when both steps are, their gradients, metrics and settings
  // (replay/training_diff.h); when only one is, training_note says so and nothing more is compared
  // than for any two steps of the same tokens.
  std::optional<TrainingDiff> training;
  std::string training_note;
  // Remarks on what could not be compared: an external step (no digests), weights a trace does not name.
  std::vector<std::string> notes;
};

// Throws InputError when the traces hold different tokens (naming the sequence and the first
// differing position), two training steps different samples (a prompt length: tokens[:P] is the prompt)
// or (without allow_model_mismatch) different model digests; TraceError and its
// kinds for unreadable traces, a step out of range or an incomplete step.
DiffReport diff_traces(const std::string& a, const std::string& b, const DiffOptions& opt);
// The same over traces already open (the viewer's worker, whose readers keep what its views read:
// TraceReader::keep_reads); the report names the readers' paths.
DiffReport diff_traces(const TraceReader& a, const TraceReader& b, const DiffOptions& opt);
std::string diff_to_json(const DiffReport& r);  // schema: docs/DIFF_JSON.md
std::string diff_to_table(const DiffReport& r);
// Writes layers.csv, tensors.csv and tokens.csv into `dir` (created if missing), and for two training
// steps gradients.csv (per parameter) and gradient_cells.csv (per kind and layer); InputError when a
// file cannot be written.
void diff_to_csv(const DiffReport& r, const std::string& dir);

}  // namespace dsv4
