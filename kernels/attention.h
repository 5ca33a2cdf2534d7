// Sparse attention with an attention sink (MODEL.md §3.8), one shared K=V head.
#pragma once

#include <cstdint>

#include "kernels/reduce.h"

namespace dsv4 {

// For each (t, h), with J = slots j of idx[t] that are not -1 (in slot order):
//   z_j = scale * dot(q[t,h], kv[idx[t][j]], order)
//   M   = max(sink[h], max_j z_j)
//   Z   = (sum_j exp_f(z_j - M), sequential in slot order from 0) + exp_f(sink[h] - M)
//   P_j = bf16(exp_f(z_j - M) / Z)
//   o[t,h,d] = bf16(sum_j P_j * kv[idx[t][j]][d])  (fma chain in slot order from 0)
//   lse[t,h] = M + log_f(Z)
// An empty row gives o = 0 and lse = sink[h] exactly. Cost O(T * H * K * Dh): only selected rows are
// touched. Multithreaded over (t, h).
struct SparseAttnParams {
  int64_t T = 0;
  int H = 0;
  int64_t Dh = 0;
  int64_t N = 0;                 // rows of kv
  int64_t K = 0;                 // idx width
  const float* q = nullptr;      // [T, H, Dh]
  const float* kv = nullptr;     // [N, Dh]
  const int32_t* idx = nullptr;  // [T, K], -1 = empty; other values must be in [0, N)
  const float* sink = nullptr;   // [H]
  float scale = 0.0f;
  ReduceOrder order{};
  float* o = nullptr;    // [T, H, Dh]
  float* lse = nullptr;  // [T, H] (may be nullptr)
};
const char* sparse_attention_check(const SparseAttnParams& p);  // also scans idx for out-of-range
void sparse_attention(const SparseAttnParams& p);

}  // namespace dsv4
