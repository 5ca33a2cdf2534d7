// KV compressor (MODEL.md §3.5) and the Walsh-Hadamard rotation on the CPU. The operation order is
// the contract of kernels/compressor.h.
#include "kernels/compressor.h"

#include <cmath>
#include <limits>
#include <vector>

#include "kernels/linear.h"
#include "kernels/norm.h"
#include "kernels/numerics/numerics.h"
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
  const int r = p.ratio;
  const bool overlap = (r == 4);
  const int64_t coff = overlap ? 2 : 1;
  const int64_t d = p.d, cw = coff * d;  // cw: width of a kvp/sc row
  const int64_t rows = G * r;

  // kvp, sc: [G*r, coff*d] fp32 (linear in T).
  std::vector<float> kvp(size_t(rows * cw)), sc(size_t(rows * cw));
  GemmParams gp;
  gp.m = rows;
  gp.n = cw;
  gp.k = p.D;
  gp.x = p.x;
  gp.ldx = p.D;
  gp.ldw = p.D;
  gp.ldy = cw;
  gp.round = OutRound::f32;
  gp.order = p.order;
  gp.w = p.wkv;
  gp.y = kvp.data();
  gemm(gp);
  gp.w = p.wgate;
  gp.y = sc.data();
  gemm(gp);

  // sc += ape[slot], slot = token index within its group.
#pragma omp parallel for schedule(static) if (rows * cw >= kParallelWork)
  for (int64_t t = 0; t < rows; ++t) {
    const float* a = p.ape + (t % r) * cw;
    float* s = sc.data() + t * cw;
    for (int64_t c = 0; c < cw; ++c) s[c] = s[c] + a[c];
  }

  // Per group and channel: softmax over the slots, then the weighted sum as an fma chain. Slots are
  // enumerated in the contract's order; `slot()` gives the (kv, score) pair of slot s, with group 0's
  // previous-group slots reading kv 0 / score -inf.
  const int nslot = overlap ? 2 * r : r;
  const float ninf = -std::numeric_limits<float>::infinity();
#pragma omp parallel if (G * d * nslot >= kParallelWork)
  {
    std::vector<float> e(static_cast<size_t>(nslot));
#pragma omp for schedule(static)
    for (int64_t g = 0; g < G; ++g) {
      float* out = p.out + g * d;
      for (int64_t c = 0; c < d; ++c) {
        auto kv_at = [&](int s) -> float {
          if (!overlap) return kvp[size_t((g * r + s) * cw + c)];
          if (s < r) return g == 0 ? 0.0f : kvp[size_t(((g - 1) * r + s) * cw + c)];
          return kvp[size_t((g * r + (s - r)) * cw + d + c)];
        };
        auto sc_at = [&](int s) -> float {
          if (!overlap) return sc[size_t((g * r + s) * cw + c)];
          if (s < r) return g == 0 ? ninf : sc[size_t(((g - 1) * r + s) * cw + c)];
          return sc[size_t((g * r + (s - r)) * cw + d + c)];
        };
        float m = ninf;
        for (int s = 0; s < nslot; ++s) {
          const float v = sc_at(s);
          if (v > m) m = v;
        }
        float Z = 0.0f;
        for (int s = 0; s < nslot; ++s) {
          e[s] = num::exp_f(sc_at(s) - m);
          Z = Z + e[s];
        }
        float acc = 0.0f;
        for (int s = 0; s < nslot; ++s) acc = std::fma(e[s] / Z, kv_at(s), acc);
        out[c] = num::bf16_round(acc);
      }
    }
  }

  // c_g = rmsnorm(bf16(c_g); norm), in place, bf16 out.
  RmsNormParams np;
  np.rows = G;
  np.dim = d;
  np.x = p.out;
  np.ldx = d;
  np.w = p.norm;
  np.y = p.out;
  np.ldy = d;
  np.eps = p.rms_eps;
  np.order = p.order;
  rmsnorm(np);

  // RoPE on the last rd dims at position g * ratio (the group's first token).
  std::vector<int64_t> pos(static_cast<size_t>(G));
  for (int64_t g = 0; g < G; ++g) pos[g] = g * r;
  RopeApplyParams rp;
  rp.rows = G;
  rp.heads = 1;
  rp.x = p.out;
  rp.ld = d;
  rp.head_stride = d;
  rp.offset = d - p.rd;
  rp.pos = pos.data();
  rp.freq = p.freq;
  rp.rd = p.rd;
  rp.inverse = false;
  rp.round_bf16 = true;
  rope_apply(rp);

  if (p.hadamard) hadamard(p.out, G, d, d);
}

void hadamard(float* x, int64_t rows, int64_t n, int64_t ld) {
  const float scale = 1.0f / std::sqrt(float(n));
#pragma omp parallel for schedule(static) if (rows * n >= kParallelWork)
  for (int64_t row = 0; row < rows; ++row) {
    float* v = x + row * ld;
    for (int64_t h = 1; h < n; h *= 2) {
      for (int64_t i = 0; i < n; i += 2 * h) {
        for (int64_t j = i; j < i + h; ++j) {
          const float a = v[j], b = v[j + h];
          v[j] = a + b;
          v[j + h] = a - b;
        }
      }
    }
    for (int64_t i = 0; i < n; ++i) v[i] = num::bf16_round(v[i] * scale);
  }
}

}  // namespace dsv4
