// Shared CPU/CUDA arithmetic of the compressor pooling backward (kernels/grad.h
// CompressorPoolBwdParams); conventions in kernels/detail/shared.h. Per group: the pooled row is
// recomputed by common::compressor_pool (kernels/detail/compressor.h), dout's rotated dims are turned
// back (compressor_bwd_unrotate), the RMSNorm backward gives the gradient of the pooled row
// (compressor_bwd_norm), and each channel's softmax pooling is differentiated and scattered to the
// kvp / sc elements its slots read (compressor_bwd_channel). dape and dnorm are sums over the groups
// (compressor_bwd_ape, and a sum of compressor_bwd_norm's per-group terms).
#pragma once

#include <cstdint>

#include "kernels/detail/compressor.h"
#include "kernels/detail/norm.h"
#include "kernels/detail/rope.h"
#include "kernels/detail/shared.h"
#include "kernels/grad.h"
#include "kernels/reduce.h"

namespace dsv4::common {

// The inverse rotation of the last rd dims of v [d] (pairs i = begin, begin + step, ... below rd/2)
// at position pos: the forward's angle fp32(pos) * freq[i] and its cos_f / sin_f, the conjugate
// rotation of kernels/detail/rope.h, not rounded.
DSV4_HD void compressor_bwd_unrotate(float* v, int64_t d, int rd, int64_t pos, const float* freq,
                                     int64_t begin, int64_t step) {
  float* r = v + (d - rd);
  for (int64_t i = begin; i < rd / 2; i += step) {
    float c, s;
    rope_cos_sin(pos, freq[i], c, s);
    rope_rotate(r + 2 * i, c, s, /*inverse=*/true, /*round_bf16=*/false);
  }
}

// RMSNorm backward of one row on one thread, with x [d] the norm's input (the bf16 pooled row), w [d]
// its weight and dy [d] the gradient of its output; r = rms_scale(sum_squares(x)) as the forward.
//   gw_i = dy_i * w_i;  s = dot(gw, x) (canonical);  k = (((r * r) * r) / d) * s
//   dx_i = r * gw_i - k * x_i                    (dx may alias dy)
//   dw_i's term of this row: (dy_i * x_i) * r    (written to dwt [d] when not null; dwt may not alias)
// gw is formed in dx first, so dx [d] is the only scratch.
DSV4_HD void compressor_bwd_norm(const float* x, const float* w, const float* dy, int64_t d, float eps,
                                 ReduceOrder order, float* dx, float* dwt) {
  const float r = rms_scale(sum_squares(x, d, order), d, eps);
  if (dwt)
    for (int64_t i = 0; i < d; ++i) dwt[i] = (dy[i] * x[i]) * r;
  for (int64_t i = 0; i < d; ++i) dx[i] = dy[i] * w[i];
  const float k = (((r * r) * r) / float(d)) * dot(dx, x, d, order);
  for (int64_t i = 0; i < d; ++i) dx[i] = r * dx[i] - k * x[i];
}

// Channel c of group g: the backward of the per-channel softmax pooling given dc, the gradient of the
// pooled value (the bf16 cast is straight-through). With the forward's m, e_s = exp_f(score_s - m) and
// Z (common::compressor_pool), w_s = e_s / Z:
//   A = fma(w_s, dc * kv_s, A) over the slots in order from 0
//   dkv_s = w_s * dc;  dscore_s = w_s * (dc * kv_s - A)
// written at the slot's kvp / sc element of dkvp / dsc (layout of a.kvp); group 0's previous-group
// slots (kv 0, score -inf) write nothing.
DSV4_HD void compressor_bwd_channel(const CompressorPool& a, int64_t g, int64_t c, float dc, float* dkvp,
                                    float* dsc) {
  const int nslot = a.overlap ? 2 * a.r : a.r;
  const float ninf = -num::f32_from_bits(0x7f800000u);
  auto at = [&](int s, float& score, float& kv) -> int64_t {  // the element's offset, -1 for a fill slot
    int64_t row, col;
    if (!compressor_slot(a, g, c, s, row, col)) {
      score = ninf, kv = 0.0f;
      return -1;
    }
    const int64_t off = (row - a.row0) * a.cw + col;
    score = a.sc[off] + a.ape[(row % a.r) * a.cw + col];
    kv = a.kvp[off];
    return off;
  };
  float score, kv;
  float m = ninf;
  for (int s = 0; s < nslot; ++s) {
    at(s, score, kv);
    if (score > m) m = score;
  }
  float Z = 0.0f;
  for (int s = 0; s < nslot; ++s) {
    at(s, score, kv);
    Z = Z + num::exp_f(score - m);
  }
  float A = 0.0f;
  for (int s = 0; s < nslot; ++s) {
    at(s, score, kv);
    A = std::fma(num::exp_f(score - m) / Z, dc * kv, A);
  }
  for (int s = 0; s < nslot; ++s) {
    const int64_t off = at(s, score, kv);
    if (off < 0) continue;
    const float w = num::exp_f(score - m) / Z;
    dkvp[off] = w * dc;
    dsc[off] = w * (dc * kv - A);
  }
}

// dape's sum for ape element (k, col) (k < r, col < cw): S = 0, then S = S + dscore over the groups
// g = g0 .. g0 + G - 1 in increasing order, each group's dscore of the one slot that adds ape[k][col]
// (read back from dsc, where compressor_bwd_channel wrote it; group 0's previous-group half has
// none). Returns S.
DSV4_HD float compressor_bwd_ape(const CompressorPool& a, int64_t g0, int64_t G, int k, int64_t col,
                                 const float* dsc) {
  // The slot that reads ape[k][col]: overlap, first half: previous-group slot k; second half: own
  // slot r + k; no overlap: own slot k. Its token is row, its column col either way.
  const bool prev = a.overlap && col < a.d;
  float S = 0.0f;
  for (int64_t g = g0; g < g0 + G; ++g) {
    if (prev && g == 0) continue;
    const int64_t row = (prev ? g - 1 : g) * a.r + k;
    S = S + dsc[(row - a.row0) * a.cw + col];
  }
  return S;
}

// ---- parameter checks (host) ----
// Every token the groups read: [first, (g0 + G) * ratio), first = the previous group's start for the
// overlapping ratio 4 (none before group 0).
inline const char* compressor_pool_backward_check_params(const CompressorPoolBwdParams& p) {
  if (p.g0 < 0) return "compressor_pool_backward: g0 must be >= 0";
  if (p.G < 0) return "compressor_pool_backward: G must be >= 0";
  if (p.ratio < 1) return "compressor_pool_backward: ratio must be >= 1";
  if (p.row0 < 0 || p.row0 % p.ratio != 0)
    return "compressor_pool_backward: row0 must be a multiple of ratio, >= 0";
  if (p.rows < 0) return "compressor_pool_backward: rows must be >= 0";
  if (p.d <= 0) return "compressor_pool_backward: d must be > 0";
  if (p.rd <= 0 || p.rd % 2 != 0 || p.rd > p.d) return "compressor_pool_backward: rd must be even, in (0, d]";
  if (!(p.rms_eps >= 0.0f)) return "compressor_pool_backward: rms_eps must be >= 0";
  if (p.order.block < 0 || p.order.block % 8 != 0)
    return "compressor_pool_backward: order.block must be 0 or a positive multiple of 8";
  if (p.G > 0) {
    const int64_t first = (p.ratio == 4 ? (p.g0 > 0 ? p.g0 - 1 : 0) : p.g0) * p.ratio;
    if (first < p.row0 || (p.g0 + p.G) * p.ratio > p.row0 + p.rows)
      return "compressor_pool_backward: the groups read tokens outside [row0, row0 + rows)";
  }
  // dkvp / dsc are overwritten whenever rows > 0 (zeros without groups).
  if (p.rows > 0 && p.dkvp == nullptr) return "compressor_pool_backward: dkvp is null";
  if (p.rows > 0 && p.dsc == nullptr) return "compressor_pool_backward: dsc is null";
  if (p.G == 0) return nullptr;
  if (p.kvp == nullptr) return "compressor_pool_backward: kvp is null";
  if (p.sc == nullptr) return "compressor_pool_backward: sc is null";
  if (p.ape == nullptr) return "compressor_pool_backward: ape is null";
  if (p.norm == nullptr) return "compressor_pool_backward: norm is null";
  if (p.freq == nullptr) return "compressor_pool_backward: freq is null";
  if (p.dout == nullptr) return "compressor_pool_backward: dout is null";
  return nullptr;
}

// The pooling inputs of p (as common::compressor_pool_shape builds them for the forward).
inline CompressorPool compressor_pool_backward_shape(const CompressorPoolBwdParams& p) {
  return CompressorPool{.kvp = p.kvp,
                        .sc = p.sc,
                        .ape = p.ape,
                        .d = p.d,
                        .cw = compressor_row_width(p.ratio, p.d),
                        .r = p.ratio,
                        .overlap = (p.ratio == 4),
                        .row0 = p.row0};
}

}  // namespace dsv4::common
