// Shared CPU/CUDA arithmetic of the RMSNorm backward (kernels/grad.h rmsnorm_backward); conventions in
// kernels/detail/shared.h. r is the forward's scale common::rms_scale (kernels/detail/norm.h) and
// gx = dot(g, x) the canonical dot over the row, both computed by the caller.
#pragma once

#include <cstdint>

#include "kernels/detail/shared.h"

namespace dsv4::common {

// g_i = dy_i * w_i, or dy_i when there is no weight.
DSV4_HD float rmsnorm_bwd_g(float dy, const float* w, int64_t i) {
  return w ? dy * w[i] : dy;
}

// The row's coefficient c = (((r * r) * r) / dim) * gx.
DSV4_HD float rmsnorm_bwd_coef(float r, float gx, int64_t dim) {
  return (((r * r) * r) / float(dim)) * gx;
}

// The row's contribution to dx_i: r * g_i - c * x_i.
DSV4_HD float rmsnorm_bwd_dx(float g, float x, float r, float c) {
  return r * g - c * x;
}

// One row's term of dw_i: (dy_i * x_i) * r.
DSV4_HD float rmsnorm_bwd_dw_term(float dy, float x, float r) {
  return (dy * x) * r;
}

}  // namespace dsv4::common
