// MoE router and experts (MODEL.md §3.9).
#pragma once

#include <cstdint>
#include <vector>

#include "kernels/reduce.h"

namespace dsv4 {

// Router on precomputed fp32 logits [T, E] (logits = x · gate^T, gemm with fp32 out):
//   s_e = sqrt(softplus_f(logit_e))
//   hash:    ids = tid2eid[token[t]]          (no bias, no top-k; margin = +inf)
//   forced:  ids = forced[t]                  (already validated by the caller; margin = min over
//            the forced ids of s + bias minus max over the other experts, +inf when k == E)
//   learned: ids = topk_row(s + bias, k)      (larger first, then smaller id; margin from topk_row)
//   ids are written sorted ascending; w_i = s_{ids_i} / (sum over the sorted ids, sequential) when
//   norm_topk_prob, else s_{ids_i}; then w_i *= routed_scaling_factor.
struct RouterParams {
  int64_t T = 0;
  int E = 0, k = 0;
  const float* logits = nullptr;     // [T, E]
  const float* bias = nullptr;       // [E] (learned layers)
  const int32_t* tid2eid = nullptr;  // [V, k] (hash layers), else nullptr
  const int32_t* tokens = nullptr;   // [T] (hash layers)
  const int32_t* forced = nullptr;   // [T, k] or nullptr
  bool norm_topk_prob = true;
  float routed_scaling_factor = 1.0f;
  int32_t* ids = nullptr;    // [T, k] out, ascending
  float* weights = nullptr;  // [T, k] out, matching ids
  float* margin = nullptr;   // [T] out (may be nullptr)
  float* scores = nullptr;   // [T, E] out s_e (may be nullptr)
};
const char* router_check(const RouterParams& p);
void router(const RouterParams& p);

// One SwiGLU expert's weights: w1 (gate) [I, D], w3 (up) [I, D], w2 (down) [D, I].
struct ExpertWeights {
  const float* w1 = nullptr;
  const float* w3 = nullptr;
  const float* w2 = nullptr;
};

// out[t] = bf16( (sum over i ascending of y_i(t)) + shared(t) ) with an fp32 accumulator starting
// at 0, where for a routed expert e = ids[t][i] with weight w:
//   g = bf16(dot(x, w1 row)), u = bf16(dot(x, w3 row))      (dense linear, bf16 out)
//   g = min(g, L); u = clamp(u, -L, L)                         (L = swiglu_limit; skipped if L <= 0)
//   a = bf16(w * (silu_f(g) * u))
//   y = dot(a, w2 row) (fp32; bf16(dot) with round_each)
// and shared(t) is the same without the weight (a = bf16(silu_f(g) * u)), clamped only when
// clamp_shared; with n_shared > 1 each shared expert's y is added to the accumulator in order.
// round_each reproduces an engine whose experts each return a bf16 tensor that is added into the
// fp32 sum (MODEL.md §12.1 item 2).
// Tokens are gathered per expert and run as a GEMM; since every output element has the canonical
// order, a token's result does not depend on which other tokens share its expert.
struct MoeParams {
  int64_t T = 0, D = 0, I = 0;
  int64_t I_shared =
      0;  // intermediate size of a shared expert (HF fuses n shared experts into one of width n*I); 0: I
  int E = 0, k = 0;
  int n_shared = 1;                // number of entries in `shared` (0 or more), each of width I_shared
  const float* x = nullptr;        // [T, D] bf16 values
  const int32_t* ids = nullptr;    // [T, k] ascending
  const float* weights = nullptr;  // [T, k]
  const ExpertWeights* experts = nullptr;  // [E]
  // The routed experts whose weights are present, [loaded_first, loaded_last) (-1: all E): a rank of
  // expert parallelism loads its own only (model/weights.h only_experts); the others are null.
  int loaded_first = 0, loaded_last = -1;
  const ExpertWeights* shared = nullptr;   // [n_shared]
  float swiglu_limit = 10.0f;
  bool clamp_shared = false;
  bool round_each = false;  // each expert's y rounded to bf16 before the sum (see above)
  ReduceOrder order{};
  float* out = nullptr;  // [T, D]
  // [T, D / 512, 8] or nullptr: the block sums of the rows the call writes (kernels/row_sums.h), out's
  // (moe_combine: its `out`'s).
  uint64_t* out_sums = nullptr;
};
const char* moe_check(const MoeParams& p);
void moe_experts(const MoeParams& p);

// moe_experts in two halves, for expert parallelism (model/expert_parallel.h): the routed outputs of
// a range of experts, and the sum. moe_combine over the outputs of every expert gives moe_experts'
// bits, whoever computed each output.
//
// The (token, slot) pairs q = t * k + i whose expert lies in [e0, e1), in the order the experts are
// run: expert increasing, then q increasing.
std::vector<int64_t> moe_pairs(const MoeParams& p, int e0, int e1);
// y [pairs, D]: each pair's routed output y_i(t) (fp32, as moe_experts forms it), rows in moe_pairs'
// order. Shared experts are not run.
void moe_routed_outputs(const MoeParams& p, int e0, int e1, float* y);
// out[t] = bf16(acc), acc = 0, then acc + y_slot[t * k + i] for i = 0 .. k-1, then + each shared
// expert's output in order (y_slot [T * k, D] indexed by pair).
void moe_combine(const MoeParams& p, const float* y_slot, float* out);

}  // namespace dsv4
