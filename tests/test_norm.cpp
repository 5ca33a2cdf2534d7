// RMSNorm (MODEL.md §3.1): float64 reference, the documented operation order, the no-weight
// variant, in place, reduce orders and thread counts.
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "kernels/norm.h"
#include "test_util.h"

namespace dsv4 {
namespace {

using test::bitwise_equal;
using test::rng_for;

std::vector<float> run(const std::vector<float>& x, const float* w, int64_t rows, int64_t dim, ReduceOrder o,
                       float eps = 1e-6f, bool bf16_arith = false) {
  std::vector<float> y(x.size());
  RmsNormParams p;
  p.rows = rows;
  p.dim = dim;
  p.x = x.data();
  p.ldx = dim;
  p.w = w;
  p.y = y.data();
  p.ldy = dim;
  p.eps = eps;
  p.order = o;
  p.bf16_arith = bf16_arith;
  EXPECT_EQ(rmsnorm_check(p), nullptr);
  rmsnorm(p);
  return y;
}

// y within one bf16 rounding (plus the fp32 error, far smaller) of the exact value.
void expect_close_to_double(const std::vector<float>& y, const std::vector<float>& x, const float* w,
                            int64_t rows, int64_t dim, double eps) {
  for (int64_t r = 0; r < rows; ++r) {
    double ss = 0;
    for (int64_t i = 0; i < dim; ++i) ss += double(x[size_t(r * dim + i)]) * x[size_t(r * dim + i)];
    const double rs = 1.0 / std::sqrt(ss / double(dim) + eps);
    for (int64_t i = 0; i < dim; ++i) {
      const double want = double(x[size_t(r * dim + i)]) * rs * (w ? double(w[i]) : 1.0);
      const double got = y[size_t(r * dim + i)];
      ASSERT_LE(std::fabs(got - want), std::ldexp(std::fabs(want), -8) + 1e-30) << r << "," << i;
      ASSERT_EQ(got, double(num::bf16_round(float(got)))) << "not a bf16 value";
    }
  }
}

TEST(RmsNorm, MatchesFloat64WithWeight) {
  auto g = rng_for("rmsnorm-w");
  for (int64_t dim : {1, 7, 64, 512, 1000}) {
    const int64_t rows = 13;
    const auto x = test::randn_bf16(g, size_t(rows * dim), 3.0f);
    const auto w = test::randn_bf16(g, size_t(dim), 0.5f);
    for (int block : {0, 64})
      expect_close_to_double(run(x, w.data(), rows, dim, {block}), x, w.data(), rows, dim, 1e-6);
  }
}

TEST(RmsNorm, MatchesFloat64WithoutWeight) {
  auto g = rng_for("rmsnorm-now");
  const int64_t rows = 9, dim = 512;
  const auto x = test::randn_bf16(g, size_t(rows * dim), 0.01f);
  expect_close_to_double(run(x, nullptr, rows, dim, {}), x, nullptr, rows, dim, 1e-6);
}

TEST(RmsNorm, EpsilonMatters) {
  // Tiny inputs: mean(x²) ~ 1e-10 << eps, so y ~ x / sqrt(eps).
  auto g = rng_for("rmsnorm-eps");
  const int64_t rows = 3, dim = 128;
  const auto x = test::randn_bf16(g, size_t(rows * dim), 1e-5f);
  expect_close_to_double(run(x, nullptr, rows, dim, {}, 1e-6f), x, nullptr, rows, dim, 1e-6);
}

TEST(RmsNorm, DocumentedOperationOrder) {
  auto g = rng_for("rmsnorm-order");
  const int64_t rows = 5, dim = 300;
  const auto x = test::randn_bf16(g, size_t(rows * dim));
  const auto w = test::randn_bf16(g, size_t(dim));
  for (int block : {0, 64, 256}) {
    const ReduceOrder o{block};
    const auto y = run(x, w.data(), rows, dim, o);
    const auto yn = run(x, nullptr, rows, dim, o);
    for (int64_t r = 0; r < rows; ++r) {
      const float* xr = x.data() + r * dim;
      const float rs = 1.0f / std::sqrt(sum_squares(xr, dim, o) / float(dim) + 1e-6f);
      for (int64_t i = 0; i < dim; ++i) {
        ASSERT_EQ(y[size_t(r * dim + i)], num::bf16_round((xr[i] * rs) * w[size_t(i)]));
        ASSERT_EQ(yn[size_t(r * dim + i)], num::bf16_round(xr[i] * rs));
      }
    }
  }
}

TEST(RmsNorm, InPlaceEqualsOutOfPlace) {
  auto g = rng_for("rmsnorm-inplace");
  const int64_t rows = 17, dim = 256;
  const auto x = test::randn_bf16(g, size_t(rows * dim));
  const auto w = test::randn_bf16(g, size_t(dim));
  const auto y = run(x, w.data(), rows, dim, {});
  std::vector<float> z = x;
  RmsNormParams p;
  p.rows = rows;
  p.dim = dim;
  p.x = z.data();
  p.ldx = dim;
  p.w = w.data();
  p.y = z.data();
  p.ldy = dim;
  ASSERT_EQ(rmsnorm_check(p), nullptr);
  rmsnorm(p);
  EXPECT_TRUE(bitwise_equal(y, z));
}

TEST(RmsNorm, StridedRowsAndThreadCounts) {
  auto g = rng_for("rmsnorm-stride");
  const int64_t rows = 50, dim = 100, ldx = 103, ldy = 111;
  const auto x = test::randn_bf16(g, size_t(rows * ldx));
  const auto w = test::randn_bf16(g, size_t(dim));
  std::vector<float> packed(size_t(rows * dim));
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t i = 0; i < dim; ++i) packed[size_t(r * dim + i)] = x[size_t(r * ldx + i)];
  const auto want = run(packed, w.data(), rows, dim, {64});
  const int saved = omp_get_max_threads();
  for (int threads : {1, 2, 3}) {
    omp_set_num_threads(threads);
    std::vector<float> y(size_t(rows * ldy), 99.0f);
    RmsNormParams p;
    p.rows = rows;
    p.dim = dim;
    p.x = x.data();
    p.ldx = ldx;
    p.w = w.data();
    p.y = y.data();
    p.ldy = ldy;
    p.order = {64};
    rmsnorm(p);
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t i = 0; i < ldy; ++i) {
        if (i < dim)
          ASSERT_EQ(y[size_t(r * ldy + i)], want[size_t(r * dim + i)]);
        else
          ASSERT_EQ(y[size_t(r * ldy + i)], 99.0f);
      }
  }
  omp_set_num_threads(saved);
}

TEST(RmsNorm, CheckRejectsBadParams) {
  std::vector<float> b(16);
  RmsNormParams p;
  p.rows = 2;
  p.dim = 8;
  p.x = p.y = b.data();
  p.ldx = p.ldy = 8;
  EXPECT_EQ(rmsnorm_check(p), nullptr);
  RmsNormParams q = p;
  q.ldx = 7;
  EXPECT_NE(rmsnorm_check(q), nullptr);
  q = p;
  q.dim = 0;
  EXPECT_NE(rmsnorm_check(q), nullptr);
  q = p;
  q.order.block = 4;
  EXPECT_NE(rmsnorm_check(q), nullptr);
}

// ---- bf16 arithmetic (RmsNormParams::bf16_arith: an engine normalising a bf16 tensor in place) ----

std::vector<float> run_bf16(const std::vector<float>& x, int64_t rows, int64_t dim, ReduceOrder o) {
  return run(x, nullptr, rows, dim, o, 1e-6f, true);
}

// Every documented rounding point, computed here with an independent bf16 rounding (test::bf16_ref)
// and float64 where one op rounds once: v = bf16(x^2); s = the canonical sum of v (reduce.h dot with
// ones, the definition of every fp32 sum); mean = bf16(s / n); r = bf16(1 / sqrt(bf16(mean + eps)));
// y = bf16(x * r).
TEST(RmsNormBf16, FollowsTheDocumentedRoundings) {
  auto g = rng_for("rmsnorm-bf16");
  for (int64_t dim : {1, 7, 64, 128, 512}) {
    const int64_t rows = 37;
    const auto x = test::randn_bf16(g, size_t(rows * dim), 2.0f);
    for (int block : {0, 64}) {
      const auto y = run_bf16(x, rows, dim, {block});
      std::vector<float> want(x.size());
      for (int64_t r = 0; r < rows; ++r) {
        const float* xr = x.data() + r * dim;
        std::vector<float> v(static_cast<size_t>(dim)), ones(static_cast<size_t>(dim), 1.0f);
        for (int64_t i = 0; i < dim; ++i) v[size_t(i)] = test::bf16_ref(float(double(xr[i]) * double(xr[i])));
        const float s = dot(v.data(), ones.data(), dim, {block});
        const float mean = test::bf16_ref(float(double(s) / double(dim)));
        const float denom = test::bf16_ref(float(double(mean) + double(1e-6f)));
        const float rs = test::bf16_ref(float(1.0 / double(std::sqrt(denom))));
        for (int64_t i = 0; i < dim; ++i) want[size_t(r * dim + i)] = test::bf16_ref(float(double(xr[i]) * rs));
      }
      ASSERT_TRUE(bitwise_equal(y, want)) << "dim " << dim << " block " << block;
    }
  }
}

// The site changes results (bf16 arithmetic is not the fp32 norm), stays within a few bf16 steps of
// it, and does not depend on the thread count.
TEST(RmsNormBf16, DiffersFromFp32ByRoundingOnlyAndIgnoresThreads) {
  auto g = rng_for("rmsnorm-bf16-vs-fp32");
  const int64_t rows = 64, dim = 512;
  const auto x = test::randn_bf16(g, size_t(rows * dim), 1.5f);
  const auto a = run(x, nullptr, rows, dim, {0});
  const int threads = omp_get_max_threads();
  omp_set_num_threads(1);
  const auto b1 = run_bf16(x, rows, dim, {0});
  omp_set_num_threads(std::max(threads, 2));
  const auto b2 = run_bf16(x, rows, dim, {0});
  omp_set_num_threads(threads);
  EXPECT_TRUE(bitwise_equal(b1, b2));
  int64_t differ = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    differ += a[i] != b1[i];
    ASSERT_LE(std::fabs(double(a[i]) - b1[i]), std::ldexp(std::fabs(double(a[i])), -6) + 1e-30) << i;
  }
  EXPECT_GT(differ, int64_t(a.size() / 20)) << "bf16 arithmetic changed almost nothing";
}

TEST(RmsNormBf16, IsDefinedWithoutAWeightOnly) {
  std::vector<float> b(16), w(8, 1.0f);
  RmsNormParams p;
  p.rows = 2;
  p.dim = 8;
  p.x = p.y = b.data();
  p.ldx = p.ldy = 8;
  p.bf16_arith = true;
  EXPECT_EQ(rmsnorm_check(p), nullptr);
  p.w = w.data();
  EXPECT_NE(rmsnorm_check(p), nullptr);
}

}  // namespace
}  // namespace dsv4
