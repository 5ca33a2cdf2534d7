// Shared CPU/CUDA arithmetic of the sparse attention with a sink (kernels/attention.h); conventions
// in kernels/detail/shared.h. The softmax of one (t, h) row works on the row's nv scores z_v of the
// valid slots, in slot order.
#pragma once

#include <cstdint>

#include "kernels/attention.h"
#include "kernels/detail/shared.h"

namespace dsv4::common {

// M = max(sink, z_0, ..., z_(nv-1)), scanned in slot order from sink with `z > M` (z_v at z[v * stride]).
DSV4_HD float attn_row_max(const float* z, int64_t nv, float sink, int64_t stride = 1) {
  float M = sink;
  for (int64_t v = 0; v < nv; ++v)
    if (z[v * stride] > M) M = z[v * stride];
  return M;
}

// e_v = exp_f(z_v - M).
DSV4_HD float attn_exp(float z, float M) {
  return num::exp_f(z - M);
}

// Z = (e_0 + e_1 + ... sequentially from 0) + exp_f(sink - M) (e_v at e[v * stride]).
DSV4_HD float attn_row_sum(const float* e, int64_t nv, float sink, float M, int64_t stride = 1) {
  float Z = 0.0f;
  for (int64_t v = 0; v < nv; ++v) Z = Z + e[v * stride];
  return Z + num::exp_f(sink - M);
}

// P_v = bf16(e_v / Z).
DSV4_HD float attn_prob(float e, float Z) {
  return num::bf16_round(e / Z);
}

// lse = M + log_f(Z).
DSV4_HD float attn_lse(float M, float Z) {
  return M + num::log_f(Z);
}

// The whole row on one thread: z [nv] becomes P [nv] in place; returns lse. (nv == 0 gives sink.)
DSV4_HD float attn_softmax_row(float* z, int64_t nv, float sink) {
  const float M = attn_row_max(z, nv, sink);
  for (int64_t v = 0; v < nv; ++v) z[v] = attn_exp(z[v], M);
  const float Z = attn_row_sum(z, nv, sink, M);
  for (int64_t v = 0; v < nv; ++v) z[v] = attn_prob(z[v], Z);
  return attn_lse(M, Z);
}

// ---- split-KV order (SparseAttnParams::splits > 0, kernels/attention.h) ----
// Valid slots per part: L = ceil(nv / splits) (nv >= 0, splits >= 1).
DSV4_HD int64_t attn_split_len(int64_t nv, int splits) {
  return (nv + splits - 1) / splits;
}

// Parts that hold a slot: ceil(nv / L), 0 for an empty row; at most splits and at most nv.
DSV4_HD int64_t attn_split_parts(int64_t nv, int splits) {
  const int64_t L = attn_split_len(nv, splits);
  return L == 0 ? 0 : (nv + L - 1) / L;
}

// One part's softmax without the sink: z [n] (n >= 1) becomes P [n] in place; returns
// lse_i = m_i + log_f(Z_i). m_i = max z scanned from z_0 with `z > m`; Z_i = 0 + e_0 + e_1 + ...
// sequentially; P_v = bf16(e_v / Z_i).
DSV4_HD float attn_part_softmax(float* z, int64_t n) {
  float m = z[0];
  for (int64_t v = 1; v < n; ++v)
    if (z[v] > m) m = z[v];
  for (int64_t v = 0; v < n; ++v) z[v] = attn_exp(z[v], m);
  float Z = 0.0f;
  for (int64_t v = 0; v < n; ++v) Z = Z + z[v];
  for (int64_t v = 0; v < n; ++v) z[v] = attn_prob(z[v], Z);
  return attn_lse(m, Z);
}

// The combine weights of n parts (n >= 1) with the sink: lse_i [n] becomes c_i = w_i / W in place
// (fp32, not rounded); returns the row's lse = M + log_f(W). M = max(sink, lse_0, ...) scanned from
// the sink, w_i = exp_f(lse_i - M), W = (w_0 + w_1 + ... sequentially) + exp_f(sink - M): the exact
// row's max, sum and lse applied to the parts' lse.
DSV4_HD float attn_combine_weights(float* lw, int64_t n, float sink) {
  const float M = attn_row_max(lw, n, sink);
  for (int64_t i = 0; i < n; ++i) lw[i] = attn_exp(lw[i], M);
  const float W = attn_row_sum(lw, n, sink, M);
  for (int64_t i = 0; i < n; ++i) lw[i] = lw[i] / W;
  return attn_lse(M, W);
}

// o[d] of a split row: for each part i in order, o_i = fma chain over its slots of P_v * kv[slots[v]][d]
// from 0; then o = bf16(fma chain over i of c_i * o_i from 0). P [nv]: the parts' probabilities in slot
// order; c [parts]: attn_combine_weights; slots [nv]: the kv rows of the valid slots in slot order.
DSV4_HD float attn_split_out(const float* P, const float* c, const int32_t* slots, int64_t nv, int64_t L,
                             const float* kv, int64_t Dh, int64_t d) {
  float acc = 0.0f;
  for (int64_t b = 0, i = 0; b < nv; b += L, ++i) {
    const int64_t e = b + L < nv ? b + L : nv;
    float part = 0.0f;
    for (int64_t v = b; v < e; ++v) part = std::fma(P[v], kv[int64_t(slots[v]) * Dh + d], part);
    acc = std::fma(c[i], part, acc);
  }
  return num::bf16_round(acc);
}

// ---- online order (SparseAttnParams::online_block > 0, kernels/attention.h) ----
// The whole row's scan on one thread: z [nv] (the valid slots' scores in slot order) becomes P [nv]
// (bf16 of the unnormalised p_v) and a [nv] (alpha_b at a block's first slot, 1 elsewhere); blocks are
// [bB, min((b+1)B, nv)) of the valid slots. Returns lse; *l_out = the final l.
DSV4_HD float attn_online_row(float* z, float* a, int64_t nv, int B, float sink, float* l_out) {
  const float neg_inf = num::f32_from_bits(0xff800000u);
  float m = neg_inf, l = 0.0f;
  for (int64_t v = 0; v < nv;) {
    const int64_t e = v + B < nv ? v + B : nv;
    float mb = neg_inf;
    for (int64_t i = v; i < e; ++i)
      if (z[i] > mb) mb = z[i];
    const float mn = mb > m ? mb : m;
    const float alpha = num::exp_f(m - mn);  // the first block: exp_f(-inf) = 0
    float s = 0.0f;
    for (int64_t i = v; i < e; ++i) {
      const float pv = num::exp_f(z[i] - mn);
      s = s + pv;
      z[i] = num::bf16_round(pv);
      a[i] = i == v ? alpha : 1.0f;
    }
    l = l * alpha + s;
    m = mn;
    v = e;
  }
  l = l + num::exp_f(sink - m);
  *l_out = l;
  return m + num::log_f(l);
}

// One step of an online row's output accumulator: slot v (probability P_v, alpha factor a_v, value x)
// gives fma(P_v, x, acc * a_v) (a_v = 1 is exact).
DSV4_HD float attn_online_acc(float acc, float P, float a, float x) {
  return std::fma(P, x, acc * a);
}
// The output from the accumulator: bf16(acc / l).
DSV4_HD float attn_online_final(float acc, float l) {
  return num::bf16_round(acc / l);
}

// o[d] of an online row: acc = 0, then attn_online_acc for v in slot order, then attn_online_final.
DSV4_HD float attn_online_out(const float* P, const float* a, const int32_t* slots, int64_t nv, const float* kv,
                              int64_t Dh, int64_t d, float l) {
  float acc = 0.0f;
  for (int64_t v = 0; v < nv; ++v) acc = attn_online_acc(acc, P[v], a[v], kv[int64_t(slots[v]) * Dh + d]);
  return attn_online_final(acc, l);
}

// ---- parameter checks (host), in the order both backends report them ----
// The dimensions.
inline const char* sparse_attention_check_dims(const SparseAttnParams& p) {
  if (p.T < 0) return "T";
  if (p.H < 1) return "H";
  if (p.Dh < 1) return "Dh";
  if (p.N < 0) return "N";
  if (p.K < 0) return "K";
  if (p.splits < 0) return "splits";
  if (p.online_block < 0) return "online_block";
  return nullptr;
}
// The pointers (none is needed when T == 0).
inline const char* sparse_attention_check_pointers(const SparseAttnParams& p) {
  if (p.T == 0) return nullptr;
  if (p.q == nullptr) return "q";
  if (p.N > 0 && p.kv == nullptr) return "kv";
  if (p.K > 0 && p.idx == nullptr) return "idx";
  if (p.sink == nullptr) return "sink";
  if (p.o == nullptr) return "o";
  return nullptr;
}

}  // namespace dsv4::common
