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
//   Steps 1 and 2 run as one launch where Hi divides 64 (detail::gemm_indexer_chain, kernels/cuda/linear.cu):
//      the GEMM's 64 x 64 output tile then holds whole tokens, and instead of storing D it keeps the tile
//      in shared memory and runs the same chain there; D is never written (the model's Hi = 64 and 4).
//   3. indexer_select_kernel: one block of 256 threads per query row of a block of Ts rows (several
//      chunks; S holds Ts x G floats): the row's n = visible(t) scores are copied into shared memory
//      and select_row (below, shared with the row-per-block kernel) picks the top-k. When visible(T - 1)
//      floats do not fit in shared memory, indexer_topk runs the row-per-block kernel instead.
// Scratch (stream-ordered): D of Tc * Hi * visible(T - 1) floats (none on the fused path) and S of
// Ts * G floats, Tc and Ts chosen from fixed budgets (kDotBudget, kScoreBudget) and caps
// (kMaxChunkRows, kMaxSelectRows); those only change how the work is cut, never a value.
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
//
// The tensor_core order (p.order.tensor_core; fast numerics, docs/NUMERICS.md): the same score chain
// over heads, top-k rule and outputs, with every dot(qi[t, h], ki[g]) a tensor-core product: qi and ki
// rounded to bf16, Di zero-padded to DI (64 or 128), DI / 16 mma.sync.m16n8k16 steps (k = 0..15,
// 16..31, ...) into one fp32 accumulator from 0. What one mma does inside is the hardware's, fixed per
// architecture (sm_80 and newer); a row's ids, margin and scores depend only on its qi, wt and the keys
// it sees. indexer_topk_tensor_core_kernel fuses the three steps, one block of 256 threads (8 warps)
// per query row t (grid-stride; at most 64 heads and Di <= 128, the model's 64 x 128):
//   1. qi[t] (bf16, [64][DI + 8]) and wt[t] are staged in shared memory.
//   2. For each tile of 256 keys (from a bf16 copy of ki made once per call, cp.async; keys past the
//      row's candidates are zeros): warp w forms the dots of heads 16 (w % 4) .. +15 against keys
//      128 (w / 4) .. +127 of the tile and stores them ([64][260] fp32); thread j then runs the chain
//      over heads in increasing h for key j of the tile (index_score_step) into the row's score row
//      (shared memory, or global scratch for very long rows) while the next tile loads.
//   3. select_row, as above. For indexer_score_ids every key is scored (no causal mask) and the given
//      ids' scores are written instead.
#include <cuda_bf16.h>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/mma.cuh"
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
    for (int h = 0; h < p.Hi; ++h)
      s = common::index_score_step(s, __ldg(w + h), __ldg(d + h * ld), p.bf16_scores);
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

// ---- the tensor_core order (header above) --------------------------------------------------------

constexpr int kTcHeads = 64;         // heads per block (zero rows past Hi)
constexpr int kTcKeys = 256;         // keys per tile (one per thread in the chain)
constexpr int kTcLdd = kTcKeys + 4;  // floats per row of the dots tile
constexpr int kTcMaxDi = 128;        // a tile of 256 keys of 256 dims would not fit beside the dots

int tc_padded_di(int64_t Di) {
  return Di <= 64 ? 64 : 128;
}

// Shared memory of the tensor_core kernel, in bytes: q [64][DI + 8] bf16, keys [256][DI + 8] bf16, dots
// [64][260] fp32, head weights [64] fp32, then the score row (sc_len floats, 0 when it lives in global
// scratch).
struct IdxTcLayout {
  int64_t ld;
  size_t keys, dots, ws, sc;
  size_t bytes(int64_t sc_len) const { return sc + sizeof(float) * size_t(sc_len); }
};
__host__ __device__ inline IdxTcLayout idx_tc_layout(int di) {
  IdxTcLayout L{};
  L.ld = di + 8;
  L.keys = sizeof(__nv_bfloat16) * size_t(kTcHeads) * size_t(L.ld);
  L.dots = L.keys + sizeof(__nv_bfloat16) * size_t(kTcKeys) * size_t(L.ld);
  L.ws = L.dots + sizeof(float) * size_t(kTcHeads) * kTcLdd;
  L.sc = L.ws + sizeof(float) * kTcHeads;
  return L;
}

// forced == nullptr: top-k of the visible keys (indexer_topk). Else indexer_score_ids: every key g < G
// is scored and out[t k + j] = score of forced[t k + j] (NaN for -1 and ids outside [0, G)).
template <int DI>
__global__ void __launch_bounds__(kThreads, 1)
    indexer_topk_tensor_core_kernel(IndexerParams p, const __nv_bfloat16* kib, bool vec,
                                    const int32_t* forced, float* out, float* scratch, int64_t sc_len) {
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 800  // the host pass sees the body too
  const IdxTcLayout L = idx_tc_layout(DI);
  const int64_t ld = L.ld;
  extern __shared__ __align__(16) unsigned char tc_sh[];
  __nv_bfloat16* qs = reinterpret_cast<__nv_bfloat16*>(tc_sh);
  __nv_bfloat16* ks = reinterpret_cast<__nv_bfloat16*>(tc_sh + L.keys);
  float* dots = reinterpret_cast<float*>(tc_sh + L.dots);
  float* ws = reinterpret_cast<float*>(tc_sh + L.ws);
  float* sc = sc_len > 0 ? reinterpret_cast<float*>(tc_sh + L.sc) : scratch + int64_t(blockIdx.x) * p.G;
  __shared__ int red_i[32];
  __shared__ uint32_t red_u[32];
  __shared__ int32_t tie_at[2];
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32, g8 = lane / 4, c = lane % 4;
  const int wr = (warp % 4) * 16, wk = (warp / 4) * 128;  // the warp's heads and keys of a tile
  const float qnan = __int_as_float(0x7fc00000);

  for (int64_t t = blockIdx.x; t < p.T; t += gridDim.x) {
    const int64_t n = forced ? p.G : common::row_candidates(p, t);
    const float* q0 = p.qi + t * p.Hi * p.Di;
    detail::stage_rows_bf16<kTcHeads, DI, kThreads>(
        qs, ld, p.Di, vec, [&](int r) { return r < p.Hi ? q0 + r * p.Di : nullptr; }, tid);
    if (tid < kTcHeads) ws[tid] = tid < p.Hi ? p.wt[t * p.Hi + tid] : 0.0f;
    auto load_keys = [&](int64_t g0) {
      constexpr int kChunks = DI / 8;  // 16-byte chunks of a bf16 key
      for (int e = tid; e < kTcKeys * kChunks; e += kThreads) {
        const int r = e / kChunks, ch = e % kChunks;
        const bool ok = g0 + r < n;
        detail::cp_async16(ks + r * ld + ch * 8, kib + (ok ? (g0 + r) * DI + ch * 8 : 0), ok ? 16 : 0);
      }
      detail::cp_async_commit();
    };
    const int64_t tiles = (n + kTcKeys - 1) / kTcKeys;
    if (tiles > 0) load_keys(0);
    for (int64_t i = 0; i < tiles; ++i) {
      detail::cp_async_wait<0>();
      __syncthreads();  // (A) the tile's keys (and q, wt) visible; the previous chain is done with dots
      float acc[16][4];
#pragma unroll
      for (int j = 0; j < 16; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[j][e] = 0.0f;
      if (i * kTcKeys + wk < n) {
#pragma unroll
        for (int k0 = 0; k0 < DI; k0 += 16) {
          uint32_t a[4];
          detail::ldmatrix_x4(a, &qs[(wr + lane % 16) * ld + k0 + (lane / 16) * 8]);
#pragma unroll
          for (int nj = 0; nj < 8; ++nj) {
            uint32_t r[4];
            detail::ldmatrix_x4(
                r, &ks[(wk + nj * 16 + lane % 8 + (lane / 16) * 8) * ld + k0 + ((lane / 8) % 2) * 8]);
            detail::mma_bf16_tensor_core(acc[2 * nj], a, r[0], r[1]);
            detail::mma_bf16_tensor_core(acc[2 * nj + 1], a, r[2], r[3]);
          }
        }
      }
#pragma unroll
      for (int j = 0; j < 16; ++j)
#pragma unroll
        for (int h = 0; h < 2; ++h)
          *reinterpret_cast<float2*>(&dots[(wr + g8 + 8 * h) * kTcLdd + wk + j * 8 + 2 * c]) =
              make_float2(acc[j][2 * h], acc[j][2 * h + 1]);
      __syncthreads();  // (B) the dots are complete; the key buffer is free
      if (i + 1 < tiles) load_keys((i + 1) * kTcKeys);
      const int64_t g = i * kTcKeys + tid;
      if (g < n) {
        float s = 0.0f;
        for (int h = 0; h < p.Hi; ++h)
          s = common::index_score_step(s, ws[h], dots[h * kTcLdd + tid], p.bf16_scores);
        sc[g] = common::index_score_final(s, p.bf16_scores);
      }
    }
    __syncthreads();  // the score row is complete
    if (forced) {
      for (int j = tid; j < p.k; j += kThreads) {
        const int32_t id = forced[t * p.k + j];
        out[t * p.k + j] = id >= 0 && id < p.G ? sc[id] : qnan;
      }
      __syncthreads();  // sc, qs and ws are reused by the next row
    } else {
      select_row(p, t, n, sc, red_i, red_u, tie_at);  // ends with a barrier
    }
  }
#else
  __trap();  // the host refuses devices below compute capability 8.0 before launching
#endif
}

template <int DI>
void launch_indexer_tc(const IndexerParams& p, const int32_t* forced, float* out, cudaStream_t stream) {
  int dev = 0, optin = 0;
  CUDA_CHECK(cudaGetDevice(&dev));
  CUDA_CHECK(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev));
  const IdxTcLayout L = idx_tc_layout(DI);
  const int64_t nmax = forced ? p.G : common::row_candidates(p, p.T - 1);
  const bool in_shared = L.bytes(nmax) <= size_t(optin);
  const size_t shmem = L.bytes(in_shared ? nmax : 0);
  if (shmem > size_t(optin))
    throw Error("indexer_topk (tensor_core order): Di = " + std::to_string(p.Di) + " needs " +
                std::to_string(shmem) + " bytes of shared memory per block; this device allows " +
                std::to_string(optin));
  const unsigned blocks = unsigned(p.T < 4096 ? p.T : 4096);
  detail::Scratch<float> scratch(in_shared ? 0 : int64_t(blocks) * p.G, stream);
  detail::Scratch<__nv_bfloat16> kib(p.G * DI, stream);
  detail::rows_to_bf16(p.ki, p.G, p.Di, DI, kib.get(), stream);
  const bool vec = p.Di % 4 == 0 && reinterpret_cast<uintptr_t>(p.qi) % 16 == 0;
  auto kernel = indexer_topk_tensor_core_kernel<DI>;
  CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(shmem)));
  kernel<<<blocks, kThreads, shmem, stream>>>(p, kib.get(), vec, forced, out, scratch.get(),
                                              in_shared ? nmax : 0);
  DSV4_LAUNCH_CHECK();
}

void indexer_tensor_core(const IndexerParams& p, const int32_t* forced, float* out, cudaStream_t stream) {
  detail::require_tensor_core_device();
  if (tc_padded_di(p.Di) == 64) return launch_indexer_tc<64>(p, forced, out, stream);
  launch_indexer_tc<128>(p, forced, out, stream);
}

// The limits of the tensor_core order, or nullptr.
const char* indexer_tensor_core_check(const IndexerParams& p) {
  if (!p.order.tensor_core) return nullptr;
  if (p.Hi > kTcHeads) return "Hi (the tensor_core order takes at most 64 heads)";
  if (p.Di > kTcMaxDi) return "Di (the tensor_core order takes at most 128)";
  return nullptr;
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
  require(indexer_tensor_core_check(p), "indexer_topk");
  if (p.T <= 0) return;
  if (p.order.tensor_core) return indexer_tensor_core(p, nullptr, nullptr, stream);
  if (p.G > INT32_MAX / 2) require("G is too large", "indexer_topk");
  // The most keys any row sees (visible_groups grows with t); the D buffer has this many columns.
  const int64_t nmax = common::row_candidates(p, p.T - 1);
  // A score row that does not fit in shared memory (more than 51200 visible keys) takes the row-per-block
  // kernel, which keeps such rows in global scratch.
  if (sizeof(float) * size_t(nmax) > kMaxShared) return indexer_topk_row_per_block(p, stream);
  // Chunk of query rows for one GEMM: Tc * Hi within kMaxGemmRows (the GEMM grid), at most
  // kMaxChunkRows rows, and D (Tc * Hi * nmax floats) within kDotBudget. On the fused path (steps 1
  // and 2 in one launch where the GEMM tile's 64 rows are whole tokens, detail::gemm_indexer_chain)
  // D is never written, so only the caps apply; the fused GEMM skips the tiles no row of theirs sees.
  const bool fused = detail::indexer_chain_fusable(p.Hi);
  int64_t tc = fused ? kMaxChunkRows : kDotBudget / (int64_t(p.Hi) * (nmax > 0 ? nmax : 1));
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

  detail::Scratch<float> dots(nmax > 0 && !fused ? tc * p.Hi * nmax : 0, stream);
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
      const detail::GemmShape shape{n, p.Di, OutRound::f32, p.order};
      if (fused) {
        detail::IndexerChainOut c;
        c.wt = p.wt, c.S = S.get(), c.t0 = t0, c.s0 = s0, c.G = p.G, c.pos0 = p.pos0;
        c.Hi = p.Hi, c.ratio = p.ratio, c.bf16 = p.bf16_scores;
        detail::gemm_indexer_chain(shape, g, c, stream);
        continue;
      }
      detail::gemm_group(shape, &g, 1, stream);
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
  require(indexer_tensor_core_check(p), "indexer_topk_row_per_block");
  if (p.T <= 0) return;
  if (p.order.tensor_core) return indexer_tensor_core(p, nullptr, nullptr, stream);  // one kernel per order
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
  require(indexer_tensor_core_check(p), "indexer_score_ids");
  if (p.T <= 0 || p.k <= 0) return;
  if (!score) require("score is null", "indexer_score_ids");
  if (p.order.tensor_core) return indexer_tensor_core(p, ids, score, stream);
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
