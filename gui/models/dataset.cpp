#include "gui/models/dataset.h"

#include <stdexcept>

#include "model/error.h"

namespace dsv4::gui {

namespace {

constexpr std::array<MetricInfo, kMetricCount> kMetrics = {{
    {Metric::IndexerOverlap, "indexer-overlap", "Indexer overlap", "|A∩B| / |A|", true, false, true, false,
     MetricAxis::Tokens, 1.0},
    {Metric::RoutingAgreement, "routing-agreement", "Routing agreement", "Jaccard |A∩B| / |A∪B|", true, false,
     true, false, MetricAxis::Tokens, 1.0},
    {Metric::MhcDifference, "mhc-diff", "mHC difference", "max |A−B|", false, true, true, false,
     MetricAxis::Tokens, 1e-3},
    {Metric::TensorDigest, "tensor-digest", "Tensor digests", "share of tensors differing", false, false,
     true, false, MetricAxis::Tokens, 0.0},
    {Metric::TensorRelL2, "tensor-rel-l2", "Tensor rel-L2 (full tensors)", "||a−b|| / ||a||", false, true,
     true, false, MetricAxis::Tokens, 1e-2},
    {Metric::IndexerMargin, "indexer-margin", "Indexer margin", "score gap", true, true, true, true,
     MetricAxis::Tokens, 1e-3},
    {Metric::RouterMargin, "router-margin", "Router margin", "score gap", true, true, true, true,
     MetricAxis::Tokens, 1e-3},
    {Metric::ExpertLoad, "expert-load", "Expert load", "tokens", false, false, false, true,
     MetricAxis::Experts, 0.0},
}};

}  // namespace

const MetricInfo& metric_info(Metric m) {
  return kMetrics.at(static_cast<size_t>(m));
}
const std::array<MetricInfo, kMetricCount>& all_metrics() {
  return kMetrics;
}

Metric metric_from_name(const std::string& name) {
  std::string known;
  for (const auto& m : kMetrics) {
    if (name == m.name) return m.metric;
    known += (known.empty() ? "" : ", ") + std::string(m.name);
  }
  throw InputError("unknown metric '" + name + "' (known: " + known + ")");
}

const LayerChunk* Dataset::chunk(int seq, int layer) const {
  if (seq < 0 || seq >= int(chunks.size()) || layer < 0 || layer >= int(chunks[seq].size())) return nullptr;
  return chunks[seq][layer].get();
}

const SeqTokens* Dataset::seq_tokens(int seq) const {
  return seq >= 0 && seq < int(seqs.size()) ? seqs[seq].get() : nullptr;
}

const LayerDiff* Dataset::layer_diff(int layer) const {
  if (!report) return nullptr;
  for (const auto& l : report->layers)
    if (l.layer == layer) return &l;
  return nullptr;
}

}  // namespace dsv4::gui
