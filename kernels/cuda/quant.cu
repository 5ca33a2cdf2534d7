// Block FP8 / FP4 simulation on the GPU in the operation order of kernels/quant.h.
//
// Kernel contract (all four kernels): one thread per (row, block), grid-stride. The thread forms the
// block's amax (a max of |x|: exact in any order, NaN skipped by the comparison, as on the CPU), the
// scale with the same fp32 operations as kernels/cpu/quant.cpp, then quantises its block. Blocks are
// disjoint, so threads never share data.
#include "kernels/cuda/common.cuh"

namespace dsv4::cuda {

namespace {

constexpr int kThreads = 256;

__device__ __forceinline__ float block_amax(const float* x, int n) {
  float m = 0.0f;
  for (int i = 0; i < n; ++i) {
    const float a = fabsf(x[i]);
    if (a > m) m = a;
  }
  return m;
}
__device__ __forceinline__ float fp8_scale(float amax, ScaleFmt fmt) {
  const float v = fmaxf(amax, 1e-4f) * (1.0f / 448.0f);
  return fmt == ScaleFmt::ue8m0 ? num::ceil_pow2(v) : v;
}
__device__ __forceinline__ float fp4_scale(float amax) {
  return num::ceil_pow2(fmaxf(amax, 6.0f * 0x1p-126f) * (1.0f / 6.0f));
}
__device__ __forceinline__ float clampf(float v, float lo, float hi) {
  return v < lo ? lo : (v > hi ? hi : v);
}

__global__ void __launch_bounds__(kThreads) act_quant_kernel(ActQuantParams p) {
  const int64_t nb = p.cols / p.block, total = p.rows * nb;
  for (int64_t e = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; e < total;
       e += int64_t(gridDim.x) * blockDim.x) {
    const int64_t r = e / nb, b = e % nb, off = r * p.cols + b * p.block;
    const float* x = p.x + off;
    uint8_t* q = p.q + off;
    const float s = fp8_scale(block_amax(x, p.block), p.fmt);
    for (int i = 0; i < p.block; ++i) q[i] = num::e4m3_bits(clampf(x[i] / s, -448.0f, 448.0f));
    p.scale[r * nb + b] = s;
  }
}

enum class SimKind { fp8, fp8_bf16_cast, fp4 };

template <SimKind kind>
__global__ void __launch_bounds__(kThreads) block_sim_kernel(Fp8SimParams p) {
  const int64_t nb = p.cols / p.block, total = p.rows * nb;
  for (int64_t e = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; e < total;
       e += int64_t(gridDim.x) * blockDim.x) {
    float* x = p.x + (e / nb) * p.ld + (e % nb) * p.block;
    const float amax = block_amax(x, p.block);
    if constexpr (kind == SimKind::fp4) {
      const float s = fp4_scale(amax);
      for (int i = 0; i < p.block; ++i) {
        const uint8_t q = num::e2m1_bits(clampf(x[i] / s, -6.0f, 6.0f));
        x[i] = num::bf16_round(num::e2m1_to_f32(q) * s);
      }
    } else {
      const float s = fp8_scale(amax, p.fmt);
      for (int i = 0; i < p.block; ++i) {
        if constexpr (kind == SimKind::fp8) {
          const uint8_t q = num::e4m3_bits(clampf(x[i] / s, -448.0f, 448.0f));
          x[i] = num::bf16_round(num::e4m3_to_f32(q) * s);
        } else {
          x[i] = num::bf16_round(num::bf16_round(clampf(x[i] / s, -448.0f, 448.0f)) * s);
        }
      }
    }
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
