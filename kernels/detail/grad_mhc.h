// Shared CPU/CUDA arithmetic of the mHC backward (kernels/grad.h: hc_post_backward,
// hc_pre_backward, hc_head_backward; MODEL.md §5.2); conventions in kernels/detail/shared.h.
//
// Everything here works on one token (or one output element) with caller-provided buffers and
// fixed-size locals (hc <= kMhcMaxHc, at most kMhcChunk columns per *_range call), so a device
// thread can run the same functions. The forward quantities (m, a, pre, w, the Sinkhorn iterates)
// are recomputed with the same operations as kernels/detail/mhc.h, hence bit-identical to hc_pre /
// hc_head given the same rho and raw = dot(fn_i, x).
#pragma once

#include <cstdint>

#include "kernels/detail/mhc.h"
#include "kernels/detail/shared.h"

namespace dsv4::common {

constexpr int kMhcMaxHc = 16;                             // as the CUDA forward's kMaxHc
constexpr int kMhcMaxRows = (2 + kMhcMaxHc) * kMhcMaxHc;  // mixer rows of hc_pre
constexpr int kMhcChunk = 64;                             // columns per mhc_*_range call

// ---- Sinkhorn with saved iterates and its backward ----------------------------------------------

// Floats of the saved iterates of one hc x hc Sinkhorn: 2 * iters + 1 matrices.
DSV4_HD int64_t sinkhorn_saved_floats(int hc, int iters) {
  return (2 * int64_t(iters) + 1) * hc * hc;
}

// The Sinkhorn of common::sinkhorn on c0 (not modified), keeping every iterate. With hh = hc * hc,
// slot s = saved + s * hh:
//   slot 0             the row softmax p (row max, exp_f, each divided by the sequential row sum);
//   slot 1             p + eps, the input of normalisation step 1;
//   slot s (s >= 2)    the output of step s - 1 = the input of step s;
//   slot 2 * iters     the output of the last step = the forward's comb.
// Step s (1 .. 2 iters - 1) is a column normalisation when s is odd, a row normalisation when even.
// Each value is formed by the forward's operations, so slot 2 * iters is bitwise common::sinkhorn.
DSV4_HD void sinkhorn_forward_saved(const float* c0, int hc, int iters, float eps, float* saved) {
  const int hh = hc * hc;
  int st = 1;  // the next normalisation step: reads slot st, writes slot st + 1
  sinkhorn_steps(
      iters,
      [&] {
        float* p = saved;
        float* c1 = saved + hh;
        for (int j = 0; j < hc; ++j) {
          line_softmax(c0 + j * hc, p + j * hc, hc, 1);
          for (int k = 0; k < hc; ++k) c1[j * hc + k] = p[j * hc + k] + eps;
        }
      },
      [&] {  // row normalisation: sum over the destination index k
        const float* in = saved + int64_t(st) * hh;
        float* out = saved + int64_t(st + 1) * hh;
        for (int j = 0; j < hc; ++j) line_normalize(in + j * hc, out + j * hc, hc, 1, eps);
        ++st;
      },
      [&] {  // column normalisation: sum over the source index j
        const float* in = saved + int64_t(st) * hh;
        float* out = saved + int64_t(st + 1) * hh;
        for (int k = 0; k < hc; ++k) line_normalize(in + k, out + k, hc, hc, eps);
        ++st;
      });
}

// Backward of sinkhorn_forward_saved: dc holds dcomb on entry and dC0 on return. Walks the steps
// from 2 iters - 1 down to 1; for step s with input c = slot s, per line (column for odd s, row for
// even s) with d = (sequential sum of c over the line) + eps as the forward forms it:
//   w = fma chain over the line (increasing index, from 0) of dc * c;  q = w / d;
//   dc = (dc - q) / d                 (= dc/d - sum(dc * c)/d^2, MODEL.md §5.2)
// then the softmax + eps step, per row with p = slot 0:
//   w = fma chain over k from 0 of dc * p;  dc = p * (dc - w).
DSV4_HD void sinkhorn_backward(const float* saved, int hc, int iters, float eps, float* dc) {
  const int hh = hc * hc;
  for (int st = 2 * iters - 1; st >= 1; --st) {
    const float* c = saved + int64_t(st) * hh;
    // A line is `hc` entries with stride `along` starting at `first`.
    const int along = (st % 2 == 1) ? hc : 1;
    const int across = (st % 2 == 1) ? 1 : hc;
    for (int l = 0; l < hc; ++l) {
      const int first = l * across;
      float s = 0.0f;
      for (int e = 0; e < hc; ++e) s += c[first + e * along];
      const float d = s + eps;
      float w = 0.0f;
      for (int e = 0; e < hc; ++e) w = std::fma(dc[first + e * along], c[first + e * along], w);
      const float q = w / d;
      for (int e = 0; e < hc; ++e) dc[first + e * along] = (dc[first + e * along] - q) / d;
    }
  }
  const float* p = saved;
  for (int j = 0; j < hc; ++j) {
    float w = 0.0f;
    for (int k = 0; k < hc; ++k) w = std::fma(dc[j * hc + k], p[j * hc + k], w);
    for (int k = 0; k < hc; ++k) dc[j * hc + k] = p[j * hc + k] * (dc[j * hc + k] - w);
  }
}

// ---- the mixer ------------------------------------------------------------------------------------

// m_i = rho * raw_i and a_i = m_i * scale[group(i)] + base_i for i < rows, exactly as
// hc_pre_weights / hc_head_weights form them.
DSV4_HD void mhc_logits(const float* raw, float rho, int rows, int hc, bool head, const float* scale,
                        const float* base, float* m, float* a) {
  for (int i = 0; i < rows; ++i) {
    m[i] = rho * raw[i];
    a[i] = mhc_logit(m[i], i, hc, head, scale, base);
  }
}

// d/da of sigmoid_f(a) given the gradient g of its output: g * (s * (1 - s)), s = sigmoid_f(a).
DSV4_HD float sigmoid_backward(float a, float g) {
  const float s = num::sigmoid_f(a);
  return g * (s * (1.0f - s));
}

// hc_pre's da [(2 + hc) * hc] from dpre [hc], dpost [hc], dcomb [hc * hc] and the token's logits a
// and Sinkhorn iterates (sinkhorn_forward_saved of a + 2 hc):
//   da_j        = dpre_j * (s * (1 - s))               s = sigmoid_f(a_j)
//   da_(hc+k)   = dpost_k * (2 * (s * (1 - s)))        s = sigmoid_f(a_(hc+k))
//   da_(2hc+..) = sinkhorn_backward(dcomb)
DSV4_HD void hc_pre_logits_backward(const float* a, int hc, const float* dpre, const float* dpost,
                                    const float* dcomb, const float* saved, int iters, float eps, float* da) {
  for (int j = 0; j < hc; ++j) da[j] = sigmoid_backward(a[j], dpre[j]);
  for (int k = 0; k < hc; ++k) {
    const float s = num::sigmoid_f(a[hc + k]);
    da[hc + k] = dpost[k] * (2.0f * (s * (1.0f - s)));
  }
  float* dc = da + 2 * hc;
  for (int e = 0; e < hc * hc; ++e) dc[e] = dcomb[e];
  sinkhorn_backward(saved, hc, iters, eps, dc);
}

// From da [rows], m and raw [rows] of one token, with n = hc * D values in the token:
//   dm_i = da_i * scale[group(i)];  gc_i = rho * dm_i                     (the dfn and fn^T coefficients)
//   dscale_t[g] = fma chain over the rows i of group g (increasing, from 0) of da_i * m_i
//                 (3 groups for hc_pre, 1 for hc_head)
//   returns c = (((rho * rho) * rho) / float(n)) * dmu, dmu = fma chain over i from 0 of dm_i * raw_i
// (the rho^3 / n <dm, u> of MODEL.md §5.2, u = raw).
DSV4_HD float mhc_mixer_coefs(const float* da, const float* m, const float* raw, float rho, int rows, int hc,
                              bool head, const float* scale, int64_t n, float* gc, float* dscale_t) {
  const int groups = head ? 1 : 3;
  for (int g = 0; g < groups; ++g) dscale_t[g] = 0.0f;
  float dmu = 0.0f;
  for (int i = 0; i < rows; ++i) {
    const int g = mhc_group(i, hc, head);
    dscale_t[g] = std::fma(da[i], m[i], dscale_t[g]);
    const float dm = da[i] * scale[g];
    gc[i] = rho * dm;
    dmu = std::fma(dm, raw[i], dmu);
  }
  return (((rho * rho) * rho) / float(n)) * dmu;
}

// dX[q] (+=) v for q in [q0, q0 + len) (len <= kMhcChunk) of one token's streams (x, dX [hc * D]),
// q = j * D + d, with
//   v = wt_j * dy_d                                        (wt: pre or hc_head's w)
//   mixer: v = fma(gc_i, fn[i, q], v) for i = 0 .. rows - 1;  v = fma(-c, x_q, v)
//   dX[q] = dX[q] + v
// gc and c from mhc_mixer_coefs; fn [rows, hcD] row-major. Without the mixer, fn / gc are unused.
DSV4_HD void mhc_dx_range(const float* x, const float* wt, const float* dy, int64_t D, bool mixer,
                          const float* fn, int64_t hcD, int rows, const float* gc, float c, int64_t q0,
                          int len, float* dX) {
  float v[kMhcChunk];
  for (int l = 0; l < len; ++l) {
    const int64_t q = q0 + l;
    v[l] = wt[q / D] * dy[q % D];
  }
  if (mixer) {
    for (int i = 0; i < rows; ++i) {
      const float* f = fn + int64_t(i) * hcD + q0;
      for (int l = 0; l < len; ++l) v[l] = std::fma(gc[i], f[l], v[l]);
    }
    for (int l = 0; l < len; ++l) v[l] = std::fma(-c, x[q0 + l], v[l]);
  }
  for (int l = 0; l < len; ++l) dX[q0 + l] = dX[q0 + l] + v[l];
}

// dfn_row[q] (+=) s_q for q in [q0, q0 + len) (len <= kMhcChunk) of mixer row i, with
//   s_q = sequential fp32 sum over t = 0 .. T-1 of (gc[t * ldgc + i] * X[t * hcD + q])
// (each token's product rounded first, the sum starting from 0), then dfn_row[q] = dfn_row[q] + s_q.
DSV4_HD void mhc_dfn_range(const float* gc, int64_t ldgc, int i, const float* X, int64_t hcD, int64_t T,
                           int64_t q0, int len, float* dfn_row) {
  float s[kMhcChunk];
  for (int l = 0; l < len; ++l) s[l] = 0.0f;
  for (int64_t t = 0; t < T; ++t) {
    const float g = gc[t * ldgc + i];
    const float* x = X + t * hcD + q0;
    for (int l = 0; l < len; ++l) s[l] = s[l] + g * x[l];
  }
  for (int l = 0; l < len; ++l) dfn_row[q0 + l] = dfn_row[q0 + l] + s[l];
}

// out[i] (+=) sequential fp32 sum over t = 0 .. T-1 of v[t * ld + i], starting from 0.
DSV4_HD void mhc_token_sum(const float* v, int64_t ld, int64_t T, int i, float* out) {
  float s = 0.0f;
  for (int64_t t = 0; t < T; ++t) s = s + v[t * ld + i];
  out[i] = out[i] + s;
}

// ---- hc_post ---------------------------------------------------------------------------------------

// Of one token (dout [hc, D]): df_d = fma chain over k from 0 of post_k * dout[k, d].
DSV4_HD float hc_post_df_at(const float* post, const float* dout, int hc, int64_t D, int64_t d) {
  float v = 0.0f;
  for (int k = 0; k < hc; ++k) v = std::fma(post[k], dout[k * D + d], v);
  return v;
}

// Of one token: dR_(j, d) = fma chain over k from 0 of comb[j][k] * dout[k, d].
DSV4_HD float hc_post_dR_at(const float* comb, const float* dout, int hc, int64_t D, int j, int64_t d) {
  float v = 0.0f;
  for (int k = 0; k < hc; ++k) v = std::fma(comb[j * hc + k], dout[k * D + d], v);
  return v;
}

}  // namespace dsv4::common
