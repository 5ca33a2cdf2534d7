// RMSNorm (MODEL.md §3.1) in the operation order documented in kernels/norm.h.
#include "kernels/norm.h"

#include <vector>

#include "kernels/detail/norm.h"
#include "kernels/row_sums.h"

namespace dsv4 {

const char* rmsnorm_check(const RmsNormParams& p) {
  if (p.rows < 0 || p.dim <= 0) return "rmsnorm: rows must be >= 0 and dim > 0";
  if (p.rows > 0) {
    if (!p.x || !p.y) return "rmsnorm: x or y is null";
    if (p.ldx < p.dim) return "rmsnorm: ldx < dim";
    if (p.ldy < p.dim) return "rmsnorm: ldy < dim";
    if (p.x == p.y && p.ldx != p.ldy) return "rmsnorm: in place needs ldx == ldy";
  }
  if (p.order.block < 0 || p.order.block % 8 != 0)
    return "rmsnorm: reduce block must be 0 or a positive multiple of 8";
  if (p.bf16_arith && p.w) return "rmsnorm: bf16 arithmetic is defined without a weight";
  return row_sums_check(p.y_sums, p.dim, "rmsnorm: y_sums asked for rows whose dim is not a multiple of 512");
}

void rmsnorm(const RmsNormParams& p) {
  const int64_t n = p.dim;
  if (p.bf16_arith) {
#pragma omp parallel if (p.rows * p.dim >= (int64_t(1) << 15))
    {
      std::vector<float> v(static_cast<size_t>(n)), ones(static_cast<size_t>(n), 1.0f);  // fma(v, 1, acc) = acc + v
#pragma omp for schedule(static)
      for (int64_t r = 0; r < p.rows; ++r) {
        const float* x = p.x + r * p.ldx;
        for (int64_t i = 0; i < n; ++i) v[size_t(i)] = num::bf16_round(x[i] * x[i]);
        const float rs = common::rms_scale_bf16(dot(v.data(), ones.data(), n, p.order), n, p.eps);
        common::rmsnorm_apply(x, p.y + r * p.ldy, nullptr, rs, 0, n, 1);
      }
    }
    if (p.y_sums) bf16_row_sums(p.y, p.rows, n, p.ldy, p.y_sums);
    return;
  }
#pragma omp parallel for schedule(static) if (p.rows * p.dim >= (int64_t(1) << 15))
  for (int64_t r = 0; r < p.rows; ++r) {
    const float* x = p.x + r * p.ldx;
    float* y = p.y + r * p.ldy;
    const float rs = common::rms_scale(sum_squares(x, n, p.order), n, p.eps);
    common::rmsnorm_apply(x, y, p.w, rs, 0, n, 1);
  }
  if (p.y_sums) bf16_row_sums(p.y, p.rows, n, p.ldy, p.y_sums);
}

}  // namespace dsv4
