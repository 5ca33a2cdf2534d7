// Shared CPU/CUDA arithmetic of the log-softmax (kernels/logits.h); conventions in
// kernels/detail/shared.h. A row of V logits is split into 8 lanes (lane l takes v = l mod 8).
#pragma once

#include <cstdint>

#include "kernels/detail/shared.h"

namespace dsv4::common {

// Folds l[v] for v = begin, begin + step, ... below V into the running maximum M of the non-NaN
// values (`x > M`) and the flag nan (any NaN seen). The maximum is exact in any order.
DSV4_HD void logit_max(const float* l, int64_t begin, int64_t V, int64_t step, float& M, bool& nan) {
  for (int64_t v = begin; v < V; v += step) {
    const float x = l[v];
    if (x != x)
      nan = true;
    else if (x > M)
      M = x;
  }
}

// The rows whose lse needs no sum: any NaN gives NaN; M = +-inf gives M (all -inf, or V == 0: -inf).
// Returns true and sets lse for those.
DSV4_HD bool lse_special(float M, bool nan, float& lse) {
  if (nan) {
    lse = quiet_nan();
    return true;
  }
  if (M == num::f32_from_bits(0x7f800000u) || M == -num::f32_from_bits(0x7f800000u)) {
    lse = M;
    return true;
  }
  return false;
}

// Accumulator `lane` of the sum: exp_f(l[v] - M) for v = lane, lane + 8, ... below V, added to a
// plain fp32 accumulator from 0 in increasing v.
DSV4_HD float lse_lane_sum(const float* l, int64_t V, float M, int lane) {
  float acc = 0.0f;
  for (int64_t v = lane; v < V; v += 8) acc += num::exp_f(l[v] - M);
  return acc;
}

// lse = M + log_f(Z), Z the 8 lane sums combined as in kernels/reduce.h.
DSV4_HD float lse_finish(float M, float Z) {
  return M + num::log_f(Z);
}

}  // namespace dsv4::common
