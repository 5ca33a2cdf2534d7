// Per-(layer, token) quantities the viewer shows that the diff engine aggregates away: computed here
// from trace data alone (the same definitions as replay/diff.h, evaluated per position), plus the
// content of the detail panel for one cell. Pure functions: no Qt, no I/O.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "gui/models/dataset.h"

namespace dsv4::gui {

// Row t of a decision table: the valid ids (−1 padding dropped), ascending (model/decision_sets.h).
std::vector<int32_t> indexer_row(const IndexerRecord& r, int64_t t);
std::vector<int32_t> routing_row(const RoutingRecord& r, int64_t t);

// Per token: set_overlap of the two rows (LayerDiff::indexer_overlap_*).
std::vector<float> indexer_overlap(const IndexerRecord& a, const IndexerRecord& b);
// Per token: set_jaccard of the two rows (LayerDiff::routing_jaccard).
std::vector<float> routing_agreement(const RoutingRecord& a, const RoutingRecord& b);
// Per token: max |A − B| over pre, post and comb of both sublayers; kNoValue where neither sublayer
// is recorded in both traces.
std::vector<float> mhc_difference(const LayerRecords& a, const LayerRecords& b, int64_t T);
// Per token: the share of `layer`'s token-row tensors (rows == T, present in both tables) whose row
// digest differs; kNoValue when the layer has no such tensor.
std::vector<float> digest_difference(const DigestTable& a, const DigestTable& b, int layer, int64_t T);
// Names of `layer`'s tensors whose digest differs at token t (token-row tensors only).
std::vector<std::string> differing_tensors(const DigestTable& a, const DigestTable& b, int layer, int64_t t);
// Per row: ||a_r − b_r|| / ||a_r|| (0 when equal, +inf when ||a_r|| = 0 < ||a_r − b_r||, NaN when a
// non-finite value differs). Throws InputError when the shapes differ.
std::vector<float> row_rel_l2(const TensorCopy& a, const TensorCopy& b);
// Per token: the smaller of the two margins (b may be null: a copy of a).
std::vector<float> min_margin(const std::vector<float>& a, const std::vector<float>* b);
// Tokens routed to each expert.
std::vector<float> expert_load(const RoutingRecord& r, int n_experts);

// The relative tie threshold of replay/diff.h (model/decision_sets.h) over one trace's margins with the
// step's tie factor (capture/trace_reader.h recorded_tie_factor); kNoValue when no margin is finite.
double single_trace_tie_threshold(const std::vector<float>& margins, double factor);

// Maps a digest row of tensor (name, layer) to the token that row belongs to: the row itself for
// token-row tensors, the last token of a compressed group for `attn.compressed_kv` / `indexer.k`.
int64_t digest_row_token(const ModelConfig& c, const std::string& name, int layer, int64_t row, int64_t T);

struct Cell {
  int seq = 0, layer = 0;
  int64_t token = 0;
  bool operator==(const Cell&) const = default;
};
// The heatmap cell of digest row `row` of tensor (name, layer) in sequence `seq`. A model-level
// tensor (layer −1) maps to layer 0 when it runs before every layer (the embedding), else to the
// last layer; `tokens` (may be null) holds the sequence's digest records that tell which.
Cell digest_cell(const LoadSummary& s, const SeqTokens* tokens, int seq, int layer, const std::string& name,
                 int64_t row);
// The heatmap cell of the report's first divergence (digest_cell of it); nullopt without one.
std::optional<Cell> first_divergence_cell(const DiffReport& r, const LoadSummary& s, const SeqTokens* seq);

// Every differing position of the layer, indexer flips first, each kind in token order.
std::vector<DecisionFlip> decision_flips(const LayerRecords& a, const LayerRecords& b);

// The metric a comparison opens on, chosen by what differs in sequence `seq` (its loaded layers): the
// mHC difference while it marks fewer than half of the cells (the runs part somewhere: it shows
// where); once numerics differ nearly everywhere (half of the cells or more, a solid wall), the
// decision that flipped — routing agreement when an expert set differs, else indexer overlap when a
// selection differs — and the mHC difference when no decision flipped. Without mHC cells (a side is
// an external step, which holds only decisions) routing agreement.
Metric default_comparison_metric(const Dataset& d, int seq);

// ---- the detail panel of one cell ------------------------------------------------------------

// One row of a full tensor in each trace (b empty in single mode).
struct TensorRowPair {
  std::string name;
  DType dtype = DType::f32;
  int64_t row = 0;  // the row of the tensor shown (the token, or its compressed group)
  std::vector<float> a, b;
};

struct Histogram {
  double lo = 0, hi = 0;             // bin edges span [lo, hi]
  std::vector<int64_t> counts;       // equal-width bins
  int64_t zeros = 0, nonfinite = 0;  // exactly-equal pairs (comparison), non-finite values
  int64_t total = 0;
};

struct WorstElement {
  int64_t index = 0;
  float a = 0, b = 0;
  double abs_diff = 0;  // +inf when a non-finite value differs
};

struct TensorDetail {
  std::string name;
  DType dtype = DType::f32;
  int64_t row = 0, elems = 0;
  bool comparison = false;
  double rel_l2 = 0, max_abs = 0;
  Histogram histogram;              // of b − a (comparison) or of a's values (single)
  std::vector<WorstElement> worst;  // largest |b − a|, at most kWorstElements (comparison)
};
constexpr int kWorstElements = 12;
constexpr int kHistogramBins = 41;

struct ExpertChoice {
  int id = 0;
  bool in_a = false, in_b = false;
  float weight_a = 0, weight_b = 0;  // 0 where not chosen
};

struct CellDetail {
  int seq = 0, layer = 0;
  int64_t token = 0;
  int32_t token_id = -1;
  bool comparison = false;
  int compress_ratio = 0;

  // Indexer (C4 layers): the selected compressed groups of A and B and their split.
  bool has_indexer = false;
  int64_t groups_visible = 0;  // floor((token + 1) / 4): groups the row could select from
  std::vector<int32_t> indexer_a, indexer_b, indexer_common, indexer_only_a, indexer_only_b;
  float indexer_margin_a = kNoValue, indexer_margin_b = kNoValue;
  double indexer_tie_threshold = kNoValue;
  bool indexer_differs = false, indexer_tie_flip = false;

  // Routing.
  bool has_routing = false, hashed = false;
  std::vector<ExpertChoice> experts;  // union of A's and B's experts, ascending id
  float router_margin_a = kNoValue, router_margin_b = kNoValue;
  double router_tie_threshold = kNoValue;
  bool routing_differs = false, routing_tie_flip = false;

  // mHC comb matrices [hc × hc] (row j = source stream) per sublayer; diff = b − a.
  int hc = 0;
  std::array<std::vector<float>, 2> comb_a, comb_b, comb_diff;

  // Digests and full tensors.
  std::vector<std::string> digest_differing;
  std::vector<TensorDetail> tensors;  // execution order (the digest records' order)
  int first_differing_tensor = -1;    // the first of them whose row differs (comparison), −1: none
};

// Thresholds come from the report's LayerDiff in comparison mode, from the chunk in single mode. A
// flip is a tie flip when either trace's margin is below the threshold (replay/diff.h).
CellDetail cell_detail(const LoadSummary& s, const SeqTokens& seq, const LayerChunk& chunk,
                       const DiffReport* report, int64_t token, const std::vector<TensorRowPair>& rows);
TensorDetail tensor_detail(const TensorRowPair& p);

}  // namespace dsv4::gui
