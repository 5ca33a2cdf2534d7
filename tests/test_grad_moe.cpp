// Backward of the MoE router and experts (kernels/grad.h, MODEL.md §5.3) against float64 central
// finite differences of forwards written here (the router weights; the MoE layer unrounded, with the
// clamp), the clamp boundaries, and bitwise batch and thread-count invariance.
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <string>
#include <vector>

#include "kernels/grad.h"
#include "test_util.h"

namespace dsv4 {
namespace {

using test::bitwise_equal;
using test::rng_for;

template <typename F>
void with_threads(int n, F&& f) {
  const int saved = omp_get_max_threads();
  omp_set_num_threads(n);
  f();
  omp_set_num_threads(saved);
}

double softplus_d(double z) {
  return z > 0 ? z + std::log1p(std::exp(-z)) : std::log1p(std::exp(z));
}
double sigmoid_d(double z) {
  return 1.0 / (1.0 + std::exp(-z));
}
double silu_d(double z) {
  return z * sigmoid_d(z);
}

// ---- router -------------------------------------------------------------------------------------

// Float64 routing weights of one token: w_i = lambda * s_i / sum s (or lambda * s_i), s = sqrt(softplus).
std::vector<double> router_weights_d(const std::vector<double>& logit, const std::vector<int32_t>& ids,
                                     bool norm, double lambda) {
  std::vector<double> s(ids.size()), w(ids.size());
  double S = 0;
  for (size_t i = 0; i < ids.size(); ++i) S += (s[i] = std::sqrt(softplus_d(logit[size_t(ids[i])])));
  for (size_t i = 0; i < ids.size(); ++i) w[i] = lambda * (norm ? s[i] / S : s[i]);
  return w;
}

TEST(RouterBackward, MatchesFiniteDifferencesOfFloat64Weights) {
  struct Row {
    std::vector<float> logits;
    std::vector<int32_t> ids;
  };
  const int E = 7;
  auto g = rng_for("router_bwd");
  std::normal_distribution<float> nd(0.0f, 2.0f);
  std::vector<Row> rows;
  for (int k : {1, 3, 7}) {
    for (int rep = 0; rep < 3; ++rep) {
      Row r;
      r.logits.resize(static_cast<size_t>(E));
      for (auto& v : r.logits) v = nd(g);
      std::vector<int32_t> all(static_cast<size_t>(E));
      std::iota(all.begin(), all.end(), 0);
      std::shuffle(all.begin(), all.end(), g);
      r.ids.assign(all.begin(), all.begin() + k);
      std::sort(r.ids.begin(), r.ids.end());
      rows.push_back(r);
    }
  }
  // Extremes: the softplus_f(x) = x branch above 20 and a strongly negative logit.
  rows.push_back(Row{{25.0f, -3.0f, 0.5f, -14.0f, 1.0f, 21.0f, -1.0f}, {0, 3, 5}});
  // A repeated id (both slots depend on the same logit).
  rows.push_back(Row{{0.3f, -0.7f, 1.2f, 0.1f, -2.0f, 0.9f, 0.0f}, {2, 2, 5}});
  for (bool norm : {true, false}) {
    for (float lambda : {1.0f, 1.5f}) {
      for (size_t ri = 0; ri < rows.size(); ++ri) {
        const Row& r = rows[ri];
        const int k = int(r.ids.size());
        SCOPED_TRACE(testing::Message() << "norm=" << norm << " lambda=" << lambda << " row " << ri);
        std::vector<float> dw(static_cast<size_t>(k));
        for (auto& v : dw) v = nd(g);
        std::vector<float> dl(size_t(E), 7.0f);
        RouterBwdParams p{.T = 1,
                          .E = E,
                          .k = k,
                          .logits = r.logits.data(),
                          .ids = r.ids.data(),
                          .dweights = dw.data(),
                          .norm_topk_prob = norm,
                          .routed_scaling_factor = lambda,
                          .dlogits = dl.data()};
        ASSERT_EQ(router_backward_check(p), nullptr);
        router_backward(p);
        std::vector<double> ld(r.logits.begin(), r.logits.end());
        // Error scale: lambda * (|dw_i| / S + sum_j |dw_j| s_j / S^2) * sigmoid / (2 s), summed over slots.
        double S = 0, A = 0;
        for (int i = 0; i < k; ++i) {
          const double s = std::sqrt(softplus_d(ld[size_t(r.ids[size_t(i)])]));
          S += s;
          A += std::fabs(dw[size_t(i)]) * s;
        }
        for (int e = 0; e < E; ++e) {
          const bool chosen = std::find(r.ids.begin(), r.ids.end(), e) != r.ids.end();
          if (!chosen) {
            EXPECT_EQ(dl[size_t(e)], 0.0f) << "expert " << e << " was not chosen";
            continue;
          }
          const double h = 1e-5 * std::max(1.0, std::fabs(ld[size_t(e)]));
          auto lp = ld, lm = ld;
          lp[size_t(e)] += h;
          lm[size_t(e)] -= h;
          const auto wp = router_weights_d(lp, r.ids, norm, lambda),
                     wm = router_weights_d(lm, r.ids, norm, lambda);
          double fd = 0;
          for (int i = 0; i < k; ++i) fd += dw[size_t(i)] * (wp[size_t(i)] - wm[size_t(i)]) / (2 * h);
          const double s = std::sqrt(softplus_d(ld[size_t(e)]));
          double mag = 0;
          for (int i = 0; i < k; ++i)
            if (r.ids[size_t(i)] == e)
              mag += lambda * (norm ? std::fabs(dw[size_t(i)]) / S + A / (S * S) : std::fabs(dw[size_t(i)])) *
                     sigmoid_d(ld[size_t(e)]) / (2 * s);
          EXPECT_NEAR(dl[size_t(e)], fd, 1e-5 * mag + 1e-12) << "expert " << e;
        }
      }
    }
  }
}

TEST(RouterBackward, VanishingScoreGivesZeroNotNaN) {
  // softplus_f(-200) underflows to 0, so s = 0: the derivative sigmoid / (2 s) tends to 0 there.
  std::vector<float> logits = {-200.0f, 0.5f, 1.0f};
  // Normalised, S = s_2 alone and w_2 = 1 whatever logit 2 is: its gradient is (close to) 0 too.
  std::vector<int32_t> ids = {0, 2};
  std::vector<float> dw = {1.0f, -0.5f};
  for (bool norm : {true, false}) {
    std::vector<float> dl(3, 9.0f);
    router_backward(RouterBwdParams{.T = 1,
                                    .E = 3,
                                    .k = 2,
                                    .logits = logits.data(),
                                    .ids = ids.data(),
                                    .dweights = dw.data(),
                                    .norm_topk_prob = norm,
                                    .dlogits = dl.data()});
    EXPECT_EQ(dl[0], 0.0f) << norm;
    EXPECT_EQ(dl[1], 0.0f) << norm;
    ASSERT_TRUE(std::isfinite(dl[2])) << norm;
    if (norm)
      EXPECT_NEAR(dl[2], 0.0f, 1e-7f);
    else
      EXPECT_NEAR(dl[2], -0.5 * sigmoid_d(1.0) / (2 * std::sqrt(softplus_d(1.0))), 1e-6);
  }
}

TEST(RouterBackward, TokenAloneEqualsTokenInBatchAndThreadsInvariant) {
  auto g = rng_for("router_bwd_threads");
  const int64_t T = 700;
  const int E = 32, k = 4;
  std::normal_distribution<float> nd(0.0f, 1.5f);
  std::vector<float> logits(size_t(T * E)), dw(size_t(T * k));
  for (auto& v : logits) v = nd(g);
  for (auto& v : dw) v = nd(g);
  std::vector<int32_t> ids(size_t(T * k));
  for (int64_t t = 0; t < T; ++t)
    for (int i = 0; i < k; ++i) ids[size_t(t * k + i)] = int32_t((t + 7 * i) % E);
  for (int64_t t = 0; t < T; ++t) std::sort(ids.begin() + t * k, ids.begin() + (t + 1) * k);
  auto run = [&](int64_t t0, int64_t n, std::vector<float>& out) {
    out.assign(size_t(n * E), 0.0f);
    router_backward(RouterBwdParams{.T = n,
                                    .E = E,
                                    .k = k,
                                    .logits = logits.data() + t0 * E,
                                    .ids = ids.data() + t0 * k,
                                    .dweights = dw.data() + t0 * k,
                                    .norm_topk_prob = true,
                                    .routed_scaling_factor = 2.5f,
                                    .dlogits = out.data()});
  };
  std::vector<float> d1, d3, one;
  with_threads(1, [&] { run(0, T, d1); });
  with_threads(3, [&] { run(0, T, d3); });
  EXPECT_TRUE(bitwise_equal(d1, d3));
  EXPECT_FALSE(test::all_zero(d1));
  for (int64_t t : {0, 321, 699}) {
    run(t, 1, one);
    EXPECT_TRUE(bitwise_equal(one, std::vector<float>(d1.begin() + t * E, d1.begin() + (t + 1) * E))) << t;
  }
  RouterBwdParams bad{.T = 1, .E = 3, .k = 4};
  EXPECT_STREQ(router_backward_check(bad), "router_backward: k must be in [1, E]");
  std::vector<int32_t> bad_ids = {0, 3};
  bad = RouterBwdParams{.T = 1,
                        .E = 3,
                        .k = 2,
                        .logits = logits.data(),
                        .ids = bad_ids.data(),
                        .dweights = dw.data(),
                        .dlogits = d1.data()};
  EXPECT_STREQ(router_backward_check(bad), "router_backward: expert id out of range");
}

// ---- experts ------------------------------------------------------------------------------------

struct MoeCase {
  const char* name;
  int64_t T, D, I, Is;
  int E, k, n_shared;
  float L;  // swiglu_limit; < 0: picked near -L in a gap of the gate / up values (active clamps)
  bool clamp_shared;
  ReduceOrder order;
};

// Inputs and weights of one MoE layer; expert j < E is routed, E + s the shared expert s.
struct MoeSetup {
  MoeCase c;
  std::vector<float> x, weights, dout;
  std::vector<int32_t> ids;
  std::vector<std::vector<float>> w1, w3, w2;
  std::vector<ExpertWeights> ew;

  int64_t width(int j) const { return j < c.E ? c.I : c.Is; }

  explicit MoeSetup(const MoeCase& mc) : c(mc) {
    auto g = rng_for(c.name);
    x = test::randn_bf16(g, size_t(c.T * c.D));
    dout = test::randn_bf16(g, size_t(c.T * c.D));
    std::uniform_real_distribution<float> wd(0.2f, 1.5f);
    weights.resize(size_t(c.T * c.k));
    for (auto& v : weights) v = wd(g);
    ids.resize(size_t(c.T * c.k));
    std::vector<int32_t> all(size_t(c.E));
    for (int64_t t = 0; t < c.T; ++t) {
      std::iota(all.begin(), all.end(), 0);
      std::shuffle(all.begin(), all.end(), g);
      std::sort(all.begin(), all.begin() + c.k);
      std::copy(all.begin(), all.begin() + c.k, ids.begin() + t * c.k);
    }
    for (int j = 0; j < c.E + c.n_shared; ++j) {
      const int64_t I = width(j);
      w1.push_back(test::randn_bf16(g, size_t(I * c.D), 1.0f / std::sqrt(float(c.D))));
      w3.push_back(test::randn_bf16(g, size_t(I * c.D), 1.0f / std::sqrt(float(c.D))));
      w2.push_back(test::randn_bf16(g, size_t(c.D * I), 1.0f / std::sqrt(float(I))));
    }
    for (int j = 0; j < c.E + c.n_shared; ++j)
      ew.push_back(ExpertWeights{w1[size_t(j)].data(), w3[size_t(j)].data(), w2[size_t(j)].data()});
  }

  MoeParams fwd(int64_t t0, int64_t n) const {
    return MoeParams{.T = n,
                     .D = c.D,
                     .I = c.I,
                     .I_shared = c.Is,
                     .E = c.E,
                     .k = c.k,
                     .n_shared = c.n_shared,
                     .x = x.data() + t0 * c.D,
                     .ids = ids.data() + t0 * c.k,
                     .weights = weights.data() + t0 * c.k,
                     .experts = ew.data(),
                     .shared = c.n_shared > 0 ? ew.data() + c.E : nullptr,
                     .swiglu_limit = c.L,
                     .clamp_shared = c.clamp_shared,
                     .order = c.order};
  }
};

struct MoeOut {
  std::vector<float> dx, dweights;
  std::vector<std::vector<float>> dw1, dw3, dw2;  // E + n_shared
};

// Runs the backward of tokens [t0, t0 + n), the outputs starting from `init` (zeros when null).
MoeOut run_backward(const MoeSetup& s, int64_t t0, int64_t n, const MoeOut* init = nullptr) {
  const MoeCase& c = s.c;
  MoeOut o;
  if (init) {
    o = *init;
  } else {
    o.dx.assign(size_t(n * c.D), 0.0f);
    o.dweights.assign(size_t(n * c.k), 0.0f);
    for (int j = 0; j < c.E + c.n_shared; ++j) {
      o.dw1.emplace_back(size_t(s.width(j) * c.D), 0.0f);
      o.dw3.emplace_back(size_t(s.width(j) * c.D), 0.0f);
      o.dw2.emplace_back(size_t(s.width(j) * c.D), 0.0f);
    }
  }
  std::vector<ExpertGrads> gr;
  for (int j = 0; j < c.E + c.n_shared; ++j)
    gr.push_back(ExpertGrads{o.dw1[size_t(j)].data(), o.dw3[size_t(j)].data(), o.dw2[size_t(j)].data()});
  MoeBwdParams p{.fwd = s.fwd(t0, n),
                 .dout = s.dout.data() + t0 * c.D,
                 .dx = o.dx.data(),
                 .dweights = o.dweights.data(),
                 .grads = gr.data(),
                 .shared_grads = c.n_shared > 0 ? gr.data() + c.E : nullptr};
  EXPECT_EQ(moe_experts_backward_check(p), nullptr);
  moe_experts_backward(p);
  return o;
}

// The float64 MoE layer, unrounded, with the clamp: loss = sum_t dout[t] . out[t].
struct MoeRef {
  const MoeCase& c;
  std::vector<double> x, weights, dout;
  std::vector<int32_t> ids;
  std::vector<std::vector<double>> w1, w3, w2;
  double L;

  explicit MoeRef(const MoeSetup& s)
      : c(s.c),
        x(s.x.begin(), s.x.end()),
        weights(s.weights.begin(), s.weights.end()),
        dout(s.dout.begin(), s.dout.end()),
        ids(s.ids),
        L(s.c.L) {
    for (size_t j = 0; j < s.w1.size(); ++j) {
      w1.emplace_back(s.w1[j].begin(), s.w1[j].end());
      w3.emplace_back(s.w3[j].begin(), s.w3[j].end());
      w2.emplace_back(s.w2[j].begin(), s.w2[j].end());
    }
  }
  int64_t width(int j) const { return j < c.E ? c.I : c.Is; }

  // The gate and up values of expert j on token t.
  void gate_up(int j, int64_t t, std::vector<double>& g, std::vector<double>& u) const {
    const int64_t I = width(j);
    g.assign(size_t(I), 0.0);
    u.assign(size_t(I), 0.0);
    for (int64_t i = 0; i < I; ++i)
      for (int64_t d = 0; d < c.D; ++d) {
        g[size_t(i)] += x[size_t(t * c.D + d)] * w1[size_t(j)][size_t(i * c.D + d)];
        u[size_t(i)] += x[size_t(t * c.D + d)] * w3[size_t(j)][size_t(i * c.D + d)];
      }
  }
  // dout[t] . expert j's output on token t (before the routing weight).
  double expert_term(int j, int64_t t, bool clamp) const {
    std::vector<double> g, u;
    gate_up(j, t, g, u);
    double r = 0;
    for (int64_t i = 0; i < width(j); ++i) {
      double gi = g[size_t(i)], ui = u[size_t(i)];
      if (clamp && L > 0) {
        gi = std::min(gi, L);
        ui = std::clamp(ui, -L, L);
      }
      const double a = silu_d(gi) * ui;
      for (int64_t d = 0; d < c.D; ++d)
        r += dout[size_t(t * c.D + d)] * w2[size_t(j)][size_t(d * width(j) + i)] * a;
    }
    return r;
  }
  // sum_i |dout[t] . w2 column i| * |a_i| of expert j on token t: the size of the terms that
  // d loss / d weight sums.
  double expert_term_abs(int j, int64_t t) const {
    std::vector<double> g, u;
    gate_up(j, t, g, u);
    double r = 0;
    for (int64_t i = 0; i < width(j); ++i) {
      const double a = silu_d(std::min(g[size_t(i)], L)) * std::clamp(u[size_t(i)], -L, L);
      double da = 0;
      for (int64_t d = 0; d < c.D; ++d)
        da += dout[size_t(t * c.D + d)] * w2[size_t(j)][size_t(d * width(j) + i)];
      r += std::fabs(da * a);
    }
    return r;
  }
  double loss() const {
    double l = 0;
    for (int64_t t = 0; t < c.T; ++t) {
      for (int i = 0; i < c.k; ++i)
        l += weights[size_t(t * c.k + i)] * expert_term(ids[size_t(t * c.k + i)], t, true);
      for (int s = 0; s < c.n_shared; ++s) l += expert_term(c.E + s, t, c.clamp_shared);
    }
    return l;
  }
  double fd(double& v) {
    const double h = 1e-4, v0 = v;
    v = v0 + h;
    const double lp = loss();
    v = v0 - h;
    const double lm = loss();
    v = v0;
    return (lp - lm) / (2 * h);
  }
};

// A limit near `target` in the middle of a gap of the gate values and the |up| values of every
// expert that clamps, at least `gap` wide, so that neither the bf16 rounding of g and u nor a finite
// difference step crosses a clamp boundary.
float pick_limit(const MoeRef& r, double target, double gap) {
  std::vector<double> v;
  std::vector<double> g, u;
  for (int64_t t = 0; t < r.c.T; ++t) {
    std::vector<int> js;
    for (int i = 0; i < r.c.k; ++i) js.push_back(r.ids[size_t(t * r.c.k + i)]);
    if (r.c.clamp_shared)
      for (int s = 0; s < r.c.n_shared; ++s) js.push_back(r.c.E + s);
    for (int j : js) {
      r.gate_up(j, t, g, u);
      for (size_t i = 0; i < g.size(); ++i) {
        v.push_back(g[i]);
        v.push_back(std::fabs(u[i]));
      }
    }
  }
  std::sort(v.begin(), v.end());
  double best = -1;
  for (size_t i = 0; i + 1 < v.size(); ++i) {
    if (v[i] <= 0 || v[i + 1] - v[i] < gap) continue;
    // bf16-exact limit near the gap's middle
    const double mid = num::bf16_round(float(0.5 * (v[i] + v[i + 1])));
    if (mid - v[i] < gap / 4 || v[i + 1] - mid < gap / 4) continue;
    if (best < 0 || std::fabs(mid - target) < std::fabs(best - target)) best = mid;
  }
  return float(best);
}

struct Err {
  double max_err = 0, max_ref = 0;
};

// |got - fd| <= rel * |fd| + abs_frac * max(max |fd| over the tensor, mag[i]). The backward keeps the
// forward's bf16 roundings of g, u and a (straight-through), which the float64 reference does not
// have: each is a relative error of up to 2^-9, and sums over units and tokens can cancel, hence the
// scale terms (mag: the size of the terms an element sums, where the tensor's own scale can be small).
void expect_close(const std::vector<float>& got, const std::vector<double>& fd, const std::string& what,
                  const std::vector<double>& mag = {}, double rel = 2e-2, double abs_frac = 1e-2) {
  ASSERT_EQ(got.size(), fd.size());
  double scale = 0;
  for (double v : fd) scale = std::max(scale, std::fabs(v));
  double worst = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    const double err = std::fabs(got[i] - fd[i]);
    worst = std::max(worst, err / (scale > 0 ? scale : 1));
    const double s = std::max(scale, mag.empty() ? 0.0 : mag[i]);
    EXPECT_NEAR(got[i], fd[i], rel * std::fabs(fd[i]) + abs_frac * s + 1e-9) << what << " [" << i << "]";
  }
  std::printf("  %-14s max |err| / max |fd| = %.2e  (max |fd| %.3g)\n", what.c_str(), worst, scale);
}

const MoeCase kFdCases[] = {
    {"moe_plain", 9, 9, 5, 6, 4, 2, 1, 10.0f, false, {}},
    {"moe_clamped", 9, 9, 5, 3, 4, 2, 2, -0.5f, true, {}},
    {"moe_clamped_routed_only", 7, 11, 6, 7, 5, 3, 1, -0.5f, false, {8}},
    {"moe_one_token", 1, 5, 3, 3, 1, 1, 0, 10.0f, false, {}},
    {"moe_no_shared", 6, 17, 4, 4, 3, 3, 0, -0.7f, false, {}},
};

TEST(MoeExpertsBackward, MatchesFiniteDifferencesOfFloat64Forward) {
  for (MoeCase c : kFdCases) {
    SCOPED_TRACE(c.name);
    if (c.L < 0) {
      MoeSetup probe(c);
      MoeRef pr(probe);
      c.L = pick_limit(pr, -c.L, 0.012);
      ASSERT_GT(c.L, 0.0f) << "no gap found";
    }
    std::printf("%s (swiglu_limit %g)\n", c.name, c.L);
    MoeSetup s(c);
    MoeRef r(s);
    if (c.L < 1.0f) {  // the clamps really are active on both sides
      int g_clamped = 0, u_clamped = 0;
      std::vector<double> g, u;
      for (int64_t t = 0; t < c.T; ++t) {
        r.gate_up(s.ids[size_t(t * c.k)], t, g, u);
        for (size_t i = 0; i < g.size(); ++i) {
          g_clamped += g[i] > c.L;
          u_clamped += std::fabs(u[i]) > c.L;
        }
      }
      EXPECT_GT(g_clamped, 0);
      EXPECT_GT(u_clamped, 0);
    }
    const MoeOut o = run_backward(s, 0, c.T);
    std::vector<double> fx(s.x.size()), fw(s.weights.size());
    for (size_t i = 0; i < fx.size(); ++i) fx[i] = r.fd(r.x[i]);
    for (size_t i = 0; i < fw.size(); ++i) fw[i] = r.fd(r.weights[i]);
    expect_close(o.dx, fx, "dx");
    std::vector<double> wmag(fw.size());
    for (int64_t t = 0; t < c.T; ++t)
      for (int i = 0; i < c.k; ++i)
        wmag[size_t(t * c.k + i)] = r.expert_term_abs(s.ids[size_t(t * c.k + i)], t);
    expect_close(o.dweights, fw, "dweights", wmag);
    for (int j = 0; j < c.E + c.n_shared; ++j) {
      const std::string tag = (j < c.E ? "e" : "shared") + std::to_string(j < c.E ? j : j - c.E);
      std::vector<double> f1(r.w1[size_t(j)].size()), f3(f1.size()), f2(r.w2[size_t(j)].size());
      for (size_t i = 0; i < f1.size(); ++i) f1[i] = r.fd(r.w1[size_t(j)][i]);
      for (size_t i = 0; i < f3.size(); ++i) f3[i] = r.fd(r.w3[size_t(j)][i]);
      for (size_t i = 0; i < f2.size(); ++i) f2[i] = r.fd(r.w2[size_t(j)][i]);
      expect_close(o.dw1[size_t(j)], f1, tag + ".dw1");
      expect_close(o.dw3[size_t(j)], f3, tag + ".dw3");
      expect_close(o.dw2[size_t(j)], f2, tag + ".dw2");
    }
    EXPECT_FALSE(test::all_zero(o.dx));
  }
}

// One token, exact dyadic values: the gate and up values land on, above and below the limit, so the
// clamp decisions are known; the gradient is 0 exactly where a clamp cut it, passes at the boundary
// values themselves, and the unclamped shared expert ignores the limit.
TEST(MoeExpertsBackward, ClampCutsTheGradientExceptAtTheBoundary) {
  const float L = 0.5f;
  const int64_t D = 2, I = 4;
  std::vector<float> x = {1.0f, 0.5f};
  // unit: 0 g = 1 (> L), u = 0.25;  1 g = 0.25, u = 1 (> L);  2 g = -0.25, u = -1 (< -L);
  //       3 g = 0.5 = L, u = -0.5 = -L (boundaries)
  std::vector<float> w1 = {1.0f, 0.0f, 0.25f, 0.0f, -0.25f, 0.0f, 0.0f, 1.0f};
  std::vector<float> w3 = {0.25f, 0.0f, 1.0f, 0.0f, -1.0f, 0.0f, 0.0f, -1.0f};
  std::vector<float> w2 = {0.5f, -0.25f, 0.75f, 1.0f, -0.5f, 0.25f, 0.5f, -1.0f};  // [D, I]
  std::vector<float> dout = {1.0f, -0.5f};
  std::vector<int32_t> ids = {0};
  std::vector<float> weight = {0.75f};
  const ExpertWeights ew{w1.data(), w3.data(), w2.data()};
  std::vector<float> dx(2, 0.0f), dwt(1, 0.0f), e1(8, 0.0f), e3(8, 0.0f), e2(8, 0.0f), s1(8, 0.0f),
      s3(8, 0.0f), s2(8, 0.0f);
  const ExpertGrads eg{e1.data(), e3.data(), e2.data()}, sg{s1.data(), s3.data(), s2.data()};
  moe_experts_backward(MoeBwdParams{.fwd = MoeParams{.T = 1,
                                                     .D = D,
                                                     .I = I,
                                                     .E = 1,
                                                     .k = 1,
                                                     .n_shared = 1,
                                                     .x = x.data(),
                                                     .ids = ids.data(),
                                                     .weights = weight.data(),
                                                     .experts = &ew,
                                                     .shared = &ew,
                                                     .swiglu_limit = L,
                                                     .clamp_shared = false},
                                    .dout = dout.data(),
                                    .dx = dx.data(),
                                    .dweights = dwt.data(),
                                    .grads = &eg,
                                    .shared_grads = &sg});
  const double g[4] = {1.0, 0.25, -0.25, 0.5}, u[4] = {0.25, 1.0, -1.0, -0.5};
  for (int i = 0; i < 4; ++i) {
    const double da = dout[0] * w2[size_t(i)] + dout[1] * w2[size_t(I + i)];
    // routed, clamped: g_c = min(g, L), u_c = clamp(u)
    const double gc = std::min(g[i], double(L)), uc = std::clamp(u[i], -double(L), double(L));
    const double sg_c = sigmoid_d(gc);
    const double dg = g[i] <= L ? weight[0] * da * uc * sg_c * (1 + gc * (1 - sg_c)) : 0.0;
    const double du = std::fabs(u[i]) <= L ? weight[0] * da * silu_d(gc) : 0.0;
    // shared, unclamped
    const double ss = sigmoid_d(g[i]);
    const double dg_s = da * u[i] * ss * (1 + g[i] * (1 - ss)), du_s = da * silu_d(g[i]);
    for (int d = 0; d < 2; ++d) {
      const size_t q = size_t(i * D + d);
      EXPECT_NEAR(e1[q], dg * x[size_t(d)], 1e-6) << "routed dw1 unit " << i;
      EXPECT_NEAR(e3[q], du * x[size_t(d)], 1e-6) << "routed dw3 unit " << i;
      EXPECT_NEAR(s1[q], dg_s * x[size_t(d)], 1e-6) << "shared dw1 unit " << i;
      EXPECT_NEAR(s3[q], du_s * x[size_t(d)], 1e-6) << "shared dw3 unit " << i;
    }
  }
  // Exactly zero where the clamp cut, non-zero at the boundaries.
  EXPECT_EQ(e1[0], 0.0f);
  EXPECT_EQ(e1[1], 0.0f);
  EXPECT_EQ(e3[2], 0.0f);
  EXPECT_EQ(e3[3], 0.0f);
  EXPECT_EQ(e3[4], 0.0f);
  EXPECT_EQ(e3[5], 0.0f);
  EXPECT_NE(e1[6], 0.0f);  // g == L
  EXPECT_NE(e3[6], 0.0f);  // u == -L
  EXPECT_NE(s1[0], 0.0f);
  EXPECT_NE(s3[2], 0.0f);
}

const MoeCase kBigCase = {"moe_big", 96, 128, 96, 80, 8, 2, 1, 0.8f, true, {}};

TEST(MoeExpertsBackward, TokenAloneEqualsTokenInBatch) {
  for (const MoeCase& c : {kFdCases[1], kFdCases[2], kBigCase}) {
    SCOPED_TRACE(c.name);
    MoeCase cc = c;
    if (cc.L < 0) cc.L = -cc.L;
    MoeSetup s(cc);
    const MoeOut all = run_backward(s, 0, cc.T);
    for (int64_t t : {int64_t(0), cc.T / 2, cc.T - 1}) {
      const MoeOut one = run_backward(s, t, 1);
      EXPECT_TRUE(bitwise_equal(
          one.dx, std::vector<float>(all.dx.begin() + t * cc.D, all.dx.begin() + (t + 1) * cc.D)))
          << "dx of token " << t;
      EXPECT_TRUE(bitwise_equal(one.dweights, std::vector<float>(all.dweights.begin() + t * cc.k,
                                                                 all.dweights.begin() + (t + 1) * cc.k)))
          << "dweights of token " << t;
    }
  }
}

TEST(MoeExpertsBackward, ThreadCountInvariant) {
  MoeSetup s(kBigCase);
  MoeOut o1, o3;
  with_threads(1, [&] { o1 = run_backward(s, 0, kBigCase.T); });
  with_threads(3, [&] { o3 = run_backward(s, 0, kBigCase.T); });
  EXPECT_TRUE(bitwise_equal(o1.dx, o3.dx));
  EXPECT_TRUE(bitwise_equal(o1.dweights, o3.dweights));
  for (size_t j = 0; j < o1.dw1.size(); ++j) {
    EXPECT_TRUE(bitwise_equal(o1.dw1[j], o3.dw1[j])) << j;
    EXPECT_TRUE(bitwise_equal(o1.dw3[j], o3.dw3[j])) << j;
    EXPECT_TRUE(bitwise_equal(o1.dw2[j], o3.dw2[j])) << j;
  }
  EXPECT_FALSE(test::all_zero(o1.dw1[0]));
}

// dx and the weight gradients are accumulated with one add per element; dweights is overwritten.
TEST(MoeExpertsBackward, AccumulatesOnceAndFrozenWeightsAreSkipped) {
  MoeCase c = kFdCases[1];
  c.L = 0.5f;
  MoeSetup s(c);
  const MoeOut zero = run_backward(s, 0, c.T);
  auto g = rng_for("moe_prefill");
  MoeOut init = zero;
  auto fill = [&](std::vector<float>& v) { v = test::randn_bf16(g, v.size()); };
  fill(init.dx);
  fill(init.dweights);
  for (auto* vs : {&init.dw1, &init.dw3, &init.dw2})
    for (auto& v : *vs) fill(v);
  const MoeOut acc = run_backward(s, 0, c.T, &init);
  auto sum = [](const std::vector<float>& a, const std::vector<float>& b) {
    std::vector<float> r(a.size());
    for (size_t i = 0; i < a.size(); ++i) r[i] = a[i] + b[i];
    return r;
  };
  EXPECT_TRUE(bitwise_equal(acc.dx, sum(init.dx, zero.dx)));
  EXPECT_TRUE(bitwise_equal(acc.dweights, zero.dweights));
  for (size_t j = 0; j < zero.dw1.size(); ++j) {
    EXPECT_TRUE(bitwise_equal(acc.dw1[j], sum(init.dw1[j], zero.dw1[j]))) << j;
    EXPECT_TRUE(bitwise_equal(acc.dw3[j], sum(init.dw3[j], zero.dw3[j]))) << j;
    EXPECT_TRUE(bitwise_equal(acc.dw2[j], sum(init.dw2[j], zero.dw2[j]))) << j;
  }

  // Frozen: no routed gradients at all, and the first shared expert's w1 frozen.
  std::vector<float> dx(zero.dx.size(), 0.0f), dw(zero.dweights.size(), 0.0f),
      s3(zero.dw3[size_t(c.E)].size(), 0.0f), s2(zero.dw2[size_t(c.E)].size(), 0.0f), t1(s3.size(), 0.0f),
      t3(s3.size(), 0.0f), t2(s2.size(), 0.0f);
  std::vector<ExpertGrads> sg = {ExpertGrads{nullptr, s3.data(), s2.data()},
                                 ExpertGrads{t1.data(), t3.data(), t2.data()}};
  MoeBwdParams p{.fwd = s.fwd(0, c.T),
                 .dout = s.dout.data(),
                 .dx = dx.data(),
                 .dweights = dw.data(),
                 .grads = nullptr,
                 .shared_grads = sg.data()};
  moe_experts_backward(p);
  EXPECT_TRUE(bitwise_equal(dx, zero.dx));
  EXPECT_TRUE(bitwise_equal(dw, zero.dweights));
  EXPECT_TRUE(bitwise_equal(s3, zero.dw3[size_t(c.E)]));
  EXPECT_TRUE(bitwise_equal(s2, zero.dw2[size_t(c.E)]));
  EXPECT_TRUE(bitwise_equal(t1, zero.dw1[size_t(c.E + 1)]));
}

TEST(MoeExpertsBackward, ChecksNameTheProblem) {
  MoeSetup s(kFdCases[0]);
  MoeBwdParams p{.fwd = s.fwd(0, s.c.T), .dout = s.dout.data()};
  EXPECT_EQ(moe_experts_backward_check(p), nullptr);
  auto bad = p;
  bad.dout = nullptr;
  EXPECT_STREQ(moe_experts_backward_check(bad), "moe_backward: dout is null");
  std::vector<int32_t> ids = s.ids;
  std::swap(ids[0], ids[1]);
  bad = p;
  bad.fwd.ids = ids.data();
  EXPECT_STREQ(moe_experts_backward_check(bad), "moe_backward: the ids of a token must be ascending");
  ids = s.ids;
  ids[3] = s.c.E;
  bad.fwd.ids = ids.data();
  EXPECT_STREQ(moe_experts_backward_check(bad), "moe_backward: expert id out of range");
  bad = p;
  bad.fwd.k = s.c.E + 1;
  EXPECT_STREQ(moe_experts_backward_check(bad), "moe: need E >= 1 and 1 <= k <= E");
}

}  // namespace
}  // namespace dsv4
