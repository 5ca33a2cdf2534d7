// The tensor_core order (fast numerics) of the GEMM (kernels/cuda/linear_tc.cu), the indexer
// (kernels/cuda/indexer.cu) and the sparse attention (kernels/cuda/attention_tc.cu): against float64 references within their documented bounds,
// and the properties that make them replayable — the same bytes run to run, for any batch composition
// (a row's result alone, in any sub-batch or at any offset equals its result in the whole batch), for
// any input alignment, with inputs taken as bf16 and the output rounded once; for the attention also
// each head alone (odd head counts 1, 3, 43, 61 and two head tiles), wherever -1 padding sits, and the
// empty row. Shapes include odd m, n, k, Dh, K and partial slot blocks.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "gpu_test_util.h"
#include "kernels/attention.h"
#include "kernels/cuda/ops.h"
#include "kernels/indexer.h"
#include "kernels/detail/moe.h"
#include "kernels/linear.h"
#include "kernels/moe.h"
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

// y [m, n] of the tensor-core GEMM on the device (x row stride ldx >= k, w row stride ldw >= k); with
// mma_sync, by the mma.sync kernel (cuda::gemm_tiled) instead of the one cuda::gemm picks.
std::vector<float> gemm_tc(const std::vector<float>& x, int64_t ldx, const std::vector<float>& w, int64_t ldw,
                           int64_t m, int64_t n, int64_t k, OutRound round, bool mma_sync = false) {
  test::DeviceBuffers d;
  GemmParams p;
  p.m = m, p.n = n, p.k = k, p.ldx = ldx, p.ldw = ldw, p.ldy = n, p.round = round, p.order = kTensorCore;
  p.x = d.upload(x, "x");
  p.w = d.upload(w, "w");
  std::vector<float> y0(size_t(m * n), -7.0f);
  p.y = d.upload(y0, "y");
  if (mma_sync)
    cuda::gemm_tiled(p, nullptr);
  else
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

// On Hopper with sm_90a code, cuda::gemm runs the wgmma kernel; its bytes are the mma.sync kernel's, so
// a fast trace's bits do not depend on which of the two a build holds. Shapes cover both of its tile
// widths (n <= 128 and wider), m, n and k tails (k padded to 32 past a whole stage of 64), long k, and
// inputs over a wide range of magnitudes with signed zeros (the products' alignment inside a step), and
// more than one band of tile rows with a partial last band (the wgmma kernel's tile order).
TEST_F(FastGemm, WgmmaKernelEqualsMmaSyncKernel) {
  if (!cuda::gemm_tensor_core_uses_wgmma()) GTEST_SKIP() << "this device or build runs the mma.sync kernel only";
  const std::vector<Shape> shapes = {{1, 1, 1},         {3, 7, 15},      {129, 130, 100},  {300, 257, 96},
                                     {200, 128, 4000},  {64, 513, 1000}, {257, 640, 4096}, {1000, 300, 32},
                                     {130, 1024, 2080}, {1300, 300, 64}, {2100, 96, 40}};
  std::mt19937 g(21);
  std::uniform_int_distribution<int> expo(-30, 30);
  for (const Shape& s : shapes) {
    SCOPED_TRACE(std::to_string(s.m) + " x " + std::to_string(s.n) + " x " + std::to_string(s.k));
    auto x = random_bf16(size_t(s.m * s.k), 22, 1.0f), w = random_bf16(size_t(s.n * s.k), 23, 0.05f);
    for (size_t i = 0; i < x.size(); i += 7) x[i] = num::bf16_round(std::ldexp(x[i], expo(g)));
    for (size_t i = 3; i < w.size(); i += 11) w[i] = i % 2 ? -0.0f : 0.0f;
    const auto y = gemm_tc(x, s.k, w, s.k, s.m, s.n, s.k, OutRound::f32);
    const auto ref = gemm_tc(x, s.k, w, s.k, s.m, s.n, s.k, OutRound::f32, /*mma_sync=*/true);
    ASSERT_EQ(y.size(), ref.size());
    int64_t differ = 0, first = -1;
    for (size_t i = 0; i < y.size(); ++i)
      if (std::memcmp(&y[i], &ref[i], sizeof(float)) != 0) first = first < 0 ? int64_t(i) : first, ++differ;
    EXPECT_EQ(differ, 0) << "elements differ; the first, " << first << ": " << (first < 0 ? 0.f : y[size_t(first)])
                         << " against " << (first < 0 ? 0.f : ref[size_t(first)]);
  }
}

// Weights kept in bf16 (cuda::keep_bf16_weights): a call that reads rows of a registered matrix reads
// its bf16 copy, made once by the first such call, and gives the bytes of a call that converts w itself:
// for the whole matrix and for row blocks inside it (wo_a's groups), with k tails, by either kernel. A
// call whose w is not at a row start or whose ldw is not the matrix's row goes on converting; a matrix
// registered again after its data changed gets a new copy; a forgotten one is converted again.
TEST_F(FastGemm, KeptBf16WeightsGiveTheSameBytes) {
  struct Case {
    int64_t rows, m, n, k, row0;
  };
  for (const Case c : {Case{7, 5, 7, 15, 0}, Case{300, 129, 100, 100, 200}, Case{1024, 257, 256, 4096, 512},
                       Case{96, 40, 32, 33, 64}}) {
    SCOPED_TRACE("rows " + std::to_string(c.rows) + ", n " + std::to_string(c.n) + ", k " + std::to_string(c.k) +
                 " from row " + std::to_string(c.row0));
    const auto x = random_bf16(size_t(c.m * c.k), 41, 1.0f);
    auto w = random_bf16(size_t(c.rows * c.k), 42, 0.05f);
    for (size_t i = 5; i < w.size(); i += 13) w[i] = i % 2 ? -0.0f : 0.0f;
    test::DeviceBuffers d;
    float* dw = d.upload(w, "w");
    std::vector<float> y0(size_t(c.m * c.n), -7.0f);
    GemmParams p;
    p.m = c.m, p.n = c.n, p.k = c.k, p.ldx = c.k, p.ldw = c.k, p.ldy = c.n, p.round = OutRound::f32,
    p.order = kTensorCore;
    p.x = d.upload(x, "x"), p.w = dw + c.row0 * c.k, p.y = d.upload(y0, "y");
    auto run = [&](bool mma_sync) {
      if (mma_sync)
        cuda::gemm_tiled(p, nullptr);
      else
        cuda::gemm(p, nullptr);
      return d.download(p.y, y0.size());
    };
    const auto converted = run(false), converted_mma = run(true);
    const cuda::KeptWeights before = cuda::kept_bf16_weights();
    cuda::keep_bf16_weights(dw, c.rows, c.k);
    EXPECT_TRUE(same_bytes(run(false), converted)) << "kept copy, the kernel gemm picks";
    EXPECT_TRUE(same_bytes(run(true), converted_mma)) << "kept copy, the mma.sync kernel";
    const cuda::KeptWeights after = cuda::kept_bf16_weights();
    EXPECT_EQ(after.registered, before.registered + 1);
    EXPECT_EQ(after.copied, before.copied + 1) << "one copy, made by the first call";
    EXPECT_EQ(after.copy_bytes - before.copy_bytes, 2 * c.rows * ((c.k + 31) / 32 * 32));

    // A w that is not at a row start, or read with another row stride, is converted by the call.
    if (c.k > 1) {
      GemmParams q = p;
      q.w = dw + c.row0 * c.k + 1, q.k = c.k - 1;
      cuda::gemm(q, nullptr);
      const auto y_shift = d.download(q.y, y0.size());
      cuda::forget_bf16_weights(dw, dw + 1);
      cuda::gemm(q, nullptr);
      EXPECT_TRUE(same_bytes(d.download(q.y, y0.size()), y_shift)) << "w inside a row";
      cuda::keep_bf16_weights(dw, c.rows, c.k);
    }
    // New data under a matrix registered again: a new copy.
    auto w2 = random_bf16(w.size(), 43, 0.05f);
    ASSERT_EQ(cudaMemcpy(dw, w2.data(), w2.size() * sizeof(float), cudaMemcpyHostToDevice), cudaSuccess);
    cuda::keep_bf16_weights(dw, c.rows, c.k);
    const auto kept_new = run(false);
    cuda::forget_bf16_weights(dw, dw + c.rows * c.k);
    EXPECT_EQ(cuda::kept_bf16_weights().registered, before.registered) << "forgotten";
    EXPECT_TRUE(same_bytes(kept_new, run(false))) << "registered again after the data changed";
    EXPECT_FALSE(same_bytes(kept_new, converted)) << "the new data gives other bytes";
    EXPECT_TRUE(d.guards_intact());
  }
}

// GEMMs that read the same x can share its bf16 copy (cuda::gemm_x_to_bf16, GemmParams::x16): the copy
// holds x's values rounded to bf16 (num::bf16_bits) with zeros past k in rows of gemm_bf16_row_width(k),
// and a GEMM handed it gives the bytes of the GEMM that converts x itself, with either kernel, for
// k tails, a padded x stride and kept weights. The exact orders refuse a copy.
TEST_F(FastGemm, SharedBf16CopyOfXGivesTheSameBytes) {
  for (const Shape s :
       std::vector<Shape>{{1, 1, 1}, {3, 7, 15}, {129, 130, 100}, {300, 257, 256}, {257, 640, 4096}}) {
    SCOPED_TRACE(std::to_string(s.m) + " x " + std::to_string(s.n) + " x " + std::to_string(s.k));
    const int64_t ldx = s.k + 5, width = cuda::gemm_bf16_row_width(s.k);
    EXPECT_EQ(width, (s.k + 31) / 32 * 32);
    auto x = random_bf16(size_t(s.m * ldx), 51, 1.0f);
    for (size_t i = 0; i < x.size(); i += 9) x[i] = x[i] * 1.001f;  // not bf16 values: the copy rounds them
    const auto w = random_bf16(size_t(s.n * s.k), 52, 0.05f);
    test::DeviceBuffers d;
    std::vector<float> y0(size_t(s.m * s.n), -7.0f);
    GemmParams p;
    p.m = s.m, p.n = s.n, p.k = s.k, p.ldx = ldx, p.ldw = s.k, p.ldy = s.n, p.round = OutRound::bf16,
    p.order = kTensorCore;
    p.x = d.upload(x, "x"), p.w = d.upload(w, "w"), p.y = d.upload(y0, "y");
    const std::vector<uint16_t> unset(size_t(s.m * width), 0xffff);
    uint16_t* x16 = d.upload(unset, "x16");
    cuda::gemm_x_to_bf16(p.x, s.m, s.k, ldx, x16, nullptr);
    const auto copy = d.download(x16, unset.size());
    int64_t wrong = 0;
    for (int64_t r = 0; r < s.m; ++r)
      for (int64_t c = 0; c < width; ++c)
        wrong +=
            copy[size_t(r * width + c)] != (c < s.k ? num::bf16_bits(x[size_t(r * ldx + c)]) : uint16_t(0));
    EXPECT_EQ(wrong, 0) << "values of the copy that are not x's bf16 patterns (or zero past k)";

    auto run = [&](bool shared, bool mma_sync) {
      GemmParams q = p;
      q.x16 = shared ? x16 : nullptr;
      if (mma_sync)
        cuda::gemm_tiled(q, nullptr);
      else
        cuda::gemm(q, nullptr);
      return d.download(q.y, y0.size());
    };
    EXPECT_TRUE(same_bytes(run(true, false), run(false, false))) << "the kernel gemm picks";
    EXPECT_TRUE(same_bytes(run(true, true), run(false, true))) << "the mma.sync kernel";
    cuda::keep_bf16_weights(p.w, s.n, s.k);
    EXPECT_TRUE(same_bytes(run(true, false), run(false, false))) << "kept w";
    cuda::forget_bf16_weights(p.w, p.w + s.n * s.k);

    GemmParams exact = p;
    exact.order = ReduceOrder{};
    exact.x16 = x16;
    EXPECT_THROW(cuda::gemm(exact, nullptr), Error);
    EXPECT_TRUE(d.guards_intact());
  }
}

// The experts in the tensor_core order make their GEMMs' bf16 copies of x (gathered once for w1 and w3)
// and of A (written by the activation) themselves (kernels/cuda/moe.cu). Their output must be the bytes
// of the definition: each expert's G, U and y as separate tensor_core GEMMs over its tokens' rows, the
// CPU's activation (common::swiglu_act) and the sum in slot order, written here from those parts.
// Dimensions off the k tiles of 32 (D 100, I 72, I_shared 40), an expert with no tokens, both roundings
// of the experts' outputs.
TEST_F(FastGemm, ExpertsEqualTheirGemms) {
  const int64_t T = 37, D = 100, I = 72, Is = 40;
  const int E = 5, k = 2;
  const float L = 0.9f;
  for (const bool round_each : {false, true}) {
    SCOPED_TRACE(round_each ? "each expert rounded" : "experts summed in fp32");
    const auto x = random_bf16(size_t(T * D), 51, 1.0f);
    std::vector<std::vector<float>> w1(E), w3(E), w2(E);
    for (int e = 0; e < E; ++e) {
      w1[size_t(e)] = random_bf16(size_t(I * D), 52 + 3 * e, 0.1f);
      w3[size_t(e)] = random_bf16(size_t(I * D), 53 + 3 * e, 0.1f);
      w2[size_t(e)] = random_bf16(size_t(D * I), 54 + 3 * e, 0.1f);
    }
    const auto s1 = random_bf16(size_t(Is * D), 71, 0.1f), s3 = random_bf16(size_t(Is * D), 72, 0.1f),
               s2 = random_bf16(size_t(D * Is), 73, 0.1f);
    std::vector<int32_t> ids(size_t(T * k));
    std::vector<float> wts(size_t(T * k));
    std::mt19937 g(74);
    const int allowed[4] = {0, 1, 2, 4};  // expert 3 gets no token
    for (int64_t t = 0; t < T; ++t) {     // two distinct experts, ascending
      const int i0 = int(g() % 4);
      int i1 = int(g() % 3);
      i1 += i1 >= i0 ? 1 : 0;
      const int a = allowed[i0], c = allowed[i1];
      ids[size_t(t * k)] = std::min(a, c), ids[size_t(t * k + 1)] = std::max(a, c);
      wts[size_t(t * k)] = 0.25f + float(t % 5) / 8, wts[size_t(t * k + 1)] = 0.75f - float(t % 3) / 8;
    }

    // The definition, part by part.
    const OutRound yr = round_each ? OutRound::bf16 : OutRound::f32;
    std::vector<float> Y(size_t(T * k * D)), Ys;
    for (int e = 0; e < E; ++e) {
      std::vector<int64_t> pairs;
      std::vector<float> xe;
      for (int64_t q = 0; q < T * k; ++q)
        if (ids[size_t(q)] == e) {
          pairs.push_back(q);
          xe.insert(xe.end(), x.begin() + (q / k) * D, x.begin() + (q / k + 1) * D);
        }
      const int64_t m = int64_t(pairs.size());
      if (m == 0) continue;
      const auto G = gemm_tc(xe, D, w1[size_t(e)], D, m, I, D, OutRound::bf16);
      const auto U = gemm_tc(xe, D, w3[size_t(e)], D, m, I, D, OutRound::bf16);
      std::vector<float> A(size_t(m * I));
      for (int64_t r = 0; r < m; ++r)
        for (int64_t i = 0; i < I; ++i)
          A[size_t(r * I + i)] = common::swiglu_act(G[size_t(r * I + i)], U[size_t(r * I + i)], true, L,
                                                    &wts[size_t(pairs[size_t(r)])]);
      const auto y = gemm_tc(A, I, w2[size_t(e)], I, m, D, I, yr);
      for (int64_t r = 0; r < m; ++r)
        std::copy(y.begin() + r * D, y.begin() + (r + 1) * D, Y.begin() + pairs[size_t(r)] * D);
    }
    {
      const auto G = gemm_tc(x, D, s1, D, T, Is, D, OutRound::bf16), U = gemm_tc(x, D, s3, D, T, Is, D, OutRound::bf16);
      std::vector<float> A(size_t(T * Is));
      for (size_t i = 0; i < A.size(); ++i) A[i] = common::swiglu_act(G[i], U[i], false, L, nullptr);
      Ys = gemm_tc(A, Is, s2, Is, T, D, Is, yr);
    }
    std::vector<float> want(size_t(T * D));
    for (int64_t t = 0; t < T; ++t)
      for (int64_t d = 0; d < D; ++d) {
        float acc = 0.0f;
        for (int i = 0; i < k; ++i) acc = acc + Y[size_t((t * k + i) * D + d)];
        acc = acc + Ys[size_t(t * D + d)];
        want[size_t(t * D + d)] = num::bf16_round(acc);
      }

    // moe_experts in one call.
    test::DeviceBuffers d;
    std::vector<ExpertWeights> ex(static_cast<size_t>(E));
    for (int e = 0; e < E; ++e)
      ex[size_t(e)] = {d.upload(w1[size_t(e)], "w1"), d.upload(w3[size_t(e)], "w3"), d.upload(w2[size_t(e)], "w2")};
    const ExpertWeights sh{d.upload(s1, "s1"), d.upload(s3, "s3"), d.upload(s2, "s2")};
    MoeParams p;
    p.T = T, p.D = D, p.I = I, p.I_shared = Is, p.E = E, p.k = k, p.n_shared = 1;
    p.x = d.upload(x, "x"), p.ids = d.upload(ids, "ids"), p.weights = d.upload(wts, "weights");
    p.experts = ex.data(), p.shared = &sh, p.swiglu_limit = L, p.clamp_shared = false, p.round_each = round_each;
    p.order = kTensorCore;
    p.out = d.upload(std::vector<float>(size_t(T * D), -7.0f), "out");
    cuda::moe_experts(p, nullptr);
    EXPECT_TRUE(same_bytes(d.download(p.out, want.size()), want));
    EXPECT_TRUE(d.guards_intact());
  }
}

// ---- sparse attention in the tensor_core order ---------------------------------------------------

// One attention problem on the host: q [T, H, Dh], kv [N, Dh], idx [T, K], sink [H].
struct AttnCase {
  int64_t T = 0, Dh = 0, N = 0, K = 0;
  int H = 0;
  std::vector<float> q, kv, sink;
  std::vector<int32_t> idx;
  float scale = 0;
};

// Row t of idx holds nv[t % nv.size()] valid slots (distinct kv rows, in a random order) with -1
// holes spread among them; q and kv are bf16 values.
AttnCase make_attn(int64_t T, int H, int64_t Dh, int64_t N, int64_t K, const std::vector<int64_t>& nv,
                   uint32_t seed) {
  AttnCase c;
  c.T = T, c.H = H, c.Dh = Dh, c.N = N, c.K = K, c.scale = float(1.0 / std::sqrt(double(Dh)));
  c.q = random_bf16(size_t(T * H * Dh), seed, 1.0f);
  c.kv = random_bf16(size_t(N * Dh), seed + 1, 1.0f);
  c.sink = random_bf16(size_t(H), seed + 2, 1.0f);
  std::mt19937 g(seed + 3);
  c.idx.assign(size_t(T * K), -1);
  std::vector<int32_t> rows(static_cast<size_t>(N));
  for (int64_t t = 0; t < T; ++t) {
    const int64_t n = std::min(nv[size_t(t) % nv.size()], std::min(K, N));
    for (int64_t i = 0; i < N; ++i) rows[size_t(i)] = int32_t(i);
    std::shuffle(rows.begin(), rows.end(), g);
    std::vector<int64_t> at(static_cast<size_t>(K));
    for (int64_t j = 0; j < K; ++j) at[size_t(j)] = j;
    std::shuffle(at.begin(), at.end(), g);
    at.resize(size_t(n));
    std::sort(at.begin(), at.end());
    for (int64_t j = 0; j < n; ++j) c.idx[size_t(t * K + at[size_t(j)])] = rows[size_t(j)];
  }
  return c;
}

struct AttnOut {
  std::vector<float> o, lse;
};

// shift > 0 places q and kv `shift` floats past a 16-byte boundary (the kernel's scalar staging);
// mma_sync runs the mma.sync kernel (cuda::sparse_attention_mma_sync) instead of the one
// cuda::sparse_attention picks.
AttnOut attn_tc(const AttnCase& c, int shift = 0, bool mma_sync = false) {
  test::DeviceBuffers d;
  SparseAttnParams p;
  p.T = c.T, p.H = c.H, p.Dh = c.Dh, p.N = c.N, p.K = c.K, p.scale = c.scale, p.order = kTensorCore;
  std::vector<float> q(size_t(shift), 0.0f), kv(size_t(shift), 0.0f);
  q.insert(q.end(), c.q.begin(), c.q.end());
  kv.insert(kv.end(), c.kv.begin(), c.kv.end());
  p.q = d.upload(q, "q") + shift;
  p.kv = d.upload(kv, "kv") + shift;
  p.idx = d.upload(c.idx, "idx");
  p.sink = d.upload(c.sink, "sink");
  std::vector<float> o0(size_t(c.T * c.H * c.Dh), -7.0f), l0(size_t(c.T * c.H), -7.0f);
  p.o = d.upload(o0, "o");
  p.lse = d.upload(l0, "lse");
  if (mma_sync)
    cuda::sparse_attention_mma_sync(p, nullptr);
  else
    cuda::sparse_attention(p, nullptr);
  EXPECT_TRUE(d.guards_intact());
  return {d.download(p.o, o0.size()), d.download(p.lse, l0.size())};
}

// Rows [t0, t0 + n) of c as a problem of their own (the same kv).
AttnCase rows_of(const AttnCase& c, int64_t t0, int64_t n) {
  AttnCase r = c;
  r.T = n;
  r.q.assign(c.q.begin() + t0 * c.H * c.Dh, c.q.begin() + (t0 + n) * c.H * c.Dh);
  r.idx.assign(c.idx.begin() + t0 * c.K, c.idx.begin() + (t0 + n) * c.K);
  return r;
}

// Head h of c as a one-head problem.
AttnCase head_of(const AttnCase& c, int h) {
  AttnCase r = c;
  r.H = 1;
  r.sink = {c.sink[size_t(h)]};
  r.q.clear();
  for (int64_t t = 0; t < c.T; ++t)
    r.q.insert(r.q.end(), c.q.begin() + (t * c.H + h) * c.Dh, c.q.begin() + (t * c.H + h + 1) * c.Dh);
  return r;
}

class FastAttention : public ::testing::Test {
 protected:
  void SetUp() override { DSV4_REQUIRE_CUDA_DEVICE(); }
};

// The attention's exponent on the device (num::exp_fast_nonpos, tensor-core revision 2) gives the host's
// bits, whose accuracy test_numerics measures (Transcendental.ExpFastNonPositive): every 61st float of
// [-87, 0], the neighbourhood of the cut and the specials.
TEST_F(FastAttention, ExponentHasTheHostsBits) {
  std::vector<float> x = {0.0f,
                          -0.0f,
                          -87.0f,
                          -100.0f,
                          -FLT_MAX,
                          -std::numeric_limits<float>::infinity(),
                          std::numeric_limits<float>::quiet_NaN()};
  for (uint32_t b = 0x80000000u; b <= num::f32_bits(-87.0f); b += 61) x.push_back(num::f32_from_bits(b));
  float c = -87.0f;
  for (int i = 0; i < 1000; ++i) c = std::nextafter(c, -std::numeric_limits<float>::infinity());
  for (int i = 0; i < 2000; ++i, c = std::nextafter(c, 0.0f)) x.push_back(c);
  test::DeviceBuffers d;
  const float* dx = d.upload(x, "x");
  float* dy = d.upload(std::vector<float>(x.size(), -7.0f), "y");
  cuda::exp_fast_nonpos(dx, dy, int64_t(x.size()), nullptr);
  const std::vector<float> y = d.download(dy, x.size());
  EXPECT_TRUE(d.guards_intact());
  int64_t differ = 0;
  for (size_t i = 0; i < x.size(); ++i) {
    const float h = num::exp_fast_nonpos(x[i]);
    if (std::memcmp(&h, &y[i], sizeof h) != 0 && differ++ < 5)
      ADD_FAILURE() << "x = " << x[i] << ": device " << y[i] << ", host " << h;
  }
  EXPECT_EQ(differ, 0) << "of " << x.size();
}

// Against softmax attention with the sink in float64, written here: per element
// |o - ref| <= 2^-7 (|ref| + sum_j P_j |kv_j[d]|) + 1e-6 — the unnormalised probabilities enter P.V
// rounded to bf16 (2^-9 relative each), o is rounded to bf16 once (2^-9), the fp32 scores and exp_fast_nonpos
// add a few 1e-6; the bound leaves a factor 4. |lse - ref| <= 1e-4 (the sums are fp32). Head counts
// 1, 3, 43, 61 and 67 (two tiles), Dh 32 .. 512 (every padded width), rows of 0 .. 200 valid slots
// (partial 16- and 64-slot blocks).
TEST_F(FastAttention, MatchesFloat64WithinItsBound) {
  struct S {
    int64_t T;
    int H;
    int64_t Dh, N, K;
  };
  const std::vector<S> shapes = {{5, 1, 32, 300, 210},   {7, 3, 96, 300, 210},   {4, 43, 200, 300, 210},
                                 {3, 61, 512, 300, 210},  {2, 67, 128, 300, 210}, {6, 64, 256, 90, 80},
                                 {3, 5, 50, 300, 210}};
  const std::vector<int64_t> nv = {200, 0, 1, 15, 16, 17, 63, 64, 65, 128, 129};
  for (const S& s : shapes) {
    SCOPED_TRACE("T=" + std::to_string(s.T) + " H=" + std::to_string(s.H) + " Dh=" + std::to_string(s.Dh));
    const AttnCase c = make_attn(s.T, s.H, s.Dh, s.N, s.K, nv, uint32_t(s.Dh + s.H));
    const AttnOut r = attn_tc(c);
    int64_t bad = 0;
    for (int64_t t = 0; t < c.T; ++t)
      for (int h = 0; h < c.H; ++h) {
        const float* q = &c.q[size_t((t * c.H + h) * c.Dh)];
        std::vector<double> z;
        std::vector<const float*> rows;
        for (int64_t j = 0; j < c.K; ++j) {
          const int32_t i = c.idx[size_t(t * c.K + j)];
          if (i < 0) continue;
          const float* kv = &c.kv[size_t(i) * size_t(c.Dh)];
          double dot = 0;
          for (int64_t e = 0; e < c.Dh; ++e) dot += double(q[e]) * double(kv[e]);
          z.push_back(double(c.scale) * dot);
          rows.push_back(kv);
        }
        double M = c.sink[size_t(h)];
        for (double v : z) M = std::max(M, v);
        double Z = std::exp(double(c.sink[size_t(h)]) - M);
        for (double v : z) Z += std::exp(v - M);
        const double lse = M + std::log(Z);
        const float got_lse = r.lse[size_t(t * c.H + h)];
        if (std::fabs(got_lse - lse) > 1e-4 && bad++ < 5)
          ADD_FAILURE() << "lse t=" << t << " h=" << h << ": " << got_lse << " vs " << lse;
        for (int64_t e = 0; e < c.Dh; ++e) {
          double o = 0, mag = 0;
          for (size_t j = 0; j < z.size(); ++j) {
            const double P = std::exp(z[j] - M) / Z;
            o += P * rows[j][e];
            mag += P * std::fabs(rows[j][e]);
          }
          const float got = r.o[size_t((t * c.H + h) * c.Dh + e)];
          if (z.empty()) {
            if (got != 0.0f && bad++ < 5) ADD_FAILURE() << "empty row t=" << t << " h=" << h << ": o = " << got;
          } else if (std::fabs(got - o) > std::ldexp(1.0, -7) * (std::fabs(o) + mag) + 1e-6 && bad++ < 5) {
            ADD_FAILURE() << "o t=" << t << " h=" << h << " d=" << e << ": " << got << " vs " << o;
          }
        }
      }
    EXPECT_EQ(bad, 0);
  }
}

// The same bytes run to run; a row alone, the rows reversed and a sub-batch at another offset give
// each row's bytes of the whole batch (alone, a row reads its kv rows in fp32; the batch reads the bf16
// copy of kv: both round alike); each head alone gives its head's bytes; -1 padding moved around the
// valid slots (their order kept) and a wider idx change nothing. The empty row is o = 0, lse = sink.
TEST_F(FastAttention, RunToRunBatchHeadAndPaddingInvariant) {
  for (const int H : {1, 3, 43, 61, 67}) {
    SCOPED_TRACE("H=" + std::to_string(H));
    const int64_t T = 9, Dh = 160, N = 700, K = 150;
    const AttnCase c = make_attn(T, H, Dh, N, K, {150, 0, 77, 64, 1, 129}, uint32_t(H));
    const AttnOut all = attn_tc(c);
    const AttnOut again = attn_tc(c);
    EXPECT_TRUE(same_bytes(all.o, again.o));
    EXPECT_TRUE(same_bytes(all.lse, again.lse));
    const int64_t row = H * Dh;
    for (int64_t t = 0; t < T; ++t) {
      const AttnOut one = attn_tc(rows_of(c, t, 1));
      EXPECT_TRUE(same_bytes(one.o, std::vector<float>(all.o.begin() + t * row, all.o.begin() + (t + 1) * row)))
          << "row " << t;
      EXPECT_TRUE(same_bytes(one.lse, std::vector<float>(all.lse.begin() + t * H, all.lse.begin() + (t + 1) * H)));
    }
    const AttnOut sub = attn_tc(rows_of(c, 3, 4));
    EXPECT_TRUE(same_bytes(sub.o, std::vector<float>(all.o.begin() + 3 * row, all.o.begin() + 7 * row)));
    AttnCase rev = c;
    for (int64_t t = 0; t < T; ++t) {
      std::copy(c.q.begin() + t * row, c.q.begin() + (t + 1) * row, rev.q.begin() + (T - 1 - t) * row);
      std::copy(c.idx.begin() + t * K, c.idx.begin() + (t + 1) * K, rev.idx.begin() + (T - 1 - t) * K);
    }
    const AttnOut r = attn_tc(rev);
    for (int64_t t = 0; t < T; ++t)
      EXPECT_TRUE(std::equal(r.o.begin() + (T - 1 - t) * row, r.o.begin() + (T - t) * row, all.o.begin() + t * row,
                             [](float a, float b) { return std::memcmp(&a, &b, sizeof a) == 0; }))
          << "reversed row " << t;
    for (int h = 0; h < H; h += (H > 8 ? 7 : 1)) {
      const AttnOut one = attn_tc(head_of(c, h));
      for (int64_t t = 0; t < T; ++t) {
        const float* want = &all.o[size_t((t * H + h) * Dh)];
        EXPECT_EQ(std::memcmp(&one.o[size_t(t * Dh)], want, size_t(Dh) * sizeof(float)), 0) << "head " << h << " row " << t;
        EXPECT_EQ(std::memcmp(&one.lse[size_t(t)], &all.lse[size_t(t * H + h)], sizeof(float)), 0);
      }
    }
    // Padding: the valid slots packed at the end of a wider idx, in their order.
    AttnCase packed = c;
    packed.K = K + 37;
    packed.idx.assign(size_t(T * packed.K), -1);
    for (int64_t t = 0; t < T; ++t) {
      std::vector<int32_t> valid;
      for (int64_t j = 0; j < K; ++j)
        if (c.idx[size_t(t * K + j)] >= 0) valid.push_back(c.idx[size_t(t * K + j)]);
      std::copy(valid.begin(), valid.end(), packed.idx.begin() + (t + 1) * packed.K - int64_t(valid.size()));
    }
    const AttnOut pk = attn_tc(packed);
    EXPECT_TRUE(same_bytes(pk.o, all.o));
    EXPECT_TRUE(same_bytes(pk.lse, all.lse));
    // Row 1 is empty: only the sink.
    for (int h = 0; h < H; ++h) {
      EXPECT_EQ(all.lse[size_t(H + h)], c.sink[size_t(h)]);
      for (int64_t e = 0; e < Dh; ++e) ASSERT_EQ(all.o[size_t((H + h) * Dh + e)], 0.0f);
    }
  }
}

// q and kv are taken as bf16: unrounded inputs give the bytes of their bf16 roundings; unaligned
// inputs (the scalar staging) give the aligned ones' bytes.
TEST_F(FastAttention, InputsAreBf16) {
  AttnCase c = make_attn(4, 8, 64, 300, 100, {100, 37}, 5);
  std::mt19937 g(9);
  std::normal_distribution<float> dist(0.0f, 1.0f);
  AttnCase raw = c;
  for (float& v : raw.q) v = dist(g);
  for (float& v : raw.kv) v = dist(g);
  AttnCase rounded = raw;
  for (float& v : rounded.q) v = num::bf16_round(v);
  for (float& v : rounded.kv) v = num::bf16_round(v);
  const AttnOut a = attn_tc(raw), b = attn_tc(rounded);
  EXPECT_TRUE(same_bytes(a.o, b.o));
  EXPECT_TRUE(same_bytes(a.lse, b.lse));
  for (const int shift : {1, 2}) {
    const AttnOut u = attn_tc(raw, shift), one = attn_tc(rows_of(raw, 1, 1), shift);
    EXPECT_TRUE(same_bytes(u.o, a.o)) << "shift " << shift;
    EXPECT_TRUE(same_bytes(u.lse, a.lse)) << "shift " << shift;
    EXPECT_TRUE(same_bytes(one.o, std::vector<float>(a.o.begin() + 8 * 64, a.o.begin() + 16 * 64))) << "shift " << shift;
  }
}

// On Hopper with sm_90a code, cuda::sparse_attention runs the wgmma kernel for Dh padded to 256 or 512;
// its bytes are the mma.sync kernel's. Rows of 0 .. K valid slots (partial 16- and 64-slot blocks, a
// block whose second half is empty), one and two head tiles, Dh tails, sharp softmaxes (q scaled by
// 2^4 and 2^6: the running maximum moves and alpha underflows) and signed zeros in q and kv.
TEST_F(FastAttention, WgmmaKernelEqualsMmaSyncKernel) {
  if (!cuda::gemm_tensor_core_uses_wgmma()) GTEST_SKIP() << "this device or build runs the mma.sync kernel only";
  struct S {
    int64_t T;
    int H;
    int64_t Dh, N, K;
    float qscale;
  };
  const std::vector<S> shapes = {{24, 64, 512, 900, 640, 1.0f}, {12, 61, 300, 500, 200, 16.0f},
                                 {12, 67, 256, 400, 130, 1.0f}, {10, 3, 200, 300, 140, 64.0f},
                                 {6, 64, 512, 300, 300, 64.0f}};
  const std::vector<int64_t> nv = {640, 0, 1, 15, 16, 17, 31, 32, 33, 63, 64, 65, 100, 129, 200, 300};
  for (const S& s : shapes) {
    SCOPED_TRACE("T=" + std::to_string(s.T) + " H=" + std::to_string(s.H) + " Dh=" + std::to_string(s.Dh) +
                 " K=" + std::to_string(s.K) + " q x " + std::to_string(s.qscale));
    AttnCase c = make_attn(s.T, s.H, s.Dh, s.N, s.K, nv, uint32_t(s.Dh * 7 + s.H));
    for (float& v : c.q) v *= s.qscale;
    for (size_t i = 5; i < c.q.size(); i += 13) c.q[i] = i % 2 ? -0.0f : 0.0f;
    for (size_t i = 2; i < c.kv.size(); i += 11) c.kv[i] = i % 2 ? -0.0f : 0.0f;
    SparseAttnParams shape;
    shape.T = c.T, shape.H = c.H, shape.Dh = c.Dh, shape.N = c.N, shape.K = c.K, shape.order = kTensorCore;
    ASSERT_TRUE(cuda::sparse_attention_uses_wgmma(shape));
    const AttnOut w = attn_tc(c), ref = attn_tc(c, 0, /*mma_sync=*/true);
    for (const auto& [got, want, what] : {std::tuple(&w.o, &ref.o, "o"), std::tuple(&w.lse, &ref.lse, "lse")}) {
      ASSERT_EQ(got->size(), want->size());
      int64_t differ = 0, first = -1;
      for (size_t i = 0; i < got->size(); ++i)
        if (std::memcmp(&(*got)[i], &(*want)[i], sizeof(float)) != 0) first = first < 0 ? int64_t(i) : first, ++differ;
      EXPECT_EQ(differ, 0) << what << ": elements differ; the first, " << first << ": "
                           << (first < 0 ? 0.f : (*got)[size_t(first)]) << " against "
                           << (first < 0 ? 0.f : (*want)[size_t(first)]);
    }
  }
}

// Limits of the order are refused by name before anything runs; T = 0 is nothing to do.
TEST_F(FastAttention, LimitsAreRefused) {
  SparseAttnParams p;
  p.T = 1, p.H = 1, p.Dh = 513, p.N = 1, p.K = 1, p.order = kTensorCore;
  const char* why = cuda::sparse_attention_check(p);
  ASSERT_NE(why, nullptr);
  EXPECT_NE(std::string(why).find("Dh"), std::string::npos) << why;
  p.Dh = 512, p.K = 100000;
  why = cuda::sparse_attention_check(p);
  ASSERT_NE(why, nullptr);
  EXPECT_NE(std::string(why).find("K"), std::string::npos) << why;
  const AttnOut none = attn_tc(make_attn(0, 4, 64, 10, 8, {8}, 1));
  EXPECT_TRUE(none.o.empty());
}

// ---- the indexer in the tensor_core order ---------------------------------------------------------

struct IdxCase {
  int64_t T = 0, pos0 = 0, Di = 0, G = 0;
  int Hi = 0, k = 0, ratio = 4;
  bool bf16_scores = false;
  std::vector<float> qi, ki, wt;
};

IdxCase make_idx(int64_t T, int64_t pos0, int Hi, int64_t Di, int64_t G, int k, uint32_t seed) {
  IdxCase c;
  c.T = T, c.pos0 = pos0, c.Hi = Hi, c.Di = Di, c.G = G, c.k = k;
  c.qi = random_bf16(size_t(T * Hi * Di), seed, 1.0f);
  c.ki = random_bf16(size_t(G * Di), seed + 1, 1.0f);
  c.wt = random_bf16(size_t(T * Hi), seed + 2, 0.1f);
  return c;
}

struct IdxOut {
  std::vector<int32_t> ids;
  std::vector<float> margin, score;
};

// c's shape and inputs on the device, in the tensor_core order (no outputs set).
IndexerParams indexer_inputs(test::DeviceBuffers& d, const IdxCase& c) {
  IndexerParams p;
  p.T = c.T, p.pos0 = c.pos0, p.Hi = c.Hi, p.Di = c.Di, p.G = c.G, p.k = c.k, p.ratio = c.ratio;
  p.order = kTensorCore, p.bf16_scores = c.bf16_scores;
  p.qi = d.upload(c.qi, "qi");
  p.ki = d.upload(c.ki, "ki");
  p.wt = d.upload(c.wt, "wt");
  return p;
}

IdxOut indexer_tc(const IdxCase& c) {
  test::DeviceBuffers d;
  IndexerParams p = indexer_inputs(d, c);
  p.ids = d.upload(std::vector<int32_t>(size_t(c.T * c.k), -7), "ids");
  p.margin = d.upload(std::vector<float>(size_t(c.T), -7.0f), "margin");
  p.score = d.upload(std::vector<float>(size_t(c.T * c.k), -7.0f), "score");
  cuda::indexer_topk(p, nullptr);
  EXPECT_TRUE(d.guards_intact());
  return {d.download(p.ids, size_t(c.T * c.k)), d.download(p.margin, size_t(c.T)),
          d.download(p.score, size_t(c.T * c.k))};
}

// indexer_score_ids in the tensor_core order: the scores of the given ids.
std::vector<float> indexer_tc_scores(const IdxCase& c, const std::vector<int32_t>& ids) {
  test::DeviceBuffers d;
  const IndexerParams p = indexer_inputs(d, c);
  const int32_t* dids = d.upload(ids, "ids");
  float* score = d.upload(std::vector<float>(ids.size(), -7.0f), "score");
  cuda::indexer_score_ids(p, dids, score, nullptr);
  EXPECT_TRUE(d.guards_intact());
  return d.download(score, ids.size());
}

class FastIndexer : public ::testing::Test {
 protected:
  void SetUp() override { DSV4_REQUIRE_CUDA_DEVICE(); }
};

// Against scores in float64 written here (qi, ki are bf16 values, so the products are exact): every
// reported score within 2^-22 (Di/16 + 1) sum_h |w_h| sum_i |q_i k_i| + 2^-22 Hi sum_h |w_h relu(dot_h)| of
// the float64 score (the tensor-core dots' fp32 accumulation, then the fp32 chain over heads); the
// chosen set is the top-k up to that bound (no unchosen key beats a chosen one by more than twice
// it), ascending, min(k, visible) ids then -1; the margin is >= 0 and at most the spread the bound
// allows. Head counts 1, 3, 43, 61, 64; Di 32, 100 (the scalar staging), 128; rows with 0 .. all
// keys visible.
TEST_F(FastIndexer, MatchesFloat64WithinItsBound) {
  struct S {
    int64_t T;
    int Hi;
    int64_t Di, G;
    int k;
  };
  for (const S& s : std::vector<S>{{40, 1, 32, 10, 4}, {60, 3, 100, 15, 8}, {300, 43, 128, 75, 32},
                                   {90, 61, 128, 22, 16}, {1100, 64, 128, 275, 64}}) {
    SCOPED_TRACE("Hi=" + std::to_string(s.Hi) + " Di=" + std::to_string(s.Di) + " G=" + std::to_string(s.G));
    const IdxCase c = make_idx(s.T, 0, s.Hi, s.Di, s.G, s.k, uint32_t(s.Hi * 7 + s.Di));
    const IdxOut r = indexer_tc(c);
    int64_t bad = 0;
    for (int64_t t = 0; t < c.T; ++t) {
      const int64_t n = std::min<int64_t>(c.G, (t + 1) / c.ratio), kk = std::min<int64_t>(c.k, n);
      std::vector<double> ref(static_cast<size_t>(n)), bound(static_cast<size_t>(n));
      for (int64_t g = 0; g < n; ++g) {
        double sc = 0, b1 = 0, b2 = 0;
        for (int h = 0; h < c.Hi; ++h) {
          double dot = 0, mag = 0;
          for (int64_t i = 0; i < c.Di; ++i) {
            const double pr = double(c.qi[size_t((t * c.Hi + h) * c.Di + i)]) * double(c.ki[size_t(g * c.Di + i)]);
            dot += pr, mag += std::fabs(pr);
          }
          const double w = c.wt[size_t(t * c.Hi + h)];
          sc += w * std::max(dot, 0.0);
          b1 += std::fabs(w) * mag;
          b2 += std::fabs(w * std::max(dot, 0.0));
        }
        ref[size_t(g)] = sc;
        bound[size_t(g)] = std::ldexp(1.0, -22) * (double((c.Di + 15) / 16 + 1) * b1 + c.Hi * b2);
      }
      std::vector<char> chosen(static_cast<size_t>(n), 0);
      double worst = 1e300;
      for (int j = 0; j < c.k; ++j) {
        const int32_t id = r.ids[size_t(t * c.k + j)];
        if (j >= kk) {
          if (id != -1 && bad++ < 5) ADD_FAILURE() << "row " << t << " slot " << j << " holds " << id;
          continue;
        }
        if ((id < 0 || id >= n || (j > 0 && id <= r.ids[size_t(t * c.k + j - 1)])) && bad++ < 5) {
          ADD_FAILURE() << "row " << t << " slot " << j << ": id " << id << " (not ascending or not visible)";
          continue;
        }
        chosen[size_t(id)] = 1;
        const float got = r.score[size_t(t * c.k + j)];
        if (std::fabs(got - ref[size_t(id)]) > bound[size_t(id)] && bad++ < 5)
          ADD_FAILURE() << "row " << t << " id " << id << ": score " << got << " vs " << ref[size_t(id)];
        worst = std::min(worst, ref[size_t(id)] + 2 * bound[size_t(id)]);
      }
      for (int64_t g = 0; g < n; ++g)
        if (!chosen[size_t(g)] && ref[size_t(g)] - 2 * bound[size_t(g)] > worst && bad++ < 5)
          ADD_FAILURE() << "row " << t << ": unchosen key " << g << " (score " << ref[size_t(g)] << ") beats a chosen one";
      const float m = r.margin[size_t(t)];
      if (n > kk && kk > 0 && !(m >= 0.0f) && bad++ < 5) ADD_FAILURE() << "row " << t << ": margin " << m;
      if ((n <= kk || kk == 0) && !std::isinf(m) && bad++ < 5) ADD_FAILURE() << "row " << t << ": margin " << m << " (inf expected)";
    }
    EXPECT_EQ(bad, 0);
  }
}

// The same bytes run to run; a row alone (at its position, pos0) gives its bytes of the batch;
// indexer_score_ids gives the bytes of the reported scores (one rule for both); fp32 and bf16 score
// chains.
TEST_F(FastIndexer, RunToRunBatchInvariantAndOneScoreRule) {
  for (const bool bf16 : {false, true}) {
    SCOPED_TRACE(bf16 ? "bf16 scores" : "fp32 scores");
    IdxCase c = make_idx(300, 0, 64, 128, 75, 32, 3);
    c.bf16_scores = bf16;
    const IdxOut all = indexer_tc(c), again = indexer_tc(c);
    EXPECT_EQ(all.ids, again.ids);
    EXPECT_TRUE(same_bytes(all.margin, again.margin));
    EXPECT_TRUE(same_bytes(all.score, again.score));
    for (const int64_t t : {0, 3, 4, 150, 299}) {
      IdxCase one = c;
      one.T = 1, one.pos0 = t;
      one.qi.assign(c.qi.begin() + t * c.Hi * c.Di, c.qi.begin() + (t + 1) * c.Hi * c.Di);
      one.wt.assign(c.wt.begin() + t * c.Hi, c.wt.begin() + (t + 1) * c.Hi);
      const IdxOut r = indexer_tc(one);
      EXPECT_EQ(r.ids, std::vector<int32_t>(all.ids.begin() + t * c.k, all.ids.begin() + (t + 1) * c.k)) << "row " << t;
      EXPECT_EQ(std::memcmp(&r.margin[0], &all.margin[size_t(t)], sizeof(float)), 0) << "row " << t;
      EXPECT_TRUE(same_bytes(r.score, std::vector<float>(all.score.begin() + t * c.k, all.score.begin() + (t + 1) * c.k)));
    }
    const std::vector<float> again_scores = indexer_tc_scores(c, all.ids);
    for (size_t i = 0; i < all.ids.size(); ++i)
      if (all.ids[i] >= 0) {
        ASSERT_EQ(std::memcmp(&again_scores[i], &all.score[i], sizeof(float)), 0) << "slot " << i;
      } else {
        ASSERT_TRUE(std::isnan(again_scores[i])) << "slot " << i;
      }
  }
}

// Long rows: with ratio 1 the last of 40000 rows sees 40000 keys, whose scores do not fit in shared
// memory beside the tiles: the batch keeps every row's scores in global scratch. Early rows alone keep
// theirs in shared memory: the same bytes.
TEST_F(FastIndexer, LongRowsKeepTheirBytes) {
  IdxCase wide = make_idx(40000, 0, 1, 64, 40000, 16, 4);
  wide.ratio = 1;
  const IdxOut all = indexer_tc(wide);
  for (const int64_t t : {0, 15, 16, 1000}) {
    IdxCase one = wide;
    one.T = 1, one.pos0 = t;
    one.qi.assign(wide.qi.begin() + t * 64, wide.qi.begin() + (t + 1) * 64);
    one.wt.assign(wide.wt.begin() + t, wide.wt.begin() + t + 1);
    const IdxOut r = indexer_tc(one);
    EXPECT_EQ(r.ids, std::vector<int32_t>(all.ids.begin() + t * 16, all.ids.begin() + (t + 1) * 16)) << "row " << t;
    EXPECT_TRUE(same_bytes(r.score, std::vector<float>(all.score.begin() + t * 16, all.score.begin() + (t + 1) * 16)));
    EXPECT_EQ(std::memcmp(&r.margin[0], &all.margin[size_t(t)], sizeof(float)), 0) << "row " << t;
  }
}

// The order is its own: the exact order's scores of the same ids (kernels/cuda/indexer.cu's canonical
// dots) differ in some bits, and by no more than the bound above allows twice.
TEST_F(FastIndexer, IsNotTheExactOrder) {
  const IdxCase c = make_idx(200, 0, 64, 128, 50, 16, 9);
  const IdxOut r = indexer_tc(c);
  test::DeviceBuffers d;
  IndexerParams p = indexer_inputs(d, c);
  p.order = ReduceOrder{};  // the exact order (block 0)
  const int32_t* ids = d.upload(r.ids, "ids");
  float* score = d.upload(std::vector<float>(r.ids.size()), "score");
  cuda::indexer_score_ids(p, ids, score, nullptr);
  const std::vector<float> exact = d.download(score, r.ids.size());
  int64_t other_bits = 0, compared = 0;
  for (size_t i = 0; i < r.ids.size(); ++i) {
    if (r.ids[i] < 0) continue;
    ++compared;
    other_bits += std::memcmp(&exact[i], &r.score[i], sizeof(float)) != 0;
    EXPECT_NEAR(exact[i], r.score[i], 1e-4 * (1.0 + std::fabs(exact[i]))) << "slot " << i;
  }
  EXPECT_GT(compared, 1000);
  EXPECT_GT(other_bits, 0) << "the tensor_core indexer gave the exact order's bits everywhere";
}

// Limits of the order are refused by name: more than 64 heads, Di above 128.
TEST_F(FastIndexer, LimitsAreRefused) {
  IdxCase c = make_idx(4, 0, 65, 32, 4, 2, 1);
  std::string msg;
  try {
    indexer_tc(c);
  } catch (const std::exception& e) {
    msg = e.what();
  }
  EXPECT_NE(msg.find("Hi"), std::string::npos) << msg;
  c = make_idx(4, 0, 4, 136, 4, 2, 1);
  msg.clear();
  try {
    indexer_tc(c);
  } catch (const std::exception& e) {
    msg = e.what();
  }
  EXPECT_NE(msg.find("Di"), std::string::npos) << msg;
}

}  // namespace
}  // namespace dsv4
