// The policy loss and group-relative advantages (train/loss.h): the gradient against float64 central
// finite differences of an independent float64 loss, hand-built clipping / TIS / KL / mismatch cases,
// the token normalisation over the whole batch, and the error cases.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "model/error.h"
#include "test_util.h"
#include "train/loss.h"

namespace dsv4 {
namespace {

using train::LossMetrics;
using train::policy_loss;
using train::PolicyLossConfig;
using train::SampleLogprobs;

// One sample with fp64 log-probs for the reference (logp perturbed by the finite differences).
struct RefSample {
  std::vector<double> logp, old, rollout, ref;
  double advantage = 0;
};

RefSample to_ref(const SampleLogprobs& s) {
  RefSample r;
  r.logp.assign(s.logp.begin(), s.logp.end());
  r.old.assign(s.old.begin(), s.old.end());
  r.rollout.assign(s.rollout.begin(), s.rollout.end());
  r.ref.assign(s.ref.begin(), s.ref.end());
  r.advantage = s.advantage;
  return r;
}

struct RefLoss {
  double loss = 0, pg = 0, kl = 0;
};

// The loss of train/loss.h written out directly in fp64 with libm.
RefLoss ref_loss(const PolicyLossConfig& c, const std::vector<RefSample>& batch) {
  double n = 0;
  for (const auto& s : batch) n += double(s.logp.size());
  RefLoss out;
  for (const auto& s : batch) {
    for (size_t t = 0; t < s.logp.size(); ++t) {
      const double r = std::exp(s.logp[t] - s.old[t]);
      const double rc = std::min(std::max(r, 1.0 - c.eps_low), 1.0 + c.eps_high);
      const double pg = -std::min(r * s.advantage, rc * s.advantage);
      const double w = c.tis ? std::min(std::exp(s.old[t] - s.rollout[t]), c.tis_cap) : 1.0;
      double kl = 0;
      if (c.kl_coef > 0) {
        const double x = s.ref[t] - s.logp[t];
        kl = std::exp(x) - x - 1.0;
      }
      out.loss += w * pg + c.kl_coef * kl;
      out.pg += w * pg;
      out.kl += kl;
    }
  }
  out.loss /= n;
  out.pg /= n;
  out.kl /= n;
  return out;
}

// A random batch whose ratios spread over both sides of the clip range, kept at least `margin`
// (relative) away from the range's ends so that the finite differences do not straddle a kink.
std::vector<SampleLogprobs> random_batch(std::mt19937_64& g, const std::vector<int>& lengths,
                                         const std::vector<double>& advantages, const PolicyLossConfig& c) {
  std::uniform_real_distribution<float> lp(-3.0f, -0.05f), dr(-0.6f, 0.6f), dref(-0.8f, 0.8f);
  const double margin = 1e-3;
  std::vector<SampleLogprobs> b;
  for (size_t i = 0; i < lengths.size(); ++i) {
    SampleLogprobs s;
    s.advantage = advantages[i];
    for (int t = 0; t < lengths[i]; ++t) {
      float l, o;
      for (;;) {
        l = lp(g);
        o = l - dr(g);
        const double r = std::exp(double(l) - double(o));
        if (std::fabs(r - (1.0 - c.eps_low)) > margin && std::fabs(r - (1.0 + c.eps_high)) > margin) break;
      }
      s.logp.push_back(l);
      s.old.push_back(o);
      s.rollout.push_back(o + dr(g));
      s.ref.push_back(l + dref(g));
    }
    b.push_back(s);
  }
  return b;
}

void expect_gradient_matches_fd(const PolicyLossConfig& c, const std::vector<SampleLogprobs>& batch) {
  std::vector<std::vector<float>> grad;
  const LossMetrics m = policy_loss(c, batch, &grad);
  std::vector<RefSample> rb;
  for (const auto& s : batch) rb.push_back(to_ref(s));
  const RefLoss base = ref_loss(c, rb);
  // Both fp64; they differ only by the exp implementation (a few fp64 ulps).
  EXPECT_NEAR(m.loss, base.loss, 1e-13 * (1 + std::fabs(base.loss)));
  EXPECT_NEAR(m.pg_loss, base.pg, 1e-13 * (1 + std::fabs(base.pg)));
  EXPECT_NEAR(m.kl, base.kl, 1e-13 * (1 + std::fabs(base.kl)));

  ASSERT_EQ(grad.size(), batch.size());
  const double h = 1e-6;
  bool any_nonzero = false;
  for (size_t i = 0; i < batch.size(); ++i) {
    ASSERT_EQ(grad[i].size(), batch[i].logp.size());
    for (size_t t = 0; t < batch[i].logp.size(); ++t) {
      auto up = rb, dn = rb;
      up[i].logp[t] += h;
      dn[i].logp[t] -= h;
      const double fd = (ref_loss(c, up).loss - ref_loss(c, dn).loss) / (2 * h);
      // The gradient is fp64 rounded once to fp32 (2^-24 relative); the central difference has
      // O(h^2) truncation and ~1e-16 / h cancellation error.
      EXPECT_NEAR(grad[i][t], fd, 2e-7 * std::fabs(fd) + 1e-9) << "sample " << i << " token " << t;
      any_nonzero = any_nonzero || grad[i][t] != 0.0f;
    }
  }
  EXPECT_TRUE(any_nonzero);
}

TEST(PolicyLoss, GradientMatchesFiniteDifferences) {
  auto g = test::rng_for("PolicyLoss.Gradient");
  const std::vector<int> lengths{1, 4, 7, 3};
  const std::vector<double> adv{1.3, -0.7, 0.4, 0.0};
  struct Case {
    const char* name;
    PolicyLossConfig c;
  };
  std::vector<Case> cases(4);
  cases[0].name = "plain";
  cases[1].name = "tis";
  cases[1].c.tis = true;
  cases[1].c.tis_cap = 1.3;  // some tokens capped, some not
  cases[2].name = "kl";
  cases[2].c.kl_coef = 0.05;
  cases[3].name = "tis+kl, asymmetric range";
  cases[3].c.tis = true;
  cases[3].c.tis_cap = 1.1;
  cases[3].c.kl_coef = 0.3;
  cases[3].c.eps_low = 0.1;
  cases[3].c.eps_high = 0.35;
  for (const auto& k : cases) {
    SCOPED_TRACE(k.name);
    const auto batch = random_batch(g, lengths, adv, k.c);
    expect_gradient_matches_fd(k.c, batch);
  }
}

// Tokens placed by hand on both sides of the range, for A > 0 and A < 0.
TEST(PolicyLoss, ClipFractionAndRatiosOnHandBuiltTokens) {
  PolicyLossConfig c;  // eps_low 0.2, eps_high 0.28: range [0.8, 1.28]
  auto tokens = [](std::vector<double> ratios, double adv) {
    SampleLogprobs s;
    s.advantage = adv;
    for (double r : ratios) {
      s.old.push_back(-1.0f);
      s.logp.push_back(float(-1.0 + std::log(r)));
    }
    return s;
  };
  // A > 0: r = 1.5 is clipped (1.28 A < 1.5 A); r = 0.5 is not (0.5 A < 0.8 A); r = 1 is inside.
  // A < 0: r = 0.5 is clipped (0.8 A < 0.5 A); r = 1.5 is not (1.5 A < 1.28 A); r = 1.1 is inside.
  const std::vector<SampleLogprobs> batch{tokens({1.5, 0.5, 1.0}, 2.0), tokens({0.5, 1.5, 1.1}, -1.0)};
  std::vector<std::vector<float>> grad;
  const LossMetrics m = policy_loss(c, batch, &grad);
  EXPECT_EQ(m.tokens, 6);
  EXPECT_DOUBLE_EQ(m.clip_fraction, 2.0 / 6.0);

  // Exact ratios of the fp32 inputs.
  std::vector<double> r;
  for (const auto& s : batch)
    for (size_t t = 0; t < s.logp.size(); ++t) r.push_back(std::exp(double(s.logp[t]) - double(s.old[t])));
  EXPECT_NEAR(m.ratio_min, 0.5, 1e-6);
  EXPECT_NEAR(m.ratio_max, 1.5, 1e-6);
  EXPECT_NEAR(m.ratio_mean, (r[0] + r[1] + r[2] + r[3] + r[4] + r[5]) / 6, 1e-14);
  EXPECT_EQ(m.tis_mean, 1.0);
  EXPECT_EQ(m.kl, 0.0);
  // pg per token: -1.28*2, -0.5*2, -r2*2, +0.8, +1.5 (r4 * 1), +r5.
  const double pg = (-1.28 * 2 - r[1] * 2 - r[2] * 2 + 0.8 + r[4] + r[5]) / 6;
  EXPECT_NEAR(m.pg_loss, pg, 1e-14);
  EXPECT_NEAR(m.loss, pg, 1e-14);
  // Clipped tokens have no gradient; the others -r A / N.
  EXPECT_EQ(grad[0][0], 0.0f);
  EXPECT_EQ(grad[1][0], 0.0f);
  EXPECT_FLOAT_EQ(grad[0][1], float(-r[1] * 2 / 6));
  EXPECT_FLOAT_EQ(grad[0][2], float(-r[2] * 2 / 6));
  EXPECT_FLOAT_EQ(grad[1][1], float(r[4] / 6));
  EXPECT_FLOAT_EQ(grad[1][2], float(r[5] / 6));
  EXPECT_EQ(m.mismatch_tokens, 0);
}

TEST(PolicyLoss, ZeroAdvantageIsNeverClippedAndHasNoGradient) {
  PolicyLossConfig c;
  SampleLogprobs s;
  s.logp = {-0.1f, -2.0f};
  s.old = {-2.0f, -0.1f};  // ratios e^1.9 and e^-1.9, far outside the range
  const std::vector<SampleLogprobs> batch{s};
  std::vector<std::vector<float>> grad;
  const LossMetrics m = policy_loss(c, batch, &grad);
  EXPECT_EQ(m.clip_fraction, 0.0);
  EXPECT_EQ(m.loss, 0.0);
  EXPECT_EQ(grad[0][0], 0.0f);
  EXPECT_EQ(grad[0][1], 0.0f);
}

TEST(PolicyLoss, TruncatedImportanceSamplingCapsTheWeight) {
  PolicyLossConfig c;
  c.tis = true;
  c.tis_cap = 2.0;
  SampleLogprobs s;
  s.advantage = 1.0;
  s.logp = {-1.0f, -1.0f};
  s.old = {-1.0f, -1.0f};  // ratio 1: unclipped, dpg = -A
  s.rollout = {float(-1.0 - std::log(3.0)),
               float(-1.0 - std::log(0.5))};  // weights 3 -> capped at 2, and 0.5
  std::vector<std::vector<float>> grad;
  const LossMetrics m = policy_loss(c, {s}, &grad);
  const double w1 = std::exp(double(s.old[1]) - double(s.rollout[1]));
  EXPECT_NEAR(w1, 0.5, 1e-7);
  EXPECT_NEAR(m.tis_mean, (2.0 + w1) / 2, 1e-15);
  EXPECT_NEAR(m.pg_loss, (-2.0 - w1) / 2, 1e-15);
  EXPECT_NEAR(m.loss, m.pg_loss, 1e-15);
  EXPECT_EQ(grad[0][0], float(-2.0 / 2));
  EXPECT_FLOAT_EQ(grad[0][1], float(-w1 / 2));
  // The rollout log-probs also give the mismatch metrics.
  EXPECT_EQ(m.mismatch_tokens, 2);

  // Without TIS the same tokens weigh 1.
  c.tis = false;
  const LossMetrics m0 = policy_loss(c, {s}, &grad);
  EXPECT_EQ(m0.tis_mean, 1.0);
  EXPECT_EQ(grad[0][0], -0.5f);
  EXPECT_EQ(grad[0][1], -0.5f);
}

TEST(PolicyLoss, K3KlPenaltyAndItsGradient) {
  PolicyLossConfig c;
  c.kl_coef = 0.25;
  SampleLogprobs s;
  s.advantage = 0.0;  // KL only
  s.logp = {-2.0f, -1.0f, -0.5f};
  s.old = s.logp;
  // ref - logp = ln 2, 0, -ln 2: k3 = 2 - ln2 - 1, 0, 1/2 + ln2 - 1.
  s.ref = {float(-2.0 + std::log(2.0)), -1.0f, float(-0.5 - std::log(2.0))};
  std::vector<std::vector<float>> grad;
  const LossMetrics m = policy_loss(c, {s}, &grad);
  std::vector<double> d(3), kl(3);
  for (int t = 0; t < 3; ++t) {
    d[t] = double(s.ref[t]) - double(s.logp[t]);
    kl[t] = std::exp(d[t]) - d[t] - 1;
  }
  EXPECT_NEAR(kl[0], 1 - std::log(2.0), 1e-7);
  EXPECT_EQ(kl[1], 0.0);
  EXPECT_NEAR(kl[2], std::log(2.0) - 0.5, 1e-7);
  EXPECT_NEAR(m.kl, (kl[0] + kl[1] + kl[2]) / 3, 1e-15);
  EXPECT_NEAR(m.loss, 0.25 * m.kl, 1e-15);
  EXPECT_EQ(m.pg_loss, 0.0);
  // d/dlogp k3 = 1 - e^(ref - logp): -1, 0, +1/2 (times kl_coef / N).
  EXPECT_NEAR(grad[0][0], -0.25 / 3, 1e-7);
  EXPECT_EQ(grad[0][1], 0.0f);
  EXPECT_NEAR(grad[0][2], 0.125 / 3, 1e-7);
  for (int t = 0; t < 3; ++t) EXPECT_FLOAT_EQ(grad[0][t], float(0.25 * (1 - std::exp(d[t])) / 3));

  // kl_coef 0: no penalty and the metric is 0, even with reference log-probs present.
  c.kl_coef = 0;
  const LossMetrics m0 = policy_loss(c, {s}, &grad);
  EXPECT_EQ(m0.kl, 0.0);
  EXPECT_EQ(m0.loss, 0.0);
}

TEST(PolicyLoss, MismatchMetricsCountOnlyTokensWithRolloutLogprobs) {
  PolicyLossConfig c;
  SampleLogprobs a, b;
  a.advantage = b.advantage = 0.5;
  a.logp = {-1.0f, -2.0f, -0.25f};
  a.old = a.logp;
  a.rollout = {-1.5f, -2.0f, -0.125f};  // logp - rollout = 0.5, 0, -0.125
  b.logp = {-3.0f, -4.0f};
  b.old = b.logp;  // no rollout log-probs
  const LossMetrics m = policy_loss(c, {a, b}, nullptr);
  EXPECT_EQ(m.tokens, 5);
  EXPECT_EQ(m.mismatch_tokens, 3);
  EXPECT_DOUBLE_EQ(m.mismatch_mean_abs, (0.5 + 0 + 0.125) / 3);
  EXPECT_EQ(m.mismatch_max_abs, 0.5);
  const double k3 = ((std::exp(0.5) - 0.5 - 1) + 0 + (std::exp(-0.125) + 0.125 - 1)) / 3;
  EXPECT_NEAR(m.mismatch_k3, k3, 1e-15);

  // No rollout log-probs anywhere: all zero.
  const LossMetrics m0 = policy_loss(c, {b}, nullptr);
  EXPECT_EQ(m0.mismatch_tokens, 0);
  EXPECT_EQ(m0.mismatch_mean_abs, 0.0);
  EXPECT_EQ(m0.mismatch_k3, 0.0);
}

// N is the number of response tokens of the whole batch: a token's gradient depends only on the
// token and N, never on which other samples share the batch or in what order.
TEST(PolicyLoss, TokenMeanOverTheWholeBatch) {
  PolicyLossConfig c;
  c.kl_coef = 0.1;
  auto g = test::rng_for("PolicyLoss.TokenMean");
  auto b1 = random_batch(g, {3, 5}, {0.8, -1.2}, c);
  auto b2 = random_batch(g, {5}, {2.5}, c);
  // s0 with 3 tokens; batches [s0, x] and [y, s0] with x, y different 5-token samples: N = 8.
  const SampleLogprobs s0 = b1[0], x = b1[1], y = b2[0];
  std::vector<std::vector<float>> g_a, g_b, g_alone, g_x;
  const LossMetrics ma = policy_loss(c, {s0, x}, &g_a);
  policy_loss(c, {y, s0}, &g_b);
  const LossMetrics m0 = policy_loss(c, {s0}, &g_alone);
  const LossMetrics mx = policy_loss(c, {x}, &g_x);
  EXPECT_TRUE(test::bitwise_equal(g_a[0], g_b[1]));

  // By hand: token t of s0 in a batch of N = 8 tokens.
  for (size_t t = 0; t < 3; ++t) {
    const double r = std::exp(double(s0.logp[t]) - double(s0.old[t]));
    const double rc = std::min(std::max(r, 0.8), 1.28);
    const double dpg = rc * s0.advantage < r * s0.advantage ? 0.0 : -r * s0.advantage;
    const double dkl = 1 - std::exp(double(s0.ref[t]) - double(s0.logp[t]));
    EXPECT_NEAR(g_a[0][t], (dpg + 0.1 * dkl) / 8, 1e-7 * std::fabs(dpg + 0.1 * dkl) / 8 + 1e-12);
    // Alone, the same token is divided by 3 instead of 8.
    EXPECT_NEAR(g_alone[0][t], g_a[0][t] * 8.0 / 3.0, 2e-7 * std::fabs(g_alone[0][t]));
  }
  // The loss is a token mean, not a mean of sample means.
  EXPECT_NEAR(ma.loss, (3 * m0.loss + 5 * mx.loss) / 8, 1e-15);
}

TEST(PolicyLoss, WrongLengthsAndMissingInputsNameTheSample) {
  PolicyLossConfig c;
  SampleLogprobs good;
  good.logp = {-1.0f, -2.0f};
  good.old = good.logp;
  auto expect_error = [&](const PolicyLossConfig& cfg, const SampleLogprobs& bad,
                          const std::vector<std::string>& parts) {
    try {
      policy_loss(cfg, {good, bad}, nullptr);
      ADD_FAILURE() << "no InputError";
    } catch (const InputError& e) {
      const std::string msg = e.what();
      EXPECT_NE(msg.find("sample 1"), std::string::npos) << msg;
      for (const auto& p : parts)
        EXPECT_NE(msg.find(p), std::string::npos) << "'" << p << "' not in: " << msg;
    }
  };
  SampleLogprobs s = good;
  s.old = {-1.0f};
  expect_error(c, s, {"'old'", "1 values", "expected 2"});
  s = good;
  s.rollout = {-1.0f, -1.0f, -1.0f};
  expect_error(c, s, {"'rollout'", "3 values"});
  s = good;
  s.ref = {-1.0f};
  expect_error(c, s, {"'ref'", "1 values"});
  s = good;
  PolicyLossConfig tis = c;
  tis.tis = true;
  good.rollout = {-1.0f, -1.0f};
  expect_error(tis, s, {"TIS", "rollout"});
  good.rollout.clear();
  PolicyLossConfig kl = c;
  kl.kl_coef = 0.1;
  good.ref = {-1.0f, -1.0f};
  expect_error(kl, s, {"kl_coef", "reference"});
  good.ref.clear();
  s.advantage = std::nan("");
  expect_error(c, s, {"advantage"});

  EXPECT_THROW(policy_loss(c, {}, nullptr), InputError);
  SampleLogprobs empty;
  EXPECT_THROW(policy_loss(c, {empty}, nullptr), InputError);
}

TEST(PolicyLoss, ConfigCheckNamesTheField) {
  auto expect_bad = [](PolicyLossConfig c, const std::string& field) {
    try {
      train::check(c);
      ADD_FAILURE() << "no InputError for " << field;
    } catch (const InputError& e) {
      EXPECT_NE(std::string(e.what()).find("'" + field + "'"), std::string::npos) << e.what();
    }
  };
  PolicyLossConfig c;
  EXPECT_NO_THROW(train::check(c));
  c.eps_low = 0;
  c.eps_high = 0;
  c.kl_coef = 0;
  EXPECT_NO_THROW(train::check(c));
  c = {};
  c.eps_low = -0.1;
  expect_bad(c, "eps_low");
  c = {};
  c.eps_high = std::nan("");
  expect_bad(c, "eps_high");
  c = {};
  c.tis_cap = 0;
  expect_bad(c, "tis_cap");
  c = {};
  c.tis_cap = INFINITY;
  expect_bad(c, "tis_cap");
  c = {};
  c.kl_coef = -1;
  expect_bad(c, "kl_coef");
}

// ---- group advantages ----------------------------------------------------------------------------

TEST(GroupAdvantages, HandComputed) {
  const double eps = 1e-6;
  // One group: mean 0.75, population std sqrt(3/16).
  const auto a = train::group_advantages({1, 0, 1, 1}, {"q", "q", "q", "q"}, true, eps);
  const double sd = std::sqrt(3.0 / 16.0);
  ASSERT_EQ(a.size(), 4u);
  EXPECT_DOUBLE_EQ(a[0], 0.25 / (sd + eps));
  EXPECT_DOUBLE_EQ(a[1], -0.75 / (sd + eps));
  EXPECT_DOUBLE_EQ(a[3], 0.25 / (sd + eps));

  // Interleaved groups; "c" has one sample.
  const std::vector<double> r{1, 2, 3, 6, 5};
  const std::vector<std::string> grp{"a", "b", "a", "b", "c"};
  const auto s = train::group_advantages(r, grp, true, eps);
  EXPECT_EQ(s, (std::vector<double>{-1 / (1 + eps), -2 / (2 + eps), 1 / (1 + eps), 2 / (2 + eps), 0.0}));
  const auto u = train::group_advantages(r, grp, false);
  EXPECT_EQ(u, (std::vector<double>{-1, -2, 1, 2, 0}));
}

TEST(GroupAdvantages, SingleSampleGroupAndEqualRewards) {
  EXPECT_EQ(train::group_advantages({3.7}, {"x"}, true), (std::vector<double>{0.0}));
  EXPECT_EQ(train::group_advantages({3.7}, {"x"}, false), (std::vector<double>{0.0}));
  // Equal rewards: the mean may round a few ulps away from them; eps keeps the result tiny.
  const auto a = train::group_advantages({0.1, 0.1, 0.1}, {"", "", ""}, true);
  for (double x : a) EXPECT_LT(std::fabs(x), 1e-9);
  EXPECT_TRUE(train::group_advantages({}, {}, true).empty());
}

TEST(GroupAdvantages, Errors) {
  EXPECT_THROW(train::group_advantages({1, 2}, {"a"}, true), InputError);
  EXPECT_THROW(train::group_advantages({1, NAN}, {"a", "a"}, true), InputError);
  EXPECT_THROW(train::group_advantages({1, 2}, {"a", "a"}, true, 0.0), InputError);
  EXPECT_NO_THROW(train::group_advantages({1, 2}, {"a", "a"}, false, 0.0));
}

}  // namespace
}  // namespace dsv4
