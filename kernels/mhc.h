// Manifold hyper-connections (MODEL.md §3.2): hc_pre (with Sinkhorn), hc_post, hc_head.
// Streams X are bf16 values stored as fp32, layout [T, hc, D] (stream-major per token).
#pragma once

#include <cstdint>

#include "kernels/reduce.h"

namespace dsv4 {

// Sinkhorn on one hc x hc matrix, in place, exactly MODEL.md §3.2: row softmax (subtract the row
// max, exp_f, divide by the row sum) + eps; column normalisation; then iters-1 times (row, column).
// Sums over 4 entries are sequential in index order.
void sinkhorn(float* c, int hc, int iters, float eps);

struct HcPreParams {
  int64_t T = 0;
  int hc = 4;
  int64_t D = 0;
  const float* X = nullptr;      // [T, hc, D]
  const float* fn = nullptr;     // [(2 + hc) * hc, hc * D] fp32
  const float* scale = nullptr;  // [3]
  const float* base = nullptr;   // [(2 + hc) * hc]
  float rms_eps = 1e-6f;
  float hc_eps = 1e-6f;
  int sinkhorn_iters = 20;
  ReduceOrder order{};    // for mean(x²) and each fn row · x
  float* y = nullptr;     // [T, D] bf16: sum_j pre_j * X[t, j]   (sum over j sequential)
  float* pre = nullptr;   // [T, hc]
  float* post = nullptr;  // [T, hc]
  float* comb = nullptr;  // [T, hc, hc], comb[j][k]: j source (row), k destination (column)
  uint64_t* y_sums = nullptr;  // [T, D / 512, 8] or nullptr: y's block sums (kernels/row_sums.h)
};
// Per token: x = X[t] flattened; rho = 1/sqrt(sum_squares(x)/(hc*D) + rms_eps);
// mix_i = rho * dot(fn_i, x); a_i = mix_i * scale[g(i)] + base_i; pre = sigmoid(a) + hc_eps;
// post = 2 sigmoid(a[hc..2hc)); comb = sinkhorn(a[2hc..]); y_d = bf16(sum_j pre_j * X[t,j,d]) with the
// sum over j computed as fma chain in j order starting from 0.
const char* hc_pre_check(const HcPreParams& p);
void hc_pre(const HcPreParams& p);

struct HcPostParams {
  int64_t T = 0;
  int hc = 4;
  int64_t D = 0;
  const float* f = nullptr;     // [T, D] sublayer output (bf16 values)
  const float* R = nullptr;     // [T, hc, D] streams that entered the matching hc_pre
  const float* post = nullptr;  // [T, hc]
  const float* comb = nullptr;  // [T, hc, hc]
  float* out = nullptr;         // [T, hc, D] bf16; must not alias R
  uint64_t* out_sums = nullptr;  // [T, hc * D / 512, 8] or nullptr: out's block sums (kernels/row_sums.h)
};
// out[t,k,d] = bf16(post_k * f[t,d] + sum_j comb[j][k] * R[t,j,d]) computed as
// acc = post_k * f; for j in 0..hc-1: acc = fma(comb[j][k], R[t,j,d], acc).
void hc_post(const HcPostParams& p);

struct HcHeadParams {
  int64_t T = 0;
  int hc = 4;
  int64_t D = 0;
  const float* X = nullptr;      // [T, hc, D]
  const float* fn = nullptr;     // [hc, hc * D]
  const float* scale = nullptr;  // [1]
  const float* base = nullptr;   // [hc]
  float rms_eps = 1e-6f, hc_eps = 1e-6f;
  ReduceOrder order{};
  float* y = nullptr;  // [T, D] bf16
  float* w = nullptr;  // [T, hc] the mixing weights, may be nullptr
  uint64_t* y_sums = nullptr;  // [T, D / 512, 8] or nullptr: y's block sums (kernels/row_sums.h)
};
// w_j = sigmoid(rho * dot(fn_j, x) * scale[0] + base_j) + hc_eps; y = bf16(sum_j w_j X[t,j]).
void hc_head(const HcHeadParams& p);

}  // namespace dsv4
