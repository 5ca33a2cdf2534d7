// Shared CPU/CUDA arithmetic of the indexer's KL objective (kernels/grad.h AttentionMassParams,
// IndexerKlParams, IndexerScoreBwdParams); conventions in kernels/detail/shared.h. The score backward
// runs in two passes like the attention's (kernels/detail/grad_attention.h):
//   1. one (t, h) row at a time (indexer_bwd_row): the recomputed dots, dwt[t, h], dqi[t, h] and the
//      slot terms e_thj into a [T * k, Hi] buffer (flat slot t * k + j, then the head);
//   2. one key row g at a time (indexer_bwd_key_row) over the flat slots that hold g, in increasing
//      order: dki[g] as one fma chain, no atomics.
#pragma once

#include <cstdint>

#include "kernels/detail/shared.h"
#include "kernels/grad.h"
#include "kernels/reduce.h"

namespace dsv4::common {

// The smallest normal fp32 value, the clamp of the KL's probabilities before their logs.
DSV4_HD float kl_tiny() {
  return num::f32_from_bits(0x00800000u);
}

// The attention mass of one slot: fp32 sum from 0 over h increasing of exp_f(scale * dot(q[h], kvn) -
// lse[h]). q [H, Dh] of the row, kvn [Dh] the slot's kv row, lse [H] of the row.
DSV4_HD float attention_mass_slot(const float* q, const float* kvn, const float* lse, int H, int64_t Dh,
                                  float scale, ReduceOrder order) {
  float S = 0.0f;
  for (int h = 0; h < H; ++h) S = S + num::exp_f(scale * dot(q + int64_t(h) * Dh, kvn, Dh, order) - lse[h]);
  return S;
}

// One row of indexer_kl: ids, score, mass, dscore [k]. Returns the row's KL (without coeff).
DSV4_HD float indexer_kl_row(const int32_t* ids, const float* score, const float* mass, int k, bool l1,
                             float coeff, float* dscore) {
  const float tiny = kl_tiny();
  bool any = false;
  float m = 0.0f;
  for (int j = 0; j < k; ++j) {
    if (ids[j] < 0) continue;
    if (!any || score[j] > m) m = score[j];
    any = true;
  }
  for (int j = 0; j < k; ++j) dscore[j] = 0.0f;
  if (!any) return 0.0f;
  float Z = 0.0f, M = 0.0f;
  for (int j = 0; j < k; ++j) {
    if (ids[j] < 0) continue;
    Z = Z + num::exp_f(score[j] - m);
    M = M + mass[j];
  }
  if (l1 && M == 0.0f) return 0.0f;
  float loss = 0.0f, A = 0.0f;
  for (int j = 0; j < k; ++j) {
    if (ids[j] < 0) continue;
    const float pi = num::exp_f(score[j] - m) / Z;
    const float tau = l1 ? mass[j] / M : mass[j];
    if (tau > 0.0f) {
      const float lt = num::log_f(tau < tiny ? tiny : tau), lp = num::log_f(pi < tiny ? tiny : pi);
      loss = loss + tau * (lt - lp);
    }
    if (pi >= tiny) A = A + tau;
  }
  for (int j = 0; j < k; ++j) {
    if (ids[j] < 0) continue;
    const float pi = num::exp_f(score[j] - m) / Z;
    const float tau = l1 ? mass[j] / M : mass[j];
    dscore[j] = coeff * ((pi * A) - (pi >= tiny ? tau : 0.0f));
  }
  return loss;
}

// Whether a slot's id names a key row.
DSV4_HD bool indexer_slot_valid(int32_t id, int64_t G) {
  return id >= 0 && id < G;
}

// The (t, h) row of the score backward on one thread. qh [Di] = qi[t, h]; ids, dscore [k] of row t;
// ki [G, Di]; wt = wt[t, h]. Writes dqh [Di] and, for every valid slot j, e[j * ld] = e_thj (invalid
// slots are not written). Returns dwt[t, h].
DSV4_HD float indexer_bwd_row(const float* qh, const float* ki, const int32_t* ids, const float* dscore, int k,
                              int64_t G, int64_t Di, float wt, float wt_scale, ReduceOrder order, float* dqh,
                              float* e, int64_t ld) {
  for (int64_t d = 0; d < Di; ++d) dqh[d] = 0.0f;
  float S = 0.0f;
  for (int j = 0; j < k; ++j) {
    if (!indexer_slot_valid(ids[j], G)) continue;
    const float* kg = ki + int64_t(ids[j]) * Di;
    const float dt = dot(qh, kg, Di, order);
    const float relu = dt < 0.0f ? 0.0f : dt;  // the forward's relu (NaN propagates)
    S = S + dscore[j] * relu;
    const float ej = dt > 0.0f ? dscore[j] * wt : 0.0f;
    for (int64_t d = 0; d < Di; ++d) dqh[d] = std::fma(ej, kg[d], dqh[d]);
    e[j * ld] = ej;
  }
  return wt_scale * S;
}

// dki of one key row, columns d = begin, begin + step, ... below Di: acc = 0, then for each flat slot
// tj = t * k + j of `slots` [count] in the given (increasing) order and each head h increasing,
// acc = fma(e[tj, h], qi[t, h, d], acc). qi [T, Hi, Di]; e [T * k, Hi].
DSV4_HD void indexer_bwd_key_row(const int64_t* slots, int64_t count, int k, int Hi, int64_t Di, const float* qi,
                                 const float* e, float* dkg, int64_t begin, int64_t step) {
  for (int64_t d = begin; d < Di; d += step) {
    float acc = 0.0f;
    for (int64_t s = 0; s < count; ++s) {
      const int64_t tj = slots[s], t = tj / k;
      for (int h = 0; h < Hi; ++h) acc = std::fma(e[tj * Hi + h], qi[(t * Hi + h) * Di + d], acc);
    }
    dkg[d] = acc;
  }
}

// ---- parameter checks (host), in the order both backends report them ----
inline const char* attention_mass_check_shape(const AttentionMassParams& p) {
  if (p.T < 0 || p.H < 1 || p.Dh < 1 || p.N < 0 || p.K < 0) return "attention_mass: bad dimensions";
  if (p.c0 < 0 || p.n < 0 || p.c0 + p.n > p.K) return "attention_mass: the slot columns lie outside [0, K)";
  if (p.order.block < 0 || p.order.block % 8 != 0)
    return "attention_mass: order.block must be 0 or a positive multiple of 8";
  if (p.T * p.n == 0) return nullptr;
  if (!p.q || !p.kv || !p.idx || !p.lse || !p.mass) return "attention_mass: a pointer is null";
  return nullptr;
}
inline const char* indexer_kl_check_shape(const IndexerKlParams& p) {
  if (p.T < 0 || p.k < 0) return "indexer_kl: bad dimensions";
  if (p.T == 0) return nullptr;
  if (!p.loss) return "indexer_kl: loss is null";
  if (p.k > 0 && (!p.ids || !p.score || !p.mass || !p.dscore)) return "indexer_kl: a pointer is null";
  return nullptr;
}
inline const char* indexer_score_backward_check_shape(const IndexerScoreBwdParams& p) {
  if (p.T < 0 || p.Hi < 1 || p.Di < 1 || p.G < 0 || p.k < 0) return "indexer_score_backward: bad dimensions";
  if (p.order.block < 0 || p.order.block % 8 != 0)
    return "indexer_score_backward: order.block must be 0 or a positive multiple of 8";
  if (p.G > 0 && !p.dki) return "indexer_score_backward: dki is null";
  if (p.T == 0) return nullptr;
  if (!p.qi || !p.wt || !p.dqi || !p.dwt || (p.G > 0 && !p.ki) || (p.k > 0 && (!p.ids || !p.dscore)))
    return "indexer_score_backward: a pointer is null";
  return nullptr;
}

}  // namespace dsv4::common
