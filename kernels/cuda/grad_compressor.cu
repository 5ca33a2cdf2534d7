// Backward of the compressor pooling on the GPU (kernels/grad.h CompressorPoolBwdParams), bit for bit
// the CPU reference kernels/cpu/grad_compressor.cpp, with the arithmetic of
// kernels/detail/grad_compressor.h.
//
// dkvp and dsc are zeroed (cudaMemsetAsync: +0.0f), then group_kernel runs one block of 256 threads
// per group g (grid-stride), the group's rows in shared memory:
//   1. thread c (c = tid, tid + 256, ...): x[c] = common::compressor_pool (the forward's bf16 pooled
//      value) and dy[c] = dout[g, c];
//   2. the inverse rotation of dy's last rd dims, the block's threads sharing the (disjoint) pairs of
//      common::compressor_bwd_unrotate;
//   3. the RMSNorm backward of common::compressor_bwd_norm split over the block: gw = dy * norm per
//      element; the two canonical dots sum_squares(x) and dot(gw, x) by two groups of 8 threads
//      (dot8); r and k formed from them (the CPU's expressions) by every thread; per element the dnorm
//      term (dy * x) * r (into a [G, d] scratch when dnorm is wanted) and dc = r * gw - k * x;
//   4. thread c: common::compressor_bwd_channel (the pooling backward of channel c, scattered to the
//      kvp / sc elements only this group reads: no two threads write one element).
// dnorm_kernel: one thread per i, dnorm[i] + (sequential sum over the groups in increasing order).
// dape_kernel: one thread per element (k, col), dape + common::compressor_bwd_ape (the same order over
// the groups, reading dsc back).
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/grad.h"
#include "kernels/detail/grad_compressor.h"

namespace dsv4::cuda {

namespace {

constexpr int kThreads = 256;
constexpr size_t kMaxShared = 200 * 1024;

// dwt: [G, d] the groups' dnorm terms, or nullptr.
__global__ void __launch_bounds__(kThreads)
    group_kernel(CompressorPoolBwdParams p, common::CompressorPool a, float* dwt) {
  extern __shared__ float sh[];
  const int64_t d = p.d;
  float* x = sh;       // [d] the pooled row (bf16 values)
  float* dy = x + d;   // [d] dout, then turned back
  float* gw = dy + d;  // [d] dy * norm
  __shared__ float sums[2];
  const int tid = threadIdx.x;

  for (int64_t g = blockIdx.x; g < p.G; g += gridDim.x) {
    const int64_t ga = p.g0 + g;
    // 1. the pooled row and dout
    for (int64_t c = tid; c < d; c += kThreads) {
      x[c] = common::compressor_pool(a, ga, c);
      dy[c] = p.dout[g * d + c];
    }
    __syncthreads();
    // 2. dout's rotated dims turned back
    common::compressor_bwd_unrotate(dy, d, p.rd, ga * p.ratio, p.freq, tid, kThreads);
    __syncthreads();
    // 3. RMSNorm backward
    for (int64_t i = tid; i < d; i += kThreads) gw[i] = dy[i] * p.norm[i];
    __syncthreads();
    if (tid < 16) {  // group 0: sum_squares(x); group 1: dot(gw, x)
      const int grp = tid >> 3;
      const float s = detail::dot8(grp == 0 ? x : gw, x, d, p.order.block, tid & 7, detail::group8_mask());
      if ((tid & 7) == 0) sums[grp] = s;
    }
    __syncthreads();
    const float r = common::rms_scale(sums[0], d, p.rms_eps);
    const float k = (((r * r) * r) / float(d)) * sums[1];
    // 4. per channel: the dnorm term, dc, the pooling backward
    for (int64_t c = tid; c < d; c += kThreads) {
      if (dwt) dwt[g * d + c] = (dy[c] * x[c]) * r;
      const float dc = r * gw[c] - k * x[c];
      common::compressor_bwd_channel(a, ga, c, dc, p.dkvp, p.dsc);
    }
    __syncthreads();
  }
}

__global__ void dnorm_kernel(const float* dwt, int64_t G, int64_t d, float* dnorm) {
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < d;
       i += int64_t(gridDim.x) * blockDim.x) {
    float S = 0.0f;
    for (int64_t g = 0; g < G; ++g) S = S + dwt[g * d + i];
    dnorm[i] = dnorm[i] + S;
  }
}

__global__ void dape_kernel(common::CompressorPool a, int64_t g0, int64_t G, const float* dsc, float* dape) {
  const int64_t total = int64_t(a.r) * a.cw;
  for (int64_t e = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; e < total;
       e += int64_t(gridDim.x) * blockDim.x)
    dape[e] = dape[e] + common::compressor_bwd_ape(a, g0, G, int(e / a.cw), e % a.cw, dsc);
}

const char* check(const CompressorPoolBwdParams& p) {
  if (const char* why = common::compressor_pool_backward_check_params(p)) return why;
  if (size_t(p.d) * 3 * sizeof(float) > kMaxShared)
    return "compressor_pool_backward: d too large for one block";
  return nullptr;
}

}  // namespace

void compressor_pool_backward(const CompressorPoolBwdParams& p, cudaStream_t stream) {
  require(check(p), "compressor_pool_backward");
  const int64_t d = p.d, G = p.G, cw = common::compressor_row_width(p.ratio, d);
  if (p.rows > 0) {
    CUDA_CHECK(cudaMemsetAsync(p.dkvp, 0, size_t(p.rows * cw) * sizeof(float), stream));
    CUDA_CHECK(cudaMemsetAsync(p.dsc, 0, size_t(p.rows * cw) * sizeof(float), stream));
  }
  if (G == 0) return;
  const common::CompressorPool a = common::compressor_pool_backward_shape(p);
  detail::Scratch<float> dwt(p.dnorm ? G * d : 0, stream);

  const size_t shmem = 3 * sizeof(float) * size_t(d);
  CUDA_CHECK(cudaFuncSetAttribute(group_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(shmem)));
  group_kernel<<<detail::grid_for(G, 1, 65535), kThreads, shmem, stream>>>(p, a, dwt.get());
  DSV4_LAUNCH_CHECK();

  if (p.dnorm) {
    dnorm_kernel<<<detail::grid_for(d, 256), 256, 0, stream>>>(dwt.get(), G, d, p.dnorm);
    DSV4_LAUNCH_CHECK();
  }
  if (p.dape) {
    dape_kernel<<<detail::grid_for(p.ratio * cw, 256), 256, 0, stream>>>(a, p.g0, G, p.dsc, p.dape);
    DSV4_LAUNCH_CHECK();
  }
}

}  // namespace dsv4::cuda
