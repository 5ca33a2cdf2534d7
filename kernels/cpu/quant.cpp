// Block FP8 / FP4 simulation (MODEL.md §4.1-4.3) in the operation order documented in kernels/quant.h.
// Every block is independent and its amax is a max (exact in any order), so results do not depend on
// the thread count; rows are spread over OpenMP threads only when the tensor is large.
#include "kernels/quant.h"

#include <cmath>

#include "kernels/numerics/numerics.h"

namespace dsv4 {

namespace {

constexpr int64_t kParallelMin = int64_t(1) << 15;  // elements; below this threads cost more than they save

// max |x[i]| over n values (fp32; NaN inputs are skipped by the comparison).
float block_amax(const float* x, int64_t n) {
  float m = 0.0f;
  for (int64_t i = 0; i < n; ++i) {
    const float a = std::fabs(x[i]);
    if (a > m) m = a;
  }
  return m;
}

// FP8 block scale: amax floored at 1e-4, v = amax * fp32(1/448) (a multiply, not a division: it
// decides which side of a power of two v falls on), then v itself or 2^ceil(log2 v).
float fp8_scale(float amax, ScaleFmt fmt) {
  const float v = std::fmax(amax, 1e-4f) * (1.0f / 448.0f);
  return fmt == ScaleFmt::ue8m0 ? num::ceil_pow2(v) : v;
}

// FP4 block scale: amax floored at 6 * 2^-126, s = 2^ceil(log2(amax * fp32(1/6))).
float fp4_scale(float amax) {
  return num::ceil_pow2(std::fmax(amax, 6.0f * 0x1p-126f) * (1.0f / 6.0f));
}

float clampf(float v, float lo, float hi) {
  return v < lo ? lo : (v > hi ? hi : v);
}

const char* block_params_check(int64_t rows, int64_t cols, int block, const char* what_block) {
  if (rows < 0) return "rows is negative";
  if (cols < 0) return "cols is negative";
  if (block <= 0) return what_block;
  if (cols % block != 0) return "cols is not a multiple of block";
  return nullptr;
}

}  // namespace

const char* act_quant_check(const ActQuantParams& p) {
  if (const char* e = block_params_check(p.rows, p.cols, p.block, "block is not positive")) return e;
  if (p.rows > 0 && p.cols > 0) {
    if (!p.x) return "x is null";
    if (!p.q) return "q is null";
    if (!p.scale) return "scale is null";
  }
  return nullptr;
}

void act_quant(const ActQuantParams& p) {
  const int64_t nb = p.cols / p.block;
#pragma omp parallel for schedule(static) if (p.rows * p.cols >= kParallelMin)
  for (int64_t r = 0; r < p.rows; ++r) {
    for (int64_t b = 0; b < nb; ++b) {
      const int64_t off = r * p.cols + b * p.block;
      const float* x = p.x + off;
      uint8_t* q = p.q + off;
      const float s = fp8_scale(block_amax(x, p.block), p.fmt);
      for (int i = 0; i < p.block; ++i) q[i] = num::e4m3_bits(clampf(x[i] / s, -448.0f, 448.0f));
      p.scale[r * nb + b] = s;
    }
  }
}

const char* fp8_sim_check(const Fp8SimParams& p) {
  if (const char* e = block_params_check(p.rows, p.cols, p.block, "block is not positive")) return e;
  if (p.rows > 0 && p.cols > 0) {
    if (p.ld < p.cols) return "ld is less than cols";
    if (!p.x) return "x is null";
  }
  return nullptr;
}

void fp8_sim(const Fp8SimParams& p) {
  const int64_t nb = p.cols / p.block;
#pragma omp parallel for schedule(static) if (p.rows * p.cols >= kParallelMin)
  for (int64_t r = 0; r < p.rows; ++r) {
    for (int64_t b = 0; b < nb; ++b) {
      float* x = p.x + r * p.ld + b * p.block;
      const float s = fp8_scale(block_amax(x, p.block), p.fmt);
      for (int i = 0; i < p.block; ++i) {
        const uint8_t q = num::e4m3_bits(clampf(x[i] / s, -448.0f, 448.0f));
        x[i] = num::bf16_round(num::e4m3_to_f32(q) * s);
      }
    }
  }
}

void fp8_sim_inplace_bf16_cast(const Fp8SimParams& p) {
  const int64_t nb = p.cols / p.block;
#pragma omp parallel for schedule(static) if (p.rows * p.cols >= kParallelMin)
  for (int64_t r = 0; r < p.rows; ++r) {
    for (int64_t b = 0; b < nb; ++b) {
      float* x = p.x + r * p.ld + b * p.block;
      const float s = fp8_scale(block_amax(x, p.block), p.fmt);
      // The inner cast targets bf16 (the input dtype), not e4m3; the product goes back to bf16.
      for (int i = 0; i < p.block; ++i)
        x[i] = num::bf16_round(num::bf16_round(clampf(x[i] / s, -448.0f, 448.0f)) * s);
    }
  }
}

void fp4_sim(const Fp8SimParams& p) {
  const int64_t nb = p.cols / p.block;
#pragma omp parallel for schedule(static) if (p.rows * p.cols >= kParallelMin)
  for (int64_t r = 0; r < p.rows; ++r) {
    for (int64_t b = 0; b < nb; ++b) {
      float* x = p.x + r * p.ld + b * p.block;
      const float s = fp4_scale(block_amax(x, p.block));
      for (int i = 0; i < p.block; ++i) {
        const uint8_t q = num::e2m1_bits(clampf(x[i] / s, -6.0f, 6.0f));
        x[i] = num::bf16_round(num::e2m1_to_f32(q) * s);
      }
    }
  }
}

}  // namespace dsv4
