// Log-probabilities on the GPU in the operation order of kernels/logits.h.
//
// Kernel contract (log_softmax_kernel): one aligned group of 8 threads per row (32 rows per block,
// grid-stride). Lane l owns accumulator l of the CPU's 8-lane sum (v = l mod 8, plain fp32 adds in
// increasing v); the lanes are combined with the xor-shuffle tree ((l0 + l4) + (l2 + l6)) +
// ((l1 + l5) + (l3 + l7)). The row maximum is an exact max over the non-NaN values (the order of a
// max does not matter; the sign of a zero maximum cannot change lse, as exp_f(+-0) = 1 and
// +-0 + log_f(Z) with Z >= 1 is the same value).
#include "kernels/cuda/common.cuh"
#include "kernels/detail/logits.h"

namespace dsv4::cuda {

namespace {

constexpr int kThreads = 256, kRowsPerBlock = kThreads / 8;

__global__ void __launch_bounds__(kThreads)
    log_softmax_kernel(const float* logits, int64_t rows, int64_t V, const int32_t* target, float* logprob) {
  const int lane = threadIdx.x & 7;
  const unsigned mask = detail::group8_mask();
  const float inf = __int_as_float(0x7f800000);
  for (int64_t t = int64_t(blockIdx.x) * kRowsPerBlock + threadIdx.x / 8; t < rows;
       t += int64_t(gridDim.x) * kRowsPerBlock) {
    if (target[t] < 0 || target[t] >= V) continue;  // uniform over the group
    const float* l = logits + t * V;
    float M = -inf;
    bool nan = false;
    common::logit_max(l, lane, V, 8, M, nan);
    int any_nan = nan;
    for (int o = 4; o > 0; o >>= 1) {
      const float m2 = __shfl_xor_sync(mask, M, o);
      any_nan |= __shfl_xor_sync(mask, any_nan, o);
      M = m2 > M ? m2 : M;
    }
    float lse;
    if (!common::lse_special(M, any_nan != 0, lse))
      lse = common::lse_finish(M, detail::combine8(common::lse_lane_sum(l, V, M, lane), mask));
    if (lane == 0) logprob[t] = l[target[t]] - lse;
  }
}

}  // namespace

void log_softmax_gather(const float* logits, int64_t rows, int64_t V, const int32_t* target, float* logprob,
                        cudaStream_t stream) {
  if (rows < 0 || V < 0) require("rows or V is negative", "log_softmax_gather");
  if (rows == 0) return;
  if (!target || !logprob || (V > 0 && !logits)) require("null pointer", "log_softmax_gather");
  log_softmax_kernel<<<detail::grid_for(rows, kRowsPerBlock, 65535), kThreads, 0, stream>>>(logits, rows, V,
                                                                                            target, logprob);
  DSV4_LAUNCH_CHECK();
}

}  // namespace dsv4::cuda
