// Log-probabilities from fp32 logits in the operation order documented in kernels/logits.h.
#include "kernels/logits.h"

#include <cmath>
#include <limits>

#include "kernels/numerics/numerics.h"
#include "kernels/reduce.h"

namespace dsv4 {

float logsumexp_row(const float* l, int64_t V) {
  float M = -std::numeric_limits<float>::infinity();
  bool nan = false;
  for (int64_t v = 0; v < V; ++v) {
    if (std::isnan(l[v]))
      nan = true;
    else if (l[v] > M)
      M = l[v];
  }
  if (nan) return std::numeric_limits<float>::quiet_NaN();
  // All -inf (or V == 0): the sum is 0 and lse = -inf; a +inf logit gives +inf (as torch does).
  if (std::isinf(M)) return M;
  float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t v = 0;
  for (; v + 8 <= V; v += 8)
    for (int l8 = 0; l8 < 8; ++l8) acc[l8] += num::exp_f(l[v + l8] - M);
  for (int l8 = 0; v + l8 < V; ++l8) acc[l8] += num::exp_f(l[v + l8] - M);
  return M + num::log_f(detail::combine_lanes8(acc));
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
