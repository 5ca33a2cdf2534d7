// mHC backward (kernels/grad.h, MODEL.md §5.2): hc_post_backward, hc_pre_backward (with the
// Sinkhorn backward) and hc_head_backward against float64 central finite differences of float64
// forwards written here from the spec (unrounded: the forward's bf16 roundings are
// straight-through); the legacy (frozen mixer) mode; the documented accumulation and token orders
// bitwise; thread-count and batch invariance.
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <vector>

#include "kernels/detail/grad_mhc.h"
#include "kernels/grad.h"
#include "kernels/linear.h"
#include "kernels/mhc.h"
#include "test_util.h"

namespace dsv4 {
namespace {

using test::bitwise_equal;
using test::rng_for;
using V = std::vector<float>;
using Vd = std::vector<double>;

// ---- float64 reference forwards ------------------------------------------------------------------

double sigmoid_d(double x) {
  return 1.0 / (1.0 + std::exp(-x));
}

// Sinkhorn in float64 (MODEL.md §3.2) on c [hc * hc] in place.
void sinkhorn_d(double* c, int hc, int iters, double eps) {
  for (int j = 0; j < hc; ++j) {
    double mx = c[j * hc];
    for (int k = 1; k < hc; ++k) mx = std::max(mx, c[j * hc + k]);
    double s = 0;
    for (int k = 0; k < hc; ++k) s += std::exp(c[j * hc + k] - mx);
    for (int k = 0; k < hc; ++k) c[j * hc + k] = std::exp(c[j * hc + k] - mx) / s + eps;
  }
  for (int it = 0; it < iters; ++it) {
    if (it > 0)
      for (int j = 0; j < hc; ++j) {
        double s = 0;
        for (int k = 0; k < hc; ++k) s += c[j * hc + k];
        for (int k = 0; k < hc; ++k) c[j * hc + k] /= s + eps;
      }
    for (int k = 0; k < hc; ++k) {
      double s = 0;
      for (int j = 0; j < hc; ++j) s += c[j * hc + k];
      for (int j = 0; j < hc; ++j) c[j * hc + k] /= s + eps;
    }
  }
}

constexpr double kEps = 1e-6;  // rms_eps and hc_eps

// The mixer logits a [rows] of one token x [hc * D] (rows mixer rows of fn, `groups` scales).
Vd logits_d(const double* x, int hc, int64_t D, const Vd& fn, const Vd& scale, const Vd& base, int rows,
            bool head) {
  const int64_t n = hc * D;
  double ss = 0;
  for (int64_t q = 0; q < n; ++q) ss += x[q] * x[q];
  const double rho = 1.0 / std::sqrt(ss / double(n) + kEps);
  Vd a(size_t(rows), 0.0);
  for (int i = 0; i < rows; ++i) {
    double u = 0;
    for (int64_t q = 0; q < n; ++q) u += fn[size_t(i * n + q)] * x[q];
    const int g = head ? 0 : (i < hc ? 0 : (i < 2 * hc ? 1 : 2));
    a[size_t(i)] = rho * u * scale[size_t(g)] + base[size_t(i)];
  }
  return a;
}

// The inputs of one mHC block: streams X, mixer fn / scale / base, sublayer output f, and the
// weights of the scalar loss (Wy on y, Wo on hc_post's out).
struct Block {
  int hc = 4;
  int64_t D = 0, T = 0;
  int iters = 20;
  bool head = false;
  Vd X, fn, scale, base, f, Wy, Wo;
  int rows() const { return head ? hc : (2 + hc) * hc; }
};

// L = sum_t <Wy[t], y[t]> + <Wo[t], out[t]> with y = sum_j pre_j X_j and
// out_k = post_k f + sum_j comb[j][k] X_j (hc_pre followed by hc_post with R = X); for a head block
// L = sum_t <Wy[t], sum_j w_j X_j>.
double block_loss(const Block& b) {
  const int hc = b.hc, rows = b.rows();
  const int64_t D = b.D, n = hc * D;
  double L = 0;
  for (int64_t t = 0; t < b.T; ++t) {
    const double* x = b.X.data() + t * n;
    const Vd a = logits_d(x, hc, D, b.fn, b.scale, b.base, rows, b.head);
    Vd pre(static_cast<size_t>(hc)), post(static_cast<size_t>(hc)), comb(static_cast<size_t>(hc * hc));
    for (int j = 0; j < hc; ++j) pre[size_t(j)] = sigmoid_d(a[size_t(j)]) + kEps;
    for (int64_t d = 0; d < D; ++d) {
      double y = 0;
      for (int j = 0; j < hc; ++j) y += pre[size_t(j)] * x[j * D + d];
      L += b.Wy[size_t(t * D + d)] * y;
    }
    if (b.head) continue;
    for (int k = 0; k < hc; ++k) post[size_t(k)] = 2.0 * sigmoid_d(a[size_t(hc + k)]);
    std::copy(a.begin() + 2 * hc, a.end(), comb.begin());
    sinkhorn_d(comb.data(), hc, b.iters, kEps);
    for (int k = 0; k < hc; ++k)
      for (int64_t d = 0; d < D; ++d) {
        double o = post[size_t(k)] * b.f[size_t(t * D + d)];
        for (int j = 0; j < hc; ++j) o += comb[size_t(j * hc + k)] * x[j * D + d];
        L += b.Wo[size_t((t * hc + k) * D + d)] * o;
      }
  }
  return L;
}

// Central finite differences of `loss` w.r.t. every element of v (step h).
Vd fd_grad(Vd& v, const std::function<double()>& loss, double h = 1e-5) {
  Vd g(v.size());
  for (size_t i = 0; i < v.size(); ++i) {
    const double keep = v[i];
    v[i] = keep + h;
    const double lp = loss();
    v[i] = keep - h;
    const double lm = loss();
    v[i] = keep;
    g[i] = (lp - lm) / (2 * h);
  }
  return g;
}

V to_f(const Vd& v) {
  return V(v.begin(), v.end());
}

// Every |got - want| <= rtol * (|want| + max|want| / 8) (a relative error, measured against the
// tensor's scale for the elements near zero), and the gradient is not all zeros.
::testing::AssertionResult grads_close(const char* what, const V& got, const Vd& want, double rtol) {
  if (got.size() != want.size()) return ::testing::AssertionFailure() << what << ": sizes differ";
  double scale = 0;
  for (double w : want) scale = std::max(scale, std::fabs(w));
  if (scale == 0) return ::testing::AssertionFailure() << what << ": reference gradient is all zeros";
  double worst = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    const double err = std::fabs(double(got[i]) - want[i]);
    const double bound = rtol * (std::fabs(want[i]) + scale / 8);
    if (!(err <= bound))
      return ::testing::AssertionFailure() << what << "[" << i << "]: got " << got[i] << ", want " << want[i]
                                           << " (error " << err << ", bound " << bound << ")";
    worst = std::max(worst, err / (std::fabs(want[i]) + scale / 8));
  }
  if (test::all_zero(got)) return ::testing::AssertionFailure() << what << ": all zeros";
  return ::testing::AssertionSuccess() << what << ": worst relative error " << worst;
}

Block make_block(const std::string& name, int hc, int64_t D, int64_t T, int iters, bool head) {
  auto g = rng_for(name);
  Block b;
  b.hc = hc, b.D = D, b.T = T, b.iters = iters, b.head = head;
  const int64_t n = hc * D;
  auto dv = [](const V& v) { return Vd(v.begin(), v.end()); };
  b.X = dv(test::randn_bf16(g, size_t(T * n)));
  // fn so that the logits m_i are O(1) whatever hc * D is.
  b.fn = dv(test::randn_bf16(g, size_t(b.rows() * n), float(1.2 / std::sqrt(double(n)))));
  b.scale = head ? Vd{1.7} : Vd{0.7, 1.3, 2.1};
  b.base = dv(test::randn_bf16(g, size_t(b.rows()), 0.5f));
  b.f = dv(test::randn_bf16(g, size_t(T * D)));
  b.Wy = dv(test::randn_bf16(g, size_t(T * D)));
  b.Wo = dv(test::randn_bf16(g, size_t(T * n)));
  return b;
}

// ---- running our kernels on a block ---------------------------------------------------------------

struct Fwd {
  V y, pre, post, comb;
};

Fwd run_pre(const Block& b, const V& X, const V& fn, const V& scale, const V& base, int64_t T,
            ReduceOrder o) {
  Fwd r;
  r.y.resize(size_t(T * b.D));
  r.pre.resize(size_t(T * b.hc));
  r.post.resize(size_t(T * b.hc));
  r.comb.resize(size_t(T * b.hc * b.hc));
  HcPreParams p;
  p.T = T, p.hc = b.hc, p.D = b.D, p.X = X.data(), p.fn = fn.data(), p.scale = scale.data();
  p.base = base.data(), p.sinkhorn_iters = b.iters, p.order = o;
  p.y = r.y.data(), p.pre = r.pre.data(), p.post = r.post.data(), p.comb = r.comb.data();
  EXPECT_EQ(hc_pre_check(p), nullptr);
  hc_pre(p);
  return r;
}

// The block's gradients from our kernels (hc_post_backward then hc_pre_backward / hc_head_backward),
// every output starting from the given initial values.
struct Grads {
  V dX, dfn, dscale, dbase, df;  // dX: total gradient of the streams
  V dpost, dcomb;                // hc_post_backward's (inputs of hc_pre_backward)
};

Grads zero_grads(const Block& b, int64_t T) {
  Grads g;
  g.dX.assign(size_t(T * b.hc * b.D), 0.0f);
  g.dfn.assign(size_t(b.rows() * b.hc * b.D), 0.0f);
  g.dscale.assign(b.head ? 1 : 3, 0.0f);
  g.dbase.assign(size_t(b.rows()), 0.0f);
  g.df.assign(size_t(T * b.D), 0.0f);
  g.dpost.assign(size_t(T * b.hc), 0.0f);
  g.dcomb.assign(size_t(T * b.hc * b.hc), 0.0f);
  return g;
}

// The block's inputs as fp32 for tokens [t0, t0 + T).
struct BlockF {
  V X, fn, scale, base, f, Wy, Wo;
  BlockF(const Block& b, int64_t t0, int64_t T) {
    const int64_t n = b.hc * b.D;
    X = V(b.X.begin() + t0 * n, b.X.begin() + (t0 + T) * n);
    fn = to_f(b.fn), scale = to_f(b.scale), base = to_f(b.base);
    f = V(b.f.begin() + t0 * b.D, b.f.begin() + (t0 + T) * b.D);
    Wy = V(b.Wy.begin() + t0 * b.D, b.Wy.begin() + (t0 + T) * b.D);
    Wo = V(b.Wo.begin() + t0 * n, b.Wo.begin() + (t0 + T) * n);
  }
};

void run_backward(const Block& b, const BlockF& in, int64_t T, Grads& g, bool train_mixer = true,
                  ReduceOrder o = {}) {
  if (b.head) {
    HcHeadBwdParams p;
    p.T = T, p.hc = b.hc, p.D = b.D, p.X = in.X.data(), p.fn = in.fn.data(), p.scale = in.scale.data();
    p.base = in.base.data(), p.order = o, p.dy = in.Wy.data(), p.train_mixer = train_mixer;
    p.dX = g.dX.data(), p.dfn = g.dfn.data(), p.dscale = g.dscale.data(), p.dbase = g.dbase.data();
    ASSERT_EQ(hc_head_backward_check(p), nullptr);
    hc_head_backward(p);
    return;
  }
  const Fwd fw = run_pre(b, in.X, in.fn, in.scale, in.base, T, o);
  HcPostBwdParams q;
  q.T = T, q.hc = b.hc, q.D = b.D, q.f = in.f.data(), q.R = in.X.data(), q.post = fw.post.data();
  q.comb = fw.comb.data(), q.dout = in.Wo.data(), q.order = o;
  q.df = g.df.data(), q.dR = g.dX.data(), q.dpost = g.dpost.data(), q.dcomb = g.dcomb.data();
  ASSERT_EQ(hc_post_backward_check(q), nullptr);
  hc_post_backward(q);
  HcPreBwdParams p;
  p.T = T, p.hc = b.hc, p.D = b.D, p.X = in.X.data(), p.fn = in.fn.data(), p.scale = in.scale.data();
  p.base = in.base.data(), p.sinkhorn_iters = b.iters, p.order = o, p.dy = in.Wy.data();
  p.dpost = g.dpost.data(), p.dcomb = g.dcomb.data(), p.train_mixer = train_mixer;
  p.dX = g.dX.data(), p.dfn = g.dfn.data(), p.dscale = g.dscale.data(), p.dbase = g.dbase.data();
  ASSERT_EQ(hc_pre_backward_check(p), nullptr);
  hc_pre_backward(p);
}

// Tolerance of the fp32 backward against float64 finite differences, relative to each element
// (plus 1/8 of the tensor's largest value): the chain has O(10) fp32 roundings per path plus the
// forward's own fp32 errors (~1e-6 relative), and the Sinkhorn backward walks 2 iters - 1 steps.
// The worst error measured over these cases is 1.4e-6 (the message of grads_close reports it), so
// 2e-5 leaves a margin of 10x; a missing term (the rho correction, one Sinkhorn step, the 2 of post)
// fails by orders of magnitude.
constexpr double kTol = 2e-5;

void check_block_against_fd(Block b) {
  SCOPED_TRACE(::testing::Message() << "hc " << b.hc << " D " << b.D << " T " << b.T << " iters " << b.iters
                                    << (b.head ? " head" : ""));
  const BlockF in(b, 0, b.T);
  Grads g = zero_grads(b, b.T);
  run_backward(b, in, b.T, g);
  auto L = [&] { return block_loss(b); };
  EXPECT_TRUE(grads_close("dX", g.dX, fd_grad(b.X, L), kTol));
  EXPECT_TRUE(grads_close("dfn", g.dfn, fd_grad(b.fn, L), kTol));
  EXPECT_TRUE(grads_close("dscale", g.dscale, fd_grad(b.scale, L), kTol));
  EXPECT_TRUE(grads_close("dbase", g.dbase, fd_grad(b.base, L), kTol));
  if (!b.head) {
    EXPECT_TRUE(grads_close("df", g.df, fd_grad(b.f, L), kTol));
  }
}

// ---- Sinkhorn alone -----------------------------------------------------------------------------

TEST(SinkhornBackward, SavedForwardIsTheForwardBitwise) {
  auto g = rng_for("sinkhorn-saved");
  std::normal_distribution<float> nd(0.0f, 2.0f);
  for (int hc : {1, 2, 3, 4, 7, 16})
    for (int iters : {1, 2, 3, 20}) {
      V c0(size_t(hc * hc));
      for (auto& v : c0) v = nd(g);
      V want = c0;
      sinkhorn(want.data(), hc, iters, 1e-6f);
      V saved(size_t(common::sinkhorn_saved_floats(hc, iters)));
      common::sinkhorn_forward_saved(c0.data(), hc, iters, 1e-6f, saved.data());
      const V got(saved.end() - hc * hc, saved.end());
      EXPECT_TRUE(bitwise_equal(got, want)) << hc << " " << iters;
      // Slot 1 is slot 0 + eps; slot 2 is slot 1 normalised over columns.
      for (int e = 0; e < hc * hc; ++e) EXPECT_EQ(saved[size_t(hc * hc + e)], saved[size_t(e)] + 1e-6f);
    }
}

TEST(SinkhornBackward, MatchesFiniteDifferences) {
  auto g = rng_for("sinkhorn-bwd");
  std::normal_distribution<double> nd(0.0, 1.0);
  for (int hc : {1, 2, 3, 4, 5})
    for (int iters : {1, 2, 3, 20})
      for (double spread : {0.5, 1.5, 4.0}) {
        SCOPED_TRACE(::testing::Message() << "hc " << hc << " iters " << iters << " spread " << spread);
        const int hh = hc * hc;
        Vd c0(static_cast<size_t>(hh)), W(static_cast<size_t>(hh));
        for (auto& v : c0) v = double(num::bf16_round(float(spread * nd(g))));
        for (auto& v : W) v = double(num::bf16_round(float(nd(g))));
        const V c0f = to_f(c0);
        V saved(size_t(common::sinkhorn_saved_floats(hc, iters)));
        common::sinkhorn_forward_saved(c0f.data(), hc, iters, 1e-6f, saved.data());
        V dc = to_f(W);
        common::sinkhorn_backward(saved.data(), hc, iters, 1e-6f, dc.data());
        auto L = [&] {
          Vd c = c0;
          sinkhorn_d(c.data(), hc, iters, kEps);
          double s = 0;
          for (int e = 0; e < hh; ++e) s += W[size_t(e)] * c[size_t(e)];
          return s;
        };
        const Vd want = fd_grad(c0, L);
        if (hc == 1) {  // a 1 x 1 Sinkhorn is constant: the gradient is exactly 0
          EXPECT_EQ(dc[0], 0.0f);
          EXPECT_NEAR(want[0], 0.0, 1e-9);
          continue;
        }
        EXPECT_TRUE(grads_close("dC0", dc, want, kTol));
      }
}

// The per-token functions the backward recomputes the forward with give hc_pre's pre, post and
// comb bitwise (from the same gemm products and rho).
TEST(SinkhornBackward, RecomputedForwardIsHcPresBitwise) {
  for (int hc : {2, 3, 4}) {
    const Block b = make_block("recompute-" + std::to_string(hc), hc, 45, 6, 20, false);
    const BlockF in(b, 0, b.T);
    const ReduceOrder o{64};
    const Fwd fw = run_pre(b, in.X, in.fn, in.scale, in.base, b.T, o);
    const int rows = b.rows();
    const int64_t n = hc * b.D;
    V raw(size_t(b.T * rows));
    gemm(linear_params(b.T, rows, n, in.X.data(), in.fn.data(), raw.data(), OutRound::f32, o));
    V m(static_cast<size_t>(rows)), a(static_cast<size_t>(rows));
    V saved(size_t(common::sinkhorn_saved_floats(hc, b.iters)));
    for (int64_t t = 0; t < b.T; ++t) {
      const float rho = common::rms_scale(sum_squares(in.X.data() + t * n, n, o), n, 1e-6f);
      common::mhc_logits(raw.data() + t * rows, rho, rows, hc, false, in.scale.data(), in.base.data(),
                         m.data(), a.data());
      for (int j = 0; j < hc; ++j) {
        ASSERT_EQ(num::sigmoid_f(a[size_t(j)]) + 1e-6f, fw.pre[size_t(t * hc + j)]);
        ASSERT_EQ(2.0f * num::sigmoid_f(a[size_t(hc + j)]), fw.post[size_t(t * hc + j)]);
      }
      common::sinkhorn_forward_saved(a.data() + 2 * hc, hc, b.iters, 1e-6f, saved.data());
      ASSERT_TRUE(bitwise_equal(V(saved.end() - hc * hc, saved.end()),
                                V(fw.comb.begin() + t * hc * hc, fw.comb.begin() + (t + 1) * hc * hc)));
    }
  }
}

// ---- hc_post alone ------------------------------------------------------------------------------

TEST(HcPostBackward, MatchesFiniteDifferencesAndDocumentedOrder) {
  for (int hc : {2, 3, 4}) {
    auto g = rng_for("hc_post_bwd" + std::to_string(hc));
    const int64_t D = 7, T = 3;
    Vd f, R, post, comb, W;
    auto fill = [&](Vd& v, size_t n) {
      const V r = test::randn_bf16(g, n);
      v.assign(r.begin(), r.end());
    };
    fill(f, size_t(T * D)), fill(R, size_t(T * hc * D)), fill(post, size_t(T * hc));
    fill(comb, size_t(T * hc * hc)), fill(W, size_t(T * hc * D));
    auto L = [&] {
      double s = 0;
      for (int64_t t = 0; t < T; ++t)
        for (int k = 0; k < hc; ++k)
          for (int64_t d = 0; d < D; ++d) {
            double o = post[size_t(t * hc + k)] * f[size_t(t * D + d)];
            for (int j = 0; j < hc; ++j)
              o += comb[size_t((t * hc + j) * hc + k)] * R[size_t((t * hc + j) * D + d)];
            s += W[size_t((t * hc + k) * D + d)] * o;
          }
      return s;
    };
    const V ff = to_f(f), Rf = to_f(R), pf = to_f(post), cf = to_f(comb), Wf = to_f(W);
    // Accumulated outputs start from nonzero values: the result is init + contribution.
    const V df0 = test::randn_bf16(g, size_t(T * D)), dR0 = test::randn_bf16(g, size_t(T * hc * D));
    V df = df0, dR = dR0, dpost(size_t(T * hc)), dcomb(size_t(T * hc * hc));
    HcPostBwdParams p;
    p.T = T, p.hc = hc, p.D = D, p.f = ff.data(), p.R = Rf.data(), p.post = pf.data(), p.comb = cf.data();
    p.dout = Wf.data(), p.df = df.data(), p.dR = dR.data(), p.dpost = dpost.data(), p.dcomb = dcomb.data();
    ASSERT_EQ(hc_post_backward_check(p), nullptr);
    hc_post_backward(p);
    V df1(df.size()), dR1(dR.size());
    for (size_t i = 0; i < df.size(); ++i) df1[i] = df[i] - df0[i];
    for (size_t i = 0; i < dR.size(); ++i) dR1[i] = dR[i] - dR0[i];
    // The function is linear: FD is exact up to float64 rounding; the tolerance covers fp32.
    EXPECT_TRUE(grads_close("df", df1, fd_grad(f, L), 1e-5));
    EXPECT_TRUE(grads_close("dR", dR1, fd_grad(R, L), 1e-5));
    EXPECT_TRUE(grads_close("dpost", dpost, fd_grad(post, L), 1e-5));
    EXPECT_TRUE(grads_close("dcomb", dcomb, fd_grad(comb, L), 1e-5));
    // The documented operation order, bitwise.
    for (int64_t t = 0; t < T; ++t)
      for (int64_t d = 0; d < D; ++d) {
        float v = 0.0f;
        for (int k = 0; k < hc; ++k)
          v = std::fma(pf[size_t(t * hc + k)], Wf[size_t((t * hc + k) * D + d)], v);
        ASSERT_EQ(df[size_t(t * D + d)], df0[size_t(t * D + d)] + v);
        for (int j = 0; j < hc; ++j) {
          float w = 0.0f;
          for (int k = 0; k < hc; ++k)
            w = std::fma(cf[size_t((t * hc + j) * hc + k)], Wf[size_t((t * hc + k) * D + d)], w);
          ASSERT_EQ(dR[size_t((t * hc + j) * D + d)], dR0[size_t((t * hc + j) * D + d)] + w);
        }
      }
    for (int64_t t = 0; t < T; ++t)
      for (int k = 0; k < hc; ++k) {
        ASSERT_EQ(dpost[size_t(t * hc + k)], dot(Wf.data() + (t * hc + k) * D, ff.data() + t * D, D, {}));
        for (int j = 0; j < hc; ++j)
          ASSERT_EQ(dcomb[size_t((t * hc + j) * hc + k)],
                    dot(Wf.data() + (t * hc + k) * D, Rf.data() + (t * hc + j) * D, D, {}));
      }
  }
}

// ---- hc_pre + hc_post, and hc_head, against finite differences ------------------------------------

TEST(HcPreBackward, MatchesFiniteDifferences20Iterations) {
  for (int hc : {2, 3, 4})
    check_block_against_fd(make_block("pre20-" + std::to_string(hc), hc, 5, 3, 20, false));
}

TEST(HcPreBackward, MatchesFiniteDifferences3Iterations) {
  for (int hc : {2, 3, 4})
    check_block_against_fd(make_block("pre3-" + std::to_string(hc), hc, 7, 3, 3, false));
}

TEST(HcPreBackward, MatchesFiniteDifferencesAcrossChunks) {
  // hc * D = 111 spans two 64-column chunks of dX and dfn; one token alone.
  check_block_against_fd(make_block("pre-chunks", 3, 37, 1, 20, false));
  check_block_against_fd(make_block("pre-chunks2", 4, 33, 2, 2, false));
}

TEST(HcHeadBackward, MatchesFiniteDifferences) {
  for (int hc : {2, 3, 4})
    check_block_against_fd(make_block("head-" + std::to_string(hc), hc, 5, 3, 0, true));
  check_block_against_fd(make_block("head-chunks", 4, 41, 2, 0, true));
}

// ---- legacy mode --------------------------------------------------------------------------------

TEST(HcPreBackward, LegacyModeIsPreTimesDyOnly) {
  for (bool head : {false, true}) {
    Block b = make_block(head ? "legacy-head" : "legacy-pre", 4, 9, 5, 20, head);
    const BlockF in(b, 0, b.T);
    auto g = rng_for("legacy-init");
    const V dX0 = test::randn_bf16(g, size_t(b.T * b.hc * b.D));
    V dX = dX0;
    // Sentinels: the mixer's gradients must stay untouched.
    V dfn(size_t(b.rows() * b.hc * b.D), 7.0f), dscale(3, 7.0f), dbase(size_t(b.rows()), 7.0f);
    V wt(size_t(b.T * b.hc));
    if (head) {
      V y(size_t(b.T * b.D));
      HcHeadParams f;
      f.T = b.T, f.hc = b.hc, f.D = b.D, f.X = in.X.data(), f.fn = in.fn.data(), f.scale = in.scale.data();
      f.base = in.base.data(), f.y = y.data(), f.w = wt.data();
      hc_head(f);
      HcHeadBwdParams p;
      p.T = b.T, p.hc = b.hc, p.D = b.D, p.X = in.X.data(), p.fn = in.fn.data(), p.scale = in.scale.data();
      p.base = in.base.data(), p.dy = in.Wy.data(), p.train_mixer = false, p.dX = dX.data();
      p.dfn = dfn.data(), p.dscale = dscale.data(), p.dbase = dbase.data();
      ASSERT_EQ(hc_head_backward_check(p), nullptr);
      hc_head_backward(p);
    } else {
      wt = run_pre(b, in.X, in.fn, in.scale, in.base, b.T, {}).pre;
      HcPreBwdParams p;
      p.T = b.T, p.hc = b.hc, p.D = b.D, p.X = in.X.data(), p.fn = in.fn.data(), p.scale = in.scale.data();
      p.base = in.base.data(), p.dy = in.Wy.data(), p.train_mixer = false, p.dX = dX.data();
      p.dfn = dfn.data(), p.dscale = dscale.data(), p.dbase = dbase.data();  // dpost / dcomb null
      ASSERT_EQ(hc_pre_backward_check(p), nullptr);
      hc_pre_backward(p);
      // Null mixer gradients are accepted in legacy mode too.
      p.dfn = p.dscale = p.dbase = nullptr;
      EXPECT_EQ(hc_pre_backward_check(p), nullptr);
    }
    for (int64_t t = 0; t < b.T; ++t)
      for (int j = 0; j < b.hc; ++j)
        for (int64_t d = 0; d < b.D; ++d) {
          const size_t q = size_t((t * b.hc + j) * b.D + d);
          ASSERT_EQ(dX[q], dX0[q] + wt[size_t(t * b.hc + j)] * in.Wy[size_t(t * b.D + d)]) << head;
        }
    EXPECT_TRUE(std::all_of(dfn.begin(), dfn.end(), [](float v) { return v == 7.0f; }));
    EXPECT_TRUE(std::all_of(dscale.begin(), dscale.end(), [](float v) { return v == 7.0f; }));
    EXPECT_TRUE(std::all_of(dbase.begin(), dbase.end(), [](float v) { return v == 7.0f; }));
  }
}

// ---- accumulation, thread count, batch composition ----------------------------------------------

// Each (+=) output is init + (the call's contribution from zero), one add per element.
TEST(HcPreBackward, AccumulatesWithOneAddPerElement) {
  for (bool head : {false, true}) {
    Block b = make_block(head ? "acc-head" : "acc-pre", 3, 11, 4, 5, head);
    const BlockF in(b, 0, b.T);
    Grads zero = zero_grads(b, b.T);
    run_backward(b, in, b.T, zero);
    auto g = rng_for("acc-init");
    Grads init = zero_grads(b, b.T);
    init.dX = test::randn_bf16(g, init.dX.size());
    init.dfn = test::randn_bf16(g, init.dfn.size());
    init.dscale = test::randn_bf16(g, init.dscale.size());
    init.dbase = test::randn_bf16(g, init.dbase.size());
    init.df = test::randn_bf16(g, init.df.size());
    Grads acc = init;
    run_backward(b, in, b.T, acc);
    auto expect_sum = [](const char* what, const V& got, const V& i0, const V& c) {
      V want(got.size());
      for (size_t e = 0; e < got.size(); ++e) want[e] = i0[e] + c[e];
      EXPECT_TRUE(bitwise_equal(got, want)) << what;
    };
    if (head) {
      expect_sum("dX", acc.dX, init.dX, zero.dX);
    } else {
      // dX receives hc_post_backward's dR and then hc_pre_backward's contribution: two adds.
      Grads only_post = zero_grads(b, b.T);
      const Fwd fw = run_pre(b, in.X, in.fn, in.scale, in.base, b.T, {});
      HcPostBwdParams q;
      q.T = b.T, q.hc = b.hc, q.D = b.D, q.f = in.f.data(), q.R = in.X.data(), q.post = fw.post.data();
      q.comb = fw.comb.data(), q.dout = in.Wo.data(), q.df = only_post.df.data(), q.dR = only_post.dX.data();
      q.dpost = only_post.dpost.data(), q.dcomb = only_post.dcomb.data();
      hc_post_backward(q);
      V pre_part(zero.dX.size());
      {
        V tmp(zero.dX.size(), 0.0f);
        HcPreBwdParams p;
        p.T = b.T, p.hc = b.hc, p.D = b.D, p.X = in.X.data(), p.fn = in.fn.data(), p.scale = in.scale.data();
        p.base = in.base.data(), p.sinkhorn_iters = b.iters, p.dy = in.Wy.data();
        p.dpost = only_post.dpost.data(), p.dcomb = only_post.dcomb.data(), p.dX = tmp.data();
        V a(zero.dfn.size()), s(3), c(zero.dbase.size());
        p.dfn = a.data(), p.dscale = s.data(), p.dbase = c.data();
        hc_pre_backward(p);
        pre_part = tmp;
      }
      V want(acc.dX.size());
      for (size_t e = 0; e < want.size(); ++e) want[e] = (init.dX[e] + only_post.dX[e]) + pre_part[e];
      EXPECT_TRUE(bitwise_equal(acc.dX, want));
      expect_sum("df", acc.df, init.df, zero.df);
    }
    expect_sum("dfn", acc.dfn, init.dfn, zero.dfn);
    expect_sum("dscale", acc.dscale, init.dscale, zero.dscale);
    expect_sum("dbase", acc.dbase, init.dbase, zero.dbase);
  }
}

TEST(HcPreBackward, ThreadCountAndBatchInvariant) {
  // T * hc * D above the parallel thresholds; hc * D = 804 ends in a partial 64-column chunk.
  for (bool head : {false, true}) {
    SCOPED_TRACE(head ? "head" : "pre");
    const Block b = make_block(head ? "inv-head" : "inv-pre", 4, 201, 37, 20, head);
    const ReduceOrder o{64};
    const BlockF all(b, 0, b.T);
    const int saved = omp_get_max_threads();
    omp_set_num_threads(1);
    Grads g1 = zero_grads(b, b.T);
    run_backward(b, all, b.T, g1, true, o);
    omp_set_num_threads(3);
    Grads g3 = zero_grads(b, b.T);
    run_backward(b, all, b.T, g3, true, o);
    omp_set_num_threads(saved);
    EXPECT_TRUE(bitwise_equal(g1.dX, g3.dX));
    EXPECT_TRUE(bitwise_equal(g1.dfn, g3.dfn));
    EXPECT_TRUE(bitwise_equal(g1.dscale, g3.dscale));
    EXPECT_TRUE(bitwise_equal(g1.dbase, g3.dbase));
    EXPECT_TRUE(bitwise_equal(g1.df, g3.df));
    EXPECT_TRUE(bitwise_equal(g1.dcomb, g3.dcomb));
    EXPECT_FALSE(test::all_zero(g1.dfn));
    // Each token alone: its dX, df, dpost, dcomb are the batch's bitwise, and the batch's sums over
    // tokens are the sequential sums (increasing t, from 0) of the tokens' own contributions.
    const int64_t n = b.hc * b.D;
    V sfn(g1.dfn.size(), 0.0f), ssc(g1.dscale.size(), 0.0f), sba(g1.dbase.size(), 0.0f);
    for (int64_t t = 0; t < b.T; ++t) {
      const BlockF one(b, t, 1);
      Grads g = zero_grads(b, 1);
      run_backward(b, one, 1, g, true, o);
      ASSERT_TRUE(bitwise_equal(g.dX, V(g1.dX.begin() + t * n, g1.dX.begin() + (t + 1) * n))) << t;
      ASSERT_TRUE(bitwise_equal(g.df, V(g1.df.begin() + t * b.D, g1.df.begin() + (t + 1) * b.D))) << t;
      ASSERT_TRUE(bitwise_equal(
          g.dcomb, V(g1.dcomb.begin() + t * b.hc * b.hc, g1.dcomb.begin() + (t + 1) * b.hc * b.hc)))
          << t;
      for (size_t e = 0; e < sfn.size(); ++e) sfn[e] = sfn[e] + g.dfn[e];
      for (size_t e = 0; e < ssc.size(); ++e) ssc[e] = ssc[e] + g.dscale[e];
      for (size_t e = 0; e < sba.size(); ++e) sba[e] = sba[e] + g.dbase[e];
    }
    EXPECT_TRUE(bitwise_equal(g1.dfn, sfn));
    EXPECT_TRUE(bitwise_equal(g1.dscale, ssc));
    EXPECT_TRUE(bitwise_equal(g1.dbase, sba));
  }
}

// ---- checks --------------------------------------------------------------------------------------

TEST(HcPreBackward, CheckRejectsBadParams) {
  V buf(64, 0.0f);
  HcPreBwdParams p;
  p.T = 1, p.hc = 2, p.D = 4;
  p.X = p.fn = p.scale = p.base = p.dy = p.dpost = p.dcomb = buf.data();
  V dX(8), dfn(8), ds(3), db(8);
  p.dX = dX.data(), p.dfn = dfn.data(), p.dscale = ds.data(), p.dbase = db.data();
  EXPECT_EQ(hc_pre_backward_check(p), nullptr);
  auto bad = [](HcPreBwdParams q, auto mutate) {
    mutate(q);
    return hc_pre_backward_check(q);
  };
  EXPECT_NE(bad(p, [](auto& q) { q.hc = 17; }), nullptr);
  EXPECT_NE(bad(p, [](auto& q) { q.hc = 0; }), nullptr);
  EXPECT_NE(bad(p, [](auto& q) { q.D = 0; }), nullptr);
  EXPECT_NE(bad(p, [](auto& q) { q.T = -1; }), nullptr);
  EXPECT_NE(bad(p, [](auto& q) { q.sinkhorn_iters = 0; }), nullptr);
  EXPECT_NE(bad(p, [](auto& q) { q.order.block = 12; }), nullptr);
  EXPECT_NE(bad(p, [](auto& q) { q.dcomb = nullptr; }), nullptr);
  EXPECT_NE(bad(p, [](auto& q) { q.dfn = nullptr; }), nullptr);
  EXPECT_NE(bad(p, [](auto& q) { q.dX = const_cast<float*>(q.X); }), nullptr);
  EXPECT_EQ(bad(p, [](auto& q) { q.train_mixer = false, q.dcomb = nullptr, q.dfn = nullptr; }), nullptr);
  EXPECT_EQ(bad(p, [](auto& q) { q.T = 0, q.X = nullptr; }), nullptr);

  HcHeadBwdParams h;
  h.T = 1, h.hc = 2, h.D = 4;
  h.X = h.fn = h.scale = h.base = h.dy = buf.data();
  h.dX = dX.data(), h.dfn = dfn.data(), h.dscale = ds.data(), h.dbase = db.data();
  EXPECT_EQ(hc_head_backward_check(h), nullptr);
  h.dbase = nullptr;
  EXPECT_NE(hc_head_backward_check(h), nullptr);
  h.train_mixer = false;
  EXPECT_EQ(hc_head_backward_check(h), nullptr);

  HcPostBwdParams q;
  q.T = 1, q.hc = 2, q.D = 4;
  q.f = q.R = q.post = q.comb = q.dout = buf.data();
  q.df = dX.data(), q.dR = dfn.data(), q.dpost = ds.data(), q.dcomb = db.data();
  EXPECT_EQ(hc_post_backward_check(q), nullptr);
  q.dR = const_cast<float*>(q.R);
  EXPECT_NE(hc_post_backward_check(q), nullptr);
}

}  // namespace
}  // namespace dsv4
