// RMSNorm on the GPU in the operation order of kernels/norm.h.
//
// Kernel contract (rmsnorm_kernel): 256 threads per block, one aligned group of 8 threads per row
// (32 rows per block, grid-stride over rows). The group forms sum_squares(x) with dot8 (the exact
// canonical order), every lane then computes r = 1 / sqrt(ss / n + eps) and writes its elements
// i = lane (mod 8). In place (y == x) is safe: the row is fully read before the group's shuffles
// complete, and each lane reads x[i] before writing y[i] (apply8).
#include "kernels/cuda/common.cuh"
#include "kernels/detail/norm.h"

namespace dsv4::cuda {

namespace {

constexpr int kThreads = 256, kRowsPerBlock = kThreads / 8;

// common::rmsnorm_apply for one lane of 8, with the loads of 4 elements issued before their stores: y
// may be x (in place), so the compiler cannot move a load above an earlier store by itself; here each
// store writes an element whose load is already done, which keeps in place safe.
__device__ __forceinline__ void apply8(const float* x, float* y, const float* w, float rs, int lane, int64_t n) {
  int64_t i = lane;
  for (; i + 24 < n; i += 32) {
    const float a = x[i], b = x[i + 8], c = x[i + 16], d = x[i + 24];
    y[i] = common::rmsnorm_value(a, rs, w, i);
    y[i + 8] = common::rmsnorm_value(b, rs, w, i + 8);
    y[i + 16] = common::rmsnorm_value(c, rs, w, i + 16);
    y[i + 24] = common::rmsnorm_value(d, rs, w, i + 24);
  }
  for (; i < n; i += 8) y[i] = common::rmsnorm_value(x[i], rs, w, i);
}

__global__ void __launch_bounds__(kThreads) rmsnorm_kernel(RmsNormParams p) {
  const int lane = threadIdx.x & 7;
  const unsigned mask = detail::group8_mask();
  for (int64_t row = int64_t(blockIdx.x) * kRowsPerBlock + threadIdx.x / 8; row < p.rows;
       row += int64_t(gridDim.x) * kRowsPerBlock) {
    const float* x = p.x + row * p.ldx;
    float* y = p.y + row * p.ldy;
    if (p.bf16_arith) {
      const float s = detail::sum8_bf16_squares(x, p.dim, p.order.block, lane, mask);
      apply8(x, y, nullptr, common::rms_scale_bf16(s, p.dim, p.eps), lane, p.dim);
    } else {
      const float ss = detail::dot8(x, x, p.dim, p.order.block, lane, mask);
      apply8(x, y, p.w, common::rms_scale(ss, p.dim, p.eps), lane, p.dim);
    }
    __syncwarp(mask);
  }
}

}  // namespace

void rmsnorm(const RmsNormParams& p, cudaStream_t stream) {
  require(dsv4::rmsnorm_check(p), "rmsnorm");
  if (p.rows <= 0) return;
  rmsnorm_kernel<<<detail::grid_for(p.rows, kRowsPerBlock, 65535), kThreads, 0, stream>>>(p);
  DSV4_LAUNCH_CHECK();
}

}  // namespace dsv4::cuda
