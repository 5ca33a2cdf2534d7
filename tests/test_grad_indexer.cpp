// The ops of the indexer's KL objective (kernels/grad.h, MODEL.md §5.5) against independent float64
// references: the Hadamard transpose against the explicit Sylvester matrix, the attention mass
// against a dense float64 softmax with the sink, the KL rows and their score gradient against the
// definition and its central finite differences, and the score backward against central finite
// differences of a float64 score; plus the clamp, empty rows, the documented dki order, thread-count
// invariance and the parameter checks.
#include <gtest/gtest.h>
#include <omp.h>

#include <cfloat>
#include <cmath>
#include <string>
#include <vector>

#include "kernels/attention.h"
#include "kernels/compressor.h"
#include "kernels/grad.h"
#include "kernels/reduce.h"
#include "test_util.h"

namespace dsv4 {
namespace {

using test::bitwise_equal;
using test::rng_for;

// ---- Hadamard transpose ---------------------------------------------------------------------------

TEST(HadamardBackward, IsTheScaledSylvesterMatrixWithoutRounding) {
  for (int64_t n : {1, 2, 8, 64}) {
    auto g = rng_for("hadamard" + std::to_string(n));
    const int64_t rows = 3, ld = n + 5;
    std::vector<float> x(size_t(rows * ld), 7.0f);
    std::uniform_real_distribution<float> u(-1.0f, 1.0f);
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t i = 0; i < n; ++i) x[size_t(r * ld + i)] = u(g);
    std::vector<float> y = x;
    hadamard_backward(y.data(), rows, n, ld);
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t i = 0; i < n; ++i) {
        // Sylvester: H[i][j] = (-1)^popcount(i & j).
        double ref = 0;
        for (int64_t j = 0; j < n; ++j)
          ref += (__builtin_popcountll(uint64_t(i & j)) % 2 ? -1.0 : 1.0) * double(x[size_t(r * ld + j)]);
        ref /= std::sqrt(double(n));
        EXPECT_NEAR(y[size_t(r * ld + i)], ref, 1e-6 * std::sqrt(double(n))) << n << " " << r << " " << i;
      }
      for (int64_t i = n; i < ld; ++i) EXPECT_EQ(y[size_t(r * ld + i)], 7.0f) << "padding written";
    }
    // Not rounded to bf16 (the forward is): some output has bits below bf16's.
    if (n >= 8) {
      bool fine = false;
      for (float v : y) fine |= (num::f32_bits(v) & 0xffffu) != 0;
      EXPECT_TRUE(fine);
    }
  }
}

// The adjoint of the forward rotation (up to its bf16 output rounding): <H x, g> = <x, H^T g>.
TEST(HadamardBackward, IsTheAdjointOfTheForwardRotation) {
  auto g = rng_for("hadamard-adjoint");
  const int64_t n = 128;
  std::vector<float> x = test::randn_bf16(g, n), gr = test::randn_bf16(g, n);
  std::vector<float> hx = x, hg = gr;
  hadamard(hx.data(), 1, n, n);
  hadamard_backward(hg.data(), 1, n, n);
  double a = 0, b = 0, scale = 0;
  for (int64_t i = 0; i < n; ++i) {
    a += double(hx[size_t(i)]) * gr[size_t(i)];
    b += double(x[size_t(i)]) * hg[size_t(i)];
    scale += std::fabs(double(hx[size_t(i)]) * gr[size_t(i)]);
  }
  EXPECT_NEAR(a, b, 1e-2 * scale / std::sqrt(double(n)));  // bf16 output rounding of the forward
}

// ---- attention mass ---------------------------------------------------------------------------------

struct MassCase {
  int64_t T = 9, Dh = 24, N = 30, K = 11;
  int H = 3;
  float scale;
  std::vector<float> q, kv, sink, o, lse;
  std::vector<int32_t> idx;
  MassCase() : scale(1.0f / std::sqrt(24.0f)) {
    auto g = rng_for("attention-mass");
    q = test::randn_bf16(g, size_t(T * H * Dh));
    kv = test::randn_bf16(g, size_t(N * Dh));
    sink = test::randn_bf16(g, size_t(H));
    idx.resize(size_t(T * K));
    std::uniform_int_distribution<int32_t> pick(0, int32_t(N - 1));
    std::bernoulli_distribution hole(0.3);
    for (auto& v : idx) v = hole(g) ? -1 : pick(g);
    for (int64_t j = 0; j < K; ++j) idx[size_t(j)] = -1;  // row 0: no key at all
    o.resize(size_t(T * H * Dh));
    lse.resize(size_t(T * H));
    SparseAttnParams p;
    p.T = T;
    p.H = H;
    p.Dh = Dh;
    p.N = N;
    p.K = K;
    p.q = q.data();
    p.kv = kv.data();
    p.idx = idx.data();
    p.sink = sink.data();
    p.scale = scale;
    p.o = o.data();
    p.lse = lse.data();
    sparse_attention(p);
  }
  AttentionMassParams params(int64_t c0, int64_t n, std::vector<float>& mass) const {
    mass.assign(size_t(T * n), -1.0f);
    AttentionMassParams p;
    p.T = T;
    p.H = H;
    p.Dh = Dh;
    p.N = N;
    p.K = K;
    p.c0 = c0;
    p.n = n;
    p.q = q.data();
    p.kv = kv.data();
    p.idx = idx.data();
    p.lse = lse.data();
    p.scale = scale;
    p.mass = mass.data();
    return p;
  }
};

// Dense float64: per (t, h) the softmax over the row's slots (each slot one column, as the forward)
// and the sink; the mass of slot j summed over heads.
std::vector<double> mass_ref(const MassCase& c, int64_t c0, int64_t n, std::vector<double>* sink_mass = nullptr) {
  std::vector<double> out(size_t(c.T * n), 0.0);
  if (sink_mass) sink_mass->assign(size_t(c.T), 0.0);
  for (int64_t t = 0; t < c.T; ++t)
    for (int h = 0; h < c.H; ++h) {
      std::vector<double> z(size_t(c.K), -INFINITY);
      double M = c.sink[size_t(h)];
      for (int64_t j = 0; j < c.K; ++j) {
        const int32_t r = c.idx[size_t(t * c.K + j)];
        if (r < 0) continue;
        double s = 0;
        for (int64_t d = 0; d < c.Dh; ++d)
          s += double(c.q[size_t((t * c.H + h) * c.Dh + d)]) * c.kv[size_t(r * c.Dh + d)];
        z[size_t(j)] = double(c.scale) * s;
        M = std::max(M, z[size_t(j)]);
      }
      double Z = std::exp(double(c.sink[size_t(h)]) - M);
      for (int64_t j = 0; j < c.K; ++j)
        if (std::isfinite(z[size_t(j)])) Z += std::exp(z[size_t(j)] - M);
      for (int64_t j = c0; j < c0 + n; ++j)
        if (std::isfinite(z[size_t(j)])) out[size_t(t * n + j - c0)] += std::exp(z[size_t(j)] - M) / Z;
      if (sink_mass) (*sink_mass)[size_t(t)] += std::exp(double(c.sink[size_t(h)]) - M) / Z;
    }
  return out;
}

TEST(AttentionMass, MatchesADenseFloat64SoftmaxWithTheSink) {
  const MassCase c;
  for (auto [c0, n] : {std::pair<int64_t, int64_t>{0, 11}, {4, 7}, {10, 1}, {3, 0}}) {
    std::vector<float> mass;
    AttentionMassParams p = c.params(c0, n, mass);
    ASSERT_EQ(attention_mass_check(p), nullptr);
    attention_mass(p);
    const std::vector<double> ref = mass_ref(c, c0, n);
    for (size_t i = 0; i < ref.size(); ++i) {
      if (c.idx[size_t(int64_t(i) / n * c.K + c0 + int64_t(i) % n)] < 0) {
        EXPECT_EQ(num::f32_bits(mass[i]), 0u) << "a hole has mass +0";
      }
      EXPECT_NEAR(mass[i], ref[i], 2e-6 + 2e-5 * ref[i]) << c0 << " " << i;
    }
  }
  // Over all slots, the mass plus the sink's is the head count (each head's probabilities sum to 1).
  std::vector<float> mass;
  AttentionMassParams p = c.params(0, c.K, mass);
  attention_mass(p);
  std::vector<double> sink_mass;
  mass_ref(c, 0, c.K, &sink_mass);
  for (int64_t t = 0; t < c.T; ++t) {
    double s = sink_mass[size_t(t)];
    for (int64_t j = 0; j < c.K; ++j) s += mass[size_t(t * c.K + j)];
    EXPECT_NEAR(s, double(c.H), 1e-4) << t;
  }
}

TEST(AttentionMass, RejectsBadColumnsAndIndices) {
  MassCase c;
  std::vector<float> mass;
  AttentionMassParams p = c.params(5, 7, mass);
  EXPECT_NE(attention_mass_check(p), nullptr);  // 5 + 7 > K
  p = c.params(0, 3, mass);
  c.idx[size_t(2 * c.K + 1)] = int32_t(c.N);  // row 2, column 1: inside the checked columns
  p.idx = c.idx.data();
  EXPECT_NE(attention_mass_check(p), nullptr);
}

// ---- KL rows ----------------------------------------------------------------------------------------

// The row's KL from the definition in float64, with the fp32 clamp of the probabilities.
double kl_ref(const std::vector<double>& s, const std::vector<double>& mu, const std::vector<int32_t>& ids, bool l1) {
  const double tiny = double(FLT_MIN);
  double m = -INFINITY, Z = 0, M = 0;
  for (size_t j = 0; j < s.size(); ++j)
    if (ids[j] >= 0) m = std::max(m, s[j]);
  if (!std::isfinite(m)) return 0;
  for (size_t j = 0; j < s.size(); ++j)
    if (ids[j] >= 0) Z += std::exp(s[j] - m), M += mu[j];
  if (l1 && M == 0) return 0;
  double L = 0;
  for (size_t j = 0; j < s.size(); ++j) {
    if (ids[j] < 0) continue;
    const double tau = l1 ? mu[j] / M : mu[j], pi = std::exp(s[j] - m) / Z;
    if (tau > 0) L += tau * (std::log(std::max(tau, tiny)) - std::log(std::max(pi, tiny)));
  }
  return L;
}

struct KlRow {
  std::vector<int32_t> ids;
  std::vector<float> score, mass;
};

void run_kl(const KlRow& r, bool l1, float coeff, float& loss, std::vector<float>& ds) {
  ds.assign(r.ids.size(), -5.0f);
  IndexerKlParams p;
  p.T = 1;
  p.k = int(r.ids.size());
  p.ids = r.ids.data();
  p.score = r.score.data();
  p.mass = r.mass.data();
  p.l1_target = l1;
  p.coeff = coeff;
  p.loss = &loss;
  p.dscore = ds.data();
  ASSERT_EQ(indexer_kl_check(p), nullptr);
  indexer_kl(p);
}

TEST(IndexerKl, LossAndScoreGradientMatchTheDefinition) {
  auto g = rng_for("kl-rows");
  std::uniform_real_distribution<float> u(-3.0f, 3.0f), m(0.0f, 0.5f);
  for (bool l1 : {true, false})
    for (int trial = 0; trial < 20; ++trial) {
      KlRow r;
      const int k = 1 + trial % 9;
      for (int j = 0; j < k; ++j) {
        r.ids.push_back((j * 7 + trial) % 5 == 0 ? -1 : j);
        r.score.push_back(u(g));
        r.mass.push_back(trial % 4 == 0 && j == 1 ? 0.0f : m(g));
      }
      float loss = 0;
      std::vector<float> ds;
      run_kl(r, l1, 0.75f, loss, ds);
      std::vector<double> s(r.score.begin(), r.score.end()), mu(r.mass.begin(), r.mass.end());
      const double L = kl_ref(s, mu, r.ids, l1);
      EXPECT_NEAR(loss, L, 1e-5 + 1e-5 * std::fabs(L)) << "l1 " << l1 << " trial " << trial;
      for (int j = 0; j < k; ++j) {
        if (r.ids[size_t(j)] < 0) {
          EXPECT_EQ(num::f32_bits(ds[size_t(j)]), 0u) << "an empty slot gets +0";
          continue;
        }
        const double h = 1e-4;
        std::vector<double> sp = s, sm = s;
        sp[size_t(j)] += h;
        sm[size_t(j)] -= h;
        const double fd = 0.75 * (kl_ref(sp, mu, r.ids, l1) - kl_ref(sm, mu, r.ids, l1)) / (2 * h);
        EXPECT_NEAR(ds[size_t(j)], fd, 2e-5 + 1e-4 * std::fabs(fd)) << "l1 " << l1 << " trial " << trial << " j " << j;
      }
    }
}

TEST(IndexerKl, EmptyRowsZeroMassAndOneSlot) {
  float loss = -1;
  std::vector<float> ds;
  run_kl({{-1, -1, -1}, {1, 2, 3}, {0.1f, 0.2f, 0.3f}}, true, 1.0f, loss, ds);
  EXPECT_EQ(loss, 0.0f);
  for (float v : ds) EXPECT_EQ(num::f32_bits(v), 0u);
  run_kl({{0, 1, -1}, {1, 2, 3}, {0.0f, 0.0f, 0.3f}}, true, 1.0f, loss, ds);  // no mass on the valid slots
  EXPECT_EQ(loss, 0.0f);
  for (float v : ds) EXPECT_EQ(num::f32_bits(v), 0u);
  run_kl({{-1, 4, -1}, {1, 2, 3}, {0.1f, 0.2f, 0.3f}}, true, 1.0f, loss, ds);  // one slot: π = τ = 1
  EXPECT_EQ(loss, 0.0f);
  for (float v : ds) EXPECT_EQ(v, 0.0f);
}

// A selected group the indexer gives almost no probability (π below the fp32 smallest normal): its
// log is clamped, so its own τ term has no gradient; the loss uses the clamped log.
TEST(IndexerKl, ClampsVanishingProbabilities) {
  KlRow r{{0, 1, 2}, {0.0f, -200.0f, 1.0f}, {0.3f, 0.2f, 0.5f}};
  float loss = 0;
  std::vector<float> ds;
  run_kl(r, true, 1.0f, loss, ds);
  std::vector<double> s(r.score.begin(), r.score.end()), mu(r.mass.begin(), r.mass.end());
  EXPECT_NEAR(loss, kl_ref(s, mu, r.ids, true), 1e-4);
  EXPECT_GT(loss, 10.0f);  // 0.2 * (log 0.2 - log FLT_MIN) dominates
  // π_1 ~ e^-201 < tiny: dscore_1 = π_1 * A - 0 ~ 0; the others see A = τ_0 + τ_2 = 0.8.
  EXPECT_EQ(ds[1], 0.0f);
  const double Z = 1 + std::exp(1.0) + std::exp(-200.0);
  EXPECT_NEAR(ds[0], 1.0 / Z * 0.8 - 0.3, 1e-6);
  EXPECT_NEAR(ds[2], std::exp(1.0) / Z * 0.8 - 0.5, 1e-6);
}

// ---- score backward -------------------------------------------------------------------------------

struct ScoreCase {
  int64_t T = 7, Di = 16, G = 9;
  int Hi = 3, k = 4;
  float wt_scale = 0.125f;
  std::vector<float> qi, ki, wt, dscore;
  std::vector<int32_t> ids;
  explicit ScoreCase(const std::string& name) {
    auto g = rng_for(name);
    qi = test::randn_bf16(g, size_t(T * Hi * Di));
    ki = test::randn_bf16(g, size_t(G * Di));
    wt = test::randn_bf16(g, size_t(T * Hi));
    dscore = test::randn_bf16(g, size_t(T * k));
    ids.resize(size_t(T * k));
    std::uniform_int_distribution<int32_t> pick(0, int32_t(G - 2));
    for (int64_t t = 0; t < T; ++t)
      for (int j = 0; j < k; ++j) ids[size_t(t * k + j)] = (t + j) % 5 == 4 ? -1 : pick(g);
    for (int j = 0; j < k; ++j) ids[size_t(j)] = -1;  // row 0 empty
    ids[size_t(2 * k + 1)] = ids[size_t(2 * k + 3)] = 3;  // one key twice in a row
    // key G - 1 is in no slot (pick never gives it)
  }
  void run(std::vector<float>& dqi, std::vector<float>& dwt, std::vector<float>& dki) const {
    dqi.assign(qi.size(), -9.0f);
    dwt.assign(wt.size(), -9.0f);
    dki.assign(ki.size(), -9.0f);
    IndexerScoreBwdParams p;
    p.T = T;
    p.Hi = Hi;
    p.Di = Di;
    p.G = G;
    p.k = k;
    p.qi = qi.data();
    p.ki = ki.data();
    p.wt = wt.data();
    p.ids = ids.data();
    p.dscore = dscore.data();
    p.wt_scale = wt_scale;
    p.dqi = dqi.data();
    p.dwt = dwt.data();
    p.dki = dki.data();
    ASSERT_EQ(indexer_score_backward_check(p), nullptr);
    indexer_score_backward(p);
  }
  // L = sum_(t, j valid) dscore[t,j] * sum_h wt[t,h] * relu(qi[t,h] . ki[ids]) in float64.
  double loss(const std::vector<double>& q, const std::vector<double>& kk, const std::vector<double>& w) const {
    double L = 0;
    for (int64_t t = 0; t < T; ++t)
      for (int j = 0; j < k; ++j) {
        const int32_t id = ids[size_t(t * k + j)];
        if (id < 0) continue;
        double s = 0;
        for (int h = 0; h < Hi; ++h) {
          double d = 0;
          for (int64_t e = 0; e < Di; ++e) d += q[size_t((t * Hi + h) * Di + e)] * kk[size_t(id * Di + e)];
          s += w[size_t(t * Hi + h)] * std::max(d, 0.0);
        }
        L += double(dscore[size_t(t * k + j)]) * s;
      }
    return L;
  }
};

TEST(IndexerScoreBackward, MatchesCentralFiniteDifferencesInFloat64) {
  const ScoreCase c("indexer-score-bwd");
  std::vector<float> dqi, dwt, dki;
  c.run(dqi, dwt, dki);
  std::vector<double> q(c.qi.begin(), c.qi.end()), kk(c.ki.begin(), c.ki.end()), w(c.wt.begin(), c.wt.end());
  const double h = 1e-5;
  auto fd = [&](std::vector<double>& v, size_t i) {
    const double x = v[i];
    v[i] = x + h;
    const double a = c.loss(q, kk, w);
    v[i] = x - h;
    const double b = c.loss(q, kk, w);
    v[i] = x;
    return (a - b) / (2 * h);
  };
  for (size_t i = 0; i < q.size(); ++i) EXPECT_NEAR(dqi[i], fd(q, i), 1e-4) << "dqi " << i;
  for (size_t i = 0; i < kk.size(); ++i) EXPECT_NEAR(dki[i], fd(kk, i), 1e-4) << "dki " << i;
  for (size_t i = 0; i < w.size(); ++i) EXPECT_NEAR(dwt[i], c.wt_scale * fd(w, i), 1e-4) << "dwt " << i;
  for (int64_t d = 0; d < c.Di; ++d) EXPECT_EQ(num::f32_bits(dki[size_t((c.G - 1) * c.Di + d)]), 0u);
  for (int h2 = 0; h2 < c.Hi; ++h2) EXPECT_EQ(num::f32_bits(dwt[size_t(h2)]), 0u) << "empty row";
}

// dki's documented order: for key g, an fma chain over its slots (t, j increasing), heads inside.
TEST(IndexerScoreBackward, KeyGradientFollowsTheDocumentedOrderForAnyThreadCount) {
  const ScoreCase c("indexer-score-order");
  std::vector<float> dqi1, dwt1, dki1;
  omp_set_num_threads(1);
  c.run(dqi1, dwt1, dki1);
  for (int threads : {2, 4}) {
    omp_set_num_threads(threads);
    std::vector<float> dqi, dwt, dki;
    c.run(dqi, dwt, dki);
    EXPECT_TRUE(bitwise_equal(dqi, dqi1) && bitwise_equal(dwt, dwt1) && bitwise_equal(dki, dki1)) << threads;
  }
  omp_set_num_threads(omp_get_num_procs());
  const int64_t g = 3, d = 5;
  float acc = 0.0f;
  for (int64_t t = 0; t < c.T; ++t)
    for (int j = 0; j < c.k; ++j) {
      if (c.ids[size_t(t * c.k + j)] != g) continue;
      for (int h = 0; h < c.Hi; ++h) {
        const float dt = dot(&c.qi[size_t((t * c.Hi + h) * c.Di)], &c.ki[size_t(g * c.Di)], c.Di, ReduceOrder{});
        const float ej = dt > 0.0f ? c.dscore[size_t(t * c.k + j)] * c.wt[size_t(t * c.Hi + h)] : 0.0f;
        acc = std::fma(ej, c.qi[size_t((t * c.Hi + h) * c.Di + d)], acc);
      }
    }
  EXPECT_EQ(num::f32_bits(dki1[size_t(g * c.Di + d)]), num::f32_bits(acc));
}

TEST(IndexerScoreBackward, RejectsIdsOutOfRange) {
  ScoreCase c("indexer-score-bad");
  c.ids[5] = int32_t(c.G);
  IndexerScoreBwdParams p;
  p.T = c.T;
  p.Hi = c.Hi;
  p.Di = c.Di;
  p.G = c.G;
  p.k = c.k;
  std::vector<float> a(c.qi.size()), b(c.wt.size()), d(c.ki.size());
  p.qi = c.qi.data();
  p.ki = c.ki.data();
  p.wt = c.wt.data();
  p.ids = c.ids.data();
  p.dscore = c.dscore.data();
  p.dqi = a.data();
  p.dwt = b.data();
  p.dki = d.data();
  ASSERT_NE(indexer_score_backward_check(p), nullptr);
  EXPECT_NE(std::string(indexer_score_backward_check(p)).find("ids"), std::string::npos);
}

}  // namespace
}  // namespace dsv4
