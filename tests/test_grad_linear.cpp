// Backward of the dense linear layers, RMSNorm, the embedding and the log-probabilities
// (kernels/grad.h): bitwise against the documented per-element order, against float64 sums and
// float64 central finite differences of forwards written here, plus bitwise thread-count and batch
// invariance.
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "kernels/detail/norm.h"
#include "kernels/grad.h"
#include "test_util.h"

namespace dsv4 {
namespace {

using test::bitwise_equal;
using test::rng_for;

std::vector<float> randn(std::mt19937_64& g, size_t n, float std = 1.0f) {
  std::normal_distribution<float> d(0.0f, std);
  std::vector<float> v(n);
  for (auto& x : v) x = d(g);
  return v;
}

// Runs f with 1 thread, then with 3, and restores the setting.
template <typename F>
void with_threads(int n, F&& f) {
  const int saved = omp_get_max_threads();
  omp_set_num_threads(n);
  f();
  omp_set_num_threads(saved);
}

// ---- gemm_dx / gemm_dw --------------------------------------------------------------------------

struct GemmCase {
  int64_t m, n, k;
  int pad;  // extra row stride of every operand
  ReduceOrder order;
};

const GemmCase kGemmCases[] = {
    {1, 1, 1, 0, {}},     {3, 5, 7, 2, {}},      {5, 13, 9, 0, {8}},   {17, 33, 20, 3, {16}},
    {50, 70, 129, 1, {}}, {49, 97, 61, 0, {32}}, {2, 200, 3, 5, {64}}, {64, 1, 50, 0, {}},
};

struct GemmData {
  std::vector<float> dy, w_or_x, out;
  int64_t lddy, ldb, ldo;
};

// dx[r, c] with the W column gathered contiguously and dot() called on it: the contract itself.
std::vector<float> dx_by_dot(const GemmCase& c, const GemmData& d) {
  std::vector<float> out(size_t(c.m * d.ldo), 0.0f), col(size_t(c.n));
  for (int64_t r = 0; r < c.m; ++r)
    for (int64_t j = 0; j < c.k; ++j) {
      for (int64_t i = 0; i < c.n; ++i) col[size_t(i)] = d.w_or_x[size_t(i * d.ldb + j)];
      out[size_t(r * d.ldo + j)] = dot(d.dy.data() + r * d.lddy, col.data(), c.n, c.order);
    }
  return out;
}

GemmData dx_data(const GemmCase& c, const char* name) {
  auto g = rng_for(name);
  GemmData d;
  d.lddy = c.n + c.pad;
  d.ldb = c.k + c.pad;
  d.ldo = c.k + c.pad;
  d.dy = randn(g, size_t(c.m * d.lddy));
  d.w_or_x = randn(g, size_t(c.n * d.ldb));
  d.out = randn(g, size_t(c.m * d.ldo));  // prefilled: padding must survive, += must add
  return d;
}

GemmDxParams dx_params(const GemmCase& c, GemmData& d, std::vector<float>& out, bool acc) {
  return GemmDxParams{.m = c.m,
                      .n = c.n,
                      .k = c.k,
                      .dy = d.dy.data(),
                      .lddy = d.lddy,
                      .w = d.w_or_x.data(),
                      .ldw = d.ldb,
                      .dx = out.data(),
                      .lddx = d.ldo,
                      .accumulate = acc,
                      .order = c.order};
}

TEST(GemmDx, EveryElementIsTheCanonicalDotOfTheGatheredColumn) {
  for (const auto& c : kGemmCases) {
    SCOPED_TRACE(testing::Message() << "m=" << c.m << " n=" << c.n << " k=" << c.k
                                    << " block=" << c.order.block);
    GemmData d = dx_data(c, "gemm_dx");
    const std::vector<float> ref = dx_by_dot(c, d);
    std::vector<float> out = d.out;
    const auto p = dx_params(c, d, out, false);
    ASSERT_EQ(gemm_dx_check(p), nullptr);
    gemm_dx(p);
    std::vector<float> want = d.out;  // padding untouched
    for (int64_t r = 0; r < c.m; ++r)
      for (int64_t j = 0; j < c.k; ++j) want[size_t(r * d.ldo + j)] = ref[size_t(r * d.ldo + j)];
    EXPECT_TRUE(bitwise_equal(out, want));

    // Accumulated: one add of the same contribution onto the previous contents.
    std::vector<float> acc = d.out;
    gemm_dx(dx_params(c, d, acc, true));
    for (int64_t r = 0; r < c.m; ++r)
      for (int64_t j = 0; j < c.k; ++j)
        want[size_t(r * d.ldo + j)] = d.out[size_t(r * d.ldo + j)] + ref[size_t(r * d.ldo + j)];
    EXPECT_TRUE(bitwise_equal(acc, want));

    // Against the float64 sum, within the canonical dot's error bound.
    for (int64_t r = 0; r < c.m; ++r)
      for (int64_t j = 0; j < c.k; ++j) {
        double s = 0, sa = 0;
        for (int64_t i = 0; i < c.n; ++i) {
          const double t = double(d.dy[size_t(r * d.lddy + i)]) * d.w_or_x[size_t(i * d.ldb + j)];
          s += t;
          sa += std::fabs(t);
        }
        ASSERT_NEAR(out[size_t(r * d.ldo + j)], s, double(c.n + 8) * 0x1p-24 * sa) << r << " " << j;
      }
  }
}

// Many rows of W: its columns are transposed in several chunks (of 48 columns here).
TEST(GemmDx, ChunkedColumnsMatchTheDot) {
  const GemmCase c{3, 70001, 101, 1, {}};
  GemmData d = dx_data(c, "gemm_dx_chunked");
  const std::vector<float> ref = dx_by_dot(c, d);
  for (bool acc : {false, true}) {
    std::vector<float> out = d.out;
    gemm_dx(dx_params(c, d, out, acc));
    for (int64_t r = 0; r < c.m; ++r)
      for (int64_t j = 0; j < c.k; ++j) {
        const size_t i = size_t(r * d.ldo + j);
        const float want = acc ? d.out[i] + ref[i] : ref[i];
        ASSERT_EQ(out[i], want) << acc << " " << r << " " << j;
      }
  }
}

TEST(GemmDx, EmptyReductionGivesZeroAndChecksNameTheField) {
  std::vector<float> dx = {1.0f, 2.0f, 3.0f, 4.0f};
  GemmDxParams p{.m = 2, .n = 0, .k = 2, .dx = dx.data(), .lddx = 2, .accumulate = false};
  ASSERT_EQ(gemm_dx_check(p), nullptr);
  gemm_dx(p);
  EXPECT_TRUE(test::all_zero(dx));
  std::vector<float> dy(6), w(6);
  GemmDxParams q{.m = 2,
                 .n = 3,
                 .k = 2,
                 .dy = dy.data(),
                 .lddy = 3,
                 .w = w.data(),
                 .ldw = 2,
                 .dx = dx.data(),
                 .lddx = 2};
  EXPECT_EQ(gemm_dx_check(q), nullptr);
  auto bad = q;
  bad.lddy = 2;
  EXPECT_STREQ(gemm_dx_check(bad), "gemm_dx: lddy < n");
  bad = q;
  bad.w = nullptr;
  EXPECT_STREQ(gemm_dx_check(bad), "gemm_dx: dy or w is null");
  bad = q;
  bad.lddx = 1;
  EXPECT_STREQ(gemm_dx_check(bad), "gemm_dx: lddx < k");
  bad = q;
  bad.dx = dy.data() + 1;
  EXPECT_STREQ(gemm_dx_check(bad), "gemm_dx: dx overlaps dy");
  bad = q;
  bad.order = {12};
  EXPECT_STREQ(gemm_dx_check(bad), "gemm_dx: reduce block must be 0 or a positive multiple of 8");
  bad = q;
  bad.m = -1;
  EXPECT_STREQ(gemm_dx_check(bad), "gemm_dx: negative dimension");
}

// dw[r, c] = dot over the tokens of the two gathered columns: the contract itself.
std::vector<float> dw_by_dot(const GemmCase& c, const GemmData& d) {
  std::vector<float> out(size_t(c.n * d.ldo), 0.0f), a(size_t(c.m)), b(size_t(c.m));
  for (int64_t r = 0; r < c.n; ++r)
    for (int64_t j = 0; j < c.k; ++j) {
      for (int64_t t = 0; t < c.m; ++t) {
        a[size_t(t)] = d.dy[size_t(t * d.lddy + r)];
        b[size_t(t)] = d.w_or_x[size_t(t * d.ldb + j)];
      }
      out[size_t(r * d.ldo + j)] = dot(a.data(), b.data(), c.m, c.order);
    }
  return out;
}

GemmData dw_data(const GemmCase& c, const char* name) {
  auto g = rng_for(name);
  GemmData d;
  d.lddy = c.n + c.pad;
  d.ldb = c.k + c.pad;
  d.ldo = c.k + c.pad;
  d.dy = randn(g, size_t(c.m * d.lddy));
  d.w_or_x = randn(g, size_t(c.m * d.ldb));
  d.out = randn(g, size_t(c.n * d.ldo));
  return d;
}

GemmDwParams dw_params(const GemmCase& c, GemmData& d, std::vector<float>& out, bool acc) {
  return GemmDwParams{.m = c.m,
                      .n = c.n,
                      .k = c.k,
                      .dy = d.dy.data(),
                      .lddy = d.lddy,
                      .x = d.w_or_x.data(),
                      .ldx = d.ldb,
                      .dw = out.data(),
                      .lddw = d.ldo,
                      .accumulate = acc,
                      .order = c.order};
}

TEST(GemmDw, EveryElementIsTheCanonicalDotOverTokens) {
  for (const auto& c : kGemmCases) {
    SCOPED_TRACE(testing::Message() << "m=" << c.m << " n=" << c.n << " k=" << c.k
                                    << " block=" << c.order.block);
    GemmData d = dw_data(c, "gemm_dw");
    const std::vector<float> ref = dw_by_dot(c, d);
    for (bool acc : {false, true}) {
      std::vector<float> out = d.out;
      const auto p = dw_params(c, d, out, acc);
      ASSERT_EQ(gemm_dw_check(p), nullptr);
      gemm_dw(p);
      std::vector<float> want = d.out;
      for (int64_t r = 0; r < c.n; ++r)
        for (int64_t j = 0; j < c.k; ++j) {
          const size_t i = size_t(r * d.ldo + j);
          want[i] = acc ? d.out[i] + ref[i] : ref[i];
        }
      EXPECT_TRUE(bitwise_equal(out, want)) << "accumulate " << acc;
    }
    for (int64_t r = 0; r < c.n; ++r)
      for (int64_t j = 0; j < c.k; ++j) {
        double s = 0, sa = 0;
        for (int64_t t = 0; t < c.m; ++t) {
          const double v = double(d.dy[size_t(t * d.lddy + r)]) * d.w_or_x[size_t(t * d.ldb + j)];
          s += v;
          sa += std::fabs(v);
        }
        ASSERT_NEAR(ref[size_t(r * d.ldo + j)], s, double(c.m + 8) * 0x1p-24 * sa);
      }
  }
}

// Many columns of X: the accumulated rows of dW go through the staging buffer in several chunks.
TEST(GemmDw, ChunkedRowsMatchTheDot) {
  const GemmCase c{5, 101, 70001, 0, {}};
  GemmData d = dw_data(c, "gemm_dw_chunked");
  const std::vector<float> ref = dw_by_dot(c, d);
  std::vector<float> out = d.out;
  gemm_dw(dw_params(c, d, out, true));
  for (size_t i = 0; i < out.size(); ++i) ASSERT_EQ(out[i], d.out[i] + ref[i]) << i;
}

TEST(GemmDw, NoTokensAndChecks) {
  std::vector<float> dw = {1.0f, -2.0f, 3.0f, 4.0f};
  GemmDwParams p{.m = 0, .n = 2, .k = 2, .dw = dw.data(), .lddw = 2, .accumulate = true};
  ASSERT_EQ(gemm_dw_check(p), nullptr);
  gemm_dw(p);
  EXPECT_EQ(dw, (std::vector<float>{1.0f, -2.0f, 3.0f, 4.0f}));
  p.accumulate = false;
  gemm_dw(p);
  EXPECT_TRUE(test::all_zero(dw));
  std::vector<float> dy(6), x(6);
  GemmDwParams q{.m = 3,
                 .n = 2,
                 .k = 2,
                 .dy = dy.data(),
                 .lddy = 2,
                 .x = x.data(),
                 .ldx = 2,
                 .dw = dw.data(),
                 .lddw = 2};
  EXPECT_EQ(gemm_dw_check(q), nullptr);
  auto bad = q;
  bad.ldx = 1;
  EXPECT_STREQ(gemm_dw_check(bad), "gemm_dw: ldx < k");
  bad = q;
  bad.dw = nullptr;
  EXPECT_STREQ(gemm_dw_check(bad), "gemm_dw: dw is null");
  bad = q;
  bad.dw = x.data() + 2;
  EXPECT_STREQ(gemm_dw_check(bad), "gemm_dw: dw overlaps x");
}

TEST(GemmGrad, ThreadCountInvariant) {
  const GemmCase c{97, 203, 151, 3, {}};
  GemmData dxd = dx_data(c, "gemm_threads_dx");
  GemmData dwd = dw_data(GemmCase{97, 203, 151, 3, {}}, "gemm_threads_dw");
  std::vector<float> dx1 = dxd.out, dx3 = dxd.out, dw1 = dwd.out, dw3 = dwd.out;
  with_threads(1, [&] {
    gemm_dx(dx_params(c, dxd, dx1, true));
    gemm_dw(dw_params(c, dwd, dw1, true));
  });
  with_threads(3, [&] {
    gemm_dx(dx_params(c, dxd, dx3, true));
    gemm_dw(dw_params(c, dwd, dw3, true));
  });
  EXPECT_TRUE(bitwise_equal(dx1, dx3));
  EXPECT_TRUE(bitwise_equal(dw1, dw3));
}

// ---- RMSNorm ------------------------------------------------------------------------------------

// Float64 weighted RMSNorm of one row, unrounded: y_i = w_i * x_i / sqrt(mean(x^2) + eps).
double rms_loss_d(const std::vector<double>& x, const std::vector<double>& w, const std::vector<double>& dy,
                  double eps) {
  double ss = 0;
  for (double v : x) ss += v * v;
  const double r = 1.0 / std::sqrt(ss / double(x.size()) + eps);
  double l = 0;
  for (size_t i = 0; i < x.size(); ++i) l += dy[i] * (w.empty() ? 1.0 : w[i]) * x[i] * r;
  return l;
}

struct NormCase {
  int64_t rows, dim;
  bool weighted;
  float xscale;  // small: eps matters
  ReduceOrder order;
};

TEST(RmsNormBackward, MatchesFiniteDifferencesOfFloat64Forward) {
  const NormCase cases[] = {{1, 1, true, 1.0f, {}},     {3, 7, true, 1.0f, {}},   {5, 33, false, 1.0f, {8}},
                            {2, 300, true, 1.0f, {64}}, {3, 13, true, 1e-3f, {}}, {1, 2, false, 1.0f, {}}};
  const float eps = 1e-6f;
  for (const auto& c : cases) {
    SCOPED_TRACE(testing::Message() << "rows=" << c.rows << " dim=" << c.dim << " w=" << c.weighted
                                    << " xscale=" << c.xscale);
    auto g = rng_for("rmsnorm_bwd" + std::to_string(c.dim));
    const int64_t ld = c.dim + 3;
    std::vector<float> x = randn(g, size_t(c.rows * ld), c.xscale), dy = randn(g, size_t(c.rows * ld));
    std::vector<float> w = c.weighted ? randn(g, size_t(c.dim)) : std::vector<float>{};
    std::vector<float> dx(size_t(c.rows * ld), 0.0f), dw(size_t(c.dim), 0.0f);
    RmsNormBwdParams p{.rows = c.rows,
                       .dim = c.dim,
                       .x = x.data(),
                       .ldx = ld,
                       .w = c.weighted ? w.data() : nullptr,
                       .dy = dy.data(),
                       .lddy = ld,
                       .dx = dx.data(),
                       .lddx = ld,
                       .dw = c.weighted ? dw.data() : nullptr,
                       .eps = eps,
                       .order = c.order};
    ASSERT_EQ(rmsnorm_backward_check(p), nullptr);
    rmsnorm_backward(p);
    std::vector<double> dw_fd(size_t(c.dim), 0.0), dw_mag(size_t(c.dim), 0.0);
    for (int64_t r = 0; r < c.rows; ++r) {
      std::vector<double> xd(size_t(c.dim)), wd, dyd(size_t(c.dim));
      for (int64_t i = 0; i < c.dim; ++i) {
        xd[size_t(i)] = x[size_t(r * ld + i)];
        dyd[size_t(i)] = dy[size_t(r * ld + i)];
      }
      if (c.weighted) wd.assign(w.begin(), w.end());
      // Error scale of a dx element in fp32: |r g_i| + (r^3 / dim) * sum_j |g_j x_j| * |x_i|.
      double ss = 0, gx_abs = 0;
      for (int64_t i = 0; i < c.dim; ++i) {
        ss += xd[size_t(i)] * xd[size_t(i)];
        gx_abs += std::fabs(dyd[size_t(i)] * (c.weighted ? wd[size_t(i)] : 1.0) * xd[size_t(i)]);
      }
      const double rr = 1.0 / std::sqrt(ss / double(c.dim) + eps);
      for (int64_t i = 0; i < c.dim; ++i) {
        const double h = 1e-4 * std::max(std::fabs(xd[size_t(i)]), 1e-3);
        auto xp = xd, xm = xd;
        xp[size_t(i)] += h;
        xm[size_t(i)] -= h;
        const double fd = (rms_loss_d(xp, wd, dyd, eps) - rms_loss_d(xm, wd, dyd, eps)) / (2 * h);
        const double gi = dyd[size_t(i)] * (c.weighted ? wd[size_t(i)] : 1.0);
        const double scale =
            rr * std::fabs(gi) + rr * rr * rr / double(c.dim) * gx_abs * std::fabs(xd[size_t(i)]);
        EXPECT_NEAR(dx[size_t(r * ld + i)], fd, 1e-5 * scale + 1e-9 * std::fabs(fd))
            << "row " << r << " i " << i;
        if (c.weighted) {
          dw_fd[size_t(i)] += dyd[size_t(i)] * xd[size_t(i)] * rr;  // d loss / d w_i, linear in w
          dw_mag[size_t(i)] += std::fabs(dyd[size_t(i)] * xd[size_t(i)] * rr);
        }
      }
    }
    if (!c.weighted) continue;
    // dw against finite differences of the whole batch's loss in w.
    for (int64_t i = 0; i < c.dim; ++i) {
      double fd = 0;
      for (int64_t r = 0; r < c.rows; ++r) {
        std::vector<double> xd(size_t(c.dim)), dyd(size_t(c.dim)), wp(w.begin(), w.end()),
            wm(w.begin(), w.end());
        for (int64_t j = 0; j < c.dim; ++j) {
          xd[size_t(j)] = x[size_t(r * ld + j)];
          dyd[size_t(j)] = dy[size_t(r * ld + j)];
        }
        const double h = 1e-3;
        wp[size_t(i)] += h;
        wm[size_t(i)] -= h;
        fd += (rms_loss_d(xd, wp, dyd, eps) - rms_loss_d(xd, wm, dyd, eps)) / (2 * h);
      }
      EXPECT_NEAR(dw[size_t(i)], fd, 1e-5 * dw_mag[size_t(i)] + 1e-12) << "dw " << i;
      EXPECT_NEAR(fd, dw_fd[size_t(i)], 1e-9 * dw_mag[size_t(i)] + 1e-12);
    }
    EXPECT_FALSE(test::all_zero(dw));
  }
}

// The documented operation order, written out with the forward's rms_scale and dot.
TEST(RmsNormBackward, FollowsTheDocumentedOrderBitwise) {
  for (ReduceOrder o : {ReduceOrder{}, ReduceOrder{16}}) {
    auto g = rng_for("rmsnorm_bwd_order");
    const int64_t rows = 4, dim = 45;
    std::vector<float> x = randn(g, size_t(rows * dim)), dy = randn(g, size_t(rows * dim)),
                       w = randn(g, size_t(dim));
    std::vector<float> dx0 = randn(g, size_t(rows * dim)), dw0 = randn(g, size_t(dim));
    std::vector<float> dx = dx0, dw = dw0;
    rmsnorm_backward(RmsNormBwdParams{.rows = rows,
                                      .dim = dim,
                                      .x = x.data(),
                                      .ldx = dim,
                                      .w = w.data(),
                                      .dy = dy.data(),
                                      .lddy = dim,
                                      .dx = dx.data(),
                                      .lddx = dim,
                                      .accumulate_dx = true,
                                      .dw = dw.data(),
                                      .eps = 1e-6f,
                                      .order = o});
    std::vector<float> want_dx = dx0, want_dw = dw0, s(size_t(dim), 0.0f), gv(static_cast<size_t>(dim));
    for (int64_t r = 0; r < rows; ++r) {
      const float* xr = x.data() + r * dim;
      const float* dyr = dy.data() + r * dim;
      const float rr = common::rms_scale(sum_squares(xr, dim, o), dim, 1e-6f);
      for (int64_t i = 0; i < dim; ++i) gv[size_t(i)] = dyr[i] * w[size_t(i)];
      const float c = (((rr * rr) * rr) / float(dim)) * dot(gv.data(), xr, dim, o);
      for (int64_t i = 0; i < dim; ++i) {
        want_dx[size_t(r * dim + i)] = want_dx[size_t(r * dim + i)] + (rr * gv[size_t(i)] - c * xr[i]);
        s[size_t(i)] += (dyr[i] * xr[i]) * rr;
      }
    }
    for (int64_t i = 0; i < dim; ++i) want_dw[size_t(i)] = want_dw[size_t(i)] + s[size_t(i)];
    EXPECT_TRUE(bitwise_equal(dx, want_dx)) << o.block;
    EXPECT_TRUE(bitwise_equal(dw, want_dw)) << o.block;
  }
}

TEST(RmsNormBackward, RowAloneEqualsRowInBatchAndThreadsInvariant) {
  auto g = rng_for("rmsnorm_bwd_threads");
  const int64_t rows = 70, dim = 1001;
  std::vector<float> x = randn(g, size_t(rows * dim)), dy = randn(g, size_t(rows * dim)),
                     w = randn(g, size_t(dim));
  auto run = [&](int64_t r0, int64_t n, std::vector<float>& dx, std::vector<float>& dw) {
    dx.assign(size_t(n * dim), 0.0f);
    dw.assign(size_t(dim), 0.0f);
    rmsnorm_backward(RmsNormBwdParams{.rows = n,
                                      .dim = dim,
                                      .x = x.data() + r0 * dim,
                                      .ldx = dim,
                                      .w = w.data(),
                                      .dy = dy.data() + r0 * dim,
                                      .lddy = dim,
                                      .dx = dx.data(),
                                      .lddx = dim,
                                      .dw = dw.data()});
  };
  std::vector<float> dx1, dw1, dx3, dw3, dxa, dwa;
  with_threads(1, [&] { run(0, rows, dx1, dw1); });
  with_threads(3, [&] { run(0, rows, dx3, dw3); });
  EXPECT_TRUE(bitwise_equal(dx1, dx3));
  EXPECT_TRUE(bitwise_equal(dw1, dw3));
  for (int64_t r : {0, 33, 69}) {
    run(r, 1, dxa, dwa);
    EXPECT_TRUE(bitwise_equal(dxa, std::vector<float>(dx1.begin() + r * dim, dx1.begin() + (r + 1) * dim)))
        << r;
  }
}

TEST(RmsNormBackward, ChecksNameTheProblem) {
  std::vector<float> x(8), dy(8), dx(8);
  RmsNormBwdParams p{
      .rows = 2, .dim = 4, .x = x.data(), .ldx = 4, .dy = dy.data(), .lddy = 4, .dx = dx.data(), .lddx = 4};
  EXPECT_EQ(rmsnorm_backward_check(p), nullptr);
  auto bad = p;
  bad.dim = 0;
  EXPECT_STREQ(rmsnorm_backward_check(bad), "rmsnorm_backward: rows must be >= 0 and dim > 0");
  bad = p;
  bad.dx = x.data();
  EXPECT_STREQ(rmsnorm_backward_check(bad), "rmsnorm_backward: dx overlaps x");
  bad = p;
  bad.dx = dy.data();
  EXPECT_STREQ(rmsnorm_backward_check(bad), "rmsnorm_backward: dx overlaps dy");
  bad = p;
  bad.lddy = 3;
  EXPECT_STREQ(rmsnorm_backward_check(bad), "rmsnorm_backward: lddy < dim");
  bad = p;
  bad.dy = nullptr;
  EXPECT_STREQ(rmsnorm_backward_check(bad), "rmsnorm_backward: x, dy or dx is null");
  bad = p;
  bad.order = {4};
  EXPECT_STREQ(rmsnorm_backward_check(bad),
               "rmsnorm_backward: reduce block must be 0 or a positive multiple of 8");
}

// ---- embedding ----------------------------------------------------------------------------------

TEST(EmbedBackward, RepeatedTokensSumInTokenOrder) {
  for (int copies : {1, 4}) {
    for (int64_t T : {int64_t(1), int64_t(9), int64_t(400)}) {
      auto g = rng_for("embed_bwd");
      const int64_t V = 11, D = 67;
      std::uniform_int_distribution<int32_t> tok(0, 4);  // few distinct tokens: many repeats
      std::vector<int32_t> tokens(static_cast<size_t>(T));
      for (auto& t : tokens) t = tok(g);
      std::vector<float> dH = randn(g, size_t(T * copies * D));
      // Magnitudes far apart: a different summation order gives different bits.
      for (size_t i = 0; i < dH.size(); i += 3) dH[i] *= 1e7f;
      std::vector<float> table0 = randn(g, size_t(V * D));
      std::vector<float> want = table0;
      for (int64_t t = 0; t < T; ++t)
        for (int j = 0; j < copies; ++j)
          for (int64_t d = 0; d < D; ++d)
            want[size_t(tokens[size_t(t)] * D + d)] += dH[size_t((t * copies + j) * D + d)];
      std::vector<float> t1 = table0, t3 = table0;
      with_threads(1, [&] { embed_backward(dH.data(), D, tokens.data(), T, copies, t1.data()); });
      with_threads(3, [&] { embed_backward(dH.data(), D, tokens.data(), T, copies, t3.data()); });
      EXPECT_TRUE(bitwise_equal(t1, want)) << copies << " " << T;
      EXPECT_TRUE(bitwise_equal(t3, want)) << copies << " " << T;
      // Rows of tokens that do not occur are untouched.
      for (int64_t v = 5; v < V; ++v)
        for (int64_t d = 0; d < D; ++d) ASSERT_EQ(t1[size_t(v * D + d)], table0[size_t(v * D + d)]);
    }
  }
}

// ---- log-probabilities --------------------------------------------------------------------------

double logprob_d(const float* l, int64_t V, int32_t target, double tau, int64_t v_pert = -1, double h = 0) {
  std::vector<double> z(static_cast<size_t>(V));
  double M = -std::numeric_limits<double>::infinity();
  for (int64_t v = 0; v < V; ++v) {
    z[size_t(v)] = (double(l[v]) + (v == v_pert ? h : 0.0)) / tau;
    M = std::max(M, z[size_t(v)]);
  }
  double s = 0;
  for (int64_t v = 0; v < V; ++v) s += std::exp(z[size_t(v)] - M);
  return z[size_t(target)] - (M + std::log(s));
}

TEST(LogSoftmaxBackward, MatchesFiniteDifferencesOfFloat64LogSoftmax) {
  for (float tau : {1.0f, 0.7f}) {
    for (int64_t V : {int64_t(1), int64_t(5), int64_t(37), int64_t(1001)}) {
      SCOPED_TRACE(testing::Message() << "tau=" << tau << " V=" << V);
      auto g = rng_for("logsoftmax_bwd" + std::to_string(V));
      const int64_t rows = 4;
      std::vector<float> logits = randn(g, size_t(rows * V), 3.0f);
      std::vector<int32_t> target(static_cast<size_t>(rows));
      std::uniform_int_distribution<int32_t> tv(0, int32_t(V - 1));
      for (auto& t : target) t = tv(g);
      if (V > 1) {
        logits[size_t(V + target[1])] = 30.0f;  // row 1: the target takes almost all the mass
        logits[size_t(2 * V + (target[2] + 1) % V)] = -std::numeric_limits<float>::infinity();  // masked
      }
      std::vector<float> dlogprob = {0.75f, -1.3f, 2.0f, 0.4f};
      std::vector<float> dl(size_t(rows * V), 1.0f);
      log_softmax_backward(logits.data(), rows, V, target.data(), dlogprob.data(), tau, dl.data());
      for (int64_t t = 0; t < rows; ++t) {
        const float* l = logits.data() + t * V;
        // softmax probabilities in float64, for the error scale
        std::vector<double> p(static_cast<size_t>(V));
        double M = -INFINITY, s = 0;
        for (int64_t v = 0; v < V; ++v) M = std::max(M, double(l[v]) / tau);
        for (int64_t v = 0; v < V; ++v) s += (p[size_t(v)] = std::exp(double(l[v]) / tau - M));
        for (int64_t v = 0; v < V; ++v) {
          const float got = dl[size_t(t * V + v)];
          if (std::isinf(l[v])) {
            EXPECT_EQ(got, 0.0f) << "masked logit";
            continue;
          }
          const double h = 1e-4;
          const double fd = dlogprob[size_t(t)] *
                            (logprob_d(l, V, target[size_t(t)], tau, v, h) -
                             logprob_d(l, V, target[size_t(t)], tau, v, -h)) /
                            (2 * h);
          // fp32: p has a relative error of a few ulps of |z| + |lse|; plus an absolute floor.
          const double coef = std::fabs(dlogprob[size_t(t)] / tau);
          const double tol =
              coef * (2e-6 * (p[size_t(v)] / s) * (1 + std::fabs(double(l[v]) / tau) + std::fabs(M)) + 2e-7);
          EXPECT_NEAR(got, fd, tol) << "row " << t << " v " << v;
        }
      }
    }
  }
}

TEST(LogSoftmaxBackward, ZeroGradientRowsAndRowsWithoutTargetGiveZeros) {
  auto g = rng_for("logsoftmax_bwd_zero");
  const int64_t rows = 3, V = 9;
  std::vector<float> logits = randn(g, size_t(rows * V));
  std::vector<int32_t> target = {2, -1, 9};
  std::vector<float> dlogprob = {0.0f, 1.0f, 1.0f};
  std::vector<float> dl(size_t(rows * V), 5.0f);
  log_softmax_backward(logits.data(), rows, V, target.data(), dlogprob.data(), 0.7f, dl.data());
  EXPECT_TRUE(test::all_zero(dl));
}

TEST(LogSoftmaxBackward, RowAloneEqualsRowInBatchAndThreadsInvariant) {
  auto g = rng_for("logsoftmax_bwd_threads");
  const int64_t rows = 40, V = 1001;
  std::vector<float> logits = randn(g, size_t(rows * V), 2.0f);
  std::vector<int32_t> target(static_cast<size_t>(rows));
  for (int64_t t = 0; t < rows; ++t) target[size_t(t)] = int32_t((t * 37) % V);
  std::vector<float> dlogprob = randn(g, size_t(rows));
  std::vector<float> d1(size_t(rows * V)), d3(size_t(rows * V)), one(static_cast<size_t>(V));
  with_threads(1, [&] {
    log_softmax_backward(logits.data(), rows, V, target.data(), dlogprob.data(), 0.7f, d1.data());
  });
  with_threads(3, [&] {
    log_softmax_backward(logits.data(), rows, V, target.data(), dlogprob.data(), 0.7f, d3.data());
  });
  EXPECT_TRUE(bitwise_equal(d1, d3));
  EXPECT_FALSE(test::all_zero(d1));
  for (int64_t t : {0, 17, 39}) {
    log_softmax_backward(logits.data() + t * V, 1, V, target.data() + t, dlogprob.data() + t, 0.7f,
                         one.data());
    EXPECT_TRUE(bitwise_equal(one, std::vector<float>(d1.begin() + t * V, d1.begin() + (t + 1) * V))) << t;
  }
}

}  // namespace
}  // namespace dsv4
