// Dense GEMM with the canonical per-element reduction order of kernels/reduce.h.
//
// gemm() is a cache-blocked, register-blocked version of gemm_reference(): every output element
// keeps its own 8 lane accumulators (lane l takes the k indices = l mod 8 of the current chain,
// updated with an explicit fma in increasing k), which is exactly detail::dot_chain; a micro-kernel
// updates MR x NR such lane vectors at once. The k range is cut into tiles that hold either whole
// ReduceOrder blocks or a multiple-of-8 part of one chain, so the lane accumulators restart at zero
// exactly where dot() starts a chain, and the chain results are added left to right as in dot().
// Threads own disjoint output tiles and never split a reduction, so results are bit-identical for
// any thread count, tiling and batch composition.
#include <algorithm>
#include <array>
#include <string>
#include <utility>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

#include "kernels/detail/linear.h"
#include "kernels/error.h"
#include "kernels/linear.h"

namespace dsv4 {

const char* gemm_check(const GemmParams& p) {
  if (p.m < 0 || p.n < 0 || p.k < 0) return "gemm: negative dimension";
  if (p.m > 0 && p.n > 0) {
    if (!p.y) return "gemm: y is null";
    if (p.ldy < p.n) return "gemm: ldy < n";
    if (p.k > 0) {
      if (!p.x || !p.w) return "gemm: x or w is null";
      if (p.ldx < p.k) return "gemm: ldx < k";
      if (p.ldw < p.k) return "gemm: ldw < k";
    }
  }
  if (p.order.block < 0 || p.order.block % 8 != 0)
    return "gemm: reduce block must be 0 or a positive multiple of 8";
  if (p.x16 && !p.order.tensor_core)
    return "gemm: a bf16 copy of x (x16) is read by the tensor_core order only";
  return nullptr;
}

namespace {

constexpr int MR = 3;         // x rows per micro-kernel
constexpr int NR = 4;         // w rows per micro-kernel (MR * NR lane vectors live in registers)
constexpr int64_t MB = 48;    // x rows per output tile (multiple of MR)
constexpr int64_t NB = 48;    // w rows per output tile (multiple of NR)
constexpr int64_t KC = 1024;  // k tile (multiple of 8)

// The reduction chains of one output: [0, k) cut at multiples of `len` (the ReduceOrder block, or
// the whole range when there is no blocking or k fits in one block).
struct Chains {
  int64_t k, len;
  Chains(int64_t k_, int block) : k(k_), len(block > 0 && k_ > block ? block : std::max<int64_t>(k_, 1)) {}
  int64_t start(int64_t i) const { return (i / len) * len; }
  int64_t end(int64_t i) const { return std::min(start(i) + len, k); }
};

// Micro-kernel state of one mr x nr block of outputs, kept between k tiles: the lane accumulators
// of the chain in progress and the running sum of the finished chains.
struct BlockState {
  float* acc;  // [mr * nr][8]
  float* sum;  // [mr * nr]
};

#if defined(__AVX2__) && defined(__FMA__)
// c[j] = combine_lanes8(lanes of a[j]) for nr <= 4 vectors: the same additions in the same order,
// with four outputs sharing each vector add. With v_i = l_i + l_(i+4): t0 = v0 + v2,
// t1 = v1 + v3, c = t0 + t1.
template <int nr>
inline void combine4(const __m256* a, float* c) {
  if constexpr (nr == 4) {
    const __m256 b01 =
        _mm256_add_ps(_mm256_permute2f128_ps(a[0], a[1], 0x20), _mm256_permute2f128_ps(a[0], a[1], 0x31));
    const __m256 b23 =
        _mm256_add_ps(_mm256_permute2f128_ps(a[2], a[3], 0x20), _mm256_permute2f128_ps(a[2], a[3], 0x31));
    // Per 128-bit half: [v0, v1 of a0 | a1] [v0, v1 of a2 | a3] and the same for v2, v3.
    const __m256 t = _mm256_add_ps(_mm256_shuffle_ps(b01, b23, _MM_SHUFFLE(1, 0, 1, 0)),
                                   _mm256_shuffle_ps(b01, b23, _MM_SHUFFLE(3, 2, 3, 2)));
    const __m256 h = _mm256_add_ps(_mm256_shuffle_ps(t, t, _MM_SHUFFLE(2, 0, 2, 0)),
                                   _mm256_shuffle_ps(t, t, _MM_SHUFFLE(3, 1, 3, 1)));
    alignas(32) float out[8];  // [c0, c2, c0, c2, c1, c3, c1, c3]
    _mm256_store_ps(out, h);
    c[0] = out[0];
    c[1] = out[4];
    c[2] = out[1];
    c[3] = out[5];
  } else {
    for (int j = 0; j < nr; ++j) {
      const __m128 v = _mm_add_ps(_mm256_castps256_ps128(a[j]), _mm256_extractf128_ps(a[j], 1));
      const __m128 t = _mm_add_ps(v, _mm_movehl_ps(v, v));
      c[j] = _mm_cvtss_f32(_mm_add_ss(t, _mm_shuffle_ps(t, t, 1)));
    }
  }
}
#endif

// Continues the reductions of x rows [0, mr) . w rows [0, nr) over k in [k0, k1). Per output this is
// exactly dot(): lane l of a chain takes the indices i with (i - chain start) mod 8 == l, each
// updated with one fma in increasing i; the scalar tail (only at the end of the range) is
// dot_chain's; at a chain end the lanes are combined with combine_lanes8 and the chain result is
// added to the running sum (the first chain initialises it). The AVX2 path performs the same
// per-lane operations as the portable one (one vfmadd lane == one std::fma).
template <int mr, int nr>
void micro(const float* x, int64_t ldx, const float* w, int64_t ldw, const Chains& ch, int64_t k0, int64_t k1,
           BlockState st) {
  float sum[mr * nr];
  for (int q = 0; q < mr * nr; ++q) sum[q] = st.sum[q];
  // Chain [cs, ce), of which [i, se) lies in this k tile; every path below ends with i == se.
  for (int64_t i = k0, cs = ch.start(k0); i < k1; cs = i) {
    const int64_t ce = std::min(cs + ch.len, ch.k), se = std::min(k1, ce);
    alignas(32) float lanes[mr * nr][8];
#if defined(__AVX2__) && defined(__FMA__)
    __m256 a[mr][nr];
    for (int r = 0; r < mr; ++r)
      for (int j = 0; j < nr; ++j)
        a[r][j] = i == cs ? _mm256_setzero_ps() : _mm256_loadu_ps(st.acc + (r * nr + j) * 8);
    for (; i + 8 <= se; i += 8) {
      __m256 wv[nr];
      for (int j = 0; j < nr; ++j) wv[j] = _mm256_loadu_ps(w + j * ldw + i);
      for (int r = 0; r < mr; ++r) {
        const __m256 xv = _mm256_loadu_ps(x + r * ldx + i);
        for (int j = 0; j < nr; ++j) a[r][j] = _mm256_fmadd_ps(xv, wv[j], a[r][j]);
      }
    }
    if (se < ce) {  // the chain continues in the next k tile
      for (int r = 0; r < mr; ++r)
        for (int j = 0; j < nr; ++j) _mm256_storeu_ps(st.acc + (r * nr + j) * 8, a[r][j]);
      continue;
    }
    if (i == se) {  // no tail: combine in registers, ((l0 + l4) + (l2 + l6)) + ((l1 + l5) + (l3 + l7))
      for (int r = 0; r < mr; ++r) {
        float c[nr];
        combine4<nr>(a[r], c);
        for (int j = 0; j < nr; ++j) {
          float& s = sum[r * nr + j];
          s = cs == 0 ? c[j] : s + c[j];
        }
      }
      continue;
    }
    for (int r = 0; r < mr; ++r)
      for (int j = 0; j < nr; ++j) _mm256_store_ps(lanes[r * nr + j], a[r][j]);
#else
    for (int q = 0; q < mr * nr; ++q)
      for (int l = 0; l < 8; ++l) lanes[q][l] = i == cs ? 0.0f : st.acc[q * 8 + l];
    for (; i + 8 <= se; i += 8)
      for (int r = 0; r < mr; ++r)
        for (int j = 0; j < nr; ++j)
          for (int l = 0; l < 8; ++l)
            lanes[r * nr + j][l] = std::fma(x[r * ldx + i + l], w[j * ldw + i + l], lanes[r * nr + j][l]);
    if (se < ce) {
      for (int q = 0; q < mr * nr; ++q)
        for (int l = 0; l < 8; ++l) st.acc[q * 8 + l] = lanes[q][l];
      continue;
    }
#endif
    for (int l = 0; i + l < se; ++l)
      for (int r = 0; r < mr; ++r)
        for (int j = 0; j < nr; ++j)
          lanes[r * nr + j][l] = std::fma(x[r * ldx + i + l], w[j * ldw + i + l], lanes[r * nr + j][l]);
    for (int q = 0; q < mr * nr; ++q) {
      const float c = detail::combine_lanes8(lanes[q]);
      sum[q] = cs == 0 ? c : sum[q] + c;
    }
    i = se;
  }
  for (int q = 0; q < mr * nr; ++q) st.sum[q] = sum[q];
}

using MicroFn = void (*)(const float*, int64_t, const float*, int64_t, const Chains&, int64_t, int64_t,
                         BlockState);

template <int mr, int... js>
constexpr std::array<MicroFn, NR + 1> micro_row(std::integer_sequence<int, js...>) {
  return {nullptr, &micro<mr, js + 1>...};
}
template <int... is>
constexpr std::array<std::array<MicroFn, NR + 1>, MR + 1> micro_rows(std::integer_sequence<int, is...>) {
  return {std::array<MicroFn, NR + 1>{}, micro_row<is + 1>(std::make_integer_sequence<int, NR>{})...};
}
// micro_table[mr][nr] for 1 <= mr <= MR, 1 <= nr <= NR (edge blocks of a tile use smaller kernels).
constexpr auto micro_table = micro_rows(std::make_integer_sequence<int, MR>{});

// One output tile: rows [i0, i0 + mb) of x, rows [j0, j0 + nb) of w. `acc` holds MB * NB lane
// vectors and `sum` MB * NB running sums, each micro-kernel block's stored contiguously.
void tile(const GemmParams& p, int64_t i0, int64_t mb, int64_t j0, int64_t nb, float* acc, float* sum) {
  const Chains ch(p.k, p.order.block);
  // A k tile holds whole chains when they are short, else part of one chain.
  const int64_t kc = ch.len <= KC ? std::max<int64_t>(1, KC / ch.len) * ch.len : KC;
  std::fill(sum, sum + MB * NB, 0.0f);  // k == 0: every output is dot() of nothing, +0
  for (int64_t k0 = 0, k1 = 0; k0 < p.k; k0 = k1) {
    k1 = ch.len <= KC ? std::min(k0 + kc, p.k) : std::min(k0 + kc, ch.end(k0));
    for (int64_t r0 = 0; r0 < mb; r0 += MR) {
      const int mr = int(std::min<int64_t>(MR, mb - r0));
      for (int64_t c0 = 0; c0 < nb; c0 += NR) {
        const int nr = int(std::min<int64_t>(NR, nb - c0));
        const int64_t off = r0 * NB + c0 * mr;  // this block's first output
        micro_table[size_t(mr)][size_t(nr)](p.x + (i0 + r0) * p.ldx, p.ldx, p.w + (j0 + c0) * p.ldw, p.ldw,
                                            ch, k0, k1, BlockState{acc + off * 8, sum + off});
      }
    }
  }
  for (int64_t r0 = 0; r0 < mb; r0 += MR) {
    const int mr = int(std::min<int64_t>(MR, mb - r0));
    for (int64_t c0 = 0; c0 < nb; c0 += NR) {
      const int nr = int(std::min<int64_t>(NR, nb - c0));
      const float* s = sum + r0 * NB + c0 * mr;
      for (int r = 0; r < mr; ++r)
        for (int j = 0; j < nr; ++j)
          p.y[(i0 + r0 + r) * p.ldy + j0 + c0 + j] = common::gemm_out(s[r * nr + j], p.round);
    }
  }
}

}  // namespace

void gemm_reference(const GemmParams& p) {
  for (int64_t i = 0; i < p.m; ++i)
    for (int64_t j = 0; j < p.n; ++j)
      p.y[i * p.ldy + j] = common::gemm_out(dot(p.x + i * p.ldx, p.w + j * p.ldw, p.k, p.order), p.round);
}

void gemm(const GemmParams& p) {
  if (const char* why = cpu_order_check(p.order)) throw Error(std::string("gemm: ") + why);
  if (p.m <= 0 || p.n <= 0) return;
  const int64_t tm = (p.m + MB - 1) / MB, tn = (p.n + NB - 1) / NB;
  // Small problems run on the calling thread: a parallel region would cost more than the work.
  // (The tiling, hence every bit of the result, is the same either way.)
  const bool par = tm * tn > 1 && p.m * p.n * std::max<int64_t>(p.k, 1) >= (int64_t(1) << 17);
#pragma omp parallel if (par)
  {
    std::vector<float> acc(MB * NB * 8), s(MB * NB);
#pragma omp for schedule(static)
    for (int64_t t = 0; t < tm * tn; ++t) {
      const int64_t ti = t / tn, tj = t % tn;
      const int64_t i0 = ti * MB, j0 = tj * NB;
      tile(p, i0, std::min(MB, p.m - i0), j0, std::min(NB, p.n - j0), acc.data(), s.data());
    }
  }
}

}  // namespace dsv4
