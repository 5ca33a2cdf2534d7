// RoPE / YaRN on the GPU in the operation order of kernels/rope.h. The frequency table comes from
// dsv4::rope_freqs on the host (one source of truth), uploaded by the caller.
//
// Kernel contract (rope_kernel): one thread per (row t, pair i), grid-stride. The thread forms the
// angle fp32(pos) * freq[i] and its cos_f / sin_f (kernels/numerics: the same bits as the CPU),
// then rotates pair i of every head of row t. Pairs are disjoint, so threads never share data.
#include "kernels/cuda/common.cuh"
#include "kernels/detail/rope.h"

namespace dsv4::cuda {

namespace {

constexpr int kThreads = 256;

__global__ void __launch_bounds__(kThreads)
    rope_kernel(RopeApplyParams p, int64_t pos_step, int64_t pos_base) {
  const int half = p.rd / 2;
  const int64_t total = p.rows * half;
  for (int64_t e = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; e < total;
       e += int64_t(gridDim.x) * blockDim.x) {
    const int64_t t = e / half;
    const int i = int(e % half);
    float c, s;
    common::rope_cos_sin(p.pos ? p.pos[t] : pos_base + t * pos_step, p.freq[i], c, s);
    for (int h = 0; h < p.heads; ++h)
      common::rope_rotate(p.x + t * p.ld + h * p.head_stride + p.offset + 2 * i, c, s, p.inverse,
                          p.round_bf16);
  }
}

}  // namespace

namespace detail {
void rope_rows(const RopeApplyParams& p, int64_t pos_step, cudaStream_t stream, int64_t pos_base) {
  if (p.rows <= 0) return;
  rope_kernel<<<grid_for(p.rows * (p.rd / 2), kThreads), kThreads, 0, stream>>>(p, pos_step, pos_base);
  DSV4_LAUNCH_CHECK();
}
}  // namespace detail

void rope_apply(const RopeApplyParams& p, cudaStream_t stream) {
  require(dsv4::rope_apply_check(p), "rope_apply");
  detail::rope_rows(p, 0, stream);
}

}  // namespace dsv4::cuda
