// RoPE / YaRN (MODEL.md §3.3): interleaved pairs (x[2i], x[2i+1]) of the last `rd` dims of a vector.
#pragma once

#include <cstdint>

namespace dsv4 {

struct RopeSpec {
  int rd = 64;            // rotary dims (even)
  float base = 10000.0f;  // theta
  bool yarn = false;      // YaRN frequency ramp on/off
  float factor = 16.0f;   // YaRN scaling factor
  int64_t original_max_position = 65536;
  float beta_fast = 32.0f, beta_slow = 1.0f;
};

// freq[i], i = 0..rd/2-1, in fp32, using kernels/numerics (no libm):
//   freq_i = exp_f(-(2i/rd) * log_f(base))
//   yarn: corr(n) = rd * log_f(L0 / (n * 2π)) / (2 * log_f(base)); low = max(floor(corr(beta_fast)), 0);
//         high = min(ceil(corr(beta_slow)), rd - 1); high += 0.001 if equal;
//         ramp_i = clamp((i - low) / (high - low), 0, 1); freq_i = freq_i/factor * ramp_i + freq_i * (1 -
//         ramp_i)
void rope_freqs(const RopeSpec& s, float* freq);

// Rotates, for every row t and head h, the `rd` values starting at
//   x + t * ld + h * head_stride + offset
// by the angle fp32(pos[t]) * freq[i]: (a, b) -> (a cos - b sin, a sin + b cos); inverse: the
// conjugate rotation. fp32 math, each result rounded to bf16 when round_bf16.
struct RopeApplyParams {
  int64_t rows = 0;
  int heads = 1;
  float* x = nullptr;
  int64_t ld = 0, head_stride = 0, offset = 0;
  const int64_t* pos = nullptr;  // [rows]
  const float* freq = nullptr;   // [rd/2]
  int rd = 64;
  bool inverse = false;
  bool round_bf16 = true;
};
const char* rope_apply_check(const RopeApplyParams& p);
void rope_apply(const RopeApplyParams& p);

}  // namespace dsv4
