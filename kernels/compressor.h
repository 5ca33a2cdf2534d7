// KV compressor (MODEL.md §3.5) for the main attention (d = Dh) and the indexer keys (d = Di), plus
// the Walsh-Hadamard rotation used by the indexer.
#pragma once

#include <cstdint>

#include "kernels/reduce.h"

namespace dsv4 {

// Pools every complete group of `ratio` tokens into one row. G = floor(T / ratio) rows are produced.
//   kvp = x · wkv^T, sc = x · wgate^T  (gemm, fp32 out, rows [0, G*ratio))
//   sc += ape[slot]                     (ape [ratio, coff*d], broadcast over groups)
//   ratio 4 (coff 2, overlap): group g uses 8 slots: slots 0..3 = previous group's tokens, features
//     [0, d) of kvp/sc; slots 4..7 = its own tokens, features [d, 2d). Group 0's previous slots are
//     kv 0 / score -inf. Other ratios (coff 1): the group's own `ratio` tokens, features [0, d).
//   per channel c: m = max_slot sc; e_s = exp_f(sc_s - m); Z = sum_s e_s (slot order);
//     c_g[c] = sum_s (e_s / Z) * kv_s[c] as an fma chain in slot order starting from 0.
//   c_g = rmsnorm(bf16(c_g); norm)  (fp32 weight, bf16 out), then RoPE on the last rd dims at
//   position g * ratio (`freq` from rope_freqs), bf16 out; if hadamard, c_g = hadamard(c_g).
// FP8 simulation is not done here (the caller applies it per profile).
struct CompressorParams {
  int64_t T = 0, D = 0;
  int ratio = 4;
  int64_t d = 0;  // output head dim
  int rd = 64;
  const float* x = nullptr;      // [T, D] bf16 values
  const float* wkv = nullptr;    // [coff*d, D]
  const float* wgate = nullptr;  // [coff*d, D]
  const float* ape = nullptr;    // [ratio, coff*d]
  const float* norm = nullptr;   // [d]
  const float* freq = nullptr;   // [rd/2]
  float rms_eps = 1e-6f;
  bool hadamard = false;
  ReduceOrder order{};
  float* out = nullptr;  // [floor(T/ratio), d]
};
inline int64_t compressor_groups(int64_t T, int ratio) {
  return T / ratio;
}
const char* compressor_check(const CompressorParams& p);
void compressor(const CompressorParams& p);

// The pooling half of the compressor on rows projected earlier: what a decoding engine runs when a
// group completes (MODEL.md §7.2), with the projections of earlier tokens kept as its state.
// kvp and sc hold the fp32 projections (x · wkv^T, x · wgate^T, [rows, coff*d]) of the tokens
// [row0, row0 + rows); row0 is a multiple of ratio. Groups g0 .. g0 + G - 1 (absolute indices) are
// pooled exactly as compressor() pools them (slot rule, ape by slot, group 0's previous slots
// kv 0 / score -inf), normed, rotated at position g * ratio and, if hadamard, rotated by the
// Walsh-Hadamard matrix: the same bits as compressor() over the whole sequence. Every token a group
// reads must lie in [row0, row0 + rows). compressor() is the two projections followed by this.
struct CompressorPoolParams {
  int64_t g0 = 0, G = 0;       // groups to produce
  int64_t row0 = 0, rows = 0;  // tokens held by kvp / sc
  int ratio = 4;
  int64_t d = 0;
  int rd = 64;
  const float* kvp = nullptr;   // [rows, coff*d]
  const float* sc = nullptr;    // [rows, coff*d]
  const float* ape = nullptr;   // [ratio, coff*d]
  const float* norm = nullptr;  // [d]
  const float* freq = nullptr;  // [rd/2]
  float rms_eps = 1e-6f;
  bool hadamard = false;
  ReduceOrder order{};
  float* out = nullptr;  // [G, d]
};
const char* compressor_pool_check(const CompressorPoolParams& p);
void compressor_pool(const CompressorPoolParams& p);

// In-place Walsh-Hadamard transform of `rows` vectors of length n (a power of two) with the
// Sylvester (natural) order, scaled by 1/sqrt(n): butterflies (a, b) -> (a + b, a - b) for
// h = 1, 2, 4, ..., n/2 in fp32, then each value * s, s = 1.0f / sqrt(float(n)) in fp32, rounded to
// bf16.
void hadamard(float* x, int64_t rows, int64_t n, int64_t ld);

}  // namespace dsv4
