// Diff of two training steps (replay/training_diff.h).
#include "replay/training_diff.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <map>
#include <nlohmann/json.hpp>
#include <set>

#include "capture/training.h"
#include "model/error.h"
#include "model/weights.h"
#include "replay/rel_l2.h"

namespace dsv4 {

namespace {

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

// Sums over the element pairs of one or more gradients.
struct Sums {
  double sq_a = 0, sq_b = 0, sq_d = 0, dot = 0, max_abs = 0;
  int64_t nonfinite = 0;

  void add(const std::vector<float>& a, const std::vector<float>& b) {
    for (size_t e = 0; e < a.size(); ++e) {
      const float fa = a[e], fb = b[e];
      if (!std::isfinite(fa) || !std::isfinite(fb)) {
        if (std::memcmp(&fa, &fb, sizeof(float)) != 0) ++nonfinite;
        continue;
      }
      const double da = fa, db = fb, d = db - da;
      sq_a += da * da;
      sq_b += db * db;
      dot += da * db;
      if (d == 0) continue;
      sq_d += d * d;
      max_abs = std::max(max_abs, std::fabs(d));
    }
  }
  double rel_l2() const { return rel_l2_of(sq_d, sq_a); }
  double cosine() const {
    if (sq_d == 0 && nonfinite == 0) return 1;  // equal (also when both are 0)
    if (sq_a == 0 || sq_b == 0) return kNaN;
    return std::clamp(dot / (std::sqrt(sq_a) * std::sqrt(sq_b)), -1.0, 1.0);
  }
};

int64_t rows_differing(const std::vector<uint64_t>& a, const std::vector<uint64_t>& b) {
  if (a.size() != b.size()) return int64_t(std::max(a.size(), b.size()));
  int64_t n = 0;
  for (size_t i = 0; i < a.size(); ++i) n += a[i] != b[i];
  return n;
}

// The numbers of a parameter or group known from digests alone: equal, or unknown.
template <typename T>
void from_digests(T& x, bool equal) {
  x.rel_l2 = equal ? 0 : kNaN;
  x.cosine = equal ? 1 : kNaN;
  x.max_abs = equal ? 0 : kNaN;
  x.norm_a = x.norm_b = kNaN;
}

template <typename T>
void from_sums(T& x, const Sums& s) {
  x.rel_l2 = s.rel_l2();
  x.cosine = s.cosine();
  x.max_abs = s.max_abs;
  x.norm_a = std::sqrt(s.sq_a);
  x.norm_b = std::sqrt(s.sq_b);
  x.nonfinite_differing = s.nonfinite;
}

std::string float_list_note(const std::vector<float>& a, const std::vector<float>& b) {
  if (a.size() != b.size()) return fmt::format("{} values in A, {} in B", a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i)
    if (std::memcmp(&a[i], &b[i], sizeof(float)) != 0)
      return fmt::format("first difference at response token {}: {} in A, {} in B", i, a[i], b[i]);
  return "";
}

void compare_samples(const TrainingRecord& a, const TrainingRecord& b, std::vector<std::string>& notes) {
  if (a.samples.size() != b.samples.size())
    throw InputError(
        fmt::format("the training steps hold different samples: {} in A, {} in B; compare steps "
                    "over the same samples",
                    a.samples.size(), b.samples.size()));
  for (size_t i = 0; i < a.samples.size(); ++i) {
    const SampleLossInputs &x = a.samples[i], &y = b.samples[i];
    if (x.prompt_length != y.prompt_length)
      throw InputError(
          fmt::format("the training steps hold different samples: sample {} ('{}') has a prompt of {} "
                      "tokens in A and {} in B; compare steps over the same samples",
                      i, x.id, x.prompt_length, y.prompt_length));
    const std::string s = fmt::format("sample {} ('{}')", i, x.id);
    if (x.id != y.id) notes.push_back(fmt::format("{}: id '{}' in B", s, y.id));
    if (std::memcmp(&x.advantage, &y.advantage, sizeof(double)) != 0)
      notes.push_back(fmt::format("{}: advantage {} in A, {} in B", s, x.advantage, y.advantage));
    if (x.has_reward != y.has_reward || (x.has_reward && x.reward != y.reward))
      notes.push_back(fmt::format("{}: reward {} in A, {} in B", s,
                                  x.has_reward ? fmt::format("{}", x.reward) : "none",
                                  y.has_reward ? fmt::format("{}", y.reward) : "none"));
    if (x.group != y.group)
      notes.push_back(fmt::format("{}: group '{}' in A, '{}' in B", s, x.group, y.group));
    const std::pair<const char*, std::string> lists[] = {
        {"rollout_logprobs", float_list_note(x.rollout_logprobs, y.rollout_logprobs)},
        {"old_logprobs", float_list_note(x.old_logprobs, y.old_logprobs)},
        {"ref_logprobs", float_list_note(x.ref_logprobs, y.ref_logprobs)}};
    for (const auto& [what, why] : lists)
      if (!why.empty()) notes.push_back(fmt::format("{}: {} differ: {}", s, what, why));
  }
}

std::vector<MetricDiff> compare_metrics(const TrainingRecord& a, const TrainingRecord& b) {
  std::set<std::string> names;
  for (const auto& [k, v] : a.metrics) names.insert(k);
  for (const auto& [k, v] : b.metrics) names.insert(k);
  std::vector<MetricDiff> out;
  for (const std::string& n : names) {
    const auto ia = a.metrics.find(n), ib = b.metrics.find(n);
    out.push_back({n, ia == a.metrics.end() ? kNaN : ia->second, ib == b.metrics.end() ? kNaN : ib->second});
  }
  return out;
}

std::vector<SettingDiff> compare_settings(const TrainingRecord& a, const TrainingRecord& b,
                                          std::vector<std::string>& notes) {
  auto leaves = [&](const std::string& text, const char* side) {
    std::map<std::string, std::string> out;
    const nlohmann::json j = nlohmann::json::parse(text, nullptr, false);
    if (j.is_discarded() || !j.is_object()) {
      notes.push_back(fmt::format("the settings of {} are not a JSON object", side));
      return out;
    }
    const nlohmann::json flat = j.flatten();
    for (const auto& [path, v] : flat.items()) {
      std::string key = path.substr(path.empty() ? 0 : 1);
      std::replace(key.begin(), key.end(), '/', '.');
      out[key] = v.dump();
    }
    return out;
  };
  const auto la = leaves(a.settings_json, "A"), lb = leaves(b.settings_json, "B");
  std::set<std::string> keys;
  for (const auto& [k, v] : la) keys.insert(k);
  for (const auto& [k, v] : lb) keys.insert(k);
  std::vector<SettingDiff> out;
  for (const std::string& k : keys) {
    const auto ia = la.find(k), ib = lb.find(k);
    const std::string va = ia == la.end() ? "(absent)" : ia->second;
    const std::string vb = ib == lb.end() ? "(absent)" : ib->second;
    if (va != vb) out.push_back({k, va, vb});
  }
  return out;
}

// A group of parameters (a cell or a layer) being summed.
struct Group {
  GradAggregate agg;
  Sums sums;
};

void add_to(Group& g, const ParamGradDiff& p, const TrainingRecord& a, const TrainingRecord& b) {
  ++g.agg.params;
  g.agg.rows += p.rows;
  g.agg.rows_differing += p.rows_differing;
  if (p.rows_differing > 0) ++g.agg.params_differing;
  if (!p.full) return;
  ++g.agg.full_params;
  g.sums.add(a.full_grads.at(p.name), b.full_grads.at(p.name));
}

GradAggregate finish(Group& g) {
  GradAggregate& x = g.agg;
  if (x.full_params == x.params)
    from_sums(x, g.sums);
  else
    from_digests(x, x.rows_differing == 0);
  return x;
}

}  // namespace

const GradAggregate* TrainingDiff::cell(const std::string& kind, int layer) const {
  for (const GradAggregate& c : cells)
    if (c.kind == kind && c.layer == layer) return &c;
  return nullptr;
}

TrainingDiff training_gradient_diff(const TrainingRecord& a, const TrainingRecord& b) {
  TrainingDiff d;
  compare_samples(a, b, d.notes);
  d.metrics = compare_metrics(a, b);
  d.settings = compare_settings(a, b, d.notes);
  d.optimizer_step_a = a.optimizer_step_before;
  d.optimizer_step_b = b.optimizer_step_before;

  std::map<std::string, const ParamDigests*> pb;
  for (const ParamDigests& p : b.params) pb[p.name] = &p;
  std::set<std::string> in_a;
  // Groups keyed by (kind, layer) and by layer; their parameters arrive in name order.
  std::map<std::pair<std::string, int>, Group> cells;
  std::map<int, Group> layers;
  for (const ParamDigests& x : a.params) {
    in_a.insert(x.name);
    const auto it = pb.find(x.name);
    if (it == pb.end()) {
      d.notes.push_back(fmt::format("parameter {}: only in A", x.name));
      continue;
    }
    const ParamDigests& y = *it->second;
    if (x.rows != y.rows || x.row_elems != y.row_elems) {
      d.notes.push_back(fmt::format("parameter {}: [{}, {}] in A, [{}, {}] in B", x.name, x.rows, x.row_elems,
                                    y.rows, y.row_elems));
      continue;
    }
    ParamGradDiff p;
    p.name = x.name;
    p.site = param_site(x.name);
    p.rows = x.rows;
    p.row_elems = x.row_elems;
    p.grad_a = !x.grad.empty();
    p.grad_b = !y.grad.empty();
    p.weight_rows_differing = rows_differing(x.weight, y.weight);
    if (p.grad_a != p.grad_b) {
      d.notes.push_back(fmt::format("parameter {}: trained in {} only", x.name, p.grad_a ? "A" : "B"));
      p.rows_differing = p.rows;
      from_digests(p, false);
      d.params.push_back(std::move(p));
      continue;
    }
    if (!p.grad_a) {  // trained in neither step
      d.params.push_back(std::move(p));
      continue;
    }
    p.rows_differing = rows_differing(x.grad, y.grad);
    const auto fa = a.full_grads.find(x.name), fb = b.full_grads.find(x.name);
    p.full = fa != a.full_grads.end() && fb != b.full_grads.end() && fa->second.size() == fb->second.size();
    if (p.full) {
      Sums s;
      s.add(fa->second, fb->second);
      from_sums(p, s);
    } else {
      from_digests(p, p.rows_differing == 0);
    }
    ++d.params_trained;
    d.params_full += p.full;
    d.params_differing += p.rows_differing > 0;
    Group& c = cells[{p.site.kind, p.site.layer}];
    c.agg.kind = p.site.kind;
    c.agg.layer = p.site.layer;
    add_to(c, p, a, b);
    Group& l = layers[p.site.layer];
    l.agg.layer = p.site.layer;
    add_to(l, p, a, b);
    d.params.push_back(std::move(p));
  }
  for (const ParamDigests& y : b.params)
    if (!in_a.count(y.name)) d.notes.push_back(fmt::format("parameter {}: only in B", y.name));

  // Rows: the kinds of layer weights ascending, then the model-level weights ascending.
  std::set<std::string> layer_kinds, model_kinds;
  for (const auto& [key, g] : cells) (key.second >= 0 ? layer_kinds : model_kinds).insert(key.first);
  d.kinds.assign(layer_kinds.begin(), layer_kinds.end());
  for (const std::string& k : model_kinds)
    if (!layer_kinds.count(k)) d.kinds.push_back(k);
  for (const std::string& k : d.kinds)
    for (auto& [key, g] : cells)
      if (key.first == k) d.cells.push_back(finish(g));
  for (auto& [layer, g] : layers) d.layers.push_back(finish(g));
  return d;
}

}  // namespace dsv4
