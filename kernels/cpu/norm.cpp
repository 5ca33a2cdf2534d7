// RMSNorm (MODEL.md §3.1) in the operation order documented in kernels/norm.h.
#include "kernels/norm.h"

#include "kernels/detail/norm.h"

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
  return nullptr;
}

void rmsnorm(const RmsNormParams& p) {
  const int64_t n = p.dim;
#pragma omp parallel for schedule(static) if (p.rows * p.dim >= (int64_t(1) << 15))
  for (int64_t r = 0; r < p.rows; ++r) {
    const float* x = p.x + r * p.ldx;
    float* y = p.y + r * p.ldy;
    const float rs = common::rms_scale(sum_squares(x, n, p.order), n, p.eps);
    common::rmsnorm_apply(x, y, p.w, rs, 0, n, 1);
  }
}

}  // namespace dsv4
