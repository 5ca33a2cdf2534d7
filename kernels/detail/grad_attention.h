// Shared CPU/CUDA arithmetic of the sparse attention backward (kernels/grad.h SparseAttnBwdParams);
// conventions in kernels/detail/shared.h. The backward runs in two passes:
//   1. one (t, h) row at a time (attn_bwd_row): Δ, the recomputed scores, the unrounded
//      probabilities P and the scaled score gradients scale * dz of the row's valid slots, dq, and the
//      row's sink term Δ * p_sink;
//   2. one kv row n at a time (attn_bwd_kv_row) over the list of the flat slots t * K + j that point
//      to n, in increasing order: dkv[n] as one sequential sum, no atomics.
// P and scale * dz live in [T, K, H] buffers (flat slot t * K + j, then the head) between the passes.
#pragma once

#include <cstdint>

#include "kernels/detail/shared.h"
#include "kernels/grad.h"
#include "kernels/reduce.h"

namespace dsv4::common {

// Δ = dot(o, dO) in the canonical order (o is the forward's bf16 output).
DSV4_HD float attn_bwd_delta(const float* o, const float* dO, int64_t Dh, ReduceOrder order) {
  return dot(o, dO, Dh, order);
}

// P = exp_f(z - lse): the unrounded probability of a score (of the sink when z = sink[h]).
DSV4_HD float attn_bwd_prob(float z, float lse) {
  return num::exp_f(z - lse);
}

// dz = P * (dot(dO, kv) - Δ).
DSV4_HD float attn_bwd_dz(float P, float dOkv, float delta) {
  return P * (dOkv - delta);
}

// One term of dkv: (scale * dz) * q + P * dO (two rounded products, one rounded addition).
DSV4_HD float attn_bwd_kv_term(float sdz, float q, float P, float dO) {
  return sdz * q + P * dO;
}

// The (t, h) row on one thread. q, dO, o: the row's [Dh] vectors; idx: the token's K slots; kv [N, Dh].
// Writes dq [Dh] (0 for an empty row), and for every valid slot j: P[j * ld] = P_j and
// sdz[j * ld] = scale * dz_j (slots -1 are not written). Returns Δ * p_sink, the row's term of the
// sink's sum (before the sign).
//   dq[d] = scale * acc[d], acc[d] = fma(dz_j, kv[idx[j]][d], acc[d]) in slot order from 0.
DSV4_HD float attn_bwd_row(const float* q, const float* dO, const float* o, const float* kv,
                           const int32_t* idx, int64_t K, int64_t Dh, float scale, float sink, float lse,
                           ReduceOrder order, float* dq, float* P, float* sdz, int64_t ld) {
  const float delta = attn_bwd_delta(o, dO, Dh, order);
  for (int64_t d = 0; d < Dh; ++d) dq[d] = 0.0f;
  for (int64_t j = 0; j < K; ++j) {
    if (idx[j] < 0) continue;
    const float* kvj = kv + int64_t(idx[j]) * Dh;
    const float z = scale * dot(q, kvj, Dh, order);
    const float p = attn_bwd_prob(z, lse);
    const float dz = attn_bwd_dz(p, dot(dO, kvj, Dh, order), delta);
    for (int64_t d = 0; d < Dh; ++d) dq[d] = std::fma(dz, kvj[d], dq[d]);
    P[j * ld] = p;
    sdz[j * ld] = scale * dz;
  }
  for (int64_t d = 0; d < Dh; ++d) dq[d] = scale * dq[d];
  return delta * attn_bwd_prob(sink, lse);
}

// dkv of one kv row, columns d = begin, begin + step, ... below Dh: 0, then for each flat slot
// tj = t * K + j of `slots` [count] in the given (increasing) order and each head h increasing,
// dkv[d] = dkv[d] + attn_bwd_kv_term(sdz[tj, h], q[t, h, d], P[tj, h], dO[t, h, d]).
// q, dO [T, H, Dh]; P, sdz [T * K, H].
DSV4_HD void attn_bwd_kv_row(const int64_t* slots, int64_t count, int64_t K, int H, int64_t Dh,
                             const float* q, const float* dO, const float* P, const float* sdz, float* dkv,
                             int64_t begin, int64_t step) {
  for (int64_t d = begin; d < Dh; d += step) dkv[d] = 0.0f;
  for (int64_t e = 0; e < count; ++e) {
    const int64_t tj = slots[e], t = tj / K;
    for (int h = 0; h < H; ++h) {
      const float p = P[tj * H + h], s = sdz[tj * H + h];
      const float* qh = q + (t * H + h) * Dh;
      const float* dOh = dO + (t * H + h) * Dh;
      for (int64_t d = begin; d < Dh; d += step) dkv[d] = dkv[d] + attn_bwd_kv_term(s, qh[d], p, dOh[d]);
    }
  }
}

// The sink's gradient of head h: dsink = dsink + (-S), S = sum over t increasing from 0 of
// ds[t * H + h] (the rows' Δ * p_sink).
DSV4_HD float attn_bwd_sink(const float* ds, int64_t T, int H, int h, float dsink) {
  float S = 0.0f;
  for (int64_t t = 0; t < T; ++t) S = S + ds[t * H + h];
  return dsink + (-S);
}

// ---- parameter checks (host), in the order both backends report them ----
// The dimensions.
inline const char* sparse_attention_backward_check_dims(const SparseAttnBwdParams& p) {
  if (p.T < 0) return "sparse_attention_backward: T must be >= 0";
  if (p.H < 1) return "sparse_attention_backward: H must be >= 1";
  if (p.Dh < 1) return "sparse_attention_backward: Dh must be >= 1";
  if (p.N < 0) return "sparse_attention_backward: N must be >= 0";
  if (p.K < 0) return "sparse_attention_backward: K must be >= 0";
  if (p.order.block < 0 || p.order.block % 8 != 0)
    return "sparse_attention_backward: order.block must be 0 or a positive multiple of 8";
  return nullptr;
}
// The pointers: dkv is written whenever N > 0 (zeros when no slot points to a row, T == 0 included);
// the rest only when T > 0. dsink may be null (the sink's gradient is then not formed).
inline const char* sparse_attention_backward_check_pointers(const SparseAttnBwdParams& p) {
  if (p.N > 0 && p.dkv == nullptr) return "sparse_attention_backward: dkv is null";
  if (p.T == 0) return nullptr;
  if (p.q == nullptr) return "sparse_attention_backward: q is null";
  if (p.N > 0 && p.kv == nullptr) return "sparse_attention_backward: kv is null";
  if (p.K > 0 && p.idx == nullptr) return "sparse_attention_backward: idx is null";
  if (p.sink == nullptr) return "sparse_attention_backward: sink is null";
  if (p.o == nullptr) return "sparse_attention_backward: o is null";
  if (p.lse == nullptr) return "sparse_attention_backward: lse is null";
  if (p.dO == nullptr) return "sparse_attention_backward: dO is null";
  if (p.dq == nullptr) return "sparse_attention_backward: dq is null";
  return nullptr;
}

}  // namespace dsv4::common
