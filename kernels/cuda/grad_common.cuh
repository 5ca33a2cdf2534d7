// Internal launchers shared by the backward ops of the CUDA backend (defined in
// kernels/cuda/grad_linear.cu, used by grad_moe.cu). Included by .cu files only.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/cuda/common.cuh"

namespace dsv4::cuda::detail {

// dot8 (kernels/cuda/common.cuh) on operands formed on the fly: operands(i, a, b) gives the i-th pair,
// which is accumulated with __fmaf_rn(a, b, acc) with dot8's lane split, chains and combine, so the
// result equals dsv4::dot over arrays holding the same operands, bit for bit. Called by all 8 threads
// of an aligned group with the same n; valid in all 8 lanes. Lane l forms only the operands
// i = l (mod 8) (chains start at multiples of 8).
template <typename F>
__device__ __forceinline__ float dot8_by(int64_t n, int block, int lane, unsigned mask, F&& operands) {
  const int64_t len = (block > 0 && n > block) ? int64_t(block) : n;
  float s = 0.0f;
  for (int64_t cs = 0; cs < n; cs += len) {
    const int64_t ce = cs + len < n ? cs + len : n;
    float acc = 0.0f;
    for (int64_t i = cs + lane; i < ce; i += 8) {
      float a, b;
      operands(i, a, b);
      acc = __fmaf_rn(a, b, acc);
    }
    const float c = combine8(acc, mask);
    s = cs == 0 ? c : s + c;
  }
  return s;
}

// dst [cols, rows] = columns [c0, c0 + cols) of the rows of src, transposed:
// dst[c * rows + r] = src[row(r) * lds + c0 + c] with row(r) = rowmap ? rowmap[r] : r (rowmap a device
// array of `rows` row indices: a gather). A pure copy: no arithmetic.
void transpose_rows(const float* src, int64_t lds, const int32_t* rowmap, int64_t rows, int64_t c0,
                    int64_t cols, float* dst, cudaStream_t stream);

// Over a [rows, cols] block: out[r, c] = out[r, c] + a[r, c] (accumulate) or a[r, c]; a == nullptr
// stands for a block of +0 (out = out + 0, or out = 0: the empty dot of a zero-length reduction).
void store_block(float* out, int64_t ldo, const float* a, int64_t lda, int64_t rows, int64_t cols,
                 bool accumulate, cudaStream_t stream);

// The inverse of an index table `table` [n] over `rows` target rows (kernels/cuda/inverse_map.cu):
// keys [inverse_map_size(n)] sorted so that the flat slots of row r are (keys[s] & 0xffffffff) for
// s in [begin[r], begin[r + 1]) in increasing order; begin [rows + 1]. Values outside [0, rows) (the
// -1 holes) belong to no row. inverse_map_slots writes those slot numbers as int64 [n] in key order.
int64_t inverse_map_size(int64_t n);
void inverse_map(const int32_t* table, int64_t n, int64_t rows, uint64_t* keys, int64_t* begin, cudaStream_t stream);
void inverse_map_slots(const uint64_t* keys, int64_t n, int64_t* slots, cudaStream_t stream);

}  // namespace dsv4::cuda::detail
