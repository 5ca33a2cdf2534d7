// Manifold hyper-connections on the GPU in the operation order of kernels/mhc.h.
//
// hc_pre / hc_head: raw[t, i] = dot(fn_i, X[t]) (fp32, canonical order, exactly what the CPU's fn
// GEMM gives), rho from sum_squares(X[t]) over the token's hc * D values, then the mixing weights with
// the CPU's functions of kernels/detail/mhc.h, then y. Two ways to the weights (the same bits):
//   - fused_weights_kernel (the usual one: 1, 2, 3, 4, 8, 15 or 24 fn rows, i.e. hc_pre with hc <= 4
//     and hc_head with hc <= 4 or hc == 8; chain or blocked order): the fn . x products, the sum of
//     squares and the weights in one kernel that reads X once. See its comment for the work split.
//     For hc_pre it leaves comb's logits; the mix kernel's first blocks run their Sinkhorn
//     (comb_sinkhorn), beside the blocks that mix.
//   - otherwise the fn . x products of all tokens are one GEMM with fp32 out (cuda::gemm), and
//     weights_kernel, one group of 8 threads per token, forms rho with dot8 and lane 0 the weights.
// Then mix_kernel, one thread per (t, d) or per 4 consecutive d (mix4_kernel, rows 16-byte aligned):
// y = bf16(fma chain over j of w_j * X[t, j, d]).
// hc_post: one thread per (t, d), each of its hc outputs (t, k, d) with the CPU's fma chain over j;
// for hc = 4 and aligned rows of D % 4 == 0, one thread per 4 consecutive d.
// Rows of D % 512 == 0 (the models' widths; aligned, hc = 4 for hc_post) take a warp per 512
// consecutive d of a token instead (mix4_blocks_kernel, hc_post4_blocks_kernel): the warp then holds
// whole 1024-byte blocks of the output rows' bf16 patterns and forms their digest sums when asked
// (kernels/row_sums.h). The same kernel runs whether or not sums are asked for, so a recorded step
// launches what its replay does. Other rows asked for sums get them from cuda::row_sums_bf16 after
// the op.

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/xxh3_sums.cuh"
#include "kernels/detail/mhc.h"
#include "kernels/row_sums.h"

namespace dsv4::cuda {

namespace {

constexpr int kThreads = 256, kMaxHc = 16;

struct MixArgs {
  int64_t T = 0;
  int hc = 4;
  int64_t D = 0;
  const float* X = nullptr;
  const float* fn = nullptr;   // [rows, hc * D]
  const float* fs = nullptr;   // fn in stage order (fn_stage_kernel), for the fused kernel
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
  uint64_t* y_sums = nullptr;
  // > 0: comb holds the logits of the fused kernel (pre_weights_lanes), and the mix kernel's first
  // sinkhorn_blocks blocks run their Sinkhorn (run_comb_sinkhorn)
  int sinkhorn_blocks = 0;
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
// touch 4 tokens' rows for 32 useful bytes each). The fn rows come from a copy in stage order made
// once a call (fn_stage_kernel), in which a lane's 8 values of a row are two float4: a thread reads 4
// steps of a row with one 16-byte load (a broadcast across the warp) and its tokens' x values from
// rows 72 floats apart (the 4 groups of a warp hit distinct banks); each accumulator still takes its
// fmas in step order. At the end of a chain a group halves its lane values three times with
// shuffles (partners l ^ 4, l ^ 2, l ^ 1: each round adds the partner's copy of the outputs it keeps,
// which is exactly the pairing of the lane combination above), so that lane l ends up holding about
// 1/8 of the outputs, and adds those chain results to its running sums. After the last chain the
// results go through shared memory to the lanes that form the weights: hc_pre's with hc lanes a
// token (pre_weights_lanes: lane j forms pre_j, post_j and the logits of comb row j, whose Sinkhorn
// the mix kernel runs: comb_sinkhorn), hc_head's by lane a < A for token a. The weights' code is the
// CPU's (kernels/detail/mhc.h) with hc a constant.
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

// The hc whose hc_pre has NR = (2 + hc) * hc fn rows, or 0 where NR rows can only be hc_head's (the
// kernel then has no hc_pre code).
constexpr int pre_hc(int NR) {
  for (int hc = 1; (2 + hc) * hc <= NR; ++hc)
    if ((2 + hc) * hc == NR) return hc;
  return 0;
}

// The fn rows in stage order (fn_stage_kernel): stage c of row r is 64 floats in which lane l's 8
// steps lie as two float4, steps 0-3 and 4-7, at float4 index 2l + (h ^ bit 2 of l) for half h. A
// thread then reads 4 steps of a row with one 16-byte load, and the 8 lanes of a group (a quarter
// warp) hit 32 distinct banks. Elements past n are zeros (never used: lanes past n skip their steps).
__host__ __device__ constexpr int fn_stage_pos(int lane, int u) {
  return 4 * (2 * lane + ((u >> 2) ^ ((lane >> 2) & 1))) + (u & 3);
}

// fs[(c * NR + r) * kChunk + fn_stage_pos(l, u)] = fn[r, c * kChunk + 8u + l], one thread an element.
// `total` = nchunks * rows * kChunk elements, which the host keeps within an int (so are fn's rows * n).
__global__ void __launch_bounds__(kThreads)
    fn_stage_kernel(const float* fn, int rows, int n, int total, float* fs) {
  for (int e = blockIdx.x * blockDim.x + threadIdx.x; e < total; e += gridDim.x * blockDim.x) {
    const int cr = e / kChunk, c = cr / rows, r = cr - c * rows;
    const int p = e - cr * kChunk, q = p / 4;  // fn_stage_pos inverted
    const int lane = q / 2, u = 4 * ((q & 1) ^ ((lane >> 2) & 1)) + p % 4;
    const int k = c * kChunk + 8 * u + lane;
    fs[e] = k < n ? fn[r * n + k] : 0.0f;
  }
}

// Lane j of a token's hc lanes holds row j of its comb matrix; afterwards it holds column j (row i in
// v[i]) and the column steps are row steps. All 32 threads of the warp call it; `src0` is the warp
// lane of the token's lane 0 (a lane outside any token passes its own lane and j = 0).
template <int HC>
__device__ __forceinline__ void transpose_lanes(float (&v)[HC], int j, int src0) {
  float w[HC];
#pragma unroll
  for (int r = 0; r < HC; ++r) {
    const int give = (j - r + HC) % HC, from = (j + r) % HC;  // lane j + r receives our entry j + r
    float send = v[0];
#pragma unroll
    for (int q = 1; q < HC; ++q) send = q == give ? v[q] : send;
    const float got = __shfl_sync(0xffffffffu, send, src0 + from);
#pragma unroll
    for (int q = 0; q < HC; ++q)
      if (q == from) w[q] = got;
  }
#pragma unroll
  for (int q = 0; q < HC; ++q) v[q] = w[q];
}

// hc_pre's weights of the tokens whose fn products lie in res (token a of the group at res +
// a * (rows + 1), the sum of squares last), HC lanes a token: lane j forms pre_j, post_j and the logits
// of comb row j with common::'s functions, and leaves those logits in comb for the Sinkhorn, which the
// mix kernel's first blocks run (comb_sinkhorn: there its latency overlaps the mix's memory traffic
// instead of ending this kernel). A group's 8 lanes take 8 / HC tokens at a time.
template <int HC, int A>
__device__ void pre_weights_lanes(const MixArgs& a, const float* res, int64_t t0, int G, int grp, int lane,
                                  int64_t n, float* wt) {
  constexpr int NR = (2 + HC) * HC, PER = 8 / HC;  // tokens a round
  const int sub = lane / HC;                       // the lane's token of the round (PER: none)
  const int j = sub < PER ? lane % HC : 0;
#pragma unroll 1
  for (int a0 = 0; a0 < A; a0 += PER) {
    const int tok = a0 + sub;
    const bool live = sub < PER && tok < A && t0 + int64_t(tok) * G + grp < a.T;
    if (!live) continue;
    const float* raw = res + tok * (NR + 1);
    const float rho = common::rms_scale(raw[NR], n, a.rms_eps);
    const int64_t t = t0 + int64_t(tok) * G + grp;
    wt[t * HC + j] = common::hc_pre_weight(common::hc_pre_logit(raw, rho, HC, a.scale, a.base, j), a.hc_eps);
    a.post[t * HC + j] = common::hc_post_weight(common::hc_pre_logit(raw, rho, HC, a.scale, a.base, HC + j));
#pragma unroll
    for (int k = 0; k < HC; ++k)
      a.comb[t * HC * HC + j * HC + k] =
          common::hc_pre_logit(raw, rho, HC, a.scale, a.base, 2 * HC + j * HC + k);
  }
}

// comb_sinkhorn's tokens a warp (launch_mix sizes its blocks by it).
__host__ __device__ constexpr int comb_sinkhorn_tokens_per_warp(int hc) {
  return 32 / hc;
}

// The Sinkhorn of comb, whose rows hold the logits pre_weights_lanes left there, in place: 32 / HC
// tokens a warp, lane j of a token's HC lanes holding row j, the column steps run on columns moved
// across the lanes (transpose_lanes), so a token's Sinkhorn takes one row's latency instead of hc. The
// values are common::hc_pre_weights's: the same operations on the same operands in the same order.
// Block b of `blocks` takes the tokens of its warps, grid-stride; all 32 threads of a warp run it.
// Measured on mid's hc_pre (T = 4096, H100): the mix kernel takes 30 us against 28 without it, and the
// fused kernel 47 us against 55 with the Sinkhorn in its tail. One thread a token (common::sinkhorn on
// the matrix in registers) has fewer instructions but a longer chain: 43 us; the Sinkhorn blocks last
// instead of first end the kernel: 47 us; two rounds a warp (half the blocks): 33 us.
template <int HC>
__device__ void comb_sinkhorn(const MixArgs& a, int64_t b, int64_t blocks) {
  constexpr int PER = comb_sinkhorn_tokens_per_warp(HC);
  const int lane = threadIdx.x & 31, sub = lane / HC;
  const int j = sub < PER ? lane % HC : 0;
  const int src0 = lane - (sub < PER ? j : 0);  // a lane outside any token reads its own
  const int64_t wpb = blockDim.x / 32, warps = blocks * wpb;
  for (int64_t w = b * wpb + threadIdx.x / 32; w * PER < a.T; w += warps) {
    const int64_t t = w * PER + sub;
    const bool live = sub < PER && t < a.T;
    float* row = a.comb + (live ? t : 0) * HC * HC + j * HC;
    float v[HC];
#pragma unroll
    for (int k = 0; k < HC; ++k) v[k] = live ? row[k] : 0.0f;
    const float eps = a.hc_eps;
    common::sinkhorn_steps(
        a.sinkhorn_iters,
        [&] {
          common::line_softmax(v, v, HC, 1);
#pragma unroll
          for (int k = 0; k < HC; ++k) v[k] = v[k] + eps;
        },
        [&] { common::line_normalize(v, v, HC, 1, eps); },
        [&] {
          transpose_lanes<HC>(v, j, src0);
          common::line_normalize(v, v, HC, 1, eps);
          transpose_lanes<HC>(v, j, src0);
        });
    if (live) {
#pragma unroll
      for (int k = 0; k < HC; ++k) row[k] = v[k];
    }
  }
}

// The mix kernels' first a.sinkhorn_blocks blocks run comb_sinkhorn (true: the caller returns); the
// others mix, as block blockIdx.x - a.sinkhorn_blocks of gridDim.x - a.sinkhorn_blocks.
__device__ bool run_comb_sinkhorn(const MixArgs& a) {
  if (int(blockIdx.x) >= a.sinkhorn_blocks) return false;
  // The fused kernel leaves logits only for hc <= 4 (try_fused).
  if (a.hc == 1) comb_sinkhorn<1>(a, blockIdx.x, a.sinkhorn_blocks);
  if (a.hc == 2) comb_sinkhorn<2>(a, blockIdx.x, a.sinkhorn_blocks);
  if (a.hc == 3) comb_sinkhorn<3>(a, blockIdx.x, a.sinkhorn_blocks);
  if (a.hc == 4) comb_sinkhorn<4>(a, blockIdx.x, a.sinkhorn_blocks);
  return true;
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
  static_assert(TOK * 16 % NT == 0 && TOK * 16 / NT < 32, "vec copies: whole rounds, one bit each");
  extern __shared__ float4 fused_smem4[];
  float* const smem = reinterpret_cast<float*>(fused_smem4);
  const int tid = threadIdx.x, lane = tid & 7, grp = tid >> 3;
  const int64_t n = int64_t(a.hc) * a.D;
  const int64_t nchunks = (n + kChunk - 1) / kChunk;
  // Steps per chain: the block's, or "never" for a single chain (the last step always ends a chain).
  const int64_t chain_steps = (a.order.block > 0 && n > a.order.block) ? a.order.block / 8 : INT64_MAX;
  // The 16-byte copies: fn's stage is NR * 16 float4 in a row of a.fs; of the tokens, a thread copies
  // column kq of rows tid / 16 + i * (NT / 16) (vec).
  constexpr int kVecF = (NR * 16 + NT - 1) / NT, kVecX = TOK * 16 / NT;
  const int kq = 4 * (tid % 16);
  const int64_t x_step = (NT / 16) * n;

  for (int64_t t0 = int64_t(blockIdx.x) * TOK; t0 < a.T; t0 += int64_t(gridDim.x) * TOK) {
    // Stage c: fn [NR][kChunk] then the block's tokens [TOK][kXStride], elements c * kChunk + k; zeros
    // past n and for tokens past T. With vec, thread tid copies the 4 floats at column kq of the fn
    // rows and token rows tid / 16 + i * (NT / 16): the row offsets are formed here once, and a stage
    // adds only its k0.
    const int64_t tok_row = t0 + tid / 16;  // the thread's first token row
    unsigned x_ok = 0;                      // bit i: token row tok_row + i * (NT / 16) exists
#pragma unroll
    for (int i = 0; i < kVecX; ++i)
      if (tok_row + i * (NT / 16) < a.T) x_ok |= 1u << i;
    const float* const x_src = a.X + (x_ok & 1u ? tok_row : 0) * n + kq;  // row 0 when the first is past T
    const bool all_x = x_ok == (1u << kVecX) - 1u;                        // uniform over most blocks
    auto issue = [&](int64_t c, float* st) {
      const int64_t k0 = c * kChunk;
      const float* fsc = a.fs + c * FSZ;
#pragma unroll
      for (int i = 0; i < kVecF; ++i) {
        const int e = tid + i * NT;
        if (kVecF * NT > NR * 16 && e >= NR * 16) break;  // NR * 16 not a multiple of NT: the last round
        copy_async16(st + 4 * e, fsc + 4 * e, true);
      }
      if (vec && all_x && k0 + kChunk <= n) {  // the usual stage: one pointer walks down the rows
        const float* src = x_src + k0;
        float* dst = st + FSZ + (tid / 16) * kXStride + kq;
#pragma unroll
        for (int i = 0; i < kVecX; ++i) {
          copy_async16(dst + i * (NT / 16) * kXStride, src, true);
          src += x_step;
        }
      } else if (vec) {
        const bool kin = k0 + kq < n;
#pragma unroll
        for (int i = 0; i < kVecX; ++i) {
          const bool ok = kin && ((x_ok >> i) & 1u);
          copy_async16(st + FSZ + (tid / 16 + i * (NT / 16)) * kXStride + kq,
                       ok ? x_src + i * x_step + k0 : a.X, ok);
        }
      } else {
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

    // Steps 4h .. 4h + 3 of a stage (st): each row's 4 fn values in one 16-byte load, x from `x`
    // (lane's column of this group's first token at step 0). Every accumulator takes its 4 fmas in
    // step order, as in `step`.
    auto step4 = [&](const float* st, const float* x, int h) {
      float xv[4][A];
#pragma unroll
      for (int s = 0; s < 4; ++s)
#pragma unroll
        for (int t = 0; t < A; ++t) xv[s][t] = x[t * G * kXStride + 8 * (4 * h + s)];
      const float* f = st + fn_stage_pos(lane, 4 * h);
#pragma unroll
      for (int r = 0; r < NR; ++r) {
        const float4 fv = *reinterpret_cast<const float4*>(f + r * kChunk);
#pragma unroll
        for (int t = 0; t < A; ++t) {
          float& c = acc[t * (NR + 1) + r];
          c = __fmaf_rn(xv[0][t], fv.x, c);
          c = __fmaf_rn(xv[1][t], fv.y, c);
          c = __fmaf_rn(xv[2][t], fv.z, c);
          c = __fmaf_rn(xv[3][t], fv.w, c);
        }
      }
#pragma unroll
      for (int t = 0; t < A; ++t) {
        float& c = acc[t * (NR + 1) + NR];
#pragma unroll
        for (int s = 0; s < 4; ++s) c = __fmaf_rn(xv[s][t], xv[s][t], c);
      }
    };
    // One step: fn from `f` (lane's value of row 0 at this step), x from `x` (lane's column of this
    // group's first token at this step).
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
      if (c < nchunks) issue(c, smem + c * STAGE);
      copy_commit();
    }
    int cur = 0;  // the stage buffer of chunk c; chunk c + kStages - 1 goes into the one before it
    for (int64_t c = 0; c < nchunks; ++c) {
      copy_wait<kStages - 2>();  // this thread's copies of stage c are done
      __syncthreads();           // everyone's, and everyone is done with stage c - 1
      const int prev = cur == 0 ? kStages - 1 : cur - 1;
      if (c + kStages - 1 < nchunks) issue(c + kStages - 1, smem + prev * STAGE);
      copy_commit();
      const float* st = smem + cur * STAGE;
      cur = cur == kStages - 1 ? 0 : cur + 1;
      const float* x = st + FSZ + grp * kXStride + lane;
      const int64_t k0 = c * kChunk;
      // Uniform over the block: every thread walks the same steps.
      if (k0 + kChunk <= n && pos + kChunkSteps <= chain_steps) {
        // The whole stage lies inside n and inside one chain (which may end with the stage).
        step4(st, x, 0);
        step4(st, x, 1);
        pos += kChunkSteps;
        if (pos == chain_steps || k0 + kChunk == n) end_chain();
      } else {
#pragma unroll 1
        for (int u = 0; u < kChunkSteps && k0 + 8 * u < n; ++u) {
          if (k0 + 8 * u + lane < n) step(st + fn_stage_pos(lane, u), x + 8 * u);  // lanes past n skip it
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
    if constexpr (pre_hc(NR) > 0) {
      if (!a.head) {  // uniform: the whole warp takes hc_pre's lanes path
        pre_weights_lanes<pre_hc(NR), A>(a, res, t0, G, grp, lane, n, wt);
        __syncthreads();  // res is read before the next tokens' stages overwrite it
        continue;
      }
    }
    if (lane < A) {
      const int64_t t = t0 + int64_t(lane) * G + grp;
      if (t < a.T) {
        const float* raw = res + lane * (NR + 1);
        const float rho = common::rms_scale(raw[NR], n, a.rms_eps);
        common::hc_head_weights(raw, rho, NR, a.scale, a.base, a.hc_eps, wt + t * NR);  // hc_head: NR = hc
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

// Stages fn in stage order (fn_stage_kernel) and launches the instance.
template <int NR, int A, int NT>
void launch_fused(MixArgs a, float* wt, bool vec, cudaStream_t stream) {
  const int n = a.hc * int(a.D), total = int((n + kChunk - 1) / kChunk * NR * kChunk);  // try_fused's bound
  detail::Scratch<float> fs(total, stream);
  fn_stage_kernel<<<detail::grid_for(total, kThreads), kThreads, 0, stream>>>(a.fn, NR, n, total, fs.get());
  DSV4_LAUNCH_CHECK();
  a.fs = fs.get();
  constexpr int smem = fused_smem_bytes<NR, A, NT>();
  auto kernel = fused_weights_kernel<NR, A, NT>;
  CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  constexpr int tok = NT / 8 * A;
  kernel<<<detail::grid_for(a.T, tok, 65535), NT, smem, stream>>>(a, wt, vec);
  DSV4_LAUNCH_CHECK();
}

// The kernel's time is mostly one block's walk over the token's hc * D values, so the split favours
// more, lighter blocks. Measured on the H200 (hc_pre, Flash shape, ms at T = 8192 / 4096 / 2048, before
// the stage-order fn and the lanes' Sinkhorn): A = 4 with 128 threads 0.61 / 0.53 / 0.50, A = 2 0.60 /
// 0.40 / 0.37, A = 1 0.90 / 0.49 / 0.35, A = 1 with 32 threads 1.22 / 0.60 / 0.51. Hence A = 2 from
// T = 16 x SMs, A = 1 (16 tokens a block) from 8 x SMs, and A = 1 with 32 threads (4 tokens a block)
// below. Since those two changes (hc_pre with the mix, docs/GPU_RESULTS.md "hc_pre"): at T = 8192 A = 4
// takes 0.43 ms and A = 2 0.45-0.47; at T = 4096 (mid) A = 2 0.085 and A = 4 0.12. Hence A = 4 from
// T = 60 x SMs, where its blocks of 64 tokens fill at least 94% of the SMs. With the Sinkhorn in the
// mix kernel (H100, mid, the fused kernel alone): A = 2 47 us, A = 4 with 64 threads 57, with 32
// threads 60, A = 1 68. Every split gives the same bits.
// False when the device lacks the shared memory (the caller then takes the GEMM path).
template <int NR>
bool launch_fused_rows(const MixArgs& a, float* wt, bool vec, cudaStream_t stream) {
  const int64_t sms = sm_count();
  if (a.T >= 60 * sms && fused_smem_bytes<NR, 4, 128>() <= smem_optin()) {
    launch_fused<NR, 4, 128>(a, wt, vec, stream);
    return true;
  }
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
  const bool vec = n % 4 == 0 && aligned(a.X);
  // fn's stage-order copy has at most 24 rows of n rounded up to kChunk: within an int for any model.
  if ((n + kChunk) * 24 > INT32_MAX) return false;
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
// Whether y's rows take mix4_blocks_kernel.
bool mix_blocks(const MixArgs& a) {
  return a.D % xxh3::kSumRowValues == 0 && reinterpret_cast<uintptr_t>(a.X) % 16 == 0 &&
         reinterpret_cast<uintptr_t>(a.y) % 16 == 0;
}

// One warp per 512 consecutive d of a token (grid-stride over the warps' (t, chunk)), lane l the 4 d
// at 4 (l + 32 i), i < 4: y = bf16(fma chain over j of wt[t, j] * X[t, j, d]) as mix4_kernel, and
// with a.y_sums the chunk's block sums.
__global__ void __launch_bounds__(kThreads) mix4_blocks_kernel(MixArgs a, const float* wt) {
  constexpr int kW = sums::kWordsPerLane;
  const int lane = threadIdx.x & 31;
  const int64_t chunks = a.D / xxh3::kSumRowValues, D4 = a.D / 4;
  if (run_comb_sinkhorn(a)) return;
  const int64_t bx = int64_t(blockIdx.x) - a.sinkhorn_blocks, nb = int64_t(gridDim.x) - a.sinkhorn_blocks;
  const int64_t warps = nb * (blockDim.x / 32);
  for (int64_t wi = (bx * blockDim.x + threadIdx.x) / 32; wi < a.T * chunks; wi += warps) {
    const int64_t t = wi / chunks, c = wi - t * chunks;
    const float4* x = reinterpret_cast<const float4*>(a.X + t * a.hc * a.D) + c * 128 + lane;
    const float* w = wt + t * a.hc;
    float4 acc[kW];
#pragma unroll
    for (int i = 0; i < kW; ++i) acc[i] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    for (int j = 0; j < a.hc; ++j) {
      const float wj = w[j];
      float4 v[kW];
#pragma unroll
      for (int i = 0; i < kW; ++i) v[i] = x[int64_t(j) * D4 + 32 * i];
#pragma unroll
      for (int i = 0; i < kW; ++i) {
        acc[i].x = __fmaf_rn(wj, v[i].x, acc[i].x);
        acc[i].y = __fmaf_rn(wj, v[i].y, acc[i].y);
        acc[i].z = __fmaf_rn(wj, v[i].z, acc[i].z);
        acc[i].w = __fmaf_rn(wj, v[i].w, acc[i].w);
      }
    }
    float4* y = reinterpret_cast<float4*>(a.y + t * a.D) + c * 128 + lane;
    uint64_t words[kW];
#pragma unroll
    for (int i = 0; i < kW; ++i) {
      const float4 o = make_float4(num::bf16_round(acc[i].x), num::bf16_round(acc[i].y),
                                   num::bf16_round(acc[i].z), num::bf16_round(acc[i].w));
      y[32 * i] = o;
      words[i] = sums::bf16_word(o);
    }
    if (a.y_sums) sums::warp_block_sums(words, c == chunks - 1, lane, a.y_sums + wi * 8);
  }
}

// One thread per (t, d): y = bf16(fma chain over j of wt[t, j] * X[t, j, d]).
template <typename Index>
__global__ void __launch_bounds__(kThreads) mix_kernel(MixArgs a, const float* wt) {
  if (run_comb_sinkhorn(a)) return;
  const int hc = a.hc;
  const Index D = Index(a.D), total = Index(a.T) * D;
  const Index bx = Index(blockIdx.x) - a.sinkhorn_blocks, nb = Index(gridDim.x) - a.sinkhorn_blocks;
  for (Index e = bx * blockDim.x + threadIdx.x; e < total; e += nb * blockDim.x) {
    const Index t = e / D, d = e - t * D;
    a.y[e] = common::mix_streams_at(a.X + int64_t(t) * hc * a.D, wt + int64_t(t) * hc, hc, a.D, d);
  }
}

// The same for 4 consecutive d at a time (D % 4 == 0, X and y 16-byte aligned): float4 loads and
// stores, each of the 4 values with common::mix_streams_at's chain acc = fma(wt[j], X[t, j, d], acc)
// over j from acc = 0, then bf16.
template <typename Index>
__global__ void __launch_bounds__(kThreads) mix4_kernel(MixArgs a, const float* wt) {
  if (run_comb_sinkhorn(a)) return;
  const int hc = a.hc;
  const Index D4 = Index(a.D / 4), total = Index(a.T) * D4;
  const Index bx = Index(blockIdx.x) - a.sinkhorn_blocks, nb = Index(gridDim.x) - a.sinkhorn_blocks;
  for (Index e = bx * blockDim.x + threadIdx.x; e < total; e += nb * blockDim.x) {
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

// hc_post for hc = HC (16-byte aligned rows of D % 512 == 0): one warp per 512 consecutive d of a
// token (grid-stride over the warps' (t, chunk)), lane l the 4 d at 4 (l + 32 i), i < 4, each output by
// common::hc_post_of as below; with p.out_sums the block sums of the chunk in each of the hc rows.
// 3 blocks an SM: 80 registers (a few spilled) rather than 94 at 2.
template <int HC>
__global__ void __launch_bounds__(kThreads, 3) hc_post4_blocks_kernel(HcPostParams p) {
  constexpr int kW = sums::kWordsPerLane;
  const int lane = threadIdx.x & 31;
  const int64_t chunks = p.D / xxh3::kSumRowValues, D4 = p.D / 4;
  const int64_t warps = int64_t(gridDim.x) * (blockDim.x / 32);
  for (int64_t wi = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) / 32; wi < p.T * chunks; wi += warps) {
    const int64_t t = wi / chunks, c = wi - t * chunks;
    float post[HC], comb[HC * HC];
#pragma unroll
    for (int i = 0; i < HC; ++i) post[i] = p.post[t * HC + i];
#pragma unroll
    for (int i = 0; i < HC * HC; ++i) comb[i] = p.comb[t * HC * HC + i];
    const float4* R = reinterpret_cast<const float4*>(p.R + t * HC * p.D) + c * 128 + lane;
    const float4* f = reinterpret_cast<const float4*>(p.f + t * p.D) + c * 128 + lane;
    float4* out = reinterpret_cast<float4*>(p.out + t * HC * p.D) + c * 128 + lane;
    uint64_t terms[HC];  // with sums: lane l's stripe terms of the chunk's block in each row k
#pragma unroll
    for (int k = 0; k < HC; ++k) terms[k] = 0;
#pragma unroll
    for (int i = 0; i < kW; ++i) {
      const float4 fv = f[32 * i];
      float rx[HC], ry[HC], rz[HC], rw[HC];
#pragma unroll
      for (int j = 0; j < HC; ++j) {
        const float4 r = R[int64_t(j) * D4 + 32 * i];
        rx[j] = r.x, ry[j] = r.y, rz[j] = r.z, rw[j] = r.w;
      }
#pragma unroll
      for (int k = 0; k < HC; ++k) {
        const float4 o = make_float4(common::hc_post_of(fv.x, LoadedColumn{rx}, post, comb, HC, k),
                                     common::hc_post_of(fv.y, LoadedColumn{ry}, post, comb, HC, k),
                                     common::hc_post_of(fv.z, LoadedColumn{rz}, post, comb, HC, k),
                                     common::hc_post_of(fv.w, LoadedColumn{rw}, post, comb, HC, k));
        out[int64_t(k) * D4 + 32 * i] = o;
        if (p.out_sums) terms[k] += sums::word_term(sums::bf16_word(o), i, k == HC - 1 && c == chunks - 1, lane);
      }
    }
    if (p.out_sums) {
#pragma unroll
      for (int k = 0; k < HC; ++k)  // block k * chunks + c of the token's row of HC * D values
        sums::block_sums_out(terms[k], lane, p.out_sums + ((t * HC + k) * chunks + c) * 8);
    }
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
  if (try_fused(a, wt, stream)) {
    // hc_pre's comb holds logits: the mix kernel's first blocks run their Sinkhorn.
    if (!a.head) {
      const int64_t warps = detail::ceil_div(a.T, comb_sinkhorn_tokens_per_warp(a.hc));
      a.sinkhorn_blocks = int(std::min<int64_t>(detail::ceil_div(warps, kThreads / 32), 4096));
    }
  } else {
    detail::Scratch<float> raw(a.T * a.rows, stream);
    fn_products(a.T, hcD, a.X, a.fn, a.rows, a.order, raw.get(), stream);
    a.raw = raw.get();
    weights_kernel<<<detail::grid_for(a.T, kThreads / 8, 65535), kThreads, 0, stream>>>(a, wt);
    DSV4_LAUNCH_CHECK();
  }
  const bool vec4 = a.D % 4 == 0 && reinterpret_cast<uintptr_t>(a.X) % 16 == 0 &&
                    reinterpret_cast<uintptr_t>(a.y) % 16 == 0;
  // The mix's grid for n work items of `per` a block, and the Sinkhorn's blocks before it.
  const auto grid = [&](int64_t n, int per) {
    return detail::grid_for(n, per) + unsigned(a.sinkhorn_blocks);
  };
  if (mix_blocks(a)) {
    const unsigned blocks = grid(a.T * (a.D / xxh3::kSumRowValues), kThreads / 32);
    mix4_blocks_kernel<<<blocks, kThreads, 0, stream>>>(a, wt);
    DSV4_LAUNCH_CHECK();
    return;
  }
  if (vec4) {
    if (fits_int(a.T * a.D / 4))
      mix4_kernel<int><<<grid(a.T * a.D / 4, kThreads), kThreads, 0, stream>>>(a, wt);
    else
      mix4_kernel<int64_t><<<grid(a.T * a.D / 4, kThreads), kThreads, 0, stream>>>(a, wt);
  } else if (fits_int(a.T * a.D)) {
    mix_kernel<int><<<grid(a.T * a.D, kThreads), kThreads, 0, stream>>>(a, wt);
  } else {
    mix_kernel<int64_t><<<grid(a.T * a.D, kThreads), kThreads, 0, stream>>>(a, wt);
  }
  DSV4_LAUNCH_CHECK();
  if (a.y_sums) row_sums_bf16(a.y, a.T, a.D, a.D, a.y_sums, stream);
}

}  // namespace

void hc_pre(const HcPreParams& p, cudaStream_t stream) {
  require(dsv4::hc_pre_check(p), "hc_pre");
  if (p.T <= 0) return;
  MixArgs a;
  a.T = p.T, a.hc = p.hc, a.D = p.D, a.X = p.X, a.fn = p.fn, a.rows = int64_t(2 + p.hc) * p.hc;
  a.scale = p.scale, a.base = p.base, a.rms_eps = p.rms_eps, a.hc_eps = p.hc_eps;
  a.sinkhorn_iters = p.sinkhorn_iters, a.order = p.order, a.head = false;
  a.y = p.y, a.post = p.post, a.comb = p.comb, a.y_sums = p.y_sums;
  launch_mix(a, p.pre, stream);
}

const char* hc_post_check(const HcPostParams& p) {
  if (p.T < 0) return "hc_post: T < 0";
  if (p.hc < 1) return "hc_post: hc < 1";
  if (p.hc > kMaxHc) return "hc_post: hc > 16 (the GPU kernel keeps a token's hc streams in registers)";
  if (p.D < 1) return "hc_post: D < 1";
  if (p.T > 0 && (!p.f || !p.R || !p.post || !p.comb || !p.out)) return "hc_post: null pointer";
  if (p.T > 0 && p.out == p.R) return "hc_post: out must not alias R";
  return row_sums_check(p.out_sums, p.hc * p.D,
                        "hc_post: out_sums asked for rows of hc * D values, not a multiple of 512");
}

void hc_post(const HcPostParams& p, cudaStream_t stream) {
  require(cuda::hc_post_check(p), "hc_post");
  if (p.T <= 0) return;
  const auto aligned = [](const void* x) { return reinterpret_cast<uintptr_t>(x) % 16 == 0; };
  const bool hc4 = p.hc == 4 && aligned(p.f) && aligned(p.R) && aligned(p.out);  // the model's hc
  if (hc4 && p.D % xxh3::kSumRowValues == 0) {
    hc_post4_blocks_kernel<4>
        <<<detail::grid_for(p.T * (p.D / xxh3::kSumRowValues), kThreads / 32), kThreads, 0, stream>>>(p);
    DSV4_LAUNCH_CHECK();
    return;
  }
  if (p.out_sums) {  // another kernel writes out; its sums are formed from it afterwards
    HcPostParams q = p;
    q.out_sums = nullptr;
    hc_post(q, stream);
    row_sums_bf16(p.out, p.T, p.hc * p.D, p.hc * p.D, p.out_sums, stream);
    return;
  }
  if (hc4 && p.D % 4 == 0) {
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
  return row_sums_check(p.y_sums, p.D, "hc_head: y_sums asked for rows of D values, D not a multiple of 512");
}

void hc_head(const HcHeadParams& p, cudaStream_t stream) {
  require(cuda::hc_head_check(p), "hc_head");
  if (p.T <= 0) return;
  MixArgs a;
  a.T = p.T, a.hc = p.hc, a.D = p.D, a.X = p.X, a.fn = p.fn, a.rows = p.hc;
  a.scale = p.scale, a.base = p.base, a.rms_eps = p.rms_eps, a.hc_eps = p.hc_eps;
  a.order = p.order, a.head = true;
  a.y = p.y, a.y_sums = p.y_sums;
  detail::Scratch<float> w(p.w ? 0 : p.T * p.hc, stream);
  launch_mix(a, p.w ? p.w : w.get(), stream);
}

}  // namespace dsv4::cuda
