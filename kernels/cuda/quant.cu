// Block FP8 / FP4 simulation on the GPU in the operation order of kernels/quant.h.
//
// Kernel contract (all four kernels): one thread per (row, block), grid-stride. The thread runs the
// block function of kernels/detail/quant.h that the CPU runs (amax, scale, quantisation). Blocks are
// disjoint, so threads never share data.
#include "kernels/cuda/common.cuh"
#include "kernels/detail/quant.h"

namespace dsv4::cuda {

namespace {

constexpr int kThreads = 256;

__global__ void __launch_bounds__(kThreads) act_quant_kernel(ActQuantParams p) {
  const int64_t nb = p.cols / p.block, total = p.rows * nb;
  for (int64_t e = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; e < total;
       e += int64_t(gridDim.x) * blockDim.x) {
    const int64_t r = e / nb, b = e % nb, off = r * p.cols + b * p.block;
    p.scale[r * nb + b] = common::act_quant_block(p.x + off, p.block, p.fmt, p.q + off);
  }
}

enum class SimKind { fp8, fp8_bf16_cast, fp4 };

template <SimKind kind>
__global__ void __launch_bounds__(kThreads) block_sim_kernel(Fp8SimParams p) {
  const int64_t nb = p.cols / p.block, total = p.rows * nb;
  for (int64_t e = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; e < total;
       e += int64_t(gridDim.x) * blockDim.x) {
    float* x = p.x + (e / nb) * p.ld + (e % nb) * p.block;
    if constexpr (kind == SimKind::fp4)
      common::fp4_sim_block(x, p.block);
    else if constexpr (kind == SimKind::fp8)
      common::fp8_sim_block(x, p.block, p.fmt);
    else
      common::fp8_bf16_cast_block(x, p.block, p.fmt);
  }
}

template <SimKind kind>
void launch_sim(const Fp8SimParams& p, cudaStream_t stream, const char* op) {
  require(dsv4::fp8_sim_check(p), op);
  if (p.rows <= 0 || p.cols <= 0) return;
  block_sim_kernel<kind><<<detail::grid_for(p.rows * (p.cols / p.block), kThreads), kThreads, 0, stream>>>(p);
  DSV4_LAUNCH_CHECK();
}

}  // namespace

void act_quant(const ActQuantParams& p, cudaStream_t stream) {
  require(dsv4::act_quant_check(p), "act_quant");
  if (p.rows <= 0 || p.cols <= 0) return;
  act_quant_kernel<<<detail::grid_for(p.rows * (p.cols / p.block), kThreads), kThreads, 0, stream>>>(p);
  DSV4_LAUNCH_CHECK();
}

void fp8_sim(const Fp8SimParams& p, cudaStream_t stream) {
  launch_sim<SimKind::fp8>(p, stream, "fp8_sim");
}
void fp8_sim_inplace_bf16_cast(const Fp8SimParams& p, cudaStream_t stream) {
  launch_sim<SimKind::fp8_bf16_cast>(p, stream, "fp8_sim_inplace_bf16_cast");
}
void fp4_sim(const Fp8SimParams& p, cudaStream_t stream) {
  launch_sim<SimKind::fp4>(p, stream, "fp4_sim");
}

}  // namespace dsv4::cuda
