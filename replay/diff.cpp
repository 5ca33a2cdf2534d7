// Diff of two traces (replay/diff.h). Reads both steps through TraceReader, one sequence at a time
// for decisions and full tensors; only the digest tables of every sequence are held at once.
#include "replay/diff.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <map>
#include <set>
#include <utility>

#include "capture/errors.h"
#include "capture/layout.h"
#include "capture/trace_reader.h"
#include "kernels/numerics/numerics.h"
#include "model/decision_sets.h"
#include "replay/rel_l2.h"

namespace dsv4 {

namespace {

using Key = std::pair<int, std::string>;  // (layer, tensor name)

// One side of the diff: the reader, the chosen step and what is read from /meta once.
struct Side {
  const TraceReader& r;
  std::string label;  // "A" or "B", for messages
  TraceStepInfo step;
  TraceModelMeta meta;
  ModelConfig cfg;
};

Side open_side(const TraceReader& r, int step, const char* label) {
  const std::string& path = r.path();
  Side s{r, label, {}, {}, {}};
  const std::vector<TraceStepInfo> steps = s.r.steps();
  if (step < 0 || step >= int(steps.size()))
    throw TraceError(fmt::format("{}: step {} out of range (trace {} holds {} step{})", path, step, label,
                                 steps.size(), steps.size() == 1 ? "" : "s"));
  s.step = steps[step];
  if (!s.step.complete)
    throw TraceIncomplete(
        fmt::format("{}: step {} is incomplete (status 0); `dsv4 trace salvage` keeps the "
                    "complete steps",
                    path, step));
  s.meta = s.r.model();
  s.cfg = s.r.config();
  return s;
}

// The model digests must agree; the message names the first weight tensor that differs.
std::string model_difference(const Side& a, const Side& b) {
  if (a.meta.model_digest == b.meta.model_digest) return "";
  if (a.meta.model_digest == trace_layout::kUnknownDigest || b.meta.model_digest == trace_layout::kUnknownDigest)
    return "";  // an external step's weights may be unknown: diff_traces notes it
  std::map<std::string, uint64_t> db;
  for (size_t i = 0; i < b.meta.tensor_names.size() && i < b.meta.tensor_digests.size(); ++i)
    db[b.meta.tensor_names[i]] = b.meta.tensor_digests[i];
  std::string first;
  for (size_t i = 0; i < a.meta.tensor_names.size() && i < a.meta.tensor_digests.size(); ++i) {
    auto it = db.find(a.meta.tensor_names[i]);
    if (it == db.end()) {
      first = fmt::format("weight '{}' only in A", a.meta.tensor_names[i]);
      break;
    }
    if (it->second != a.meta.tensor_digests[i]) {
      first = fmt::format("first differing weight '{}'", a.meta.tensor_names[i]);
      break;
    }
  }
  if (first.empty()) first = "the weight lists differ";
  return fmt::format("different models: {} has model_digest {}, {} has {} ({})", a.r.path(),
                     a.meta.model_digest, b.r.path(), b.meta.model_digest, first);
}

// The two steps must hold the same batch: sequence count, lengths and tokens.
void check_batches(const Side& a, const Side& b) {
  const auto& la = a.step.seq_lengths;
  const auto& lb = b.step.seq_lengths;
  if (la.size() != lb.size())
    throw InputError(
        fmt::format("traces hold different batches: {} step {} has {} sequences, {} step {} has {}",
                    a.r.path(), a.step.index, la.size(), b.r.path(), b.step.index, lb.size()));
  for (size_t s = 0; s < la.size(); ++s) {
    const std::vector<int32_t> ta = a.r.tokens(a.step.index, int(s));
    const std::vector<int32_t> tb = b.r.tokens(b.step.index, int(s));
    const size_t n = std::min(ta.size(), tb.size());
    for (size_t t = 0; t < n; ++t)
      if (ta[t] != tb[t])
        throw InputError(
            fmt::format("traces hold different tokens: sequence {} differs at position {} (token {} in "
                        "{}, {} in {})",
                        s, t, ta[t], a.r.path(), tb[t], b.r.path()));
    if (ta.size() != tb.size())
      throw InputError(
          fmt::format("traces hold different tokens: sequence {} has {} tokens in {} and {} in {} "
                      "(first differing position {})",
                      s, ta.size(), a.r.path(), tb.size(), b.r.path(), n));
  }
}

// Monotonic integer image of a float's bit pattern: adjacent floats differ by 1.
int64_t ordered_key(float x) {
  int32_t i;
  std::memcpy(&i, &x, 4);
  return i < 0 ? int64_t(INT32_MIN) - i : int64_t(i);
}

// Sums kept per tensor while the sequences are compared; rel_l2 is formed at the end.
struct Norms {
  double sum_sq_a = 0, sum_sq_d = 0;
};

// Element comparison of two full tensors of one sequence into `td`. Returns the per-row squared
// difference (what attribution weighs), or nothing when the shapes differ.
std::optional<std::vector<double>> compare_full(const TensorCopy& a, const TensorCopy& b, TensorDiff& td,
                                                Norms& nm) {
  if (a.shape != b.shape || a.dtype != b.dtype) return std::nullopt;
  const int64_t rows = a.shape.empty() ? 1 : a.shape[0];
  int64_t n = 1;
  for (int64_t d : a.shape) n *= d;
  const int64_t row_elems = rows > 0 ? n / rows : 0;
  std::vector<double> row_sq(size_t(std::max<int64_t>(rows, 0)), 0.0);
  if (a.dtype == DType::i32) {
    if (int64_t(a.i.size()) != n || int64_t(b.i.size()) != n) return std::nullopt;
    for (int64_t e = 0; e < n; ++e) {
      const double va = a.i[e], d = double(b.i[e]) - va;
      nm.sum_sq_a += va * va;
      if (d == 0) continue;
      nm.sum_sq_d += d * d;
      row_sq[e / row_elems] += d * d;
      td.max_abs = std::max(td.max_abs, std::fabs(d));
      td.max_ulp = std::max(td.max_ulp, int64_t(std::fabs(d)));
    }
    return row_sq;
  }
  if (int64_t(a.f.size()) != n || int64_t(b.f.size()) != n) return std::nullopt;
  // bf16 values sit in the upper 16 bits of the fp32 pattern, so their fp32 key distance is an exact
  // multiple of 2^16.
  const int64_t ulp_unit = a.dtype == DType::bf16 ? 65536 : 1;
  for (int64_t e = 0; e < n; ++e) {
    const float fa = a.f[e], fb = b.f[e];
    if (std::isfinite(fa)) nm.sum_sq_a += double(fa) * fa;
    if (std::memcmp(&fa, &fb, 4) == 0) continue;
    if (!std::isfinite(fa) || !std::isfinite(fb)) {
      ++td.nonfinite_differing;
      continue;
    }
    const double d = double(fb) - double(fa);
    nm.sum_sq_d += d * d;
    row_sq[e / row_elems] += d * d;
    td.max_abs = std::max(td.max_abs, std::fabs(d));
    td.max_ulp = std::max<int64_t>(td.max_ulp, std::llabs(ordered_key(fa) - ordered_key(fb)) / ulp_unit);
  }
  return row_sq;
}

// The selections of one layer and decision kind, all sequences concatenated.
struct SetRows {
  std::vector<std::vector<int32_t>> a, b;
  std::vector<float> ma, mb;
  std::vector<std::pair<int, int64_t>> where;  // (sequence, position)

  // Rows [0, T) of both sides. An external step may hold no margins (empty): its side's margin reads
  // NaN, so only the other side's margin can make a flip a tie.
  void add(int seq, int64_t T, const std::vector<int32_t>& ids_a, int ka, const std::vector<float>& marg_a,
           const std::vector<int32_t>& ids_b, int kb, const std::vector<float>& marg_b) {
    const auto margin = [](const std::vector<float>& m, int64_t t) {
      return m.empty() ? std::numeric_limits<float>::quiet_NaN() : m[size_t(t)];
    };
    for (int64_t t = 0; t < T; ++t) {
      a.push_back(valid_ids(ids_a.data() + t * ka, ka));
      b.push_back(valid_ids(ids_b.data() + t * kb, kb));
      ma.push_back(margin(marg_a, t));
      mb.push_back(margin(marg_b, t));
      where.emplace_back(seq, t);
    }
  }

  // The default rule's threshold over both traces (model/decision_sets.h); 0 when no margin is finite.
  double threshold(const DiffOptions& opt, double factor) const {
    if (opt.tie_threshold >= 0) return opt.tie_threshold;
    return relative_tie_threshold({&ma, &mb}, factor).value_or(0);
  }

  bool tie(size_t i, double thr) const { return is_tie_flip(ma[i], mb[i], thr); }
};

void max_abs_into(const std::vector<float>& a, const std::vector<float>& b, double& m) {
  const size_t n = std::min(a.size(), b.size());
  for (size_t i = 0; i < n; ++i) {
    const double d = std::fabs(double(a[i]) - double(b[i]));
    if (!(d <= m)) m = d;  // NaN propagates: a NaN in either trace is worth seeing
  }
}

std::string layer_name(int layer) {
  return layer < 0 ? std::string("model") : fmt::format("layer {}", layer);
}

// ---- the stages of diff_traces: one per decision kind ------------------------------------------------

// The two steps every stage reads.
struct Steps {
  Side& A;
  Side& B;
  int sa, sb;  // step indices in A and B
  int S;       // sequences (the same batch in both)
};

// Per (sequence, layer): the ffn.hc_post rows whose digests differ and, where both traces hold the
// tensor in full, their squared difference; what attribution weighs.
struct LayerOutputs {
  std::map<std::pair<int, int>, std::vector<char>> diff;
  std::map<std::pair<int, int>, std::vector<double>> mass;
};

// Per sequence, the positions of one layer whose selections (indexer and routing) agree.
using Agreement = std::vector<std::vector<char>>;

// Per sequence, one layer's unmatched records of one stage; merged in sequence order.
using SeqNotes = std::vector<std::vector<std::string>>;

// Tensors: digests row by row, full tensors element by element, the first divergence.
LayerOutputs diff_tensors(const Steps& st, DiffReport& rep) {
  Side& A = st.A;
  Side& B = st.B;
  const int sa = st.sa, sb = st.sb, S = st.S;
  LayerOutputs out;
  std::map<Key, size_t> tensor_index;  // into rep.tensors
  std::vector<Norms> norms;
  std::map<Key, std::vector<bool>> full_everywhere;  // per tensor: full in each sequence compared
  for (int s = 0; s < S; ++s) {
    const DigestTable da = A.r.digests(sa, s);
    const DigestTable db = B.r.digests(sb, s);
    std::map<Key, size_t> b_records;
    for (size_t i = 0; i < db.records.size(); ++i) b_records[{db.records[i].layer, db.records[i].name}] = i;
    std::set<std::pair<std::string, int>> full_a, full_b;
    for (const auto& f : A.r.full_tensors(sa, s)) full_a.insert(f);
    for (const auto& f : B.r.full_tensors(sb, s)) full_b.insert(f);
    std::vector<bool> b_matched(db.records.size(), false);

    for (const DigestRecord& ra : da.records) {
      const Key key{ra.layer, ra.name};
      auto [ti, added] = tensor_index.try_emplace(key, rep.tensors.size());
      if (added) {
        TensorDiff td;
        td.name = ra.name;
        td.layer = ra.layer;
        rep.tensors.push_back(td);
        norms.emplace_back();
      }
      TensorDiff& td = rep.tensors[ti->second];
      auto it = b_records.find(key);
      if (it == b_records.end()) {
        rep.unmatched.push_back(fmt::format("seq {} {} {}: only in A", s, layer_name(ra.layer), ra.name));
        continue;
      }
      b_matched[it->second] = true;
      const DigestRecord& rb = db.records[it->second];
      if (ra.rows != rb.rows)
        rep.unmatched.push_back(fmt::format("seq {} {} {}: {} rows in A, {} in B", s, layer_name(ra.layer),
                                            ra.name, ra.rows, rb.rows));
      const int64_t rows = std::min(ra.rows, rb.rows);
      std::vector<char> differing(size_t(std::max<int64_t>(rows, 0)), 0);
      for (int64_t row = 0; row < rows; ++row) {
        if (da.values[size_t(ra.first + row)] == db.values[size_t(rb.first + row)]) continue;
        differing[size_t(row)] = 1;
        ++td.rows_differing;
        if (td.first_digest_row < 0) {
          td.first_digest_seq = s;
          td.first_digest_row = row;
        }
        if (!rep.first_divergence) rep.first_divergence = DiffReport::First{s, ra.layer, ra.name, row};
      }
      td.rows += rows;

      const bool full = full_a.count({ra.name, ra.layer}) && full_b.count({ra.name, ra.layer});
      full_everywhere[key].push_back(full);
      std::optional<std::vector<double>> mass;
      if (full) {
        const auto fa = A.r.tensor(sa, s, ra.layer, ra.name);
        const auto fb = B.r.tensor(sb, s, ra.layer, ra.name);
        if (fa && fb) mass = compare_full(*fa, *fb, td, norms[ti->second]);
        if (!mass) {
          rep.unmatched.push_back(fmt::format("seq {} {} {}: full tensors of different shapes", s,
                                              layer_name(ra.layer), ra.name));
          full_everywhere[key].back() = false;
        }
      }
      if (ra.name == "ffn.hc_post") {
        out.diff[{s, ra.layer}] = std::move(differing);
        if (mass) out.mass[{s, ra.layer}] = std::move(*mass);
      }
    }
    for (size_t i = 0; i < db.records.size(); ++i)
      if (!b_matched[i])
        rep.unmatched.push_back(
            fmt::format("seq {} {} {}: only in B", s, layer_name(db.records[i].layer), db.records[i].name));
  }
  for (size_t i = 0; i < rep.tensors.size(); ++i) {
    TensorDiff& td = rep.tensors[i];
    const auto& fe = full_everywhere[{td.layer, td.name}];
    td.full = !fe.empty() && std::all_of(fe.begin(), fe.end(), [](bool f) { return f; });
    td.rel_l2 = rel_l2_of(norms[i].sum_sq_d, norms[i].sum_sq_a);
  }

  return out;
}

// Decision rows of two steps compare when equal in number, or one short on an external step's side
// (the engines report no row for the last token); then the rows both hold are compared.
bool comparable_rows(int64_t Ta, int64_t Tb, const Steps& st) {
  if (Ta == Tb) return true;
  return (Ta == Tb - 1 && st.A.step.external()) || (Tb == Ta - 1 && st.B.step.external());
}

// Indexer (C4 layers): overlap, flips; positions whose selections differ leave `agree`.
void diff_indexer(const Steps& st, int layer, const DiffOptions& opt, double factor, LayerDiff& L,
                  Agreement& agree, SeqNotes& notes) {
  SetRows idx;
  for (int s = 0; s < st.S; ++s) {
    const auto ia = st.A.r.indexer(st.sa, s, layer);
    const auto ib = st.B.r.indexer(st.sb, s, layer);
    if (ia && ib) {
      if (!comparable_rows(ia->T, ib->T, st) || ia->k != ib->k) {
        notes[size_t(s)].push_back(fmt::format("seq {} layer {} indexer: [{}, {}] in A, [{}, {}] in B", s, layer,
                                               ia->T, ia->k, ib->T, ib->k));
      } else {
        idx.add(s, std::min(ia->T, ib->T), ia->ids, ia->k, ia->margin, ib->ids, ib->k, ib->margin);
      }
    } else if (ia || ib) {
      notes[size_t(s)].push_back(
          fmt::format("seq {} layer {} indexer decisions: only in {}", s, layer, ia ? "A" : "B"));
    }
  }
  if (idx.a.empty()) return;
  L.has_indexer = true;
  L.indexer_tie_threshold = idx.threshold(opt, factor);
  double sum = 0, mn = 1;
  for (size_t i = 0; i < idx.a.size(); ++i) {
    const auto& a = idx.a[i];
    const auto& b = idx.b[i];
    const double ov = set_overlap(a, b);
    sum += ov;
    mn = std::min(mn, ov);
    if (a == b) continue;
    ++L.indexer_rows_differing;
    agree[size_t(idx.where[i].first)][size_t(idx.where[i].second)] = 0;
    ++(idx.tie(i, L.indexer_tie_threshold) ? L.indexer_tie_flips : L.indexer_confident_flips);
  }
  L.indexer_overlap_mean = sum / double(idx.a.size());
  L.indexer_overlap_min = mn;
}

// Routing: exact agreement, Jaccard, flips, hash layers that disagree; positions whose experts
// differ leave `agree`.
void diff_routing(const Steps& st, int layer, const DiffOptions& opt, double factor, LayerDiff& L,
                  Agreement& agree, SeqNotes& notes) {
  SetRows rt;
  for (int s = 0; s < st.S; ++s) {
    const auto ra = st.A.r.routing(st.sa, s, layer);
    const auto rb = st.B.r.routing(st.sb, s, layer);
    if (ra && rb) {
      if (ra->hashed || rb->hashed) L.hashed = true;
      if (ra->hashed != rb->hashed) {
        L.hash_disagreement = true;
        notes[size_t(s)].push_back(
            fmt::format("seq {} layer {} routing: hashed in {} only", s, layer, ra->hashed ? "A" : "B"));
      }
      if (!comparable_rows(ra->T, rb->T, st) || ra->k != rb->k) {
        notes[size_t(s)].push_back(fmt::format("seq {} layer {} routing: [{}, {}] in A, [{}, {}] in B", s, layer,
                                               ra->T, ra->k, rb->T, rb->k));
      } else {
        rt.add(s, std::min(ra->T, rb->T), ra->ids, ra->k, ra->margin, rb->ids, rb->k, rb->margin);
      }
    } else if (ra || rb) {
      notes[size_t(s)].push_back(
          fmt::format("seq {} layer {} routing decisions: only in {}", s, layer, ra ? "A" : "B"));
    }
  }
  if (rt.a.empty()) return;
  L.routing_tie_threshold = rt.threshold(opt, factor);
  double jac = 0;
  int64_t exact = 0;
  for (size_t i = 0; i < rt.a.size(); ++i) {
    const auto& a = rt.a[i];
    const auto& b = rt.b[i];
    jac += set_jaccard(a, b);
    if (a == b) {
      ++exact;
      continue;
    }
    ++L.routing_rows_differing;
    agree[size_t(rt.where[i].first)][size_t(rt.where[i].second)] = 0;
    ++(rt.tie(i, L.routing_tie_threshold) ? L.routing_tie_flips : L.routing_confident_flips);
  }
  L.routing_exact = double(exact) / double(rt.a.size());
  L.routing_jaccard = jac / double(rt.a.size());
  if (L.hashed && L.routing_rows_differing > 0) L.hash_disagreement = true;
}

// mHC: max |A − B| of the mixing weights over both sublayers.
void diff_mhc(const Steps& st, int layer, LayerDiff& L, SeqNotes& notes) {
  if (st.A.step.external() || st.B.step.external()) return;  // engines report no mHC mixes
  for (int s = 0; s < st.S; ++s) {
    for (Sublayer sub : {Sublayer::attn, Sublayer::ffn}) {
      const auto ma = st.A.r.mhc(st.sa, s, layer, sub);
      const auto mb = st.B.r.mhc(st.sb, s, layer, sub);
      if (ma && mb) {
        max_abs_into(ma->pre, mb->pre, L.mhc_pre_max_abs);
        max_abs_into(ma->post, mb->post, L.mhc_post_max_abs);
        max_abs_into(ma->comb, mb->comb, L.mhc_comb_max_abs);
      } else if (ma || mb) {
        notes[size_t(s)].push_back(
            fmt::format("seq {} layer {} mhc {}: only in {}", s, layer, to_string(sub), ma ? "A" : "B"));
      }
    }
  }
}

// Attribution: weigh by the squared row difference of ffn.hc_post when every sequence holds it in
// full, else count the digest-differing rows.
void attribute(int S, int layer, const LayerOutputs& out, const Agreement& agree, LayerDiff& L) {
  bool have_mass = true, have_rows = false;
  for (int s = 0; s < S; ++s) {
    if (out.diff.count({s, layer})) have_rows = true;
    if (!out.mass.count({s, layer})) have_mass = false;
  }
  if (!have_rows) return;
  double total = 0, same = 0;
  for (int s = 0; s < S; ++s) {
    auto it = out.diff.find({s, layer});
    if (it == out.diff.end()) continue;
    const auto& ag = agree[size_t(s)];
    const std::vector<double>* mass = have_mass ? &out.mass.at({s, layer}) : nullptr;
    for (size_t t = 0; t < it->second.size(); ++t) {
      if (it->second[t]) ++L.rows_out_differing;
      const double w = mass ? (*mass)[t] : (it->second[t] ? 1.0 : 0.0);
      total += w;
      if (t < ag.size() && ag[t]) same += w;
    }
  }
  L.same_selection_share = total > 0 ? same / total : 0.0;
}

// Layers: the indexer, routing and mHC stages, then attribution. A layer's unmatched records are
// listed by sequence, in the order indexer, routing, mHC.
void diff_layers(const Steps& st, const DiffOptions& opt, const LayerOutputs& out, DiffReport& rep) {
  const int S = st.S;
  const double factor = rep.tie_threshold;
  for (int layer = 0; layer < st.A.cfg.num_hidden_layers; ++layer) {
    LayerDiff L;
    L.layer = layer;
    L.compress_ratio = st.A.cfg.ratio(layer);
    L.hashed = st.A.cfg.is_hash_layer(layer);
    Agreement agree(static_cast<size_t>(S));
    for (int s = 0; s < S; ++s) agree[size_t(s)].assign(size_t(st.A.step.seq_lengths[size_t(s)]), 1);
    L.rows = 0;
    for (int s = 0; s < S; ++s) L.rows += st.A.step.seq_lengths[size_t(s)];

    SeqNotes idx_notes(static_cast<size_t>(S)), rt_notes(static_cast<size_t>(S)),
        mhc_notes(static_cast<size_t>(S));
    diff_indexer(st, layer, opt, factor, L, agree, idx_notes);
    diff_routing(st, layer, opt, factor, L, agree, rt_notes);
    diff_mhc(st, layer, L, mhc_notes);
    for (int s = 0; s < S; ++s)
      for (const SeqNotes* n : {&idx_notes, &rt_notes, &mhc_notes})
        for (const std::string& m : (*n)[size_t(s)]) rep.unmatched.push_back(m);

    attribute(S, layer, out, agree, L);
    rep.layers.push_back(L);
  }
}

// Tokens: log-prob mismatch and importance ratios.
void diff_tokens(const Steps& st, DiffReport& rep) {
  double sum_k1 = 0, sum_k3 = 0, sum_r = 0, sum_abs = 0;
  int64_t outside = 0;
  for (int s = 0; s < st.S; ++s) {
    if (!st.A.r.has_logprobs(st.sa, s) || !st.B.r.has_logprobs(st.sb, s)) {
      rep.unmatched.push_back(fmt::format("seq {} logprobs: only in {}", s,
                                          st.A.r.has_logprobs(st.sa, s) ? "A"
                                          : st.B.r.has_logprobs(st.sb, s) ? "B"
                                                                          : "neither"));
      continue;
    }
    const std::vector<float> la = st.A.r.logprobs(st.sa, s);
    const std::vector<float> lb = st.B.r.logprobs(st.sb, s);
    if (la.size() != lb.size())
      rep.unmatched.push_back(fmt::format("seq {} logprobs: {} in A, {} in B", s, la.size(), lb.size()));
    for (size_t t = 0; t < std::min(la.size(), lb.size()); ++t) {
      TokenDiff tk;
      tk.seq = s;
      tk.position = int64_t(t);
      tk.logprob_a = la[t];
      tk.logprob_b = lb[t];
      const double log_r = tk.logprob_b - tk.logprob_a;
      tk.abs_diff = std::fabs(log_r);
      tk.ratio = num::exp_f64(log_r);
      const bool first = rep.tokens.empty();
      rep.ratio_max = first ? tk.ratio : std::max(rep.ratio_max, tk.ratio);
      rep.ratio_min = first ? tk.ratio : std::min(rep.ratio_min, tk.ratio);
      rep.logprob_abs_max = std::max(rep.logprob_abs_max, tk.abs_diff);
      sum_k1 += -log_r;
      sum_k3 += (tk.ratio - 1.0) - log_r;
      sum_r += tk.ratio;
      sum_abs += tk.abs_diff;
      if (tk.ratio < 0.8 || tk.ratio > 1.25) ++outside;
      rep.tokens.push_back(tk);
    }
  }
  if (!rep.tokens.empty()) {
    const double n = double(rep.tokens.size());
    rep.k1 = sum_k1 / n;
    rep.k3 = sum_k3 / n;
    rep.ratio_mean = sum_r / n;
    rep.ratio_outside = double(outside) / n;
    rep.logprob_abs_mean = sum_abs / n;
  }
}

// Training steps: the gradient diff when both are, a note when only one is.
void diff_training(const Side& a, const Side& b, DiffReport& rep) {
  const std::optional<TrainingRecord> ta = a.r.training(a.step.index);
  const std::optional<TrainingRecord> tb = b.r.training(b.step.index);
  if (ta && tb) {
    try {
      rep.training = training_gradient_diff(*ta, *tb);
    } catch (const InputError& e) {
      throw InputError(fmt::format("{} step {} (A) and {} step {} (B): {}", a.r.path(), a.step.index,
                                   b.r.path(), b.step.index, e.what()));
    }
  } else if (ta || tb) {
    const Side& t = ta ? a : b;
    const Side& o = ta ? b : a;
    rep.training_note = fmt::format(
        "only {} ({} step {}) is a training step; {} ({} step {}) is a step of kind '{}': gradients are not "
        "compared",
        t.label, t.r.path(), t.step.index, o.label, o.r.path(), o.step.index, o.step.kind);
  }
}

}  // namespace

DiffReport diff_traces(const std::string& path_a, const std::string& path_b, const DiffOptions& opt) {
  const TraceReader a = TraceReader::open(path_a);
  const TraceReader b = TraceReader::open(path_b);
  return diff_traces(a, b, opt);
}

DiffReport diff_traces(const TraceReader& ra, const TraceReader& rb, const DiffOptions& opt) {
  const std::string &path_a = ra.path(), &path_b = rb.path();
  Side A = open_side(ra, opt.step_a, "A");
  Side B = open_side(rb, opt.step_b, "B");

  DiffReport rep;
  rep.trace_a = path_a;
  rep.trace_b = path_b;
  rep.step_a = opt.step_a;
  rep.step_b = opt.step_b;
  rep.profile_a = A.step.profile;
  rep.profile_b = B.step.profile;
  // The steps' recorded profiles, when this build knows them (an engine's name may not be a profile).
  const std::optional<NumericsProfile> pa = known_recorded_profile(A.step, path_a),
                                       pb = known_recorded_profile(B.step, path_b);
  if (pa && pb) {
    rep.profile_sites = profile_diff(*pa, *pb);
    rep.profile_sites_known = true;
  }
  rep.model_digest_a = A.meta.model_digest;
  rep.model_digest_b = B.meta.model_digest;
  if (const std::string why = model_difference(A, B); !why.empty()) {
    if (!opt.allow_model_mismatch) throw InputError(why + "; allow a model mismatch to compare them anyway");
    rep.model_mismatch = true;
  }
  check_batches(A, B);
  const int S = int(A.step.seq_lengths.size());
  rep.seq_count = S;
  if (opt.tie_threshold >= 0) {
    rep.tie_rule = "absolute";
    rep.tie_threshold = opt.tie_threshold;
  } else {
    rep.tie_rule = "relative";
    rep.tie_threshold = std::max(recorded_tie_factor(A.step, path_a), recorded_tie_factor(B.step, path_b));
  }
  diff_training(A, B, rep);
  Steps st{A, B, A.step.index, B.step.index, S};
  for (const Side* s : {&A, &B}) {
    if (s->meta.model_digest == trace_layout::kUnknownDigest)
      rep.notes.push_back(fmt::format("{} ({}) does not name its weights: the models could not be checked to be the "
                                      "same",
                                      s->label, s->r.path()));
    if (s->step.external())
      rep.notes.push_back(fmt::format("{} step {} is an external step (engine '{}'): it holds no digests, so "
                                      "decisions and log-probs are compared, tensors are not",
                                      s->label, s->step.index, s->step.engine));
  }
  const bool digests = !A.step.external() && !B.step.external();
  const LayerOutputs out = digests ? diff_tensors(st, rep) : LayerOutputs{};
  diff_layers(st, opt, out, rep);
  diff_tokens(st, rep);
  return rep;
}

}  // namespace dsv4
