// MoE router and experts (MODEL.md §3.9): selection semantics, weights, hash and forced routing,
// experts against a float64 reference and against the documented operation order (bitwise), clamp
// variants, batch invariance and empty expert groups.
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <string>
#include <vector>

#include "kernels/moe.h"
#include "kernels/row_sums.h"
#include "test_util.h"

namespace dsv4 {
namespace {

using test::bitwise_equal;
using test::rng_for;

const float kInf = std::numeric_limits<float>::infinity();

struct RouterOut {
  std::vector<int32_t> ids;
  std::vector<float> weights, margin, scores;
};

RouterOut run_router(RouterParams p) {
  RouterOut r;
  r.ids.assign(size_t(p.T * p.k), -7);
  r.weights.assign(size_t(p.T * p.k), 0.0f);
  r.margin.assign(size_t(p.T), 0.0f);
  r.scores.assign(size_t(p.T * p.E), 0.0f);
  p.ids = r.ids.data();
  p.weights = r.weights.data();
  p.margin = r.margin.data();
  p.scores = r.scores.data();
  EXPECT_EQ(router_check(p), nullptr);
  router(p);
  return r;
}

double sqrt_softplus_d(double z) {
  return std::sqrt(z > 20 ? z : std::log1p(std::exp(z)));
}

TEST(Router, LearnedSelectionWeightsAndMargin) {
  auto g = rng_for("router-learned");
  const int64_t T = 40;
  const int E = 16, k = 4;
  const auto logits = test::randn_bf16(g, size_t(T * E), 2.0f);
  const auto bias = test::randn_bf16(g, size_t(E), 0.3f);
  RouterParams p;
  p.T = T;
  p.E = E;
  p.k = k;
  p.logits = logits.data();
  p.bias = bias.data();
  p.routed_scaling_factor = 1.5f;
  const auto r = run_router(p);
  for (int64_t t = 0; t < T; ++t) {
    // Scores: sqrt(softplus), checked against float64.
    for (int e = 0; e < E; ++e) {
      const double want = sqrt_softplus_d(logits[size_t(t * E + e)]);
      ASSERT_NEAR(r.scores[size_t(t * E + e)], want, 1e-6 * want);
    }
    // Selection on score + bias: larger first, then smaller id; written ascending.
    std::vector<float> sel(static_cast<size_t>(E));
    for (int e = 0; e < E; ++e) sel[size_t(e)] = r.scores[size_t(t * E + e)] + bias[size_t(e)];
    std::vector<int32_t> order(static_cast<size_t>(E));
    std::iota(order.begin(), order.end(), 0);
    std::sort(order.begin(), order.end(), [&](int32_t a, int32_t b) {
      return sel[size_t(a)] != sel[size_t(b)] ? sel[size_t(a)] > sel[size_t(b)] : a < b;
    });
    std::vector<int32_t> want(order.begin(), order.begin() + k);
    std::sort(want.begin(), want.end());
    ASSERT_EQ(std::vector<int32_t>(r.ids.begin() + t * k, r.ids.begin() + (t + 1) * k), want) << t;
    ASSERT_EQ(r.margin[size_t(t)], sel[size_t(order[size_t(k - 1)])] - sel[size_t(order[size_t(k)])]);
    // Weights from the unbiased scores, normalised, then scaled.
    double sum = 0;
    for (int32_t e : want) sum += sqrt_softplus_d(logits[size_t(t * E + e)]);
    for (int i = 0; i < k; ++i) {
      const double w = sqrt_softplus_d(logits[size_t(t * E + want[size_t(i)])]) / sum * 1.5;
      ASSERT_NEAR(r.weights[size_t(t * k + i)], w, 1e-6 * w);
    }
  }
}

TEST(Router, BiasOnlySelects) {
  const int E = 8, k = 2;
  std::vector<float> logits = {3.0f, 2.0f, 1.0f, 0.0f, -1.0f, -2.0f, -3.0f, -4.0f};
  std::vector<float> bias(static_cast<size_t>(E), 0.0f);
  bias[7] = 100.0f;  // expert 7 always selected, yet weighted by its own (small) score
  RouterParams p;
  p.T = 1;
  p.E = E;
  p.k = k;
  p.logits = logits.data();
  p.bias = bias.data();
  const auto r = run_router(p);
  EXPECT_EQ(r.ids, (std::vector<int32_t>{0, 7}));
  const double s0 = sqrt_softplus_d(3.0), s7 = sqrt_softplus_d(-4.0);
  EXPECT_NEAR(r.weights[0], s0 / (s0 + s7), 1e-6);
  EXPECT_NEAR(r.weights[1], s7 / (s0 + s7), 1e-6);
  EXPECT_GT(r.weights[0], r.weights[1]);
}

TEST(Router, TiesGoToTheSmallerId) {
  const int E = 8, k = 3;
  std::vector<float> logits(static_cast<size_t>(E), 0.5f), bias(static_cast<size_t>(E), 0.0f);
  logits[6] = 0.25f;
  RouterParams p;
  p.T = 1;
  p.E = E;
  p.k = k;
  p.logits = logits.data();
  p.bias = bias.data();
  p.routed_scaling_factor = 2.5f;
  const auto r = run_router(p);
  EXPECT_EQ(r.ids, (std::vector<int32_t>{0, 1, 2}));
  EXPECT_EQ(r.margin[0], 0.0f);
  for (float w : r.weights) EXPECT_NEAR(w, 2.5 / 3.0, 1e-6);
}

TEST(Router, WithoutNormalisation) {
  const int E = 4, k = 2;
  std::vector<float> logits = {1.0f, -1.0f, 2.0f, 0.0f}, bias(4, 0.0f);
  RouterParams p;
  p.T = 1;
  p.E = E;
  p.k = k;
  p.logits = logits.data();
  p.bias = bias.data();
  p.norm_topk_prob = false;
  p.routed_scaling_factor = 1.5f;
  const auto r = run_router(p);
  EXPECT_EQ(r.ids, (std::vector<int32_t>{0, 2}));
  EXPECT_NEAR(r.weights[0], sqrt_softplus_d(1.0) * 1.5, 1e-6);
  EXPECT_NEAR(r.weights[1], sqrt_softplus_d(2.0) * 1.5, 1e-6);
}

TEST(Router, HashLayersIgnoreScoresAndBias) {
  auto g = rng_for("router-hash");
  const int64_t T = 6;
  const int E = 8, k = 3, V = 10;
  const auto logits = test::randn_bf16(g, size_t(T * E), 2.0f);
  std::vector<float> bias(static_cast<size_t>(E), 0.0f);
  bias[0] = bias[1] = 1000.0f;  // would dominate a learned selection
  std::vector<int32_t> table(size_t(V * k));
  for (int v = 0; v < V; ++v)  // unsorted rows
    for (int i = 0; i < k; ++i) table[size_t(v * k + i)] = int32_t((7 - v - 2 * i + 3 * E) % E);
  const std::vector<int32_t> tokens = {3, 9, 0, 3, 5, 1};
  RouterParams p;
  p.T = T;
  p.E = E;
  p.k = k;
  p.logits = logits.data();
  p.bias = bias.data();
  p.tid2eid = table.data();
  p.tokens = tokens.data();
  const auto r = run_router(p);
  for (int64_t t = 0; t < T; ++t) {
    std::vector<int32_t> want(table.begin() + tokens[size_t(t)] * k,
                              table.begin() + (tokens[size_t(t)] + 1) * k);
    std::sort(want.begin(), want.end());
    ASSERT_EQ(std::vector<int32_t>(r.ids.begin() + t * k, r.ids.begin() + (t + 1) * k), want);
    EXPECT_EQ(r.margin[size_t(t)], kInf);
    double sum = 0;
    for (int32_t e : want) sum += sqrt_softplus_d(logits[size_t(t * E + e)]);
    for (int i = 0; i < k; ++i)
      EXPECT_NEAR(r.weights[size_t(t * k + i)],
                  sqrt_softplus_d(logits[size_t(t * E + want[size_t(i)])]) / sum, 1e-6);
  }
}

TEST(Router, ForcedIdsAndTheirMargin) {
  const int E = 6, k = 2;
  std::vector<float> logits = {0.0f, 1.0f, 2.0f, 3.0f, 4.0f, 5.0f}, bias(6, 0.0f);
  const std::vector<int32_t> forced = {4, 1};
  RouterParams p;
  p.T = 1;
  p.E = E;
  p.k = k;
  p.logits = logits.data();
  p.bias = bias.data();
  p.forced = forced.data();
  const auto r = run_router(p);
  EXPECT_EQ(r.ids, (std::vector<int32_t>{1, 4}));
  const auto& s = r.scores;
  EXPECT_EQ(r.margin[0], s[1] - s[5]);  // worst forced minus best other: negative
  EXPECT_LT(r.margin[0], 0.0f);
  EXPECT_NEAR(r.weights[0], sqrt_softplus_d(1.0) / (sqrt_softplus_d(1.0) + sqrt_softplus_d(4.0)), 1e-6);
}

// ---- experts ----------------------------------------------------------------------------------

struct ExpertData {
  int64_t D, I;
  std::vector<float> w1, w3, w2;
  ExpertData(std::mt19937_64& g, int64_t D_, int64_t I_) : D(D_), I(I_) {
    w1 = test::randn_bf16(g, size_t(I * D), 0.15f);
    w3 = test::randn_bf16(g, size_t(I * D), 0.15f);
    w2 = test::randn_bf16(g, size_t(D * I), 0.15f);
  }
  ExpertWeights view() const { return {w1.data(), w3.data(), w2.data()}; }
};

struct MoeCase {
  int64_t T, D = 64, I = 48, I_shared = 0;
  int E = 8, k = 2, n_shared = 1;
  float L = 10.0f;
  bool clamp_shared = false;
  bool round_each = false;  // MoeParams::round_each
  ReduceOrder order{};
  std::vector<float> x, weights;
  std::vector<int32_t> ids;
  std::vector<ExpertData> experts, shared;

  MoeCase(const std::string& name, int64_t T_, int E_ = 8, int k_ = 2, int n_shared_ = 1,
          int64_t I_shared_ = 0, int64_t D_ = 64)
      : T(T_), D(D_), I_shared(I_shared_), E(E_), k(k_), n_shared(n_shared_) {
    auto g = rng_for(name);
    x = test::randn_bf16(g, size_t(T * D));
    for (int e = 0; e < E; ++e) experts.emplace_back(g, D, I);
    for (int s = 0; s < n_shared; ++s) shared.emplace_back(g, D, I_shared > 0 ? I_shared : I);
    std::uniform_real_distribution<float> u(0.1f, 1.5f);
    for (int64_t t = 0; t < T; ++t) {
      std::vector<int32_t> all(static_cast<size_t>(E));
      std::iota(all.begin(), all.end(), 0);
      std::shuffle(all.begin(), all.end(), g);
      std::sort(all.begin(), all.begin() + k);
      for (int i = 0; i < k; ++i) {
        ids.push_back(all[size_t(i)]);
        weights.push_back(u(g));
      }
    }
  }

  std::vector<float> run(uint64_t* out_sums = nullptr) const {
    std::vector<ExpertWeights> ev, sv;
    for (const auto& e : experts) ev.push_back(e.view());
    for (const auto& s : shared) sv.push_back(s.view());
    std::vector<float> out(size_t(T * D), -1.0f);
    MoeParams p;
    p.T = T;
    p.D = D;
    p.I = I;
    p.I_shared = I_shared;
    p.E = E;
    p.k = k;
    p.n_shared = n_shared;
    p.x = x.data();
    p.ids = ids.data();
    p.weights = weights.data();
    p.experts = ev.data();
    p.shared = sv.data();
    p.swiglu_limit = L;
    p.clamp_shared = clamp_shared;
    p.round_each = round_each;
    p.order = order;
    p.out = out.data();
    p.out_sums = out_sums;
    EXPECT_EQ(moe_check(p), nullptr);
    moe_experts(p);
    return out;
  }

  // Float64 SwiGLU with bf16 roundings at the spec's storage points; adds y into acc, |terms| into mag.
  void expert_d(const ExpertData& e, const float* xt, double w, bool weighted, bool clamp,
                std::vector<double>& acc, std::vector<double>& mag) const {
    std::vector<double> a(static_cast<size_t>(e.I));
    for (int64_t n = 0; n < e.I; ++n) {
      double gd = 0, ud = 0;
      for (int64_t d = 0; d < D; ++d) {
        gd += double(xt[d]) * e.w1[size_t(n * D + d)];
        ud += double(xt[d]) * e.w3[size_t(n * D + d)];
      }
      double gv = num::bf16_round(float(gd)), uv = num::bf16_round(float(ud));
      if (clamp && L > 0) {
        gv = std::min(gv, double(L));  // gate: from above only
        uv = std::clamp(uv, -double(L), double(L));
      }
      const double h = gv / (1.0 + std::exp(-gv)) * uv;
      a[size_t(n)] = num::bf16_round(float(weighted ? w * h : h));
    }
    for (int64_t d = 0; d < D; ++d)
      for (int64_t n = 0; n < e.I; ++n) {
        const double term = a[size_t(n)] * e.w2[size_t(d * e.I + n)];
        acc[size_t(d)] += term;
        mag[size_t(d)] += std::fabs(term);
      }
  }

  void expect_matches_float64(const std::vector<float>& out) const {
    for (int64_t t = 0; t < T; ++t) {
      std::vector<double> acc(static_cast<size_t>(D), 0.0), mag(static_cast<size_t>(D), 0.0);
      for (int i = 0; i < k; ++i)
        expert_d(experts[size_t(ids[size_t(t * k + i)])], x.data() + t * D, weights[size_t(t * k + i)], true,
                 true, acc, mag);
      for (const auto& s : shared) expert_d(s, x.data() + t * D, 1.0, false, clamp_shared, acc, mag);
      for (int64_t d = 0; d < D; ++d) {
        const double got = out[size_t(t * D + d)], want = acc[size_t(d)];
        ASSERT_LE(std::fabs(got - want), std::ldexp(std::fabs(want), -8) + 1e-2 * mag[size_t(d)])
            << "token " << t << " dim " << d;
      }
    }
  }

  // The documented per-element operation order, in float with dsv4::dot (bitwise contract).
  std::vector<float> contract() const {
    std::vector<float> out(size_t(T * D));
    auto expert = [&](const ExpertData& e, const float* xt, float w, bool weighted, bool clamp,
                      std::vector<float>& y) {
      std::vector<float> a(static_cast<size_t>(e.I));
      for (int64_t n = 0; n < e.I; ++n) {
        float gv = num::bf16_round(dot(xt, e.w1.data() + n * D, D, order));
        float uv = num::bf16_round(dot(xt, e.w3.data() + n * D, D, order));
        if (clamp && L > 0) {
          gv = std::min(gv, L);
          uv = std::min(std::max(uv, -L), L);
        }
        const float h = num::silu_f(gv) * uv;
        a[size_t(n)] = num::bf16_round(weighted ? w * h : h);
      }
      for (int64_t d = 0; d < D; ++d) {
        const float v = dot(a.data(), e.w2.data() + d * e.I, e.I, order);
        y[size_t(d)] = round_each ? test::bf16_ref(v) : v;  // each expert's output a bf16 tensor
      }
    };
    std::vector<float> y(static_cast<size_t>(D));
    for (int64_t t = 0; t < T; ++t) {
      std::vector<float> acc(static_cast<size_t>(D), 0.0f);
      for (int i = 0; i < k; ++i) {
        expert(experts[size_t(ids[size_t(t * k + i)])], x.data() + t * D, weights[size_t(t * k + i)], true,
               true, y);
        for (int64_t d = 0; d < D; ++d) acc[size_t(d)] += y[size_t(d)];
      }
      for (const auto& s : shared) {
        expert(s, x.data() + t * D, 1.0f, false, clamp_shared, y);
        for (int64_t d = 0; d < D; ++d) acc[size_t(d)] += y[size_t(d)];
      }
      for (int64_t d = 0; d < D; ++d) out[size_t(t * D + d)] = num::bf16_round(acc[size_t(d)]);
    }
    return out;
  }
};

// Each routed and shared expert's w2 output rounded to bf16 before the fp32 sum (an engine whose
// experts return bf16 tensors, MODEL.md §12.1 item 2): the documented order with that rounding, close
// to float64, and not the round-once result.
TEST(MoeExperts, RoundEachExpertFollowsTheContract) {
  for (int n_shared : {0, 1, 2}) {
    MoeCase c("moe-round-each-" + std::to_string(n_shared), 31, 8, 3, n_shared);
    c.round_each = true;
    const auto out = c.run();
    EXPECT_TRUE(bitwise_equal(out, c.contract())) << n_shared << " shared";
    c.expect_matches_float64(out);
    c.round_each = false;
    EXPECT_FALSE(bitwise_equal(out, c.run())) << "per-expert rounding changed no bit";
  }
}

TEST(MoeExperts, MatchesFloat64AndContract) {
  MoeCase c("moe-basic", 23);
  const auto out = c.run();
  c.expect_matches_float64(out);
  EXPECT_TRUE(bitwise_equal(out, c.contract()));
  c.order.block = 32;
  EXPECT_TRUE(bitwise_equal(c.run(), c.contract()));
}

TEST(MoeExperts, ActiveClampOnRoutedExpertsOnly) {
  MoeCase c("moe-clamp", 17);
  c.L = 0.5f;  // |g|, |u| ~ 1: the clamp is active on many elements
  const auto out = c.run();
  c.expect_matches_float64(out);
  EXPECT_TRUE(bitwise_equal(out, c.contract()));
  MoeCase unclamped = c;
  unclamped.L = 0.0f;
  EXPECT_FALSE(bitwise_equal(out, unclamped.run())) << "the clamp had no effect";
  // Clamping the shared expert too changes the result; both variants follow the spec.
  MoeCase cs = c;
  cs.clamp_shared = true;
  const auto out_cs = cs.run();
  cs.expect_matches_float64(out_cs);
  EXPECT_TRUE(bitwise_equal(out_cs, cs.contract()));
  EXPECT_FALSE(bitwise_equal(out, out_cs));
}

TEST(MoeExperts, GateIsClampedFromAboveOnly) {
  // Reference with a two-sided gate clamp must disagree with the kernel.
  MoeCase c("moe-gate", 9);
  c.L = 0.5f;
  const auto out = c.run();
  int differing = 0;
  for (int64_t t = 0; t < c.T; ++t) {
    std::vector<double> acc(static_cast<size_t>(c.D), 0.0), mag(static_cast<size_t>(c.D), 0.0);
    for (int i = 0; i < c.k; ++i) {
      const ExpertData& e = c.experts[size_t(c.ids[size_t(t * c.k + i)])];
      for (int64_t d = 0; d < c.D; ++d)
        for (int64_t n = 0; n < c.I; ++n) {
          double gd = 0, ud = 0;
          for (int64_t q = 0; q < c.D; ++q) {
            gd += double(c.x[size_t(t * c.D + q)]) * e.w1[size_t(n * c.D + q)];
            ud += double(c.x[size_t(t * c.D + q)]) * e.w3[size_t(n * c.D + q)];
          }
          gd = std::clamp(gd, -0.5, 0.5);
          ud = std::clamp(ud, -0.5, 0.5);
          acc[size_t(d)] +=
              c.weights[size_t(t * c.k + i)] * gd / (1 + std::exp(-gd)) * ud * e.w2[size_t(d * c.I + n)];
        }
    }
    for (const auto& s : c.shared) c.expert_d(s, c.x.data() + t * c.D, 1.0, false, false, acc, mag);
    for (int64_t d = 0; d < c.D; ++d)
      if (std::fabs(out[size_t(t * c.D + d)] - acc[size_t(d)]) > 0.02 * std::fabs(acc[size_t(d)]) + 1e-3)
        ++differing;
  }
  EXPECT_GT(differing, int(c.T * c.D / 4));
}

TEST(MoeExperts, BatchInvariance) {
  MoeCase c("moe-batch", 31);
  const auto all = c.run();
  for (int64_t t : {0, 12, 30}) {
    MoeCase one = c;
    one.T = 1;
    one.x.assign(c.x.begin() + t * c.D, c.x.begin() + (t + 1) * c.D);
    one.ids.assign(c.ids.begin() + t * c.k, c.ids.begin() + (t + 1) * c.k);
    one.weights.assign(c.weights.begin() + t * c.k, c.weights.begin() + (t + 1) * c.k);
    EXPECT_TRUE(
        bitwise_equal(one.run(), std::vector<float>(all.begin() + t * c.D, all.begin() + (t + 1) * c.D)))
        << "token " << t;
  }
}

TEST(MoeExperts, EmptyExpertGroupsAndNoSharedExpert) {
  MoeCase c("moe-empty", 12, 8, 2, 1);
  for (int64_t t = 0; t < c.T; ++t) {  // only experts 1 and 5 receive tokens
    c.ids[size_t(t * 2)] = 1;
    c.ids[size_t(t * 2 + 1)] = 5;
  }
  const auto out = c.run();
  c.expect_matches_float64(out);
  EXPECT_TRUE(bitwise_equal(out, c.contract()));
  MoeCase ns("moe-noshared", 5, 4, 1, 0);
  ns.expect_matches_float64(ns.run());
  EXPECT_TRUE(bitwise_equal(ns.run(), ns.contract()));
}

TEST(MoeExperts, RepeatedIdAddsBothSlots) {
  MoeCase c("moe-repeat", 7);
  for (int64_t t = 0; t < c.T; ++t) c.ids[size_t(t * 2)] = c.ids[size_t(t * 2 + 1)];
  const auto out = c.run();
  c.expect_matches_float64(out);
  EXPECT_TRUE(bitwise_equal(out, c.contract()));
}

TEST(MoeExperts, WiderSharedExpert) {
  MoeCase c("moe-wide-shared", 10, 8, 2, 1, 96);
  const auto out = c.run();
  c.expect_matches_float64(out);
  EXPECT_TRUE(bitwise_equal(out, c.contract()));
}

TEST(MoeExperts, TwoSharedExpertsAndThreadCounts) {
  MoeCase c("moe-threads", 40, 6, 3, 2);
  const int saved = omp_get_max_threads();
  omp_set_num_threads(1);
  const auto a = c.run();
  omp_set_num_threads(3);
  const auto b = c.run();
  omp_set_num_threads(saved);
  EXPECT_TRUE(bitwise_equal(a, b));
  c.expect_matches_float64(a);
  EXPECT_TRUE(bitwise_equal(a, c.contract()));
}

// Asked for the block sums of its output rows (kernels/row_sums.h), the op forms them: each row's
// XXH3-64 of its bf16 patterns, from the sums; the output itself does not change. Rows of a D that is
// not a multiple of 512 have none and are refused.
TEST(MoeExperts, FormsItsOutputsBlockSums) {
  const MoeCase c("moe-sums", 3, 4, 2, 1, 0, 1024);
  std::vector<uint64_t> sums(size_t(c.T * 2 * 8));
  const std::vector<float> plain = c.run(), with = c.run(sums.data());
  EXPECT_TRUE(bitwise_equal(plain, with));
  for (int64_t t = 0; t < c.T; ++t) {
    std::vector<uint16_t> bits;
    for (int64_t d = 0; d < c.D; ++d) bits.push_back(num::bf16_bits(with[size_t(t * c.D + d)]));
    EXPECT_EQ(xxh3::hash_from_sums(sums.data() + t * 16, 2, xxh3::kSecret),
              xxh3::hash64(bits.data(), bits.size() * 2, xxh3::kSecret))
        << t;
  }
  MoeParams p;
  p.D = 64, p.I = 8, p.E = 2, p.k = 1, p.out_sums = sums.data();
  ASSERT_NE(moe_check(p), nullptr);
  EXPECT_NE(std::string(moe_check(p)).find("out_sums"), std::string::npos);
}

TEST(MoeExperts, CheckRejectsBadIds) {
  MoeCase c("moe-check", 2);
  std::vector<ExpertWeights> ev;
  for (const auto& e : c.experts) ev.push_back(e.view());
  std::vector<ExpertWeights> sv{c.shared[0].view()};
  std::vector<float> out(size_t(c.T * c.D));
  MoeParams p;
  p.T = c.T;
  p.D = c.D;
  p.I = c.I;
  p.E = c.E;
  p.k = c.k;
  p.x = c.x.data();
  p.ids = c.ids.data();
  p.weights = c.weights.data();
  p.experts = ev.data();
  p.shared = sv.data();
  p.out = out.data();
  EXPECT_EQ(moe_check(p), nullptr);
  c.ids[1] = c.E;
  EXPECT_NE(moe_check(p), nullptr);
  c.ids[0] = 3;  // descending: the slot order would not be the expert order
  c.ids[1] = 1;
  EXPECT_NE(moe_check(p), nullptr);
  c.ids[1] = 3;  // a repeated id is allowed
  EXPECT_EQ(moe_check(p), nullptr);
}

}  // namespace
}  // namespace dsv4
