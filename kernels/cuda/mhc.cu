// Manifold hyper-connections on the GPU in the operation order of kernels/mhc.h.
//
// hc_pre / hc_head: raw[t, i] = dot(fn_i, X[t]) (fp32, canonical order, exactly what the CPU's fn
// GEMM gives), rho from sum_squares(X[t]) over the token's hc * D values, then the mixing weights with
// the CPU's functions of kernels/detail/mhc.h, then y. Two ways to the weights (the same bits):
//   - fused_weights_kernel (the usual one: 1, 2, 3, 4, 8, 15 or 24 fn rows, i.e. hc_pre with hc <= 4
//     and hc_head with hc <= 4 or hc == 8; chain or blocked order): the fn . x products, the sum of
//     squares and the weights in one kernel that reads X once. See its comment for the work split.
//   - otherwise the fn . x products of all tokens are one GEMM with fp32 out (cuda::gemm), and
//     weights_kernel, one group of 8 threads per token, forms rho with dot8 and lane 0 the weights.
// Then mix_kernel, one thread per (t, d) or per 4 consecutive d (mix4_kernel, rows 16-byte aligned):
// y = bf16(fma chain over j of w_j * X[t, j, d]).
// hc_post: one thread per (t, d), each of its hc outputs (t, k, d) with the CPU's fma chain over j;
// for hc = 4 and aligned rows of D % 4 == 0 (the model's case), one thread per 4 consecutive d.

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
  const float* fn = nullptr;   // [rows, hc * D]
  const float* raw = nullptr;  // [T, rows] fn . x (the GEMM path)
  int64_t rows = 0;            // (2 + hc) * hc for hc_pre, hc for hc_head
  const float* scale = nullptr;
  const float* base = nullptr;
  float rms_eps = 0, hc_eps = 0;
  int sinkhorn_iters = 0;
  ReduceOrder order{};
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
    const float ss = detail::dot8(x, x, hcD, a.order.block, lane, mask);
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

// ---- the fused weights kernel ----------------------------------------------------------------------
// fused_weights_kernel<NR, A, NT>: NR fn rows, A tokens per thread, NT threads per block.
//
// Order. For each token, the NR products dot(fn_r, x) and sum_squares(x) = dot(x, x) over the token's
// n = hc * D values are dsv4::dot's canonical order (kernels/reduce.h), exactly as the CPU's GEMM and
// sum_squares form them: a chain is [0, n) (single chain, or n <= block) or a block of `block`
// elements; lane l of a chain accumulates the elements i = l (mod 8) with acc = fma(x[i], f[i], acc)
// in increasing i from +0 (a lane whose element lies past n skips the step); at the end of a chain the
// lanes are combined as ((l0 + l4) + (l2 + l6)) + ((l1 + l5) + (l3 + l7)) and the chain result is added
// to the running sum (the first chain initialises it). The weights then come from the CPU's functions.
//
// Work split. An aligned group of 8 threads is the 8 lanes: thread l of group g holds lane l of the
// NR + 1 accumulators (the NR fn rows and the sum of squares) of A tokens, t0 + a * (NT / 8) + g for
// a < A, so each fn value it loads feeds A fmas and each x value NR + 1. The block's tokens and the fn
// rows are staged through shared memory 64 elements (8 steps) at a time with cp.async, 3 stages deep:
// the copies of the next two stages are in flight while the fmas of the current one run, and the
// stage loads are plain coalesced row segments (the lane split would otherwise make every warp load
// touch 4 tokens' rows for 32 useful bytes each). In a step every thread of a warp reads the same 8
// fn values per row (a broadcast) and its tokens' x values from rows 72 floats apart (the 4 groups of
// a warp hit distinct banks). At the end of a chain a group halves its lane values three times with
// shuffles (partners l ^ 4, l ^ 2, l ^ 1: each round adds the partner's copy of the outputs it keeps,
// which is exactly the pairing of the lane combination above), so that lane l ends up holding about
// 1/8 of the outputs, and adds those chain results to its running sums. After the last chain the
// results go through shared memory to lanes a < A, which form token a's weights.
constexpr int kChunk = 64, kChunkSteps = kChunk / 8;  // elements (steps) of a stage
constexpr int kStages = 3;
constexpr int kXStride = kChunk + 8;  // shared row of a token: groups of a warp 8 banks apart

// cp.async where the device has it (sm_80+); elsewhere a plain copy (bytes = 0: zeros).
__device__ __forceinline__ void copy_async4(float* dst, const float* src, bool valid) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(
                   static_cast<unsigned>(__cvta_generic_to_shared(dst))),
               "l"(src), "r"(valid ? 4 : 0)
               : "memory");
#else
  *dst = valid ? *src : 0.0f;
#endif
}
__device__ __forceinline__ void copy_async16(float* dst, const float* src, bool valid) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(
                   static_cast<unsigned>(__cvta_generic_to_shared(dst))),
               "l"(src), "r"(valid ? 16 : 0)
               : "memory");
#else
  *reinterpret_cast<float4*>(dst) =
      valid ? *reinterpret_cast<const float4*>(src) : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
#endif
}
__device__ __forceinline__ void copy_commit() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.commit_group;\n" ::: "memory");
#endif
}
template <int N>
__device__ __forceinline__ void copy_wait() {  // at most N committed groups still in flight
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
#endif
}

// One halving round over the N values v[0, N) of a lane: the lane keeps the first half ((N + 1) / 2
// values) when (lane & M) == 0, else the second, and adds the partner's (lane ^ M) copy of the values
// it keeps. v[j] then holds the kept output j or j + (N + 1) / 2. All 32 threads of the warp call it.
template <int NV, int N, int M>
__device__ __forceinline__ void halve(float (&v)[NV], int lane) {
  constexpr int H = (N + 1) / 2;
  const bool upper = (lane & M) != 0;
#pragma unroll
  for (int j = 0; j < H; ++j) {
    const float lo = v[j], hi = j + H < N ? v[j + H] : 0.0f;
    const float keep = upper ? hi : lo, send = upper ? lo : hi;
    v[j] = keep + __shfl_xor_sync(0xffffffffu, send, M);
  }
}

// Whether NR fn rows can be hc_pre's, (2 + hc) * hc (else only hc_head's: the kernel then has no
// hc_pre code).
constexpr bool pre_rows(int NR) {
  for (int hc = 1; (2 + hc) * hc <= NR; ++hc)
    if ((2 + hc) * hc == NR) return true;
  return false;
}

template <int NR, int A>
struct FusedShape {
  static constexpr int NO = A * (NR + 1);  // outputs of a group: A tokens x (NR fn rows + sum of squares)
  static constexpr int H1 = (NO + 1) / 2, H2 = (H1 + 1) / 2, H3 = (H2 + 1) / 2;  // kept after each round
};

template <int NR, int A, int NT>
constexpr int fused_stage_floats() {
  return NR * kChunk + (NT / 8) * A * kXStride;
}
template <int NR, int A, int NT>
constexpr int fused_smem_bytes() {
  return kStages * fused_stage_floats<NR, A, NT>() * int(sizeof(float));
}

// vec: every fn and X row starts 16-byte aligned (pointers aligned, hc * D % 4 == 0): the stages are
// copied 16 bytes at a time.
template <int NR, int A, int NT>
__global__ void __launch_bounds__(NT, 1) fused_weights_kernel(MixArgs a, float* wt, bool vec) {
  using S = FusedShape<NR, A>;
  constexpr int G = NT / 8, TOK = G * A;  // groups, tokens of a block
  constexpr int FSZ = NR * kChunk, STAGE = fused_stage_floats<NR, A, NT>();
  static_assert(NT % 32 == 0 && STAGE % 4 == 0 && TOK * S::NO / A <= kStages * STAGE, "shared layout");
  extern __shared__ float4 fused_smem4[];
  float* const smem = reinterpret_cast<float*>(fused_smem4);
  const int tid = threadIdx.x, lane = tid & 7, grp = tid >> 3;
  const int64_t n = int64_t(a.hc) * a.D;
  const int64_t nchunks = (n + kChunk - 1) / kChunk;
  // Steps per chain: the block's, or "never" for a single chain (the last step always ends a chain).
  const int64_t chain_steps = (a.order.block > 0 && n > a.order.block) ? a.order.block / 8 : INT64_MAX;

  for (int64_t t0 = int64_t(blockIdx.x) * TOK; t0 < a.T; t0 += int64_t(gridDim.x) * TOK) {
    // Stage c: fn [NR][kChunk] then the block's tokens [TOK][kXStride], elements c * kChunk + k; zeros
    // past n and for tokens past T.
    auto issue = [&](int64_t c) {
      float* st = smem + (c % kStages) * STAGE;
      const int64_t k0 = c * kChunk;
      if (vec) {
#pragma unroll
        for (int e = tid; e < NR * (kChunk / 4); e += NT) {
          const int r = e / (kChunk / 4), k = 4 * (e % (kChunk / 4));
          const bool ok = k0 + k < n;
          copy_async16(st + r * kChunk + k, ok ? a.fn + r * n + k0 + k : a.fn, ok);
        }
#pragma unroll
        for (int e = tid; e < TOK * (kChunk / 4); e += NT) {
          const int tk = e / (kChunk / 4), k = 4 * (e % (kChunk / 4));
          const int64_t t = t0 + tk;
          const bool ok = t < a.T && k0 + k < n;
          copy_async16(st + FSZ + tk * kXStride + k, ok ? a.X + t * n + k0 + k : a.X, ok);
        }
      } else {
#pragma unroll 4
        for (int e = tid; e < FSZ; e += NT) {
          const int r = e / kChunk, k = e % kChunk;
          const bool ok = k0 + k < n;
          copy_async4(st + r * kChunk + k, ok ? a.fn + r * n + k0 + k : a.fn, ok);
        }
#pragma unroll 4
        for (int e = tid; e < TOK * kChunk; e += NT) {
          const int tk = e / kChunk, k = e % kChunk;
          const int64_t t = t0 + tk;
          const bool ok = t < a.T && k0 + k < n;
          copy_async4(st + FSZ + tk * kXStride + k, ok ? a.X + t * n + k0 + k : a.X, ok);
        }
      }
    };

    float acc[S::NO];  // lane values, output a * (NR + 1) + r (r == NR: the sum of squares)
    float sum[S::H3];  // running sums of the outputs this lane keeps after the halving rounds
#pragma unroll
    for (int o = 0; o < S::NO; ++o) acc[o] = 0.0f;
#pragma unroll
    for (int j = 0; j < S::H3; ++j) sum[j] = 0.0f;
    bool started = false;  // a finished chain has been added to sum
    int64_t pos = 0;       // steps of the current chain done

    // The step at chunk offset 8u: fn from `f` (lane's column of row 0), x from `x` (lane's column
    // of this group's first token).
    auto step = [&](const float* f, const float* x) {
      float xv[A];
#pragma unroll
      for (int t = 0; t < A; ++t) xv[t] = x[t * G * kXStride];
#pragma unroll
      for (int r = 0; r < NR; ++r) {
        const float fv = f[r * kChunk];
#pragma unroll
        for (int t = 0; t < A; ++t) acc[t * (NR + 1) + r] = __fmaf_rn(xv[t], fv, acc[t * (NR + 1) + r]);
      }
#pragma unroll
      for (int t = 0; t < A; ++t) acc[t * (NR + 1) + NR] = __fmaf_rn(xv[t], xv[t], acc[t * (NR + 1) + NR]);
    };
    // End of a chain: the lane combination by halving, the chain results into the running sums, the
    // lanes restarted at +0.
    auto end_chain = [&]() {
      halve<S::NO, S::NO, 4>(acc, lane);
      halve<S::NO, S::H1, 2>(acc, lane);
      halve<S::NO, S::H2, 1>(acc, lane);
#pragma unroll
      for (int j = 0; j < S::H3; ++j) sum[j] = started ? sum[j] + acc[j] : acc[j];
#pragma unroll
      for (int o = 0; o < S::NO; ++o) acc[o] = 0.0f;
      started = true;
      pos = 0;
    };

#pragma unroll
    for (int c = 0; c < kStages - 1; ++c) {
      if (c < nchunks) issue(c);
      copy_commit();
    }
    for (int64_t c = 0; c < nchunks; ++c) {
      copy_wait<kStages - 2>();  // this thread's copies of stage c are done
      __syncthreads();           // everyone's, and everyone is done with stage c - 1
      if (c + kStages - 1 < nchunks) issue(c + kStages - 1);  // into the buffer of stage c - 1
      copy_commit();
      const float* st = smem + (c % kStages) * STAGE;
      const float* f = st + lane;
      const float* x = st + FSZ + grp * kXStride + lane;
      const int64_t k0 = c * kChunk;
      // Uniform over the block: every thread walks the same steps.
      if (k0 + kChunk <= n && pos + kChunkSteps <= chain_steps) {
        // The whole stage lies inside n and inside one chain (which may end with the stage).
#pragma unroll
        for (int u = 0; u < kChunkSteps; ++u) step(f + 8 * u, x + 8 * u);
        pos += kChunkSteps;
        if (pos == chain_steps || k0 + kChunk == n) end_chain();
      } else {
#pragma unroll 1
        for (int u = 0; u < kChunkSteps && k0 + 8 * u < n; ++u) {
          if (k0 + 8 * u + lane < n) step(f + 8 * u, x + 8 * u);  // lanes past n skip the step
          ++pos;
          if (pos == chain_steps || k0 + 8 * u + 8 >= n) end_chain();
        }
      }
    }
    copy_wait<0>();
    __syncthreads();  // the stages are free: the results go there

    // Lane l holds, in sum[j], output j + b0 H3 + b1 H2 + b2 H1 (b_k = bit k of l) where each level's
    // index lies inside that level's half.
    float* res = smem + grp * S::NO;  // [S::NO] of this group
    const int b0 = lane & 1, b1 = (lane >> 1) & 1, b2 = (lane >> 2) & 1;
#pragma unroll
    for (int j = 0; j < S::H3; ++j) {
      const int i2 = j + b0 * S::H3, i1 = i2 + b1 * S::H2, o = i1 + b2 * S::H1;
      if (i2 < S::H2 && i1 < S::H1 && o < S::NO) res[o] = sum[j];
    }
    __syncwarp();
    if (lane < A) {
      const int64_t t = t0 + int64_t(lane) * G + grp;
      if (t < a.T) {
        const float* raw = res + lane * (NR + 1);
        const float rho = common::rms_scale(raw[NR], n, a.rms_eps);
        const int hc = a.hc;
        if constexpr (pre_rows(NR)) {
          if (!a.head) {
            float av[NR];
            common::hc_pre_weights(raw, rho, hc, a.scale, a.base, a.hc_eps, a.sinkhorn_iters, av, wt + t * hc,
                                   a.post + t * hc, a.comb + t * hc * hc);
          }
        }
        if (a.head) common::hc_head_weights(raw, rho, hc, a.scale, a.base, a.hc_eps, wt + t * hc);
      }
    }
    __syncthreads();  // res is read before the next tokens' stages overwrite it
  }
}

int sm_count() {
  return detail::device_attribute(cudaDevAttrMultiProcessorCount);
}
int smem_optin() {
  return detail::device_attribute(cudaDevAttrMaxSharedMemoryPerBlockOptin);
}

template <int NR, int A, int NT>
void launch_fused(const MixArgs& a, float* wt, bool vec, cudaStream_t stream) {
  constexpr int smem = fused_smem_bytes<NR, A, NT>();
  auto kernel = fused_weights_kernel<NR, A, NT>;
  CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  constexpr int tok = NT / 8 * A;
  kernel<<<detail::grid_for(a.T, tok, 65535), NT, smem, stream>>>(a, wt, vec);
  DSV4_LAUNCH_CHECK();
}

// The kernel's time is mostly one block's walk over the token's hc * D values, so the split favours
// more, lighter blocks. Measured on the H200 (hc_pre, Flash shape, ms at T = 8192 / 4096 / 2048):
// A = 4 with 128 threads 0.61 / 0.53 / 0.50, A = 2 0.60 / 0.40 / 0.37, A = 1 0.90 / 0.49 / 0.35,
// A = 1 with 32 threads 1.22 / 0.60 / 0.51. Hence A = 2 from T = 16 x SMs, A = 1 (16 tokens a block)
// from 8 x SMs, and A = 1 with 32 threads (4 tokens a block) below. Every split gives the same bits.
// False when the device lacks the shared memory (the caller then takes the GEMM path).
template <int NR>
bool launch_fused_rows(const MixArgs& a, float* wt, bool vec, cudaStream_t stream) {
  const int64_t sms = sm_count();
  if (a.T >= 16 * sms && fused_smem_bytes<NR, 2, 128>() <= smem_optin()) {
    launch_fused<NR, 2, 128>(a, wt, vec, stream);
    return true;
  }
  if (a.T >= 8 * sms && fused_smem_bytes<NR, 1, 128>() <= smem_optin()) {
    launch_fused<NR, 1, 128>(a, wt, vec, stream);
    return true;
  }
  if (fused_smem_bytes<NR, 1, 32>() <= smem_optin()) {
    launch_fused<NR, 1, 32>(a, wt, vec, stream);
    return true;
  }
  return false;
}

// Runs the fused kernel when it has an instance for a.rows and the order is an exact one; false
// otherwise.
bool try_fused(const MixArgs& a, float* wt, cudaStream_t stream) {
  if (a.order.tensor_core) return false;
  const int64_t n = int64_t(a.hc) * a.D;
  const auto aligned = [](const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; };
  const bool vec = n % 4 == 0 && aligned(a.X) && aligned(a.fn);
  switch (a.rows) {
    case 1: return launch_fused_rows<1>(a, wt, vec, stream);
    case 2: return launch_fused_rows<2>(a, wt, vec, stream);
    case 3: return launch_fused_rows<3>(a, wt, vec, stream);
    case 4: return launch_fused_rows<4>(a, wt, vec, stream);
    case 8: return launch_fused_rows<8>(a, wt, vec, stream);
    case 15: return launch_fused_rows<15>(a, wt, vec, stream);
    case 24: return launch_fused_rows<24>(a, wt, vec, stream);
    default: return false;
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

// The same for 4 consecutive d at a time (D % 4 == 0, X and y 16-byte aligned): float4 loads and
// stores, each of the 4 values with common::mix_streams_at's chain acc = fma(wt[j], X[t, j, d], acc)
// over j from acc = 0, then bf16.
template <typename Index>
__global__ void __launch_bounds__(kThreads) mix4_kernel(MixArgs a, const float* wt) {
  const int hc = a.hc;
  const Index D4 = Index(a.D / 4), total = Index(a.T) * D4;
  for (Index e = Index(blockIdx.x) * blockDim.x + threadIdx.x; e < total; e += Index(gridDim.x) * blockDim.x) {
    const Index t = e / D4, d4 = e - t * D4;
    const float4* x = reinterpret_cast<const float4*>(a.X + int64_t(t) * hc * a.D) + d4;
    const float* w = wt + int64_t(t) * hc;
    float4 acc = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    for (int j = 0; j < hc; ++j) {
      const float wj = w[j];
      const float4 v = x[int64_t(j) * D4];
      acc.x = __fmaf_rn(wj, v.x, acc.x);
      acc.y = __fmaf_rn(wj, v.y, acc.y);
      acc.z = __fmaf_rn(wj, v.z, acc.z);
      acc.w = __fmaf_rn(wj, v.w, acc.w);
    }
    reinterpret_cast<float4*>(a.y)[e] =
        make_float4(num::bf16_round(acc.x), num::bf16_round(acc.y), num::bf16_round(acc.z), num::bf16_round(acc.w));
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

// hc_post for hc = HC, 4 consecutive d a thread (D % 4 == 0; f, R and out 16-byte aligned): float4
// loads and stores, the token's post and comb read once into registers for its 4 columns, each output
// by common::hc_post_of as above.
template <int HC, typename Index>
__global__ void __launch_bounds__(kThreads) hc_post4_kernel(HcPostParams p) {
  const Index D4 = Index(p.D / 4), total = Index(p.T) * D4;
  for (Index e = Index(blockIdx.x) * blockDim.x + threadIdx.x; e < total; e += Index(gridDim.x) * blockDim.x) {
    const Index t = e / D4, d4 = e - t * D4;
    float post[HC], comb[HC * HC];
#pragma unroll
    for (int i = 0; i < HC; ++i) post[i] = p.post[int64_t(t) * HC + i];
#pragma unroll
    for (int i = 0; i < HC * HC; ++i) comb[i] = p.comb[int64_t(t) * HC * HC + i];
    const float4* R = reinterpret_cast<const float4*>(p.R + int64_t(t) * HC * p.D) + d4;
    float4 r[HC];
#pragma unroll
    for (int j = 0; j < HC; ++j) r[j] = R[int64_t(j) * D4];
    const float4 f = reinterpret_cast<const float4*>(p.f)[e];
    float4* out = reinterpret_cast<float4*>(p.out + int64_t(t) * HC * p.D) + d4;
#pragma unroll
    for (int k = 0; k < HC; ++k) {
      float rx[HC], ry[HC], rz[HC], rw[HC];
#pragma unroll
      for (int j = 0; j < HC; ++j) rx[j] = r[j].x, ry[j] = r[j].y, rz[j] = r[j].z, rw[j] = r[j].w;
      out[int64_t(k) * D4] = make_float4(common::hc_post_of(f.x, LoadedColumn{rx}, post, comb, HC, k),
                                         common::hc_post_of(f.y, LoadedColumn{ry}, post, comb, HC, k),
                                         common::hc_post_of(f.z, LoadedColumn{rz}, post, comb, HC, k),
                                         common::hc_post_of(f.w, LoadedColumn{rw}, post, comb, HC, k));
    }
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
void launch_mix(MixArgs a, float* wt, cudaStream_t stream) {
  if (a.hc > kMaxHc) throw Error("cuda hc_pre/hc_head cannot run: hc is larger than 16");
  const int64_t hcD = int64_t(a.hc) * a.D;
  if (!try_fused(a, wt, stream)) {
    detail::Scratch<float> raw(a.T * a.rows, stream);
    fn_products(a.T, hcD, a.X, a.fn, a.rows, a.order, raw.get(), stream);
    a.raw = raw.get();
    weights_kernel<<<detail::grid_for(a.T, kThreads / 8, 65535), kThreads, 0, stream>>>(a, wt);
    DSV4_LAUNCH_CHECK();
  }
  const bool vec4 = a.D % 4 == 0 && reinterpret_cast<uintptr_t>(a.X) % 16 == 0 &&
                    reinterpret_cast<uintptr_t>(a.y) % 16 == 0;
  if (vec4) {
    if (fits_int(a.T * a.D / 4))
      mix4_kernel<int><<<detail::grid_for(a.T * a.D / 4, kThreads), kThreads, 0, stream>>>(a, wt);
    else
      mix4_kernel<int64_t><<<detail::grid_for(a.T * a.D / 4, kThreads), kThreads, 0, stream>>>(a, wt);
  } else if (fits_int(a.T * a.D)) {
    mix_kernel<int><<<detail::grid_for(a.T * a.D, kThreads), kThreads, 0, stream>>>(a, wt);
  } else {
    mix_kernel<int64_t><<<detail::grid_for(a.T * a.D, kThreads), kThreads, 0, stream>>>(a, wt);
  }
  DSV4_LAUNCH_CHECK();
}

}  // namespace

void hc_pre(const HcPreParams& p, cudaStream_t stream) {
  require(dsv4::hc_pre_check(p), "hc_pre");
  if (p.T <= 0) return;
  MixArgs a;
  a.T = p.T, a.hc = p.hc, a.D = p.D, a.X = p.X, a.fn = p.fn, a.rows = int64_t(2 + p.hc) * p.hc;
  a.scale = p.scale, a.base = p.base, a.rms_eps = p.rms_eps, a.hc_eps = p.hc_eps;
  a.sinkhorn_iters = p.sinkhorn_iters, a.order = p.order, a.head = false;
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
  const auto aligned = [](const void* x) { return reinterpret_cast<uintptr_t>(x) % 16 == 0; };
  if (p.hc == 4 && p.D % 4 == 0 && aligned(p.f) && aligned(p.R) && aligned(p.out)) {  // the model's hc
    const int64_t n = p.T * p.D / 4;
    if (fits_int(n))
      hc_post4_kernel<4, int><<<detail::grid_for(n, kThreads), kThreads, 0, stream>>>(p);
    else
      hc_post4_kernel<4, int64_t><<<detail::grid_for(n, kThreads), kThreads, 0, stream>>>(p);
    DSV4_LAUNCH_CHECK();
    return;
  }
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
  MixArgs a;
  a.T = p.T, a.hc = p.hc, a.D = p.D, a.X = p.X, a.fn = p.fn, a.rows = p.hc;
  a.scale = p.scale, a.base = p.base, a.rms_eps = p.rms_eps, a.hc_eps = p.hc_eps;
  a.order = p.order, a.head = true;
  a.y = p.y;
  detail::Scratch<float> w(p.w ? 0 : p.T * p.hc, stream);
  launch_mix(a, p.w ? p.w : w.get(), stream);
}

}  // namespace dsv4::cuda
