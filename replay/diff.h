// Diff of two traces of the same tokens (rollout vs training): selection agreement, numeric error,
// log-prob mismatch, the first divergence, and attribution (DESIGN.md §6).
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace dsv4 {

struct DiffOptions {
  int step_a = 0, step_b = 0;
  bool allow_model_mismatch = false;
  double tie_threshold = -1;  // margin below which a flip is a tie flip; < 0: default from the profiles
};

struct LayerDiff {
  int layer = 0;
  // Indexer (C4 layers): overlap = |A ∩ B| / max(|A|, 1) per position.
  bool has_indexer = false;
  double indexer_overlap_mean = 1, indexer_overlap_min = 1;
  int64_t indexer_rows_differing = 0;
  int64_t indexer_tie_flips = 0, indexer_confident_flips = 0;
  // Routing.
  bool hashed = false;
  double routing_exact = 1, routing_jaccard = 1;
  int64_t routing_rows_differing = 0;
  int64_t routing_tie_flips = 0, routing_confident_flips = 0;
  bool hash_disagreement = false;  // a hash layer that disagrees: always a bug
  // mHC
  double mhc_pre_max_abs = 0, mhc_post_max_abs = 0, mhc_comb_max_abs = 0;
  // Attribution: the share of this layer's output difference (rel-L2 of ffn.hc_post where both
  // traces hold it, else digest-differing rows) that appears at positions whose selections agree.
  double same_selection_share = 0;
  int64_t rows_out_differing = 0;
};

struct TensorDiff {
  std::string name;
  int layer = -1;
  bool full = false;  // both traces hold the full tensor
  double rel_l2 = 0, max_abs = 0;
  int64_t max_ulp = 0;
  int64_t first_digest_row = -1;  // first row whose digests differ (-1: none)
  int64_t rows_differing = 0, rows = 0;
};

struct TokenDiff {
  int64_t position = 0;
  double logprob_a = 0, logprob_b = 0, abs_diff = 0;
  double ratio = 1;  // exp(logprob_b - logprob_a): importance ratio of B (candidate) against A
};

struct DiffReport {
  std::string trace_a, trace_b;
  int step_a = 0, step_b = 0, seq_count = 0;
  bool model_mismatch = false;
  std::vector<LayerDiff> layers;      // sequence-aggregated
  std::vector<TensorDiff> tensors;    // execution order
  std::vector<TokenDiff> tokens;      // all sequences concatenated
  double k1 = 0, k3 = 0;              // KL estimators over tokens (log r, (r - 1) - log r)
  double ratio_mean = 1, ratio_max = 1, ratio_outside = 0;  // outside [0.8, 1.25]
  double tie_threshold = 0;
  struct First {
    int seq = 0, layer = -1;
    std::string tensor;
    int64_t row = 0;
  };
  std::optional<First> first_divergence;  // execution order
};

// Throws InputError when the traces hold different tokens or (without allow_model_mismatch)
// different model digests.
DiffReport diff_traces(const std::string& a, const std::string& b, const DiffOptions& opt);
std::string diff_to_json(const DiffReport& r);  // schema: docs/DIFF_JSON.md
std::string diff_to_table(const DiffReport& r);
void diff_to_csv(const DiffReport& r, const std::string& dir);  // layers.csv, tensors.csv, tokens.csv

}  // namespace dsv4
