// Shared CPU/CUDA arithmetic of the manifold hyper-connections (kernels/mhc.h); conventions in
// kernels/detail/shared.h.
#pragma once

#include <cstdint>

#include "kernels/detail/norm.h"
#include "kernels/detail/shared.h"

namespace dsv4::common {

// Sinkhorn on one hc x hc matrix in place (the contract of dsv4::sinkhorn): row softmax (row max
// kept as mx < r[k] ? r[k] : mx, exp_f of the differences, each divided by the sequential row sum)
// + eps; a column normalisation; then iters - 1 times a row and a column normalisation. A
// normalisation divides every entry by (sequential sum of its row or column) + eps.
DSV4_HD void sinkhorn(float* c, int hc, int iters, float eps) {
  for (int j = 0; j < hc; ++j) {
    float* r = c + j * hc;
    float mx = r[0];
    for (int k = 1; k < hc; ++k) mx = (mx < r[k]) ? r[k] : mx;
    float s = 0.0f;
    for (int k = 0; k < hc; ++k) {
      r[k] = num::exp_f(r[k] - mx);
      s += r[k];
    }
    for (int k = 0; k < hc; ++k) r[k] = r[k] / s + eps;
  }
  for (int it = 0; it < iters; ++it) {
    if (it > 0) {  // row normalisation (the first row step was the softmax above)
      for (int j = 0; j < hc; ++j) {
        float s = 0.0f;
        for (int k = 0; k < hc; ++k) s += c[j * hc + k];
        const float d = s + eps;
        for (int k = 0; k < hc; ++k) c[j * hc + k] = c[j * hc + k] / d;
      }
    }
    for (int k = 0; k < hc; ++k) {
      float s = 0.0f;
      for (int j = 0; j < hc; ++j) s += c[j * hc + k];
      const float d = s + eps;
      for (int j = 0; j < hc; ++j) c[j * hc + k] = c[j * hc + k] / d;
    }
  }
}

// hc_pre's per-token weights from raw[i] = dot(fn_i, x) and rho (rms_scale over the token's hc * D
// values): a_i = (rho * raw_i) * scale[g(i)] + base_i for the (2 + hc) * hc rows (g = 0, 1, 2 for
// the pre, post and comb rows); pre_j = sigmoid(a_j) + hc_eps; post_j = 2 sigmoid(a_(hc+j));
// comb = sinkhorn(a[2hc..]). `a` is scratch for (2 + hc) * hc values.
DSV4_HD void hc_pre_weights(const float* raw, float rho, int hc, const float* scale, const float* base,
                            float hc_eps, int sinkhorn_iters, float* a, float* pre, float* post,
                            float* comb) {
  const int rows = (2 + hc) * hc;
  for (int i = 0; i < rows; ++i) {
    const int g = i < hc ? 0 : (i < 2 * hc ? 1 : 2);
    const float mix = rho * raw[i];
    a[i] = mix * scale[g] + base[i];
  }
  for (int j = 0; j < hc; ++j) {
    pre[j] = num::sigmoid_f(a[j]) + hc_eps;
    post[j] = 2.0f * num::sigmoid_f(a[hc + j]);
  }
  float* cm = a + 2 * hc;  // normalised in place, then copied out
  sinkhorn(cm, hc, sinkhorn_iters, hc_eps);
  for (int j = 0; j < hc * hc; ++j) comb[j] = cm[j];
}

// hc_head's weights: w_j = sigmoid((rho * raw_j) * scale[0] + base_j) + hc_eps.
DSV4_HD void hc_head_weights(const float* raw, float rho, int hc, const float* scale, const float* base,
                             float hc_eps, float* w) {
  for (int j = 0; j < hc; ++j) {
    const float mix = rho * raw[j];
    w[j] = num::sigmoid_f(mix * scale[0] + base[j]) + hc_eps;
  }
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
