// Shared helpers of the training-step tests: seeded token sequences and samples.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "model/weights.h"
#include "train/samples.h"

namespace dsv4::test {

// n seeded token ids in [0, vocab).
inline std::vector<int32_t> seq_tokens(int n, int vocab, uint64_t seed) {
  std::mt19937_64 g(seed);
  std::vector<int32_t> t(static_cast<size_t>(n));
  for (auto& x : t) x = int32_t(g() % uint64_t(vocab));
  return t;
}

// A sample of `prompt` + `response` seeded tokens with a given advantage.
inline train::TrainSample make_sample(const std::string& id, int prompt, int response, int vocab, uint64_t seed,
                                      double advantage) {
  const std::vector<int32_t> t = seq_tokens(prompt + response, vocab, seed);
  train::TrainSample s;
  s.id = id;
  s.prompt.assign(t.begin(), t.begin() + prompt);
  s.response.assign(t.begin() + prompt, t.end());
  s.advantage = advantage;
  return s;
}

// A directional check of a gradient: the step along the gradient `grads` of the tensors `names` of w
// aimed at a change of `aim` in f with at most 5% relative change of any tensor, w± = round(w ± alpha g)
// (the rounding to each tensor's storage dtype included: the prediction uses the realised w+ - w-).
// Returns the predicted and the measured central difference f(w+) - f(w-), or nothing when the
// prediction is below `min_predicted` (too close to f's rounding noise to judge).
struct DirectionalStep {
  double predicted = 0, actual = 0;
};
inline std::optional<DirectionalStep> directional_step(const Weights& w,
                                                       const std::map<std::string, std::vector<float>>& grads,
                                                       const std::vector<std::string>& names, double aim,
                                                       double min_predicted,
                                                       const std::function<double(const Weights&)>& f) {
  double gg_all = 0;
  for (const auto& n : names)
    for (float x : grads.at(n)) gg_all += double(x) * x;
  if (gg_all == 0) return std::nullopt;
  std::map<std::string, std::vector<float>> plus, minus;
  for (const auto& n : names) {
    const std::vector<float>& wv = w.get(n).f;
    const std::vector<float>& gv = grads.at(n);
    double ww = 0, gg = 0;
    for (size_t i = 0; i < wv.size(); ++i) ww += double(wv[i]) * wv[i], gg += double(gv[i]) * gv[i];
    if (gg == 0) continue;
    const double alpha = std::min(0.05 * std::sqrt(ww / gg), aim / (2 * gg_all));
    auto& p = plus[n];
    auto& m = minus[n];
    for (size_t i = 0; i < wv.size(); ++i) {
      p.push_back(float(double(wv[i]) + alpha * gv[i]));
      m.push_back(float(double(wv[i]) - alpha * gv[i]));
    }
  }
  const Weights wp = w.with_values(plus, "plus"), wm = w.with_values(minus, "minus");
  DirectionalStep s;
  for (const auto& [n, p] : plus) {
    const std::vector<float>& gv = grads.at(n);
    const std::vector<float>& a = wp.get(n).f;
    const std::vector<float>& b = wm.get(n).f;
    for (size_t i = 0; i < gv.size(); ++i) s.predicted += double(gv[i]) * (double(a[i]) - double(b[i]));
  }
  if (s.predicted < min_predicted) return std::nullopt;
  s.actual = f(wp) - f(wm);
  return s;
}

}  // namespace dsv4::test
