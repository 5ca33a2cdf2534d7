// Shared CPU/CUDA arithmetic of the MoE backward (kernels/grad.h router_backward and
// moe_experts_backward); conventions in kernels/detail/shared.h. The forward's pieces (router_score,
// swiglu_act) are kernels/detail/moe.h.
#pragma once

#include <cstdint>

#include "kernels/detail/moe.h"
#include "kernels/detail/shared.h"

namespace dsv4::common {

// ---- router -------------------------------------------------------------------------------------

// d s / d logit for s = sqrt(softplus_f(logit)): sigmoid_f(logit) / (2 * s), written as
// (ds * sigmoid_f(logit)) / (2 * s) for an incoming ds; 0 where s == 0 (softplus underflowed: the
// true derivative tends to 0 there).
DSV4_HD float router_score_grad(float logit, float s, float ds) {
  return s > 0.0f ? (ds * num::sigmoid_f(logit)) / (2.0f * s) : 0.0f;
}

// One token's router backward: dlogits [E] overwritten. With s_i = router_score(logits[ids_i]):
//   S = s_0 + s_1 + ...                        (sequential from 0, as router_weights sums)
//   norm: A = dw_0 * s_0 + dw_1 * s_1 + ...    (sequential from 0, one multiply and one add each)
//         ds_i = lambda * ((dw_i / S) - (A / (S * S)))
//   else: ds_i = lambda * dw_i
//   dlogits[ids_i] += router_score_grad(logits[ids_i], s_i, ds_i) in increasing i over a zeroed row
//   (a repeated id sums its slots in slot order; distinct ids receive exactly their one term).
DSV4_HD void router_backward_row(const float* logits, int E, const int32_t* ids, int k, const float* dw,
                                 bool norm_topk_prob, float lambda, float* dlogits) {
  for (int e = 0; e < E; ++e) dlogits[e] = 0.0f;
  float S = 0.0f, A = 0.0f;
  for (int i = 0; i < k; ++i) {
    const float s = router_score(logits[ids[i]]);
    S += s;
    A += dw[i] * s;
  }
  for (int i = 0; i < k; ++i) {
    const float l = logits[ids[i]];
    const float s = router_score(l);
    const float ds = norm_topk_prob ? lambda * ((dw[i] / S) - (A / (S * S))) : lambda * dw[i];
    dlogits[ids[i]] += router_score_grad(l, s, ds);
  }
}

// ---- SwiGLU expert ------------------------------------------------------------------------------

// silu'(g) = s * (1 + g * (1 - s)) with s = sigmoid_f(g).
DSV4_HD float silu_grad(float g) {
  const float s = num::sigmoid_f(g);
  return s * (1.0f + g * (1.0f - s));
}

// The forward's clamp of the bf16 gate and up values (kernels/detail/moe.h swiglu_act): with clamp and
// L > 0, g = min(g, L) and u = clamp(u, -L, L), written exactly as the forward writes them.
DSV4_HD void swiglu_clamp(float& g, float& u, bool clamp, float L) {
  if (clamp && L > 0.0f) {
    g = g > L ? L : g;
    u = u > L ? L : (u < -L ? -L : u);
  }
}

// The unweighted, unrounded activation h = silu_f(g) * u of the clamped g, u (the forward's h before
// the routing weight and the bf16 rounding).
DSV4_HD float swiglu_h(float g, float u, bool clamp, float L) {
  swiglu_clamp(g, u, clamp, L);
  return num::silu_f(g) * u;
}

// The gradients of the bf16 gate g and up u (before the clamp) given dh = d loss / d h:
//   dg = (dh * u_c) * silu_grad(g_c)   where g <= L, else 0
//   du = dh * silu_f(g_c)              where -L <= u <= L, else 0
// (g_c, u_c the clamped values; the clamp conditions apply only with clamp and L > 0; the boundary
// values themselves pass the gradient, as torch's min / clamp do). A NaN g or u gives 0 under the clamp.
DSV4_HD void swiglu_backward(float g, float u, bool clamp, float L, float dh, float& dg, float& du) {
  bool pass_g = true, pass_u = true;
  if (clamp && L > 0.0f) {
    pass_g = g <= L;
    pass_u = u >= -L && u <= L;
  }
  swiglu_clamp(g, u, clamp, L);
  dg = pass_g ? (dh * u) * silu_grad(g) : 0.0f;
  du = pass_u ? dh * num::silu_f(g) : 0.0f;
}

}  // namespace dsv4::common
