// RMSNorm on the GPU in the operation order of kernels/norm.h.
//
// Two kernels; which one runs never changes a bit (both form sum_squares with dot8, the exact
// canonical order, and apply common::rmsnorm_value to each element):
//
// rmsnorm_kernel (rows shorter than kStagedMinDim, or too long for shared memory): 256 threads per
// block, one aligned group of 8 threads per row (32 rows per block, grid-stride over rows). The group
// forms sum_squares(x) with dot8, every lane then computes r = 1 / sqrt(ss / n + eps) and writes its
// elements i = lane (mod 8). In place (y == x) is safe: the row is fully read before the group's
// shuffles complete, and each lane reads x[i] before writing y[i] (apply8).
//
// rmsnorm_staged_kernel (model-width rows): 128 threads per block, one row per block at a time
// (grid-stride over rows). All 128 threads copy the row into shared memory with coalesced loads
// (8 in flight per thread), one group of 8 threads forms the sum of squares from shared memory with
// dot8 (the 8-lane chain is serial and cannot be split further), and all 128 threads then write y
// from shared memory. The row is read from global memory once (the 8-thread kernel reads it twice:
// the chain, then the apply, and a model-width row no longer sits in L1 for the second read), and
// the serial chain of one block overlaps the copies of the other blocks on the multiprocessor (up to
// 13 blocks of a 4096-wide row each). In place is safe: a row is read completely before the barrier
// that precedes its stores, and only its own block touches it. Asked for y's block sums
// (kernels/row_sums.h), its warps write y in chunks of 512 values, lane l the 4 values at
// 4 (l + 32 i), i < 4, and form each chunk's sums; the other kernel's rows get them from
// cuda::row_sums_bf16 afterwards.

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/xxh3_sums.cuh"
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

// ---- the staged kernel: one row per block, read once into shared memory ---------------------------
constexpr int kStagedThreads = 128;
constexpr int kStagedBatch = 8;            // loads in flight per thread while a row is copied
constexpr int64_t kStagedMinDim = 1024;    // shorter rows keep rmsnorm_kernel (they stay in L1 there)
constexpr int64_t kStagedMaxBytes = 96 << 10;  // shared memory per block: at least 2 blocks per SM

// The staged kernel's stores with y's block sums (n % 512 == 0): warp v writes chunks v, v + 4, ... of
// 512 values and forms their sums into sums[chunk * 8 ..].
__device__ void write_with_sums(const float* staged, float* y, int64_t n, float rs, const float* w,
                                uint64_t* sums, int tid) {
  constexpr int kW = sums::kWordsPerLane;
  const int lane = tid & 31;
  const int64_t chunks = n / xxh3::kSumRowValues;
  const bool vec = (reinterpret_cast<uintptr_t>(y) & 15) == 0;
  for (int64_t c = tid / 32; c < chunks; c += kStagedThreads / 32) {
    uint64_t words[kW];
#pragma unroll
    for (int i = 0; i < kW; ++i) {
      const int64_t q = c * 128 + lane + 32 * i, j = 4 * q;
      const float4 v = reinterpret_cast<const float4*>(staged)[q];
      const float4 o =
          make_float4(common::rmsnorm_value(v.x, rs, w, j), common::rmsnorm_value(v.y, rs, w, j + 1),
                      common::rmsnorm_value(v.z, rs, w, j + 2), common::rmsnorm_value(v.w, rs, w, j + 3));
      if (vec)
        reinterpret_cast<float4*>(y)[q] = o;
      else
        y[j] = o.x, y[j + 1] = o.y, y[j + 2] = o.z, y[j + 3] = o.w;
      words[i] = sums::bf16_word(o);
    }
    sums::warp_block_sums(words, c == chunks - 1, lane, sums + c * 8);
  }
}

__global__ void __launch_bounds__(kStagedThreads) rmsnorm_staged_kernel(RmsNormParams p) {
  extern __shared__ float staged_row[];  // [dim]
  __shared__ float scale;
  const int tid = threadIdx.x;
  const int64_t n = p.dim;
  for (int64_t row = blockIdx.x; row < p.rows; row += gridDim.x) {
    const float* x = p.x + row * p.ldx;
    float* y = p.y + row * p.ldy;
    // Copy: batches of kStagedBatch coalesced loads issued before their shared-memory stores.
    int64_t i = tid;
    for (; i + (kStagedBatch - 1) * kStagedThreads < n; i += kStagedBatch * kStagedThreads) {
      float v[kStagedBatch];
#pragma unroll
      for (int k = 0; k < kStagedBatch; ++k) v[k] = x[i + k * kStagedThreads];
#pragma unroll
      for (int k = 0; k < kStagedBatch; ++k) staged_row[i + k * kStagedThreads] = v[k];
    }
    for (; i < n; i += kStagedThreads) staged_row[i] = x[i];
    __syncthreads();
    // The chain: threads 0..7, lane = thread (dot8's split and combine, from shared memory).
    if (tid < 8) {
      const unsigned mask = 0xffu;
      const float r = p.bf16_arith
                          ? common::rms_scale_bf16(
                                detail::sum8_bf16_squares(staged_row, n, p.order.block, tid, mask), n, p.eps)
                          : common::rms_scale(detail::dot8(staged_row, staged_row, n, p.order.block, tid, mask),
                                              n, p.eps);
      if (tid == 0) scale = r;
    }
    __syncthreads();
    const float rs = scale;
    const float* w = p.bf16_arith ? nullptr : p.w;
    if (p.y_sums)
      write_with_sums(staged_row, y, n, rs, w, p.y_sums + row * (n / xxh3::kSumRowValues) * 8, tid);
    else
      for (int64_t j = tid; j < n; j += kStagedThreads) y[j] = common::rmsnorm_value(staged_row[j], rs, w, j);
    __syncthreads();  // the next row overwrites staged_row and scale
  }
}

// Shared memory of the staged kernel for rows of n elements, or 0 when it does not take them.
int64_t staged_bytes(int64_t n) {
  const int64_t bytes = n * int64_t(sizeof(float));
  return (n >= kStagedMinDim && bytes <= kStagedMaxBytes) ? bytes : 0;
}

// Sets the staged kernel's dynamic shared memory limit (above the default 48 KiB) and prefers
// shared memory over L1 for it.
void prepare_staged() {
  CUDA_CHECK(cudaFuncSetAttribute(rmsnorm_staged_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                  int(kStagedMaxBytes)));
  CUDA_CHECK(cudaFuncSetAttribute(rmsnorm_staged_kernel, cudaFuncAttributePreferredSharedMemoryCarveout,
                                  int(cudaSharedmemCarveoutMaxShared)));
}

}  // namespace

void rmsnorm(const RmsNormParams& p, cudaStream_t stream) {
  require(dsv4::rmsnorm_check(p), "rmsnorm");
  if (p.rows <= 0) return;
  if (const int64_t smem = staged_bytes(p.dim)) {
    prepare_staged();
    rmsnorm_staged_kernel<<<detail::grid_for(p.rows, 1, 1 << 20), kStagedThreads, size_t(smem), stream>>>(p);
    DSV4_LAUNCH_CHECK();
    return;
  }
  rmsnorm_kernel<<<detail::grid_for(p.rows, kRowsPerBlock, 65535), kThreads, 0, stream>>>(p);
  DSV4_LAUNCH_CHECK();
  if (p.y_sums) row_sums_bf16(p.y, p.rows, p.dim, p.ldy, p.y_sums, stream);
}

}  // namespace dsv4::cuda
