// Backward of the dense linear layers, RMSNorm, the embedding and the log-probabilities on the GPU
// (kernels/grad.h), in the operation orders of the CPU reference kernels/cpu/grad_linear.cpp.
//
// gemm_dx / gemm_dw: as on the CPU, forward GEMMs on transposed operands. transpose_kernel copies the
// gathered columns into stream-ordered scratch, cuda::gemm (fp32 out, bit-identical to dsv4::gemm)
// gives every element the canonical dot of kernels/reduce.h, and an accumulated output is staged and
// added once per element (store_block_kernel). Chunking bounds the scratch; it never changes a bit.
//
// rmsnorm_backward: rmsnorm_bwd_rows_kernel, one aligned group of 8 threads per row (32 rows per block,
// grid-stride), forms sum_squares(x) with dot8 exactly as the forward (kernels/cuda/norm.cu) and
// dot(g, x) with the same lane split, then writes dx. rmsnorm_bwd_dw_kernel: one thread per column,
// the sequential sum over rows in increasing order from 0, then one add into dw.
//
// embed_backward: embed_next_kernel links each position t to the next position holding the same
// token (a scan, no atomics); embed_bwd_kernel gives each (first occurrence of a token, feature d) one
// thread, which walks that chain in increasing t (j inside) adding one term at a time into the table
// element: the CPU's order for that element.
//
// log_softmax_backward: lse_kernel recomputes lse over l / temperature with the forward's row
// reduction (kernels/cuda/logits.cu: 8 lanes of the CPU's interleaved sum, xor-shuffle combine);
// log_softmax_bwd_kernel writes one element per thread.
#include <algorithm>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/grad.h"
#include "kernels/cuda/grad_common.cuh"
#include "kernels/detail/grad_norm.h"
#include "kernels/detail/logits.h"
#include "kernels/detail/norm.h"

namespace dsv4::cuda {

namespace {

constexpr int kThreads = 256, kRowsPerBlock = kThreads / 8;
// Bound (floats) of the transposed chunk plus staging buffer of one gemm_dx / gemm_dw step.
constexpr int64_t kChunkFloats = int64_t(1) << 26;
constexpr int64_t kChunkAlign = 64;  // multiple of the GEMM output tiles

#define DSV4_GRID_STRIDE(i, n)                                              \
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < (n); \
       i += int64_t(gridDim.x) * blockDim.x)

// ---- element-wise ------------------------------------------------------------------------------------

__global__ void add_kernel(float* y, const float* x, int64_t n) {
  DSV4_GRID_STRIDE(i, n) y[i] = y[i] + x[i];
}

// One thread per element of the [rows, cols] block (grid-stride).
__global__ void store_block_kernel(float* out, int64_t ldo, const float* a, int64_t lda, int64_t rows,
                                   int64_t cols, bool accumulate) {
  DSV4_GRID_STRIDE(e, rows * cols) {
    const int64_t r = e / cols, c = e % cols;
    const float v = a ? a[r * lda + c] : 0.0f;
    float* o = out + r * ldo + c;
    *o = accumulate ? *o + v : v;
  }
}

// Grid (ceil(cols / 32), min(ceil(rows / 32), 65535)), block (32, 8). Block (bx, by) moves the 32 x 32
// tiles of columns [32 bx, 32 bx + 32) and row tiles by, by + gridDim.y, ... through shared memory:
// coalesced reads along a source row, coalesced writes along a destination row.
constexpr int kTile = 32, kTileRows = 8;
__global__ void __launch_bounds__(kTile* kTileRows)
    transpose_kernel(const float* src, int64_t lds, const int32_t* rowmap, int64_t rows, int64_t c0,
                     int64_t cols, float* dst) {
  __shared__ float tile[kTile][kTile + 1];
  const int tx = threadIdx.x, ty = threadIdx.y;
  const int64_t cb = int64_t(blockIdx.x) * kTile;
  const int64_t rtiles = (rows + kTile - 1) / kTile;
  for (int64_t rt = blockIdx.y; rt < rtiles; rt += gridDim.y) {
    const int64_t rb = rt * kTile;
    for (int i = ty; i < kTile; i += kTileRows) {
      const int64_t r = rb + i, c = cb + tx;
      if (r < rows && c < cols) {
        const int64_t sr = rowmap ? int64_t(rowmap[r]) : r;
        tile[i][tx] = src[sr * lds + c0 + c];
      }
    }
    __syncthreads();
    for (int i = ty; i < kTile; i += kTileRows) {
      const int64_t c = cb + i, r = rb + tx;
      if (r < rows && c < cols) dst[c * rows + r] = tile[tx][i];
    }
    __syncthreads();
  }
}

// ---- RMSNorm ----------------------------------------------------------------------------------------

// 256 threads, one aligned group of 8 per row (grid-stride over rows). rs[row] = r when rs is set.
__global__ void __launch_bounds__(kThreads) rmsnorm_bwd_rows_kernel(RmsNormBwdParams p, float* rs) {
  const int lane = threadIdx.x & 7;
  const unsigned mask = detail::group8_mask();
  for (int64_t row = int64_t(blockIdx.x) * kRowsPerBlock + threadIdx.x / 8; row < p.rows;
       row += int64_t(gridDim.x) * kRowsPerBlock) {
    const float* x = p.x + row * p.ldx;
    const float* dy = p.dy + row * p.lddy;
    float* dx = p.dx + row * p.lddx;
    const float r = common::rms_scale(detail::dot8(x, x, p.dim, p.order.block, lane, mask), p.dim, p.eps);
    // dot(g, x) with g_i = rmsnorm_bwd_g(dy_i, w, i) formed right before its fma (the CPU's g array).
    const float gx = detail::dot8_by(p.dim, p.order.block, lane, mask, [&](int64_t i, float& a, float& b) {
      a = common::rmsnorm_bwd_g(dy[i], p.w, i);
      b = x[i];
    });
    const float c = common::rmsnorm_bwd_coef(r, gx, p.dim);
    for (int64_t i = lane; i < p.dim; i += 8) {
      const float v = common::rmsnorm_bwd_dx(common::rmsnorm_bwd_g(dy[i], p.w, i), x[i], r, c);
      dx[i] = p.accumulate_dx ? dx[i] + v : v;
    }
    if (rs && lane == 0) rs[row] = r;
    __syncwarp(mask);
  }
}

// One thread per column i: s = sum over rows (increasing, from 0) of (dy_i * x_i) * r; dw_i = dw_i + s.
__global__ void __launch_bounds__(kThreads) rmsnorm_bwd_dw_kernel(RmsNormBwdParams p, const float* rs) {
  DSV4_GRID_STRIDE(i, p.dim) {
    float s = 0.0f;
    for (int64_t r = 0; r < p.rows; ++r) s += common::rmsnorm_bwd_dw_term(p.dy[r * p.lddy + i], p.x[r * p.ldx + i], rs[r]);
    p.dw[i] = p.dw[i] + s;
  }
}

// ---- embedding --------------------------------------------------------------------------------------

// One thread per position t: next[t] = the smallest t' > t with tokens[t'] == tokens[t], else -1.
__global__ void embed_next_kernel(const int32_t* tokens, int64_t T, int64_t* next) {
  DSV4_GRID_STRIDE(t, T) {
    const int32_t tok = tokens[t];
    int64_t n = -1;
    for (int64_t u = t + 1; u < T; ++u)
      if (tokens[u] == tok) {
        n = u;
        break;
      }
    next[t] = n;
  }
}

// One thread per position t: first[next[t]] = 0 (a position reached from an earlier one). Each
// position has at most one predecessor, so no two threads write the same element.
__global__ void embed_first_kernel(const int64_t* next, int64_t T, unsigned char* first) {
  DSV4_GRID_STRIDE(t, T) if (next[t] >= 0) first[next[t]] = 0;
}

// One thread per (t, d), working where t is the first occurrence of a token in [0, vocab): the table
// element (tokens[t], d) gets dH[u, j, d] added one at a time for the positions u of the token in
// increasing order, j increasing inside.
__global__ void embed_bwd_kernel(const float* dH, int64_t D, const int32_t* tokens, int64_t T, int copies,
                                 const int64_t* next, const unsigned char* first, float* dtable,
                                 int64_t vocab) {
  DSV4_GRID_STRIDE(e, T * D) {
    const int64_t t = e / D, d = e % D;
    const int32_t tok = tokens[t];
    if (!first[t] || tok < 0 || int64_t(tok) >= vocab) continue;
    float* out = dtable + int64_t(tok) * D + d;
    float v = *out;
    for (int64_t u = t; u >= 0; u = next[u])
      for (int j = 0; j < copies; ++j) v = v + dH[(u * copies + j) * D + d];
    *out = v;
  }
}

// ---- log-probabilities ------------------------------------------------------------------------------

// 256 threads, one aligned group of 8 per row (grid-stride): lse[t] = logsumexp_row of
// z_v = l[v] / temperature, for the rows that get a gradient (the others are not read). The forward's
// reduction (kernels/cuda/logits.cu) on z formed in fp32 right before each use: an exact max over the
// non-NaN values, then lane l sums exp_f(z_v - M) for v = l (mod 8) in increasing v.
__global__ void __launch_bounds__(kThreads)
    lse_kernel(const float* logits, int64_t rows, int64_t V, const int32_t* target, const float* dlogprob,
               float temperature, float* lse_out) {
  const int lane = threadIdx.x & 7;
  const unsigned mask = detail::group8_mask();
  const float inf = __int_as_float(0x7f800000);
  for (int64_t t = int64_t(blockIdx.x) * kRowsPerBlock + threadIdx.x / 8; t < rows;
       t += int64_t(gridDim.x) * kRowsPerBlock) {
    if (dlogprob[t] == 0.0f || target[t] < 0 || target[t] >= V) continue;  // uniform over the group
    const float* l = logits + t * V;
    float M = -inf;
    bool nan = false;
    for (int64_t v = lane; v < V; v += 8) {
      const float z = l[v] / temperature;
      if (z != z)
        nan = true;
      else if (z > M)
        M = z;
    }
    int any_nan = nan;
    for (int o = 4; o > 0; o >>= 1) {
      const float m2 = __shfl_xor_sync(mask, M, o);
      any_nan |= __shfl_xor_sync(mask, any_nan, o);
      M = m2 > M ? m2 : M;
    }
    float lse;
    if (!common::lse_special(M, any_nan != 0, lse)) {
      float acc = 0.0f;
      for (int64_t v = lane; v < V; v += 8) acc += num::exp_f(l[v] / temperature - M);
      lse = common::lse_finish(M, detail::combine8(acc, mask));
    }
    if (lane == 0) lse_out[t] = lse;
  }
}

// One thread per (t, v): (dlogprob[t] / temperature) * ((v == target) - exp_f(l[v] / temperature - lse)),
// or 0 for a row without a gradient.
__global__ void __launch_bounds__(kThreads)
    log_softmax_bwd_kernel(const float* logits, int64_t rows, int64_t V, const int32_t* target,
                           const float* dlogprob, float temperature, const float* lse, float* dlogits) {
  DSV4_GRID_STRIDE(e, rows * V) {
    const int64_t t = e / V, v = e % V;
    const int32_t tgt = target[t];
    if (dlogprob[t] == 0.0f || tgt < 0 || tgt >= V) {
      dlogits[e] = 0.0f;
      continue;
    }
    const float coef = dlogprob[t] / temperature;
    const float ind = v == tgt ? 1.0f : 0.0f;
    dlogits[e] = coef * (ind - num::exp_f(logits[e] / temperature - lse[t]));
  }
}

// A chunk length for a dimension of `total` when each unit costs `per` floats of scratch.
int64_t chunk_len(int64_t total, int64_t per) {
  int64_t c = std::max<int64_t>(kChunkAlign, kChunkFloats / std::max<int64_t>(per, 1));
  c = c / kChunkAlign * kChunkAlign;
  return std::min(total, c);
}

}  // namespace

// ---- internal launchers ------------------------------------------------------------------------------

namespace detail {

void transpose_rows(const float* src, int64_t lds, const int32_t* rowmap, int64_t rows, int64_t c0,
                    int64_t cols, float* dst, cudaStream_t stream) {
  if (rows <= 0 || cols <= 0) return;
  const int64_t rtiles = ceil_div(rows, kTile), ctiles = ceil_div(cols, kTile);
  if (ctiles > int64_t(INT32_MAX)) throw Error("cuda transpose cannot run: too many columns");
  const dim3 grid(unsigned(ctiles), unsigned(std::min<int64_t>(rtiles, 65535)));
  transpose_kernel<<<grid, dim3(kTile, kTileRows), 0, stream>>>(src, lds, rowmap, rows, c0, cols, dst);
  DSV4_LAUNCH_CHECK();
}

void store_block(float* out, int64_t ldo, const float* a, int64_t lda, int64_t rows, int64_t cols,
                 bool accumulate, cudaStream_t stream) {
  if (rows <= 0 || cols <= 0) return;
  store_block_kernel<<<grid_for(rows * cols, kThreads), kThreads, 0, stream>>>(out, ldo, a, lda, rows, cols,
                                                                              accumulate);
  DSV4_LAUNCH_CHECK();
}

}  // namespace detail

// ---- element-wise ------------------------------------------------------------------------------------

void zero(float* x, int64_t n, cudaStream_t stream) {
  if (n < 0) require("negative size", "zero");
  if (n == 0) return;
  if (!x) require("x is null", "zero");
  CUDA_CHECK(cudaMemsetAsync(x, 0, size_t(n) * sizeof(float), stream));  // all-zero bits: +0.0f
}

void add(float* y, const float* x, int64_t n, cudaStream_t stream) {
  if (n < 0) require("negative size", "add");
  if (n == 0) return;
  if (!y || !x) require("y or x is null", "add");
  add_kernel<<<detail::grid_for(n, kThreads), kThreads, 0, stream>>>(y, x, n);
  DSV4_LAUNCH_CHECK();
}

// ---- dense linear -------------------------------------------------------------------------------------

void gemm_dx(const GemmDxParams& p, cudaStream_t stream) {
  require(dsv4::gemm_dx_check(p), "gemm_dx");
  if (p.m <= 0 || p.k <= 0) return;
  if (p.n == 0) return detail::store_block(p.dx, p.lddx, nullptr, 0, p.m, p.k, p.accumulate, stream);
  // Columns of W in chunks: wt [cols, n] holds them contiguously, and the GEMM gives
  // dx[r, c0 + c] = dot(dy row r, wt row c) = dot_n(dY[r, :], W[:, c0 + c]).
  const int64_t cb = chunk_len(p.k, p.n + (p.accumulate ? p.m : 0));
  detail::Scratch<float> wt(cb * p.n, stream), stage(p.accumulate ? p.m * cb : 0, stream);
  for (int64_t c0 = 0; c0 < p.k; c0 += cb) {
    const int64_t cols = std::min(cb, p.k - c0);
    detail::transpose_rows(p.w, p.ldw, nullptr, p.n, c0, cols, wt.get(), stream);
    float* y = p.accumulate ? stage.get() : p.dx + c0;
    const int64_t ldy = p.accumulate ? cols : p.lddx;
    gemm(GemmParams{.m = p.m,
                    .n = cols,
                    .k = p.n,
                    .x = p.dy,
                    .ldx = p.lddy,
                    .w = wt.get(),
                    .ldw = p.n,
                    .y = y,
                    .ldy = ldy,
                    .round = OutRound::f32,
                    .order = p.order},
         stream);
    if (p.accumulate) detail::store_block(p.dx + c0, p.lddx, stage.get(), cols, p.m, cols, true, stream);
  }
}

void gemm_dw(const GemmDwParams& p, cudaStream_t stream) {
  require(dsv4::gemm_dw_check(p), "gemm_dw");
  if (p.n <= 0 || p.k <= 0) return;
  if (p.m == 0) return detail::store_block(p.dw, p.lddw, nullptr, 0, p.n, p.k, p.accumulate, stream);
  // xt [k, m] and the chunk dyt [rows, m] hold the columns of X and dY contiguously (the token axis
  // innermost): dw[r0 + r, c] = dot(dyt row r, xt row c) = dot_m(dY[:, r0 + r], X[:, c]).
  detail::Scratch<float> xt(p.k * p.m, stream);
  detail::transpose_rows(p.x, p.ldx, nullptr, p.m, 0, p.k, xt.get(), stream);
  const int64_t rb = chunk_len(p.n, p.m + (p.accumulate ? p.k : 0));
  detail::Scratch<float> dyt(rb * p.m, stream), stage(p.accumulate ? rb * p.k : 0, stream);
  for (int64_t r0 = 0; r0 < p.n; r0 += rb) {
    const int64_t rows = std::min(rb, p.n - r0);
    detail::transpose_rows(p.dy, p.lddy, nullptr, p.m, r0, rows, dyt.get(), stream);
    float* y = p.accumulate ? stage.get() : p.dw + r0 * p.lddw;
    const int64_t ldy = p.accumulate ? p.k : p.lddw;
    gemm(GemmParams{.m = rows,
                    .n = p.k,
                    .k = p.m,
                    .x = dyt.get(),
                    .ldx = p.m,
                    .w = xt.get(),
                    .ldw = p.m,
                    .y = y,
                    .ldy = ldy,
                    .round = OutRound::f32,
                    .order = p.order},
         stream);
    if (p.accumulate) detail::store_block(p.dw + r0 * p.lddw, p.lddw, stage.get(), p.k, rows, p.k, true, stream);
  }
}

// ---- RMSNorm ------------------------------------------------------------------------------------------

void rmsnorm_backward(const RmsNormBwdParams& p, cudaStream_t stream) {
  require(dsv4::rmsnorm_backward_check(p), "rmsnorm_backward");
  if (p.rows <= 0) return;
  detail::Scratch<float> rs(p.dw ? p.rows : 0, stream);
  rmsnorm_bwd_rows_kernel<<<detail::grid_for(p.rows, kRowsPerBlock, 65535), kThreads, 0, stream>>>(p, rs.get());
  DSV4_LAUNCH_CHECK();
  if (!p.dw) return;
  rmsnorm_bwd_dw_kernel<<<detail::grid_for(p.dim, kThreads), kThreads, 0, stream>>>(p, rs.get());
  DSV4_LAUNCH_CHECK();
}

// ---- embedding and log-probabilities ------------------------------------------------------------------

void embed_backward(const float* dH, int64_t D, const int32_t* tokens, int64_t T, int copies, float* dtable,
                    int64_t vocab, cudaStream_t stream) {
  if (T <= 0 || D <= 0 || copies <= 0) return;  // nothing to add, as on the CPU
  if (!dH || !tokens || !dtable) require("dH, tokens or dtable is null", "embed_backward");
  if (vocab < 1) require("vocab < 1", "embed_backward");
  detail::Scratch<int64_t> next(T, stream);
  detail::Scratch<unsigned char> first(T, stream);
  CUDA_CHECK(cudaMemsetAsync(first.get(), 1, size_t(T), stream));
  embed_next_kernel<<<detail::grid_for(T, kThreads), kThreads, 0, stream>>>(tokens, T, next.get());
  DSV4_LAUNCH_CHECK();
  embed_first_kernel<<<detail::grid_for(T, kThreads), kThreads, 0, stream>>>(next.get(), T, first.get());
  DSV4_LAUNCH_CHECK();
  embed_bwd_kernel<<<detail::grid_for(T * D, kThreads), kThreads, 0, stream>>>(dH, D, tokens, T, copies, next.get(),
                                                                              first.get(), dtable, vocab);
  DSV4_LAUNCH_CHECK();
}

void log_softmax_backward(const float* logits, int64_t rows, int64_t V, const int32_t* target,
                          const float* dlogprob, float temperature, float* dlogits, cudaStream_t stream) {
  if (rows < 0 || V < 0) require("rows or V is negative", "log_softmax_backward");
  if (rows == 0 || V == 0) return;
  if (!logits || !target || !dlogprob || !dlogits)
    require("logits, target, dlogprob or dlogits is null", "log_softmax_backward");
  detail::Scratch<float> lse(rows, stream);
  lse_kernel<<<detail::grid_for(rows, kRowsPerBlock, 65535), kThreads, 0, stream>>>(logits, rows, V, target,
                                                                                   dlogprob, temperature, lse.get());
  DSV4_LAUNCH_CHECK();
  log_softmax_bwd_kernel<<<detail::grid_for(rows * V, kThreads), kThreads, 0, stream>>>(
      logits, rows, V, target, dlogprob, temperature, lse.get(), dlogits);
  DSV4_LAUNCH_CHECK();
}

}  // namespace dsv4::cuda
