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
//
// splits = S >= 1 replaces the softmax and P·V above by the split-KV ("flash-decoding") order of an
// inference engine's decode kernel (docs/NUMERICS.md "Split-KV decode attention"). With the z_v of the
// nv valid slots (v = 0 .. nv-1, slot order, computed as above):
//   L = ceil(nv / S); part i holds v in [i*L, min((i+1)*L, nv)), i = 0 .. n-1, n = ceil(nv / L)
//     (parts without a slot are skipped, so n <= S)
//   per part i, without the sink:
//     m_i = max_v z_v                     (scanned from the part's first z with `z > m`)
//     Z_i = sum_v exp_f(z_v - m_i)        (sequential from the part's first slot, starting at 0)
//     P_v = bf16(exp_f(z_v - m_i) / Z_i)
//     o_i[d] = fma chain over the part's slots of P_v * kv[slot v][d], from 0  (fp32, not rounded)
//     lse_i = m_i + log_f(Z_i)
//   combine, in part order 0 .. n-1, with the sink as one more logit that has no value:
//     M   = max(sink[h], lse_0, ..., lse_(n-1))   (scanned from the sink with `x > M`)
//     w_i = exp_f(lse_i - M)
//     W   = (w_0 + w_1 + ... sequentially from 0) + exp_f(sink[h] - M)
//     c_i = w_i / W                               (fp32, not rounded)
//     o[t,h,d] = bf16(fma chain over i of c_i * o_i[d], from 0)
//     lse[t,h] = M + log_f(W)
// Same maths as the exact order, other roundings. S = 1 is not the exact order: its P are normalised
// without the sink and bf16-rounded before the sink enters (through c_0 = w_0 / W, in fp32). An empty
// row gives o = 0 and lse = sink[h] exactly, as above.
//
// online_block = B >= 1 (and splits == 0) replaces the two-pass softmax by the online softmax of a
// flash-attention kernel that walks the row in blocks of B slots (MODEL.md §3.8, §12.1 item 7). The
// blocks are taken over the valid slots v = 0 .. nv-1 in slot order, [bB, min((b+1)B, nv)), so the
// result does not depend on where -1 padding sits (a decode step's row equals the prefill's). With
// m = -inf, l = 0, acc[d] = 0, for each block b in order:
//   mb = max of the block's z (scanned in slot order with `z > mb` from -inf); mn = max(m, mb)
//   alpha = exp_f(m - mn)                          (0 for the first block)
//   p_v = exp_f(z_v - mn); s = sum of the block's p_v sequentially from 0
//   l = l * alpha + s
//   acc[d] = acc[d] * alpha, then acc[d] = fma(bf16(p_v), kv[row of v][d], acc[d]) for the block's
//            slots in slot order
//   m = mn
// then l = l + exp_f(sink[h] - m); o[t,h,d] = bf16(acc[d] / l); lse[t,h] = m + log_f(l). The
// probabilities enter P·V unnormalised and bf16-rounded; the division comes last. An empty row gives
// o = 0 and lse = sink[h] exactly.
//
// order.tensor_core (CUDA only, the fast numerics of docs/NUMERICS.md) replaces all of the above by
// the tensor_core order of kernels/cuda/attention_tc.cu: q, kv and the probabilities in bf16,
// tensor-core products with fp32 accumulation, an online softmax over blocks of 64 valid slots whose
// exponent is exp_fast_nonpos (kernels/numerics/numerics.h; the sink's stays exp_f);
// splits and online_block are not used (a decode step's row equals the prefill's). The CPU refuses it
// (cpu_order_check).
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
  int splits = 0;        // 0: the exact row order; N >= 1: split-KV into N parts (decode, see above)
  int online_block = 0;  // 0: two-pass softmax; B >= 1: online softmax in blocks of B slots (above)
};
const char* sparse_attention_check(const SparseAttnParams& p);  // also scans idx for out-of-range
void sparse_attention(const SparseAttnParams& p);

}  // namespace dsv4
