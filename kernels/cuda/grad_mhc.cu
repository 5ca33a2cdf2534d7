// Backward of the manifold hyper-connections on the GPU (kernels/grad.h: hc_post_backward,
// hc_pre_backward, hc_head_backward), bit-identical to kernels/cpu/grad_mhc.cpp: every output
// element is formed with the operations of kernels/detail/grad_mhc.h (mostly by calling those
// functions; the two token sums that are rewritten for the device say which function they follow)
// or the canonical dot (reproduced by dot8), on the same inputs, and each thread owns whole output
// elements. Compiled with --fmad=false, so nothing but the explicit fma is contracted.
//
// hc_post_backward:
//   - post_elem_kernel, one thread per (t, d): df[t, d] and dR[t, j, d] for every j, each the CPU's
//     fma chain over k (hc_post_df_at / hc_post_dR_at) then one add into the output;
//   - post_dots_kernel, one aligned group of 8 threads per (t, k, r): dpost[t, k] = dot(dout[t, k], f[t])
//     (r = 0) or dcomb[t, r - 1, k] = dot(dout[t, k], R[t, r - 1]) with dot8.
// hc_pre_backward / hc_head_backward (the three passes of the CPU, split into kernels):
//   1. raw = fn . x of all tokens as one cuda::gemm with fp32 out (the CPU's fn_products: each
//      element exactly dot(fn_i, x), whatever the number of rows or tokens);
//   2. token_dots_kernel, one group of 8 threads per (token, dot): the sum of squares of the token's
//      hc * D values, and (mixer) dw_j = dot(dy[t], X[t, j]), with dot8;
//   3. token_coefs_kernel, one thread per token (grid-stride over a bounded number of slots, each with
//      its own global scratch for m, a and the Sinkhorn iterates): rho, the logits, the weights of
//      y, and (mixer) da, gc, the token's dscale terms and c, with the CPU's per-token functions in
//      the CPU's order;
//   4. dx_kernel, one thread per (column q, 8 consecutive tokens): mhc_dx_range on the single column q
//      of each token (the columns of a range are independent, so this is the CPU's value);
//   5. (mixer) dfn_kernel, one thread per (8 rows, column q): mhc_dfn_range's sequential sum over the
//      tokens in increasing order for each of the rows (X[:, q] loaded once for the 8 rows);
//   6. (mixer) token_sums_kernel, one warp per dbase row and per dscale group: mhc_token_sum's
//      sequential sum over the tokens.
// No atomics; no result depends on the launch configuration.
#include <algorithm>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/grad.h"
#include "kernels/detail/grad_mhc.h"

namespace dsv4::cuda {

namespace {

constexpr int kThreads = 256;
constexpr int kCoefThreads = 32;  // small blocks: the few token threads spread over all SMs
constexpr int kDxTokens = 8;      // tokens per dx_kernel thread
constexpr int kDfnThreads = 128;  // dfn_kernel: columns per tile (one per thread)
constexpr int kDfnRows = 8;       // dfn_kernel: mixer rows per tile
constexpr int kDfnStage = kDfnThreads / kDfnRows;  // tokens per shared-memory stage (one gc value per thread)
// Bound of the per-slot scratch of token_coefs_kernel (floats; 256 MiB).
constexpr int64_t kCoefScratchFloats = int64_t(1) << 26;

// ---- hc_post -------------------------------------------------------------------------------------

// One thread per (t, d) (tokens over grid y, columns over grid x): df[t, d] and dR[t, j, d] for j
// increasing, each the CPU's fma chain over k (hc_post_df_at / hc_post_dR_at) then one add into the
// output. The thread re-reads dout[t, :, d] from L1 for every j.
__global__ void __launch_bounds__(kThreads) post_elem_kernel(HcPostBwdParams p) {
  const int hc = p.hc;
  const int64_t D = p.D, d = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (d >= D) return;
  for (int64_t t = blockIdx.y; t < p.T; t += gridDim.y) {
    const float* dout = p.dout + t * hc * D;
    float* df = p.df + t * D + d;
    *df = *df + common::hc_post_df_at(p.post + t * hc, dout, hc, D, d);
    for (int j = 0; j < hc; ++j) {
      float* dR = p.dR + (t * hc + j) * D + d;
      *dR = *dR + common::hc_post_dR_at(p.comb + t * hc * hc, dout, hc, D, j, d);
    }
  }
}

// One aligned group of 8 threads per (t, k, r), r in [0, hc]: r = 0 is dpost[t, k], r = 1 + j is
// dcomb[t, j, k]. The loop bound is uniform over a group, so all 8 lanes make every dot8 call.
__global__ void __launch_bounds__(kThreads) post_dots_kernel(HcPostBwdParams p) {
  const int lane = threadIdx.x & 7;
  const unsigned mask = detail::group8_mask();
  const int hc = p.hc;
  const int64_t D = p.D, per_token = int64_t(hc) * (hc + 1), total = p.T * per_token;
  for (int64_t u = int64_t(blockIdx.x) * (kThreads / 8) + threadIdx.x / 8; u < total;
       u += int64_t(gridDim.x) * (kThreads / 8)) {
    const int64_t t = u / per_token;
    const int rem = int(u % per_token);
    const int k = rem / (hc + 1), r = rem % (hc + 1);
    const float* dk = p.dout + (t * hc + k) * D;
    const float* other = r == 0 ? p.f + t * D : p.R + (t * hc + (r - 1)) * D;
    const float v = detail::dot8(dk, other, D, p.order.block, lane, mask);
    if (lane != 0) continue;
    if (r == 0)
      p.dpost[t * hc + k] = v;
    else
      p.dcomb[(t * hc + (r - 1)) * hc + k] = v;
  }
}

// ---- hc_pre / hc_head ---------------------------------------------------------------------------

// What hc_pre_backward and hc_head_backward share (the CPU's MixerBwd), plus the scratch buffers.
struct MixerArgs {
  int64_t T = 0;
  int hc = 0;
  int64_t D = 0;
  bool head = false;
  bool mixer = false;
  int rows = 0;    // mixer rows: (2 + hc) * hc for hc_pre, hc for hc_head
  int nraw = 0;    // rows of raw: rows with the mixer, hc without
  int groups = 0;  // scale groups: 3 for hc_pre, 1 for hc_head
  const float* X = nullptr;
  const float* fn = nullptr;
  const float* scale = nullptr;
  const float* base = nullptr;
  float rms_eps = 0, hc_eps = 0;
  int iters = 0;  // hc_pre only
  int block = 0;  // ReduceOrder block
  const float* dy = nullptr;
  const float* dpost = nullptr;  // hc_pre full mode
  const float* dcomb = nullptr;
  float* dX = nullptr;
  float* dfn = nullptr;
  float* dscale = nullptr;
  float* dbase = nullptr;
  // scratch
  const float* raw = nullptr;  // [T, nraw]
  float* ss = nullptr;         // [T] sum of squares of the token's hc * D values
  float* dw = nullptr;         // [T, hc] dot(dy[t], X[t, j]) (mixer)
  float* wt = nullptr;         // [T, hc] pre / w
  float* da = nullptr;         // [T, rows] (mixer)
  float* gc = nullptr;         // [T, rows] (mixer)
  float* dsc = nullptr;        // [T, groups] (mixer)
  float* c = nullptr;          // [T] (mixer)
  float* slot = nullptr;       // [slots, slot_floats]: m [rows], a [rows], Sinkhorn iterates
  int64_t slots = 0, slot_floats = 0;
};

// One aligned group of 8 threads per (t, w): w = 0 forms ss[t] = sum_squares(X[t]) over the hc * D
// values, w = 1 + j (mixer only) dw[t, j] = dot(dy[t], X[t, j]) over D (the canonical order, dot8).
// The loop bound is uniform over a group, so all 8 lanes make every dot8 call.
__global__ void __launch_bounds__(kThreads) token_dots_kernel(MixerArgs a) {
  const int lane = threadIdx.x & 7;
  const unsigned mask = detail::group8_mask();
  const int hc = a.hc, per_token = a.mixer ? hc + 1 : 1;
  const int64_t D = a.D, hcD = int64_t(hc) * D, total = a.T * per_token;
  for (int64_t u = int64_t(blockIdx.x) * (kThreads / 8) + threadIdx.x / 8; u < total;
       u += int64_t(gridDim.x) * (kThreads / 8)) {
    const int64_t t = u / per_token;
    const int w = int(u % per_token);
    const float* x = a.X + t * hcD;
    if (w == 0) {
      const float ss = detail::dot8(x, x, hcD, a.block, lane, mask);
      if (lane == 0) a.ss[t] = ss;
    } else {
      const float v = detail::dot8(a.dy + t * D, x + (w - 1) * D, D, a.block, lane, mask);
      if (lane == 0) a.dw[t * hc + (w - 1)] = v;
    }
  }
}

// One thread per token (slot s handles tokens s, s + slots, ...): the per-token part of the CPU's
// mixer_backward, with the same functions in the same order.
__global__ void __launch_bounds__(kCoefThreads) token_coefs_kernel(MixerArgs a) {
  const int64_t s = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (s >= a.slots) return;
  const int hc = a.hc, rows = a.rows, nraw = a.nraw;
  const int64_t hcD = int64_t(hc) * a.D;
  float* m = a.slot + s * a.slot_floats;
  float* av = m + rows;
  float* saved = av + rows;
  for (int64_t t = s; t < a.T; t += a.slots) {
    const float* rt = a.raw + t * nraw;
    const float rho = common::rms_scale(a.ss[t], hcD, a.rms_eps);
    common::mhc_logits(rt, rho, nraw, hc, a.head, a.scale, a.base, m, av);
    float* wt = a.wt + t * hc;
    for (int j = 0; j < hc; ++j) wt[j] = num::sigmoid_f(av[j]) + a.hc_eps;
    float c = 0.0f;
    if (a.mixer) {
      const float* dw = a.dw + t * hc;
      float* dat = a.da + t * rows;
      if (a.head) {
        for (int j = 0; j < hc; ++j) dat[j] = common::sigmoid_backward(av[j], dw[j]);
      } else {
        common::sinkhorn_forward_saved(av + 2 * hc, hc, a.iters, a.hc_eps, saved);
        common::hc_pre_logits_backward(av, hc, dw, a.dpost + t * hc, a.dcomb + t * hc * hc, saved, a.iters,
                                       a.hc_eps, dat);
      }
      c = common::mhc_mixer_coefs(dat, m, rt, rho, rows, hc, a.head, a.scale, hcD, a.gc + t * rows,
                                  a.dsc + t * a.groups);
      a.c[t] = c;
    }
  }
}

// One thread per (q, chunk of kDxTokens tokens): dX[t, q] (+=) the CPU's v for column q of each token
// of the chunk in turn (mhc_dx_range on one column; each column of a range is independent, so this
// is the CPU's value). A thread keeps one column across tokens, so fn[:, q] is re-read from L1.
__global__ void __launch_bounds__(kThreads) dx_kernel(MixerArgs a) {
  const int hc = a.hc;
  const int64_t D = a.D, hcD = int64_t(hc) * D, chunks = (a.T + kDxTokens - 1) / kDxTokens, total = chunks * hcD;
  for (int64_t e = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; e < total;
       e += int64_t(gridDim.x) * blockDim.x) {
    const int64_t t0 = (e / hcD) * kDxTokens, q = e % hcD;
    const int64_t t1 = t0 + kDxTokens < a.T ? t0 + kDxTokens : a.T;
    for (int64_t t = t0; t < t1; ++t)
      common::mhc_dx_range(a.X + t * hcD, a.wt + t * hc, a.dy + t * D, D, a.mixer, a.fn, hcD, a.rows,
                           a.mixer ? a.gc + t * a.rows : nullptr, a.mixer ? a.c[t] : 0.0f, q, 1,
                           a.dX + t * hcD);
  }
}

// dfn[i, q] (+=) s with s = sequential fp32 sum over t = 0 .. T-1 (from 0) of (gc[t, i] * X[t, q]),
// the product rounded first, then dfn[i, q] = dfn[i, q] + s: the operations of mhc_dfn_range for one
// element, here for kDfnRows rows at once so that each X value is loaded once for all of them. A
// block takes a tile of kDfnRows rows by kDfnThreads columns (tiles grid-stride), one column per
// thread; the tokens are walked in stages of kDfnStage, the stage's gc values of the tile's rows
// staged in shared memory (0 past the last row, whose sums are never stored).
__global__ void __launch_bounds__(kDfnThreads) dfn_kernel(MixerArgs a) {
  __shared__ float sg[kDfnStage * kDfnRows];
  const int rows = a.rows;
  const int64_t T = a.T, hcD = int64_t(a.hc) * a.D;
  const int64_t col_tiles = (hcD + kDfnThreads - 1) / kDfnThreads, row_tiles = (rows + kDfnRows - 1) / kDfnRows;
  for (int64_t tile = blockIdx.x; tile < row_tiles * col_tiles; tile += gridDim.x) {  // uniform over the block
    const int i0 = int(tile / col_tiles) * kDfnRows;
    const int64_t q = (tile % col_tiles) * kDfnThreads + threadIdx.x;
    const bool active = q < hcD;
    const float* x = a.X + (active ? q : 0);
    float s[kDfnRows];
#pragma unroll
    for (int r = 0; r < kDfnRows; ++r) s[r] = 0.0f;
    for (int64_t t0 = 0; t0 < T; t0 += kDfnStage) {
      const int n = T - t0 < kDfnStage ? int(T - t0) : kDfnStage;
      {
        const int u = int(threadIdx.x) / kDfnRows, r = int(threadIdx.x) % kDfnRows;
        sg[threadIdx.x] = (u < n && i0 + r < rows) ? a.gc[(t0 + u) * rows + i0 + r] : 0.0f;
      }
      __syncthreads();
      if (active && n == kDfnStage) {  // a full stage: all loads first, then the adds in token order
        float xv[kDfnStage];
#pragma unroll
        for (int u = 0; u < kDfnStage; ++u) xv[u] = x[(t0 + u) * hcD];
#pragma unroll
        for (int u = 0; u < kDfnStage; ++u)
#pragma unroll
          for (int r = 0; r < kDfnRows; ++r) s[r] = s[r] + sg[u * kDfnRows + r] * xv[u];
      } else if (active) {
        for (int u = 0; u < n; ++u) {
          const float xv = x[(t0 + u) * hcD];
#pragma unroll
          for (int r = 0; r < kDfnRows; ++r) s[r] = s[r] + sg[u * kDfnRows + r] * xv;
        }
      }
      __syncthreads();
    }
    if (active) {
#pragma unroll
      for (int r = 0; r < kDfnRows; ++r) {
        if (i0 + r < rows) {
          float* out = a.dfn + int64_t(i0 + r) * hcD + q;
          *out = *out + s[r];
        }
      }
    }
  }
}

// One warp per output: dbase[i] for o = i < rows, dscale[g] for o = rows + g. The operations of
// mhc_token_sum: s = 0, s = s + v[t] for t = 0 .. T-1 in increasing order, then out = out + s. The
// lanes load 32 tokens' values at a time; every lane runs the same chain over them (shuffles in
// lane order), and lane 0 writes.
__global__ void __launch_bounds__(kThreads) token_sums_kernel(MixerArgs a) {
  const int lane = threadIdx.x & 31;
  const int64_t total = int64_t(a.rows) + a.groups;
  for (int64_t o = int64_t(blockIdx.x) * (kThreads / 32) + threadIdx.x / 32; o < total;
       o += int64_t(gridDim.x) * (kThreads / 32)) {
    const bool is_base = o < a.rows;
    const float* v = is_base ? a.da : a.dsc;
    const int64_t ld = is_base ? a.rows : a.groups;
    const int64_t idx = is_base ? o : o - a.rows;
    float* out = is_base ? a.dbase : a.dscale;
    float s = 0.0f;
    for (int64_t t0 = 0; t0 < a.T; t0 += 32) {
      const float mine = t0 + lane < a.T ? v[(t0 + lane) * ld + idx] : 0.0f;
      const int n = a.T - t0 < 32 ? int(a.T - t0) : 32;
      for (int k = 0; k < n; ++k) s = s + __shfl_sync(0xffffffffu, mine, k);
    }
    if (lane == 0) out[idx] = out[idx] + s;
  }
}

// The CPU's mixer_backward. The caller has validated the parameters (hc <= kMhcMaxHc).
void mixer_backward(MixerArgs a, ReduceOrder order, cudaStream_t stream) {
  if (a.T <= 0) return;
  const int hc = a.hc;
  const int64_t T = a.T, hcD = int64_t(hc) * a.D;
  a.rows = a.head ? hc : (2 + hc) * hc;
  a.nraw = a.mixer ? a.rows : hc;  // legacy: only the weights of y are needed
  a.groups = a.head ? 1 : 3;
  a.block = order.block;

  detail::Scratch<float> raw(T * a.nraw, stream);
  gemm(linear_params(T, a.nraw, hcD, a.X, a.fn, raw.get(), OutRound::f32, order), stream);
  a.raw = raw.get();

  detail::Scratch<float> ss(T, stream), wt(T * hc, stream);
  detail::Scratch<float> dw(a.mixer ? T * hc : 0, stream), da(a.mixer ? T * a.rows : 0, stream),
      gc(a.mixer ? T * a.rows : 0, stream), dsc(a.mixer ? T * a.groups : 0, stream), c(a.mixer ? T : 0, stream);
  a.ss = ss.get(), a.wt = wt.get(), a.dw = dw.get(), a.da = da.get(), a.gc = gc.get(), a.dsc = dsc.get();
  a.c = c.get();

  const int64_t saved_n = (a.mixer && !a.head) ? common::sinkhorn_saved_floats(hc, a.iters) : 0;
  a.slot_floats = 2 * int64_t(a.rows) + saved_n;
  const int64_t cap = std::max<int64_t>(kCoefThreads, kCoefScratchFloats / a.slot_floats);
  a.slots = std::min<int64_t>(T, cap);
  detail::Scratch<float> slot(a.slots * a.slot_floats, stream);
  a.slot = slot.get();

  const int64_t dot_groups = T * (a.mixer ? hc + 1 : 1);
  token_dots_kernel<<<detail::grid_for(dot_groups, kThreads / 8, 65535), kThreads, 0, stream>>>(a);
  DSV4_LAUNCH_CHECK();
  token_coefs_kernel<<<unsigned(detail::ceil_div(a.slots, kCoefThreads)), kCoefThreads, 0, stream>>>(a);
  DSV4_LAUNCH_CHECK();
  dx_kernel<<<detail::grid_for(detail::ceil_div(T, kDxTokens) * hcD, kThreads), kThreads, 0, stream>>>(a);
  DSV4_LAUNCH_CHECK();
  if (!a.mixer || !a.dfn) return;  // a frozen mixer: its weights receive no gradient
  const int64_t tiles = detail::ceil_div(a.rows, kDfnRows) * detail::ceil_div(hcD, kDfnThreads);
  dfn_kernel<<<detail::grid_for(tiles, 1), kDfnThreads, 0, stream>>>(a);
  DSV4_LAUNCH_CHECK();
  token_sums_kernel<<<detail::grid_for(int64_t(a.rows) + a.groups, kThreads / 32), kThreads, 0, stream>>>(a);
  DSV4_LAUNCH_CHECK();
}

}  // namespace

void hc_post_backward(const HcPostBwdParams& p, cudaStream_t stream) {
  require(dsv4::hc_post_backward_check(p), "hc_post_backward");
  if (p.T <= 0) return;
  const int64_t dots = p.T * int64_t(p.hc) * (p.hc + 1);
  const dim3 elem_grid(unsigned(detail::ceil_div(p.D, kThreads)), unsigned(std::min<int64_t>(p.T, 65535)));
  post_elem_kernel<<<elem_grid, kThreads, 0, stream>>>(p);
  DSV4_LAUNCH_CHECK();
  post_dots_kernel<<<detail::grid_for(dots, kThreads / 8, 65535), kThreads, 0, stream>>>(p);
  DSV4_LAUNCH_CHECK();
}

void hc_pre_backward(const HcPreBwdParams& p, cudaStream_t stream) {
  require(dsv4::hc_pre_backward_check(p), "hc_pre_backward");
  MixerArgs a;
  a.T = p.T, a.hc = p.hc, a.D = p.D, a.head = false, a.mixer = p.train_mixer;
  a.X = p.X, a.fn = p.fn, a.scale = p.scale, a.base = p.base;
  a.rms_eps = p.rms_eps, a.hc_eps = p.hc_eps, a.iters = p.sinkhorn_iters;
  a.dy = p.dy, a.dpost = p.dpost, a.dcomb = p.dcomb;
  a.dX = p.dX, a.dfn = p.dfn, a.dscale = p.dscale, a.dbase = p.dbase;
  mixer_backward(a, p.order, stream);
}

void hc_head_backward(const HcHeadBwdParams& p, cudaStream_t stream) {
  require(dsv4::hc_head_backward_check(p), "hc_head_backward");
  MixerArgs a;
  a.T = p.T, a.hc = p.hc, a.D = p.D, a.head = true, a.mixer = p.train_mixer;
  a.X = p.X, a.fn = p.fn, a.scale = p.scale, a.base = p.base;
  a.rms_eps = p.rms_eps, a.hc_eps = p.hc_eps;
  a.dy = p.dy;
  a.dX = p.dX, a.dfn = p.dfn, a.dscale = p.dscale, a.dbase = p.dbase;
  mixer_backward(a, p.order, stream);
}

}  // namespace dsv4::cuda
