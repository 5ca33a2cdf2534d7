// Device-side building blocks shared by the CUDA kernels, and the internal host entry points that one
// op uses to launch another's kernel (the compressor runs the GEMM, RMSNorm and RoPE kernels, the
// MoE runs grouped GEMMs). Included by .cu files only.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/cuda/check.h"
#include "kernels/cuda/ops.h"
#include "kernels/numerics/numerics.h"
#include "kernels/reduce.h"

namespace dsv4::cuda::detail {

// ---- launch helpers -----------------------------------------------------------------------------
inline int64_t ceil_div(int64_t a, int64_t b) {
  return (a + b - 1) / b;
}
// Grid size for a grid-stride loop over n items with `threads` per block.
inline unsigned grid_for(int64_t n, int threads, int64_t cap = int64_t(1) << 20) {
  const int64_t g = ceil_div(n, threads);
  return unsigned(g < 1 ? 1 : (g > cap ? cap : g));
}
#define DSV4_LAUNCH_CHECK() CUDA_CHECK(cudaGetLastError())

// Scratch memory from the stream-ordered allocator, released (stream-ordered) when it goes out of scope.
template <typename T>
class Scratch {
 public:
  Scratch(int64_t n, cudaStream_t s) : s_(s) {
    if (n > 0) CUDA_CHECK(cudaMallocAsync(reinterpret_cast<void**>(&p_), size_t(n) * sizeof(T), s));
  }
  ~Scratch() {
    if (p_) cudaFreeAsync(p_, s_);
  }
  Scratch(const Scratch&) = delete;
  Scratch& operator=(const Scratch&) = delete;
  T* get() const { return p_; }

 private:
  T* p_ = nullptr;
  cudaStream_t s_;
};

// The chain length of the canonical order for a reduction over n elements (kernels/reduce.h): the
// block length when the order is blocked and n exceeds it, else n (one chain).
__host__ __device__ inline int64_t chain_length(int64_t n, ReduceOrder o) {
  return (o.block > 0 && n > o.block) ? int64_t(o.block) : (n > 0 ? n : 1);
}

// ---- the canonical dot product, split over an aligned group of 8 threads --------------------------
// Lane l (= thread index % 8) owns accumulator l of dsv4::dot: within each chain it accumulates the
// elements i with (i - chain start) % 8 == l, in increasing i, with an explicit fma. The lanes are
// combined with xor-shuffles over distances 4, 2, 1, which forms ((l0 + l4) + (l2 + l6)) +
// ((l1 + l5) + (l3 + l7)) in every lane (IEEE addition is commutative); the chain results are added
// left to right. The result equals dot(a, b, n, o) bit for bit and is returned in all 8 lanes.
// `mask` names the 8 threads of the group (group8_mask); all of them must make the call.
__device__ __forceinline__ unsigned group8_mask() {
  return 0xffu << (threadIdx.x & 24u);
}
__device__ __forceinline__ float combine8(float acc, unsigned mask) {
  const float v = acc + __shfl_xor_sync(mask, acc, 4);
  const float t = v + __shfl_xor_sync(mask, v, 2);
  return t + __shfl_xor_sync(mask, t, 1);
}
// The lane split, chains and combine of the canonical order, with the per-element step
// acc = step(i, acc) (dot8: an fma of a[i] * b[i]).
template <typename Step>
__device__ __forceinline__ float chain8(int64_t n, int block, int lane, unsigned mask, Step step) {
  const int64_t len = (block > 0 && n > block) ? int64_t(block) : n;
  float s = 0.0f;
  for (int64_t cs = 0; cs < n; cs += len) {
    const int64_t ce = cs + len < n ? cs + len : n;
    float acc = 0.0f;
    // Unrolled so that several loads are in flight ahead of the chain (the loads do not depend on
    // acc); the fma order is the loop's.
#pragma unroll 8
    for (int64_t i = cs + lane; i < ce; i += 8) acc = step(i, acc);
    const float c = combine8(acc, mask);
    s = cs == 0 ? c : s + c;
  }
  return s;
}
__device__ __forceinline__ float dot8(const float* a, const float* b, int64_t n, int block, int lane,
                                      unsigned mask) {
  return chain8(n, block, lane, mask, [=](int64_t i, float acc) { return __fmaf_rn(a[i], b[i], acc); });
}

// The canonical sum of bf16(a[i]^2) (dot of those values with ones: fma(v, 1, acc) is acc + v), with
// dot8's lane split and combine; RMSNorm in bf16 arithmetic (kernels/norm.h).
__device__ __forceinline__ float sum8_bf16_squares(const float* a, int64_t n, int block, int lane,
                                                   unsigned mask) {
  return chain8(n, block, lane, mask,
                [=](int64_t i, float acc) { return __fadd_rn(acc, num::bf16_round(__fmul_rn(a[i], a[i]))); });
}

// dot(a + h * lda, b[j], n, order) for the rows h < na (na <= NH) of `a` against nb <= NB vectors
// b[j], by an aligned group of 8 threads: the same lane split and combine as dot8 for every pair, but
// each element of a vector is loaded once for all rows and each element of a row once for all vectors
// (the rows typically sit in shared memory). out[h * NB + j] is valid in all 8 lanes for h < na,
// j < nb; na and nb must be the same in the group's 8 threads.
template <int NH, int NB>
__device__ __forceinline__ void multi_dot8_rows(const float* a, int64_t lda, int na, const float* const* b,
                                                int nb, int64_t n, int block, int lane, unsigned mask,
                                                float* out) {
  const int64_t len = (block > 0 && n > block) ? int64_t(block) : n;
  float sum[NH][NB];
#pragma unroll
  for (int h = 0; h < NH; ++h)
#pragma unroll
    for (int j = 0; j < NB; ++j) sum[h][j] = 0.0f;
  for (int64_t cs = 0; cs < n; cs += len) {
    const int64_t ce = cs + len < n ? cs + len : n;
    float acc[NH][NB];
#pragma unroll
    for (int h = 0; h < NH; ++h)
#pragma unroll
      for (int j = 0; j < NB; ++j) acc[h][j] = 0.0f;
#pragma unroll 2
    for (int64_t i = cs + lane; i < ce; i += 8) {
      float bv[NB];
#pragma unroll
      for (int j = 0; j < NB; ++j) bv[j] = j < nb ? b[j][i] : 0.0f;
#pragma unroll
      for (int h = 0; h < NH; ++h) {
        if (h < na) {  // a[h * lda + i] is loaded once for the NB fmas (on their line for the kernel audit)
#pragma unroll
          for (int j = 0; j < NB; ++j)
            if (j < nb) acc[h][j] = __fmaf_rn(a[h * lda + i], bv[j], acc[h][j]);
        }
      }
    }
#pragma unroll
    for (int h = 0; h < NH; ++h)
#pragma unroll
      for (int j = 0; j < NB; ++j)
        if (h < na && j < nb) {  // uniform over the group
          const float c = combine8(acc[h][j], mask);
          sum[h][j] = cs == 0 ? c : sum[h][j] + c;
        }
  }
#pragma unroll
  for (int h = 0; h < NH; ++h)
#pragma unroll
    for (int j = 0; j < NB; ++j) out[h * NB + j] = sum[h][j];
}
// The same against one vector b: out[h] for h < na.
template <int NH>
__device__ __forceinline__ void multi_dot8(const float* a, int64_t lda, int na, const float* b, int64_t n,
                                           int block, int lane, unsigned mask, float* out) {
  multi_dot8_rows<NH, 1>(a, lda, na, &b, 1, n, block, lane, mask, out);
}

// ---- block-wide integer reductions and scans (deterministic, no atomics) ---------------------------
// All threads of the block must call them; `red` is shared scratch of at least 32 entries.
template <typename T>
__device__ __forceinline__ T warp_sum(T v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
template <typename T>
__device__ T block_sum(T v, T* red) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = (blockDim.x + 31) >> 5;
  v = warp_sum(v);
  __syncthreads();
  if (lane == 0) red[warp] = v;
  __syncthreads();
  T s = 0;
  for (int i = 0; i < nw; ++i) s += red[i];
  return s;
}
// Exclusive prefix sum over the threads of the block in thread order; *total gets the block sum.
template <typename T>
__device__ T block_exclusive_scan(T v, T* red, T* total) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = (blockDim.x + 31) >> 5;
  T inc = v;
  for (int o = 1; o < 32; o <<= 1) {
    const T u = __shfl_up_sync(0xffffffffu, inc, o);
    if (lane >= o) inc += u;
  }
  __syncthreads();
  if (lane == 31 || threadIdx.x == blockDim.x - 1) red[warp] = inc;
  __syncthreads();
  T before = 0, all = 0;
  for (int i = 0; i < nw; ++i) {
    if (i < warp) before += red[i];
    all += red[i];
  }
  *total = all;
  return before + inc - v;
}

// The valid slots of an attention row idx [K] (not -1 and inside [0, N): nothing else is ever
// loaded) compacted in slot order into slots, by the Threads threads of the block: contiguous chunks
// of slots per thread, placed by a block prefix sum. Returns their count nv (the same in every
// thread), after a barrier.
template <int Threads>
__device__ int compact_valid_slots(const int32_t* idx, int64_t K, int64_t N, int tid, int32_t* slots, int* red) {
  const int64_t chunk = (K + Threads - 1) / Threads, lo = tid * chunk, hi = lo + chunk < K ? lo + chunk : K;
  int mine = 0;
  for (int64_t j = lo; j < hi; ++j) mine += idx[j] >= 0 && idx[j] < N;
  int nv = 0;
  int pos = block_exclusive_scan(mine, red, &nv);
  for (int64_t j = lo; j < hi; ++j)
    if (idx[j] >= 0 && idx[j] < N) slots[pos++] = idx[j];
  __syncthreads();
  return nv;
}

// ---- internal launchers (defined in the op's .cu file) ----------------------------------------------

// One GEMM of a group: y[yrow(r)] = round(x[xrow(r)] . w^T) for r < m; row maps are optional device
// arrays (gather of x rows, scatter of y rows).
struct GemmProblem {
  const float* x = nullptr;
  int64_t ldx = 0;
  const int32_t* xrow = nullptr;
  const float* w = nullptr;
  int64_t ldw = 0;
  float* y = nullptr;
  int64_t ldy = 0;
  const int32_t* yrow = nullptr;
  int64_t m = 0;
  // The tensor_core order only: x already as the GEMM's bf16 copy, rows of gemm_bf16_width(k) values
  // (row r at x16 + r * width, zeros past k; kernels/cuda/mma.cuh); x, ldx and xrow are then unused.
  const __nv_bfloat16* x16 = nullptr;
};
struct GemmShape {
  int64_t n = 0, k = 0;
  OutRound round = OutRound::bf16;
  ReduceOrder order{};
};
// Launches `count` problems of one shape; `problems` is a host array (copied to the device when
// count > 1). Problems with m == 0 are allowed.
void gemm_group(const GemmShape& s, const GemmProblem* problems, int count, cudaStream_t stream);
// The lightning indexer's head chain in the lane-split GEMM's epilogue (kernels/cuda/indexer.cu,
// steps 1 and 2 in one launch): problem g holds the dot products of the query rows [t0, t0 + g.m / Hi)
// (x row (t - t0) Hi + h is qi[t, h], w row j is ki[j], g.y unused), and instead of storing them the
// kernel keeps each 64 x 64 output tile in shared memory, whose rows are whole tokens when Hi divides
// 64, and writes S[(t - s0) G + j] = the chain over heads of indexer_chain_kernel for every j below
// both n and visible_groups(G, pos0 + t, ratio). The same bits as the GEMM followed by the chain kernel.
struct IndexerChainOut {
  const float* wt = nullptr;  // [T, Hi] head weights
  float* S = nullptr;         // score rows, leading dimension G, row 0 = query row s0
  int64_t t0 = 0, s0 = 0, G = 0, pos0 = 0;
  int Hi = 0, ratio = 4;
  bool bf16 = false;
};
bool indexer_chain_fusable(int Hi);  // Hi divides the GEMM tile's 64 rows
void gemm_indexer_chain(const GemmShape& s, const GemmProblem& g, const IndexerChainOut& c, cudaStream_t stream);
// An attribute of the current device.
int device_attribute(cudaDeviceAttr a);
// Throws unless the current device has bf16 tensor cores (compute capability 8.0 or newer), which
// every kernel of the tensor_core order needs (kernels/cuda/linear_tc.cu).
void require_tensor_core_device();
// True when the current device is compute capability 9.0 and this binary holds sm_90a code for it (the
// wgmma kernel of the tensor_core GEMM can run); asked once per device.
bool wgmma_available();
// gemm_group in the tensor_core order (kernels/cuda/linear_tc.cu; s.order.tensor_core), mmax the
// largest m: the wgmma kernel where wgmma_allowed and the device runs this binary's sm_90a code, else
// the mma.sync kernel (the same bits). Throws Error on a device below compute capability 8.0.
void gemm_tensor_core_group(const GemmShape& s, const GemmProblem* problems, int count, int64_t mmax,
                            bool wgmma_allowed, cudaStream_t stream);

// Sparse attention in the tensor_core order (kernels/cuda/attention_tc.cu; p.order.tensor_core):
// the check of its own limits (nullptr or the offending field), and the launch.
// With wgmma_allowed the Hopper wgmma kernel runs where it can (the same bits as the mma.sync kernel);
// uses_wgmma says whether it would for p.
const char* sparse_attention_tensor_core_check(const SparseAttnParams& p);
void sparse_attention_tensor_core(const SparseAttnParams& p, bool wgmma_allowed, cudaStream_t stream);
bool sparse_attention_tensor_core_uses_wgmma(const SparseAttnParams& p);

// RoPE over rows whose position is pos[r] (pos != nullptr) or pos_base + r * pos_step.
void rope_rows(const RopeApplyParams& p, int64_t pos_step, cudaStream_t stream, int64_t pos_base = 0);

}  // namespace dsv4::cuda::detail
