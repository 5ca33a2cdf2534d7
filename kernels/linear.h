// Dense linear layers: Y[m, n] = sum_k X[m, k] * W[n, k]   (W row-major [N, K], as in torch Linear).
// Every output element is the canonical dot product of kernels/reduce.h over k in increasing order,
// so the result for a row never depends on the other rows (batch invariance), on the thread count or
// on the tiling. Multithreaded over output tiles with OpenMP.
#pragma once

#include <cstdint>

#include "kernels/reduce.h"

namespace dsv4 {

enum class OutRound { f32, bf16 };  // bf16: each output element is rounded to bf16 once

struct GemmParams {
  int64_t m = 0, n = 0, k = 0;
  const float* x = nullptr;
  int64_t ldx = 0;  // row stride of x (>= k)
  const float* w = nullptr;
  int64_t ldw = 0;  // row stride of w (>= k)
  float* y = nullptr;
  int64_t ldy = 0;  // row stride of y (>= n)
  OutRound round = OutRound::bf16;
  ReduceOrder order{};
  // The tensor_core order on CUDA only: x already as the bf16 copy that the GEMM would make of it
  // (cuda::gemm_x_to_bf16: bf16 patterns, rows of cuda::gemm_bf16_row_width(k) values), so that GEMMs
  // reading the same x share one copy. The bits are those of the GEMM from x; x must still be given.
  const uint16_t* x16 = nullptr;
};
const char* gemm_check(const GemmParams& p);
void gemm(const GemmParams& p);

// The parameters of y [m, n] = x [m, k] . w [n, k]^T on dense rows (ldx = ldw = k, ldy = n), the
// set-up of the GEMMs that the ops (compressor, mHC, MoE) run on either backend.
inline GemmParams linear_params(int64_t m, int64_t n, int64_t k, const float* x, const float* w, float* y,
                                OutRound round, ReduceOrder order) {
  return GemmParams{.m = m,
                    .n = n,
                    .k = k,
                    .x = x,
                    .ldx = k,
                    .w = w,
                    .ldw = k,
                    .y = y,
                    .ldy = n,
                    .round = round,
                    .order = order};
}

// Reference implementation: one `dot()` call per output element, single-threaded. The tests and the
// benchmark compare gemm() against it bit for bit.
void gemm_reference(const GemmParams& p);

}  // namespace dsv4
