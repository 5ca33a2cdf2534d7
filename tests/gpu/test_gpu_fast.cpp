// The tensor_core reduction order of the GEMM (fast numerics, kernels/cuda/linear_tc.cu): against a
// float64 reference within its documented bound, and the properties that make it replayable — the same
// bytes run to run, for any batch composition (a row's result alone, in any sub-batch or at any offset
// equals its result in the whole batch), for any input alignment, with inputs taken as bf16 and the
// output rounded once. Shapes include odd m, n and k (tails of every tile dimension).
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "gpu_test_util.h"
#include "kernels/cuda/ops.h"
#include "kernels/linear.h"
#include "kernels/numerics/numerics.h"

namespace dsv4 {
namespace {

constexpr ReduceOrder kTensorCore{.block = 0, .tensor_core = true};

std::vector<float> random_bf16(size_t n, uint32_t seed, float scale) {
  std::mt19937 g(seed);
  std::normal_distribution<float> d(0.0f, scale);
  std::vector<float> v(n);
  for (float& x : v) x = num::bf16_round(d(g));
  return v;
}

bool same_bytes(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

// y [m, n] of the tensor-core GEMM on the device (x row stride ldx >= k, w row stride ldw >= k).
std::vector<float> gemm_tc(const std::vector<float>& x, int64_t ldx, const std::vector<float>& w, int64_t ldw,
                           int64_t m, int64_t n, int64_t k, OutRound round) {
  test::DeviceBuffers d;
  GemmParams p;
  p.m = m, p.n = n, p.k = k, p.ldx = ldx, p.ldw = ldw, p.ldy = n, p.round = round, p.order = kTensorCore;
  p.x = d.upload(x, "x");
  p.w = d.upload(w, "w");
  std::vector<float> y0(size_t(m * n), -7.0f);
  p.y = d.upload(y0, "y");
  cuda::gemm(p, nullptr);
  EXPECT_TRUE(d.guards_intact());
  return d.download(p.y, y0.size());
}

struct Shape {
  int64_t m, n, k;
};
const std::vector<Shape> kShapes = {{1, 1, 1},     {3, 7, 15},     {16, 8, 16},    {17, 9, 33},
                                    {128, 128, 32}, {129, 130, 100}, {300, 257, 256}, {64, 512, 1000},
                                    {257, 64, 4096}};

class FastGemm : public ::testing::Test {
 protected:
  void SetUp() override { DSV4_REQUIRE_CUDA_DEVICE(); }
};

// Every element within the bound of fp32 accumulation of exact bf16 products:
// |y - sum| <= 2^-22 * k_tiles * sum |x_i w_i| (each 16-wide tensor-core step and each accumulation
// adds at most a few fp32 ulps of the running magnitude), against a float64 sum written here.
TEST_F(FastGemm, MatchesFloat64WithinItsBound) {
  for (const Shape& s : kShapes) {
    SCOPED_TRACE(std::to_string(s.m) + " x " + std::to_string(s.n) + " x " + std::to_string(s.k));
    const auto x = random_bf16(size_t(s.m * s.k), 1, 1.0f), w = random_bf16(size_t(s.n * s.k), 2, 0.05f);
    const auto y = gemm_tc(x, s.k, w, s.k, s.m, s.n, s.k, OutRound::f32);
    const double tiles = double((s.k + 15) / 16 + 1);
    int64_t bad = 0;
    double worst = 0;
    for (int64_t i = 0; i < s.m; ++i)
      for (int64_t j = 0; j < s.n; ++j) {
        double sum = 0, mag = 0;
        for (int64_t c = 0; c < s.k; ++c) {
          const double p = double(x[size_t(i * s.k + c)]) * double(w[size_t(j * s.k + c)]);
          sum += p;
          mag += std::fabs(p);
        }
        const double err = std::fabs(double(y[size_t(i * s.n + j)]) - sum);
        const double bound = std::ldexp(1.0, -22) * tiles * mag + 1e-30;
        worst = std::max(worst, err / bound);
        bad += err > bound;
      }
    EXPECT_EQ(bad, 0) << "elements outside the bound; worst error / bound " << worst;
  }
}

// Run to run, and a row's bytes never depend on the rows around it: the whole batch against each row
// alone, against sub-batches starting at other offsets (other tile positions), and with the rows
// reversed.
TEST_F(FastGemm, RunToRunAndBatchInvariant) {
  const int64_t m = 300, n = 257, k = 520;
  const auto x = random_bf16(size_t(m * k), 3, 1.0f), w = random_bf16(size_t(n * k), 4, 0.05f);
  const auto all = gemm_tc(x, k, w, k, m, n, k, OutRound::bf16);
  EXPECT_TRUE(same_bytes(all, gemm_tc(x, k, w, k, m, n, k, OutRound::bf16))) << "run to run";
  for (int64_t first : {0, 1, 77, 128, 299}) {
    for (int64_t rows : {int64_t(1), int64_t(5), int64_t(130)}) {
      if (first + rows > m) continue;
      const std::vector<float> sub(x.begin() + first * k, x.begin() + (first + rows) * k);
      const auto ys = gemm_tc(sub, k, w, k, rows, n, k, OutRound::bf16);
      EXPECT_TRUE(same_bytes(ys, std::vector<float>(all.begin() + first * n, all.begin() + (first + rows) * n)))
          << rows << " rows from row " << first;
    }
  }
  std::vector<float> rev(x.size());
  for (int64_t i = 0; i < m; ++i)
    std::copy(x.begin() + i * k, x.begin() + (i + 1) * k, rev.begin() + (m - 1 - i) * k);
  const auto yr = gemm_tc(rev, k, w, k, m, n, k, OutRound::bf16);
  for (int64_t i = 0; i < m; ++i)
    ASSERT_TRUE(same_bytes(std::vector<float>(yr.begin() + (m - 1 - i) * n, yr.begin() + (m - i) * n),
                           std::vector<float>(all.begin() + i * n, all.begin() + (i + 1) * n)))
        << "row " << i << " reversed";
}

// Rows whose stride or start is not 16-byte aligned (the scalar staging path) give the aligned bytes.
TEST_F(FastGemm, AlignmentDoesNotChangeBits) {
  const int64_t m = 70, n = 45, k = 123;
  const auto x = random_bf16(size_t(m * k), 5, 1.0f), w = random_bf16(size_t(n * k), 6, 0.05f);
  const auto ref = gemm_tc(x, k, w, k, m, n, k, OutRound::f32);
  const int64_t ld = k + 3;  // padded rows, odd stride
  std::vector<float> xp(size_t(m * ld), 9.0f), wp(size_t(n * ld), 9.0f);
  for (int64_t i = 0; i < m; ++i) std::copy(x.begin() + i * k, x.begin() + (i + 1) * k, xp.begin() + i * ld);
  for (int64_t j = 0; j < n; ++j) std::copy(w.begin() + j * k, w.begin() + (j + 1) * k, wp.begin() + j * ld);
  EXPECT_TRUE(same_bytes(ref, gemm_tc(xp, ld, wp, ld, m, n, k, OutRound::f32)));
  // k a multiple of 4 but the rows start unaligned (x from element 1 of its buffer).
  const int64_t k4 = 128;
  const auto x4 = random_bf16(size_t(m * k4 + 1), 7, 1.0f), w4 = random_bf16(size_t(n * k4), 8, 0.05f);
  const std::vector<float> x4a(x4.begin() + 1, x4.end());
  test::DeviceBuffers d;
  GemmParams p;
  p.m = m, p.n = n, p.k = k4, p.ldx = k4, p.ldw = k4, p.ldy = n, p.round = OutRound::f32, p.order = kTensorCore;
  p.x = d.upload(x4, "x") + 1;
  p.w = d.upload(w4, "w");
  p.y = d.upload(std::vector<float>(size_t(m * n), 0.0f), "y");
  cuda::gemm(p, nullptr);
  EXPECT_TRUE(same_bytes(d.download(p.y, size_t(m * n)), gemm_tc(x4a, k4, w4, k4, m, n, k4, OutRound::f32)));
}

// Inputs are taken as bf16 (round to nearest even), and a bf16 output is the fp32 output rounded once.
TEST_F(FastGemm, InputsAreBf16AndTheOutputIsRoundedOnce) {
  const int64_t m = 33, n = 40, k = 200;
  std::mt19937 g(11);
  std::normal_distribution<float> dist(0.0f, 1.0f);
  std::vector<float> x(size_t(m * k)), w(size_t(n * k));
  for (float& v : x) v = dist(g);
  for (float& v : w) v = 0.05f * dist(g);
  std::vector<float> xr = x, wr = w;
  for (float& v : xr) v = num::bf16_round(v);
  for (float& v : wr) v = num::bf16_round(v);
  const auto y = gemm_tc(x, k, w, k, m, n, k, OutRound::f32);
  EXPECT_TRUE(same_bytes(y, gemm_tc(xr, k, wr, k, m, n, k, OutRound::f32)));
  auto yb = gemm_tc(x, k, w, k, m, n, k, OutRound::bf16);
  for (size_t i = 0; i < y.size(); ++i) ASSERT_EQ(yb[i], num::bf16_round(y[i])) << "element " << i;
}

// k = 0 gives zeros; m or n = 0 writes nothing.
TEST_F(FastGemm, EmptyShapes) {
  const auto y = gemm_tc({}, 0, {}, 0, 4, 3, 0, OutRound::f32);
  for (float v : y) EXPECT_EQ(v, 0.0f);
  const auto none = gemm_tc(random_bf16(8, 1, 1.f), 8, {}, 8, 1, 0, 8, OutRound::f32);
  EXPECT_TRUE(none.empty());
}

}  // namespace
}  // namespace dsv4
