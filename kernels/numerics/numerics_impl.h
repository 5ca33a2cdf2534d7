// Definitions of the functions declared in numerics.h (included at its end; do not include directly).
//
// Every function uses only IEEE fp32 +, -, *, /, sqrt, explicit fma, floor, integer bit manipulation and
// constants written as exact hexadecimal literals, so results are the same bits on any IEEE machine
// (given -ffp-contract=off, which the build enforces). Integer rounding of a float uses the
// "add and subtract 1.5 * 2^23" idiom, which rounds to nearest even in the default rounding mode
// and is exact for |t| < 2^22.
//
// NaN inputs are returned unchanged, with no arithmetic on them: x86 arithmetic keeps a NaN's sign
// and payload while CUDA arithmetic returns a canonical NaN, so only the untouched input is the same
// bits on both. NaNs created here (log of a negative number, sin/cos of inf) are 0x7fc00000.
// CUDA builds must keep IEEE semantics: --fmad=false, no --use_fast_math (no ftz, IEEE div/sqrt).
#pragma once

#include "kernels/numerics/numerics.h"

namespace dsv4::num {

namespace detail {

constexpr float kInf = __builtin_huge_valf();
constexpr float kNaN = __builtin_nanf("");
constexpr float kRoundMagic = 0x1.8p23f;  // 1.5 * 2^23

// Round to nearest integer, ties to even; exact for |t| < 2^22.
DSV4_HD float round_even(float t) {
  return (t + kRoundMagic) - kRoundMagic;
}

// 2^n as a float for n in [-126, 127].
DSV4_HD float pow2i(int n) {
  return f32_from_bits(uint32_t(n + 127) << 23);
}

DSV4_HD bool is_nan(float x) {
  return !(x == x);
}

// ln 2 split: LN2_HI = fp32(ln 2), LN2_LO = fp32(ln 2 - LN2_HI); the remainder is 8.8e-17.
constexpr float kLn2Hi = 0x1.62e430p-1f;
constexpr float kLn2Lo = -0x1.05c610p-29f;
constexpr float kLog2e = 0x1.715476p+0f;

// log(1 + f) + c + dk * ln2 for f in [sqrt(1/2) - 1, sqrt(2) - 1], c a small correction term.
// log(1 + f) = 2 atanh(s) with s = f / (2 + f), |s| <= 0.1716, z = s^2 <= 0.0295:
//   2 atanh(s) = 2s + s R(z),  R(z) = sum_{n>=1} 2 z^n / (2n + 1)  (series to z^6, tail < 1e-11 rel)
// and 2s = f - s f rearranged as f - hfsq + s (hfsq + R) with hfsq = f^2 / 2, which keeps the large
// term f exact and puts all rounding into the small terms.
DSV4_HD float log1p_reduced(float f, float dk, float c) {
  const float s = f / (2.0f + f);
  const float z = s * s;
  float R = 0x1.3b13b2p-3f;            // 2/13
  R = std::fma(R, z, 0x1.745d18p-3f);  // 2/11
  R = std::fma(R, z, 0x1.c71c72p-3f);  // 2/9
  R = std::fma(R, z, 0x1.24924ap-2f);  // 2/7
  R = std::fma(R, z, 0x1.99999ap-2f);  // 2/5
  R = std::fma(R, z, 0x1.555556p-1f);  // 2/3
  R = R * z;
  const float hfsq = 0.5f * (f * f);
  const float small = s * (hfsq + R) + std::fma(dk, kLn2Lo, c);
  const float rest = f - (hfsq - small);
  return std::fma(dk, kLn2Hi, rest);
}

// Split a positive normal float u into u = m * 2^k with m in [sqrt(1/2), sqrt(2)).
DSV4_HD float split_sqrt2(float u, int& k) {
  uint32_t b = f32_bits(u);
  b += 0x3f800000u - 0x3f3504f3u;
  k = int(b >> 23) - 127;
  b = (b & 0x007fffffu) + 0x3f3504f3u;
  return f32_from_bits(b);
}

// log1p(x + xl) for finite x > -1 with |x| >= 2^-24 and |xl| <= ulp(x) (a double-float argument).
// u = fl(1 + x) = m 2^k; log1p = k ln2 + log(m) + c / u where c = (1 + x - u) + xl, the rounding
// error of 1 + x (exact, Fast2Sum of the larger and the smaller of 1 and x) plus the low part.
DSV4_HD float log1p_dd(float x, float xl) {
  const float u = 1.0f + x;
  int k;
  const float m = split_sqrt2(u, k);
  float c = (x > 1.0f) ? 1.0f - (u - x) : x - (u - 1.0f);
  c = (c + xl) / u;
  return log1p_reduced(m - 1.0f, float(k), c);
}

// pi/2 = P1 + P2 + P3 + O(1.1e-23), each part an fp32 value.
constexpr float kPio2_1 = 0x1.921fb6p+0f;
constexpr float kPio2_2 = -0x1.777a5cp-25f;
constexpr float kPio2_3 = -0x1.ee59dap-50f;
constexpr float kTwoOverPi = 0x1.45f306p-1f;

// sin(r + rl) for |r| <= pi/4 + tiny, |rl| <= ulp(r). Taylor series to r^13 (tail < 1e-11 rel).
DSV4_HD float sin_kernel(float r, float rl) {
  const float z = r * r;
  float p = 0x1.612462p-33f;             // 1/13!
  p = std::fma(p, z, -0x1.ae6456p-26f);  // -1/11!
  p = std::fma(p, z, 0x1.71de3ap-19f);   // 1/9!
  p = std::fma(p, z, -0x1.a01a02p-13f);  // -1/7!
  p = std::fma(p, z, 0x1.111112p-7f);    // 1/5!
  p = std::fma(p, z, -0x1.555556p-3f);   // -1/3!
  // sin(r + rl) = sin r + rl cos r,  cos r ~= 1 - z/2 is plenty for a term of size ulp(r).
  const float tail = rl * std::fma(-0.5f, z, 1.0f);
  return r + std::fma(r * z, p, tail);
}

// cos(r + rl) for |r| <= pi/4 + tiny. Taylor series to r^12 (tail < 2e-12).
// cos = 1 - z/2 + z^2 q(z); w = 1 - z/2 is rounded, and its rounding error ((1 - w) - z/2, exact)
// and that of z (from an fma) are added back with the small terms.
DSV4_HD float cos_kernel(float r, float rl) {
  const float z = r * r;
  const float zl = std::fma(r, r, -z);   // exact: r*r = z + zl
  float q = 0x1.1eed8ep-29f;             // 1/12!
  q = std::fma(q, z, -0x1.27e4fcp-22f);  // -1/10!
  q = std::fma(q, z, 0x1.a01a02p-16f);   // 1/8!
  q = std::fma(q, z, -0x1.6c16c2p-10f);  // -1/6!
  q = std::fma(q, z, 0x1.555556p-5f);    // 1/4!
  const float hz = 0.5f * z;
  const float w = 1.0f - hz;
  const float werr = ((1.0f - w) - hz) - 0.5f * zl;
  // derivative term: cos(r + rl) ~= cos r - rl sin r ~= cos r - rl r
  const float small = std::fma(z * z, q, std::fma(-r, rl, werr));
  return w + small;
}

// x = k * pi/2 + (r + rl) with |r| <= pi/4 (approximately), for |x| <= 2^22. The first product
// k * P1 and x - k * P1 are exact (fma, and the difference fits in 24 bits); the second step is an
// exact two-sum of r1 and the exact product k * P2; the remaining errors are far below ulp(r).
// Returns k mod 4 as the quadrant.
DSV4_HD int reduce_pio2(float x, float& r, float& rl) {
  const float kf = round_even(x * kTwoOverPi);
  const float r1 = std::fma(-kf, kPio2_1, x);
  const float p = kf * kPio2_2;
  const float pe = std::fma(kf, kPio2_2, -p);  // k * P2 = p + pe exactly
  // two-sum: s + e = r1 - p exactly
  const float s = r1 - p;
  const float bb = s - r1;
  const float e = (r1 - (s - bb)) + (-p - bb);
  const float lo = std::fma(-kf, kPio2_3, e - pe);
  r = s + lo;
  rl = lo - (r - s);
  // quadrant: kf - 4 floor(kf / 4) is exact for any integer-valued kf
  const float q = kf - 4.0f * std::floor(kf * 0.25f);
  return int(q);
}

// Reduction for |x| > 2^22 (outside the accuracy contract): a deterministic, bounded fallback.
// Brings x into [0, 2 pi) with a plain fp32 multiply/floor; the result is not accurate.
DSV4_HD float reduce_huge(float x) {
  const float t = x * 0x1.45f306p-3f;  // 1 / (2 pi)
  const float fr = t - std::floor(t);
  return fr * 0x1.921fb6p+2f;  // 2 pi
}

DSV4_HD float sincos_impl(float x, bool want_cos) {
  if (is_nan(x)) return x;
  const float ax = std::fabs(x);
  if (ax == kInf) return kNaN;
  if (!want_cos && ax < 0x1p-12f) return x;  // sin x = x (1 - x^2/6), |x^2/6| < 2^-25: exact-rounded
  if (ax > 0x1p22f) x = reduce_huge(x);
  float r, rl;
  const int q = reduce_pio2(x, r, rl) + (want_cos ? 1 : 0);
  switch (q & 3) {
    case 0:
      return sin_kernel(r, rl);
    case 1:
      return cos_kernel(r, rl);
    case 2:
      return -sin_kernel(r, rl);
    default:
      return -cos_kernel(r, rl);
  }
}

// exp(x) = (ph + pl) 2^k for x in [-104, 89], ph in [0.7, 1.42], |pl| <= ulp(ph) / 2, relative
// error of ph + pl about 2^-28.
// x = k ln2 + r + rl, |r| <= ln2/2 (+ tiny): the first reduction step is exact (fma), the second
// rounds and its error rl is kept. exp(r + rl) = 1 + r + (r^2 u(r) + rl) with u the Taylor series
// 1/2! .. 1/8! (tail < 2.1e-10 relative); 1 + r is split exactly (Fast2Sum) so the only large
// rounding is that of ph.
DSV4_HD int exp_core(float x, float& ph, float& pl) {
  const float kf = round_even(x * kLog2e);
  const float r1 = std::fma(-kf, kLn2Hi, x);  // exact
  const float r = std::fma(-kf, kLn2Lo, r1);
  const float rl = std::fma(-kf, kLn2Lo, r1 - r);
  float u = 0x1.a01a02p-16f;            // 1/8!
  u = std::fma(u, r, 0x1.a01a02p-13f);  // 1/7!
  u = std::fma(u, r, 0x1.6c16c2p-10f);  // 1/6!
  u = std::fma(u, r, 0x1.111112p-7f);   // 1/5!
  u = std::fma(u, r, 0x1.555556p-5f);   // 1/4!
  u = std::fma(u, r, 0x1.555556p-3f);   // 1/3!
  u = std::fma(u, r, 0.5f);
  const float t = std::fma(u, r * r, rl);
  const float h1 = 1.0f + r;
  const float l1 = ((1.0f - h1) + r) + t;  // 1 + r = h1 + ((1 - h1) + r) exactly (Fast2Sum)
  ph = h1 + l1;
  pl = l1 - (ph - h1);  // renormalise: |pl| <= ulp(ph) / 2
  return int(kf);
}

}  // namespace detail

// ---- bf16 --------------------------------------------------------------------------------------
DSV4_HD uint16_t bf16_bits(float x) {
  uint32_t u = f32_bits(x);
  if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x0040u);  // NaN: keep sign, quiet
  u += 0x7fffu + ((u >> 16) & 1u);  // round to nearest even; carries into the exponent (-> inf)
  return uint16_t(u >> 16);
}

// ---- fp16 --------------------------------------------------------------------------------------
DSV4_HD float f16_to_f32(uint16_t h) {
  const uint32_t sign = uint32_t(h & 0x8000u) << 16;
  const uint32_t e = (h >> 10) & 0x1fu;
  const uint32_t m = h & 0x3ffu;
  if (e == 0) {
    // zero or subnormal: m * 2^-24, exact in fp32
    const float v = float(m) * 0x1p-24f;
    return f32_from_bits(f32_bits(v) | sign);
  }
  if (e == 31) return f32_from_bits(sign | 0x7f800000u | (m << 13));  // inf / NaN (payload kept)
  return f32_from_bits(sign | ((e + 112u) << 23) | (m << 13));
}

// ---- fp8 e4m3 ----------------------------------------------------------------------------------
DSV4_HD uint8_t e4m3_bits(float x) {
  const uint32_t u = f32_bits(x);
  const uint8_t sign = uint8_t((u >> 24) & 0x80u);
  if ((u & 0x7fffffffu) > 0x7f800000u) return uint8_t(sign | 0x7fu);
  const float a = std::fabs(x);
  if (a >= 448.0f) return uint8_t(sign | 0x7eu);  // saturate (includes inf)
  if (a < 0x1p-6f) {
    // subnormal range: step 2^-9; code = round_even(a * 2^9) in [0, 8] (8 = smallest normal)
    const float q = detail::round_even(a * 0x1p9f);
    return uint8_t(sign | uint8_t(q));
  }
  // normal: round the 23-bit mantissa to 3 bits (RNE); a carry moves into the exponent
  uint32_t b = f32_bits(a);
  b += 0x7ffffu + ((b >> 20) & 1u);
  const uint32_t e = (b >> 23) - 127u + 7u;
  const uint32_t m = (b >> 20) & 7u;
  uint32_t code = (e << 3) | m;
  if (code > 0x7eu) code = 0x7eu;  // 448 < a < 464 rounds to 448; a >= 464 is caught above anyway
  return uint8_t(sign | code);
}

DSV4_HD float e4m3_to_f32(uint8_t b) {
  const uint32_t sign = uint32_t(b & 0x80u) << 24;
  const uint32_t e = (b >> 3) & 0xfu;
  const uint32_t m = b & 7u;
  if (e == 15 && m == 7) return f32_from_bits(sign | 0x7fc00000u);
  if (e == 0) return f32_from_bits(f32_bits(float(m) * 0x1p-9f) | sign);
  return f32_from_bits(sign | ((e + 120u) << 23) | (m << 20));
}

// ---- fp4 e2m1 ----------------------------------------------------------------------------------
// Decision points are the midpoints of the grid; at a midpoint the even code wins:
//   0.25 -> 0 (0), 0.75 -> 1.0 (2), 1.25 -> 1.0 (2), 1.75 -> 2 (4), 2.5 -> 2 (4), 3.5 -> 4 (6),
//   5 -> 4 (6). NaN (no encoding) falls through every comparison and becomes the largest code (+-6).
DSV4_HD uint8_t e2m1_bits(float x) {
  const uint8_t sign = uint8_t((f32_bits(x) >> 28) & 0x8u);
  const float a = std::fabs(x);
  uint8_t c;
  if (a <= 0.25f)
    c = 0;
  else if (a < 0.75f)
    c = 1;
  else if (a <= 1.25f)
    c = 2;
  else if (a < 1.75f)
    c = 3;
  else if (a <= 2.5f)
    c = 4;
  else if (a < 3.5f)
    c = 5;
  else if (a <= 5.0f)
    c = 6;
  else
    c = 7;
  return uint8_t(sign | c);
}

DSV4_HD float e2m1_to_f32(uint8_t b) {
  const uint32_t e = (b >> 1) & 3u;
  const uint32_t m = b & 1u;
  // e == 0: m * 0.5; else (1 + m/2) * 2^(e-1)
  const float mag = (e == 0) ? float(m) * 0.5f : (1.0f + float(m) * 0.5f) * detail::pow2i(int(e) - 1);
  return (b & 0x8u) ? -mag : mag;
}

// ---- power-of-two scales (UE8M0) ----------------------------------------------------------------
// 2^ceil(log2 v) for a positive finite v, read from v's bits: exponent - 127, plus 1 if any mantissa
// bit is set (MODEL.md §4.1). v must be a normal number (the callers' amax floors guarantee it) and
// below 2^127 (the result 2^128 would come out as +inf).
DSV4_HD float ceil_pow2(float v) {
  const uint32_t b = f32_bits(v);
  const uint32_t e = (b >> 23) + ((b & 0x007fffffu) ? 1u : 0u);  // biased exponent of the result
  return f32_from_bits(e << 23);
}

// ---- exp ----------------------------------------------------------------------------------------
DSV4_HD float exp_f(float x) {
  if (detail::is_nan(x)) return x;
  if (x > 89.0f) return detail::kInf;
  if (x < -104.0f) return 0.0f;
  float ph, pl;
  const int k = detail::exp_core(x, ph, pl);
  const float p = ph;
  if (k > 127) return (p * 2.0f) * detail::pow2i(k - 1);        // k == 128: may overflow to inf (correct)
  if (k < -126) return (p * detail::pow2i(k + 64)) * 0x1p-64f;  // one rounding into the subnormals
  return p * detail::pow2i(k);
}

// x = k ln2 + r with k = round(x log2 e), taken by the add of 1.5 * 2^23 (j's low mantissa bits then hold
// k, so j's bits shifted up by 23 are k in the exponent field: the multiple of 2^32 that bits(1.5 * 2^23)
// << 23 leaves is dropped by the 32-bit add), r by the two-part reduction (|r| <= ln2/2 + tiny, an
// absolute error under 2^-35). e^r = sum r^n / n! to n = 7 (remainder < 7.5e-9 relative) in Horner form;
// for x >= -87, k >= -126 and e^r >= 1 when k = -126, so p 2^k is a normal float.
DSV4_HD float exp_fast_nonpos(float x) {
  const float j = std::fma(x, detail::kLog2e, detail::kRoundMagic);
  const float kf = j - detail::kRoundMagic;
  float r = std::fma(-kf, detail::kLn2Hi, x);
  r = std::fma(-kf, detail::kLn2Lo, r);
  float p = 0x1.a01a02p-13f;            // 1/7!
  p = std::fma(p, r, 0x1.6c16c2p-10f);  // 1/6!
  p = std::fma(p, r, 0x1.111112p-7f);   // 1/5!
  p = std::fma(p, r, 0x1.555556p-5f);   // 1/4!
  p = std::fma(p, r, 0x1.555556p-3f);   // 1/3!
  p = std::fma(p, r, 0.5f);
  p = std::fma(p, r, 1.0f);
  p = std::fma(p, r, 1.0f);
  const float y = f32_from_bits(f32_bits(p) + (f32_bits(j) << 23));
  const float z = x < -87.0f ? 0.0f : y;
  return detail::is_nan(x) ? x : z;
}

// ---- log ----------------------------------------------------------------------------------------
DSV4_HD float log_f(float x) {
  if (detail::is_nan(x)) return x;
  if (x < 0.0f) return detail::kNaN;
  if (x == 0.0f) return -detail::kInf;
  if (x == detail::kInf) return x;
  int kadj = 0;
  if (x < 0x1p-126f) {
    x *= 0x1p25f;  // subnormal input: scale into the normal range (exact)
    kadj = -25;
  }
  int k;
  const float m = detail::split_sqrt2(x, k);
  return detail::log1p_reduced(m - 1.0f, float(k + kadj), 0.0f);  // m - 1 is exact (Sterbenz)
}

DSV4_HD float log1p_f(float x) {
  if (detail::is_nan(x)) return x;
  if (x < -1.0f) return detail::kNaN;
  if (x == -1.0f) return -detail::kInf;
  if (x == detail::kInf) return x;
  if (std::fabs(x) < 0x1p-24f) return x;  // log1p(x) = x - x^2/2 + ..., x^2/2 < ulp(x)/2; keeps -0
  return detail::log1p_dd(x, 0.0f);
}

// ---- sin / cos ---------------------------------------------------------------------------------
DSV4_HD float sin_f(float x) {
  return detail::sincos_impl(x, false);
}
DSV4_HD float cos_f(float x) {
  return detail::sincos_impl(x, true);
}

// ---- sigmoid / softplus ------------------------------------------------------------------------
// sigmoid: e = exp(-|x|) <= 1 is taken as a double-float (exp_core), so 1 + e and the quotient are
// formed with one significant rounding: x >= 0: 1 / (1 + e); x < 0: e / (1 + e). The quotient's
// remainder is computed exactly with an fma and folded back in. Below x = -80, 1 + e == 1 and the
// result is exp(x) itself (relative difference < 2^-115), and above 80 it is 1.
DSV4_HD float sigmoid_f(float x) {
  if (detail::is_nan(x)) return x;
  if (x < -80.0f) return exp_f(x);
  if (x > 80.0f) return 1.0f;  // 1 / (1 + e), e < 2^-115
  float ph, pl;
  const int k = detail::exp_core(-std::fabs(x), ph, pl);  // k in [-116, 0]
  const float sc = detail::pow2i(k);
  const float eh = ph * sc, el = pl * sc;  // exact scaling (normal range)
  const float dh = 1.0f + eh;
  const float dl = ((1.0f - dh) + eh) + el;  // 1 + e = dh + dl (Fast2Sum, |eh| <= 1)
  const float nh = x >= 0.0f ? 1.0f : eh;
  const float nl = x >= 0.0f ? 0.0f : el;
  const float q = nh / dh;
  const float rem = std::fma(-q, dh, nh);  // exact
  return q + (rem + std::fma(-q, dl, nl)) / dh;
}

// softplus: x for x > 20 (torch's threshold); below, with e = exp(-|x|) as a double-float
// (exp_core): x + log1p(e) for 0 < x <= 20, log1p(e) for -17 <= x <= 0, and exp(x) below -17 where
// log1p(e) = e to within e/2 < 2^-25.
DSV4_HD float softplus_f(float x) {
  if (detail::is_nan(x)) return x;
  if (x > 20.0f) return x;
  if (x < -17.0f) return exp_f(x);
  float ph, pl;
  const int k = detail::exp_core(-std::fabs(x), ph, pl);  // k in [-29, 0]
  const float sc = detail::pow2i(k);
  const float l = detail::log1p_dd(ph * sc, pl * sc);  // exact scaling
  return x > 0.0f ? x + l : l;
}

// x = k ln2 + r with |r| <= ln2 / 2 (Cody-Waite: ln2_hi has 32 significant bits, so k * ln2_hi and
// x - k * ln2_hi are exact for |k| < 2^11); e^r by its Taylor series to degree 13 (the remainder is below
// 2^-60 relative), evaluated by Horner's rule; then scaled by 2^k.
inline double exp_f64(double x) {
  if (std::isnan(x)) return x;
  if (x > 709.8) return HUGE_VAL;
  if (x < -745.2) return 0.0;
  constexpr double kLog2e = 1.4426950408889634;
  constexpr double kLn2Hi = 6.93147180369123816490e-01;  // 0x3fe62e42fee00000
  constexpr double kLn2Lo = 1.90821492927058770002e-10;
  const double k = std::nearbyint(x * kLog2e);
  const double r = (x - k * kLn2Hi) - k * kLn2Lo;
  // 1 / n! for n = 13 down to 2.
  constexpr double kInvFact[] = {1.0 / 6227020800.0, 1.0 / 479001600.0, 1.0 / 39916800.0, 1.0 / 3628800.0,
                                 1.0 / 362880.0,     1.0 / 40320.0,     1.0 / 5040.0,     1.0 / 720.0,
                                 1.0 / 120.0,        1.0 / 24.0,        1.0 / 6.0,        0.5};
  double p = kInvFact[0];
  for (int i = 1; i < 12; ++i) p = p * r + kInvFact[i];
  p = p * r + 1.0;
  p = p * r + 1.0;
  return std::ldexp(p, int(k));
}

}  // namespace dsv4::num
