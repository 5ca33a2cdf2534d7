// Lightning indexer scores + top-k and the attention index rows on the GPU, in the operation order
// and with the tie rule of kernels/indexer.h.
//
// cuda::indexer_topk runs three steps per block of query rows; none of them changes a bit of the
// result (every score is the same fma chain over heads of the same canonical dot products):
//   1. Dots (the lane-split GEMM of kernels/cuda/linear.cu through detail::gemm_group, OutRound::f32):
//      for a chunk of Tc query rows [t0, t1) the matrix of dot products
//        D[(t - t0) Hi + h][g] = dot(qi[t, h, :], ki[g, :], Di, order),  g < n = visible(t1 - 1),
//      i.e. the rows of qi (flattened over (t, h), contiguous in memory) times the first n rows of ki.
//      The GEMM's contract is exactly dsv4::dot per element, rounded to nothing for f32. Every key row
//      is loaded once per 64 x 64 output tile instead of once per query row, and each thread keeps a
//      register tile of outputs (one canonical lane each). n is the largest visible count of the
//      chunk, so only the slots g >= visible(t) of rows t < t1 - 1 are computed in vain (less than
//      Tc / ratio columns).
//   2. indexer_chain_kernel: one thread per (t, g) with t in the chunk and g < visible(t):
//      S[t][g] = index_score_step(...(index_score_step(0, wt[t, 0], D[.. h = 0][g]) ...), h = Hi - 1),
//      the chain over heads in increasing h. Reads of D are coalesced over g. Slots g >= visible(t)
//      of S are never written nor read.
//   3. indexer_select_kernel: one block of 256 threads per query row of a block of Ts rows (several
//      chunks; S holds Ts x G floats): the row's n = visible(t) scores are copied into shared memory
//      and select_row (below, shared with the row-per-block kernel) picks the top-k. When visible(T - 1)
//      floats do not fit in shared memory, indexer_topk runs the row-per-block kernel instead.
// Scratch (stream-ordered): D of Tc * Hi * visible(T - 1) floats and S of Ts * G floats, Tc and Ts
// chosen from fixed budgets (kDotBudget, kScoreBudget) and caps (kMaxChunkRows, kMaxSelectRows);
// those only change how the work is cut, never a value.
//
// indexer_topk_row_per_block_kernel (cuda::indexer_topk_row_per_block): one block of 256 threads per query
// row t (grid-stride over rows).
//   1. q[t] and wt[t] are staged in shared memory; the n = min(G, (t+1)/ratio) candidate scores are
//      computed by 32 groups of 8 threads (one candidate per group at a time): the group forms
//      dot(q[t,h], ki[g]) for a tile of 4, 8 or 16 heads at once with multi_dot8 (the canonical order per
//      head, each key element loaded once per tile) and keeps the fma chain over heads in increasing
//      h. The score row lives in shared memory (global scratch when it does not fit).
//   2. select_row.
// select_row: selection without sorting and without atomics. Each score maps to a 32-bit key that
//   orders like topk_row's ranking (NaN lowest, -0 == +0, larger score larger key); the k-th largest
//   key `thr` is found bit by bit (32 block-wide counts). Chosen = key > thr, plus the first
//   k - #(key > thr) candidates with key == thr in index order (smaller index first). The worst
//   chosen is the last of those ties; the best unchosen is the next tie, or else the smallest index
//   among the largest key below thr. Chosen ids are compacted in index order (ascending) with a
//   block prefix sum over contiguous index chunks.
// indexer_score_ids_kernel: one group of 8 threads per (t, j), the same score formula.
// build_index_kernel: one thread per index entry (t, m).
#include "kernels/cuda/common.cuh"
#include "kernels/detail/indexer.h"

namespace dsv4::cuda {

namespace {

constexpr int kThreads = 256, kGroups = kThreads / 8;

// The ranking of topk_row as an unsigned key: NaN -> 0 (after every number); -0 counts as +0; for
// numbers the usual monotone map of the fp32 bits (all numbers, -inf included, map above 0).
__device__ __forceinline__ uint32_t rank_key(float s) {
  if (s != s) return 0u;
  uint32_t u = __float_as_uint(s);
  if (u == 0x80000000u) u = 0u;
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

template <typename T, typename Op>
__device__ T block_reduce(T v, T* red, Op op) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
  for (int o = 16; o > 0; o >>= 1) v = op(v, __shfl_xor_sync(0xffffffffu, v, o));
  __syncthreads();
  if (lane == 0) red[warp] = v;
  __syncthreads();
  T s = red[0];
  for (int i = 1; i < nw; ++i) s = op(s, red[i]);
  return s;
}

// The score of one candidate (the chain over heads of kernels/detail/indexer.h), computed by the 8
// threads of a group; the value is valid in every lane.
__device__ __forceinline__ float index_score(const float* q, const float* w, const float* k, int Hi,
                                             int64_t Di, int block, bool bf16, int lane, unsigned mask) {
  float s = 0.0f;
  for (int h = 0; h < Hi; ++h)
    s = common::index_score_step(s, w[h], detail::dot8(q + h * Di, k, Di, block, lane, mask), bf16);
  return common::index_score_final(s, bf16);
}

// The selection of row t from its n = visible(t) scores sc[0..n) (shared or global memory, read
// only): writes ids, margin and score of the row. All threads of the block call it with the same
// arguments; the scores must be complete (a barrier after they were written). On return every thread
// is past its last read of sc (a barrier ends the function), so the caller may overwrite sc.
__device__ __forceinline__ void select_row(const IndexerParams p, int64_t t, int64_t n, const float* sc,
                                           int* red_i, uint32_t* red_u, int32_t* tie_at) {
  const int tid = threadIdx.x;
  const float inf = __int_as_float(0x7f800000), qnan = __int_as_float(0x7fc00000);
  const int kk = int(p.k < n ? p.k : n);
  int32_t* ids = p.ids + t * p.k;
  float margin = inf;
  if (kk > 0 && n <= kk) {  // every candidate is chosen: ids 0..n-1
    for (int j = tid; j < kk; j += kThreads) ids[j] = j;
  } else if (kk > 0) {
    // thr = the kk-th largest key: the largest value with #(key >= value) >= kk.
    uint32_t thr = 0;
    for (int bit = 31; bit >= 0; --bit) {
      const uint32_t cand = thr | (1u << bit);
      int cnt = 0;
      for (int64_t i = tid; i < n; i += kThreads) cnt += rank_key(sc[i]) >= cand;
      if (detail::block_sum(cnt, red_i) >= kk) thr = cand;
    }
    int gt = 0;
    for (int64_t i = tid; i < n; i += kThreads) gt += rank_key(sc[i]) > thr;
    const int r = kk - detail::block_sum(gt, red_i);  // ties to take, >= 1
    // Ties in index order over contiguous chunks.
    const int64_t chunk = (n + kThreads - 1) / kThreads, lo = tid * chunk,
                  hi = lo + chunk < n ? lo + chunk : n;
    int mine = 0;
    for (int64_t i = lo; i < hi; ++i) mine += rank_key(sc[i]) == thr;
    int total = 0;
    const int before = detail::block_exclusive_scan(mine, red_i, &total);
    if (tid < 2) tie_at[tid] = -1;
    __syncthreads();
    for (int want = r; want <= r + 1; ++want) {
      if (want <= total && before < want && want <= before + mine) {
        int seen = before;
        for (int64_t i = lo; i < hi; ++i)
          if (rank_key(sc[i]) == thr && ++seen == want) {
            tie_at[want - r] = int32_t(i);
            break;
          }
      }
    }
    __syncthreads();
    const int32_t worst = tie_at[0];
    int32_t best_unchosen = tie_at[1];
    if (best_unchosen < 0) {
      // No further tie: the largest key below thr, smallest index among equals (exists as n > kk).
      uint32_t below = 0;
      bool any = false;
      for (int64_t i = tid; i < n; i += kThreads) {
        const uint32_t kv = rank_key(sc[i]);
        if (kv < thr && (!any || kv > below)) below = kv, any = true;
      }
      // Keys below thr are < thr <= 0xffffffff; encode "none" as 0 with a flag folded in via +1.
      const uint32_t best = block_reduce<uint32_t>(any ? below + 1u : 0u, red_u,
                                                   [](uint32_t a, uint32_t b) { return a > b ? a : b; });
      int first = INT32_MAX;
      for (int64_t i = tid; i < n; i += kThreads)
        if (rank_key(sc[i]) + 1u == best && int(i) < first) first = int(i);
      best_unchosen = block_reduce<int>(first, red_i, [](int a, int b) { return a < b ? a : b; });
    }
    margin = sc[worst] - sc[best_unchosen];
    // Compaction: chosen ids ascending.
    int sel = 0;
    for (int64_t i = lo; i < hi; ++i) {
      const uint32_t kv = rank_key(sc[i]);
      sel += kv > thr || (kv == thr && i <= worst);
    }
    int nsel = 0;
    int pos = detail::block_exclusive_scan(sel, red_i, &nsel);
    for (int64_t i = lo; i < hi; ++i) {
      const uint32_t kv = rank_key(sc[i]);
      if (kv > thr || (kv == thr && i <= worst)) ids[pos++] = int32_t(i);
    }
  }
  for (int j = kk + tid; j < p.k; j += kThreads) ids[j] = -1;
  if (tid == 0 && p.margin) p.margin[t] = margin;
  __syncthreads();  // ids of this row are complete
  if (p.score)
    for (int j = tid; j < p.k; j += kThreads) p.score[t * p.k + j] = j < kk ? sc[ids[j]] : qnan;
  __syncthreads();  // sc is reused by the next row
}

template <int kHeadTile>
__global__ void __launch_bounds__(kThreads)
    indexer_topk_row_per_block_kernel(IndexerParams p, bool scores_in_shared, float* scratch) {
  extern __shared__ float sh[];
  float* qs = sh;                                                                  // [Hi * Di]
  float* ws = qs + p.Hi * p.Di;                                                    // [Hi]
  float* sc = scores_in_shared ? ws + p.Hi : scratch + int64_t(blockIdx.x) * p.G;  // [G]
  __shared__ int red_i[32];
  __shared__ uint32_t red_u[32];
  __shared__ int32_t tie_at[2];  // the r-th and (r+1)-th tie in index order (-1: none)
  const int tid = threadIdx.x, lane = tid & 7, group = tid >> 3;
  const unsigned mask = detail::group8_mask();

  for (int64_t t = blockIdx.x; t < p.T; t += gridDim.x) {
    const int64_t n = common::row_candidates(p, t);
    for (int64_t i = tid; i < p.Hi * p.Di; i += kThreads) qs[i] = p.qi[t * p.Hi * p.Di + i];
    for (int i = tid; i < p.Hi; i += kThreads) ws[i] = p.wt[t * p.Hi + i];
    __syncthreads();
    for (int64_t c = group; c < n; c += kGroups) {
      // Heads in tiles of kHeadTile: each key element is loaded once per tile; the fma chain over
      // heads runs in increasing h.
      const float* kc = p.ki + c * p.Di;
      float s = 0.0f;
      for (int h0 = 0; h0 < p.Hi; h0 += kHeadTile) {
        const int nh = p.Hi - h0 < kHeadTile ? p.Hi - h0 : kHeadTile;
        float d[kHeadTile];
        detail::multi_dot8<kHeadTile>(qs + h0 * p.Di, p.Di, nh, kc, p.Di, p.order.block, lane, mask, d);
#pragma unroll
        for (int h = 0; h < kHeadTile; ++h)
          if (h < nh) s = common::index_score_step(s, ws[h0 + h], d[h], p.bf16_scores);
      }
      if (lane == 0) sc[c] = common::index_score_final(s, p.bf16_scores);
    }
    __syncthreads();

    select_row(p, t, n, sc, red_i, red_u, tie_at);  // ends with a barrier: sc, qs are free again
  }
}

// Step 2 of cuda::indexer_topk for the query rows [t0, t0 + rows): dots holds the chunk's dot products
// D[r Hi + h][g] (row r = t - t0, leading dimension ld = the chunk's n, g < ld); S row t - s0 (leading
// dimension G) gets the score of every visible slot g < visible(t) (<= ld), as the fma chain over heads
// in increasing h. Consecutive threads take consecutive g of one row: the loads of D are coalesced.
__global__ void __launch_bounds__(kThreads)
    indexer_chain_kernel(IndexerParams p, int64_t t0, int64_t rows, int64_t ld, const float* dots, float* S,
                         int64_t s0) {
  const int64_t total = rows * ld;
  for (int64_t e = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; e < total;
       e += int64_t(gridDim.x) * blockDim.x) {
    const int64_t r = e / ld, g = e % ld, t = t0 + r;
    if (g >= common::row_candidates(p, t)) continue;
    const float* d = dots + r * p.Hi * ld + g;  // D[r Hi + h][g] = d[h ld]
    const float* w = p.wt + t * p.Hi;
    float s = 0.0f;
#pragma unroll 4
    for (int h = 0; h < p.Hi; ++h) s = common::index_score_step(s, __ldg(w + h), __ldg(d + h * ld), p.bf16_scores);
    S[(t - s0) * p.G + g] = common::index_score_final(s, p.bf16_scores);
  }
}

// Step 3 of cuda::indexer_topk for the query rows [s0, s0 + rows): S row t - s0 holds the scores of
// row t's visible slots; the row is copied into shared memory (nmax floats, dynamic) and selected.
__global__ void __launch_bounds__(kThreads)
    indexer_select_kernel(IndexerParams p, int64_t s0, int64_t rows, const float* S) {
  extern __shared__ float sh[];  // [nmax]
  __shared__ int red_i[32];
  __shared__ uint32_t red_u[32];
  __shared__ int32_t tie_at[2];  // the r-th and (r+1)-th tie in index order (-1: none)
  const int tid = threadIdx.x;
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const int64_t t = s0 + r, n = common::row_candidates(p, t);
    for (int64_t i = tid; i < n; i += kThreads) sh[i] = S[r * p.G + i];  // S is null only when n == 0
    __syncthreads();                                                     // the scores are complete
    select_row(p, t, n, sh, red_i, red_u, tie_at);  // ends with a barrier: sh is free again
  }
}

__global__ void __launch_bounds__(kThreads)
    indexer_score_ids_kernel(IndexerParams p, const int32_t* ids, float* score) {
  const int lane = threadIdx.x & 7;
  const unsigned mask = detail::group8_mask();
  const float qnan = __int_as_float(0x7fc00000);
  const int64_t total = p.T * p.k;
  for (int64_t e = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) / 8; e < total;
       e += int64_t(gridDim.x) * blockDim.x / 8) {
    const int64_t t = e / p.k;
    const int32_t g = ids[e];
    if (g < 0 || g >= p.G) {
      if (lane == 0) score[e] = qnan;
      continue;
    }
    const float s = index_score(p.qi + t * p.Hi * p.Di, p.wt + t * p.Hi, p.ki + int64_t(g) * p.Di, p.Hi, p.Di,
                                p.order.block, p.bf16_scores, lane, mask);
    if (lane == 0) score[e] = s;
  }
}

__global__ void __launch_bounds__(kThreads)
    build_index_kernel(IndexBuildParams p, int64_t kw, int64_t width) {
  const int64_t total = p.T * width;
  for (int64_t e = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; e < total;
       e += int64_t(gridDim.x) * blockDim.x) {
    p.idx[e] = common::index_entry(p, kw, e / width, e % width);
  }
}

// Shared memory of the top-k kernels: (row per block) q and the head weights, plus the score row when it
// fits.
constexpr size_t kMaxShared = 200 * 1024;
// Work cuts of cuda::indexer_topk (kernels/cuda/indexer.cu header): none of them changes a value.
constexpr int64_t kDotBudget = int64_t(8) << 20;     // floats of D (32 MiB)
constexpr int64_t kScoreBudget = int64_t(16) << 20;  // floats of S (64 MiB)
constexpr int64_t kMaxChunkRows = 256;               // query rows per GEMM
constexpr int64_t kMaxSelectRows = 2048;             // query rows per selection launch
constexpr int64_t kMaxGemmRows = int64_t(1) << 21;   // GEMM rows (t, h) per launch: grid.y < 65536
constexpr int64_t kSelectBlocks = 2048;              // blocks of the selection kernel (grid-stride)

}  // namespace

void indexer_topk(const IndexerParams& p, cudaStream_t stream) {
  require(dsv4::indexer_check(p), "indexer_topk");
  if (p.T <= 0) return;
  if (p.G > INT32_MAX / 2) require("G is too large", "indexer_topk");
  // The most keys any row sees (visible_groups grows with t); the D buffer has this many columns.
  const int64_t nmax = common::row_candidates(p, p.T - 1);
  // A score row that does not fit in shared memory (more than 51200 visible keys) takes the row-per-block
  // kernel, which keeps such rows in global scratch.
  if (sizeof(float) * size_t(nmax) > kMaxShared) return indexer_topk_row_per_block(p, stream);
  // Chunk of query rows for one GEMM: D (Tc * Hi * nmax floats) within kDotBudget, Tc * Hi within
  // kMaxGemmRows (the GEMM grid), at most kMaxChunkRows rows.
  int64_t tc = kDotBudget / (int64_t(p.Hi) * (nmax > 0 ? nmax : 1));
  tc = tc < kMaxGemmRows / p.Hi ? tc : kMaxGemmRows / p.Hi;
  tc = tc < kMaxChunkRows ? tc : kMaxChunkRows;
  tc = tc < p.T ? tc : p.T;
  tc = tc > 0 ? tc : 1;
  // Rows per selection launch: a multiple of tc with S (ts * G floats) within kScoreBudget, at most
  // kMaxSelectRows (but at least one chunk).
  int64_t ts = kScoreBudget / (p.G > 0 ? p.G : 1);
  ts = ts < kMaxSelectRows ? ts : kMaxSelectRows;
  ts = ts / tc * tc;
  ts = ts > tc ? ts : tc;
  ts = ts < p.T ? ts : p.T;
  if (int64_t(p.Hi) * tc > kMaxGemmRows) require("Hi is too large", "indexer_topk");

  detail::Scratch<float> dots(nmax > 0 ? tc * p.Hi * nmax : 0, stream);
  detail::Scratch<float> S(nmax > 0 ? ts * p.G : 0, stream);
  // The selection kernel keeps a row of scores (at most nmax) in shared memory.
  const size_t shmem = sizeof(float) * size_t(nmax);
  CUDA_CHECK(
      cudaFuncSetAttribute(indexer_select_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(shmem)));
  for (int64_t s0 = 0; s0 < p.T; s0 += ts) {
    const int64_t s1 = s0 + ts < p.T ? s0 + ts : p.T;
    // Invariant: S rows [0, t0 - s0) hold the scores of rows [s0, t0) at every visible slot.
    for (int64_t t0 = s0; t0 < s1; t0 += tc) {
      const int64_t t1 = t0 + tc < s1 ? t0 + tc : s1, rows = t1 - t0;
      const int64_t n = common::row_candidates(p, t1 - 1);  // >= visible(t), t in [t0, t1)
      if (n <= 0) continue;  // no row of the chunk sees a key: nothing to score
      detail::GemmProblem g;
      g.x = p.qi + t0 * p.Hi * p.Di;  // row (t - t0) Hi + h is qi[t, h, :]
      g.ldx = p.Di;
      g.w = p.ki;  // row g is ki[g, :]
      g.ldw = p.Di;
      g.y = dots.get();
      g.ldy = n;
      g.m = rows * p.Hi;
      detail::gemm_group(detail::GemmShape{n, p.Di, OutRound::f32, p.order}, &g, 1, stream);
      indexer_chain_kernel<<<detail::grid_for(rows * n, kThreads), kThreads, 0, stream>>>(
          p, t0, rows, n, dots.get(), S.get(), s0);
      DSV4_LAUNCH_CHECK();
    }
    const int64_t rows = s1 - s0;
    const unsigned blocks = unsigned(rows < kSelectBlocks ? rows : kSelectBlocks);
    indexer_select_kernel<<<blocks, kThreads, shmem, stream>>>(p, s0, rows, S.get());
    DSV4_LAUNCH_CHECK();
  }
}

void indexer_topk_row_per_block(const IndexerParams& p, cudaStream_t stream) {
  require(dsv4::indexer_check(p), "indexer_topk_row_per_block");
  if (p.T <= 0) return;
  if (p.G > INT32_MAX / 2) require("G is too large", "indexer_topk_row_per_block");
  const size_t qbytes = sizeof(float) * size_t(p.Hi * p.Di + p.Hi);
  if (qbytes > kMaxShared / 2)
    require("Hi * Di is too large for shared memory", "indexer_topk_row_per_block");
  const bool in_shared = qbytes + sizeof(float) * size_t(p.G) <= kMaxShared;
  const size_t shmem = qbytes + (in_shared ? sizeof(float) * size_t(p.G) : 0);
  const unsigned blocks = unsigned(p.T < 2048 ? p.T : 2048);
  detail::Scratch<float> scratch(in_shared ? 0 : int64_t(blocks) * p.G, stream);
  // Head tile: the smallest of 4, 8, 16 that covers Hi (more heads run in several tiles).
  auto launch = [&](auto kernel) {
    CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(shmem)));
    kernel<<<blocks, kThreads, shmem, stream>>>(p, in_shared, scratch.get());
  };
  if (p.Hi <= 4)
    launch(indexer_topk_row_per_block_kernel<4>);
  else if (p.Hi <= 8)
    launch(indexer_topk_row_per_block_kernel<8>);
  else
    launch(indexer_topk_row_per_block_kernel<16>);
  DSV4_LAUNCH_CHECK();
}

void indexer_score_ids(const IndexerParams& p, const int32_t* ids, float* score, cudaStream_t stream) {
  IndexerParams c = p;  // the ids come as an argument here, not in p
  c.ids = const_cast<int32_t*>(ids);
  require(dsv4::indexer_check(c), "indexer_score_ids");
  if (p.T <= 0 || p.k <= 0) return;
  if (!score) require("score is null", "indexer_score_ids");
  indexer_score_ids_kernel<<<detail::grid_for(p.T * p.k * 8, kThreads), kThreads, 0, stream>>>(p, ids, score);
  DSV4_LAUNCH_CHECK();
}

const char* build_index_check(const IndexBuildParams& p) {
  if (p.T < 0) return "build_index: T < 0";
  if (p.W < 1) return "build_index: W < 1";
  if (p.pos0 < 0 || p.hist < 0 || p.hist > p.pos0) return "build_index: pos0 / hist";
  if (p.kind == CompressedKind::c128 && p.ratio < 1) return "build_index: ratio < 1";
  if (p.kind == CompressedKind::c4 && p.k < 0) return "build_index: k < 0";
  if (p.T > 0 && !p.idx) return "build_index: idx is null";
  if (p.T > 0 && p.kind == CompressedKind::c4 && p.k > 0 && !p.sel) return "build_index: sel is null";
  return nullptr;
}

void build_index(const IndexBuildParams& p, cudaStream_t stream) {
  require(cuda::build_index_check(p), "build_index");
  const int64_t kw = index_window_width(p), width = index_width(p);
  if (p.T <= 0 || width <= 0) return;
  build_index_kernel<<<detail::grid_for(p.T * width, kThreads), kThreads, 0, stream>>>(p, kw, width);
  DSV4_LAUNCH_CHECK();
}

}  // namespace dsv4::cuda
