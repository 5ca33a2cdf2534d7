// The canonical reduction orders. Every long fp32 sum in the runtime (GEMM dot products, RMSNorm
// sums of squares, attention and indexer dot products, mHC fn·x) is one of these, so a result never
// depends on the thread count, the batch composition, padding or the instruction set.
//
// Order (block == 0, "single chain"): 8 interleaved accumulators. Element i goes to lane i % 8 and
// is accumulated with an explicit fma, in increasing i: acc[l] = fma(a[i], b[i], acc[l]). The lanes
// are then combined as ((acc0 + acc4) + (acc2 + acc6)) + ((acc1 + acc5) + (acc3 + acc7)).
//
// Order (block = B > 0, "blocked"): the range is cut into consecutive blocks of B elements (B a
// multiple of 8; the last block may be shorter); each block is reduced with the single-chain order
// above starting from zero, and the block results are added left to right: s = ((b0 + b1) + b2) + ...
// (n <= B is a single block, i.e. the single-chain order).
//
// The train profile uses block 0, the rollout profile a different fixed block (see model/profile.h):
// the two profiles are each deterministic, and differ from each other like two real engines do.
//
// Order `tensor_core` (GEMM, expert, indexer and attention sites only; the fast numerics of
// docs/NUMERICS.md): bf16 inputs, tensor-core products and fp32 accumulation in the order of
// kernels/cuda/linear_tc.cu (GEMMs, experts), kernels/cuda/indexer.cu (the indexer's dots) and
// kernels/cuda/attention_tc.cu (sparse attention), fixed for one GPU architecture. It is not defined
// here and the CPU does not compute it: dot() is never called with it (the CPU GEMM, experts, indexer
// and attention refuse it with cpu_order_check).
//
// The tensor_core order's bits are those of this build's kernels: kTensorCoreRevision (below) names
// them, and a trace records it (env key tensor_core_revision).
#pragma once

#include <cmath>
#include <cstdint>

#include "kernels/numerics/hd.h"

namespace dsv4 {

struct ReduceOrder {
  int block = 0;  // 0: one chain over the whole range; else block length (multiple of 8)
  bool tensor_core = false;  // the GPU's tensor-core order (above); block is then 0 and unused
  friend bool operator==(const ReduceOrder&, const ReduceOrder&) = default;
};

// nullptr, or why the CPU cannot compute in order `o`: the CPU ops that take an order from a GEMM,
// expert, indexer or attention site refuse the tensor_core order with it.
inline const char* cpu_order_check(ReduceOrder o) {
  return o.tensor_core ? "the tensor_core order (fast numerics) is a GPU's tensor-core order; the CPU does not "
                         "compute it (run on --device cuda)"
                       : nullptr;
}

// The revision of the tensor_core order's bits: one more whenever a change to those kernels changes
// any byte they compute (a kernel that only runs faster, with the same bytes, keeps it). A fast step
// replays bit for bit only on a GPU of the recorded architecture with kernels of the recorded revision
// (replay/replay.h fast_replay_obstacle). Revision 1: the kernels as they were when traces began to
// record the key; a trace without it is taken at revision 1.
//   1: the attention's softmax exponent has exp_f's bits.
//   2: the attention's softmax exponent is exp_fast_nonpos (kernels/numerics/numerics.h).
inline constexpr int kTensorCoreRevision = 2;

namespace detail {
DSV4_HD float combine_lanes8(const float acc[8]) {
  return ((acc[0] + acc[4]) + (acc[2] + acc[6])) + ((acc[1] + acc[5]) + (acc[3] + acc[7]));
}
DSV4_HD float dot_chain(const float* a, const float* b, int64_t n) {
  float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    for (int l = 0; l < 8; ++l) acc[l] = std::fma(a[i + l], b[i + l], acc[l]);
  for (int l = 0; i + l < n; ++l) acc[l] = std::fma(a[i + l], b[i + l], acc[l]);
  return combine_lanes8(acc);
}
}  // namespace detail

// sum_i a[i] * b[i] in the canonical order `o`. This function *is* the definition; optimised
// kernels (blocked GEMM, CUDA) must reproduce it bit for bit.
DSV4_HD float dot(const float* a, const float* b, int64_t n, ReduceOrder o) {
  if (o.block <= 0 || n <= o.block) return detail::dot_chain(a, b, n);
  float s = detail::dot_chain(a, b, o.block);
  for (int64_t start = o.block; start < n; start += o.block) {
    const int64_t len = (n - start < o.block) ? (n - start) : o.block;
    s = s + detail::dot_chain(a + start, b + start, len);
  }
  return s;
}

// sum_i a[i]^2 in the canonical order.
DSV4_HD float sum_squares(const float* a, int64_t n, ReduceOrder o) {
  return dot(a, a, n, o);
}

}  // namespace dsv4
