// Log-probabilities from fp32 logits.
#pragma once

#include <cstdint>

namespace dsv4 {

// Per row t: M = max_v l[v]; Z = sum_v exp_f(l[v] - M) with 8 interleaved accumulators (lane v % 8,
// lanes combined as in kernels/reduce.h); lse = M + log_f(Z). Special rows: any NaN gives NaN,
// M = +-inf gives M (all -inf: -inf, as torch does).
// logprob[t] = l[target[t]] - lse[t] for the rows that have a target.
float logsumexp_row(const float* l, int64_t V);
void log_softmax_gather(const float* logits, int64_t rows, int64_t V, const int32_t* target, float* logprob);

}  // namespace dsv4
