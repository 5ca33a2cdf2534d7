// Shared CPU/CUDA arithmetic of the manifold hyper-connections (kernels/mhc.h); conventions in
// kernels/detail/shared.h.
#pragma once

#include <cstdint>

#include "kernels/detail/norm.h"
#include "kernels/detail/shared.h"

namespace dsv4::common {

// ---- Sinkhorn (the contract of dsv4::sinkhorn) ----------------------------------------------------
// A line is hc entries v[0], v[s], ..., v[(hc - 1) s] of the matrix (a row: s = 1, a column: s = hc),
// or of a thread's registers.

// p = the line's softmax: the max kept as mx < v[k] ? v[k] : mx from v[0], exp_f of the differences,
// each divided by their sequential sum. p may be v.
DSV4_HD void line_softmax(const float* v, float* p, int hc, int s) {
  float mx = v[0];
  for (int k = 1; k < hc; ++k) mx = (mx < v[k * s]) ? v[k * s] : mx;
  float sum = 0.0f;
  for (int k = 0; k < hc; ++k) {
    p[k * s] = num::exp_f(v[k * s] - mx);
    sum += p[k * s];
  }
  for (int k = 0; k < hc; ++k) p[k * s] = p[k * s] / sum;
}

// A normalisation: out = in / ((sequential sum of in) + eps), entry by entry. out may be in.
DSV4_HD void line_normalize(const float* in, float* out, int hc, int s, float eps) {
  float sum = 0.0f;
  for (int k = 0; k < hc; ++k) sum += in[k * s];
  const float d = sum + eps;
  for (int k = 0; k < hc; ++k) out[k * s] = in[k * s] / d;
}

// The order of the Sinkhorn steps: the row softmax, each entry + eps (softmax_rows); a column
// normalisation; then iters - 1 times a row and a column normalisation. Every Sinkhorn (the CPU's in
// place, the saved iterates of the backward, the GPU's across lanes) walks this schedule.
template <class SoftmaxRows, class NormalizeRows, class NormalizeColumns>
DSV4_HD void sinkhorn_steps(int iters, SoftmaxRows&& softmax_rows, NormalizeRows&& normalize_rows,
                            NormalizeColumns&& normalize_columns) {
  softmax_rows();
  for (int it = 0; it < iters; ++it) {
    if (it > 0) normalize_rows();
    normalize_columns();
  }
}

// Sinkhorn on one hc x hc matrix in place.
DSV4_HD void sinkhorn(float* c, int hc, int iters, float eps) {
  sinkhorn_steps(
      iters,
      [&] {
        for (int j = 0; j < hc; ++j) {
          float* r = c + j * hc;
          line_softmax(r, r, hc, 1);
          for (int k = 0; k < hc; ++k) r[k] = r[k] + eps;
        }
      },
      [&] {
        for (int j = 0; j < hc; ++j) line_normalize(c + j * hc, c + j * hc, hc, 1, eps);
      },
      [&] {
        for (int k = 0; k < hc; ++k) line_normalize(c + k, c + k, hc, hc, eps);
      });
}

// ---- hc_pre's weights ------------------------------------------------------------------------------
// From raw[i] = dot(fn_i, x) and rho (rms_scale over the token's hc * D values): the logit
// a_i = (rho * raw_i) * scale[g(i)] + base_i for the (2 + hc) * hc rows (g = 0, 1, 2 for the pre,
// post and comb rows); pre_j = sigmoid(a_j) + hc_eps; post_j = 2 sigmoid(a_(hc+j));
// comb = sinkhorn(a[2hc..]).

// The scale group of mixer row i: hc_pre: 0 (pre), 1 (post), 2 (comb); hc_head: always 0.
DSV4_HD int mhc_group(int i, int hc, bool head) {
  return head ? 0 : (i < hc ? 0 : (i < 2 * hc ? 1 : 2));
}
// The logit of mixer row i from its mix m_i = rho * raw_i: m_i * scale[group] + base_i (hc_pre's and
// hc_head's, forward and backward).
DSV4_HD float mhc_logit(float mix, int i, int hc, bool head, const float* scale, const float* base) {
  return mix * scale[mhc_group(i, hc, head)] + base[i];
}
DSV4_HD float hc_pre_logit(const float* raw, float rho, int hc, const float* scale, const float* base,
                           int i) {
  return mhc_logit(rho * raw[i], i, hc, false, scale, base);
}
DSV4_HD float hc_pre_weight(float a, float hc_eps) {
  return num::sigmoid_f(a) + hc_eps;
}
DSV4_HD float hc_post_weight(float a) {
  return 2.0f * num::sigmoid_f(a);
}

// A token's weights. `a` is scratch for (2 + hc) * hc values.
DSV4_HD void hc_pre_weights(const float* raw, float rho, int hc, const float* scale, const float* base,
                            float hc_eps, int sinkhorn_iters, float* a, float* pre, float* post,
                            float* comb) {
  const int rows = (2 + hc) * hc;
  for (int i = 0; i < rows; ++i) a[i] = hc_pre_logit(raw, rho, hc, scale, base, i);
  for (int j = 0; j < hc; ++j) {
    pre[j] = hc_pre_weight(a[j], hc_eps);
    post[j] = hc_post_weight(a[hc + j]);
  }
  float* cm = a + 2 * hc;  // normalised in place, then copied out
  sinkhorn(cm, hc, sinkhorn_iters, hc_eps);
  for (int j = 0; j < hc * hc; ++j) comb[j] = cm[j];
}

// hc_head's weights: w_j = sigmoid((rho * raw_j) * scale[0] + base_j) + hc_eps.
DSV4_HD void hc_head_weights(const float* raw, float rho, int hc, const float* scale, const float* base,
                             float hc_eps, float* w) {
  for (int j = 0; j < hc; ++j)
    w[j] = num::sigmoid_f(mhc_logit(rho * raw[j], j, hc, true, scale, base)) + hc_eps;
}

// bf16(sum_j wt[j] * X[j, d]) for the hc streams X [hc, D] of one token, as an fma chain over j from 0.
DSV4_HD float mix_streams_at(const float* X, const float* wt, int hc, int64_t D, int64_t d) {
  float acc = 0.0f;
  for (int j = 0; j < hc; ++j) acc = std::fma(wt[j], X[j * D + d], acc);
  return num::bf16_round(acc);
}

// hc_post of one element: bf16(post[k] * f[d] + sum_j comb[j][k] * R[j, d]) as acc = post[k] * f[d],
// then acc = fma(comb[j][k], R[j, d], acc) for j from 0 (f [D], R [hc, D], comb [hc, hc] of one token).
// R_at(j) gives R[j, d]: the CPU reads it in place, the GPU from registers it loaded once for every k.
template <class RAt>
DSV4_HD float hc_post_of(float f_d, RAt R_at, const float* post, const float* comb, int hc, int k) {
  float acc = post[k] * f_d;
  for (int j = 0; j < hc; ++j) acc = std::fma(comb[j * hc + k], R_at(j), acc);
  return num::bf16_round(acc);
}
struct StridedColumn {  // R[j * D + d]
  const float* R;
  int64_t D, d;
  DSV4_HD float operator()(int j) const { return R[j * D + d]; }
};
DSV4_HD float hc_post_at(const float* f, const float* R, const float* post, const float* comb, int hc,
                         int64_t D, int k, int64_t d) {
  return hc_post_of(f[d], StridedColumn{R, D, d}, post, comb, hc, k);
}

}  // namespace dsv4::common
