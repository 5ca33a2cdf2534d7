// Numerics shared by the CPU reference and the CUDA kernels: explicit rounding to the storage types
// (bf16, fp8 e4m3, fp4 e2m1) and our own transcendental functions.
//
// Why our own exp/log/sin/cos: libm's results differ between machines and versions and CUDA's differ
// from libm, so a runtime that calls them cannot be bit-identical across machines or across CPU and
// GPU. The functions below use only +, -, *, explicit fma, IEEE division and sqrt, integer bit
// manipulation and fixed constants, so they give the same bits wherever IEEE fp32 is implemented.
// Their accuracy in ulp (against long double) is documented next to each and checked by
// tests/test_numerics.cpp. Everything here is header-only and usable from device code.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include "kernels/numerics/hd.h"

namespace dsv4::num {

// ---- bit casts -------------------------------------------------------------------------------
DSV4_HD uint32_t f32_bits(float x) {
  uint32_t u;
  std::memcpy(&u, &x, 4);
  return u;
}
DSV4_HD float f32_from_bits(uint32_t u) {
  float x;
  std::memcpy(&x, &u, 4);
  return x;
}

// ---- bf16 --------------------------------------------------------------------------------------
// fp32 -> bf16 bits, round to nearest even; NaN stays NaN (quiet bit set), +-inf stays inf;
// overflow rounds to inf as IEEE does.
DSV4_HD uint16_t bf16_bits(float x);
DSV4_HD float bf16_to_f32(uint16_t b) {
  return f32_from_bits(uint32_t(b) << 16);
}
// Round an fp32 value to the nearest bf16 value (returned as fp32, exactly representable in bf16).
DSV4_HD float bf16_round(float x) {
  return bf16_to_f32(bf16_bits(x));
}

// ---- fp16 (safetensors F16 weights) -----------------------------------------------------------
DSV4_HD float f16_to_f32(uint16_t h);

// ---- fp8 e4m3 (OCP "e4m3fn": bias 7, no inf, 0x7f/0xff NaN, max 448) -------------------------
// fp32 -> e4m3 bits, round to nearest even, saturating to +-448 (values beyond the range, including
// +-inf, become +-448); NaN -> 0x7f (sign kept).
DSV4_HD uint8_t e4m3_bits(float x);
DSV4_HD float e4m3_to_f32(uint8_t b);

// ---- fp4 e2m1 (grid {0, 0.5, 1, 1.5, 2, 3, 4, 6}, no inf/NaN) ----------------------------------
// fp32 -> e2m1 code (sign in bit 3), round to nearest with ties to the even code, saturating to +-6
// (+-inf and NaN, which the format cannot hold, become +-6).
DSV4_HD uint8_t e2m1_bits(float x);
DSV4_HD float e2m1_to_f32(uint8_t b);

// ---- transcendental functions -----------------------------------------------------------------
// Accuracy contracts (max error against long double, in ulps of the exact result; the tests measure
// and print the maximum over dense sweeps, random bit patterns and the special cases):
//   exp_f    <= 1 ulp; exp_f(x) = +inf above ~88.7228 (where e^x rounds to inf), subnormal results
//            below -87.34, 0 below -103.98; NaN -> NaN
//   log_f    <= 1 ulp on (0, inf] (subnormals included); log_f(+-0) = -inf, log_f(x<0) = NaN
//   log1p_f  <= 1 ulp on (-1, inf]; log1p_f(-1) = -inf, x < -1 -> NaN, keeps -0
//   sin_f/cos_f <= 1 ulp for |x| <= 2^20 (RoPE angles are below 2^20 for positions < 2^20); beyond
//            that the result is deterministic and in [-1, 1] but not accurate; +-inf -> NaN
//   sigmoid_f <= 1 ulp; softplus_f <= 2 ulp, softplus_f(x) = x for x > 20 (as torch does)
DSV4_HD float exp_f(float x);
// The tensor_core order's softmax exponent (kernels/cuda/attention_tc.cu; fast numerics only, the exact
// order keeps exp_f): e^x for x in [-87, 0] within 1 ulp, 0 below -87 (where e^x < 1.7e-38, far under
// an ulp of any softmax sum, which holds a term of 1), NaN -> NaN; x > 0 is outside its contract. About
// 16 instructions against about 40 for exp_f's bits without branches: 2^k by an integer add to the exponent
// field, one rounded argument reduction, a degree-7 polynomial, no subnormal results.
DSV4_HD float exp_fast_nonpos(float x);
DSV4_HD float log_f(float x);
DSV4_HD float log1p_f(float x);
DSV4_HD float sin_f(float x);
DSV4_HD float cos_f(float x);
DSV4_HD float sigmoid_f(float x);   // 1 / (1 + exp(-x))
DSV4_HD float softplus_f(float x);  // log(1 + exp(x)), x for x > 20
DSV4_HD float silu_f(float x) {
  return x * sigmoid_f(x);
}

// e^x in fp64, on the host: the policy loss's importance ratios (train/loss.cpp), the diff report's
// per-token ratios (replay/diff.cpp) and the viewer's. Only IEEE +, -, *, nearbyint and ldexp (exact
// scaling by a power of two, correctly rounded into subnormals), so the same bits on every machine,
// where libm's exp may differ in its last bit. Error < 2 fp64 ulps (1.11 measured by
// Transcendental.ExpF64 against long double over 400k points); +inf above 709.8, 0 below -745.2;
// NaN -> NaN.
inline double exp_f64(double x);

// 2^ceil(log2 v) from v's bits (exponent - 127, +1 if any mantissa bit is set): the UE8M0 block scale
// of MODEL.md §4.1/§4.3. v must be positive and normal.
DSV4_HD float ceil_pow2(float v);

}  // namespace dsv4::num

#include "kernels/numerics/numerics_impl.h"
