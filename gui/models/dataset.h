// The viewer's in-memory picture of one trace or of a pair (A = reference, B = candidate): what the
// loader reads in stages and the models present. Everything here is plain data; a stage's result is
// handed to the UI thread as a shared_ptr<const ...> and never changed afterwards, so the loader
// thread and the UI thread may both hold it.
#pragma once

#include <array>
#include <cmath>
#include <cstdint>
#include <limits>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "capture/env.h"
#include "capture/trace_reader.h"
#include "model/collect.h"
#include "model/config.h"
#include "replay/diff.h"

namespace dsv4::gui {

constexpr float kNoValue = std::numeric_limits<float>::quiet_NaN();  // a cell without data

// The heatmap metrics. Per (layer, token) unless the metric's axis says experts.
enum class Metric : int {
  IndexerOverlap,    // |A ∩ B| / max(|A|, 1) of the indexer's selected groups (1: identical)
  RoutingAgreement,  // Jaccard |A ∩ B| / |A ∪ B| of the routed experts (1: identical)
  MhcDifference,     // max |A − B| over the mHC pre, post and comb of both sublayers
  TensorDigest,      // share of the layer's per-token tensors whose row digests differ (0: bit-equal)
  TensorRelL2,       // max over the layer's full tensors of ||a_t − b_t|| / ||a_t|| (row t)
  IndexerMargin,     // indexer boundary margin (comparison: the smaller of A's and B's)
  RouterMargin,      // router boundary margin (comparison: the smaller of A's and B's)
  ExpertLoad,        // tokens routed to each expert (layer × expert; trace A)
};
constexpr int kMetricCount = 8;

enum class MetricAxis { Tokens, Experts };

struct MetricInfo {
  Metric metric;
  const char* name;   // command-line name (--metric)
  const char* label;  // menu text
  const char* unit;   // legend text
  bool lower_is_worse;
  bool log_scale;
  bool comparison;  // offered when two traces are open
  bool single;      // offered when one trace is open
  MetricAxis axis;
  double default_threshold;
};

const MetricInfo& metric_info(Metric m);
const std::array<MetricInfo, kMetricCount>& all_metrics();
// Throws InputError listing the known names.
Metric metric_from_name(const std::string& name);

// Stage 1, per trace: what the file says about itself.
struct TraceInfo {
  std::string path;
  int format_version = 0;
  std::string producer, created;
  std::string seal;  // the file's seal as `trace info` words it (capture/trace_seal.h seal_summary)
  EnvFingerprint env;
  std::string model_digest, weights_path;
  ModelConfig config;
  std::vector<TraceStepInfo> steps;
  int step = 0;  // the step shown
  int64_t file_bytes = 0;
  KernelRecords kernels;  // the GPU kernels of the step shown (available = false: none, and why)
};

// Stage 1 for the view: both traces' info and the shape of what follows.
struct LoadSummary {
  TraceInfo a;
  std::optional<TraceInfo> b;
  int layers = 0;
  std::vector<int64_t> seq_lengths;  // tokens of each sequence of the step shown
  // When a trace's step is a generation (kind "generate"), per sequence its request id and prompt
  // length (positions from it on were generated); empty otherwise.
  std::vector<std::string> request_ids;
  std::vector<int64_t> prompt_lengths;
  bool comparison() const { return b.has_value(); }
  // The first generated position of sequence `seq`, or -1 when the step is no generation.
  int64_t prompt_length(int seq) const {
    return seq >= 0 && seq < int(prompt_lengths.size()) ? prompt_lengths[size_t(seq)] : -1;
  }
};

// One trace's decisions at one (sequence, layer).
struct LayerRecords {
  std::optional<IndexerRecord> indexer;
  std::optional<RoutingRecord> routing;
  std::array<std::optional<MhcRecord>, 2> mhc;  // indexed by Sublayer (attn, ffn)
};

// Stage 2, per sequence: tokens, log-probs and digests of both traces.
struct SeqTokens {
  int seq = 0;
  int64_t T = 0;
  std::vector<int32_t> tokens;
  std::vector<float> logprobs_a, logprobs_b;  // T − 1 rows; b empty in single mode
  DigestTable digests_a, digests_b;
  // Full tensors of this sequence: in single mode A's, in comparison mode those held by both.
  std::vector<std::pair<std::string, int>> full_tensors;
};

// A position of one layer where A's and B's decision sets differ (model/decision_sets.h rows), with
// both recorded margins; whether it is a tie flip needs the layer's threshold (the diff report's).
enum class DecisionKind : uint8_t { Indexer, Routing };
struct DecisionFlip {
  int64_t token = 0;
  DecisionKind kind = DecisionKind::Indexer;
  float margin_a = kNoValue, margin_b = kNoValue;
};
// Stage 3, per (sequence, layer): the records and every metric's row.
struct LayerChunk {
  int seq = 0, layer = 0;
  LayerRecords a, b;  // b empty in single mode
  // values[metric]: one value per token (per expert for ExpertLoad); empty when the metric does not
  // apply in this mode; kNoValue where the layer has no such data.
  std::array<std::vector<float>, kMetricCount> values;
  // Single mode: near-tie thresholds of this layer by the relative rule of replay/diff.h (NaN: no
  // margins). Comparison mode takes them from the DiffReport instead.
  double indexer_tie_threshold = kNoValue, router_tie_threshold = kNoValue;
  // Comparison mode, TensorRelL2: the full tensor whose row gives each token's value (an index into
  // rel_l2_tensors; −1 where no tensor of the layer is held in full).
  std::vector<std::string> rel_l2_tensors;
  std::vector<int16_t> rel_l2_argmax;
  // Comparison mode: the positions whose decision sets differ (gui/models/metrics.h decision_flips).
  std::vector<DecisionFlip> flips;
};

using SummaryPtr = std::shared_ptr<const LoadSummary>;
using SeqPtr = std::shared_ptr<const SeqTokens>;
using ChunkPtr = std::shared_ptr<const LayerChunk>;
using ReportPtr = std::shared_ptr<const DiffReport>;
struct DivergenceList;
using DivergencesPtr = std::shared_ptr<const DivergenceList>;  // gui/models/divergences.h

// What a loaded view holds on the UI thread; filled stage by stage.
struct Dataset {
  SummaryPtr summary;
  std::vector<SeqPtr> seqs;                   // [seq], null until loaded
  std::vector<std::vector<ChunkPtr>> chunks;  // [seq][layer], null until loaded
  ReportPtr report;                           // comparison mode, once computed
  DivergencesPtr divergences;                 // comparison mode, after the report
  bool complete = false;

  bool comparison() const { return summary && summary->comparison(); }
  int layers() const { return summary ? summary->layers : 0; }
  int seq_count() const { return summary ? int(summary->seq_lengths.size()) : 0; }
  int64_t tokens(int seq) const {
    return summary && seq >= 0 && seq < seq_count() ? summary->seq_lengths[seq] : 0;
  }
  const LayerChunk* chunk(int seq, int layer) const;
  const SeqTokens* seq_tokens(int seq) const;
  const LayerDiff* layer_diff(int layer) const;  // from the report, null without one
};

}  // namespace dsv4::gui
