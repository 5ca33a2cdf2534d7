// Shared CPU/CUDA arithmetic of RMSNorm (kernels/norm.h); conventions in kernels/detail/shared.h.
#pragma once

#include <cmath>
#include <cstdint>

#include "kernels/detail/shared.h"

namespace dsv4::common {

// 1 / sqrt(ss / n + eps): the RMS scale of n values whose sum of squares is ss (IEEE division and sqrt).
DSV4_HD float rms_scale(float ss, int64_t n, float eps) {
  return 1.0f / std::sqrt(ss / float(n) + eps);
}

// The RMS scale in bf16 arithmetic (RmsNormParams::bf16_arith), from the sum s of bf16(x[i]^2) in the
// canonical order: r = bf16(1 / sqrt(bf16(bf16(s / n) + eps))) — PyTorch's rsqrt(mean(x^2) + eps) on a
// bf16 tensor, each op's output rounded to bf16 (IEEE division and sqrt inside an op).
DSV4_HD float rms_scale_bf16(float s, int64_t n, float eps) {
  const float mean = num::bf16_round(s / float(n));
  return num::bf16_round(1.0f / std::sqrt(num::bf16_round(mean + eps)));
}

// y[i] = bf16((x[i] * rs) * w[i]), or bf16(x[i] * rs) when w is null, for i = begin, begin + step, ...
// below n. Element i is read right before y[i] is written, so y == x is safe.
DSV4_HD float rmsnorm_value(float x, float rs, const float* w, int64_t i) {
  return w ? num::bf16_round((x * rs) * w[i]) : num::bf16_round(x * rs);
}
DSV4_HD void rmsnorm_apply(const float* x, float* y, const float* w, float rs, int64_t begin, int64_t n,
                           int64_t step) {
  for (int64_t i = begin; i < n; i += step) y[i] = rmsnorm_value(x[i], rs, w, i);
}

}  // namespace dsv4::common
