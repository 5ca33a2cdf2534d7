// Shared CPU/CUDA arithmetic of the MoE router and experts (kernels/moe.h); conventions in
// kernels/detail/shared.h.
#pragma once

#include <cmath>
#include <cstdint>

#include "kernels/detail/shared.h"
#include "kernels/linear.h"
#include "kernels/moe.h"
#include "kernels/row_sums.h"

namespace dsv4::common {

// The router score of a logit: s = sqrt(softplus_f(logit)).
DSV4_HD float router_score(float logit) {
  return std::sqrt(num::softplus_f(logit));
}

// ids [k] sorted ascending in place (insertion sort; k is small).
DSV4_HD void sort_ids(int32_t* ids, int k) {
  for (int i = 1; i < k; ++i) {
    const int32_t v = ids[i];
    int j = i - 1;
    for (; j >= 0 && ids[j] > v; --j) ids[j + 1] = ids[j];
    ids[j + 1] = v;
  }
}

// The margin of forced routing: (min over the forced experts of s_e + bias_e) - (max over the other
// experts of s_e + bias_e), both scanned in increasing e (worst = v < worst ? v : worst from +inf,
// best = v > best ? v : best from -inf). ids [k] must be sorted ascending; +inf when k >= E.
DSV4_HD float router_forced_margin(const float* s, const float* bias, int E, const int32_t* ids, int k) {
  const float inf = num::f32_from_bits(0x7f800000u);
  if (k >= E) return inf;
  float worst = inf, best = -inf;
  int i = 0;
  for (int e = 0; e < E; ++e) {
    const float v = s[e] + bias[e];
    while (i < k && ids[i] < e) ++i;
    if (i < k && ids[i] == e)
      worst = v < worst ? v : worst;
    else
      best = v > best ? v : best;
  }
  return worst - best;
}

// The routing weights of the chosen ids [k]: sum = s_(ids_0) + s_(ids_1) + ... (sequential),
// w_i = (norm_topk_prob ? s_(ids_i) / sum : s_(ids_i)) * routed_scaling_factor.
DSV4_HD void router_weights(const float* s, const int32_t* ids, int k, bool norm_topk_prob,
                            float routed_scaling_factor, float* w) {
  float sum = 0.0f;
  for (int i = 0; i < k; ++i) sum += s[ids[i]];
  for (int i = 0; i < k; ++i) {
    const float si = s[ids[i]];
    w[i] = (norm_topk_prob ? si / sum : si) * routed_scaling_factor;
  }
}

// One SwiGLU activation from the bf16 gate g and up u: with clamp and L > 0, g = min(g, L) as
// g > L ? L : g and u = u > L ? L : (u < -L ? -L : u); h = silu_f(g) * u; returns bf16(*weight * h),
// or bf16(h) when weight is null (shared experts).
DSV4_HD float swiglu_act(float g, float u, bool clamp, float L, const float* weight) {
  if (clamp && L > 0.0f) {
    g = g > L ? L : g;
    u = u > L ? L : (u < -L ? -L : u);
  }
  const float h = num::silu_f(g) * u;
  return num::bf16_round(weight ? *weight * h : h);
}

// ---- parameter checks (host), in the order both backends report them ----
// The dimensions and the reduce order.
// The rounding of an expert's w2 output (MoeParams::round_each).
inline OutRound expert_output_round(const MoeParams& p) {
  return p.round_each ? OutRound::bf16 : OutRound::f32;
}

inline const char* moe_check_dims(const MoeParams& p) {
  if (p.T < 0) return "moe: T < 0";
  if (p.D < 1 || p.I < 1) return "moe: D and I must be >= 1";
  if (p.E < 1 || p.k < 1 || p.k > p.E) return "moe: need E >= 1 and 1 <= k <= E";
  if (p.n_shared < 0) return "moe: n_shared < 0";
  if (p.I_shared < 0) return "moe: I_shared < 0";
  if (p.order.block < 0 || p.order.block % 8 != 0)
    return "moe: reduce block must be 0 or a positive multiple of 8";
  return row_sums_check(p.out_sums, p.D, "moe: out_sums asked for rows of D values, D not a multiple of 512");
}
// The top-level pointers (T > 0).
inline const char* moe_check_pointers(const MoeParams& p) {
  if (!p.x || !p.ids || !p.weights || !p.experts || !p.out) return "moe: null pointer";
  if (p.n_shared > 0 && !p.shared) return "moe: null shared experts";
  return nullptr;
}
// The weights of every routed and shared expert (T > 0).
inline const char* moe_check_expert_weights(const MoeParams& p) {
  const int last = p.loaded_last < 0 ? p.E : p.loaded_last;
  if (p.loaded_first < 0 || p.loaded_first > last || last > p.E) return "moe: the loaded experts are not a range of E";
  for (int e = p.loaded_first; e < last; ++e)
    if (!p.experts[e].w1 || !p.experts[e].w3 || !p.experts[e].w2) return "moe: null expert weights";
  for (int e = 0; e < p.n_shared; ++e)
    if (!p.shared[e].w1 || !p.shared[e].w3 || !p.shared[e].w2) return "moe: null shared expert weights";
  return nullptr;
}

}  // namespace dsv4::common
