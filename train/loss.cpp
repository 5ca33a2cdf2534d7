// The policy loss and the group-relative advantages (train/loss.h).
#include "train/loss.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <map>

#include "kernels/numerics/numerics.h"
#include "model/error.h"

namespace dsv4::train {

namespace {

void check_finite_nonneg(double v, const char* field, bool positive) {
  if (!std::isfinite(v) || (positive ? !(v > 0) : !(v >= 0)))
    throw InputError(fmt::format("policy loss config: field '{}' must be a finite number {} 0, found {}",
                                 field, positive ? ">" : ">=", v));
}

// Checks the lengths of one sample's arrays against logp.
void check_sample(const PolicyLossConfig& c, const SampleLogprobs& s, size_t i) {
  const size_t n = s.logp.size();
  auto wrong = [&](const char* field, size_t got) {
    return InputError(
        fmt::format("policy loss: sample {}: '{}' has {} values, expected {} (one per response "
                    "token, as 'logp')",
                    i, field, got, n));
  };
  if (s.old.size() != n) throw wrong("old", s.old.size());
  if (c.tis && s.rollout.empty() && n > 0)
    throw InputError(fmt::format(
        "policy loss: sample {}: TIS is on but the sample has no rollout log-probs ('rollout' is empty)", i));
  if (!s.rollout.empty() && s.rollout.size() != n) throw wrong("rollout", s.rollout.size());
  if (c.kl_coef > 0 && s.ref.empty() && n > 0)
    throw InputError(fmt::format(
        "policy loss: sample {}: kl_coef is {} but the sample has no reference log-probs ('ref' is empty)", i,
        c.kl_coef));
  if (!s.ref.empty() && s.ref.size() != n) throw wrong("ref", s.ref.size());
  if (!std::isfinite(s.advantage))
    throw InputError(
        fmt::format("policy loss: sample {}: the advantage must be finite, found {}", i, s.advantage));
}

}  // namespace

void check(const PolicyLossConfig& c) {
  check_finite_nonneg(c.eps_low, "eps_low", false);
  check_finite_nonneg(c.eps_high, "eps_high", false);
  check_finite_nonneg(c.tis_cap, "tis_cap", true);
  check_finite_nonneg(c.kl_coef, "kl_coef", false);
}

LossMetrics policy_loss(const PolicyLossConfig& c, const std::vector<SampleLogprobs>& samples,
                        std::vector<std::vector<float>>* dlogp, int64_t normaliser) {
  check(c);
  int64_t N = 0;
  for (size_t i = 0; i < samples.size(); ++i) {
    check_sample(c, samples[i], i);
    N += int64_t(samples[i].logp.size());
  }
  if (N == 0)
    throw InputError(
        fmt::format("policy loss: the batch of {} samples has no response tokens", samples.size()));

  const double lo = 1.0 - c.eps_low, hi = 1.0 + c.eps_high;
  if (normaliser < 0) throw InputError(fmt::format("policy loss: normaliser {} < 0", normaliser));
  // The loss and its gradient are divided by the batch's token count (normaliser when given); the
  // per-token statistics below are means over these samples' own tokens.
  const double n_norm = double(normaliser > 0 ? normaliser : N);
  const double n_tokens = double(N);
  const bool kl_on = c.kl_coef > 0;

  LossMetrics m;
  m.tokens = N;
  m.ratio_min = HUGE_VAL;
  m.ratio_max = -HUGE_VAL;
  double sum_l = 0, sum_pg = 0, sum_kl = 0, sum_ratio = 0, sum_tis = 0, n_clipped = 0;
  double sum_mm_abs = 0, sum_mm_k3 = 0;
  if (dlogp) dlogp->assign(samples.size(), {});

  for (size_t i = 0; i < samples.size(); ++i) {
    const SampleLogprobs& s = samples[i];
    const size_t n = s.logp.size();
    const double A = s.advantage;
    std::vector<float>* g = dlogp ? &(*dlogp)[i] : nullptr;
    if (g) g->resize(n);
    for (size_t t = 0; t < n; ++t) {
      const double lp = s.logp[t];
      const double r = num::exp_f64(lp - double(s.old[t]));
      const double ra = r * A;
      const double ca = std::clamp(r, lo, hi) * A;
      // The clipped term is taken only where it is strictly the minimum; inside the range the two
      // are equal and the unclipped term (with its gradient) counts.
      const bool clipped = ca < ra;
      const double pg = -(clipped ? ca : ra);
      const double dpg = clipped ? 0.0 : -ra;
      const double tis = c.tis ? std::min(num::exp_f64(double(s.old[t]) - double(s.rollout[t])), c.tis_cap) : 1.0;
      double kl = 0, dkl = 0;
      if (kl_on) {
        const double d = double(s.ref[t]) - lp;
        const double e = num::exp_f64(d);
        kl = e - d - 1.0;
        dkl = 1.0 - e;
      }
      const double l = tis * pg + c.kl_coef * kl;
      if (g) (*g)[t] = float((tis * dpg + c.kl_coef * dkl) / n_norm);

      sum_l += l;
      sum_pg += tis * pg;
      sum_kl += kl;
      sum_ratio += r;
      sum_tis += tis;
      if (clipped) n_clipped += 1;
      m.ratio_min = std::min(m.ratio_min, r);
      m.ratio_max = std::max(m.ratio_max, r);
      if (!s.rollout.empty()) {
        // k3 estimate of KL(rollout || train) on tokens sampled by the rollout: rho - 1 - log rho
        // with rho = p_train / p_rollout.
        const double d = lp - double(s.rollout[t]);
        sum_mm_abs += std::fabs(d);
        sum_mm_k3 += num::exp_f64(d) - d - 1.0;
        m.mismatch_max_abs = std::max(m.mismatch_max_abs, std::fabs(d));
        ++m.mismatch_tokens;
      }
    }
  }
  m.loss = sum_l / n_norm;
  m.pg_loss = sum_pg / n_norm;
  m.kl = sum_kl / n_norm;
  m.clip_fraction = n_clipped / n_tokens;
  m.ratio_mean = sum_ratio / n_tokens;
  m.tis_mean = sum_tis / n_tokens;
  if (m.mismatch_tokens > 0) {
    m.mismatch_mean_abs = sum_mm_abs / double(m.mismatch_tokens);
    m.mismatch_k3 = sum_mm_k3 / double(m.mismatch_tokens);
  }
  return m;
}

std::vector<double> group_advantages(const std::vector<double>& rewards,
                                     const std::vector<std::string>& group, bool scale_by_std, double eps) {
  if (rewards.size() != group.size())
    throw InputError(
        fmt::format("group advantages: {} rewards but {} group names", rewards.size(), group.size()));
  // eps > 0 keeps a group of equal rewards (std 0, or a few ulps from rounding the mean) at ~0.
  if (scale_by_std && (!std::isfinite(eps) || !(eps > 0)))
    throw InputError(fmt::format("group advantages: eps must be a finite number > 0, found {}", eps));
  for (size_t i = 0; i < rewards.size(); ++i)
    if (!std::isfinite(rewards[i]))
      throw InputError(
          fmt::format("group advantages: sample {}: the reward must be finite, found {}", i, rewards[i]));

  struct Stats {
    double sum = 0, sq = 0, mean = 0, std = 0;
    int64_t n = 0;
  };
  std::map<std::string, Stats> st;
  for (size_t i = 0; i < rewards.size(); ++i) {
    Stats& s = st[group[i]];
    s.sum += rewards[i];
    ++s.n;
  }
  for (auto& [name, s] : st) s.mean = s.sum / double(s.n);
  for (size_t i = 0; i < rewards.size(); ++i) {
    Stats& s = st[group[i]];
    const double d = rewards[i] - s.mean;
    s.sq += d * d;
  }
  for (auto& [name, s] : st) s.std = std::sqrt(s.sq / double(s.n));

  std::vector<double> a(rewards.size());
  for (size_t i = 0; i < rewards.size(); ++i) {
    const Stats& s = st.at(group[i]);
    if (s.n == 1) {
      a[i] = 0.0;
      continue;
    }
    const double d = rewards[i] - s.mean;
    a[i] = scale_by_std ? d / (s.std + eps) : d;
  }
  return a;
}

}  // namespace dsv4::train
