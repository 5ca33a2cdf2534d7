// Dense GEMM on the GPU with the canonical per-element reduction order (kernels/linear.h,
// kernels/reduce.h): every output element is exactly dsv4::dot(x_row, w_row, k, order), rounded once.
// Two kernels compute it; which one runs never changes a bit of the result.
//
// Shared definitions. A "chain" is a range of k that dot() reduces with 8 lanes from zero: [0, k)
// for the single-chain order (or when k <= block), else the blocks [cB, min(cB + B, k)). Chains start
// at multiples of 8, so element i always goes to lane i % 8, and a "step" is the aligned group of 8
// elements [8t, 8t + 8). Lane l of a chain is the fma sequence acc = __fmaf_rn(x[i], w[i], acc) over
// the elements i = l (mod 8) of the chain in increasing i, from acc = +0. At the end of a chain the
// lanes are combined as ((l0 + l4) + (l2 + l6)) + ((l1 + l5) + (l3 + l7)) and the result is added to
// the running sum (the first chain initialises it; k == 0 gives +0). IEEE addition is commutative, so
// a + b and b + a are the same bits; nothing else is reordered. Elements past k are never
// accumulated: a lane whose element of the last step lies past k skips its fma (fma(0, 0, acc) would
// turn an acc of -0, which an underflowing product can produce, into +0). Rows past m or n are
// computed on whatever is loaded for them and never stored. A row's result never depends on other
// rows, the kernel, the tile shape or the grid (batch invariance).
//
// gemm_tiled_kernel<TM, TN> (narrow outputs, few tiles; cuda::gemm_tiled): grid (ceil(n / BN),
// ceil(m / BM), problems), 256 threads, BM = 16 TM, BN = 16 TN. Thread (ty, tx) = (tid / 16, tid % 16)
// owns the TM x TN outputs (ty + 16 r, tx + 16 c) and keeps all 8 lane accumulators of each: k is
// consumed one step at a time and element (step start + l) goes to accumulator l.
//
// gemm_lanes_kernel (everything else): grid (ceil(n / 64), ceil(m / 64), problems), 256 threads,
// block tile 64 x 64 outputs, 51 KiB of dynamic shared memory: k is staged 32 at a time, k-major
// (transposed) and double-buffered; the next stage is loaded into registers while the current one is
// consumed. The lanes are split over threads: thread tid has lane l = tid % 8 and group g = tid / 8;
// the 8 threads of a group share a tile of 8 x rows by 16 w rows, and thread l accumulates lane l of
// all 128 outputs of that tile (one register each), i.e. at step t it consumes element 8t + l, read as
// float4 from shared memory. At the end of a chain the 8 threads of the group reduce their 8 x 128 lane
// values with three shuffle rounds (partners l ^ 4, l ^ 2, l ^ 1), each halving the outputs a thread
// keeps: exactly combine_lanes8's additions. Each thread then holds the chain results of a 4 x 4 block
// of the tile, adds them to its running sums (kept in shared memory) and restarts its lanes at +0.

#include <atomic>
#include <mutex>
#include <set>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/lanes.cuh"
#include "kernels/detail/indexer.h"
#include "kernels/detail/linear.h"

namespace dsv4::cuda {

namespace detail {
namespace {

constexpr int kThreads = 256;

// ---- the tiled kernel: 8 lane accumulators per output in one thread ---------------------------------
constexpr int BK = 32;       // k per shared-memory stage (a multiple of 8)
constexpr int LDS = BK + 4;  // padded row stride: the rows tx + 16c of a warp hit distinct banks
static_assert(BK % 8 == 0, "k stages must hold whole groups of 8");

// Tile: thread (ty, tx) = (tid / 16, tid % 16) owns outputs (ty + 16 r, tx + 16 c), r < TM, c < TN;
// the block tile is BM x BN = 16 TM x 16 TN. Thread tid stages column tid % BK of x rows
// tid / BK + 8 i and of w rows tid / BK + 8 j; the next stage is loaded into registers while the
// current one is consumed from shared memory.
template <int TM, int TN>
__global__ void __launch_bounds__(kThreads)
    gemm_tiled_kernel(GemmShape s, int64_t chain_groups, GemmProblem one, const GemmProblem* many) {
  constexpr int BM = 16 * TM, BN = 16 * TN;
  constexpr int XL = BM * BK / kThreads, WL = BN * BK / kThreads;  // staged values per thread
  static_assert((BM * BK) % kThreads == 0 && (BN * BK) % kThreads == 0, "tile loads must divide evenly");
  const GemmProblem P = many ? many[blockIdx.z] : one;
  const int64_t m0 = int64_t(blockIdx.y) * BM, n0 = int64_t(blockIdx.x) * BN;
  if (m0 >= P.m) return;
  __shared__ float Xs[BM][LDS];
  __shared__ float Ws[BN][LDS];
  const int tid = threadIdx.x, tx = tid % 16, ty = tid / 16;
  const int lc = tid % BK, lr = tid / BK;  // staging column and first staging row

  // Row pointers of the staged rows (nullptr past m or n: those rows load as 0), in shared memory to
  // keep registers for the accumulators.
  __shared__ const float* xptr[BM];
  __shared__ const float* wptr[BN];
  for (int i = tid; i < BM; i += kThreads) {
    const int64_t row = m0 + i;
    xptr[i] = row < P.m ? P.x + int64_t(P.xrow ? P.xrow[row] : row) * P.ldx : nullptr;
  }
  for (int j = tid; j < BN; j += kThreads) {
    const int64_t col = n0 + j;
    wptr[j] = col < s.n ? P.w + col * P.ldw : nullptr;
  }
  __syncthreads();
  float xr[XL], wr[WL];
  auto fetch = [&](int64_t k0) {
    const bool in = k0 + lc < s.k;
#pragma unroll
    for (int i = 0; i < XL; ++i) {
      const float* p = xptr[lr + 8 * i];
      xr[i] = (in && p) ? p[k0 + lc] : 0.0f;
    }
#pragma unroll
    for (int j = 0; j < WL; ++j) {
      const float* p = wptr[lr + 8 * j];
      wr[j] = (in && p) ? p[k0 + lc] : 0.0f;
    }
  };

  float acc[TM][TN][8];
  float sum[TM][TN];
#pragma unroll
  for (int r = 0; r < TM; ++r)
#pragma unroll
    for (int c = 0; c < TN; ++c) {
      sum[r][c] = 0.0f;
#pragma unroll
      for (int l = 0; l < 8; ++l) acc[r][c][l] = 0.0f;
    }
  bool started = false;         // a finished chain has been folded into sum
  int64_t left = chain_groups;  // groups of 8 left in the current chain

  // Accumulates the step at stage column kk into lanes l < lanes (8 except in the last step of k).
  auto step = [&](int kk, int lanes) {
    float xv[TM][8];
#pragma unroll
    for (int r = 0; r < TM; ++r)
#pragma unroll
      for (int l = 0; l < 8; ++l) xv[r][l] = Xs[ty + 16 * r][kk + l];
#pragma unroll
    for (int c = 0; c < TN; ++c) {
      float wv[8];
#pragma unroll
      for (int l = 0; l < 8; ++l) wv[l] = Ws[tx + 16 * c][kk + l];
#pragma unroll
      for (int r = 0; r < TM; ++r)
#pragma unroll
        for (int l = 0; l < 8; ++l)
          if (l < lanes) acc[r][c][l] = __fmaf_rn(xv[r][l], wv[l], acc[r][c][l]);
    }
  };

  if (s.k > 0) fetch(0);
  for (int64_t k0 = 0; k0 < s.k; k0 += BK) {
#pragma unroll
    for (int i = 0; i < XL; ++i) Xs[lr + 8 * i][lc] = xr[i];
#pragma unroll
    for (int j = 0; j < WL; ++j) Ws[lr + 8 * j][lc] = wr[j];
    __syncthreads();
    if (k0 + BK < s.k) fetch(k0 + BK);  // in flight while this stage is consumed
    const int kend = s.k - k0 < BK ? int(s.k - k0) : BK;
    for (int kk = 0; kk < kend; kk += 8) {
      // Uniform over the block: every thread walks the same k groups.
      if (kend - kk >= 8)
        step(kk, 8);
      else
        step(kk, kend - kk);
      if (--left == 0 || k0 + kk + 8 >= s.k) {
#pragma unroll
        for (int r = 0; r < TM; ++r)
#pragma unroll
          for (int c = 0; c < TN; ++c) {
            const float v = dsv4::detail::combine_lanes8(acc[r][c]);
            sum[r][c] = started ? sum[r][c] + v : v;
#pragma unroll
            for (int l = 0; l < 8; ++l) acc[r][c][l] = 0.0f;
          }
        started = true;
        left = chain_groups;
      }
    }
    __syncthreads();
  }
  // Post-condition: sum[r][c] == dot(x row, w row, k, order) (or +0 for k == 0).
#pragma unroll
  for (int r = 0; r < TM; ++r) {
    const int64_t row = m0 + ty + 16 * r;
    if (row >= P.m) continue;
    float* y = P.y + int64_t(P.yrow ? P.yrow[row] : row) * P.ldy;
#pragma unroll
    for (int c = 0; c < TN; ++c) {
      const int64_t col = n0 + tx + 16 * c;
      if (col < s.n) y[col] = common::gemm_out(sum[r][c], s.round);
    }
  }
}

// VEC: every x and w row starts 16-byte aligned (pointers and leading dimensions), so whole 4-float
// chunks inside k are loaded as float4.
// The kernel's body; CHAIN: the indexer's head chain instead of the store (IndexerChainOut, common.cuh;
// `co` is unused otherwise).
template <bool VEC, bool CHAIN>
__device__ __forceinline__ void gemm_lanes_body(const GemmShape& s, int64_t chain_steps,
                                                const GemmProblem& one, const GemmProblem* many,
                                                const IndexerChainOut& co) {
  using namespace lanes;
  const GemmProblem P = many ? many[blockIdx.z] : one;
  // The output tile: (blockIdx.y, blockIdx.x); with CHAIN the blocks walk the tiles (n fastest) with a
  // stride of the grid, and the next tile's first stage is fetched during the last stage of this one.
  const int64_t tiles_n = (s.n + BN - 1) / BN, ntiles = CHAIN ? tiles_n * ((P.m + BM - 1) / BM) : 1;
  // CHAIN: a tile none of whose query rows sees a key of it (n0 >= the last row's visible count) is
  // skipped; the walk depends on blockIdx only, so it is the same for every thread of the block.
  auto dead = [&](int64_t t) {
    if constexpr (!CHAIN) return false;
    const int64_t mm = t / tiles_n * BM, last = (mm + BM < P.m ? mm + BM : P.m) - 1;
    return t % tiles_n * BN >= common::visible_groups(co.G, co.pos0 + co.t0 + last / co.Hi, co.ratio);
  };
  int64_t tile = CHAIN ? int64_t(blockIdx.x) : 0;
  while (tile < ntiles && dead(tile)) tile += gridDim.x;
  int64_t m0 = CHAIN ? tile / tiles_n * BM : int64_t(blockIdx.y) * BM;
  int64_t n0 = CHAIN ? tile % tiles_n * BN : int64_t(blockIdx.x) * BN;
  if (m0 >= P.m || tile >= ntiles) return;
  extern __shared__ float4 lanes_smem[];
  auto Xs = reinterpret_cast<float(*)[KS][SX]>(lanes_smem);    // [2][KS][SX]
  auto Ws = reinterpret_cast<float(*)[KS][SW]>(&Xs[2][0][0]);  // [2][KS][SW]
  const int tid = threadIdx.x, l = tid & 7, u = tid & 31, warp = tid >> 5;
  float4* const sums = reinterpret_cast<float4*>(&Ws[2][0][0]) + tid;  // [4][NT] running sums
  const int gm = lanes_gm(tid), gn = lanes_gn(tid);

  // Staging (lanes_stage_row / lanes_stage_chunk). Rows past m or n are read from the last row
  // instead: they feed only outputs that are not stored.
  auto row_of = [&](int i) { return lanes_stage_row(warp, u, i); };
  auto chunk_of = [&](int i) { return lanes_stage_chunk(warp, u, i); };
  const float* xp[XCH];  // row start + 4c
  const float* wp[WCH];
  auto place = [&]() {  // the staging pointers of tile (m0, n0)
#pragma unroll
    for (int i = 0; i < XCH; ++i) {
      int64_t row = m0 + row_of(i);
      row = row < P.m ? row : P.m - 1;
      xp[i] = P.x + int64_t(P.xrow ? P.xrow[row] : row) * P.ldx + 4 * chunk_of(i);
    }
#pragma unroll
    for (int i = 0; i < WCH; ++i) {
      int64_t col = n0 + row_of(i);
      col = col < s.n ? col : s.n - 1;
      wp[i] = P.w + col * P.ldw + 4 * chunk_of(i);
    }
  };
  place();
  // CHAIN: the head weight of tile row tid (tid < BM), loaded with the tile's first stage.
  auto weight_of = [&]() {
    if constexpr (!CHAIN) return 0.0f;
    return tid < BM && m0 + tid < P.m ? __ldg(co.wt + co.t0 * co.Hi + m0 + tid) : 0.0f;
  };
  float weight = weight_of(), next_weight = 0.0f;
  float4 xr[XCH], wr[WCH];
  // Chunk at p (= row + 4c + k0) when the stage lies inside k.
  auto load4 = [&](const float* p) {
    if constexpr (VEC) return __ldg(reinterpret_cast<const float4*>(p));
    return make_float4(__ldg(p), __ldg(p + 1), __ldg(p + 2), __ldg(p + 3));
  };
  // The same where `left` = k - (k0 + 4c) may be below 4: elements past k load as 0.
  auto load4_tail = [&](const float* p, int64_t left) {
    if (left >= 4) return load4(p);
    float4 v = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    if (left > 0) v.x = __ldg(p);
    if (left > 1) v.y = __ldg(p + 1);
    if (left > 2) v.z = __ldg(p + 2);
    return v;
  };
  // Loads this thread's chunks of the stage at k0 into registers.
  auto fetch = [&](int64_t k0) {
    if (k0 + KS <= s.k) {  // uniform
#pragma unroll
      for (int i = 0; i < XCH; ++i) xr[i] = load4(xp[i] + k0);
#pragma unroll
      for (int i = 0; i < WCH; ++i) wr[i] = load4(wp[i] + k0);
    } else {
#pragma unroll
      for (int i = 0; i < XCH; ++i) xr[i] = load4_tail(xp[i] + k0, s.k - k0 - 4 * chunk_of(i));
#pragma unroll
      for (int i = 0; i < WCH; ++i) wr[i] = load4_tail(wp[i] + k0, s.k - k0 - 4 * chunk_of(i));
    }
  };
  auto stash = [&](int buf) { lanes_stash(Xs[buf], Ws[buf], xr, wr, warp, u); };

  float acc[TM][TN];
#pragma unroll
  for (int r = 0; r < TM; ++r)
#pragma unroll
    for (int c = 0; c < TN; ++c) acc[r][c] = 0.0f;
  const int64_t nstages = (s.k + KS - 1) / KS;

  if (nstages > 0) {
    fetch(0);
    stash(0);
  }
  __syncthreads();
  for (;;) {  // once, or (CHAIN) once per tile of this block
    const int64_t tm0 = m0, tn0 = n0;
    int64_t next = tile + gridDim.x;
    while (next < ntiles && dead(next)) next += gridDim.x;
    bool started = false;  // a finished chain has been folded into the sums
    int64_t pos = 0;       // steps of the current chain done
    for (int64_t st = 0; st < nstages; ++st) {
      const int buf = int(st & 1);
      const int64_t k0 = st * KS;
      if (st + 1 < nstages) {
        fetch(k0 + KS);  // in flight while this stage is consumed
      } else if (CHAIN && next < ntiles) {
        m0 = next / tiles_n * BM, n0 = next % tiles_n * BN;
        place();
        fetch(0);  // the next tile's first stage, in flight during this stage and the epilogue
        next_weight = weight_of();
      }
      const float* xs = &Xs[buf][l][gm * TM];
      const float* ws = &Ws[buf][l][gn * TN];
      const int kin = s.k - k0 < KS ? int(s.k - k0) : KS;  // k of this stage
      // Every branch below is uniform over the block: every thread walks the same steps.
      if (kin == KS && pos + STEPS <= chain_steps) {
        // The whole stage lies inside k and inside one chain (which may end with the stage).
        lanes_stage(acc, xs, ws);
        pos += STEPS;
        if (pos == chain_steps || k0 + KS == s.k) {
          lanes_combine(acc, sums, started);
          started = true;
          pos = 0;
        }
      } else {
        const int nt = (kin + 7) / 8;
        for (int j = 0; j < nt; ++j) {
          Frag f;
          lanes_load(f, xs + 8 * j * SX, ws + 8 * j * SW);
          // A lane whose element lies past k skips the step (its accumulators stay as they are).
          if (8 * j + l < kin) lanes_fma(acc, f);
          if (++pos == chain_steps || (j + 1 == nt && k0 + kin == s.k)) {
            lanes_combine(acc, sums, started);
            started = true;
            pos = 0;
          }
        }
      }
      if (st + 1 < nstages) stash(buf ^ 1);  // the buffer read in the previous stage
      __syncthreads();
    }
    // Post-condition: the sums hold dot(x row, w row, k, order) (nothing for k == 0: +0) for the
    // outputs at tile x row TM gm + 4 (l >> 2) + r and tile w row TN gn + 4 (l & 3) + c, r, c < 4.
    if constexpr (CHAIN) {
      // The stage buffers are free (the loop ended with a barrier): the tile's dot products go there,
      // [BM][BN + 1], and each (token of the tile, column) pair runs its chain over the token's Hi rows
      // in increasing h, reading down a column (consecutive threads, consecutive columns).
      constexpr int LD = BN + 1;
      static_assert(BM * LD <= 2 * KS * SX, "the tile fits in the x stages");
      float* dots = &Xs[0][0][0];
#pragma unroll
      for (int r = 0; r < 4; ++r) {
        const float4 v4 = started ? sums[r * NT] : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        const float v[4] = {v4.x, v4.y, v4.z, v4.w};
#pragma unroll
        for (int c = 0; c < 4; ++c)
          dots[(gm * TM + lanes_out_row(l, r)) * LD + gn * TN + lanes_out_col(l, c)] =
              common::gemm_out(v[c], s.round);
      }
      // The head weights of the tile's rows beside them (row r of the chunk is head r % Hi of query
      // row t0 + r / Hi, whose weights start at wt + (t0 + r / Hi) Hi).
      float* wts = dots + BM * LD;
      static_assert(BM * LD + BM <= 2 * KS * SX, "the weights fit beside the tile");
      if (tid < BM) wts[tid] = weight;
      __syncthreads();
      const int Hi = co.Hi, tokens = BM / Hi;
      for (int item = tid; item < tokens * BN; item += NT) {
        const int tau = item / BN, j = item % BN;
        const int64_t row0 = tm0 + int64_t(tau) * Hi, g = tn0 + j;
        if (row0 >= P.m || g >= s.n) continue;
        const int64_t t = co.t0 + row0 / Hi;
        if (g >= common::visible_groups(co.G, co.pos0 + t, co.ratio)) continue;
        const float* w = wts + tau * Hi;
        const float* d = dots + tau * Hi * LD + j;
        // Sixteen heads' dots and weights are loaded before their steps, which form the chain.
        float sc = 0.0f;
        int h = 0;
        for (; h + 16 <= Hi; h += 16) {
          float dv[16], wv[16];
#pragma unroll
          for (int i = 0; i < 16; ++i) dv[i] = d[(h + i) * LD], wv[i] = w[h + i];
#pragma unroll
          for (int i = 0; i < 16; ++i) sc = common::index_score_step(sc, wv[i], dv[i], co.bf16);
        }
        for (; h < Hi; ++h) sc = common::index_score_step(sc, w[h], d[h * LD], co.bf16);
        co.S[(t - co.s0) * co.G + g] = common::index_score_final(sc, co.bf16);
      }
    } else {
#pragma unroll
      for (int r = 0; r < 4; ++r) {
        const int64_t row = tm0 + gm * TM + lanes_out_row(l, r);
        if (row >= P.m) continue;
        float* y = P.y + int64_t(P.yrow ? P.yrow[row] : row) * P.ldy;
        const float4 v4 = started ? sums[r * NT] : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        const float v[4] = {v4.x, v4.y, v4.z, v4.w};
#pragma unroll
        for (int c = 0; c < 4; ++c) {
          const int64_t col = tn0 + gn * TN + lanes_out_col(l, c);
          if (col < s.n) y[col] = common::gemm_out(v[c], s.round);
        }
      }
    }
    if (!CHAIN || next >= ntiles) break;
    __syncthreads();  // every thread is past its reads of the tile
    if (nstages > 0) stash(0);
    __syncthreads();
    tile = next;
    weight = next_weight;
  }
}

template <bool VEC>
__global__ void __launch_bounds__(lanes::NT, 1)
    gemm_lanes_kernel(GemmShape s, int64_t chain_steps, GemmProblem one, const GemmProblem* many) {
  gemm_lanes_body<VEC, false>(s, chain_steps, one, many, IndexerChainOut{});
}
template <bool VEC>
__global__ void __launch_bounds__(lanes::NT, 1)
    gemm_indexer_chain_kernel(GemmShape s, int64_t chain_steps, GemmProblem one, IndexerChainOut co) {
  gemm_lanes_body<VEC, true>(s, chain_steps, one, nullptr, co);
}

// ---- launch ------------------------------------------------------------------------------------------
// Launches `kernel` over grid (ceil(n / BN), ceil(mmax / BM), count); a group's problem array goes to
// the device first.
template <typename Kernel>
void launch(Kernel kernel, int threads, int smem, int BM, int BN, const GemmShape& s, int64_t chain,
            const GemmProblem* problems, int count, int64_t mmax, cudaStream_t stream) {
  if (ceil_div(mmax, BM) > 65535) throw Error("cuda gemm cannot run: m is too large for one launch");
  const dim3 grid(unsigned(ceil_div(s.n, BN)), unsigned(ceil_div(mmax, BM)), unsigned(count));
  if (count == 1) {
    kernel<<<grid, threads, smem, stream>>>(s, chain, problems[0], nullptr);
    DSV4_LAUNCH_CHECK();
    return;
  }
  Scratch<GemmProblem> dev(count, stream);
  CUDA_CHECK(cudaMemcpyAsync(dev.get(), problems, sizeof(GemmProblem) * size_t(count), cudaMemcpyHostToDevice,
                             stream));
  kernel<<<grid, threads, smem, stream>>>(s, chain, GemmProblem{}, dev.get());
  DSV4_LAUNCH_CHECK();
}

// Allows `kernel` the lane-split kernels' dynamic shared memory (above the default 48 KiB) on the
// current device, once per device: bit d of `ready` (the kernel's own) says it was done on device d.
template <typename Kernel>
void allow_lanes_smem(Kernel kernel, std::atomic<uint64_t>& ready) {
  int dev = 0;
  CUDA_CHECK(cudaGetDevice(&dev));
  const uint64_t bit = dev < 64 ? uint64_t(1) << dev : 0;
  if (!(ready.load() & bit)) {
    CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, lanes::SMEM));
    ready.fetch_or(bit);
  }
}

// The lane-split kernel.
template <bool VEC>
void launch_lanes(const GemmShape& s, int64_t chain, const GemmProblem* problems, int count, int64_t mmax,
                  cudaStream_t stream) {
  static std::atomic<uint64_t> ready{0};
  allow_lanes_smem(gemm_lanes_kernel<VEC>, ready);
  launch(gemm_lanes_kernel<VEC>, lanes::NT, lanes::SMEM, lanes::BM, lanes::BN, s, chain, problems, count,
         mmax, stream);
}

// gemm_indexer_chain_kernel.
template <bool VEC>
void launch_indexer_chain(const GemmShape& s, int64_t chain, const GemmProblem& g, const IndexerChainOut& c,
                          cudaStream_t stream) {
  static std::atomic<uint64_t> ready{0};
  allow_lanes_smem(gemm_indexer_chain_kernel<VEC>, ready);
  // One wave of blocks walks the tiles.
  static std::atomic<int> per_sm{0};
  if (per_sm.load() == 0) {
    int n = 0;
    CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, gemm_indexer_chain_kernel<VEC>, lanes::NT,
                                                             lanes::SMEM));
    per_sm.store(n > 0 ? n : 1);
  }
  const int64_t tiles = ceil_div(s.n, lanes::BN) * ceil_div(g.m, lanes::BM);
  const int64_t wave = int64_t(per_sm.load()) * device_attribute(cudaDevAttrMultiProcessorCount);
  const unsigned grid = unsigned(tiles < wave ? tiles : wave);
  gemm_indexer_chain_kernel<VEC><<<grid, lanes::NT, lanes::SMEM, stream>>>(s, chain, g, c);
  DSV4_LAUNCH_CHECK();
}

bool aligned16(const void* p, int64_t ld) {
  return reinterpret_cast<uintptr_t>(p) % 16 == 0 && ld % 4 == 0;
}

enum class Kernel { automatic, tiled };
constexpr int64_t kMinLaneTiles = 96;  // output tiles from which gemm_group takes the lane-split kernel

void run_group(const GemmShape& s, const GemmProblem* problems, int count, cudaStream_t stream,
               Kernel which) {
  if (count <= 0 || s.n <= 0) return;
  int64_t mmax = 0;
  for (int i = 0; i < count; ++i) mmax = problems[i].m > mmax ? problems[i].m : mmax;
  if (mmax <= 0) return;
  if (count > 65535) throw Error("cuda gemm cannot run: too many problems in one group");
  if (s.order.tensor_core)
    return gemm_tensor_core_group(s, problems, count, mmax, which == Kernel::automatic, stream);
  for (int i = 0; i < count; ++i)
    if (problems[i].x16) throw Error("cuda gemm: a bf16 x (GemmProblem::x16) needs the tensor_core order");
  // Chain length in groups of 8: the ReduceOrder block, or "never" for a single chain.
  const int64_t chain_groups = (s.order.block > 0 && s.k > s.order.block) ? s.order.block / 8 : INT64_MAX;
  // The kernel and the tile only change which thread computes an element, never its order. The
  // lane-split kernel is faster per tile but its tiles are 4 times larger than the tiled kernel's
  // 32 x 64: it takes the problem when that still gives about one wave of blocks (an H200 has 132
  // multiprocessors, each running one such block).
  int64_t tiles = 0;
  for (int i = 0; i < count; ++i) tiles += ceil_div(problems[i].m, lanes::BM);
  tiles *= ceil_div(s.n, lanes::BN);
  if (which == Kernel::automatic && s.n > 32 && tiles >= kMinLaneTiles) {
    bool vec = true;
    for (int i = 0; i < count; ++i)
      vec = vec && (problems[i].m <= 0 ||
                    (aligned16(problems[i].x, problems[i].ldx) && aligned16(problems[i].w, problems[i].ldw)));
    if (vec)
      launch_lanes<true>(s, chain_groups, problems, count, mmax, stream);
    else
      launch_lanes<false>(s, chain_groups, problems, count, mmax, stream);
    return;
  }
  // Narrow outputs (router, head weights, mHC mixes) take narrow tiles so that more blocks share
  // the work.
  if (s.n <= 16)
    launch(gemm_tiled_kernel<1, 1>, kThreads, 0, 16, 16, s, chain_groups, problems, count, mmax, stream);
  else if (s.n <= 32)
    launch(gemm_tiled_kernel<2, 2>, kThreads, 0, 32, 32, s, chain_groups, problems, count, mmax, stream);
  else
    launch(gemm_tiled_kernel<2, 4>, kThreads, 0, 32, 64, s, chain_groups, problems, count, mmax, stream);
}

GemmProblem single_problem(const GemmParams& p) {
  GemmProblem g;
  g.x = p.x;
  g.ldx = p.ldx;
  g.w = p.w;
  g.ldw = p.ldw;
  g.y = p.y;
  g.ldy = p.ldy;
  g.m = p.m;
  g.x16 = reinterpret_cast<const __nv_bfloat16*>(p.x16);
  return g;
}

}  // namespace

void gemm_group(const GemmShape& s, const GemmProblem* problems, int count, cudaStream_t stream) {
  run_group(s, problems, count, stream, Kernel::automatic);
}

bool indexer_chain_fusable(int Hi) {
  return Hi > 0 && lanes::BM % Hi == 0;
}

void gemm_indexer_chain(const GemmShape& s, const GemmProblem& g, const IndexerChainOut& c,
                        cudaStream_t stream) {
  if (!indexer_chain_fusable(c.Hi)) throw Error("cuda gemm_indexer_chain: Hi must divide 64");
  if (s.order.tensor_core) throw Error("cuda gemm_indexer_chain: the exact orders only");
  if (g.m <= 0 || s.n <= 0) return;
  if (g.m % c.Hi != 0) throw Error("cuda gemm_indexer_chain: m is not a whole number of query rows");
  const int64_t chain_groups = (s.order.block > 0 && s.k > s.order.block) ? s.order.block / 8 : INT64_MAX;
  if (aligned16(g.x, g.ldx) && aligned16(g.w, g.ldw))
    launch_indexer_chain<true>(s, chain_groups, g, c, stream);
  else
    launch_indexer_chain<false>(s, chain_groups, g, c, stream);
}

}  // namespace detail

bool device_available() {
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
}

void keep_scratch_memory() {
  static std::mutex mu;
  static std::set<int> kept;  // devices whose pool is set
  int dev = 0;
  CUDA_CHECK(cudaGetDevice(&dev));
  const std::lock_guard<std::mutex> lock(mu);
  if (!kept.insert(dev).second) return;
  cudaMemPool_t pool;
  CUDA_CHECK(cudaDeviceGetDefaultMemPool(&pool, dev));
  uint64_t threshold = UINT64_MAX;
  CUDA_CHECK(cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &threshold));
}

void gemm(const GemmParams& p, cudaStream_t stream) {
  require(dsv4::gemm_check(p), "gemm");
  if (p.m <= 0 || p.n <= 0) return;
  const detail::GemmProblem g = detail::single_problem(p);
  detail::run_group(detail::GemmShape{p.n, p.k, p.round, p.order}, &g, 1, stream, detail::Kernel::automatic);
}

void gemm_tiled(const GemmParams& p, cudaStream_t stream) {
  require(dsv4::gemm_check(p), "gemm");
  if (p.m <= 0 || p.n <= 0) return;
  const detail::GemmProblem g = detail::single_problem(p);
  detail::run_group(detail::GemmShape{p.n, p.k, p.round, p.order}, &g, 1, stream, detail::Kernel::tiled);
}

bool gemm_tensor_core_uses_wgmma() {
  return detail::wgmma_available();
}

}  // namespace dsv4::cuda
