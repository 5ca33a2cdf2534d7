// Manifold hyper-connections (MODEL.md §3.2) in the operation order documented in kernels/mhc.h.
// The fn · x products of all tokens are one gemm() (fp32 out), which gives each element exactly
// dot(fn_i, x) in the canonical order; everything else is per token, parallel over tokens.
#include "kernels/mhc.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "kernels/linear.h"
#include "kernels/numerics/numerics.h"

namespace dsv4 {

void sinkhorn(float* c, int hc, int iters, float eps) {
  const auto row_norm = [&] {
    for (int j = 0; j < hc; ++j) {
      float s = 0.0f;
      for (int k = 0; k < hc; ++k) s += c[j * hc + k];
      const float d = s + eps;
      for (int k = 0; k < hc; ++k) c[j * hc + k] = c[j * hc + k] / d;
    }
  };
  const auto col_norm = [&] {
    for (int k = 0; k < hc; ++k) {
      float s = 0.0f;
      for (int j = 0; j < hc; ++j) s += c[j * hc + k];
      const float d = s + eps;
      for (int j = 0; j < hc; ++j) c[j * hc + k] = c[j * hc + k] / d;
    }
  };
  // Row softmax (subtract the row max) + eps: the first row step.
  for (int j = 0; j < hc; ++j) {
    float* r = c + j * hc;
    float mx = r[0];
    for (int k = 1; k < hc; ++k) mx = std::max(mx, r[k]);
    float s = 0.0f;
    for (int k = 0; k < hc; ++k) {
      r[k] = num::exp_f(r[k] - mx);
      s += r[k];
    }
    for (int k = 0; k < hc; ++k) r[k] = r[k] / s + eps;
  }
  col_norm();
  for (int it = 1; it < iters; ++it) {
    row_norm();
    col_norm();
  }
}

namespace {

// Below this many stream values a parallel region costs more than it saves (results do not depend
// on it: tokens are independent).
constexpr int64_t kParallelMin = int64_t(1) << 14;

// rho = 1 / sqrt(sum_squares(x) / n + eps) over the token's hc * D stream values.
inline float stream_rho(const float* x, int64_t n, float eps, ReduceOrder o) {
  return 1.0f / std::sqrt(sum_squares(x, n, o) / float(n) + eps);
}

// raw[t, i] = dot(fn_i, X[t]) for all tokens (fp32, canonical order).
std::vector<float> fn_products(int64_t T, int64_t hcD, const float* X, const float* fn, int64_t rows,
                               ReduceOrder o) {
  std::vector<float> raw(size_t(T * rows));
  GemmParams g;
  g.m = T;
  g.n = rows;
  g.k = hcD;
  g.x = X;
  g.ldx = hcD;
  g.w = fn;
  g.ldw = hcD;
  g.y = raw.data();
  g.ldy = rows;
  g.round = OutRound::f32;
  g.order = o;
  gemm(g);
  return raw;
}

// y[d] = bf16(sum_j wt[j] * X[j, d]) as an fma chain over j from 0.
inline void mix_streams(const float* X, const float* wt, int hc, int64_t D, float* y) {
  for (int64_t d = 0; d < D; ++d) {
    float acc = 0.0f;
    for (int j = 0; j < hc; ++j) acc = std::fma(wt[j], X[j * D + d], acc);
    y[d] = num::bf16_round(acc);
  }
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
  return nullptr;
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
      for (int64_t i = 0; i < rows; ++i) {
        const int g = i < hc ? 0 : (i < 2 * hc ? 1 : 2);
        const float mix = rho * raw[size_t(t * rows + i)];
        a[size_t(i)] = mix * p.scale[g] + p.base[i];
      }
      float* pre = p.pre + t * hc;
      float* post = p.post + t * hc;
      float* comb = p.comb + t * hc * hc;
      for (int j = 0; j < hc; ++j) {
        pre[j] = num::sigmoid_f(a[size_t(j)]) + p.hc_eps;
        post[j] = 2.0f * num::sigmoid_f(a[size_t(hc + j)]);
      }
      for (int j = 0; j < hc * hc; ++j) comb[j] = a[size_t(2 * hc + j)];
      sinkhorn(comb, hc, p.sinkhorn_iters, p.hc_eps);
      mix_streams(x, pre, hc, D, p.y + t * D);
    }
  }
}

void hc_post(const HcPostParams& p) {
  const int hc = p.hc;
  const int64_t D = p.D;
#pragma omp parallel for schedule(static) if (p.T * hc * D >= kParallelMin)
  for (int64_t t = 0; t < p.T; ++t) {
    const float* f = p.f + t * D;
    const float* R = p.R + t * hc * D;
    const float* comb = p.comb + t * hc * hc;
    for (int k = 0; k < hc; ++k) {
      const float pk = p.post[t * hc + k];
      float* out = p.out + (t * hc + k) * D;
      for (int64_t d = 0; d < D; ++d) {
        float acc = pk * f[d];
        for (int j = 0; j < hc; ++j) acc = std::fma(comb[j * hc + k], R[j * D + d], acc);
        out[d] = num::bf16_round(acc);
      }
    }
  }
}

void hc_head(const HcHeadParams& p) {
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
      for (int j = 0; j < hc; ++j) {
        const float mix = rho * raw[size_t(t * hc + j)];
        wt[size_t(j)] = num::sigmoid_f(mix * p.scale[0] + p.base[j]) + p.hc_eps;
      }
      if (p.w)
        for (int j = 0; j < hc; ++j) p.w[t * hc + j] = wt[size_t(j)];
      mix_streams(x, wt.data(), hc, D, p.y + t * D);
    }
  }
}

}  // namespace dsv4
