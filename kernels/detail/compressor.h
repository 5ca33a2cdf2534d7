// Shared CPU/CUDA arithmetic and set-up of the KV compressor and the Walsh-Hadamard rotation
// (kernels/compressor.h); conventions in kernels/detail/shared.h.
#pragma once

#include <cmath>
#include <cstdint>

#include "kernels/compressor.h"
#include "kernels/detail/shared.h"
#include "kernels/norm.h"
#include "kernels/rope.h"

namespace dsv4::common {

// The pooling inputs: kvp and sc [rows, cw] (the two fp32 GEMM outputs of the tokens from row0 on,
// cw = coff * d; row0 a multiple of r) and ape [r, cw]. overlap (ratio 4): 2r slots per group,
// else r. Group indices are absolute (group g covers tokens [g*r, g*r + r)).
struct CompressorPool {
  const float* kvp = nullptr;
  const float* sc = nullptr;
  const float* ape = nullptr;
  int64_t d = 0, cw = 0;
  int r = 4;
  bool overlap = true;
  int64_t row0 = 0;
};

// Where slot s of group g, channel c lives: the absolute token `row` (its ape row is row % r; its
// kvp / sc row is row - row0) and column `col`; false for group 0's previous-group slots (kv 0,
// score -inf).
DSV4_HD bool compressor_slot(const CompressorPool& a, int64_t g, int64_t c, int s, int64_t& row,
                             int64_t& col) {
  if (!a.overlap) {
    row = g * a.r + s, col = c;
    return true;
  }
  if (s < a.r) {
    row = (g - 1) * a.r + s, col = c;
    return g > 0;
  }
  row = g * a.r + (s - a.r), col = a.d + c;
  return true;
}

// Channel c of pooled group g (before the RMSNorm), in the contract's order: per slot s the score
// sc + ape[slot] (one addition), m = max over the slots (`v > m` from -inf), Z = sum of
// exp_f(score - m) in slot order from 0, then bf16(acc) with acc = fma(e_s / Z, kv_s, acc) in slot
// order from 0. The exp_f terms are recomputed in the last loop (the same inputs give the same bits).
DSV4_HD float compressor_pool(const CompressorPool& a, int64_t g, int64_t c) {
  const int nslot = a.overlap ? 2 * a.r : a.r;
  const float ninf = -num::f32_from_bits(0x7f800000u);
  auto sc_at = [&](int s) -> float {
    int64_t row, col;
    if (!compressor_slot(a, g, c, s, row, col)) return ninf;
    return a.sc[(row - a.row0) * a.cw + col] + a.ape[(row % a.r) * a.cw + col];
  };
  auto kv_at = [&](int s) -> float {
    int64_t row, col;
    if (!compressor_slot(a, g, c, s, row, col)) return 0.0f;
    return a.kvp[(row - a.row0) * a.cw + col];
  };
  float m = ninf;
  for (int s = 0; s < nslot; ++s) {
    const float v = sc_at(s);
    if (v > m) m = v;
  }
  float Z = 0.0f;
  for (int s = 0; s < nslot; ++s) Z = Z + num::exp_f(sc_at(s) - m);
  float acc = 0.0f;
  for (int s = 0; s < nslot; ++s) acc = std::fma(num::exp_f(sc_at(s) - m) / Z, kv_at(s), acc);
  return num::bf16_round(acc);
}

// Stage h (1, 2, 4, ..., n/2) of the Walsh-Hadamard butterflies on v [n], for the pairs
// q = begin, begin + step, ... below n/2: pair q is (j, j + h) with j = (q / h) * 2h + q % h
// (h is a power of two), and (a, b) -> (a + b, a - b). The pairs of a stage are disjoint.
DSV4_HD void hadamard_stage(float* v, int64_t n, int64_t h, int64_t begin, int64_t step) {
  for (int64_t q = begin; q < n / 2; q += step) {
    const int64_t j = ((q & ~(h - 1)) << 1) | (q & (h - 1));
    const float a = v[j], b = v[j + h];
    v[j] = a + b;
    v[j + h] = a - b;
  }
}

// The output scale of the rotation, 1.0f / sqrt(float(n)), and an output value bf16(v * scale).
inline float hadamard_scale(int64_t n) {
  return 1.0f / std::sqrt(float(n));
}
DSV4_HD float hadamard_out(float v, float scale) {
  return num::bf16_round(v * scale);
}

// ---- host set-up --------------------------------------------------------------------------------
// Width of a kvp / sc row: coff * d (ratio 4 overlaps: coff 2).
inline int64_t compressor_row_width(int ratio, int64_t d) {
  return (ratio == 4 ? 2 : 1) * d;
}
// The pooling inputs of p.
inline CompressorPool compressor_pool_shape(const CompressorPoolParams& p) {
  const bool overlap = (p.ratio == 4);
  return CompressorPool{.kvp = p.kvp,
                        .sc = p.sc,
                        .ape = p.ape,
                        .d = p.d,
                        .cw = compressor_row_width(p.ratio, p.d),
                        .r = p.ratio,
                        .overlap = overlap,
                        .row0 = p.row0};
}
// The whole-sequence compressor p as its pooling half over the projections kvp / sc of its G * ratio
// complete rows.
inline CompressorPoolParams compressor_pool_params(const CompressorParams& p, const float* kvp,
                                                   const float* sc) {
  const int64_t G = compressor_groups(p.T, p.ratio);
  return CompressorPoolParams{.g0 = 0,
                              .G = G,
                              .row0 = 0,
                              .rows = G * p.ratio,
                              .ratio = p.ratio,
                              .d = p.d,
                              .rd = p.rd,
                              .kvp = kvp,
                              .sc = sc,
                              .ape = p.ape,
                              .norm = p.norm,
                              .freq = p.freq,
                              .rms_eps = p.rms_eps,
                              .hadamard = p.hadamard,
                              .order = p.order,
                              .out = p.out};
}
// RMSNorm of the G pooled rows of p.out in place (fp32 weight p.norm, bf16 out).
inline RmsNormParams compressor_norm_params(const CompressorPoolParams& p, int64_t G) {
  return RmsNormParams{.rows = G,
                       .dim = p.d,
                       .x = p.out,
                       .ldx = p.d,
                       .w = p.norm,
                       .y = p.out,
                       .ldy = p.d,
                       .eps = p.rms_eps,
                       .order = p.order};
}
// RoPE on the last rd dims of the G rows of p.out, bf16 out; positions `pos` (the caller's choice:
// row g is at (g0 + g) * ratio).
inline RopeApplyParams compressor_rope_params(const CompressorPoolParams& p, int64_t G, const int64_t* pos) {
  return RopeApplyParams{.rows = G,
                         .heads = 1,
                         .x = p.out,
                         .ld = p.d,
                         .head_stride = p.d,
                         .offset = p.d - p.rd,
                         .pos = pos,
                         .freq = p.freq,
                         .rd = p.rd,
                         .inverse = false,
                         .round_bf16 = true};
}

}  // namespace dsv4::common
