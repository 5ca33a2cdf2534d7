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
// hadamard_warp_kernel (rows of 32 .. 1024): a warp per row, in registers and shuffles.
// hadamard_kernel (other lengths): a row in shared memory per min(256, n / 2) threads (several rows
// per block when they are short); each butterfly stage h pairs (j, j + h) disjointly, a row's threads sharing the
// pairs of common::hadamard_stage, with a barrier between stages, so every value sees exactly the
// CPU's sequence of additions; then v = bf16(v * (1 / sqrt(n))).
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

// Grid-stride over groups of `per_block` rows (a group per block at a time); dynamic shared memory
// per_block * n floats. Each row has threads_per_row = min(blockDim, n / 2) threads, so short rows
// (the indexer's 128) share a block instead of leaving most of it idle. kRound: the forward's bf16
// output (hadamard_out); else the gradient's fp32 v * scale (hadamard_backward).
template <bool kRound>
__global__ void __launch_bounds__(kThreads)
    hadamard_kernel(float* x, int64_t rows, int64_t n, int64_t ld, float scale, int per_block) {
  extern __shared__ float sh[];
  const int threads_per_row = int(blockDim.x) / per_block;
  const int sub = int(threadIdx.x) / threads_per_row, lane = int(threadIdx.x) % threads_per_row;
  float* v = sh + int64_t(sub) * n;
  for (int64_t first = int64_t(blockIdx.x) * per_block; first < rows; first += int64_t(gridDim.x) * per_block) {
    const int64_t row = first + sub;
    const bool mine = sub < per_block && row < rows;  // barriers below are reached by every thread
    float* xr = x + row * ld;
    if (mine)
      for (int64_t i = lane; i < n; i += threads_per_row) v[i] = xr[i];
    __syncthreads();
    for (int64_t h = 1; h < n; h *= 2) {
      if (mine) common::hadamard_stage(v, n, h, lane, threads_per_row);
      __syncthreads();
    }
    if (mine)
      for (int64_t i = lane; i < n; i += threads_per_row)
        xr[i] = kRound ? common::hadamard_out(v[i], scale) : v[i] * scale;
    __syncthreads();
  }
}

// Rows of 32 K elements (K = 1 .. 32): one warp per row, lane l holding v[32 k + l] in registers. A
// butterfly stage h pairs the same (j, j + h) as common::hadamard_stage and forms the same a + b and
// a - b (a = v[j], b = v[j + h]): for h < 32 the partner is the lane l ^ h (a shuffle), for h >= 32
// the register k + h / 32 of the same lane. No shared memory and no barriers.
template <int K, bool kRound>
__global__ void __launch_bounds__(kThreads) hadamard_warp_kernel(float* x, int64_t rows, int64_t ld, float scale) {
  const int lane = int(threadIdx.x) & 31;
  const int64_t warps = int64_t(gridDim.x) * (kThreads / 32);
  for (int64_t row = int64_t(blockIdx.x) * (kThreads / 32) + threadIdx.x / 32; row < rows; row += warps) {
    float* xr = x + row * ld;
    float v[K];
#pragma unroll
    for (int k = 0; k < K; ++k) v[k] = xr[32 * k + lane];
#pragma unroll
    for (int h = 1; h < 32 && h < 32 * K; h *= 2) {
#pragma unroll
      for (int k = 0; k < K; ++k) {
        const float other = __shfl_xor_sync(0xffffffffu, v[k], h);
        v[k] = (lane & h) == 0 ? v[k] + other : other - v[k];
      }
    }
#pragma unroll
    for (int hk = 1; hk < K; hk *= 2) {
#pragma unroll
      for (int k = 0; k < K; ++k) {
        if ((k & hk) != 0) continue;
        const float a = v[k], b = v[k + hk];
        v[k] = a + b;
        v[k + hk] = a - b;
      }
    }
#pragma unroll
    for (int k = 0; k < K; ++k) xr[32 * k + lane] = kRound ? common::hadamard_out(v[k], scale) : v[k] * scale;
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
  const unsigned warp_grid = detail::grid_for(rows, kThreads / 32, 65535);
  switch (n) {  // rows of 32 .. 1024 elements: a warp each, in registers
    case 32: hadamard_warp_kernel<1, kRound><<<warp_grid, kThreads, 0, stream>>>(x, rows, ld, scale); break;
    case 64: hadamard_warp_kernel<2, kRound><<<warp_grid, kThreads, 0, stream>>>(x, rows, ld, scale); break;
    case 128: hadamard_warp_kernel<4, kRound><<<warp_grid, kThreads, 0, stream>>>(x, rows, ld, scale); break;
    case 256: hadamard_warp_kernel<8, kRound><<<warp_grid, kThreads, 0, stream>>>(x, rows, ld, scale); break;
    case 512: hadamard_warp_kernel<16, kRound><<<warp_grid, kThreads, 0, stream>>>(x, rows, ld, scale); break;
    case 1024: hadamard_warp_kernel<32, kRound><<<warp_grid, kThreads, 0, stream>>>(x, rows, ld, scale); break;
    default: break;
  }
  if (n >= 32 && n <= 1024) {
    DSV4_LAUNCH_CHECK();
    return;
  }
  const int per_block = n / 2 >= kThreads ? 1 : int(kThreads / (n / 2 > 0 ? n / 2 : 1));
  hadamard_kernel<kRound><<<detail::grid_for(rows, per_block, 65535), kThreads,
                            size_t(per_block) * size_t(n) * sizeof(float), stream>>>(x, rows, n, ld, scale,
                                                                                    per_block);
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
