// The CUDA backward ops of kernels/cuda/grad.h (dense, RMSNorm, embedding, log-probabilities, MoE
// router and experts) against the CPU reference (kernels/cpu/grad_linear.cpp, grad_moe.cpp), bitwise:
// seeded inputs (seeded from the case name), odd shapes and strides, accumulated outputs pre-filled
// with random values, untouched elements pre-filled with a NaN pattern, frozen (null) gradient
// outputs; guarded device buffers. Every case skips without a CUDA device.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "gpu_test_util.h"
#include "kernels/cuda/grad.h"
#include "model/communicator.h"  // expert_range (header only)
#include "test_util.h"

namespace dsv4 {
namespace {

using test::DeviceBuffers;
using test::same_floats;

std::string order_name(ReduceOrder o) {
  return o.block ? "block=" + std::to_string(o.block) : "chain";
}

// fp32 gradients ~ N(0, std), not rounded.
std::vector<float> randn(std::mt19937_64& g, size_t n, float std = 1.0f) {
  std::normal_distribution<float> d(0.0f, std);
  std::vector<float> v(n);
  for (auto& x : v) x = d(g);
  return v;
}

std::vector<float> filled(size_t n) {
  return std::vector<float>(n, test::fill_value());
}

// ---- element-wise -------------------------------------------------------------------------------

TEST(GradGpu, ZeroAndAdd) {
  DSV4_REQUIRE_CUDA_DEVICE();
  auto g = test::rng_for("zero-add");
  const int64_t n = 1237;
  auto y = randn(g, size_t(n));
  const auto x = randn(g, size_t(n));
  y[5] = -0.0f;  // -0 + +0 = +0
  std::vector<float> xs = x;
  xs[5] = 0.0f;
  DeviceBuffers d;
  float* dy = d.upload(y, "y");
  const float* dx = d.upload(xs, "x");
  cuda::add(dy, dx, n, nullptr);
  std::vector<float> ref = y;
  for (int64_t i = 0; i < n; ++i) ref[size_t(i)] = ref[size_t(i)] + xs[size_t(i)];
  ASSERT_TRUE(d.guards_intact());
  EXPECT_TRUE(same_floats(ref, d.download(dy, size_t(n)), "add"));
  cuda::zero(dy, n - 1, nullptr);  // the last element stays
  ASSERT_TRUE(d.guards_intact());
  std::vector<float> zref(size_t(n), 0.0f);
  zref.back() = ref.back();
  EXPECT_TRUE(same_floats(zref, d.download(dy, size_t(n)), "zero"));
  EXPECT_THROW(cuda::add(dy, nullptr, 3, nullptr), Error);
}

// ---- dense linear -------------------------------------------------------------------------------

void gemm_dx_case(int64_t m, int64_t n, int64_t k, int64_t pad, ReduceOrder order, bool accumulate) {
  const std::string name = "GEMM_DX(m=" + std::to_string(m) + ",n=" + std::to_string(n) + ",k=" +
                           std::to_string(k) + ",pad=" + std::to_string(pad) + "," + order_name(order) +
                           (accumulate ? ",acc)" : ")");
  SCOPED_TRACE(name);
  auto g = test::rng_for(name);
  const int64_t lddy = n + pad, ldw = k + pad, lddx = k + pad;
  const auto dy = randn(g, size_t(m * lddy));
  const auto w = test::randn_bf16(g, size_t(n * ldw), 0.05f);
  auto dx0 = accumulate ? randn(g, size_t(m * lddx)) : filled(size_t(m * lddx));
  if (accumulate && !dx0.empty()) dx0[0] = -0.0f;
  std::vector<float> dx = dx0;
  GemmDxParams p{.m = m, .n = n, .k = k, .lddy = lddy, .ldw = ldw, .lddx = lddx, .accumulate = accumulate,
                 .order = order};
  p.dy = dy.data(), p.w = w.data(), p.dx = dx.data();
  ASSERT_EQ(gemm_dx_check(p), nullptr);
  gemm_dx(p);
  DeviceBuffers d;
  p.dy = d.upload(dy, "dy"), p.w = d.upload(w, "w"), p.dx = d.upload(dx0, "dx");
  cuda::gemm_dx(p, nullptr);
  ASSERT_TRUE(d.guards_intact());
  const auto gdx = d.download(p.dx, dx.size());
  EXPECT_TRUE(same_floats(dx, gdx, "dx"));
  EXPECT_FALSE(test::all_zero(gdx));
}

TEST(GradGpu, GemmDx) {
  DSV4_REQUIRE_CUDA_DEVICE();
  for (const ReduceOrder o : {ReduceOrder{}, ReduceOrder{64}, ReduceOrder{16}})
    for (const bool acc : {false, true}) {
      gemm_dx_case(37, 70, 53, 3, o, acc);
      gemm_dx_case(1, 1, 1, 0, o, acc);
      gemm_dx_case(5, 9, 300, 1, o, acc);
      gemm_dx_case(600, 150, 700, 0, o, acc);  // enough tiles for the lane-split GEMM kernel
    }
  gemm_dx_case(7, 0, 11, 2, ReduceOrder{}, true);   // n == 0: dx + 0
  gemm_dx_case(7, 0, 11, 2, ReduceOrder{}, false);  // n == 0: dx = 0
}

// W of 8192 x 8192: the columns of W are transposed in two chunks.
TEST(GradGpu, GemmDxChunked) {
  DSV4_REQUIRE_CUDA_DEVICE();
  gemm_dx_case(8, 8192, 8192, 0, ReduceOrder{}, true);
}

void gemm_dw_case(int64_t m, int64_t n, int64_t k, int64_t pad, ReduceOrder order, bool accumulate) {
  const std::string name = "GEMM_DW(m=" + std::to_string(m) + ",n=" + std::to_string(n) + ",k=" +
                           std::to_string(k) + ",pad=" + std::to_string(pad) + "," + order_name(order) +
                           (accumulate ? ",acc)" : ")");
  SCOPED_TRACE(name);
  auto g = test::rng_for(name);
  const int64_t lddy = n + pad, ldx = k + pad, lddw = k + pad;
  const auto dy = randn(g, size_t(m * lddy));
  const auto x = test::randn_bf16(g, size_t(m * ldx));
  auto dw0 = accumulate ? randn(g, size_t(n * lddw)) : filled(size_t(n * lddw));
  if (accumulate && !dw0.empty()) dw0[0] = -0.0f;
  std::vector<float> dw = dw0;
  GemmDwParams p{.m = m, .n = n, .k = k, .lddy = lddy, .ldx = ldx, .lddw = lddw, .accumulate = accumulate,
                 .order = order};
  p.dy = dy.data(), p.x = x.data(), p.dw = dw.data();
  ASSERT_EQ(gemm_dw_check(p), nullptr);
  gemm_dw(p);
  DeviceBuffers d;
  p.dy = d.upload(dy, "dy"), p.x = d.upload(x, "x"), p.dw = d.upload(dw0, "dw");
  cuda::gemm_dw(p, nullptr);
  ASSERT_TRUE(d.guards_intact());
  const auto gdw = d.download(p.dw, dw.size());
  EXPECT_TRUE(same_floats(dw, gdw, "dw"));
  EXPECT_FALSE(test::all_zero(gdw));
}

TEST(GradGpu, GemmDw) {
  DSV4_REQUIRE_CUDA_DEVICE();
  for (const ReduceOrder o : {ReduceOrder{}, ReduceOrder{64}, ReduceOrder{16}})
    for (const bool acc : {false, true}) {
      gemm_dw_case(37, 70, 53, 3, o, acc);
      gemm_dw_case(1, 1, 1, 0, o, acc);
      gemm_dw_case(300, 9, 5, 1, o, acc);
      gemm_dw_case(150, 600, 700, 0, o, acc);  // enough tiles for the lane-split GEMM kernel
    }
  gemm_dw_case(0, 7, 11, 2, ReduceOrder{}, true);   // m == 0: dw + 0
  gemm_dw_case(0, 7, 11, 2, ReduceOrder{}, false);  // m == 0: dw = 0
}

// dW of 8192 x 8192, accumulated: its rows go through the staging buffer in two chunks.
TEST(GradGpu, GemmDwChunked) {
  DSV4_REQUIRE_CUDA_DEVICE();
  gemm_dw_case(8, 8192, 8192, 0, ReduceOrder{}, true);
}

TEST(GradGpu, GemmChecksThrow) {
  DSV4_REQUIRE_CUDA_DEVICE();
  GemmDxParams p{.m = 2, .n = 3, .k = 4, .lddy = 2, .ldw = 4, .lddx = 4};  // lddy < n
  float buf[64] = {};
  p.dy = buf, p.w = buf + 16, p.dx = buf + 32;
  EXPECT_THROW(cuda::gemm_dx(p, nullptr), Error);
}

// ---- RMSNorm ------------------------------------------------------------------------------------

void rmsnorm_bwd_case(int64_t rows, int64_t dim, bool weight, bool accumulate, bool with_dw, ReduceOrder order) {
  const std::string name = "RMSNORM_BWD(rows=" + std::to_string(rows) + ",dim=" + std::to_string(dim) +
                           (weight ? ",w" : ",no-w") + (accumulate ? ",acc" : "") + (with_dw ? ",dw," : ",") +
                           order_name(order) + ")";
  SCOPED_TRACE(name);
  auto g = test::rng_for(name);
  const int64_t ldx = dim + 3, lddy = dim + 1, lddx = dim + 2;
  auto x = test::randn_bf16(g, size_t(rows * ldx), 3.0f);
  if (rows > 2)
    for (int64_t i = 0; i < dim; ++i) x[size_t(2 * ldx + i)] = 0.0f;  // a zero row: r = 1 / sqrt(eps)
  const auto w = test::randn_bf16(g, size_t(dim), 1.0f);
  const auto dy = randn(g, size_t(rows * lddy));
  const auto dx0 = accumulate ? randn(g, size_t(rows * lddx)) : filled(size_t(rows * lddx));
  const auto dw0 = randn(g, size_t(dim));
  std::vector<float> dx = dx0, dw = dw0;
  RmsNormBwdParams p;
  p.rows = rows, p.dim = dim, p.ldx = ldx, p.lddy = lddy, p.lddx = lddx, p.accumulate_dx = accumulate;
  p.eps = 1e-6f, p.order = order;
  p.x = x.data(), p.w = weight ? w.data() : nullptr, p.dy = dy.data(), p.dx = dx.data();
  p.dw = with_dw ? dw.data() : nullptr;
  ASSERT_EQ(rmsnorm_backward_check(p), nullptr);
  rmsnorm_backward(p);
  DeviceBuffers d;
  p.x = d.upload(x, "x"), p.w = weight ? d.upload(w, "w") : nullptr, p.dy = d.upload(dy, "dy");
  p.dx = d.upload(dx0, "dx");
  float* gdw = d.upload(dw0, "dw");
  p.dw = with_dw ? gdw : nullptr;
  cuda::rmsnorm_backward(p, nullptr);
  ASSERT_TRUE(d.guards_intact());
  const auto gdx = d.download(p.dx, dx.size());
  EXPECT_TRUE(same_floats(dx, gdx, "dx"));
  EXPECT_FALSE(test::all_zero(gdx));
  EXPECT_TRUE(same_floats(dw, d.download(gdw, dw.size()), "dw"));  // unchanged when not wanted
}

TEST(GradGpu, RmsNormBackward) {
  DSV4_REQUIRE_CUDA_DEVICE();
  for (const ReduceOrder o : {ReduceOrder{}, ReduceOrder{64}})
    for (const bool weight : {true, false})
      for (const bool acc : {false, true}) {
        rmsnorm_bwd_case(37, 203, weight, acc, true, o);
        rmsnorm_bwd_case(1, 7, weight, acc, !acc, o);
        rmsnorm_bwd_case(70, 1000, weight, acc, acc, o);
      }
}

// ---- embedding ----------------------------------------------------------------------------------

void embed_bwd_case(int64_t T, int64_t D, int copies, int64_t vocab) {
  const std::string name = "EMBED_BWD(T=" + std::to_string(T) + ",D=" + std::to_string(D) +
                           ",copies=" + std::to_string(copies) + ",vocab=" + std::to_string(vocab) + ")";
  SCOPED_TRACE(name);
  auto g = test::rng_for(name);
  std::vector<int32_t> tokens(static_cast<size_t>(T));
  for (auto& t : tokens) t = int32_t(g() % uint64_t(vocab));
  if (T > 3) tokens[size_t(T - 1)] = tokens[0], tokens[1] = tokens[0];  // repeats, first and last positions
  const auto dH = randn(g, size_t(T * copies * D));
  const auto table0 = randn(g, size_t(vocab * D));
  std::vector<float> table = table0;
  embed_backward(dH.data(), D, tokens.data(), T, copies, table.data());
  DeviceBuffers d;
  float* gt = d.upload(table0, "dtable");
  cuda::embed_backward(d.upload(dH, "dH"), D, d.upload(tokens, "tokens"), T, copies, gt, vocab, nullptr);
  ASSERT_TRUE(d.guards_intact());
  EXPECT_TRUE(same_floats(table, d.download(gt, table.size()), "dtable"));
}

TEST(GradGpu, EmbedBackward) {
  DSV4_REQUIRE_CUDA_DEVICE();
  embed_bwd_case(41, 67, 1, 13);
  embed_bwd_case(41, 67, 4, 13);
  embed_bwd_case(1, 5, 3, 2);
  embed_bwd_case(300, 130, 4, 1000);
  embed_bwd_case(64, 33, 2, 1);  // every position is the same token
}

// ---- log-probabilities --------------------------------------------------------------------------

void log_softmax_bwd_case(int64_t rows, int64_t V, float temperature) {
  const std::string name = "LOG_SOFTMAX_BWD(rows=" + std::to_string(rows) + ",V=" + std::to_string(V) +
                           ",temp=" + std::to_string(temperature) + ")";
  SCOPED_TRACE(name);
  auto g = test::rng_for(name);
  auto l = test::randn_bf16(g, size_t(rows * V), 3.0f);
  const float inf = std::numeric_limits<float>::infinity();
  // Special rows: a NaN, all -inf, a +inf, some -inf entries, all zeros (+0 and -0).
  if (rows > 5) {
    l[size_t(1 * V + V / 2)] = std::numeric_limits<float>::quiet_NaN();
    for (int64_t v = 0; v < V; ++v) l[size_t(2 * V + v)] = -inf;
    l[size_t(3 * V + 1)] = inf;
    for (int64_t v = 0; v < V; v += 5) l[size_t(4 * V + v)] = -inf;
    for (int64_t v = 0; v < V; ++v) l[size_t(5 * V + v)] = (v % 2) ? -0.0f : 0.0f;
  }
  std::vector<int32_t> target(static_cast<size_t>(rows));
  for (auto& t : target) t = int32_t(g() % uint64_t(V));
  auto dlp = randn(g, size_t(rows));
  if (rows > 9) target[6] = -1, target[7] = int32_t(V), dlp[8] = 0.0f, dlp[9] = -0.0f;  // no gradient: zeros
  std::vector<float> dl = filled(size_t(rows * V));
  log_softmax_backward(l.data(), rows, V, target.data(), dlp.data(), temperature, dl.data());
  DeviceBuffers d;
  float* gdl = d.upload(filled(dl.size()), "dlogits");
  cuda::log_softmax_backward(d.upload(l, "logits"), rows, V, d.upload(target, "target"), d.upload(dlp, "dlogprob"),
                             temperature, gdl, nullptr);
  ASSERT_TRUE(d.guards_intact());
  const auto got = d.download(gdl, dl.size());
  EXPECT_TRUE(same_floats(dl, got, "dlogits"));
  if (V > 1) {
    EXPECT_FALSE(test::all_zero(got));  // (V == 1: log_softmax is constant, the gradient 0)
  }
}

TEST(GradGpu, LogSoftmaxBackward) {
  DSV4_REQUIRE_CUDA_DEVICE();
  for (const float temp : {1.0f, 0.7f, 1.3f}) {
    log_softmax_bwd_case(12, 997, temp);
    log_softmax_bwd_case(3, 1, temp);
    log_softmax_bwd_case(40, 5003, temp);
  }
}

// ---- MoE router ---------------------------------------------------------------------------------

void router_bwd_case(int64_t T, int E, int k, bool norm, float scale, bool repeats) {
  const std::string name = "ROUTER_BWD(T=" + std::to_string(T) + ",E=" + std::to_string(E) +
                           ",k=" + std::to_string(k) + (norm ? ",norm" : ",no-norm") +
                           ",scale=" + std::to_string(scale) + (repeats ? ",repeats)" : ")");
  SCOPED_TRACE(name);
  auto g = test::rng_for(name);
  auto logits = randn(g, size_t(T * E), 3.0f);
  logits[0] = -200.0f;  // softplus underflows: s = 0
  std::vector<int32_t> ids(size_t(T * k));
  for (int64_t t = 0; t < T; ++t) {
    std::vector<int32_t> all(static_cast<size_t>(E));
    for (int e = 0; e < E; ++e) all[size_t(e)] = e;
    std::shuffle(all.begin(), all.end(), g);
    if (repeats && k > 1 && t % 3 == 0) all[1] = all[0];
    std::sort(all.begin(), all.begin() + k);
    std::copy(all.begin(), all.begin() + k, ids.begin() + t * k);
  }
  ids[0] = 0;  // the underflowing logit is chosen
  std::sort(ids.begin(), ids.begin() + k);
  const auto dw = randn(g, size_t(T * k));
  std::vector<float> dl = filled(size_t(T * E));
  RouterBwdParams p;
  p.T = T, p.E = E, p.k = k, p.norm_topk_prob = norm, p.routed_scaling_factor = scale;
  p.logits = logits.data(), p.ids = ids.data(), p.dweights = dw.data(), p.dlogits = dl.data();
  ASSERT_EQ(router_backward_check(p), nullptr);
  router_backward(p);
  DeviceBuffers d;
  p.logits = d.upload(logits, "logits"), p.ids = d.upload(ids, "ids"), p.dweights = d.upload(dw, "dweights");
  p.dlogits = d.upload(filled(dl.size()), "dlogits");
  cuda::router_backward(p, nullptr);
  ASSERT_TRUE(d.guards_intact());
  const auto got = d.download(p.dlogits, dl.size());
  EXPECT_TRUE(same_floats(dl, got, "dlogits"));
  if (!norm || k > 1) {
    EXPECT_FALSE(test::all_zero(got));  // (one normalised weight is constant)
  }
}

TEST(GradGpu, RouterBackward) {
  DSV4_REQUIRE_CUDA_DEVICE();
  for (const bool norm : {true, false}) {
    router_bwd_case(33, 7, 3, norm, 2.5f, false);
    router_bwd_case(33, 7, 3, norm, 1.0f, true);
    router_bwd_case(5, 1, 1, norm, 1.0f, false);
    router_bwd_case(257, 64, 6, norm, 1.5f, false);
  }
}

// ---- MoE experts --------------------------------------------------------------------------------

// Which gradient outputs the call asks for.
enum class Wanted { all, frozen_some, no_weight_grads, weight_grads_only };

struct MoeBwdCase {
  int64_t T, D, I;
  int E, k, used;  // `used` experts receive all routed pairs (the others are empty)
  int n_shared;
  int64_t I_shared;
  float limit;
  bool clamp_shared;
  ReduceOrder order;
  bool repeats;  // some tokens list one expert twice
  Wanted wanted;
};

void moe_bwd_case(const MoeBwdCase& c) {
  const std::string name =
      "MOE_BWD(T=" + std::to_string(c.T) + ",D=" + std::to_string(c.D) + ",I=" + std::to_string(c.I) +
      ",E=" + std::to_string(c.E) + ",k=" + std::to_string(c.k) + ",used=" + std::to_string(c.used) +
      ",shared=" + std::to_string(c.n_shared) + "x" + std::to_string(c.I_shared) +
      ",L=" + std::to_string(int(c.limit * 100)) + (c.clamp_shared ? ",clamp-shared," : ",") +
      order_name(c.order) + (c.repeats ? ",repeats" : "") + ",wanted=" + std::to_string(int(c.wanted)) + ")";
  SCOPED_TRACE(name);
  auto g = test::rng_for(name);
  const int64_t T = c.T, D = c.D, I = c.I, k = c.k;
  const int E = c.E, ns = c.n_shared;
  const int64_t Is = c.I_shared > 0 ? c.I_shared : I;
  auto x = test::randn_bf16(g, size_t(T * D));
  std::vector<int32_t> ids(size_t(T * k));
  for (int64_t t = 0; t < T; ++t) {
    std::vector<int32_t> all(static_cast<size_t>(c.used));
    for (int e = 0; e < c.used; ++e) all[size_t(e)] = e * E / c.used;  // spread over [0, E)
    std::shuffle(all.begin(), all.end(), g);
    if (c.repeats && k > 1 && t % 4 == 1) all[1] = all[0];
    std::sort(all.begin(), all.begin() + k);
    std::copy(all.begin(), all.begin() + k, ids.begin() + t * k);
  }
  const auto weights = test::randn_bf16(g, size_t(T * k), 0.5f);
  std::vector<std::vector<float>> hw;  // w1, w3, w2 of each routed, then each shared expert
  for (int e = 0; e < E + ns; ++e) {
    const int64_t ii = e < E ? I : Is;
    hw.push_back(test::randn_bf16(g, size_t(ii * D), 0.15f));
    hw.push_back(test::randn_bf16(g, size_t(ii * D), 0.15f));
    hw.push_back(test::randn_bf16(g, size_t(D * ii), 0.15f));
  }
  // Clamp boundaries (with L = 0.5): token 0 is the unit vector e_0, so its gate and up values are
  // column 0 of w1 and w3: g = L (passes), g = 1.5 L (clamped), u = -L and u = L (pass).
  if (c.limit == 0.5f && I >= 2 && Is >= 2) {
    for (int64_t d = 0; d < D; ++d) x[size_t(d)] = d == 0 ? 1.0f : 0.0f;
    for (int e = 0; e < E + ns; ++e) {
      std::vector<float>& w1 = hw[size_t(3 * e)];
      std::vector<float>& w3 = hw[size_t(3 * e + 1)];
      w1[0] = 0.5f, w1[size_t(D)] = 0.75f;
      w3[0] = -0.5f, w3[size_t(D)] = 0.5f;
    }
  }
  const auto dout = randn(g, size_t(T * D));
  const auto dx0 = randn(g, size_t(T * D));
  // Weight gradients, accumulated: pre-filled with random values.
  std::vector<std::vector<float>> hg0;
  for (int e = 0; e < E + ns; ++e) {
    const int64_t ii = e < E ? I : Is;
    for (int j = 0; j < 3; ++j) hg0.push_back(randn(g, size_t(ii * D), 0.1f));
  }
  const bool want_dx = c.wanted != Wanted::weight_grads_only;
  const bool want_dweights = c.wanted != Wanted::weight_grads_only;
  const bool want_grads = c.wanted != Wanted::no_weight_grads;
  // Frozen outputs: expert 1's dw1, all of expert 2's, the shared expert's dw3.
  auto wanted_grad = [&](int e, int j) {
    if (c.wanted != Wanted::frozen_some) return true;
    if (e == 1 && j == 0) return false;
    if (e == 2) return false;
    if (e == E && j == 1) return false;
    return true;
  };

  // CPU.
  std::vector<std::vector<float>> hg = hg0;
  std::vector<ExpertWeights> ex(static_cast<size_t>(E)), sh(static_cast<size_t>(ns));
  std::vector<ExpertGrads> eg(static_cast<size_t>(E)), sg(static_cast<size_t>(ns));
  auto set_ptrs = [&](const std::vector<const float*>& w, const std::vector<float*>& gr) {
    for (int e = 0; e < E + ns; ++e) {
      const ExpertWeights ew{w[size_t(3 * e)], w[size_t(3 * e + 1)], w[size_t(3 * e + 2)]};
      ExpertGrads eg1;
      eg1.dw1 = wanted_grad(e, 0) ? gr[size_t(3 * e)] : nullptr;
      eg1.dw3 = wanted_grad(e, 1) ? gr[size_t(3 * e + 1)] : nullptr;
      eg1.dw2 = wanted_grad(e, 2) ? gr[size_t(3 * e + 2)] : nullptr;
      if (e < E)
        ex[size_t(e)] = ew, eg[size_t(e)] = eg1;
      else
        sh[size_t(e - E)] = ew, sg[size_t(e - E)] = eg1;
    }
  };
  std::vector<const float*> hwp;
  std::vector<float*> hgp;
  for (auto& v : hw) hwp.push_back(v.data());
  for (auto& v : hg) hgp.push_back(v.data());
  set_ptrs(hwp, hgp);
  std::vector<float> dx = dx0, dwt = filled(size_t(T * k));
  MoeBwdParams p;
  p.fwd.T = T, p.fwd.D = D, p.fwd.I = I, p.fwd.I_shared = c.I_shared, p.fwd.E = E, p.fwd.k = c.k;
  p.fwd.n_shared = ns, p.fwd.swiglu_limit = c.limit, p.fwd.clamp_shared = c.clamp_shared, p.fwd.order = c.order;
  p.fwd.x = x.data(), p.fwd.ids = ids.data(), p.fwd.weights = weights.data(), p.fwd.experts = ex.data();
  p.fwd.shared = sh.data();
  p.dout = dout.data();
  p.dx = want_dx ? dx.data() : nullptr;
  p.dweights = want_dweights ? dwt.data() : nullptr;
  p.grads = want_grads ? eg.data() : nullptr;
  p.shared_grads = want_grads ? sg.data() : nullptr;
  ASSERT_EQ(moe_experts_backward_check(p), nullptr);
  moe_experts_backward(p);

  // GPU.
  DeviceBuffers d;
  std::vector<const float*> dwp;
  std::vector<float*> dgp;
  for (size_t i = 0; i < hw.size(); ++i) dwp.push_back(d.upload(hw[i], "expert weight " + std::to_string(i)));
  for (size_t i = 0; i < hg0.size(); ++i) dgp.push_back(d.upload(hg0[i], "expert grad " + std::to_string(i)));
  set_ptrs(dwp, dgp);
  p.fwd.x = d.upload(x, "x"), p.fwd.ids = d.upload(ids, "ids"), p.fwd.weights = d.upload(weights, "weights");
  p.dout = d.upload(dout, "dout");
  float* gdx = d.upload(dx0, "dx");
  float* gdwt = d.upload(filled(dwt.size()), "dweights");
  p.dx = want_dx ? gdx : nullptr;
  p.dweights = want_dweights ? gdwt : nullptr;
  cuda::moe_experts_backward(p, nullptr);
  ASSERT_TRUE(d.guards_intact());
  const auto got_dx = d.download(gdx, dx.size());
  EXPECT_TRUE(same_floats(dx, got_dx, "dx"));
  if (want_dx) {
    EXPECT_FALSE(same_floats(dx0, got_dx, "dx"));
  }
  const auto got_dwt = d.download(gdwt, dwt.size());
  EXPECT_TRUE(same_floats(dwt, got_dwt, "dweights"));
  if (want_dweights) {
    EXPECT_FALSE(test::all_zero(got_dwt));
  }
  for (size_t i = 0; i < hg.size(); ++i) {
    const auto got = d.download(dgp[i], hg[i].size());
    EXPECT_TRUE(same_floats(hg[i], got, "expert grad " + std::to_string(i)));
  }

  // The two parts of expert parallelism, every rank in this process with its own gradient buffers
  // (from hg0): each rank's routed experts' gradients, and the combine over every rank's pairs in rank
  // order (from dx0 and hg0), equal the whole backward's (the CPU's, equal to it above) bit for bit.
  for (int ranks : {1, 2, 3, E + 1}) {
    const std::string what = " of " + std::to_string(ranks) + " ranks";
    std::vector<float> dx1_all, dx3_all, dw_all;
    std::vector<std::vector<float>> routed(hg.size());
    for (int r = 0; r < ranks; ++r) {
      const ExpertRange er = expert_range(E, r, ranks);
      std::vector<float*> rg;
      for (size_t i = 0; i < hg0.size(); ++i) rg.push_back(d.upload(hg0[i], "rank grad " + std::to_string(i)));
      set_ptrs(dwp, rg);
      const size_t m = size_t(std::count_if(ids.begin(), ids.end(), [&](int32_t id) {
        return id >= er.first && id < er.last;
      }));
      float* d1 = d.upload(filled(std::max<size_t>(m * size_t(D), 1)), "dx1 pairs");
      float* d3 = d.upload(filled(std::max<size_t>(m * size_t(D), 1)), "dx3 pairs");
      float* dw = d.upload(filled(std::max<size_t>(m, 1)), "dw pairs");
      cuda::moe_backward_routed(p, er.first, er.last, d1, d3, dw, nullptr);
      for (auto [dst, src, n] : {std::tuple{&dx1_all, d1, m * size_t(D)}, std::tuple{&dx3_all, d3, m * size_t(D)},
                                 std::tuple{&dw_all, dw, m}}) {
        const auto v = d.download(src, n);
        dst->insert(dst->end(), v.begin(), v.end());
      }
      for (int e = er.first; e < er.last; ++e)
        for (int j = 0; j < 3; ++j) routed[size_t(3 * e + j)] = d.download(rg[size_t(3 * e + j)], hg0[size_t(3 * e + j)].size());
    }
    std::vector<float*> cg;
    for (size_t i = 0; i < hg0.size(); ++i) cg.push_back(d.upload(hg0[i], "combine grad " + std::to_string(i)));
    set_ptrs(dwp, cg);
    float* cdx = d.upload(dx0, "combine dx");
    float* cdw = d.upload(filled(dwt.size()), "combine dweights");
    p.dx = want_dx ? cdx : nullptr;
    p.dweights = want_dweights ? cdw : nullptr;
    auto upload1 = [&](const std::vector<float>& v, const char* name) {
      return d.upload(v.empty() ? std::vector<float>(1) : v, name);
    };
    cuda::moe_backward_combine(p, upload1(dx1_all, "dx1 all"), upload1(dx3_all, "dx3 all"), upload1(dw_all, "dw all"),
                               nullptr);
    ASSERT_TRUE(d.guards_intact());
    EXPECT_TRUE(same_floats(dx, d.download(cdx, dx.size()), "dx" + what));
    EXPECT_TRUE(same_floats(dwt, d.download(cdw, dwt.size()), "dweights" + what));
    for (int e = 0; e < E; ++e)
      for (int j = 0; j < 3; ++j)
        EXPECT_TRUE(same_floats(hg[size_t(3 * e + j)], routed[size_t(3 * e + j)],
                                "expert " + std::to_string(e) + " grad " + std::to_string(j) + what));
    for (size_t i = size_t(3 * E); i < hg.size(); ++i)
      EXPECT_TRUE(same_floats(hg[i], d.download(cg[i], hg[i].size()), "shared grad " + std::to_string(i) + what));
  }
}

TEST(GradGpu, MoeExpertsBackward) {
  DSV4_REQUIRE_CUDA_DEVICE();
  for (const ReduceOrder o : {ReduceOrder{}, ReduceOrder{16}}) {
    moe_bwd_case({17, 64, 32, 6, 2, 6, 1, 0, 10.0f, false, o, false, Wanted::all});
    moe_bwd_case({17, 64, 37, 8, 3, 4, 1, 64, 0.5f, true, o, false, Wanted::all});  // empty experts, clamps
    moe_bwd_case({17, 64, 37, 8, 3, 4, 1, 64, 0.5f, false, o, true, Wanted::frozen_some});
    moe_bwd_case({23, 40, 24, 5, 2, 5, 2, 16, 0.5f, true, o, true, Wanted::no_weight_grads});
    moe_bwd_case({23, 40, 24, 5, 2, 5, 0, 0, 0.0f, false, o, false, Wanted::weight_grads_only});
  }
  moe_bwd_case({1, 8, 3, 4, 1, 1, 1, 0, 0.5f, true, ReduceOrder{}, false, Wanted::all});
  moe_bwd_case({300, 576, 640, 6, 2, 4, 1, 0, 10.0f, false, ReduceOrder{64}, false, Wanted::all});
}

TEST(GradGpu, MoeExpertsBackwardChecks) {
  DSV4_REQUIRE_CUDA_DEVICE();
  // An id out of range is reported by the CPU check (the ids are downloaded first).
  const int64_t T = 2, D = 8, I = 4;
  const int E = 2, k = 1;
  DeviceBuffers d;
  const float* x = d.upload(std::vector<float>(size_t(T * D), 1.0f), "x");
  const float* w = d.upload(std::vector<float>(size_t(I * D), 0.1f), "w");
  std::vector<ExpertWeights> ex(size_t(E), ExpertWeights{w, w, w});
  MoeBwdParams p;
  p.fwd.T = T, p.fwd.D = D, p.fwd.I = I, p.fwd.E = E, p.fwd.k = k, p.fwd.n_shared = 0;
  p.fwd.x = x, p.fwd.ids = d.upload(std::vector<int32_t>{0, 5}, "ids");
  p.fwd.weights = d.upload(std::vector<float>(size_t(T * k), 1.0f), "weights"), p.fwd.experts = ex.data();
  p.dout = x;
  EXPECT_THROW(cuda::moe_experts_backward(p, nullptr), Error);
  p.fwd.ids = d.upload(std::vector<int32_t>{0, 1}, "ids ok");
  EXPECT_NO_THROW(cuda::moe_experts_backward(p, nullptr));
  p.dout = nullptr;
  EXPECT_THROW(cuda::moe_experts_backward(p, nullptr), Error);
}

}  // namespace
}  // namespace dsv4
