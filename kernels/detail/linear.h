// Shared CPU/CUDA arithmetic of the dense GEMM (kernels/linear.h); conventions in
// kernels/detail/shared.h. The per-element sum itself is kernels/reduce.h (dot, combine_lanes8).
#pragma once

#include "kernels/detail/shared.h"
#include "kernels/linear.h"

namespace dsv4::common {

// The output rounding of a GEMM element: bf16(v) for OutRound::bf16, else v.
DSV4_HD float gemm_out(float v, OutRound r) {
  return r == OutRound::bf16 ? num::bf16_round(v) : v;
}

}  // namespace dsv4::common
