// Manifold hyper-connections on the GPU in the operation order of kernels/mhc.h.
//
// hc_pre / hc_head: the fn . x products of all tokens are one GEMM with fp32 out (each element
// exactly dot(fn_i, x)), as on the CPU; then
//   - weights_kernel, one group of 8 threads per token: rho from sum_squares(x) over the token's
//     hc * D values (dot8), then lane 0 forms the mixing weights (and, for hc_pre, post and the
//     Sinkhorn-normalised comb) with the CPU's functions of kernels/detail/mhc.h;
//   - mix_kernel, one thread per (t, d): y = bf16(fma chain over j of w_j * X[t, j, d]).
// hc_post: one thread per (t, d), each of its hc outputs (t, k, d) with the CPU's fma chain over j.
#include "kernels/cuda/common.cuh"
#include "kernels/detail/mhc.h"

namespace dsv4::cuda {

namespace {

constexpr int kThreads = 256, kMaxHc = 16;

struct MixArgs {
  int64_t T = 0;
  int hc = 4;
  int64_t D = 0;
  const float* X = nullptr;
  const float* raw = nullptr;  // [T, rows] fn . x
  int64_t rows = 0;            // (2 + hc) * hc for hc_pre, hc for hc_head
  const float* scale = nullptr;
  const float* base = nullptr;
  float rms_eps = 0, hc_eps = 0;
  int sinkhorn_iters = 0;
  int block = 0;  // ReduceOrder block
  bool head = false;
  float* y = nullptr;
  float* post = nullptr;  // hc_pre only
  float* comb = nullptr;  // hc_pre only
};

// One aligned group of 8 threads per token (32 tokens per block, grid-stride). The group forms rho
// with dot8; lane 0 then forms the mixing weights (hc_pre: pre, post and the Sinkhorn-normalised comb)
// with the CPU's functions. `wt` receives the weights of y (pre, or hc_head's w).
__global__ void __launch_bounds__(kThreads) weights_kernel(MixArgs a, float* wt) {
  const int lane = threadIdx.x & 7;
  const unsigned mask = detail::group8_mask();
  const int64_t hcD = int64_t(a.hc) * a.D;
  constexpr int kMaxRows = (2 + kMaxHc) * kMaxHc;
  for (int64_t t = int64_t(blockIdx.x) * (kThreads / 8) + threadIdx.x / 8; t < a.T;
       t += int64_t(gridDim.x) * (kThreads / 8)) {
    const float* x = a.X + t * hcD;
    const float ss = detail::dot8(x, x, hcD, a.block, lane, mask);
    if (lane != 0) continue;
    const float rho = common::rms_scale(ss, hcD, a.rms_eps);
    const float* raw = a.raw + t * a.rows;
    const int hc = a.hc;
    if (a.head) {
      common::hc_head_weights(raw, rho, hc, a.scale, a.base, a.hc_eps, wt + t * hc);
    } else {
      float av[kMaxRows];
      common::hc_pre_weights(raw, rho, hc, a.scale, a.base, a.hc_eps, a.sinkhorn_iters, av, wt + t * hc,
                             a.post + t * hc, a.comb + t * hc * hc);
    }
  }
}

// Index: int where every (t, d) fits one (the integer division and remainder of the element index are
// then 32-bit), else int64_t.
// One thread per (t, d): y = bf16(fma chain over j of wt[t, j] * X[t, j, d]).
template <typename Index>
__global__ void __launch_bounds__(kThreads) mix_kernel(MixArgs a, const float* wt) {
  const int hc = a.hc;
  const Index D = Index(a.D), total = Index(a.T) * D;
  for (Index e = Index(blockIdx.x) * blockDim.x + threadIdx.x; e < total; e += Index(gridDim.x) * blockDim.x) {
    const Index t = e / D, d = e - t * D;
    a.y[e] = common::mix_streams_at(a.X + int64_t(t) * hc * a.D, wt + int64_t(t) * hc, hc, a.D, d);
  }
}

// The token's R[j, d] for every j, loaded once (common::hc_post_of's R_at).
struct LoadedColumn {
  const float* r;
  __device__ float operator()(int j) const { return r[j]; }
};

// One thread per (t, d), writing the hc outputs (t, k, d): R[t, j, d] and f[t, d] are read once for
// all k.
template <typename Index>
__global__ void __launch_bounds__(kThreads) hc_post_kernel(HcPostParams p) {
  const int hc = p.hc;
  const Index D = Index(p.D), total = Index(p.T) * D;
  for (Index e = Index(blockIdx.x) * blockDim.x + threadIdx.x; e < total; e += Index(gridDim.x) * blockDim.x) {
    const Index t = e / D, d = e - t * D;
    const float* R = p.R + int64_t(t) * hc * p.D + d;
    float r[kMaxHc];
    for (int j = 0; j < hc; ++j) r[j] = R[int64_t(j) * p.D];
    const float f_d = p.f[e];
    const float* post = p.post + int64_t(t) * hc;
    const float* comb = p.comb + int64_t(t) * hc * hc;
    float* out = p.out + int64_t(t) * hc * p.D + d;
    for (int k = 0; k < hc; ++k) out[int64_t(k) * p.D] = common::hc_post_of(f_d, LoadedColumn{r}, post, comb, hc, k);
  }
}

bool fits_int(int64_t n) {
  return n < (int64_t(1) << 31) - (int64_t(65535) * kThreads);  // room for the grid stride
}

// raw[t, i] = dot(fn_i, X[t]) for all tokens (fp32, canonical order): the CPU's fn_products.
void fn_products(int64_t T, int64_t hcD, const float* X, const float* fn, int64_t rows, ReduceOrder o,
                 float* raw, cudaStream_t stream) {
  gemm(linear_params(T, rows, hcD, X, fn, raw, OutRound::f32, o), stream);
}

// wt: hc_pre's pre output, or hc_head's w (scratch when the caller does not want it).
void launch_mix(const MixArgs& a, float* wt, cudaStream_t stream) {
  if (a.hc > kMaxHc) throw Error("cuda hc_pre/hc_head cannot run: hc is larger than 16");
  weights_kernel<<<detail::grid_for(a.T, kThreads / 8, 65535), kThreads, 0, stream>>>(a, wt);
  DSV4_LAUNCH_CHECK();
  if (fits_int(a.T * a.D))
    mix_kernel<int><<<detail::grid_for(a.T * a.D, kThreads), kThreads, 0, stream>>>(a, wt);
  else
    mix_kernel<int64_t><<<detail::grid_for(a.T * a.D, kThreads), kThreads, 0, stream>>>(a, wt);
  DSV4_LAUNCH_CHECK();
}

}  // namespace

void hc_pre(const HcPreParams& p, cudaStream_t stream) {
  require(dsv4::hc_pre_check(p), "hc_pre");
  if (p.T <= 0) return;
  const int64_t hcD = int64_t(p.hc) * p.D, rows = int64_t(2 + p.hc) * p.hc;
  detail::Scratch<float> raw(p.T * rows, stream);
  fn_products(p.T, hcD, p.X, p.fn, rows, p.order, raw.get(), stream);
  MixArgs a;
  a.T = p.T, a.hc = p.hc, a.D = p.D, a.X = p.X, a.raw = raw.get(), a.rows = rows;
  a.scale = p.scale, a.base = p.base, a.rms_eps = p.rms_eps, a.hc_eps = p.hc_eps;
  a.sinkhorn_iters = p.sinkhorn_iters, a.block = p.order.block, a.head = false;
  a.y = p.y, a.post = p.post, a.comb = p.comb;
  launch_mix(a, p.pre, stream);
}

const char* hc_post_check(const HcPostParams& p) {
  if (p.T < 0) return "hc_post: T < 0";
  if (p.hc < 1) return "hc_post: hc < 1";
  if (p.hc > kMaxHc) return "hc_post: hc > 16 (the GPU kernel keeps a token's hc streams in registers)";
  if (p.D < 1) return "hc_post: D < 1";
  if (p.T > 0 && (!p.f || !p.R || !p.post || !p.comb || !p.out)) return "hc_post: null pointer";
  if (p.T > 0 && p.out == p.R) return "hc_post: out must not alias R";
  return nullptr;
}

void hc_post(const HcPostParams& p, cudaStream_t stream) {
  require(cuda::hc_post_check(p), "hc_post");
  if (p.T <= 0) return;
  if (fits_int(p.T * p.D))
    hc_post_kernel<int><<<detail::grid_for(p.T * p.D, kThreads), kThreads, 0, stream>>>(p);
  else
    hc_post_kernel<int64_t><<<detail::grid_for(p.T * p.D, kThreads), kThreads, 0, stream>>>(p);
  DSV4_LAUNCH_CHECK();
}

const char* hc_head_check(const HcHeadParams& p) {
  if (p.T < 0) return "hc_head: T < 0";
  if (p.hc < 1) return "hc_head: hc < 1";
  if (p.D < 1) return "hc_head: D < 1";
  if (p.order.block < 0 || p.order.block % 8 != 0)
    return "hc_head: reduce block must be 0 or a positive multiple of 8";
  if (p.T > 0 && (!p.X || !p.fn || !p.scale || !p.base || !p.y)) return "hc_head: null pointer";
  return nullptr;
}

void hc_head(const HcHeadParams& p, cudaStream_t stream) {
  require(cuda::hc_head_check(p), "hc_head");
  if (p.T <= 0) return;
  const int64_t hcD = int64_t(p.hc) * p.D;
  detail::Scratch<float> raw(p.T * p.hc, stream);
  fn_products(p.T, hcD, p.X, p.fn, p.hc, p.order, raw.get(), stream);
  MixArgs a;
  a.T = p.T, a.hc = p.hc, a.D = p.D, a.X = p.X, a.raw = raw.get(), a.rows = p.hc;
  a.scale = p.scale, a.base = p.base, a.rms_eps = p.rms_eps, a.hc_eps = p.hc_eps;
  a.block = p.order.block, a.head = true;
  a.y = p.y;
  detail::Scratch<float> w(p.w ? 0 : p.T * p.hc, stream);
  launch_mix(a, p.w ? p.w : w.get(), stream);
}

}  // namespace dsv4::cuda
