// The `tensor_core` reduction order of a GEMM (kernels/reduce.h ReduceOrder::tensor_core; the fast
// numerics of docs/NUMERICS.md "Fast numerics"): y = round(bf16(x) . bf16(w)^T) with bf16 tensor-core
// products and fp32 accumulation, in an order fixed by this kernel alone.
//
// The order: k is cut into tiles of 32 from k = 0 (the last one zero-padded); each tile is two
// mma.sync.m16n8k16 steps (k 0..15, then 16..31) accumulated into the same fp32 accumulators, tiles in
// increasing k. What one mma does inside (the products' alignment and summation) is the hardware's,
// fixed per architecture (sm_80 and newer). A row's result therefore depends only on its row of x, the
// weights and the GPU architecture: not on m, the other rows of the batch, the grid, the number of
// SMs or the run (no split-K, no atomics). It is not the CPU's order, and the CPU cannot reproduce it:
// a site with this order runs on CUDA only (model/profile.h uses_tensor_cores).
//
// Inputs are rounded to bf16 (round to nearest even): the model's activations and weights are bf16
// values already, so for them this changes nothing.
//
// Two kernels per group of problems:
//   1. rows_to_bf16_kernel: every problem's x rows (through its row gather) and w rows become bf16
//      copies with k padded to kp = 32 ceil(k / 32) (zeros), one launch for the whole group (one job
//      per operand and problem). The padded, aligned copies let the GEMM read whole 16-byte chunks.
//      A weight matrix registered with keep_bf16_weights (kernels/cuda/ops.h) is copied once, by the
//      first call that reads it, and that copy is read from then on; an x handed over as its copy
//      (GemmParams::x16, made by gemm_x_to_bf16 and shared by the GEMMs that read that x) is not copied.
//   2. On Hopper with sm_90a code in the build, gemm_tma_tensor_core_kernel (wgmma fed by the tensor
//      memory accelerator, below); elsewhere gemm_tensor_core_kernel: block tile 128 x 128 outputs, 256
//      threads (8 warps, 2 x 4, each 64 x 32 outputs, i.e. 4 x 4 mma tiles of 16 x 8); k arrives 64 at
//      a time (two of the order's tiles; the second skipped past kp) in shared memory by cp.async in a
//      pipeline of kStages buffers (rows padded to 72 elements, so the eight 16-byte rows an ldmatrix
//      phase reads fall in distinct banks), kStages - 1 stages in flight while one is consumed.
// How the work is cut never changes a bit of the result. Functions named *tensor_core* are the only
// ones scripts/kernel-audit.py lets use tensor cores.

#include <algorithm>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include <cuda.h>
#include <cudaTypedefs.h>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/mma.cuh"
#include "kernels/cuda/wgmma.cuh"
#include "kernels/detail/linear.h"

namespace dsv4::cuda::detail {
namespace {

constexpr int kBM = 128, kBN = 128, kThreads = 256, kStages = 3;
constexpr int kKStep = 32;  // the order's k tiles (kp, the padded k, is a multiple of it)
constexpr int kBK = 64;     // k staged per pipeline stage: two of the order's tiles
constexpr int kLds = kBK + 8;  // bf16 elements per staged row
constexpr int kChunksPerRow = kBK / 8;                                   // 16-byte chunks of a staged row
// [[maybe_unused]]: below sm_80 the kernels compile to nothing and leave this and store_pair unused.
[[maybe_unused]] constexpr int kChunksPerThread = kBM * kChunksPerRow / kThreads;  // 4 per operand and stage
constexpr size_t kStageBytes = sizeof(__nv_bfloat16) * (kBM + kBN) * kLds;  // one x and one w tile
static_assert(kBM == kBN, "x and w tiles are staged alike");

// One operand of one problem for rows_to_bf16_kernel: rows r < rows of src (row map[r] when map is
// set, stride ld) become dst rows [r * kp, +kp) in bf16.
struct Bf16Job {
  const float* src = nullptr;
  int64_t ld = 0;
  const int32_t* map = nullptr;
  int64_t rows = 0;
  __nv_bfloat16* dst = nullptr;
};

// A problem of the GEMM kernel: a [m, kp] and b [n, kp] bf16, y rows scattered through yrow.
struct Bf16Problem {
  const __nv_bfloat16* a = nullptr;
  const __nv_bfloat16* b = nullptr;
  float* y = nullptr;
  int64_t ldy = 0;
  const int32_t* yrow = nullptr;
  int64_t m = 0;
};

// A launch's jobs or problems: the first N travel in the kernel's parameters; more go to device memory
// (a copy from pageable host memory, which can make the host wait for the stream before it returns:
// small groups, the common case, launch without one).
template <typename T, int N>
struct Batch {
  T item[N];
  const T* many = nullptr;  // all of them, in device memory, when there are more than N
  __device__ const T& operator[](int i) const { return many ? many[i] : item[i]; }
};
constexpr int kInlineJobs = 16, kInlineProblems = 32;
using Bf16Jobs = Batch<Bf16Job, kInlineJobs>;

// Fills a Batch with `items`, putting them in device memory (`scratch`, which must outlive the launch)
// when they do not fit.
template <typename T, int N>
Batch<T, N> batch_of(const std::vector<T>& items, std::unique_ptr<Scratch<T>>& scratch, cudaStream_t stream) {
  Batch<T, N> b{};
  if (items.size() <= size_t(N)) {
    for (size_t i = 0; i < items.size(); ++i) b.item[i] = items[i];
    return b;
  }
  scratch = std::make_unique<Scratch<T>>(int64_t(items.size()), stream);
  CUDA_CHECK(cudaMemcpyAsync(scratch->get(), items.data(), sizeof(T) * items.size(), cudaMemcpyHostToDevice, stream));
  b.many = scratch->get();
  return b;
}

// Job blockIdx.y: its rows in bf16, k values padded with zeros to kp. One warp a row: float4 loads and
// 8-byte stores where the source row is 16-byte aligned and kp a multiple of 4 (four loads in flight
// a lane where they lie inside k), else pairs.
constexpr int kRowThreads = 256;
__global__ void __launch_bounds__(kRowThreads)
    rows_to_bf16_kernel(const __grid_constant__ Bf16Jobs jobs, int64_t k, int64_t kp) {
  const Bf16Job& J = jobs[int(blockIdx.y)];
  const int lane = threadIdx.x % 32;
  const int64_t warps = int64_t(gridDim.x) * (kRowThreads / 32);
  for (int64_t r = int64_t(blockIdx.x) * (kRowThreads / 32) + threadIdx.x / 32; r < J.rows; r += warps) {
    const float* row = J.src + (J.map ? int64_t(J.map[r]) : r) * J.ld;
    __nv_bfloat16* out = J.dst + r * kp;
    if (kp % 4 == 0 && reinterpret_cast<uintptr_t>(row) % 16 == 0) {
      int64_t d = 4 * lane;
      // Whole chunks of 512 values inside k: four loads in flight before their stores.
      for (; d + 384 + 4 <= k; d += 512) {
        float4 v[4];
#pragma unroll
        for (int u = 0; u < 4; ++u) v[u] = *reinterpret_cast<const float4*>(row + d + 128 * u);
#pragma unroll
        for (int u = 0; u < 4; ++u)
          *reinterpret_cast<uint2*>(out + d + 128 * u) =
              make_uint2(pack_bf16(v[u].x, v[u].y), pack_bf16(v[u].z, v[u].w));
      }
      for (; d < kp; d += 128) {
        const float4 v = d + 4 <= k ? *reinterpret_cast<const float4*>(row + d)
                                    : make_float4(d < k ? row[d] : 0.f, d + 1 < k ? row[d + 1] : 0.f,
                                                  d + 2 < k ? row[d + 2] : 0.f, d + 3 < k ? row[d + 3] : 0.f);
        *reinterpret_cast<uint2*>(out + d) = make_uint2(pack_bf16(v.x, v.y), pack_bf16(v.z, v.w));
      }
    } else {
      for (int64_t d = 2 * lane; d < kp; d += 64)
        *reinterpret_cast<uint32_t*>(out + d) = pack_bf16(d < k ? row[d] : 0.f, d + 1 < k ? row[d + 1] : 0.f);
    }
  }
}

// Blocks of rows_to_bf16_kernel for jobs of at most `rows` rows.
unsigned row_blocks(int64_t rows) {
  return grid_for(rows, kRowThreads / 32, 8192);
}

// Outputs (col, col + 1) of output row y, v0 and v1 before rounding: one 8-byte store where both are
// inside n and the pair is 8-byte aligned (four lanes then fill a 32-byte sector), else one at a time.
[[maybe_unused]] __device__ __forceinline__ void store_pair(float* y, int64_t col, const GemmShape& s,
                                                            float v0, float v1) {
  const float a = common::gemm_out(v0, s.round), b = common::gemm_out(v1, s.round);
  if (col + 1 < s.n && reinterpret_cast<uintptr_t>(y + col) % 8 == 0) {
    *reinterpret_cast<float2*>(y + col) = make_float2(a, b);
    return;
  }
  if (col < s.n) y[col] = a;
  if (col + 1 < s.n) y[col + 1] = b;
}

__global__ void __launch_bounds__(kThreads, 2)
    gemm_tensor_core_kernel(GemmShape s, int64_t kp, Bf16Problem one, const Bf16Problem* many) {
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 800  // the host pass sees the body too
  const Bf16Problem& P = many ? many[blockIdx.z] : one;
  const int64_t m0 = int64_t(blockIdx.y) * kBM, n0 = int64_t(blockIdx.x) * kBN;
  if (m0 >= P.m) return;
  extern __shared__ __align__(16) unsigned char tc_smem[];
  auto xs = [&](int st) { return reinterpret_cast<__nv_bfloat16*>(tc_smem + st * kStageBytes); };
  auto ws = [&](int st) { return reinterpret_cast<__nv_bfloat16*>(tc_smem + st * kStageBytes) + kBM * kLds; };

  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  // k stage t into buffer st: thread tid copies chunks tid + 256 i of each operand (row c / 8, 8 k
  // values from 8 (c % 8)); rows past m or n and k past kp are zeros.
  auto load = [&](int64_t t, int st) {
#pragma unroll
    for (int i = 0; i < kChunksPerThread; ++i) {
      const int c = tid + i * kThreads, row = c / kChunksPerRow, kc = (c % kChunksPerRow) * 8;
      const int64_t r = m0 + row, col = n0 + row, k0 = t * kBK + kc;
      const bool xk = r < P.m && k0 < kp, wk = col < s.n && k0 < kp;
      cp_async16(xs(st) + row * kLds + kc, P.a + (xk ? r * kp + k0 : 0), xk ? 16 : 0);
      cp_async16(ws(st) + row * kLds + kc, P.b + (wk ? col * kp + k0 : 0), wk ? 16 : 0);
    }
  };

  // Warp (wm, wn) owns outputs [64 wm, +64) x [32 wn, +32) of the tile: mma tiles (mi, ni), 16 x 8 each.
  const int wm = warp / 4, wn = warp % 4;
  float acc[4][4][4];
#pragma unroll
  for (int mi = 0; mi < 4; ++mi)
#pragma unroll
    for (int ni = 0; ni < 4; ++ni)
#pragma unroll
      for (int c = 0; c < 4; ++c) acc[mi][ni][c] = 0.f;

  const int64_t tiles = (kp + kBK - 1) / kBK;
#pragma unroll
  for (int st = 0; st < kStages - 1; ++st) {  // the pipeline's first tiles (empty groups past the end)
    if (st < tiles) load(st, st);
    cp_async_commit();
  }
  for (int64_t t = 0; t < tiles; ++t) {
    cp_async_wait<kStages - 2>();  // tile t has landed (this thread's copies) ...
    __syncthreads();               // ... for every thread; and every warp is done with tile t - 1
    if (t + kStages - 1 < tiles) load(t + kStages - 1, int((t + kStages - 1) % kStages));
    cp_async_commit();
    const int st = int(t % kStages);
    const __nv_bfloat16* xt = xs(st);
    const __nv_bfloat16* wt = ws(st);
    const int kend = kp - t * kBK < kBK ? int(kp - t * kBK) : kBK;  // a whole number of the order's tiles
#pragma unroll
    for (int kk = 0; kk < kBK; kk += 16) {
      if (kk >= kend) break;
      uint32_t a[4][4], b[4][2];
#pragma unroll
      for (int mi = 0; mi < 4; ++mi)  // rows lane % 16, k half lane / 16
        ldmatrix_x4(a[mi], &xt[(wm * 64 + mi * 16 + lane % 16) * kLds + kk + (lane / 16) * 8]);
#pragma unroll
      for (int nj = 0; nj < 2; ++nj) {  // n rows lane % 8 (+8 for lanes 16..31), k half (lane / 8) % 2
        uint32_t r[4];
        ldmatrix_x4(r, &wt[(wn * 32 + nj * 16 + lane % 8 + (lane / 16) * 8) * kLds + kk + ((lane / 8) % 2) * 8]);
        b[2 * nj][0] = r[0], b[2 * nj][1] = r[1], b[2 * nj + 1][0] = r[2], b[2 * nj + 1][1] = r[3];
      }
#pragma unroll
      for (int mi = 0; mi < 4; ++mi)
#pragma unroll
        for (int ni = 0; ni < 4; ++ni) mma_bf16_tensor_core(acc[mi][ni], a[mi], b[ni][0], b[ni][1]);
    }
  }
  cp_async_wait<0>();  // no copy outlives the block

  // Accumulator c of tile (mi, ni): row group + 8 (c / 2), column 2 (lane % 4) + c % 2.
  const int group = lane / 4, pair = (lane % 4) * 2;
#pragma unroll
  for (int mi = 0; mi < 4; ++mi)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int64_t r = m0 + wm * 64 + mi * 16 + group + 8 * h;
      if (r >= P.m) continue;
      float* y = P.y + (P.yrow ? int64_t(P.yrow[r]) : r) * P.ldy;
#pragma unroll
      for (int ni = 0; ni < 4; ++ni)
        store_pair(y, n0 + wn * 32 + ni * 8 + pair, s, acc[mi][ni][2 * h], acc[mi][ni][2 * h + 1]);
    }
#else
  __trap();  // the host refuses devices below compute capability 8.0 before launching
#endif
}

// STEPS k16 steps of a warpgroup, in increasing k, from the stage's A rows at a and B rows at b.
template <int BN, int STEPS>
__device__ __forceinline__ void wgmma_steps(float (&acc)[BN / 2], uint32_t a, uint32_t b) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#pragma unroll
  for (int kk = 0; kk < STEPS; ++kk) {
    if constexpr (BN == 256)
      wgmma_m64n256k16_tensor_core(acc, wgmma_desc_sw128(a + 32 * kk), wgmma_desc_sw128(b + 32 * kk));
    else
      wgmma_m64n128k16_tensor_core(acc, wgmma_desc_sw128(a + 32 * kk), wgmma_desc_sw128(b + 32 * kk));
  }
#endif
}

// The same GEMM on Hopper (sm_90a): the order above, the same k16 steps in increasing k, each one
// warpgroup wgmma.mma_async.m64nBNk16 from shared memory instead of mma.sync.m16n8k16 per 16 x 8 tile
// (the same bytes: tests/gpu/test_gpu_fast.cpp FastGemm.WgmmaKernelEqualsMmaSyncKernel). Tiles of
// 128 x BN outputs; one persistent block per SM walks the launch's tiles (problem by problem, each in
// the order of band_tile) with a stride of the grid, the stages' use counted across its tiles, so the
// producer fills the next tile's stages while the consumers store the last one. 384 threads,
// warp-specialised: warpgroup 0 produces (one thread issues the tensor memory accelerator's copies of a
// stage, whose barrier `full` completes with their bytes), warpgroups 1 and 2 consume, 64 rows each (wgmma
// from the stage, then, once it has retired, an arrival of each of their warps on the stage's `empty`
// barrier, which frees it for the producer). Stages hold 128 x 64 x values and BN x 64 w values,
// 128B-swizzled by the copy as wgmma reads them (kernels/cuda/wgmma.cuh); rows past m or n and k past kp
// arrive as zeros.
struct TmaProblem {
  CUtensorMap a, b;  // the bf16 copies: a [m, kp], b [n, kp]; boxes 64 x kBM and 64 x BN
  float* y = nullptr;
  int64_t ldy = 0;
  const int32_t* yrow = nullptr;
  int64_t m = 0;
  int tile0 = 0;  // the launch's index of the problem's first output tile (problems in order)
};
constexpr int kTmaThreads = 384;

// The order in which a launch's blocks take a problem's output tiles: bands of kBand tile rows (128 x
// rows each), n fastest across a band, the band's rows fastest within one n. The tiles in flight at once
// (one a multiprocessor) then share kBand x tiles and about SMs / kBand w tiles, and the next ones reuse
// them from L2: with rows-major order and a w larger than L2 (wq_b: 32768 x 1024), every tile row read
// all of w from memory again. Which block computes a tile never changes its bits.
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)  // as the kernel's body, its only user
constexpr int kBand = 8;
__device__ __forceinline__ void band_tile(int local, int mtiles, int ntiles, int& mt, int& nt) {
  const int band = local / (kBand * ntiles), in_band = local - band * kBand * ntiles;
  const int rows = min(kBand, mtiles - band * kBand);  // the last band may be partial
  mt = band * kBand + in_band % rows, nt = in_band / rows;
}
#endif
using TmaProblems = Batch<TmaProblem, kInlineProblems>;  // tensor maps as parameters: __grid_constant__

template <int BN>
struct Tma {
  static constexpr int kStageA = kBM * 128, kStageB = BN * 128, kStage = kStageA + kStageB;  // bytes
  static constexpr int kStages = (200 * 1024) / kStage;
  static constexpr size_t kSmem = size_t(kStages) * kStage + 2 * 8 * kStages + 1024;  // + barriers, alignment
};

template <int BN>
__global__ void __launch_bounds__(kTmaThreads, 1)
    gemm_tma_tensor_core_kernel(GemmShape s, int64_t kp, int count, int tiles_total,
                                const __grid_constant__ TmaProblems problems) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using L = Tma<BN>;
  extern __shared__ __align__(16) unsigned char wg_smem[];
  const uint32_t raw = smem_addr(wg_smem), base = (raw + 1023u) & ~1023u;  // swizzle atoms 1024-aligned
  const uint32_t full = base + uint32_t(L::kStages * L::kStage), empty = full + 8 * L::kStages;
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, wg = warp / 4;
  if (tid == 0) {
    for (int st = 0; st < L::kStages; ++st) {
      mbar_init(full + 8 * st, 1);
      mbar_init(empty + 8 * st, 8);  // the consumers' eight warps
    }
    mbar_init_fence();
  }
  __syncthreads();
  const int ktiles = int((kp + kBK - 1) / kBK);
  const int ntiles = int((s.n + BN - 1) / BN);
  // Tile `tile` of the launch: its problem (the last whose tile0 <= tile) and its m0, n0.
  auto locate = [&](int tile, int& z, int64_t& m0, int64_t& n0) {
    int lo = 0, hi = count - 1;
    while (lo < hi) {
      const int mid = (lo + hi + 1) / 2;
      if (problems[mid].tile0 <= tile)
        lo = mid;
      else
        hi = mid - 1;
    }
    z = lo;
    const int mtiles = int((problems[z].m + kBM - 1) / kBM);
    int mt, nt;
    band_tile(tile - problems[z].tile0, mtiles, ntiles, mt, nt);
    m0 = int64_t(mt) * kBM, n0 = int64_t(nt) * BN;
  };

  if (wg == 0) {  // the producer
    setmaxnreg_dec<40>();
    if (tid == 0) {
      int it = 0;  // stage uses so far, over all of the block's tiles
      for (int tile = blockIdx.x; tile < tiles_total; tile += gridDim.x) {
        int z;
        int64_t m0, n0;
        locate(tile, z, m0, n0);
        const TmaProblem& P = problems[z];
        for (int t = 0; t < ktiles; ++t, ++it) {
          const int st = it % L::kStages, round = it / L::kStages;
          if (round > 0) mbar_wait(empty + 8 * st, uint32_t(round - 1) & 1u);  // its last use has retired
          const uint32_t a = base + uint32_t(st * L::kStage);
          mbar_arrive_expect_tx(full + 8 * st, L::kStage);
          tma_load_2d(a, &P.a, full + 8 * st, t * kBK, int(m0));
          tma_load_2d(a + L::kStageA, &P.b, full + 8 * st, t * kBK, int(n0));
        }
      }
    }
    return;
  }

  setmaxnreg_inc<232>();
  const int cw = wg - 1;  // the consumer's 64 rows of the tile
  int it = 0;
  for (int tile = blockIdx.x; tile < tiles_total; tile += gridDim.x) {
    int z;
    int64_t m0, n0;
    locate(tile, z, m0, n0);
    const TmaProblem& P = problems[z];
    float acc[BN / 2];
#pragma unroll
    for (int i = 0; i < BN / 2; ++i) acc[i] = 0.f;
    for (int t = 0; t < ktiles; ++t, ++it) {
      const int st = it % L::kStages;
      mbar_wait(full + 8 * st, uint32_t(it / L::kStages) & 1u);
      const uint32_t a = base + uint32_t(st * L::kStage) + uint32_t(cw * 64 * 128), b = base + uint32_t(st * L::kStage + L::kStageA);
      wgmma_pin(acc);
      wgmma_fence_tensor_core();
      // All four k16 steps, also in a last stage whose second half is past kp (zeros): those add +-0
      // products to accumulators that are never -0 (they start at +0), which changes no bit, and keep the
      // wgmma sequence free of branches.
      wgmma_steps<BN, kBK / 16>(acc, a, b);
      wgmma_commit_tensor_core();
      wgmma_wait_tensor_core<1>();  // step t - 1 has retired: its stage is free
      wgmma_pin(acc);
      if (t > 0 && lane == 0) mbar_arrive(empty + 8 * ((it - 1) % L::kStages));
    }
    wgmma_wait_tensor_core<0>();
    wgmma_pin(acc);
    if (lane == 0) mbar_arrive(empty + 8 * ((it - 1) % L::kStages));  // the tile's last stage is free too

    const int64_t row0 = m0 + cw * 64 + (warp % 4) * 16 + lane / 4;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int64_t r = row0 + 8 * h;
      if (r >= P.m) continue;
      float* y = P.y + (P.yrow ? int64_t(P.yrow[r]) : r) * P.ldy;
#pragma unroll
      for (int j = 0; j < BN / 8; ++j) store_pair(y, n0 + 8 * j + 2 * (lane % 4), s, acc[4 * j + 2 * h], acc[4 * j + 2 * h + 1]);
    }
  }
#else
  __trap();  // the host launches it only where gemm_wgmma_available_kernel said sm_90a code is present
#endif
}

// Writes 1 when this binary holds sm_90a code for the current device (the wgmma kernel can run), else 0.
__global__ void gemm_wgmma_available_kernel(int* out) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  *out = 1;
#else
  *out = 0;
#endif
}

}  // namespace

int device_attribute(cudaDeviceAttr a) {
  int dev = 0, v = 0;
  CUDA_CHECK(cudaGetDevice(&dev));
  CUDA_CHECK(cudaDeviceGetAttribute(&v, a, dev));
  return v;
}

void require_tensor_core_device() {
  const int major = device_attribute(cudaDevAttrComputeCapabilityMajor);
  if (major < 8)
    throw Error(
        "the tensor_core reduction order (fast numerics) needs a GPU of compute capability 8.0 or newer "
        "(bf16 mma.sync); this device is " + std::to_string(major) + ".x");
}

void rows_to_bf16(const float* x, int64_t rows, int64_t cols, int width, __nv_bfloat16* out, cudaStream_t stream) {
  gathered_rows_to_bf16(x, cols, nullptr, rows, cols, width, out, stream);
}

void gathered_rows_to_bf16(const float* x, int64_t ld, const int32_t* map, int64_t rows, int64_t cols, int width,
                           __nv_bfloat16* out, cudaStream_t stream) {
  if (rows <= 0) return;
  Bf16Jobs jobs{};
  jobs.item[0] = Bf16Job{x, ld, map, rows, out};
  rows_to_bf16_kernel<<<row_blocks(rows), kRowThreads, 0, stream>>>(jobs, cols, width);
  DSV4_LAUNCH_CHECK();
}

int64_t gemm_bf16_width(int64_t k) {
  return ceil_div(k > 0 ? k : 1, kKStep) * kKStep;
}

namespace {

// The kernels of the order (the same bits: tests/gpu/test_gpu_fast.cpp FastGemm.WgmmaKernelEqualsMmaSyncKernel).
enum class TcKernel { mma_sync, wgmma };

// cuTensorMapEncodeTiled, from the driver the runtime uses (no link against libcuda).
PFN_cuTensorMapEncodeTiled_v12000 tensor_map_encoder() {
  static PFN_cuTensorMapEncodeTiled_v12000 fn = [] {
    void* p = nullptr;
    cudaDriverEntryPointQueryResult q{};
    CUDA_CHECK(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &p, 12000, cudaEnableDefault, &q));
    if (q != cudaDriverEntryPointSuccess || !p) throw Error("cuda gemm: the driver has no cuTensorMapEncodeTiled");
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(p);
  }();
  return fn;
}

// The tensor map of rows [rows, kp] bf16 at `data`, read in boxes of 64 k values x box_rows rows.
CUtensorMap bf16_rows_map(const __nv_bfloat16* data, int64_t rows, int64_t kp, int box_rows) {
  CUtensorMap map{};
  const cuuint64_t dims[2] = {cuuint64_t(kp), cuuint64_t(rows)};
  const cuuint64_t strides[1] = {cuuint64_t(kp) * sizeof(__nv_bfloat16)};
  const cuuint32_t box[2] = {cuuint32_t(kBK), cuuint32_t(box_rows)}, step[2] = {1, 1};
  const CUresult r = tensor_map_encoder()(&map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, const_cast<__nv_bfloat16*>(data),
                                           dims, strides, box, step, CU_TENSOR_MAP_INTERLEAVE_NONE,
                                           CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                                           CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS)
    throw Error("cuda gemm: cuTensorMapEncodeTiled failed (error " + std::to_string(int(r)) + ") for " +
                std::to_string(rows) + " x " + std::to_string(kp) + " bf16 rows");
  return map;
}

template <int BN>
void launch_tma(const GemmShape& s, int64_t kp, const std::vector<Bf16Problem>& bp, int64_t mmax,
                cudaStream_t stream) {
  using L = Tma<BN>;
  if (kp > INT32_MAX || mmax > INT32_MAX || s.n > INT32_MAX)  // the copies' coordinates are 32-bit
    throw Error("cuda gemm cannot run: a dimension is too large for the TMA coordinates");
  // The problems with rows, each followed by its tiles' count in the launch's tile index.
  const int64_t ntiles = ceil_div(s.n, BN);
  std::vector<TmaProblem> tp;
  int64_t tiles = 0;
  for (const Bf16Problem& b : bp) {
    if (b.m <= 0) continue;
    TmaProblem t;
    t.y = b.y, t.ldy = b.ldy, t.yrow = b.yrow, t.m = b.m;
    t.a = bf16_rows_map(b.a, b.m, kp, kBM);
    t.b = bf16_rows_map(b.b, s.n, kp, BN);
    t.tile0 = int(tiles);
    tiles += ceil_div(b.m, kBM) * ntiles;
    if (tiles > INT32_MAX) throw Error("cuda gemm cannot run: too many output tiles in one launch");
    tp.push_back(t);
  }
  if (tp.empty()) return;
  std::unique_ptr<Scratch<TmaProblem>> scratch;
  const TmaProblems problems = batch_of<TmaProblem, kInlineProblems>(tp, scratch, stream);
  CUDA_CHECK(cudaFuncSetAttribute(gemm_tma_tensor_core_kernel<BN>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                  int(L::kSmem)));
  // One block per SM (the kernel holds an SM's shared memory), never more blocks than tiles.
  const int64_t blocks = std::min<int64_t>(tiles, device_attribute(cudaDevAttrMultiProcessorCount));
  gemm_tma_tensor_core_kernel<BN><<<unsigned(blocks), kTmaThreads, L::kSmem, stream>>>(s, kp, int(tp.size()),
                                                                                      int(tiles), problems);
  DSV4_LAUNCH_CHECK();
}

// Problems [0, count) of a group, their bf16 copies in one scratch buffer of `total` elements; kept[i],
// when set, is problem i's w already in bf16 (keep_bf16_weights), which is then not copied.
void run_tensor_core_chunk(const GemmShape& s, int64_t kp, const GemmProblem* problems,
                           const __nv_bfloat16* const* kept, int count, int64_t total, TcKernel kernel,
                           cudaStream_t stream) {
  int64_t mmax = 0;
  for (int i = 0; i < count; ++i) mmax = problems[i].m > mmax ? problems[i].m : mmax;
  if (mmax <= 0) return;
  Scratch<__nv_bfloat16> copies(total, stream);
  std::vector<Bf16Job> jobs;
  std::vector<Bf16Problem> bp(static_cast<size_t>(count));
  int64_t at = 0, rows_max = 0;
  for (int i = 0; i < count; ++i) {
    const GemmProblem& g = problems[i];
    Bf16Problem& b = bp[size_t(i)];
    b.y = g.y, b.ldy = g.ldy, b.yrow = g.yrow, b.m = g.m;
    if (g.m <= 0) continue;
    if (g.x16) {
      b.a = g.x16;
    } else {
      b.a = copies.get() + at;
      jobs.push_back(Bf16Job{g.x, g.ldx, g.xrow, g.m, copies.get() + at});
      at += g.m * kp;
      rows_max = g.m > rows_max ? g.m : rows_max;
    }
    if (kept[i]) {
      b.b = kept[i];
      continue;
    }
    b.b = copies.get() + at;
    jobs.push_back(Bf16Job{g.w, g.ldw, nullptr, s.n, copies.get() + at});
    at += s.n * kp;
    rows_max = s.n > rows_max ? s.n : rows_max;
  }
  if (jobs.size() > 65535) throw Error("cuda gemm cannot run: too many problems in one group");
  std::unique_ptr<Scratch<Bf16Job>> job_scratch;
  if (!jobs.empty()) {  // none when every x is given in bf16 and every w kept
    rows_to_bf16_kernel<<<dim3(row_blocks(rows_max), unsigned(jobs.size())), kRowThreads, 0, stream>>>(
        batch_of<Bf16Job, kInlineJobs>(jobs, job_scratch, stream), s.k, kp);
    DSV4_LAUNCH_CHECK();
  }

  if (kernel == TcKernel::wgmma) {
    // n <= 128 (the router, small projections) wastes less of a 128-wide tile.
    if (s.n <= 128)
      launch_tma<128>(s, kp, bp, mmax, stream);
    else
      launch_tma<256>(s, kp, bp, mmax, stream);
    return;
  }
  const size_t shmem = kStages * kStageBytes;
  CUDA_CHECK(cudaFuncSetAttribute(gemm_tensor_core_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(shmem)));
  const dim3 grid(unsigned(ceil_div(s.n, kBN)), unsigned(ceil_div(mmax, kBM)), unsigned(count));
  if (count == 1) {
    gemm_tensor_core_kernel<<<grid, kThreads, shmem, stream>>>(s, kp, bp[0], nullptr);
    DSV4_LAUNCH_CHECK();
    return;
  }
  Scratch<Bf16Problem> dev_problems(count, stream);
  CUDA_CHECK(cudaMemcpyAsync(dev_problems.get(), bp.data(), sizeof(Bf16Problem) * size_t(count),
                             cudaMemcpyHostToDevice, stream));
  gemm_tensor_core_kernel<<<grid, kThreads, shmem, stream>>>(s, kp, Bf16Problem{}, dev_problems.get());
  DSV4_LAUNCH_CHECK();
}

// Elements of bf16 copies one launch of the group may hold (1 GiB): larger groups run in chunks of
// problems, which changes no value.
constexpr int64_t kCopyBudget = int64_t(1) << 29;

// ---- weights kept in bf16 (keep_bf16_weights) ----------------------------------------------------

// A registered fp32 matrix and, once a call has read it, its bf16 copy: rows of kp(cols) values, the
// layout of the per-call copies.
struct KeptMatrix {
  int64_t rows = 0, cols = 0;
  __nv_bfloat16* copy = nullptr;
  bool no_room = false;  // the copy could not be allocated: calls convert w as before
};

struct KeptRegistry {
  std::mutex mu;
  std::map<uintptr_t, KeptMatrix> by_start;  // by the matrix's first address
};

// Never destroyed: the copies are freed by forget_bf16_weights (or with the process).
KeptRegistry& kept_registry() {
  static KeptRegistry* r = new KeptRegistry;
  return *r;
}

// The bf16 copy of rows [0, n) of w when w lies at a row start of a registered matrix that the call
// reads whole rows of (ldw = k = cols); made on first use. Else nullptr: the call converts w itself.
const __nv_bfloat16* kept_bf16(const float* w, int64_t n, int64_t k, int64_t ldw, cudaStream_t stream) {
  KeptRegistry& r = kept_registry();
  const std::lock_guard<std::mutex> lock(r.mu);
  if (r.by_start.empty()) return nullptr;
  auto it = r.by_start.upper_bound(reinterpret_cast<uintptr_t>(w));
  if (it == r.by_start.begin()) return nullptr;
  --it;
  KeptMatrix& K = it->second;
  const uintptr_t offset = reinterpret_cast<uintptr_t>(w) - it->first;
  if (K.cols != k || ldw != k || offset % sizeof(float) != 0) return nullptr;
  const int64_t at = int64_t(offset / sizeof(float));
  if (at % k != 0 || at / k + n > K.rows) return nullptr;
  const int64_t kp = gemm_bf16_width(k);
  if (!K.copy) {
    if (K.no_room) return nullptr;
    if (cudaMalloc(reinterpret_cast<void**>(&K.copy), sizeof(__nv_bfloat16) * size_t(K.rows * kp)) != cudaSuccess) {
      (void)cudaGetLastError();  // out of memory is not sticky: clear it and convert per call
      K.copy = nullptr;
      K.no_room = true;
      return nullptr;
    }
    rows_to_bf16(reinterpret_cast<const float*>(it->first), K.rows, k, int(kp), K.copy, stream);
    // Other streams may read the copy next: it is complete before anyone is handed it.
    CUDA_CHECK(cudaStreamSynchronize(stream));
  }
  return K.copy + (at / k) * kp;
}

}  // namespace

bool wgmma_available() {
  static std::mutex mu;
  static std::map<int, bool> known;  // per device
  int dev = 0;
  CUDA_CHECK(cudaGetDevice(&dev));
  const std::lock_guard<std::mutex> lock(mu);
  if (const auto it = known.find(dev); it != known.end()) return it->second;
  int major = 0, minor = 0;
  CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev));
  CUDA_CHECK(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev));
  bool yes = false;
  if (major == 9 && minor == 0) {  // sm_90a code runs on compute capability 9.0 only
    int* flag = nullptr;
    int host = 0;
    CUDA_CHECK(cudaMalloc(&flag, sizeof(int)));
    gemm_wgmma_available_kernel<<<1, 1>>>(flag);
    const cudaError_t launched = cudaGetLastError();  // no image for this device: not available
    CUDA_CHECK(cudaMemcpy(&host, flag, sizeof(int), cudaMemcpyDeviceToHost));
    CUDA_CHECK(cudaFree(flag));
    yes = launched == cudaSuccess && host == 1;
  }
  known.emplace(dev, yes);
  return yes;
}

void gemm_tensor_core_group(const GemmShape& s, const GemmProblem* problems, int count, int64_t mmax,
                            bool wgmma_allowed, cudaStream_t stream) {
  require_tensor_core_device();
  const TcKernel kernel = wgmma_allowed && wgmma_available() ? TcKernel::wgmma : TcKernel::mma_sync;
  if (ceil_div(mmax, kBM) > 65535) throw Error("cuda gemm cannot run: m is too large for one launch");
  const int64_t kp = gemm_bf16_width(s.k);
  // w already in bf16 where it is kept (keep_bf16_weights).
  std::vector<const __nv_bfloat16*> kept(size_t(count), nullptr);
  for (int i = 0; i < count; ++i)
    if (problems[i].m > 0) kept[size_t(i)] = kept_bf16(problems[i].w, s.n, s.k, problems[i].ldw, stream);
  // The bf16 copies: each problem's x rows, then its w rows unless kept; a chunk holds at least one
  // problem.
  int i0 = 0;
  int64_t total = 0;
  for (int i = 0; i < count; ++i) {
    const GemmProblem& g = problems[i];
    const int64_t need = (g.m > 0 ? (g.x16 ? 0 : g.m) + (kept[size_t(i)] ? 0 : s.n) : 0) * kp;
    if (i > i0 && total + need > kCopyBudget) {
      run_tensor_core_chunk(s, kp, problems + i0, kept.data() + i0, i - i0, total, kernel, stream);
      i0 = i, total = 0;
    }
    total += need;
  }
  run_tensor_core_chunk(s, kp, problems + i0, kept.data() + i0, count - i0, total, kernel, stream);
}

}  // namespace dsv4::cuda::detail

namespace dsv4::cuda {

void keep_bf16_weights(const float* w, int64_t rows, int64_t cols) {
  if (!w || rows <= 0 || cols <= 0) return;
  // rows_to_bf16's width is an int: a wider matrix is converted per call.
  if (detail::gemm_bf16_width(cols) > INT32_MAX) return;
  detail::KeptRegistry& r = detail::kept_registry();
  const std::lock_guard<std::mutex> lock(r.mu);
  detail::KeptMatrix& K = r.by_start[reinterpret_cast<uintptr_t>(w)];
  if (K.copy) {  // registered again: the data may be new, so the copy is made again on first use
    cudaFree(K.copy);
    K.copy = nullptr;
  }
  K.rows = rows, K.cols = cols, K.no_room = false;
}

void forget_bf16_weights(const void* begin, const void* end) {
  detail::KeptRegistry& r = detail::kept_registry();
  const std::lock_guard<std::mutex> lock(r.mu);
  auto it = r.by_start.lower_bound(reinterpret_cast<uintptr_t>(begin));
  while (it != r.by_start.end() && it->first < reinterpret_cast<uintptr_t>(end)) {
    if (it->second.copy) cudaFree(it->second.copy);  // errors ignored: this may run while the process exits
    it = r.by_start.erase(it);
  }
}

int64_t gemm_bf16_row_width(int64_t k) {
  return detail::gemm_bf16_width(k);
}

void gemm_x_to_bf16(const float* x, int64_t rows, int64_t k, int64_t ldx, uint16_t* out,
                    cudaStream_t stream) {
  if (rows < 0 || k <= 0) throw Error("cuda gemm_x_to_bf16: rows must be >= 0 and k > 0");
  if (ldx < k) throw Error("cuda gemm_x_to_bf16: ldx < k");
  if (rows == 0) return;
  if (!x || !out) throw Error("cuda gemm_x_to_bf16: x or out is null");
  const int64_t width = detail::gemm_bf16_width(k);
  if (width > INT32_MAX) throw Error("cuda gemm_x_to_bf16: k is too large for one row copy");
  detail::gathered_rows_to_bf16(x, ldx, nullptr, rows, k, int(width), reinterpret_cast<__nv_bfloat16*>(out),
                                stream);
}

KeptWeights kept_bf16_weights() {
  detail::KeptRegistry& r = detail::kept_registry();
  const std::lock_guard<std::mutex> lock(r.mu);
  KeptWeights k;
  for (const auto& [start, K] : r.by_start) {
    ++k.registered;
    if (K.copy) {
      ++k.copied;
      k.copy_bytes += int64_t(sizeof(__nv_bfloat16)) * K.rows * detail::gemm_bf16_width(K.cols);
    }
  }
  return k;
}

}  // namespace dsv4::cuda
