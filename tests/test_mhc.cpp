// mHC (MODEL.md §3.2): Sinkhorn, hc_pre, hc_post and hc_head against float64 references written
// from the spec, plus bitwise batch and thread-count invariance.
#include <omp.h>

#include <cmath>
#include <vector>

#include "kernels/mhc.h"
#include "test_util.h"

namespace dsv4 {
namespace {

using test::bitwise_equal;
using test::rng_for;

double sigmoid_d(double x) {
  return 1.0 / (1.0 + std::exp(-x));
}

// Float64 Sinkhorn, the same steps as the spec.
std::vector<double> sinkhorn_d(std::vector<double> c, int hc, int iters, double eps) {
  for (int j = 0; j < hc; ++j) {
    double mx = c[size_t(j * hc)];
    for (int k = 1; k < hc; ++k) mx = std::max(mx, c[size_t(j * hc + k)]);
    double s = 0;
    for (int k = 0; k < hc; ++k) s += std::exp(c[size_t(j * hc + k)] - mx);
    for (int k = 0; k < hc; ++k) c[size_t(j * hc + k)] = std::exp(c[size_t(j * hc + k)] - mx) / s + eps;
  }
  auto col = [&] {
    for (int k = 0; k < hc; ++k) {
      double s = 0;
      for (int j = 0; j < hc; ++j) s += c[size_t(j * hc + k)];
      for (int j = 0; j < hc; ++j) c[size_t(j * hc + k)] /= (s + eps);
    }
  };
  auto row = [&] {
    for (int j = 0; j < hc; ++j) {
      double s = 0;
      for (int k = 0; k < hc; ++k) s += c[size_t(j * hc + k)];
      for (int k = 0; k < hc; ++k) c[size_t(j * hc + k)] /= (s + eps);
    }
  };
  col();
  for (int i = 1; i < iters; ++i) {
    row();
    col();
  }
  return c;
}

TEST(Sinkhorn, MatchesFloat64AndIsDoublyStochastic) {
  auto g = rng_for("sinkhorn");
  std::normal_distribution<float> d(0.0f, 1.0f);
  for (int hc : {2, 4}) {
    for (int trial = 0; trial < 50; ++trial) {
      std::vector<float> c(size_t(hc * hc));
      for (auto& v : c) v = d(g);
      std::vector<double> cd(c.begin(), c.end());
      sinkhorn(c.data(), hc, 20, 1e-6f);
      const auto want = sinkhorn_d(cd, hc, 20, 1e-6);
      for (int i = 0; i < hc * hc; ++i)
        ASSERT_NEAR(c[size_t(i)], want[size_t(i)], 1e-5) << hc << " " << trial;
      for (int k = 0; k < hc; ++k) {
        double s = 0;
        for (int j = 0; j < hc; ++j) s += c[size_t(j * hc + k)];
        ASSERT_NEAR(s, 1.0, 1e-5) << "column " << k;
      }
      for (int j = 0; j < hc; ++j) {
        double s = 0;
        for (int k = 0; k < hc; ++k) s += c[size_t(j * hc + k)];
        ASSERT_NEAR(s, 1.0, 1e-2) << "row " << j;  // converging, not converged
      }
    }
  }
}

TEST(Sinkhorn, OneIterationIsSoftmaxThenColumnStep) {
  std::vector<float> c = {0.0f, 1.0f, 2.0f, -1.0f};
  std::vector<double> cd(c.begin(), c.end());
  sinkhorn(c.data(), 2, 1, 1e-6f);
  const auto want = sinkhorn_d(cd, 2, 1, 1e-6);
  for (int i = 0; i < 4; ++i) EXPECT_NEAR(c[size_t(i)], want[size_t(i)], 1e-6);
  EXPECT_NEAR(c[0] + c[2], 1.0, 1e-5);
  EXPECT_NEAR(c[1] + c[3], 1.0, 1e-5);
}

struct Mixer {
  int hc;
  int64_t D;
  std::vector<float> fn, scale, base;
  Mixer(std::mt19937_64& g, int hc_, int64_t D_, int rows) : hc(hc_), D(D_) {
    fn = test::randn_bf16(g, size_t(rows) * size_t(hc * D), 0.05f);
    scale = {0.7f, 1.3f, 2.1f};
    base = test::randn_bf16(g, size_t(rows), 0.5f);
  }
};

struct PreOut {
  std::vector<float> y, pre, post, comb;
};

PreOut run_pre(const Mixer& m, const std::vector<float>& X, int64_t T, ReduceOrder o = {}) {
  PreOut r;
  r.y.resize(size_t(T * m.D));
  r.pre.resize(size_t(T * m.hc));
  r.post.resize(size_t(T * m.hc));
  r.comb.resize(size_t(T * m.hc * m.hc));
  HcPreParams p;
  p.T = T;
  p.hc = m.hc;
  p.D = m.D;
  p.X = X.data();
  p.fn = m.fn.data();
  p.scale = m.scale.data();
  p.base = m.base.data();
  p.order = o;
  p.y = r.y.data();
  p.pre = r.pre.data();
  p.post = r.post.data();
  p.comb = r.comb.data();
  EXPECT_EQ(hc_pre_check(p), nullptr);
  hc_pre(p);
  return r;
}

TEST(HcPre, MatchesFloat64) {
  auto g = rng_for("hc_pre");
  const int hc = 4;
  const int64_t D = 96, T = 11, rows = (2 + hc) * hc;
  const Mixer m(g, hc, D, int(rows));
  const auto X = test::randn_bf16(g, size_t(T * hc * D));
  const auto r = run_pre(m, X, T);
  for (int64_t t = 0; t < T; ++t) {
    const float* x = X.data() + t * hc * D;
    double ss = 0;
    for (int64_t i = 0; i < hc * D; ++i) ss += double(x[i]) * x[i];
    const double rho = 1.0 / std::sqrt(ss / double(hc * D) + 1e-6);
    std::vector<double> a(static_cast<size_t>(rows));
    for (int64_t i = 0; i < rows; ++i) {
      double dot = 0;
      for (int64_t q = 0; q < hc * D; ++q) dot += double(m.fn[size_t(i * hc * D + q)]) * x[q];
      const int grp = i < hc ? 0 : (i < 2 * hc ? 1 : 2);
      a[size_t(i)] = rho * dot * m.scale[size_t(grp)] + m.base[size_t(i)];
    }
    std::vector<double> pre(static_cast<size_t>(hc));
    for (int j = 0; j < hc; ++j) {
      pre[size_t(j)] = sigmoid_d(a[size_t(j)]) + 1e-6;
      ASSERT_NEAR(r.pre[size_t(t * hc + j)], pre[size_t(j)], 2e-6);
      ASSERT_NEAR(r.post[size_t(t * hc + j)], 2.0 * sigmoid_d(a[size_t(hc + j)]), 4e-6);
    }
    const auto comb = sinkhorn_d(std::vector<double>(a.begin() + 2 * hc, a.end()), hc, 20, 1e-6);
    for (int i = 0; i < hc * hc; ++i) ASSERT_NEAR(r.comb[size_t(t * hc * hc + i)], comb[size_t(i)], 2e-5);
    for (int64_t d = 0; d < D; ++d) {
      double y = 0, mag = 0;
      for (int j = 0; j < hc; ++j) {
        y += pre[size_t(j)] * x[j * D + d];
        mag += std::fabs(pre[size_t(j)] * x[j * D + d]);
      }
      ASSERT_LE(std::fabs(r.y[size_t(t * D + d)] - y), std::ldexp(std::fabs(y), -8) + 1e-5 * mag)
          << t << "," << d;
    }
  }
}

TEST(HcPre, BatchAndThreadInvariant) {
  auto g = rng_for("hc_pre-inv");
  const int hc = 4;
  const int64_t D = 200, T = 37;
  const Mixer m(g, hc, D, (2 + hc) * hc);
  const auto X = test::randn_bf16(g, size_t(T * hc * D));
  const int saved = omp_get_max_threads();
  omp_set_num_threads(1);
  const auto all1 = run_pre(m, X, T, {64});
  omp_set_num_threads(3);
  const auto all3 = run_pre(m, X, T, {64});
  omp_set_num_threads(saved);
  EXPECT_TRUE(bitwise_equal(all1.y, all3.y));
  EXPECT_TRUE(bitwise_equal(all1.comb, all3.comb));
  for (int64_t t : {0, 5, 36}) {
    const std::vector<float> Xt(X.begin() + t * hc * D, X.begin() + (t + 1) * hc * D);
    const auto one = run_pre(m, Xt, 1, {64});
    EXPECT_TRUE(
        bitwise_equal(one.y, std::vector<float>(all1.y.begin() + t * D, all1.y.begin() + (t + 1) * D)));
    EXPECT_TRUE(bitwise_equal(
        one.pre, std::vector<float>(all1.pre.begin() + t * hc, all1.pre.begin() + (t + 1) * hc)));
    EXPECT_TRUE(bitwise_equal(
        one.post, std::vector<float>(all1.post.begin() + t * hc, all1.post.begin() + (t + 1) * hc)));
    EXPECT_TRUE(bitwise_equal(one.comb, std::vector<float>(all1.comb.begin() + t * hc * hc,
                                                           all1.comb.begin() + (t + 1) * hc * hc)));
  }
}

TEST(HcPost, MatchesFloat64AndSumsOverSource) {
  auto g = rng_for("hc_post");
  const int hc = 4;
  const int64_t D = 64, T = 5;
  const auto f = test::randn_bf16(g, size_t(T * D));
  const auto R = test::randn_bf16(g, size_t(T * hc * D));
  const auto post = test::randn_bf16(g, size_t(T * hc));
  // A strongly non-symmetric comb: comb[j][k] = 1 for k == (j + 1) % hc, small otherwise, so
  // summing over the destination index instead of the source one gives a different result.
  std::vector<float> comb(size_t(T * hc * hc));
  std::uniform_real_distribution<float> u(0.0f, 0.05f);
  for (int64_t t = 0; t < T; ++t)
    for (int j = 0; j < hc; ++j)
      for (int k = 0; k < hc; ++k) comb[size_t((t * hc + j) * hc + k)] = k == (j + 1) % hc ? 1.0f : u(g);
  std::vector<float> out(size_t(T * hc * D));
  HcPostParams p;
  p.T = T;
  p.hc = hc;
  p.D = D;
  p.f = f.data();
  p.R = R.data();
  p.post = post.data();
  p.comb = comb.data();
  p.out = out.data();
  hc_post(p);
  for (int64_t t = 0; t < T; ++t)
    for (int k = 0; k < hc; ++k)
      for (int64_t d = 0; d < D; ++d) {
        double want = double(post[size_t(t * hc + k)]) * f[size_t(t * D + d)];
        double mag = std::fabs(want);
        for (int j = 0; j < hc; ++j) {
          const double term = double(comb[size_t((t * hc + j) * hc + k)]) * R[size_t((t * hc + j) * D + d)];
          want += term;
          mag += std::fabs(term);
        }
        const float got = out[size_t((t * hc + k) * D + d)];
        ASSERT_LE(std::fabs(got - want), std::ldexp(std::fabs(want), -8) + 1e-6 * mag)
            << t << "," << k << "," << d;
        // Documented order, bitwise.
        float acc = post[size_t(t * hc + k)] * f[size_t(t * D + d)];
        for (int j = 0; j < hc; ++j)
          acc = std::fma(comb[size_t((t * hc + j) * hc + k)], R[size_t((t * hc + j) * D + d)], acc);
        ASSERT_EQ(got, num::bf16_round(acc));
      }
}

TEST(HcHead, MatchesFloat64) {
  auto g = rng_for("hc_head");
  const int hc = 4;
  const int64_t D = 80, T = 9;
  const auto fn = test::randn_bf16(g, size_t(hc * hc * D), 0.05f);
  const std::vector<float> scale = {1.7f};
  const auto base = test::randn_bf16(g, size_t(hc), 0.5f);
  const auto X = test::randn_bf16(g, size_t(T * hc * D));
  std::vector<float> y(size_t(T * D)), w(size_t(T * hc));
  HcHeadParams p;
  p.T = T;
  p.hc = hc;
  p.D = D;
  p.X = X.data();
  p.fn = fn.data();
  p.scale = scale.data();
  p.base = base.data();
  p.y = y.data();
  p.w = w.data();
  hc_head(p);
  for (int64_t t = 0; t < T; ++t) {
    const float* x = X.data() + t * hc * D;
    double ss = 0;
    for (int64_t i = 0; i < hc * D; ++i) ss += double(x[i]) * x[i];
    const double rho = 1.0 / std::sqrt(ss / double(hc * D) + 1e-6);
    std::vector<double> wt(static_cast<size_t>(hc));
    for (int j = 0; j < hc; ++j) {
      double dot = 0;
      for (int64_t q = 0; q < hc * D; ++q) dot += double(fn[size_t(j * hc * D + q)]) * x[q];
      wt[size_t(j)] = sigmoid_d(rho * dot * scale[0] + base[size_t(j)]) + 1e-6;
      ASSERT_NEAR(w[size_t(t * hc + j)], wt[size_t(j)], 2e-6);
    }
    for (int64_t d = 0; d < D; ++d) {
      double want = 0, mag = 0;
      for (int j = 0; j < hc; ++j) {
        want += wt[size_t(j)] * x[j * D + d];
        mag += std::fabs(wt[size_t(j)] * x[j * D + d]);
      }
      ASSERT_LE(std::fabs(y[size_t(t * D + d)] - want), std::ldexp(std::fabs(want), -8) + 1e-5 * mag);
    }
  }
  // The weights are optional and do not change y.
  std::vector<float> y2(y.size());
  p.y = y2.data();
  p.w = nullptr;
  hc_head(p);
  EXPECT_TRUE(bitwise_equal(y, y2));
}

TEST(HcPre, CheckRejectsBadParams) {
  HcPreParams p;
  p.T = 0;
  p.D = 8;
  EXPECT_EQ(hc_pre_check(p), nullptr);
  p.T = 1;
  EXPECT_NE(hc_pre_check(p), nullptr);  // null pointers
  HcPreParams q;
  q.D = 0;
  EXPECT_NE(hc_pre_check(q), nullptr);
}

}  // namespace
}  // namespace dsv4
