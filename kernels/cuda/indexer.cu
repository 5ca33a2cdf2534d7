// Lightning indexer scores + top-k and the attention index rows on the GPU, in the operation order
// and with the tie rule of kernels/indexer.h.
//
// indexer_topk_kernel: one block of 256 threads per query row t (grid-stride over rows).
//   1. q[t] and wt[t] are staged in shared memory; the n = min(G, (t+1)/ratio) candidate scores are
//      computed by 32 groups of 8 threads (one candidate per group at a time): the group forms
//      dot(q[t,h], ki[g]) for a tile of 4, 8 or 16 heads at once with multi_dot8 (the canonical order per
//      head, each key element loaded once per tile) and keeps the fma chain over heads in increasing
//      h. The score row lives in shared memory (global scratch when it does not fit).
//   2. Selection without sorting and without atomics. Each score maps to a 32-bit key that orders
//      like topk_row's ranking (NaN lowest, -0 == +0, larger score larger key); the k-th largest key
//      `thr` is found bit by bit (32 block-wide counts). Chosen = key > thr, plus the first
//      k - #(key > thr) candidates with key == thr in index order (smaller index first). The worst
//      chosen is the last of those ties; the best unchosen is the next tie, or else the smallest index
//      among the largest key below thr. Chosen ids are compacted in index order (ascending) with a
//      block prefix sum over contiguous index chunks.
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

// score = sum_h wt[h] * relu(dot(q[h], k)) as an fma chain over h from 0, computed by the 8 threads of
// a group; the value is valid in every lane.
__device__ __forceinline__ float index_score(const float* q, const float* w, const float* k, int Hi,
                                             int64_t Di, int block, int lane, unsigned mask) {
  float s = 0.0f;
  for (int h = 0; h < Hi; ++h)
    s = common::index_score_step(s, w[h], detail::dot8(q + h * Di, k, Di, block, lane, mask));
  return s;
}

template <int kHeadTile>
__global__ void __launch_bounds__(kThreads)
    indexer_topk_kernel(IndexerParams p, bool scores_in_shared, float* scratch) {
  extern __shared__ float sh[];
  float* qs = sh;                                                                  // [Hi * Di]
  float* ws = qs + p.Hi * p.Di;                                                    // [Hi]
  float* sc = scores_in_shared ? ws + p.Hi : scratch + int64_t(blockIdx.x) * p.G;  // [G]
  __shared__ int red_i[32];
  __shared__ uint32_t red_u[32];
  __shared__ int32_t tie_at[2];  // the r-th and (r+1)-th tie in index order (-1: none)
  const int tid = threadIdx.x, lane = tid & 7, group = tid >> 3;
  const unsigned mask = detail::group8_mask();
  const float inf = __int_as_float(0x7f800000), qnan = __int_as_float(0x7fc00000);

  for (int64_t t = blockIdx.x; t < p.T; t += gridDim.x) {
    const int64_t n = common::visible_groups(p.G, t, p.ratio);
    const int kk = int(p.k < n ? p.k : n);
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
          if (h < nh) s = common::index_score_step(s, ws[h0 + h], d[h]);
      }
      if (lane == 0) sc[c] = s;
    }
    __syncthreads();

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
    __syncthreads();  // sc, qs are reused by the next row
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
                                p.order.block, lane, mask);
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

// Shared memory of the top-k kernel: q and the head weights, plus the score row when it fits.
constexpr size_t kMaxShared = 200 * 1024;

}  // namespace

void indexer_topk(const IndexerParams& p, cudaStream_t stream) {
  require(dsv4::indexer_check(p), "indexer_topk");
  if (p.T <= 0) return;
  if (p.G > INT32_MAX / 2) require("G is too large", "indexer_topk");
  const size_t qbytes = sizeof(float) * size_t(p.Hi * p.Di + p.Hi);
  if (qbytes > kMaxShared / 2) require("Hi * Di is too large for shared memory", "indexer_topk");
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
    launch(indexer_topk_kernel<4>);
  else if (p.Hi <= 8)
    launch(indexer_topk_kernel<8>);
  else
    launch(indexer_topk_kernel<16>);
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
  if (p.kind == CompressedKind::c128 && p.ratio < 1) return "build_index: ratio < 1";
  if (p.kind == CompressedKind::c4 && p.k < 0) return "build_index: k < 0";
  if (p.T > 0 && !p.idx) return "build_index: idx is null";
  if (p.T > 0 && p.kind == CompressedKind::c4 && p.k > 0 && !p.sel) return "build_index: sel is null";
  return nullptr;
}

void build_index(const IndexBuildParams& p, cudaStream_t stream) {
  require(cuda::build_index_check(p), "build_index");
  const int64_t kw = p.T < p.W ? p.T : p.W, width = index_width(p);
  if (p.T <= 0 || width <= 0) return;
  build_index_kernel<<<detail::grid_for(p.T * width, kThreads), kThreads, 0, stream>>>(p, kw, width);
  DSV4_LAUNCH_CHECK();
}

}  // namespace dsv4::cuda
