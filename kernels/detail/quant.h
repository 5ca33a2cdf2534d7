// Shared CPU/CUDA arithmetic of the block FP8 / FP4 simulation (kernels/quant.h); conventions in
// kernels/detail/shared.h. Each function handles one block of n contiguous values.
#pragma once

#include <cmath>
#include <cstdint>

#include "kernels/detail/shared.h"
#include "kernels/quant.h"

namespace dsv4::common {

// max |x[i]| over n values, starting from 0 (fp32; NaN inputs are skipped by the comparison).
DSV4_HD float block_amax(const float* x, int64_t n) {
  float m = 0.0f;
  for (int64_t i = 0; i < n; ++i) {
    const float a = std::fabs(x[i]);
    if (a > m) m = a;
  }
  return m;
}

// FP8 block scale: amax floored at 1e-4, v = amax * fp32(1/448) (a multiply, not a division: it
// decides which side of a power of two v falls on), then v itself or 2^ceil(log2 v).
DSV4_HD float fp8_scale(float amax, ScaleFmt fmt) {
  const float v = std::fmax(amax, 1e-4f) * (1.0f / 448.0f);
  return fmt == ScaleFmt::ue8m0 ? num::ceil_pow2(v) : v;
}

// FP4 block scale: amax floored at 6 * 2^-126, s = 2^ceil(log2(amax * fp32(1/6))).
DSV4_HD float fp4_scale(float amax) {
  return num::ceil_pow2(std::fmax(amax, 6.0f * 0x1p-126f) * (1.0f / 6.0f));
}

// act_quant of one block: q[i] = e4m3(clamp(x[i] / s, -448, 448)); returns the scale s.
DSV4_HD float act_quant_block(const float* x, int64_t n, ScaleFmt fmt, uint8_t* q) {
  const float s = fp8_scale(block_amax(x, n), fmt);
  for (int64_t i = 0; i < n; ++i) q[i] = num::e4m3_bits(clampf(x[i] / s, -448.0f, 448.0f));
  return s;
}

// fp8_sim of one block in place: x[i] = bf16(fp32(e4m3(clamp(x[i] / s, -448, 448))) * s).
DSV4_HD void fp8_sim_block(float* x, int64_t n, ScaleFmt fmt) {
  const float s = fp8_scale(block_amax(x, n), fmt);
  for (int64_t i = 0; i < n; ++i) {
    const uint8_t q = num::e4m3_bits(clampf(x[i] / s, -448.0f, 448.0f));
    x[i] = num::bf16_round(num::e4m3_to_f32(q) * s);
  }
}

// fp8_sim_inplace_bf16_cast of one block in place: the inner cast targets bf16 (the input dtype),
// not e4m3: x[i] = bf16(bf16(clamp(x[i] / s, -448, 448)) * s).
DSV4_HD void fp8_bf16_cast_block(float* x, int64_t n, ScaleFmt fmt) {
  const float s = fp8_scale(block_amax(x, n), fmt);
  for (int64_t i = 0; i < n; ++i)
    x[i] = num::bf16_round(num::bf16_round(clampf(x[i] / s, -448.0f, 448.0f)) * s);
}

// fp4_sim of one block in place: x[i] = bf16(fp32(e2m1(clamp(x[i] / s, -6, 6))) * s).
DSV4_HD void fp4_sim_block(float* x, int64_t n) {
  const float s = fp4_scale(block_amax(x, n));
  for (int64_t i = 0; i < n; ++i) {
    const uint8_t q = num::e2m1_bits(clampf(x[i] / s, -6.0f, 6.0f));
    x[i] = num::bf16_round(num::e2m1_to_f32(q) * s);
  }
}

}  // namespace dsv4::common
