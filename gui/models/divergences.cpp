#include "gui/models/divergences.h"

#include <algorithm>
#include <cmath>

#include "model/decision_sets.h"

namespace dsv4::gui {

const char* divergence_kind_name(DivergenceKind k) {
  switch (k) {
    case DivergenceKind::ConfidentFlip:
      return "confident flip";
    case DivergenceKind::TieFlip:
      return "tie flip";
    case DivergenceKind::FirstTensor:
      return "first differing tensor";
    case DivergenceKind::WorstToken:
      return "log-prob";
  }
  return "?";
}

bool divergence_before(const Divergence& x, const Divergence& y) {
  if (x.kind != y.kind) return int(x.kind) < int(y.kind);
  if (x.kind != DivergenceKind::FirstTensor) {
    // NaN values (a margin or threshold missing) sort last within the kind.
    const bool xn = std::isnan(x.value), yn = std::isnan(y.value);
    if (xn != yn) return yn;
    if (!xn && x.value != y.value) return x.value > y.value;
  }
  return x.order < y.order;
}

DivergenceList build_divergences(const LoadSummary& s, const std::vector<SeqPtr>& seqs,
                                 const std::vector<std::vector<ChunkPtr>>& chunks, const DiffReport& r,
                                 int worst_tokens) {
  DivergenceList out;
  auto seq_tokens = [&](int seq) -> const SeqTokens* {
    return seq >= 0 && seq < int(seqs.size()) ? seqs[size_t(seq)].get() : nullptr;
  };
  int64_t order = 0;

  // Decision flips, classified by the report's per-layer thresholds (the rule of dsv4 diff).
  for (size_t seq = 0; seq < chunks.size(); ++seq) {
    for (const ChunkPtr& c : chunks[seq]) {
      if (!c) continue;
      const LayerDiff* ld = nullptr;
      for (const auto& l : r.layers)
        if (l.layer == c->layer) ld = &l;
      for (const DecisionFlip& f : c->flips) {
        Divergence d;
        d.seq = c->seq;
        d.layer = d.cell_layer = c->layer;
        d.token = f.token;
        const bool idx = f.kind == DecisionKind::Indexer;
        d.what = idx ? "indexer" : "routing";
        d.margin_a = f.margin_a;
        d.margin_b = f.margin_b;
        d.threshold = ld ? (idx ? ld->indexer_tie_threshold : ld->routing_tie_threshold) : kNoValue;
        const bool tie = is_tie_flip(f.margin_a, f.margin_b, d.threshold);
        d.kind = tie ? DivergenceKind::TieFlip : DivergenceKind::ConfidentFlip;
        const double m = std::min(double(f.margin_a), double(f.margin_b));
        d.value = d.threshold > 0 ? m / d.threshold : (std::isnan(m) ? kNoValue : m);
        d.order = order++;
        ++(tie ? out.tie_flips : out.confident_flips);
        ++(idx ? out.indexer_flips : out.routing_flips);
        out.items.push_back(std::move(d));
      }
    }
  }

  // The first differing tensor of each layer (and of the model-level tensors), execution order.
  std::vector<int> seen;
  for (const TensorDiff& t : r.tensors) {
    if (t.rows_differing <= 0 || t.first_digest_row < 0) continue;
    if (std::find(seen.begin(), seen.end(), t.layer) != seen.end()) continue;
    seen.push_back(t.layer);
    const int seq = int(std::max<int64_t>(t.first_digest_seq, 0));
    const Cell cell = digest_cell(s, seq_tokens(seq), seq, t.layer, t.name, t.first_digest_row);
    Divergence d;
    d.kind = DivergenceKind::FirstTensor;
    d.seq = seq;
    d.layer = t.layer;
    d.cell_layer = cell.layer;
    d.token = cell.token;
    d.what = t.name;
    d.full = t.full;
    d.value = t.full ? t.rel_l2 : (t.rows > 0 ? double(t.rows_differing) / double(t.rows) : 0);
    d.order = order++;
    out.items.push_back(std::move(d));
  }

  // The tokens whose log-probs differ most.
  std::vector<const TokenDiff*> tok;
  for (const TokenDiff& t : r.tokens)
    if (t.abs_diff > 0 || std::isnan(t.abs_diff)) tok.push_back(&t);
  const size_t keep = std::min(tok.size(), size_t(std::max(worst_tokens, 0)));
  auto worse = [](const TokenDiff* x, const TokenDiff* y) {
    const bool xn = std::isnan(x->abs_diff), yn = std::isnan(y->abs_diff);
    if (xn != yn) return xn;  // a NaN log-prob difference is the worst
    if (x->abs_diff != y->abs_diff) return x->abs_diff > y->abs_diff;
    return x->seq != y->seq ? x->seq < y->seq : x->position < y->position;
  };
  std::partial_sort(tok.begin(), tok.begin() + std::ptrdiff_t(keep), tok.end(), worse);
  for (size_t i = 0; i < keep; ++i) {
    Divergence d;
    d.kind = DivergenceKind::WorstToken;
    d.seq = tok[i]->seq;
    d.layer = -1;
    d.cell_layer = std::max(s.layers - 1, 0);
    d.token = tok[i]->position;
    d.what = "log-prob";
    d.value = std::isnan(tok[i]->abs_diff) ? HUGE_VAL : tok[i]->abs_diff;
    d.order = order++;
    out.items.push_back(std::move(d));
  }

  std::stable_sort(out.items.begin(), out.items.end(), divergence_before);
  out.digests_compared = !r.tensors.empty();
  if (r.first_divergence) {
    out.has_first_divergence = true;
    out.first = *r.first_divergence;
    if (const auto c = first_divergence_cell(r, s, seq_tokens(r.first_divergence->seq))) out.first_cell = *c;
  }
  return out;
}

}  // namespace dsv4::gui
