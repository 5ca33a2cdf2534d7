// Backward of the manifold hyper-connections (kernels/grad.h, MODEL.md §5.2) in the operation
// order documented there and in kernels/detail/grad_mhc.h.
//
// hc_pre_backward / hc_head_backward run in three passes:
//   1. the fn . x products of all tokens as one gemm() (fp32 out, as the forward's fn_products);
//   2. per token (parallel over tokens): rho, the logits, pre / w, the Sinkhorn iterates, da, the
//      coefficients gc = rho * dm and the token's dscale terms (kept per token), and dX;
//   3. the sums over tokens: dfn parallel over (row, chunk of 64 columns), each element a
//      sequential sum over the tokens; dbase and dscale sequential.
// No result depends on the thread count or on which other tokens share the call (apart from the
// sums over tokens, which are in increasing token order).
#include <algorithm>
#include <vector>

#include "kernels/detail/grad_mhc.h"
#include "kernels/detail/norm.h"
#include "kernels/grad.h"
#include "kernels/linear.h"

namespace dsv4 {

namespace {

// Below this much work a parallel region costs more than it saves (results do not depend on it).
constexpr int64_t kParallelMin = int64_t(1) << 14;

const char* order_check(const ReduceOrder& o) {
  return (o.block < 0 || o.block % 8 != 0) ? "reduce block must be 0 or a positive multiple of 8" : nullptr;
}

// raw[t, i] = dot(fn_i, X[t]) for the first `rows` mixer rows of all tokens (fp32, canonical
// order): each element is the forward's, whatever `rows` is (a gemm element depends only on its
// row of fn and of X).
std::vector<float> fn_products(int64_t T, int64_t hcD, const float* X, const float* fn, int64_t rows,
                               ReduceOrder o) {
  std::vector<float> raw(size_t(T * rows));
  gemm(linear_params(T, rows, hcD, X, fn, raw.data(), OutRound::f32, o));
  return raw;
}

// What hc_pre_backward and hc_head_backward share.
struct MixerBwd {
  int64_t T = 0;
  int hc = 0;
  int64_t D = 0;
  bool head = false;
  const float* X = nullptr;
  const float* fn = nullptr;
  const float* scale = nullptr;
  const float* base = nullptr;
  float rms_eps = 0, hc_eps = 0;
  int iters = 0;  // hc_pre only
  ReduceOrder order{};
  const float* dy = nullptr;
  const float* dpost = nullptr;  // hc_pre full mode
  const float* dcomb = nullptr;
  bool mixer = false;
  float* dX = nullptr;
  float* dfn = nullptr;
  float* dscale = nullptr;
  float* dbase = nullptr;
};

void mixer_backward(const MixerBwd& p) {
  if (p.T <= 0) return;
  const int hc = p.hc;
  const int64_t T = p.T, D = p.D, hcD = int64_t(hc) * D;
  const int rows = p.head ? hc : (2 + hc) * hc;
  const int nraw = p.mixer ? rows : hc;  // legacy: only the weights of y are needed
  const int groups = p.head ? 1 : 3;
  const std::vector<float> raw = fn_products(T, hcD, p.X, p.fn, nraw, p.order);
  std::vector<float> gc, da, dsc;
  if (p.mixer) {
    gc.resize(size_t(T * rows));
    da.resize(size_t(T * rows));
    dsc.resize(size_t(T * groups));
  }
  const int64_t saved_n = p.head ? 0 : common::sinkhorn_saved_floats(hc, p.iters);
#pragma omp parallel if (T * hcD >= kParallelMin)
  {
    const auto nrow = static_cast<size_t>(rows), nhc = static_cast<size_t>(hc);
    std::vector<float> m(nrow), a(nrow), wt(nhc), dw(nhc);
    std::vector<float> saved(static_cast<size_t>(p.mixer ? saved_n : 0));
#pragma omp for schedule(static)
    for (int64_t t = 0; t < T; ++t) {
      const float* x = p.X + t * hcD;
      const float* dy = p.dy + t * D;
      const float* rt = raw.data() + t * nraw;
      const float rho = common::rms_scale(sum_squares(x, hcD, p.order), hcD, p.rms_eps);
      common::mhc_logits(rt, rho, nraw, hc, p.head, p.scale, p.base, m.data(), a.data());
      for (int j = 0; j < hc; ++j) wt[size_t(j)] = num::sigmoid_f(a[size_t(j)]) + p.hc_eps;
      float c = 0.0f;
      if (p.mixer) {
        for (int j = 0; j < hc; ++j) dw[size_t(j)] = dot(dy, x + j * D, D, p.order);
        float* dat = da.data() + t * rows;
        if (p.head) {
          for (int j = 0; j < hc; ++j) dat[j] = common::sigmoid_backward(a[size_t(j)], dw[size_t(j)]);
        } else {
          common::sinkhorn_forward_saved(a.data() + 2 * hc, hc, p.iters, p.hc_eps, saved.data());
          common::hc_pre_logits_backward(a.data(), hc, dw.data(), p.dpost + t * hc, p.dcomb + t * hc * hc,
                                         saved.data(), p.iters, p.hc_eps, dat);
        }
        c = common::mhc_mixer_coefs(dat, m.data(), rt, rho, rows, hc, p.head, p.scale, hcD,
                                    gc.data() + t * rows, dsc.data() + t * groups);
      }
      for (int64_t q0 = 0; q0 < hcD; q0 += common::kMhcChunk) {
        const int len = int(std::min<int64_t>(common::kMhcChunk, hcD - q0));
        common::mhc_dx_range(x, wt.data(), dy, D, p.mixer, p.fn, hcD, rows,
                             p.mixer ? gc.data() + t * rows : nullptr, c, q0, len, p.dX + t * hcD);
      }
    }
  }
  if (!p.mixer || !p.dfn) return;  // a frozen mixer: its weights receive no gradient
  const int64_t chunks = (hcD + common::kMhcChunk - 1) / common::kMhcChunk;
  const int64_t tasks = int64_t(rows) * chunks;
#pragma omp parallel for schedule(static) if (T * rows * hcD >= kParallelMin)
  for (int64_t task = 0; task < tasks; ++task) {
    const int i = int(task / chunks);
    const int64_t q0 = (task % chunks) * common::kMhcChunk;
    const int len = int(std::min<int64_t>(common::kMhcChunk, hcD - q0));
    common::mhc_dfn_range(gc.data(), rows, i, p.X, hcD, T, q0, len, p.dfn + int64_t(i) * hcD);
  }
  for (int i = 0; i < rows; ++i) common::mhc_token_sum(da.data(), rows, T, i, p.dbase);
  for (int g = 0; g < groups; ++g) common::mhc_token_sum(dsc.data(), groups, T, g, p.dscale);
}

}  // namespace

const char* hc_post_backward_check(const HcPostBwdParams& p) {
  if (p.T < 0) return "hc_post_backward: T < 0";
  if (p.hc < 1) return "hc_post_backward: hc < 1";
  if (p.D < 1) return "hc_post_backward: D < 1";
  if (order_check(p.order)) return "hc_post_backward: reduce block must be 0 or a positive multiple of 8";
  if (p.T > 0 && (!p.f || !p.R || !p.post || !p.comb || !p.dout || !p.df || !p.dR || !p.dpost || !p.dcomb))
    return "hc_post_backward: null pointer";
  if (p.T > 0 && (p.dR == p.R || p.dR == p.dout || p.df == p.f))
    return "hc_post_backward: dR must not alias R or dout, df must not alias f";
  return nullptr;
}

void hc_post_backward(const HcPostBwdParams& p) {
  const int hc = p.hc;
  const int64_t D = p.D;
#pragma omp parallel for schedule(static) if (p.T * hc * D >= kParallelMin)
  for (int64_t t = 0; t < p.T; ++t) {
    const float* f = p.f + t * D;
    const float* R = p.R + t * hc * D;
    const float* post = p.post + t * hc;
    const float* comb = p.comb + t * hc * hc;
    const float* dout = p.dout + t * hc * D;
    float* df = p.df + t * D;
    float* dR = p.dR + t * hc * D;
    for (int64_t d = 0; d < D; ++d) df[d] = df[d] + common::hc_post_df_at(post, dout, hc, D, d);
    for (int j = 0; j < hc; ++j)
      for (int64_t d = 0; d < D; ++d)
        dR[j * D + d] = dR[j * D + d] + common::hc_post_dR_at(comb, dout, hc, D, j, d);
    for (int k = 0; k < hc; ++k) {
      p.dpost[t * hc + k] = dot(dout + k * D, f, D, p.order);
      for (int j = 0; j < hc; ++j) p.dcomb[(t * hc + j) * hc + k] = dot(dout + k * D, R + j * D, D, p.order);
    }
  }
}

const char* hc_pre_backward_check(const HcPreBwdParams& p) {
  if (p.T < 0) return "hc_pre_backward: T < 0";
  if (p.hc < 1 || p.hc > common::kMhcMaxHc) return "hc_pre_backward: hc must be in [1, 16]";
  if (p.D < 1) return "hc_pre_backward: D < 1";
  if (p.sinkhorn_iters < 1) return "hc_pre_backward: sinkhorn_iters < 1";
  if (order_check(p.order)) return "hc_pre_backward: reduce block must be 0 or a positive multiple of 8";
  if (p.T == 0) return nullptr;
  if (!p.X || !p.fn || !p.scale || !p.base || !p.dy || !p.dX) return "hc_pre_backward: null pointer";
  if (p.train_mixer && (!p.dpost || !p.dcomb))
    return "hc_pre_backward: dpost and dcomb are required when the mixer is trained";
  if (p.train_mixer && (!p.dfn != !p.dscale || !p.dfn != !p.dbase))
    return "hc_pre_backward: dfn, dscale and dbase are all given (the mixer's weights are trained) or all null";
  if (p.dX == p.X || p.dX == p.dy) return "hc_pre_backward: dX must not alias X or dy";
  return nullptr;
}

void hc_pre_backward(const HcPreBwdParams& p) {
  MixerBwd m;
  m.T = p.T, m.hc = p.hc, m.D = p.D, m.head = false;
  m.X = p.X, m.fn = p.fn, m.scale = p.scale, m.base = p.base;
  m.rms_eps = p.rms_eps, m.hc_eps = p.hc_eps, m.iters = p.sinkhorn_iters, m.order = p.order;
  m.dy = p.dy, m.dpost = p.dpost, m.dcomb = p.dcomb, m.mixer = p.train_mixer;
  m.dX = p.dX, m.dfn = p.dfn, m.dscale = p.dscale, m.dbase = p.dbase;
  mixer_backward(m);
}

const char* hc_head_backward_check(const HcHeadBwdParams& p) {
  if (p.T < 0) return "hc_head_backward: T < 0";
  if (p.hc < 1 || p.hc > common::kMhcMaxHc) return "hc_head_backward: hc must be in [1, 16]";
  if (p.D < 1) return "hc_head_backward: D < 1";
  if (order_check(p.order)) return "hc_head_backward: reduce block must be 0 or a positive multiple of 8";
  if (p.T == 0) return nullptr;
  if (!p.X || !p.fn || !p.scale || !p.base || !p.dy || !p.dX) return "hc_head_backward: null pointer";
  if (p.train_mixer && (!p.dfn != !p.dscale || !p.dfn != !p.dbase))
    return "hc_head_backward: dfn, dscale and dbase are all given (the mixer's weights are trained) or all null";
  if (p.dX == p.X || p.dX == p.dy) return "hc_head_backward: dX must not alias X or dy";
  return nullptr;
}

void hc_head_backward(const HcHeadBwdParams& p) {
  MixerBwd m;
  m.T = p.T, m.hc = p.hc, m.D = p.D, m.head = true;
  m.X = p.X, m.fn = p.fn, m.scale = p.scale, m.base = p.base;
  m.rms_eps = p.rms_eps, m.hc_eps = p.hc_eps, m.order = p.order;
  m.dy = p.dy, m.mixer = p.train_mixer;
  m.dX = p.dX, m.dfn = p.dfn, m.dscale = p.dscale, m.dbase = p.dbase;
  mixer_backward(m);
}

}  // namespace dsv4
