// RMSNorm on the GPU in the operation order of kernels/norm.h.
//
// Kernel contract (rmsnorm_kernel): 256 threads per block, one aligned group of 8 threads per row
// (32 rows per block, grid-stride over rows). The group forms sum_squares(x) with dot8 (the exact
// canonical order), every lane then computes r = 1 / sqrt(ss / n + eps) and writes its elements
// i = lane (mod 8). In place (y == x) is safe: the row is fully read before the group's shuffles
// complete, and each lane reads x[i] right before writing y[i].
#include "kernels/cuda/common.cuh"
#include "kernels/detail/norm.h"

namespace dsv4::cuda {

namespace {

constexpr int kThreads = 256, kRowsPerBlock = kThreads / 8;

__global__ void __launch_bounds__(kThreads) rmsnorm_kernel(RmsNormParams p) {
  const int lane = threadIdx.x & 7;
  const unsigned mask = detail::group8_mask();
  for (int64_t row = int64_t(blockIdx.x) * kRowsPerBlock + threadIdx.x / 8; row < p.rows;
       row += int64_t(gridDim.x) * kRowsPerBlock) {
    const float* x = p.x + row * p.ldx;
    float* y = p.y + row * p.ldy;
    if (p.bf16_arith) {
      const float s = detail::sum8_bf16_squares(x, p.dim, p.order.block, lane, mask);
      common::rmsnorm_apply(x, y, nullptr, common::rms_scale_bf16(s, p.dim, p.eps), lane, p.dim, 8);
    } else {
      const float ss = detail::dot8(x, x, p.dim, p.order.block, lane, mask);
      common::rmsnorm_apply(x, y, p.w, common::rms_scale(ss, p.dim, p.eps), lane, p.dim, 8);
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
