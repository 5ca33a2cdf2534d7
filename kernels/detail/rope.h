// Shared CPU/CUDA arithmetic of RoPE (kernels/rope.h); conventions in kernels/detail/shared.h.
#pragma once

#include <cstdint>

#include "kernels/detail/shared.h"

namespace dsv4::common {

// cos and sin of the angle fp32(pos) * freq (our own cos_f / sin_f).
DSV4_HD void rope_cos_sin(int64_t pos, float freq, float& c, float& s) {
  const float angle = float(pos) * freq;
  c = num::cos_f(angle);
  s = num::sin_f(angle);
}

// Rotates the pair (v[0], v[1]) = (a, b) by the angle with cosine c and sine s:
// (a c - b s, a s + b c), or the inverse (a c + b s, b c - a s): each output is two rounded products
// and one rounded addition or subtraction, then rounded to bf16 when round_bf16.
DSV4_HD void rope_rotate(float* v, float c, float s, bool inverse, bool round_bf16) {
  const float a = v[0], b = v[1];
  float ra, rb;
  if (!inverse) {
    ra = a * c - b * s;
    rb = a * s + b * c;
  } else {
    ra = a * c + b * s;
    rb = b * c - a * s;  // -a*s + b*c: the same rounded value
  }
  if (round_bf16) {
    ra = num::bf16_round(ra);
    rb = num::bf16_round(rb);
  }
  v[0] = ra;
  v[1] = rb;
}

}  // namespace dsv4::common
