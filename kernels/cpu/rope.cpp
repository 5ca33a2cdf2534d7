// RoPE / YaRN on the CPU (MODEL.md §3.3). The operation order is the contract of kernels/rope.h:
// every step is one fp32 operation written out explicitly, so a CUDA port reproduces the bits.
#include "kernels/rope.h"

#include <cmath>
#include <vector>

#include "kernels/detail/rope.h"
#include "kernels/numerics/numerics.h"

namespace dsv4 {

namespace {
// Below this much work (multiply-adds or elements) a parallel region costs more than it saves. The
// thread count never changes the result, so the threshold is free to tune.
constexpr int64_t kParallelWork = int64_t(1) << 15;

// 2π rounded to fp32, the constant of the reference (`2 * math.pi` converted on use).
constexpr float kTwoPi = 6.28318530717958647692f;
}  // namespace

void rope_freqs(const RopeSpec& s, float* freq) {
  const int half = s.rd / 2;
  const float log_base = num::log_f(s.base);
  for (int i = 0; i < half; ++i) {
    const float e = float(2 * i) / float(s.rd);
    freq[i] = num::exp_f(-(e * log_base));
  }
  if (!s.yarn) return;
  const float l0 = float(s.original_max_position);
  // corr(n) = rd * log_f(L0 / (n * 2π)) / (2 * log_f(base)), left to right.
  auto corr = [&](float n) { return float(s.rd) * num::log_f(l0 / (n * kTwoPi)) / (2.0f * log_base); };
  float low = std::floor(corr(s.beta_fast));
  float high = std::ceil(corr(s.beta_slow));
  if (low < 0.0f) low = 0.0f;
  if (high > float(s.rd - 1)) high = float(s.rd - 1);
  if (low == high) high += 0.001f;
  for (int i = 0; i < half; ++i) {
    float ramp = (float(i) - low) / (high - low);
    if (ramp < 0.0f) ramp = 0.0f;
    if (ramp > 1.0f) ramp = 1.0f;
    const float f = freq[i];
    freq[i] = (f / s.factor) * ramp + f * (1.0f - ramp);
  }
}

const char* rope_apply_check(const RopeApplyParams& p) {
  if (p.rows < 0) return "rows";
  if (p.heads < 1) return "heads";
  if (p.rd <= 0 || p.rd % 2 != 0) return "rd";
  if (p.offset < 0) return "offset";
  if (p.head_stride < 0 || (p.heads > 1 && p.head_stride < p.offset + p.rd)) return "head_stride";
  if (p.ld < 0 || (p.rows > 1 && p.ld < int64_t(p.heads - 1) * p.head_stride + p.offset + p.rd)) return "ld";
  if (p.rows == 0) return nullptr;
  if (p.x == nullptr) return "x";
  if (p.pos == nullptr) return "pos";
  if (p.freq == nullptr) return "freq";
  return nullptr;
}

// One row per iteration: the angle table of the row is built once (fp32(pos) * freq, then our own
// cos/sin) and applied to every head. Rows are independent, so any thread count gives the same bits.
void rope_apply(const RopeApplyParams& p) {
  const int half = p.rd / 2;
#pragma omp parallel if (p.rows * p.heads * p.rd >= kParallelWork)
  {
    std::vector<float> cs(static_cast<size_t>(half)), sn(static_cast<size_t>(half));
#pragma omp for schedule(static)
    for (int64_t t = 0; t < p.rows; ++t) {
      for (int i = 0; i < half; ++i) common::rope_cos_sin(p.pos[t], p.freq[i], cs[i], sn[i]);
      for (int h = 0; h < p.heads; ++h) {
        float* v = p.x + t * p.ld + h * p.head_stride + p.offset;
        for (int i = 0; i < half; ++i) common::rope_rotate(v + 2 * i, cs[i], sn[i], p.inverse, p.round_bf16);
      }
    }
  }
}

}  // namespace dsv4
