// RMSNorm (MODEL.md §3.1): y = bf16(w ⊙ x · (mean(x²) + eps)^(-1/2)), fp32 math.
//   ss   = sum_squares(x, n, order)           (kernels/reduce.h)
//   r    = 1 / sqrt(ss / n + eps)             (IEEE division and sqrt)
//   y[i] = bf16((x[i] * r) * w[i])            (w == nullptr: bf16(x[i] * r); per-head q norm)
// Rows are independent; in place (y == x) is allowed.
#pragma once

#include <cstdint>

#include "kernels/reduce.h"

namespace dsv4 {

struct RmsNormParams {
  int64_t rows = 0, dim = 0;
  const float* x = nullptr;
  int64_t ldx = 0;
  const float* w = nullptr;  // [dim] or nullptr
  float* y = nullptr;
  int64_t ldy = 0;
  float eps = 1e-6f;
  ReduceOrder order{};
  // bf16 arithmetic (an engine that normalises a bf16 tensor in place, MODEL.md §12.1 item 1; no
  // weight): v[i] = bf16(x[i]^2), s = sum of v in `order`, r = bf16(1 / sqrt(bf16(bf16(s / dim) + eps))),
  // y[i] = bf16(x[i] * r). false: the fp32 arithmetic above.
  bool bf16_arith = false;
  uint64_t* y_sums = nullptr;  // [rows, dim / 512, 8] or nullptr: y's block sums (kernels/row_sums.h)
};
const char* rmsnorm_check(const RmsNormParams& p);
void rmsnorm(const RmsNormParams& p);

}  // namespace dsv4
