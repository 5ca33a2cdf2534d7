// KV compressor and Walsh-Hadamard rotation on the GPU in the operation order of
// kernels/compressor.h.
//
// compressor(): kvp = x . wkv^T and sc = x . wgate^T as two fp32 GEMMs over the G * ratio complete
// rows (as on the CPU); pool_kernel then runs one thread per (group g, channel c) with the CPU's
// common::compressor_pool (slot scores sc + ape[slot], their max, the exp_f terms and their sum in
// slot order, the weighted sum as an fma chain in slot order). Then the RMSNorm, RoPE (position
// g * ratio) and Hadamard kernels run on the G output rows in place. compressor_pool() is that second
// half on projections kept by a decoding engine (absolute groups g0 .. g0 + G - 1).
//
// hadamard_kernel: one block per row, the row in shared memory; each butterfly stage h pairs
// (j, j + h) disjointly, the block's threads sharing the pairs of common::hadamard_stage, with a
// barrier between stages, so every value sees exactly the CPU's sequence of additions; then
// v = bf16(v * (1 / sqrt(n))).
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/grad.h"
#include "kernels/detail/compressor.h"

namespace dsv4::cuda {

namespace {

constexpr int kThreads = 256;

// One thread per (group g0 + g, channel c) of out [G, d].
__global__ void __launch_bounds__(kThreads)
    pool_kernel(common::CompressorPool a, int64_t g0, int64_t G, float* out) {
  const int64_t total = G * a.d;
  for (int64_t e = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; e < total;
       e += int64_t(gridDim.x) * blockDim.x)
    out[e] = common::compressor_pool(a, g0 + e / a.d, e % a.d);
}

// Grid: one block per row (grid-stride); dynamic shared memory n floats. kRound: the forward's bf16
// output (hadamard_out); else the gradient's fp32 v * scale (hadamard_backward).
template <bool kRound>
__global__ void __launch_bounds__(kThreads)
    hadamard_kernel(float* x, int64_t rows, int64_t n, int64_t ld, float scale) {
  extern __shared__ float v[];
  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    float* xr = x + row * ld;
    for (int64_t i = threadIdx.x; i < n; i += blockDim.x) v[i] = xr[i];
    __syncthreads();
    for (int64_t h = 1; h < n; h *= 2) {
      common::hadamard_stage(v, n, h, threadIdx.x, blockDim.x);
      __syncthreads();
    }
    for (int64_t i = threadIdx.x; i < n; i += blockDim.x)
      xr[i] = kRound ? common::hadamard_out(v[i], scale) : v[i] * scale;
    __syncthreads();
  }
}

bool is_pow2(int64_t n) {
  return n > 0 && (n & (n - 1)) == 0;
}

}  // namespace

namespace {
template <bool kRound>
void hadamard_rows(float* x, int64_t rows, int64_t n, int64_t ld, cudaStream_t stream, const char* op) {
  if (rows < 0) require("rows", op);
  if (!is_pow2(n)) require("n must be a power of two", op);
  if (ld < n) require("ld < n", op);
  if (rows == 0) return;
  if (!x) require("x", op);
  if (n > 12 * 1024) require("n is too large for one block", op);
  const float scale = common::hadamard_scale(n);
  hadamard_kernel<kRound><<<detail::grid_for(rows, 1, 65535), kThreads, size_t(n) * sizeof(float), stream>>>(
      x, rows, n, ld, scale);
  DSV4_LAUNCH_CHECK();
}
}  // namespace

void hadamard(float* x, int64_t rows, int64_t n, int64_t ld, cudaStream_t stream) {
  hadamard_rows<true>(x, rows, n, ld, stream, "hadamard");
}

void hadamard_backward(float* x, int64_t rows, int64_t n, int64_t ld, cudaStream_t stream) {
  hadamard_rows<false>(x, rows, n, ld, stream, "hadamard_backward");
}

void compressor(const CompressorParams& p, cudaStream_t stream) {
  require(dsv4::compressor_check(p), "compressor");
  const int64_t G = compressor_groups(p.T, p.ratio);
  if (G == 0) return;
  const int64_t cw = common::compressor_row_width(p.ratio, p.d), rows = G * p.ratio;

  detail::Scratch<float> kvp(rows * cw, stream), sc(rows * cw, stream);
  gemm(linear_params(rows, cw, p.D, p.x, p.wkv, kvp.get(), OutRound::f32, p.order), stream);
  gemm(linear_params(rows, cw, p.D, p.x, p.wgate, sc.get(), OutRound::f32, p.order), stream);
  compressor_pool(common::compressor_pool_params(p, kvp.get(), sc.get()), stream);
}

void compressor_pool(const CompressorPoolParams& p, cudaStream_t stream) {
  require(dsv4::compressor_pool_check(p), "compressor_pool");
  if (p.G == 0) return;
  const common::CompressorPool a = common::compressor_pool_shape(p);
  pool_kernel<<<detail::grid_for(p.G * p.d, kThreads), kThreads, 0, stream>>>(a, p.g0, p.G, p.out);
  DSV4_LAUNCH_CHECK();

  rmsnorm(common::compressor_norm_params(p, p.G), stream);
  // pos == nullptr: row g at position (g0 + g) * ratio
  detail::rope_rows(common::compressor_rope_params(p, p.G, nullptr), p.ratio, stream, p.g0 * p.ratio);

  if (p.hadamard) hadamard(p.out, p.G, p.d, p.d, stream);
}

}  // namespace dsv4::cuda
