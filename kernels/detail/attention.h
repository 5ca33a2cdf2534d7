// Shared CPU/CUDA arithmetic of the sparse attention with a sink (kernels/attention.h); conventions
// in kernels/detail/shared.h. The softmax of one (t, h) row works on the row's nv scores z_v of the
// valid slots, in slot order.
#pragma once

#include <cstdint>

#include "kernels/attention.h"
#include "kernels/detail/shared.h"

namespace dsv4::common {

// M = max(sink, z_0, ..., z_(nv-1)), scanned in slot order from sink with `z > M`.
DSV4_HD float attn_row_max(const float* z, int64_t nv, float sink) {
  float M = sink;
  for (int64_t v = 0; v < nv; ++v)
    if (z[v] > M) M = z[v];
  return M;
}

// e_v = exp_f(z_v - M).
DSV4_HD float attn_exp(float z, float M) {
  return num::exp_f(z - M);
}

// Z = (e_0 + e_1 + ... sequentially from 0) + exp_f(sink - M).
DSV4_HD float attn_row_sum(const float* e, int64_t nv, float sink, float M) {
  float Z = 0.0f;
  for (int64_t v = 0; v < nv; ++v) Z = Z + e[v];
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

// ---- parameter checks (host), in the order both backends report them ----
// The dimensions.
inline const char* sparse_attention_check_dims(const SparseAttnParams& p) {
  if (p.T < 0) return "T";
  if (p.H < 1) return "H";
  if (p.Dh < 1) return "Dh";
  if (p.N < 0) return "N";
  if (p.K < 0) return "K";
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
