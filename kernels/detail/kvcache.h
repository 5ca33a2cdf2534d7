// Shared CPU/CUDA arithmetic of the cached-row codec (kernels/kvcache.h); conventions in
// kernels/detail/shared.h. Each function handles one row.
#pragma once

#include <cstdint>

#include "kernels/detail/quant.h"
#include "kernels/detail/shared.h"
#include "kernels/kvcache.h"

namespace dsv4::common {

// Encodes one row x [f.dim] into out [f.bytes()].
DSV4_HD void kv_encode_row(const KvRowFormat& f, const float* x, uint8_t* out) {
  uint8_t* exps = out + f.fp8_dims;
  for (int64_t b = 0; b < f.scales(); ++b) {
    const float s = act_quant_block(x + b * f.block, f.block, ScaleFmt::ue8m0, out + b * f.block);
    exps[b] = uint8_t(num::f32_bits(s) >> 23);  // a normal power of two: its biased exponent
  }
  uint8_t* tail = exps + f.scales();
  for (int64_t i = f.fp8_dims; i < f.dim; ++i) {
    const uint16_t h = num::bf16_bits(x[i]);
    tail[2 * (i - f.fp8_dims)] = uint8_t(h & 0xff);
    tail[2 * (i - f.fp8_dims) + 1] = uint8_t(h >> 8);
  }
}

// Decodes one row in [f.bytes()] into y [f.dim].
DSV4_HD void kv_decode_row(const KvRowFormat& f, const uint8_t* in, float* y) {
  const uint8_t* exps = in + f.fp8_dims;
  for (int64_t b = 0; b < f.scales(); ++b) {
    const float s = num::f32_from_bits(uint32_t(exps[b]) << 23);
    for (int64_t i = b * f.block; i < (b + 1) * f.block; ++i)
      y[i] = num::bf16_round(num::e4m3_to_f32(in[i]) * s);
  }
  const uint8_t* tail = exps + f.scales();
  for (int64_t i = f.fp8_dims; i < f.dim; ++i)
    y[i] = num::bf16_to_f32(
        uint16_t(tail[2 * (i - f.fp8_dims)] | (uint16_t(tail[2 * (i - f.fp8_dims) + 1]) << 8)));
}

}  // namespace dsv4::common
