#include "gui/models/metrics.h"

#include "model/decision_sets.h"
#include "model/error.h"

#include <algorithm>
#include <cmath>
#include <map>
#include <stdexcept>

namespace dsv4::gui {

namespace {

int64_t row_elems_of(const TensorCopy& t) {
  int64_t n = 1;
  for (size_t i = 1; i < t.shape.size(); ++i) n *= t.shape[i];
  return n;
}

double value_at(const TensorCopy& t, int64_t i) {
  return t.dtype == DType::i32 ? double(t.i[i]) : double(t.f[i]);
}

using RecordKey = std::pair<std::string, int>;
std::map<RecordKey, const DigestRecord*> index_records(const DigestTable& t) {
  std::map<RecordKey, const DigestRecord*> m;
  for (const auto& r : t.records) m.emplace(RecordKey{r.name, r.layer}, &r);
  return m;
}

float safe_at(const std::vector<float>& v, int64_t t) {
  return t >= 0 && t < int64_t(v.size()) ? v[t] : kNoValue;
}

}  // namespace

std::vector<int32_t> indexer_row(const IndexerRecord& r, int64_t t) {
  return r.T > 0 ? valid_ids(r.ids, int64_t(r.ids.size()) / r.T, t) : std::vector<int32_t>{};
}

std::vector<int32_t> routing_row(const RoutingRecord& r, int64_t t) {
  return valid_ids(r.ids, r.k, t);
}

std::vector<float> indexer_overlap(const IndexerRecord& a, const IndexerRecord& b) {
  const int64_t T = std::min(a.T, b.T);
  std::vector<float> out(size_t(std::max(a.T, b.T)), kNoValue);
  for (int64_t t = 0; t < T; ++t) {
    out[t] = float(set_overlap(indexer_row(a, t), indexer_row(b, t)));
  }
  return out;
}

std::vector<float> routing_agreement(const RoutingRecord& a, const RoutingRecord& b) {
  const int64_t T = std::min(a.T, b.T);
  std::vector<float> out(size_t(std::max(a.T, b.T)), kNoValue);
  for (int64_t t = 0; t < T; ++t) {
    out[t] = float(set_jaccard(routing_row(a, t), routing_row(b, t)));
  }
  return out;
}

std::vector<float> mhc_difference(const LayerRecords& a, const LayerRecords& b, int64_t T) {
  std::vector<float> out(size_t(std::max<int64_t>(T, 0)), kNoValue);
  for (int s = 0; s < 2; ++s) {
    if (!a.mhc[s] || !b.mhc[s]) continue;
    const MhcRecord &ma = *a.mhc[s], &mb = *b.mhc[s];
    if (ma.hc != mb.hc) continue;
    const int64_t rows = std::min({ma.T, mb.T, T});
    const int hc = ma.hc;
    auto fold = [&](const std::vector<float>& x, const std::vector<float>& y, int64_t per_row) {
      if (int64_t(x.size()) < rows * per_row || int64_t(y.size()) < rows * per_row) return;
      for (int64_t t = 0; t < rows; ++t) {
        float m = std::isnan(out[t]) ? 0.0f : out[t];
        for (int64_t j = 0; j < per_row; ++j) {
          const float xa = x[t * per_row + j], yb = y[t * per_row + j];
          float d = std::fabs(xa - yb);
          if (std::isnan(d))
            d = (std::isnan(xa) && std::isnan(yb)) ? 0.0f : std::numeric_limits<float>::infinity();
          m = std::max(m, d);
        }
        out[t] = m;
      }
    };
    fold(ma.pre, mb.pre, hc);
    fold(ma.post, mb.post, hc);
    fold(ma.comb, mb.comb, int64_t(hc) * hc);
  }
  return out;
}

std::vector<float> digest_difference(const DigestTable& a, const DigestTable& b, int layer, int64_t T) {
  std::vector<float> out(size_t(std::max<int64_t>(T, 0)), kNoValue);
  const auto bi = index_records(b);
  std::vector<int32_t> differing(out.size(), 0);
  int compared = 0;
  for (const auto& ra : a.records) {
    if (ra.layer != layer || ra.rows != T) continue;
    const auto it = bi.find({ra.name, ra.layer});
    if (it == bi.end() || it->second->rows != T) continue;
    const DigestRecord& rb = *it->second;
    if (ra.first + T > int64_t(a.values.size()) || rb.first + T > int64_t(b.values.size())) continue;
    ++compared;
    for (int64_t t = 0; t < T; ++t) differing[t] += a.values[ra.first + t] != b.values[rb.first + t];
  }
  if (compared == 0) return out;
  for (int64_t t = 0; t < T; ++t) out[t] = float(double(differing[t]) / compared);
  return out;
}

std::vector<std::string> differing_tensors(const DigestTable& a, const DigestTable& b, int layer, int64_t t) {
  std::vector<std::string> names;
  const auto bi = index_records(b);
  for (const auto& ra : a.records) {
    if (ra.layer != layer || t < 0 || t >= ra.rows) continue;
    const auto it = bi.find({ra.name, ra.layer});
    if (it == bi.end() || it->second->rows != ra.rows) continue;
    const DigestRecord& rb = *it->second;
    if (ra.first + t >= int64_t(a.values.size()) || rb.first + t >= int64_t(b.values.size())) continue;
    if (a.values[ra.first + t] != b.values[rb.first + t]) names.push_back(ra.name);
  }
  return names;
}

std::vector<float> row_rel_l2(const TensorCopy& a, const TensorCopy& b) {
  if (a.shape != b.shape || a.dtype != b.dtype)
    throw InputError("row_rel_l2: tensors differ in shape or dtype");
  const int64_t rows = a.shape.empty() ? 1 : a.shape[0];
  const int64_t n = row_elems_of(a);
  std::vector<float> out(size_t(rows), 0.0f);
  for (int64_t r = 0; r < rows; ++r) {
    double num = 0, den = 0;
    bool nonfinite_diff = false;
    for (int64_t j = 0; j < n; ++j) {
      const double x = value_at(a, r * n + j), y = value_at(b, r * n + j);
      if (!std::isfinite(x) || !std::isfinite(y)) {
        if (!(x == y || (std::isnan(x) && std::isnan(y)))) nonfinite_diff = true;
        continue;
      }
      num += (x - y) * (x - y);
      den += x * x;
    }
    if (nonfinite_diff) {
      out[r] = kNoValue;
    } else if (num == 0) {
      out[r] = 0.0f;
    } else {
      out[r] = den == 0 ? std::numeric_limits<float>::infinity() : float(std::sqrt(num / den));
    }
  }
  return out;
}

std::vector<float> min_margin(const std::vector<float>& a, const std::vector<float>* b) {
  std::vector<float> out = a;
  if (b)
    for (size_t t = 0; t < out.size() && t < b->size(); ++t) out[t] = std::min(out[t], (*b)[t]);
  return out;
}

std::vector<float> expert_load(const RoutingRecord& r, int n_experts) {
  std::vector<float> load(size_t(std::max(n_experts, 0)), 0.0f);
  for (int32_t id : r.ids)
    if (id >= 0 && id < n_experts) load[id] += 1.0f;
  return load;
}

double single_trace_tie_threshold(const std::vector<float>& margins, double factor) {
  return relative_tie_threshold({&margins}, factor).value_or(kNoValue);
}

int64_t digest_row_token(const ModelConfig& c, const std::string& name, int layer, int64_t row, int64_t T) {
  int ratio = 1;
  if (name == "attn.compressed_kv" && layer >= 0 && layer < int(c.compress_ratios.size())) {
    ratio = std::max(c.compress_ratios[layer], 1);
  } else if (name == "indexer.k") {
    ratio = 4;
  }
  const int64_t token = ratio == 1 ? row : (row + 1) * ratio - 1;
  return std::clamp<int64_t>(token, 0, std::max<int64_t>(T - 1, 0));
}

Cell digest_cell(const LoadSummary& s, const SeqTokens* tokens, int seq, int layer, const std::string& name,
                 int64_t row) {
  Cell c;
  c.seq = seq;
  const int64_t T = seq >= 0 && seq < int(s.seq_lengths.size()) ? s.seq_lengths[seq] : 0;
  if (layer >= 0) {
    c.layer = std::min(layer, std::max(s.layers - 1, 0));
  } else {
    // Model-level: before every layer record (the embedding) or after them (the head).
    bool before = name == "embed";
    if (tokens) {
      for (const auto& rec : tokens->digests_a.records) {
        if (rec.layer >= 0) {
          before = false;
          break;
        }
        if (rec.name == name) {
          before = true;
          break;
        }
      }
    }
    c.layer = before ? 0 : std::max(s.layers - 1, 0);
  }
  c.token = digest_row_token(s.a.config, name, layer, row, T);
  return c;
}

std::optional<Cell> first_divergence_cell(const DiffReport& r, const LoadSummary& s, const SeqTokens* seq) {
  if (!r.first_divergence || s.layers <= 0) return std::nullopt;
  const auto& f = *r.first_divergence;
  return digest_cell(s, seq, f.seq, f.layer, f.tensor, f.row);
}

namespace {

// Row t of two [T, w] id tables holds the same ids as stored (then the same set, without building it).
bool same_stored_row(const std::vector<int32_t>& a, int64_t wa, const std::vector<int32_t>& b, int64_t wb,
                     int64_t t) {
  if (wa != wb || wa <= 0 || int64_t(a.size()) < (t + 1) * wa || int64_t(b.size()) < (t + 1) * wb)
    return false;
  return std::equal(a.begin() + t * wa, a.begin() + (t + 1) * wa, b.begin() + t * wb);
}

}  // namespace

std::vector<DecisionFlip> decision_flips(const LayerRecords& a, const LayerRecords& b) {
  std::vector<DecisionFlip> out;
  if (a.indexer && b.indexer && a.indexer->T == b.indexer->T && a.indexer->T > 0) {
    const IndexerRecord &ia = *a.indexer, &ib = *b.indexer;
    const int64_t wa = int64_t(ia.ids.size()) / ia.T, wb = int64_t(ib.ids.size()) / ib.T;
    for (int64_t t = 0; t < ia.T; ++t)
      if (!same_stored_row(ia.ids, wa, ib.ids, wb, t) && indexer_row(ia, t) != indexer_row(ib, t))
        out.push_back({t, DecisionKind::Indexer, safe_at(ia.margin, t), safe_at(ib.margin, t)});
  }
  if (a.routing && b.routing && a.routing->T == b.routing->T) {
    const RoutingRecord &ra = *a.routing, &rb = *b.routing;
    for (int64_t t = 0; t < ra.T; ++t)
      if (!same_stored_row(ra.ids, ra.k, rb.ids, rb.k, t) && routing_row(ra, t) != routing_row(rb, t))
        out.push_back({t, DecisionKind::Routing, safe_at(ra.margin, t), safe_at(rb.margin, t)});
  }
  return out;
}

TensorDetail tensor_detail(const TensorRowPair& p) {
  TensorDetail d;
  d.name = p.name;
  d.dtype = p.dtype;
  d.row = p.row;
  d.comparison = !p.b.empty();
  d.elems = int64_t(p.a.size());
  Histogram& h = d.histogram;
  h.counts.assign(kHistogramBins, 0);
  h.total = d.elems;
  std::vector<double> v;  // the values binned: b − a, or a
  v.reserve(p.a.size());
  double num = 0, den = 0;
  for (size_t i = 0; i < p.a.size(); ++i) {
    const double x = p.a[i];
    if (!d.comparison) {
      if (!std::isfinite(x)) {
        ++h.nonfinite;
        continue;
      }
      v.push_back(x);
      continue;
    }
    const double y = i < p.b.size() ? double(p.b[i]) : std::numeric_limits<double>::quiet_NaN();
    if (!std::isfinite(x) || !std::isfinite(y)) {
      const bool same = x == y || (std::isnan(x) && std::isnan(y));
      ++h.nonfinite;
      if (!same) d.worst.push_back({int64_t(i), float(x), float(y), std::numeric_limits<double>::infinity()});
      continue;
    }
    const double diff = y - x;
    num += diff * diff;
    den += x * x;
    d.max_abs = std::max(d.max_abs, std::fabs(diff));
    if (diff == 0) {
      ++h.zeros;
      continue;
    }
    v.push_back(diff);
    d.worst.push_back({int64_t(i), float(x), float(y), std::fabs(diff)});
  }
  if (d.comparison)
    d.rel_l2 = num == 0 ? 0 : (den == 0 ? std::numeric_limits<double>::infinity() : std::sqrt(num / den));
  if (!v.empty()) {
    if (d.comparison) {
      double m = 0;
      for (double x : v) m = std::max(m, std::fabs(x));
      h.lo = -m, h.hi = m;
    } else {
      h.lo = *std::min_element(v.begin(), v.end());
      h.hi = *std::max_element(v.begin(), v.end());
    }
    const double width = h.hi > h.lo ? (h.hi - h.lo) / kHistogramBins : 1.0;
    for (double x : v) {
      const int bin = std::clamp(int((x - h.lo) / width), 0, kHistogramBins - 1);
      ++h.counts[bin];
    }
  }
  const size_t keep = std::min<size_t>(d.worst.size(), kWorstElements);
  std::partial_sort(d.worst.begin(), d.worst.begin() + keep, d.worst.end(),
                    [](const WorstElement& x, const WorstElement& y) {
                      return x.abs_diff != y.abs_diff ? x.abs_diff > y.abs_diff : x.index < y.index;
                    });
  d.worst.resize(keep);
  return d;
}

Metric default_comparison_metric(const Dataset& d, int seq) {
  int64_t cells = 0, differing = 0;
  bool routing = false, indexer = false;
  for (int layer = 0; layer < d.layers(); ++layer) {
    const LayerChunk* c = d.chunk(seq, layer);
    if (!c) continue;
    for (float v : c->values[int(Metric::MhcDifference)]) {
      if (!std::isfinite(v)) continue;
      ++cells;
      differing += v > 0;
    }
    for (const DecisionFlip& f : c->flips) {
      routing = routing || f.kind == DecisionKind::Routing;
      indexer = indexer || f.kind == DecisionKind::Indexer;
    }
  }
  if (cells == 0) return Metric::RoutingAgreement;  // no mHC on a side (an external step): decisions
  if (2 * differing < cells) return Metric::MhcDifference;
  if (routing) return Metric::RoutingAgreement;
  if (indexer) return Metric::IndexerOverlap;
  return Metric::MhcDifference;
}

CellDetail cell_detail(const LoadSummary& s, const SeqTokens& seq, const LayerChunk& chunk,
                       const DiffReport* report, int64_t token, const std::vector<TensorRowPair>& rows) {
  CellDetail d;
  d.seq = chunk.seq;
  d.layer = chunk.layer;
  d.token = token;
  d.token_id = token >= 0 && token < int64_t(seq.tokens.size()) ? seq.tokens[token] : -1;
  d.comparison = s.comparison();
  const ModelConfig& c = s.a.config;
  d.compress_ratio = chunk.layer < int(c.compress_ratios.size()) ? c.compress_ratios[chunk.layer] : 0;

  const LayerDiff* ld = nullptr;
  if (report)
    for (const auto& l : report->layers)
      if (l.layer == chunk.layer) ld = &l;
  d.indexer_tie_threshold = ld ? ld->indexer_tie_threshold : chunk.indexer_tie_threshold;
  d.router_tie_threshold = ld ? ld->routing_tie_threshold : chunk.router_tie_threshold;

  if (chunk.a.indexer && token < chunk.a.indexer->T) {
    d.has_indexer = true;
    d.groups_visible = (token + 1) / 4;
    d.indexer_a = indexer_row(*chunk.a.indexer, token);
    d.indexer_margin_a = safe_at(chunk.a.indexer->margin, token);
    if (d.comparison && chunk.b.indexer) {
      d.indexer_b = indexer_row(*chunk.b.indexer, token);
      d.indexer_margin_b = safe_at(chunk.b.indexer->margin, token);
      std::set_intersection(d.indexer_a.begin(), d.indexer_a.end(), d.indexer_b.begin(), d.indexer_b.end(),
                            std::back_inserter(d.indexer_common));
      std::set_difference(d.indexer_a.begin(), d.indexer_a.end(), d.indexer_b.begin(), d.indexer_b.end(),
                          std::back_inserter(d.indexer_only_a));
      std::set_difference(d.indexer_b.begin(), d.indexer_b.end(), d.indexer_a.begin(), d.indexer_a.end(),
                          std::back_inserter(d.indexer_only_b));
      d.indexer_differs = d.indexer_a != d.indexer_b;
      d.indexer_tie_flip =
          d.indexer_differs && is_tie_flip(d.indexer_margin_a, d.indexer_margin_b, d.indexer_tie_threshold);
    } else {
      d.indexer_common = d.indexer_a;
    }
  }

  if (chunk.a.routing && token < chunk.a.routing->T) {
    const RoutingRecord& ra = *chunk.a.routing;
    d.has_routing = true;
    d.hashed = ra.hashed;
    d.router_margin_a = safe_at(ra.margin, token);
    std::map<int, ExpertChoice> experts;
    for (int j = 0; j < ra.k; ++j) {
      const int32_t id = ra.ids[token * ra.k + j];
      if (id < 0) continue;
      auto& e = experts[id];
      e.id = id, e.in_a = true, e.weight_a = ra.weights[token * ra.k + j];
    }
    if (d.comparison && chunk.b.routing && token < chunk.b.routing->T) {
      const RoutingRecord& rb = *chunk.b.routing;
      d.router_margin_b = safe_at(rb.margin, token);
      for (int j = 0; j < rb.k; ++j) {
        const int32_t id = rb.ids[token * rb.k + j];
        if (id < 0) continue;
        auto& e = experts[id];
        e.id = id, e.in_b = true, e.weight_b = rb.weights[token * rb.k + j];
      }
      d.routing_differs = routing_row(ra, token) != routing_row(rb, token);
      d.routing_tie_flip =
          d.routing_differs && is_tie_flip(d.router_margin_a, d.router_margin_b, d.router_tie_threshold);
    }
    for (const auto& [id, e] : experts) d.experts.push_back(e);
  }

  for (int sl = 0; sl < 2; ++sl) {
    const auto& ma = chunk.a.mhc[sl];
    if (!ma || token >= ma->T) continue;
    d.hc = ma->hc;
    const size_t n = size_t(ma->hc) * ma->hc;
    d.comb_a[sl].assign(ma->comb.begin() + token * n, ma->comb.begin() + (token + 1) * n);
    const auto& mb = chunk.b.mhc[sl];
    if (d.comparison && mb && token < mb->T && mb->hc == ma->hc) {
      d.comb_b[sl].assign(mb->comb.begin() + token * n, mb->comb.begin() + (token + 1) * n);
      d.comb_diff[sl].resize(n);
      for (size_t i = 0; i < n; ++i) d.comb_diff[sl][i] = d.comb_b[sl][i] - d.comb_a[sl][i];
    }
  }

  if (d.comparison) d.digest_differing = differing_tensors(seq.digests_a, seq.digests_b, chunk.layer, token);
  for (const auto& p : rows) d.tensors.push_back(tensor_detail(p));
  // Execution order: the position of the tensor's digest record (names without one last, by name).
  auto rank = [&](const std::string& name) {
    const auto& recs = seq.digests_a.records;
    for (size_t i = 0; i < recs.size(); ++i)
      if (recs[i].layer == chunk.layer && recs[i].name == name) return i;
    return recs.size();
  };
  std::stable_sort(d.tensors.begin(), d.tensors.end(), [&](const TensorDetail& x, const TensorDetail& y) {
    const size_t rx = rank(x.name), ry = rank(y.name);
    return rx != ry ? rx < ry : x.name < y.name;
  });
  if (d.comparison)
    for (size_t i = 0; i < d.tensors.size() && d.first_differing_tensor < 0; ++i)
      if (d.tensors[i].rel_l2 != 0 || d.tensors[i].histogram.nonfinite > 0 || !d.tensors[i].worst.empty())
        d.first_differing_tensor = int(i);
  return d;
}

}  // namespace dsv4::gui
