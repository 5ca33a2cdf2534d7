// Manifold hyper-connections (MODEL.md §3.2) in the operation order documented in kernels/mhc.h.
// The fn · x products of all tokens are one gemm() (fp32 out), which gives each element exactly
// dot(fn_i, x) in the canonical order; everything else is per token, parallel over tokens.
#include "kernels/mhc.h"

#include <vector>

#include "kernels/error.h"

#include "kernels/detail/mhc.h"
#include "kernels/linear.h"
#include "kernels/row_sums.h"

namespace dsv4 {

void sinkhorn(float* c, int hc, int iters, float eps) {
  common::sinkhorn(c, hc, iters, eps);
}

namespace {

// Below this many stream values a parallel region costs more than it saves (results do not depend
// on it: tokens are independent).
constexpr int64_t kParallelMin = int64_t(1) << 14;

// rho = 1 / sqrt(sum_squares(x) / n + eps) over the token's hc * D stream values.
inline float stream_rho(const float* x, int64_t n, float eps, ReduceOrder o) {
  return common::rms_scale(sum_squares(x, n, o), n, eps);
}

// raw[t, i] = dot(fn_i, X[t]) for all tokens (fp32, canonical order).
std::vector<float> fn_products(int64_t T, int64_t hcD, const float* X, const float* fn, int64_t rows,
                               ReduceOrder o) {
  std::vector<float> raw(size_t(T * rows));
  gemm(linear_params(T, rows, hcD, X, fn, raw.data(), OutRound::f32, o));
  return raw;
}

// y[d] = bf16(sum_j wt[j] * X[j, d]) as an fma chain over j from 0.
inline void mix_streams(const float* X, const float* wt, int hc, int64_t D, float* y) {
  for (int64_t d = 0; d < D; ++d) y[d] = common::mix_streams_at(X, wt, hc, D, d);
}

}  // namespace

const char* hc_pre_check(const HcPreParams& p) {
  if (p.T < 0) return "hc_pre: T < 0";
  if (p.hc < 1) return "hc_pre: hc < 1";
  if (p.D < 1) return "hc_pre: D < 1";
  if (p.sinkhorn_iters < 1) return "hc_pre: sinkhorn_iters < 1";
  if (p.order.block < 0 || p.order.block % 8 != 0)
    return "hc_pre: reduce block must be 0 or a positive multiple of 8";
  if (p.T > 0 && (!p.X || !p.fn || !p.scale || !p.base || !p.y || !p.pre || !p.post || !p.comb))
    return "hc_pre: null pointer";
  return row_sums_check(p.y_sums, p.D, "hc_pre: y_sums asked for rows of D values, D not a multiple of 512");
}

void hc_pre(const HcPreParams& p) {
  if (p.T <= 0) return;
  const int hc = p.hc;
  const int64_t D = p.D, hcD = int64_t(hc) * D, rows = int64_t(2 + hc) * hc;
  const std::vector<float> raw = fn_products(p.T, hcD, p.X, p.fn, rows, p.order);
#pragma omp parallel if (p.T * hcD >= kParallelMin)
  {
    std::vector<float> a(size_t(rows), 0.0f);
#pragma omp for schedule(static)
    for (int64_t t = 0; t < p.T; ++t) {
      const float* x = p.X + t * hcD;
      const float rho = stream_rho(x, hcD, p.rms_eps, p.order);
      float* pre = p.pre + t * hc;
      common::hc_pre_weights(raw.data() + t * rows, rho, hc, p.scale, p.base, p.hc_eps, p.sinkhorn_iters,
                             a.data(), pre, p.post + t * hc, p.comb + t * hc * hc);
      mix_streams(x, pre, hc, D, p.y + t * D);
    }
  }
  if (p.y_sums) bf16_row_sums(p.y, p.T, D, D, p.y_sums);
}

void hc_post(const HcPostParams& p) {
  const int hc = p.hc;
  const int64_t D = p.D;
  if (const char* why = row_sums_check(p.out_sums, hc * D,
                                       "hc_post: out_sums asked for rows of hc * D values, "
                                       "not a multiple of 512"))
    throw Error(why);
#pragma omp parallel for schedule(static) if (p.T * hc * D >= kParallelMin)
  for (int64_t t = 0; t < p.T; ++t) {
    const float* f = p.f + t * D;
    const float* R = p.R + t * hc * D;
    const float* comb = p.comb + t * hc * hc;
    const float* post = p.post + t * hc;
    for (int k = 0; k < hc; ++k) {
      float* out = p.out + (t * hc + k) * D;
      for (int64_t d = 0; d < D; ++d) out[d] = common::hc_post_at(f, R, post, comb, hc, D, k, d);
    }
  }
  if (p.out_sums) bf16_row_sums(p.out, p.T, hc * D, hc * D, p.out_sums);
}

void hc_head(const HcHeadParams& p) {
  if (const char* why = row_sums_check(p.y_sums, p.D,
                                       "hc_head: y_sums asked for rows of D values, D not a "
                                       "multiple of 512"))
    throw Error(why);
  if (p.T <= 0) return;
  const int hc = p.hc;
  const int64_t D = p.D, hcD = int64_t(hc) * D;
  const std::vector<float> raw = fn_products(p.T, hcD, p.X, p.fn, hc, p.order);
#pragma omp parallel if (p.T * hcD >= kParallelMin)
  {
    std::vector<float> wt(static_cast<size_t>(hc));
#pragma omp for schedule(static)
    for (int64_t t = 0; t < p.T; ++t) {
      const float* x = p.X + t * hcD;
      const float rho = stream_rho(x, hcD, p.rms_eps, p.order);
      common::hc_head_weights(raw.data() + t * hc, rho, hc, p.scale, p.base, p.hc_eps, wt.data());
      if (p.w)
        for (int j = 0; j < hc; ++j) p.w[t * hc + j] = wt[size_t(j)];
      mix_streams(x, wt.data(), hc, D, p.y + t * D);
    }
  }
  if (p.y_sums) bf16_row_sums(p.y, p.T, D, D, p.y_sums);
}

}  // namespace dsv4
