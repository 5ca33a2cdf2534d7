// Log-probabilities from fp32 logits in the operation order documented in kernels/logits.h.
#include "kernels/logits.h"

#include <limits>

#include "kernels/detail/logits.h"
#include "kernels/reduce.h"

namespace dsv4 {

float logsumexp_row(const float* l, int64_t V) {
  float M = -std::numeric_limits<float>::infinity();
  bool nan = false;
  common::logit_max(l, 0, V, 1, M, nan);
  // All -inf (or V == 0): the sum is 0 and lse = -inf; a +inf logit gives +inf (as torch does).
  float lse;
  if (common::lse_special(M, nan, lse)) return lse;
  float acc[8];
  for (int lane = 0; lane < 8; ++lane) acc[lane] = common::lse_lane_sum(l, V, M, lane);
  return common::lse_finish(M, detail::combine_lanes8(acc));
}

void log_softmax_gather(const float* logits, int64_t rows, int64_t V, const int32_t* target, float* logprob) {
#pragma omp parallel for schedule(static) if (rows * V >= (int64_t(1) << 15))
  for (int64_t t = 0; t < rows; ++t) {
    if (target[t] < 0 || target[t] >= V) continue;  // no target: logprob[t] is left unchanged
    const float* l = logits + t * V;
    logprob[t] = l[target[t]] - logsumexp_row(l, V);
  }
}

}  // namespace dsv4
