// The divergences of a compared step, in severity order: what the navigator lists and the banner
// sums up. Built from the loaded chunks' decision flips and the diff report (whose per-layer tie
// thresholds classify the flips, so the navigator, the heatmap, the detail panel and `dsv4 diff`
// agree on every flip). Pure functions: no Qt, no I/O.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "gui/models/dataset.h"
#include "gui/models/metrics.h"

namespace dsv4::gui {

// In severity order: a confident flip (a decision differs although both margins are above the
// tie threshold) is worse than a tie flip; then the first tensor of each layer whose digests
// differ; then the tokens whose log-probs differ most.
enum class DivergenceKind : int { ConfidentFlip, TieFlip, FirstTensor, WorstToken };
constexpr int kDivergenceKinds = 4;
const char* divergence_kind_name(DivergenceKind k);  // "confident flip", "tie flip", …

struct Divergence {
  DivergenceKind kind = DivergenceKind::FirstTensor;
  int seq = 0;
  int layer = -1;  // the layer (FirstTensor: −1 for a model-level tensor); WorstToken: −1
  int64_t token = 0;
  std::string what;  // "indexer" or "routing" (flips), the tensor name, "log-prob"
  // Flips: min(margin A, margin B) / the layer's tie threshold (how far above the rounding noise the
  // decision was); FirstTensor: rel-L2 where both traces hold the tensor in full, else the share of
  // its rows whose digests differ; WorstToken: |Δ log-prob|.
  double value = 0;
  float margin_a = kNoValue, margin_b = kNoValue;
  double threshold = kNoValue;  // flips: the layer's tie threshold
  bool full = false;            // FirstTensor: value is the rel-L2 of full tensors
  int cell_layer = 0;           // the heatmap row that shows it (WorstToken: the last layer)
  int64_t order = 0;            // execution-order rank, for equal severities
};

struct DivergenceList {
  std::vector<Divergence> items;  // severity order (divergence_before)
  int64_t confident_flips = 0, tie_flips = 0;
  int64_t indexer_flips = 0, routing_flips = 0;
  bool has_first_divergence = false;
  bool digests_compared = true;  // false when a side is an external step (no digests)
  DiffReport::First first;  // the report's first divergence
  Cell first_cell;          // its heatmap cell
};

constexpr int kWorstTokens = 20;

// The severity order: kind, then within a kind the larger value first (FirstTensor: execution
// order), then execution order.
bool divergence_before(const Divergence& x, const Divergence& y);

// Needs every chunk of the step (null chunks are skipped) and the report.
DivergenceList build_divergences(const LoadSummary& s, const std::vector<SeqPtr>& seqs,
                                 const std::vector<std::vector<ChunkPtr>>& chunks, const DiffReport& r,
                                 int worst_tokens = kWorstTokens);

}  // namespace dsv4::gui
