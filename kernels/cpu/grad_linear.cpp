// Backward of the dense linear layers, RMSNorm, the embedding and the log-probabilities
// (kernels/grad.h), in the operation orders documented there.
//
// The two GEMM gradients are forward GEMMs on transposed operands: dX = dY · (W^T)^T and
// dW = (dY^T) · (X^T)^T, where the transposed operand holds the gathered columns contiguously. gemm()
// (kernels/linear.h, OutRound::f32) gives every element exactly dot() of its two rows, so each element
// is the canonical dot of the contract, whatever the tiling, the chunking below or the thread count.
#include <algorithm>
#include <cstdint>
#include <functional>
#include <vector>

#include "kernels/detail/grad_norm.h"
#include "kernels/detail/norm.h"
#include "kernels/grad.h"
#include "kernels/linear.h"
#include "kernels/logits.h"

namespace dsv4 {

namespace {

// Below this many elements a parallel region costs more than it saves (the split is over
// independent outputs, so results do not depend on it).
constexpr int64_t kParallelMin = int64_t(1) << 14;
// Size bound (floats) of the transposed chunk of W (gemm_dx) and of the staging buffer of an
// accumulated output: keeps the scratch small next to the weights.
constexpr int64_t kChunkFloats = int64_t(1) << 22;
constexpr int64_t kChunkAlign = 48;  // multiple of gemm's output tile

bool reduce_order_ok(ReduceOrder o) {
  return o.block >= 0 && o.block % 8 == 0;
}

// Whether the [rows, cols] matrices a (row stride lda) and b (row stride ldb) share memory.
bool overlaps(const float* a, int64_t rows_a, int64_t cols_a, int64_t lda, const float* b, int64_t rows_b,
              int64_t cols_b, int64_t ldb) {
  if (!a || !b || rows_a <= 0 || cols_a <= 0 || rows_b <= 0 || cols_b <= 0) return false;
  const float* a_end = a + (rows_a - 1) * lda + cols_a;
  const float* b_end = b + (rows_b - 1) * ldb + cols_b;
  return std::less<const float*>()(a, b_end) && std::less<const float*>()(b, a_end);
}

// dst [cols, rows] = columns [c0, c0 + cols) of src [rows, *] (row stride lds), transposed:
// dst[c * rows + r] = src[r * lds + c0 + c]. Blocked for the caches, parallel over column blocks.
void transpose_columns(const float* src, int64_t lds, int64_t rows, int64_t c0, int64_t cols, float* dst) {
  constexpr int64_t B = 32;
#pragma omp parallel for schedule(static) if (rows * cols >= kParallelMin)
  for (int64_t cb = 0; cb < cols; cb += B) {
    const int64_t ce = std::min(cols, cb + B);
    for (int64_t rb = 0; rb < rows; rb += B) {
      const int64_t re = std::min(rows, rb + B);
      for (int64_t c = cb; c < ce; ++c)
        for (int64_t r = rb; r < re; ++r) dst[c * rows + r] = src[r * lds + c0 + c];
    }
  }
}

// out[r, c] = out[r, c] + add[r, c] (accumulate) or add[r, c] over a [rows, cols] block.
void store_block(float* out, int64_t ldo, const float* add, int64_t lda, int64_t rows, int64_t cols,
                 bool accumulate) {
#pragma omp parallel for schedule(static) if (rows * cols >= kParallelMin)
  for (int64_t r = 0; r < rows; ++r) {
    float* o = out + r * ldo;
    const float* a = add + r * lda;
    if (accumulate)
      for (int64_t c = 0; c < cols; ++c) o[c] = o[c] + a[c];
    else
      for (int64_t c = 0; c < cols; ++c) o[c] = a[c];
  }
}

// The dot of an empty range is +0: the [rows, cols] output becomes 0 (or out + 0).
void store_zero(float* out, int64_t ldo, int64_t rows, int64_t cols, bool accumulate) {
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) out[r * ldo + c] = accumulate ? out[r * ldo + c] + 0.0f : 0.0f;
}

// A chunk length for a dimension of `total` when each unit costs `per` floats of scratch.
int64_t chunk_len(int64_t total, int64_t per) {
  int64_t c = std::max<int64_t>(kChunkAlign, kChunkFloats / std::max<int64_t>(per, 1));
  c = c / kChunkAlign * kChunkAlign;
  return std::min(total, c);
}

}  // namespace

// ---- dense linear -------------------------------------------------------------------------------

const char* gemm_dx_check(const GemmDxParams& p) {
  if (p.m < 0 || p.n < 0 || p.k < 0) return "gemm_dx: negative dimension";
  if (!reduce_order_ok(p.order)) return "gemm_dx: reduce block must be 0 or a positive multiple of 8";
  if (p.m == 0 || p.k == 0) return nullptr;
  if (!p.dx) return "gemm_dx: dx is null";
  if (p.lddx < p.k) return "gemm_dx: lddx < k";
  if (p.n > 0) {
    if (!p.dy || !p.w) return "gemm_dx: dy or w is null";
    if (p.lddy < p.n) return "gemm_dx: lddy < n";
    if (p.ldw < p.k) return "gemm_dx: ldw < k";
    if (overlaps(p.dx, p.m, p.k, p.lddx, p.dy, p.m, p.n, p.lddy)) return "gemm_dx: dx overlaps dy";
    if (overlaps(p.dx, p.m, p.k, p.lddx, p.w, p.n, p.k, p.ldw)) return "gemm_dx: dx overlaps w";
  }
  return nullptr;
}

void gemm_dx(const GemmDxParams& p) {
  if (p.m <= 0 || p.k <= 0) return;
  if (p.n == 0) return store_zero(p.dx, p.lddx, p.m, p.k, p.accumulate);
  // Columns of W in chunks: wt [cols, n] holds them contiguously, gemm gives dx[r, c0 + c] =
  // dot(dy row r, wt row c) = dot_n(dY[r, :], W[:, c0 + c]).
  const int64_t cb = chunk_len(p.k, p.n + (p.accumulate ? p.m : 0));
  std::vector<float> wt(size_t(cb * p.n)), stage(p.accumulate ? size_t(p.m * cb) : 0);
  for (int64_t c0 = 0; c0 < p.k; c0 += cb) {
    const int64_t cols = std::min(cb, p.k - c0);
    transpose_columns(p.w, p.ldw, p.n, c0, cols, wt.data());
    float* y = p.accumulate ? stage.data() : p.dx + c0;
    const int64_t ldy = p.accumulate ? cols : p.lddx;
    gemm(GemmParams{.m = p.m,
                    .n = cols,
                    .k = p.n,
                    .x = p.dy,
                    .ldx = p.lddy,
                    .w = wt.data(),
                    .ldw = p.n,
                    .y = y,
                    .ldy = ldy,
                    .round = OutRound::f32,
                    .order = p.order});
    if (p.accumulate) store_block(p.dx + c0, p.lddx, stage.data(), cols, p.m, cols, true);
  }
}

const char* gemm_dw_check(const GemmDwParams& p) {
  if (p.m < 0 || p.n < 0 || p.k < 0) return "gemm_dw: negative dimension";
  if (!reduce_order_ok(p.order)) return "gemm_dw: reduce block must be 0 or a positive multiple of 8";
  if (p.n == 0 || p.k == 0) return nullptr;
  if (!p.dw) return "gemm_dw: dw is null";
  if (p.lddw < p.k) return "gemm_dw: lddw < k";
  if (p.m > 0) {
    if (!p.dy || !p.x) return "gemm_dw: dy or x is null";
    if (p.lddy < p.n) return "gemm_dw: lddy < n";
    if (p.ldx < p.k) return "gemm_dw: ldx < k";
    if (overlaps(p.dw, p.n, p.k, p.lddw, p.dy, p.m, p.n, p.lddy)) return "gemm_dw: dw overlaps dy";
    if (overlaps(p.dw, p.n, p.k, p.lddw, p.x, p.m, p.k, p.ldx)) return "gemm_dw: dw overlaps x";
  }
  return nullptr;
}

void gemm_dw(const GemmDwParams& p) {
  if (p.n <= 0 || p.k <= 0) return;
  if (p.m == 0) return store_zero(p.dw, p.lddw, p.n, p.k, p.accumulate);
  // dyt [n, m] and xt [k, m] hold the columns of dY and X contiguously (the token axis innermost), so
  // gemm gives dw[r, c] = dot(dyt row r, xt row c) = dot_m(dY[:, r], X[:, c]).
  std::vector<float> dyt(size_t(p.n * p.m)), xt(size_t(p.k * p.m));
  transpose_columns(p.dy, p.lddy, p.m, 0, p.n, dyt.data());
  transpose_columns(p.x, p.ldx, p.m, 0, p.k, xt.data());
  // Accumulated: rows of dW in chunks through a staging buffer, then one add per element.
  const int64_t rb = p.accumulate ? chunk_len(p.n, p.k) : p.n;
  std::vector<float> stage(p.accumulate ? size_t(rb * p.k) : 0);
  for (int64_t r0 = 0; r0 < p.n; r0 += rb) {
    const int64_t rows = std::min(rb, p.n - r0);
    float* y = p.accumulate ? stage.data() : p.dw + r0 * p.lddw;
    const int64_t ldy = p.accumulate ? p.k : p.lddw;
    gemm(GemmParams{.m = rows,
                    .n = p.k,
                    .k = p.m,
                    .x = dyt.data() + r0 * p.m,
                    .ldx = p.m,
                    .w = xt.data(),
                    .ldw = p.m,
                    .y = y,
                    .ldy = ldy,
                    .round = OutRound::f32,
                    .order = p.order});
    if (p.accumulate) store_block(p.dw + r0 * p.lddw, p.lddw, stage.data(), p.k, rows, p.k, true);
  }
}

// ---- RMSNorm ------------------------------------------------------------------------------------

const char* rmsnorm_backward_check(const RmsNormBwdParams& p) {
  if (p.rows < 0 || p.dim <= 0) return "rmsnorm_backward: rows must be >= 0 and dim > 0";
  if (!reduce_order_ok(p.order))
    return "rmsnorm_backward: reduce block must be 0 or a positive multiple of 8";
  if (p.rows == 0) return nullptr;
  if (!p.x || !p.dy || !p.dx) return "rmsnorm_backward: x, dy or dx is null";
  if (p.ldx < p.dim) return "rmsnorm_backward: ldx < dim";
  if (p.lddy < p.dim) return "rmsnorm_backward: lddy < dim";
  if (p.lddx < p.dim) return "rmsnorm_backward: lddx < dim";
  if (overlaps(p.dx, p.rows, p.dim, p.lddx, p.x, p.rows, p.dim, p.ldx))
    return "rmsnorm_backward: dx overlaps x";
  if (overlaps(p.dx, p.rows, p.dim, p.lddx, p.dy, p.rows, p.dim, p.lddy))
    return "rmsnorm_backward: dx overlaps dy";
  if (p.dw && overlaps(p.dw, 1, p.dim, p.dim, p.dx, p.rows, p.dim, p.lddx))
    return "rmsnorm_backward: dw overlaps dx";
  return nullptr;
}

void rmsnorm_backward(const RmsNormBwdParams& p) {
  if (p.rows <= 0) return;
  const int64_t n = p.dim;
  std::vector<float> rs(size_t(p.rows));
  const bool par = p.rows * n >= kParallelMin;
#pragma omp parallel if (par)
  {
    std::vector<float> g(static_cast<size_t>(n));
#pragma omp for schedule(static)
    for (int64_t r = 0; r < p.rows; ++r) {
      const float* x = p.x + r * p.ldx;
      const float* dy = p.dy + r * p.lddy;
      float* dx = p.dx + r * p.lddx;
      const float rr = common::rms_scale(sum_squares(x, n, p.order), n, p.eps);
      rs[size_t(r)] = rr;
      for (int64_t i = 0; i < n; ++i) g[size_t(i)] = common::rmsnorm_bwd_g(dy[i], p.w, i);
      const float c = common::rmsnorm_bwd_coef(rr, dot(g.data(), x, n, p.order), n);
      for (int64_t i = 0; i < n; ++i) {
        const float v = common::rmsnorm_bwd_dx(g[size_t(i)], x[i], rr, c);
        dx[i] = p.accumulate_dx ? dx[i] + v : v;
      }
    }
  }
  if (!p.dw) return;
  // dw: each element sums its rows sequentially (from 0, increasing row), then one add into dw.
  constexpr int64_t B = 64;
#pragma omp parallel for schedule(static) if (par)
  for (int64_t i0 = 0; i0 < n; i0 += B) {
    const int64_t i1 = std::min(n, i0 + B);
    float s[B];
    for (int64_t i = i0; i < i1; ++i) s[i - i0] = 0.0f;
    for (int64_t r = 0; r < p.rows; ++r) {
      const float* x = p.x + r * p.ldx;
      const float* dy = p.dy + r * p.lddy;
      for (int64_t i = i0; i < i1; ++i) s[i - i0] += common::rmsnorm_bwd_dw_term(dy[i], x[i], rs[size_t(r)]);
    }
    for (int64_t i = i0; i < i1; ++i) p.dw[i] = p.dw[i] + s[i - i0];
  }
}

// ---- embedding and log-probabilities ------------------------------------------------------------

void embed_backward(const float* dH, int64_t D, const int32_t* tokens, int64_t T, int copies, float* dtable) {
  if (T <= 0 || D <= 0 || copies <= 0) return;
  // Split over the feature axis: every element still receives its terms in (t, j) order.
  constexpr int64_t B = 64;
#pragma omp parallel for schedule(static) if (T * copies * D >= kParallelMin)
  for (int64_t d0 = 0; d0 < D; d0 += B) {
    const int64_t d1 = std::min(D, d0 + B);
    for (int64_t t = 0; t < T; ++t) {
      float* row = dtable + int64_t(tokens[t]) * D;
      for (int j = 0; j < copies; ++j) {
        const float* src = dH + (t * copies + j) * D;
        for (int64_t d = d0; d < d1; ++d) row[d] = row[d] + src[d];
      }
    }
  }
}

void log_softmax_backward(const float* logits, int64_t rows, int64_t V, const int32_t* target,
                          const float* dlogprob, float temperature, float* dlogits) {
  if (rows <= 0 || V <= 0) return;
#pragma omp parallel if (rows * V >= (int64_t(1) << 15))
  {
    std::vector<float> z(static_cast<size_t>(V));
#pragma omp for schedule(static)
    for (int64_t t = 0; t < rows; ++t) {
      float* out = dlogits + t * V;
      const int32_t tgt = target[t];
      if (dlogprob[t] == 0.0f || tgt < 0 || tgt >= V) {
        std::fill(out, out + V, 0.0f);
        continue;
      }
      const float* l = logits + t * V;
      for (int64_t v = 0; v < V; ++v) z[size_t(v)] = l[v] / temperature;
      const float lse = logsumexp_row(z.data(), V);
      const float coef = dlogprob[t] / temperature;
      for (int64_t v = 0; v < V; ++v) {
        const float ind = v == tgt ? 1.0f : 0.0f;
        out[v] = coef * (ind - num::exp_f(z[size_t(v)] - lse));
      }
    }
  }
}

}  // namespace dsv4
