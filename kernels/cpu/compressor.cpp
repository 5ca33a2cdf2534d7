// KV compressor (MODEL.md §3.5) and the Walsh-Hadamard rotation on the CPU. The operation order is
// the contract of kernels/compressor.h.
#include "kernels/compressor.h"

#include <algorithm>
#include <vector>

#include "kernels/detail/compressor.h"
#include "kernels/grad.h"
#include "kernels/linear.h"
#include "kernels/norm.h"
#include "kernels/rope.h"

namespace dsv4 {

namespace {
// Below this much work (multiply-adds or elements) a parallel region costs more than it saves. The
// thread count never changes the result, so the threshold is free to tune.
constexpr int64_t kParallelWork = int64_t(1) << 15;

bool is_pow2(int64_t n) {
  return n > 0 && (n & (n - 1)) == 0;
}
}  // namespace

const char* compressor_check(const CompressorParams& p) {
  if (p.T < 0) return "T";
  if (p.D <= 0) return "D";
  if (p.ratio < 1) return "ratio";
  if (p.d <= 0) return "d";
  if (p.rd <= 0 || p.rd % 2 != 0 || p.rd > p.d) return "rd";
  if (p.hadamard && !is_pow2(p.d)) return "d";
  if (!(p.rms_eps >= 0.0f)) return "rms_eps";
  if (compressor_groups(p.T, p.ratio) == 0) return nullptr;
  if (p.x == nullptr) return "x";
  if (p.wkv == nullptr) return "wkv";
  if (p.wgate == nullptr) return "wgate";
  if (p.ape == nullptr) return "ape";
  if (p.norm == nullptr) return "norm";
  if (p.freq == nullptr) return "freq";
  if (p.out == nullptr) return "out";
  return nullptr;
}

void compressor(const CompressorParams& p) {
  const int64_t G = compressor_groups(p.T, p.ratio);
  if (G == 0) return;
  const int64_t cw = common::compressor_row_width(p.ratio, p.d), rows = G * p.ratio;

  // kvp, sc: [G*r, coff*d] fp32 (linear in T).
  std::vector<float> kvp(size_t(rows * cw)), sc(size_t(rows * cw));
  gemm(linear_params(rows, cw, p.D, p.x, p.wkv, kvp.data(), OutRound::f32, p.order));
  gemm(linear_params(rows, cw, p.D, p.x, p.wgate, sc.data(), OutRound::f32, p.order));
  compressor_pool(common::compressor_pool_params(p, kvp.data(), sc.data()));
}

const char* compressor_pool_check(const CompressorPoolParams& p) {
  if (p.g0 < 0) return "g0";
  if (p.G < 0) return "G";
  if (p.ratio < 1) return "ratio";
  if (p.row0 < 0 || p.row0 % p.ratio != 0) return "row0";
  if (p.rows < 0) return "rows";
  if (p.d <= 0) return "d";
  if (p.rd <= 0 || p.rd % 2 != 0 || p.rd > p.d) return "rd";
  if (p.hadamard && !is_pow2(p.d)) return "d";
  if (!(p.rms_eps >= 0.0f)) return "rms_eps";
  if (p.G == 0) return nullptr;
  // Every token the groups read: [first, (g0 + G) * ratio), first = the previous group's start for
  // the overlapping ratio 4 (none before group 0).
  const int64_t first = (p.ratio == 4 ? std::max<int64_t>(p.g0 - 1, 0) : p.g0) * p.ratio;
  if (first < p.row0 || (p.g0 + p.G) * p.ratio > p.row0 + p.rows) return "rows";
  if (p.kvp == nullptr) return "kvp";
  if (p.sc == nullptr) return "sc";
  if (p.ape == nullptr) return "ape";
  if (p.norm == nullptr) return "norm";
  if (p.freq == nullptr) return "freq";
  if (p.out == nullptr) return "out";
  return nullptr;
}

void compressor_pool(const CompressorPoolParams& p) {
  if (p.G == 0) return;
  const common::CompressorPool a = common::compressor_pool_shape(p);
  const int64_t d = p.d, G = p.G;

  // Per group and channel: softmax over the slots (scores sc + ape[slot]), then the weighted sum.
  const int nslot = a.overlap ? 2 * a.r : a.r;
#pragma omp parallel for schedule(static) if (G * d * nslot >= kParallelWork)
  for (int64_t g = 0; g < G; ++g)
    for (int64_t c = 0; c < d; ++c) p.out[g * d + c] = common::compressor_pool(a, p.g0 + g, c);

  // c_g = rmsnorm(bf16(c_g); norm), in place, bf16 out.
  rmsnorm(common::compressor_norm_params(p, G));

  // RoPE on the last rd dims at position g * ratio (the group's first token).
  std::vector<int64_t> pos(static_cast<size_t>(G));
  for (int64_t g = 0; g < G; ++g) pos[g] = (p.g0 + g) * p.ratio;
  rope_apply(common::compressor_rope_params(p, G, pos.data()));

  if (p.hadamard) hadamard(p.out, G, d, d);
}

namespace {
// The butterflies of every row, then the output scale: the forward's bf16 value (round) or the
// gradient's fp32 v * scale.
void hadamard_rows(float* x, int64_t rows, int64_t n, int64_t ld, bool round) {
  const float scale = common::hadamard_scale(n);
#pragma omp parallel for schedule(static) if (rows * n >= kParallelWork)
  for (int64_t row = 0; row < rows; ++row) {
    float* v = x + row * ld;
    for (int64_t h = 1; h < n; h *= 2) common::hadamard_stage(v, n, h, 0, 1);
    for (int64_t i = 0; i < n; ++i) v[i] = round ? common::hadamard_out(v[i], scale) : v[i] * scale;
  }
}
}  // namespace

void hadamard(float* x, int64_t rows, int64_t n, int64_t ld) {
  hadamard_rows(x, rows, n, ld, true);
}

void hadamard_backward(float* x, int64_t rows, int64_t n, int64_t ld) {
  hadamard_rows(x, rows, n, ld, false);
}

}  // namespace dsv4
