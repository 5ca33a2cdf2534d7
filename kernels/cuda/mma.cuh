// Tensor-core building blocks of the fast numerics' kernels (the `tensor_core` order of
// kernels/reduce.h): bf16 packing, shared-memory addresses, ldmatrix, cp.async and the
// mma.sync.m16n8k16 bf16 step with fp32 accumulators. Functions that issue mma are named
// *tensor_core* (scripts/kernel-audit.py lets only those use tensor cores). Included by .cu files only.
//
// Fragment layouts of m16n8k16 (g = lane / 4, c = lane % 4), which the kernels rely on:
//   A (16 x 16, row-major): a0 = (row g, cols 2c, 2c+1), a1 = (row g+8, same cols),
//                           a2 = (row g, cols 2c+8, 2c+9), a3 = (row g+8, cols 2c+8, 2c+9)
//   B (16 x 8, k x n):      b0 = (k 2c, 2c+1; col g), b1 = (k 2c+8, 2c+9; col g)
//   C (16 x 8, fp32):       c0, c1 = (row g, cols 2c, 2c+1), c2, c3 = (row g+8, cols 2c, 2c+1)
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace dsv4::cuda::detail {

// x [rows, cols] fp32 (row-major, cols apart) -> out [rows, width] bf16, round to nearest even, zeros
// past cols (width even, >= cols): the bf16 copy a kernel of the tensor_core order reads with cp.async
// (the attention's kv, the indexer's keys). Defined in kernels/cuda/linear_tc.cu, whose operand copies
// use the same kernel.
void rows_to_bf16(const float* x, int64_t rows, int64_t cols, int width, __nv_bfloat16* out, cudaStream_t stream);
// The same for rows map[r] of x (row stride ld): a gathered operand (the experts' token rows).
void gathered_rows_to_bf16(const float* x, int64_t ld, const int32_t* map, int64_t rows, int64_t cols, int width,
                           __nv_bfloat16* out, cudaStream_t stream);
// The row width of the tensor_core GEMM's bf16 operand copies for k values: k padded to the order's
// k tiles of 32 (GemmProblem::x16).
int64_t gemm_bf16_width(int64_t k);

// Two floats rounded to bf16 (to nearest even), lo at the lower address.
__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
  const __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&h);
}

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// Four 8 x 8 b16 matrices; lanes 8i .. 8i+7 give the row addresses of matrix i, register i holds it.
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(p)));
}
// The same, each matrix transposed on the way (a k-major tile read as B fragments).
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(p)));
}

// 16 bytes global -> shared, asynchronous; bytes = 0 fills the 16 bytes with zeros instead.
__device__ __forceinline__ void cp_async16(void* dst, const void* src, int bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr(dst)), "l"(src), "r"(bytes));
}
__device__ __forceinline__ void cp_async_commit() {
  asm volatile("cp.async.commit_group;\n" ::);
}
// Wait until at most N committed groups are still in flight.
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

// d = a . b + d: m16n8k16, bf16 inputs, fp32 accumulators.
__device__ __forceinline__ void mma_bf16_tensor_core(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                                     uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// ROWS rows of fp32 (row r at row(r), nullptr for a row of zeros; `cols` values each, cols <= COLS)
// into bf16 dst [ROWS][ld] (round to nearest even), zeros past cols, by the THREADS threads of the
// block. With vec (cols a multiple of 4, rows 16-byte aligned) each thread issues its float4 loads in
// batches of 8 before converting them, so a batch costs one memory latency, not eight.
template <int ROWS, int COLS, int THREADS, typename Row>
__device__ __forceinline__ void stage_rows_bf16(__nv_bfloat16* dst, int64_t ld, int64_t cols, bool vec, Row row,
                                                int tid) {
  static_assert(COLS % 4 == 0 && (ROWS * (COLS / 4)) % THREADS == 0, "whole float4 passes");
  if (vec) {
    constexpr int kPer = ROWS * (COLS / 4) / THREADS, kBatch = kPer < 8 ? kPer : 8;
    static_assert(kPer % kBatch == 0, "whole batches");
#pragma unroll 1
    for (int b0 = 0; b0 < kPer; b0 += kBatch) {
      float4 v[kBatch];
#pragma unroll
      for (int u = 0; u < kBatch; ++u) {
        const int e = tid + (b0 + u) * THREADS, r = e / (COLS / 4), d = (e % (COLS / 4)) * 4;
        const float* src = row(r);
        v[u] = src && d < cols ? *reinterpret_cast<const float4*>(src + d) : make_float4(0.f, 0.f, 0.f, 0.f);
      }
#pragma unroll
      for (int u = 0; u < kBatch; ++u) {
        const int e = tid + (b0 + u) * THREADS, r = e / (COLS / 4), d = (e % (COLS / 4)) * 4;
        *reinterpret_cast<uint2*>(&dst[r * ld + d]) = make_uint2(pack_bf16(v[u].x, v[u].y), pack_bf16(v[u].z, v[u].w));
      }
    }
    return;
  }
  for (int e = tid; e < ROWS * (COLS / 2); e += THREADS) {
    const int r = e / (COLS / 2), d = (e % (COLS / 2)) * 2;
    const float* src = row(r);
    const float lo = src && d < cols ? src[d] : 0.0f, hi = src && d + 1 < cols ? src[d + 1] : 0.0f;
    *reinterpret_cast<uint32_t*>(&dst[r * ld + d]) = pack_bf16(lo, hi);
  }
}

}  // namespace dsv4::cuda::detail
