// The diff report's formatters (replay/diff.h): JSON (docs/DIFF_JSON.md), the text table and CSV.
#include "replay/diff.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "capture/errors.h"

namespace dsv4 {

// ---- JSON (docs/DIFF_JSON.md) ------------------------------------------------------------------------

namespace {

nlohmann::ordered_json aggregate_json(const GradAggregate& g, bool with_kind) {
  nlohmann::ordered_json j;
  if (with_kind) j["kind"] = g.kind;
  j["layer"] = g.layer;
  j["params"] = g.params;
  j["full_params"] = g.full_params;
  j["params_differing"] = g.params_differing;
  j["rows"] = g.rows;
  j["rows_differing"] = g.rows_differing;
  j["rel_l2"] = g.rel_l2;
  j["cosine"] = g.cosine;
  j["max_abs"] = g.max_abs;
  j["norm_a"] = g.norm_a;
  j["norm_b"] = g.norm_b;
  j["nonfinite_differing"] = g.nonfinite_differing;
  return j;
}

nlohmann::ordered_json training_json(const TrainingDiff& t) {
  using J = nlohmann::ordered_json;
  J j;
  j["optimizer_step_a"] = t.optimizer_step_a;
  j["optimizer_step_b"] = t.optimizer_step_b;
  j["params_trained"] = t.params_trained;
  j["params_full"] = t.params_full;
  j["params_differing"] = t.params_differing;
  J metrics = J::array();
  for (const MetricDiff& m : t.metrics) metrics.push_back({{"name", m.name}, {"a", m.a}, {"b", m.b}});
  j["metrics"] = std::move(metrics);
  J settings = J::array();
  for (const SettingDiff& s : t.settings) settings.push_back({{"key", s.key}, {"a", s.a}, {"b", s.b}});
  j["settings"] = std::move(settings);
  j["kinds"] = t.kinds;
  J params = J::array();
  for (const ParamGradDiff& p : t.params)
    params.push_back({{"name", p.name},
                      {"kind", p.site.kind},
                      {"layer", p.site.layer},
                      {"expert", p.site.expert},
                      {"rows", p.rows},
                      {"row_elems", p.row_elems},
                      {"grad_a", p.grad_a},
                      {"grad_b", p.grad_b},
                      {"full", p.full},
                      {"rows_differing", p.rows_differing},
                      {"weight_rows_differing", p.weight_rows_differing},
                      {"rel_l2", p.rel_l2},
                      {"cosine", p.cosine},
                      {"max_abs", p.max_abs},
                      {"norm_a", p.norm_a},
                      {"norm_b", p.norm_b},
                      {"nonfinite_differing", p.nonfinite_differing}});
  j["params"] = std::move(params);
  J cells = J::array();
  for (const GradAggregate& c : t.cells) cells.push_back(aggregate_json(c, true));
  j["cells"] = std::move(cells);
  J layers = J::array();
  for (const GradAggregate& l : t.layers) layers.push_back(aggregate_json(l, false));
  j["layers"] = std::move(layers);
  j["notes"] = t.notes;
  return j;
}

}  // namespace

std::string diff_to_json(const DiffReport& r) {
  using J = nlohmann::ordered_json;
  J j;
  j["format"] = "dsv4-diff";
  j["version"] = 1;
  j["trace_a"] = {
      {"path", r.trace_a}, {"step", r.step_a}, {"profile", r.profile_a}, {"model_digest", r.model_digest_a}};
  j["trace_b"] = {
      {"path", r.trace_b}, {"step", r.step_b}, {"profile", r.profile_b}, {"model_digest", r.model_digest_b}};
  j["seq_count"] = r.seq_count;
  j["model_mismatch"] = r.model_mismatch;
  if (r.profile_sites_known) {
    J sites = J::array();
    for (const auto& d : r.profile_sites) sites.push_back({{"site", d.key}, {"a", d.a}, {"b", d.b}});
    j["profile_sites"] = std::move(sites);
  } else {
    j["profile_sites"] = nullptr;
  }
  j["tie"] = {{"rule", r.tie_rule}, {"threshold", r.tie_threshold}};
  if (r.first_divergence) {
    const auto& f = *r.first_divergence;
    j["first_divergence"] = {{"seq", f.seq}, {"layer", f.layer}, {"tensor", f.tensor}, {"row", f.row}};
  } else {
    j["first_divergence"] = nullptr;
  }
  j["logprobs"] = {{"tokens", r.tokens.size()},
                   {"abs_mean", r.logprob_abs_mean},
                   {"abs_max", r.logprob_abs_max},
                   {"k1", r.k1},
                   {"k3", r.k3},
                   {"ratio_mean", r.ratio_mean},
                   {"ratio_min", r.ratio_min},
                   {"ratio_max", r.ratio_max},
                   {"ratio_outside", r.ratio_outside}};
  J layers = J::array();
  for (const LayerDiff& L : r.layers) {
    J l;
    l["layer"] = L.layer;
    l["compress_ratio"] = L.compress_ratio;
    l["rows"] = L.rows;
    if (L.has_indexer) {
      l["indexer"] = {
          {"overlap_mean", L.indexer_overlap_mean},       {"overlap_min", L.indexer_overlap_min},
          {"rows_differing", L.indexer_rows_differing},   {"tie_flips", L.indexer_tie_flips},
          {"confident_flips", L.indexer_confident_flips}, {"tie_threshold", L.indexer_tie_threshold}};
    } else {
      l["indexer"] = nullptr;
    }
    l["routing"] = {{"hashed", L.hashed},
                    {"exact", L.routing_exact},
                    {"jaccard", L.routing_jaccard},
                    {"rows_differing", L.routing_rows_differing},
                    {"tie_flips", L.routing_tie_flips},
                    {"confident_flips", L.routing_confident_flips},
                    {"tie_threshold", L.routing_tie_threshold},
                    {"hash_disagreement", L.hash_disagreement}};
    l["mhc"] = {{"pre_max_abs", L.mhc_pre_max_abs},
                {"post_max_abs", L.mhc_post_max_abs},
                {"comb_max_abs", L.mhc_comb_max_abs}};
    l["attribution"] = {{"rows_out_differing", L.rows_out_differing},
                        {"same_selection_share", L.same_selection_share}};
    layers.push_back(std::move(l));
  }
  j["layers"] = std::move(layers);
  J tensors = J::array();
  for (const TensorDiff& t : r.tensors) {
    tensors.push_back({{"name", t.name},
                       {"layer", t.layer},
                       {"rows", t.rows},
                       {"rows_differing", t.rows_differing},
                       {"first_digest_seq", t.first_digest_seq},
                       {"first_digest_row", t.first_digest_row},
                       {"full", t.full},
                       {"rel_l2", t.rel_l2},
                       {"max_abs", t.max_abs},
                       {"max_ulp", t.max_ulp},
                       {"nonfinite_differing", t.nonfinite_differing}});
  }
  j["tensors"] = std::move(tensors);
  J tokens = J::array();
  for (const TokenDiff& t : r.tokens) {
    tokens.push_back({{"seq", t.seq},
                      {"position", t.position},
                      {"logprob_a", t.logprob_a},
                      {"logprob_b", t.logprob_b},
                      {"abs_diff", t.abs_diff},
                      {"ratio", t.ratio}});
  }
  j["tokens"] = std::move(tokens);
  j["unmatched"] = r.unmatched;
  j["notes"] = r.notes;
  j["training"] = r.training ? training_json(*r.training) : J(nullptr);
  j["training_note"] = r.training_note;
  return j.dump(2) + "\n";
}

// ---- text table ------------------------------------------------------------------------------------

namespace {

std::string layer_name(int layer) {
  return layer < 0 ? std::string("model") : fmt::format("layer {}", layer);
}
std::string fmt_share(double x) {
  return fmt::format("{:.4f}", x);
}
std::string fmt_sci(double x) {
  return std::isfinite(x) ? fmt::format("{:.3g}", x) : fmt::format("{}", x);
}

// The worst tensors first: most digest rows differing (as a share), then largest rel-L2.
std::vector<const TensorDiff*> worst_tensors(const DiffReport& r, size_t n) {
  std::vector<const TensorDiff*> v;
  for (const auto& t : r.tensors)
    if (t.rows_differing > 0 || t.rel_l2 > 0) v.push_back(&t);
  auto share = [](const TensorDiff* t) {
    return t->rows > 0 ? double(t->rows_differing) / double(t->rows) : 0.0;
  };
  std::stable_sort(v.begin(), v.end(), [&](const TensorDiff* x, const TensorDiff* y) {
    if (share(x) != share(y)) return share(x) > share(y);
    return x->rel_l2 > y->rel_l2;
  });
  if (v.size() > n) v.resize(n);
  return v;
}

// Unknown numbers (no full gradients, some row differs) print as "?".
std::string fmt_known(double x) {
  return std::isnan(x) ? std::string("?") : fmt_sci(x);
}

std::string param_layer(int layer) {
  return layer < 0 ? std::string("model") : std::to_string(layer);
}

// The parameters whose gradients differ, largest rel-L2 first; those whose rel-L2 is unknown (no
// full gradients) after them, most differing rows (as a share) first.
std::vector<const ParamGradDiff*> worst_params(const TrainingDiff& t, size_t n) {
  std::vector<const ParamGradDiff*> v;
  for (const auto& p : t.params)
    if (p.grad_a && p.grad_b && p.rows_differing > 0) v.push_back(&p);
  auto share = [](const ParamGradDiff* p) {
    return p->rows > 0 ? double(p->rows_differing) / double(p->rows) : 0.0;
  };
  std::stable_sort(v.begin(), v.end(), [&](const ParamGradDiff* x, const ParamGradDiff* y) {
    const bool kx = !std::isnan(x->rel_l2), ky = !std::isnan(y->rel_l2);
    if (kx != ky) return kx;
    if (kx && x->rel_l2 != y->rel_l2) return x->rel_l2 > y->rel_l2;
    return share(x) > share(y);
  });
  if (v.size() > n) v.resize(n);
  return v;
}

std::string training_table(const TrainingDiff& t) {
  std::string o = "\ntraining steps: the gradients of B against A\n";
  if (t.optimizer_step_a != t.optimizer_step_b)
    o += fmt::format("optimizer steps before: {} in A, {} in B\n", t.optimizer_step_a, t.optimizer_step_b);
  for (const SettingDiff& s : t.settings) o += fmt::format("setting {}: {} in A, {} in B\n", s.key, s.a, s.b);
  o += fmt::format("  {:<18} {:>13} {:>13} {:>11}\n", "metric", "A", "B", "B - A");
  for (const MetricDiff& m : t.metrics)
    o += fmt::format("  {:<18} {:>13} {:>13} {:>11}\n", m.name, fmt::format("{:.6g}", m.a),
                     fmt::format("{:.6g}", m.b), fmt_known(m.b - m.a));

  o += fmt::format("\ngradients: {} parameters trained in both steps, {} held in full by both; ",
                   t.params_trained, t.params_full);
  if (t.params_differing == 0) {
    o += "every gradient row agrees\n";
  } else {
    int64_t rows = 0, differing = 0;
    for (const auto& p : t.params)
      if (p.grad_a && p.grad_b) {
        rows += p.rows;
        differing += p.rows_differing;
      }
    o += fmt::format("{} differ ({} of {} rows)\n", t.params_differing, differing, rows);
    const auto worst = worst_params(t, 12);
    o += fmt::format("  {:<48} {:>5} {:>10} {:>10} {:>10} {:>13}\n", "parameter (largest rel_l2 first)",
                     "layer", "rel_l2", "cosine", "max_abs", "rows differ");
    for (const ParamGradDiff* p : worst)
      o += fmt::format("  {:<48} {:>5} {:>10} {:>10} {:>10} {:>13}\n", p->name, param_layer(p->site.layer),
                       fmt_known(p->rel_l2), fmt_known(p->cosine), fmt_known(p->max_abs),
                       fmt::format("{}/{}", p->rows_differing, p->rows));
    if (t.params_differing > int(worst.size()))
      o += fmt::format("  ... {} more (--json lists every parameter)\n",
                       t.params_differing - int(worst.size()));
  }
  o += fmt::format("\n  {:>5} {:>7} {:>7} {:>7} {:>15} {:>10} {:>10} {:>10}\n", "layer", "params", "full",
                   "differ", "rows differ", "rel_l2", "cosine", "max_abs");
  for (const GradAggregate& l : t.layers)
    o +=
        fmt::format("  {:>5} {:>7} {:>7} {:>7} {:>15} {:>10} {:>10} {:>10}\n", param_layer(l.layer), l.params,
                    l.full_params, l.params_differing, fmt::format("{}/{}", l.rows_differing, l.rows),
                    fmt_known(l.rel_l2), fmt_known(l.cosine), fmt_known(l.max_abs));
  if (!t.notes.empty()) {
    o += fmt::format("training notes ({}):\n", t.notes.size());
    for (size_t i = 0; i < t.notes.size() && i < 20; ++i) o += "  " + t.notes[i] + "\n";
    if (t.notes.size() > 20) o += fmt::format("  ... {} more\n", t.notes.size() - 20);
  }
  return o;
}

}  // namespace

std::string diff_to_table(const DiffReport& r) {
  std::string o;
  o += fmt::format("A: {} step {} (profile {}, model {})\n", r.trace_a, r.step_a, r.profile_a,
                   r.model_digest_a);
  o += fmt::format("B: {} step {} (profile {}, model {})\n", r.trace_b, r.step_b, r.profile_b,
                   r.model_digest_b);
  o += fmt::format("{} sequence{}", r.seq_count, r.seq_count == 1 ? "" : "s");
  if (r.model_mismatch) o += "; MODEL MISMATCH (different weights)";
  o += "\n";
  if (!r.profile_sites_known)
    o += "profile sites: unknown (a step's profile is not one this build knows)\n";
  else if (r.profile_sites.empty())
    o += "profile sites: the same precision map\n";
  else {
    o += fmt::format("profile sites that differ ({}):\n", r.profile_sites.size());
    for (const auto& d : r.profile_sites) o += fmt::format("  {:<20} {} -> {}\n", d.key, d.a, d.b);
  }
  if (r.tie_rule == "absolute")
    o += fmt::format("tie flips: margin < {} (absolute)\n\n", fmt_sci(r.tie_threshold));
  else
    o += fmt::format("tie flips: margin < {} x median |margin| of the layer\n\n", fmt_sci(r.tie_threshold));

  o += fmt::format(
      "{:>5} {:>5} {:>4} | {:>8} {:>8} {:>6} {:>5} {:>5} | {:>8} {:>8} {:>6} {:>5} {:>5} | {:>9} {:>9} {:>9} "
      "| {:>6} {:>8}\n",
      "layer", "ratio", "hash", "idx.ovl", "idx.min", "diff", "tie", "conf", "rt.exact", "rt.jacc", "diff",
      "tie", "conf", "mhc.pre", "mhc.post", "mhc.comb", "out.df", "same.sel");
  for (const LayerDiff& L : r.layers) {
    const std::string ia = L.has_indexer ? fmt_share(L.indexer_overlap_mean) : "-";
    const std::string im = L.has_indexer ? fmt_share(L.indexer_overlap_min) : "-";
    const std::string id = L.has_indexer ? std::to_string(L.indexer_rows_differing) : "-";
    const std::string it = L.has_indexer ? std::to_string(L.indexer_tie_flips) : "-";
    const std::string ic = L.has_indexer ? std::to_string(L.indexer_confident_flips) : "-";
    o += fmt::format(
        "{:>5} {:>5} {:>4} | {:>8} {:>8} {:>6} {:>5} {:>5} | {:>8} {:>8} {:>6} {:>5} {:>5} | {:>9} {:>9} "
        "{:>9} | {:>6} "
        "{:>8}{}\n",
        L.layer, L.compress_ratio, L.hashed ? "yes" : "", ia, im, id, it, ic, fmt_share(L.routing_exact),
        fmt_share(L.routing_jaccard), L.routing_rows_differing, L.routing_tie_flips,
        L.routing_confident_flips, fmt_sci(L.mhc_pre_max_abs), fmt_sci(L.mhc_post_max_abs),
        fmt_sci(L.mhc_comb_max_abs), L.rows_out_differing, fmt_share(L.same_selection_share),
        L.hash_disagreement ? "  HASH-ROUTING DISAGREES (bug)" : "");
  }

  const auto worst = worst_tensors(r, 12);
  o += "\n";
  if (r.tensors.empty()) {
    o += "tensors: none compared (see the notes)\n";
  } else if (worst.empty()) {
    o += "tensors: every digest row agrees\n";
  } else {
    o += fmt::format("worst tensors ({} of {} differ):\n",
                     std::count_if(r.tensors.begin(), r.tensors.end(),
                                   [](const TensorDiff& t) { return t.rows_differing > 0; }),
                     r.tensors.size());
    o += fmt::format("  {:<22} {:>5} {:>13} {:>11} {:>10} {:>10} {:>10}\n", "tensor", "layer", "rows differ",
                     "first", "rel_l2", "max_abs", "max_ulp");
    for (const TensorDiff* t : worst) {
      const std::string first =
          t->first_digest_row < 0 ? "-" : fmt::format("s{}:{}", t->first_digest_seq, t->first_digest_row);
      o += fmt::format("  {:<22} {:>5} {:>13} {:>11} {:>10} {:>10} {:>10}\n", t->name,
                       t->layer < 0 ? std::string("model") : std::to_string(t->layer),
                       fmt::format("{}/{}", t->rows_differing, t->rows), first,
                       t->full ? fmt_sci(t->rel_l2) : "-", t->full ? fmt_sci(t->max_abs) : "-",
                       t->full ? std::to_string(t->max_ulp) : "-");
    }
  }

  o += fmt::format(
      "\nlog-probs over {} tokens: |d| mean {} max {}; k1 {} k3 {}; ratio mean {} min {} max {}, outside "
      "[0.8, 1.25]: {:.2f}%\n",
      r.tokens.size(), fmt_sci(r.logprob_abs_mean), fmt_sci(r.logprob_abs_max), fmt_sci(r.k1), fmt_sci(r.k3),
      fmt_sci(r.ratio_mean), fmt_sci(r.ratio_min), fmt_sci(r.ratio_max), 100.0 * r.ratio_outside);
  if (r.first_divergence) {
    const auto& f = *r.first_divergence;
    o += fmt::format("first divergence: seq {}, {}, {}, row {}\n", f.seq, layer_name(f.layer), f.tensor,
                     f.row);
  } else if (!r.tensors.empty()) {
    o += "first divergence: none (every digest agrees)\n";
  }
  for (const std::string& n : r.notes) o += "note: " + n + "\n";
  if (!r.unmatched.empty()) {
    o += fmt::format("unmatched ({}):\n", r.unmatched.size());
    for (size_t i = 0; i < r.unmatched.size() && i < 20; ++i) o += "  " + r.unmatched[i] + "\n";
    if (r.unmatched.size() > 20) o += fmt::format("  ... {} more\n", r.unmatched.size() - 20);
  }
  if (r.training) o += training_table(*r.training);
  if (!r.training_note.empty()) o += "\n" + r.training_note + "\n";
  return o;
}

// ---- CSV ------------------------------------------------------------------------------------------

namespace {

// Numbers round-trip (17 significant digits); non-finite values are written as nan/inf/-inf.
std::string num(double x) {
  if (std::isnan(x)) return "nan";
  if (std::isinf(x)) return x > 0 ? "inf" : "-inf";
  return fmt::format("{:.17g}", x);
}

// Tensor names hold no commas or quotes today; quote anyway so a future name cannot break a row.
std::string quoted(const std::string& s) {
  std::string o = "\"";
  for (char c : s) o += c == '"' ? std::string("\"\"") : std::string(1, c);
  return o + "\"";
}

void write_file(const std::filesystem::path& p, const std::string& text) {
  std::ofstream f(p, std::ios::binary);
  f << text;
  f.close();
  if (!f) throw InputError(fmt::format("{}: cannot write", p.string()));
}

}  // namespace

void diff_to_csv(const DiffReport& r, const std::string& dir) {
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec) throw InputError(fmt::format("{}: cannot create directory: {}", dir, ec.message()));
  const std::filesystem::path d(dir);

  std::string l =
      "layer,compress_ratio,rows,has_indexer,indexer_overlap_mean,indexer_overlap_min,indexer_rows_differing,"
      "indexer_tie_flips,indexer_confident_flips,indexer_tie_threshold,hashed,routing_exact,routing_jaccard,"
      "routing_rows_differing,routing_tie_flips,routing_confident_flips,routing_tie_threshold,hash_"
      "disagreement,"
      "mhc_pre_max_abs,mhc_post_max_abs,mhc_comb_max_abs,rows_out_differing,same_selection_share\n";
  for (const LayerDiff& L : r.layers)
    l += fmt::format("{},{},{},{},{},{},{},{},{},{},{},{},{},{},{},{},{},{},{},{},{},{},{}\n", L.layer,
                     L.compress_ratio, L.rows, int(L.has_indexer), num(L.indexer_overlap_mean),
                     num(L.indexer_overlap_min), L.indexer_rows_differing, L.indexer_tie_flips,
                     L.indexer_confident_flips, num(L.indexer_tie_threshold), int(L.hashed),
                     num(L.routing_exact), num(L.routing_jaccard), L.routing_rows_differing,
                     L.routing_tie_flips, L.routing_confident_flips, num(L.routing_tie_threshold),
                     int(L.hash_disagreement), num(L.mhc_pre_max_abs), num(L.mhc_post_max_abs),
                     num(L.mhc_comb_max_abs), L.rows_out_differing, num(L.same_selection_share));
  write_file(d / "layers.csv", l);

  std::string t =
      "name,layer,rows,rows_differing,first_digest_seq,first_digest_row,full,rel_l2,max_abs,max_ulp,"
      "nonfinite_differing\n";
  for (const TensorDiff& x : r.tensors)
    t += fmt::format("{},{},{},{},{},{},{},{},{},{},{}\n", quoted(x.name), x.layer, x.rows, x.rows_differing,
                     x.first_digest_seq, x.first_digest_row, int(x.full), num(x.rel_l2), num(x.max_abs),
                     x.max_ulp, x.nonfinite_differing);
  write_file(d / "tensors.csv", t);

  std::string k = "seq,position,logprob_a,logprob_b,abs_diff,ratio\n";
  for (const TokenDiff& x : r.tokens)
    k += fmt::format("{},{},{},{},{},{}\n", x.seq, x.position, num(x.logprob_a), num(x.logprob_b),
                     num(x.abs_diff), num(x.ratio));
  write_file(d / "tokens.csv", k);

  if (!r.training) return;
  std::string g =
      "name,kind,layer,expert,rows,row_elems,grad_a,grad_b,full,rows_differing,weight_rows_differing,rel_l2,"
      "cosine,max_abs,norm_a,norm_b,nonfinite_differing\n";
  for (const ParamGradDiff& p : r.training->params)
    g += fmt::format("{},{},{},{},{},{},{},{},{},{},{},{},{},{},{},{},{}\n", quoted(p.name),
                     quoted(p.site.kind), p.site.layer, p.site.expert, p.rows, p.row_elems, int(p.grad_a),
                     int(p.grad_b), int(p.full), p.rows_differing, p.weight_rows_differing, num(p.rel_l2),
                     num(p.cosine), num(p.max_abs), num(p.norm_a), num(p.norm_b), p.nonfinite_differing);
  write_file(d / "gradients.csv", g);
  std::string c =
      "kind,layer,params,full_params,params_differing,rows,rows_differing,rel_l2,cosine,max_abs,norm_a,norm_"
      "b,"
      "nonfinite_differing\n";
  for (const GradAggregate& x : r.training->cells)
    c += fmt::format("{},{},{},{},{},{},{},{},{},{},{},{},{}\n", quoted(x.kind), x.layer, x.params,
                     x.full_params, x.params_differing, x.rows, x.rows_differing, num(x.rel_l2),
                     num(x.cosine), num(x.max_abs), num(x.norm_a), num(x.norm_b), x.nonfinite_differing);
  write_file(d / "gradient_cells.csv", c);
}

}  // namespace dsv4
