// Sparse attention with an attention sink on the GPU, in the operation order of kernels/attention.h.
//
// Kernel contract (sparse_attention_kernel): one block of 256 threads per (row t, tile of HT heads),
// grid-stride over those pairs.
//   1. The valid slots of idx[t] (not -1, and inside [0, N): anything else is never loaded) are
//      compacted in slot order with a block prefix sum over contiguous slot chunks.
//   2. The tile's q rows are staged in shared memory; 32 groups of 8 threads take two valid slots each
//      (one in the split and online kernels) and form z[h][v] = scale * dot(q[t,h], kv[slot v]) for
//      every head of the tile with multi_dot8_rows (the canonical order per head; each kv element is
//      loaded once for all heads, each q element read once for the group's slots).
//   3. Thread h of the tile forms M = max(sink, z...) and then Z = (sum of exp_f(z - M) in slot order)
//      + exp_f(sink - M) sequentially, with the CPU's functions of kernels/detail/attention.h; the
//      exp_f terms and P = bf16(e / Z) are computed by all threads in between (element-wise).
//   4. Thread d (d = tid, tid + 256, ...) keeps one fp32 accumulator per head of the tile and runs the
//      fma chain over the valid slots in slot order, loading kv[slot][d] once for all heads of the
//      tile (and, where K % 4 == 0, four slots' probabilities of a head as one float4); o = bf16(acc).
//      An empty row gives o = 0 and lse = sink exactly.
//
// sparse_attention_heads_kernel (below, with its contract) takes the same exact order for rows of 32
// or more heads: 64 heads a block, the scores by the exact GEMM's lane-split tiles (lanes.cuh), so each
// kv row is loaded once for 64 heads instead of once per 8; the kernel above takes every other shape.
//
// Kernel contract (sparse_attention_split_kernel, p.splits > 0, the split-KV order of
// kernels/attention.h): the same grid, blocks and steps 1 and 2 (same helpers); then, with
// L = ceil(nv / splits) and n parts (common::attn_split_len / attn_split_parts):
//   3. Thread q (q = tid, tid + 256, ...) takes the pair (head h = q / n, part i = q % n) of the tile
//      and runs common::attn_part_softmax over the part's scores (z -> P in place), storing lse_i.
//   4. Thread h of the tile turns its n lse_i into the combine weights c_i and the row's lse with
//      common::attn_combine_weights (one thread per row: the sums are sequential in part order).
//   5. Thread e (e = tid, tid + 256, ...) takes the output element (head e / Dh, dim e % Dh) and runs
//      common::attn_split_out: the per-part fma chains and their combine, then bf16. No partial output
//      is stored: element d of o_i is formed and consumed in part order, the CPU's order.
//   Shared memory adds [ht][min(splits, K)] floats (lse_i, then c_i) to the exact kernel's.
//
// Kernel contract (sparse_attention_online_kernel, p.online_block > 0 and p.splits == 0, the online
// order of kernels/attention.h): the same grid, blocks and steps 1 and 2. Then:
//   3. Thread h of the tile runs common::attn_online_row over its scores (z -> bf16 P in place, the
//      alpha factors beside them, l and lse): the block maxima and sums are sequential, as on the CPU.
//   4. Thread e (e = tid, tid + 256, ...) takes the output element (head e / Dh, dim e % Dh) and runs
//      common::attn_online_out: the fma chain over the valid slots with the alpha rescales, / l, bf16.
//   Shared memory adds [ht][K] floats (alpha) to the exact kernel's.
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/lanes.cuh"
#include "kernels/detail/attention.h"

namespace dsv4::cuda {

namespace {

constexpr int kThreads = 256, kGroups = kThreads / 8, kMaxHeadTile = 8;
constexpr size_t kMaxShared = 200 * 1024;

// Only the sink (nv == 0): o = 0 and lse = sink for the nh heads from h0 of row t.
__device__ void write_empty_rows(const SparseAttnParams& p, int64_t t, int h0, int nh, int tid) {
  for (int64_t e = tid; e < int64_t(nh) * p.Dh; e += kThreads) p.o[(t * p.H + h0) * p.Dh + e] = 0.0f;
  if (p.lse && tid < nh) p.lse[t * p.H + h0 + tid] = p.sink[h0 + tid];
}

// Step 2, all threads of the block: q rows of the tile staged in qs [nh][Dh], then
// zs[h * K + v] = scale * dot(q[t, h0 + h], kv[slots[v]], order) for h < nh, v < nv; one group of 8
// threads per NB slots v = v0 + j kGroups at a time (multi_dot8_rows, the canonical order: each q
// element read from shared memory feeds the group's NB slots, each kv element the tile's heads).
template <int NB>
__device__ void tile_scores(const SparseAttnParams& p, int64_t t, int h0, int nh, const int32_t* slots,
                            int nv, int tid, float* qs, float* zs) {
  const int lane = tid & 7, group = tid >> 3;
  const unsigned mask = detail::group8_mask();
  for (int64_t e = tid; e < int64_t(nh) * p.Dh; e += kThreads) qs[e] = p.q[(t * p.H + h0) * p.Dh + e];
  __syncthreads();
  for (int64_t v0 = group; v0 < nv; v0 += int64_t(kGroups) * NB) {
    const float* rows[NB];
    int nb = 0;  // the valid slots of this pass are a prefix of j
#pragma unroll
    for (int j = 0; j < NB; ++j) {
      const int64_t v = v0 + int64_t(j) * kGroups;
      rows[j] = p.kv + int64_t(slots[v < nv ? v : v0]) * p.Dh;
      nb += v < nv;
    }
    float d[kMaxHeadTile * NB];
    detail::multi_dot8_rows<kMaxHeadTile, NB>(qs, p.Dh, nh, rows, nb, p.Dh, p.order.block, lane, mask, d);
    if (lane == 0) {
#pragma unroll
      for (int h = 0; h < kMaxHeadTile; ++h)
#pragma unroll
        for (int j = 0; j < NB; ++j)
          if (h < nh && j < nb) zs[h * p.K + v0 + int64_t(j) * kGroups] = p.scale * d[h * NB + j];
    }
  }
  __syncthreads();
}

// Steps 1 and 2 of every order for the item (row t, heads h0 .. h0 + nh - 1), all threads of the
// block: the valid slots and the tile's scores (NB slots a group at a time). Returns nv; 0 means the
// row is only the sink and was written (o = 0, lse = sink), and the block is past a barrier.
template <int NB>
__device__ int row_scores(const SparseAttnParams& p, int64_t t, int h0, int nh, int tid, float* zs, float* qs,
                          int32_t* slots, int* red) {
  const int nv = detail::compact_valid_slots<kThreads>(p.idx + t * p.K, p.K, p.N, tid, slots, red);
  if (nv == 0) {
    write_empty_rows(p, t, h0, nh, tid);
    __syncthreads();
    return 0;
  }
  tile_scores<NB>(p, t, h0, nh, slots, nv, tid, qs, zs);
  return nv;
}

// Step 3 of the exact order, all threads of the block: the scores z of the nh heads from h0 of row t
// become their probabilities P in place, and lse is stored. Score (h, v) is at zs[h * hs + v * vs];
// each(f) calls f(z, h) on every score of the nh heads, spread over the block's threads. M and Z are
// formed by thread h, sequentially where the CPU is (kernels/detail/attention.h); the exp_f terms and
// P by all threads in between. Ms and Zs hold nh floats.
template <typename Each>
__device__ void softmax_rows(const SparseAttnParams& p, int64_t t, int h0, int nh, int nv, float* zs,
                             int64_t hs, int64_t vs, float* Ms, float* Zs, int tid, Each each) {
  if (tid < nh) Ms[tid] = common::attn_row_max(zs + tid * hs, nv, p.sink[h0 + tid], vs);
  __syncthreads();
  each([&](float& z, int h) { z = common::attn_exp(z, Ms[h]); });
  __syncthreads();
  if (tid < nh) {
    const float Z = common::attn_row_sum(zs + tid * hs, nv, p.sink[h0 + tid], Ms[tid], vs);
    Zs[tid] = Z;
    if (p.lse) p.lse[t * p.H + h0 + tid] = common::attn_lse(Ms[tid], Z);
  }
  __syncthreads();
  each([&](float& z, int h) { z = common::attn_prob(z, Zs[h]); });
  __syncthreads();
}

// Three blocks an SM (at most 85 registers): the two slots a group of step 2 and the four slots a
// load of step 4 would otherwise take about 100 to 128 registers and halve the blocks an SM holds.
__global__ void __launch_bounds__(kThreads, 3) sparse_attention_kernel(SparseAttnParams p, int ht) {
  extern __shared__ float sh[];
  float* zs = sh;                                                        // [ht][K]: z, then e, then P
  float* qs = sh + int64_t(ht) * p.K;                                    // [ht][Dh]: q of the tile
  int32_t* slots = reinterpret_cast<int32_t*>(qs + int64_t(ht) * p.Dh);  // [K] valid kv rows, slot order
  __shared__ int red[32];
  __shared__ float Zs[kMaxHeadTile], Ms[kMaxHeadTile];
  const int tid = threadIdx.x;
  const int tiles = (p.H + ht - 1) / ht;
  const int64_t K = p.K;

  for (int64_t item = blockIdx.x; item < p.T * tiles; item += gridDim.x) {
    const int64_t t = item / tiles;
    const int h0 = int(item % tiles) * ht;
    const int nh = p.H - h0 < ht ? p.H - h0 : ht;

    // 1, 2. valid slots in slot order; scores, two valid slots a group, all heads of the tile at once
    const int nv = row_scores<2>(p, t, h0, nh, tid, zs, qs, slots, red);
    if (nv == 0) continue;  // only the sink: o = 0, lse = sink

    // 3. softmax with the sink, sequential where the CPU is
    softmax_rows(p, t, h0, nh, nv, zs, K, 1, Ms, Zs, tid, [&](auto f) {
      for (int64_t q = tid; q < int64_t(nh) * nv; q += kThreads) {
        const int h = int(q / nv);
        f(zs[h * K + q % nv], h);
      }
    });

    // 4. o = P . kv, one accumulator per head of the tile; where the rows of zs are 16-byte aligned,
    // four slots' probabilities of a head are one load
    for (int64_t d = tid; d < p.Dh; d += kThreads) {
      float acc[kMaxHeadTile];
#pragma unroll
      for (int h = 0; h < kMaxHeadTile; ++h) acc[h] = 0.0f;
      int v = 0;
      if (K % 4 == 0) {
        for (; v + 4 <= nv; v += 4) {
          float x[4];
#pragma unroll
          for (int u = 0; u < 4; ++u) x[u] = p.kv[int64_t(slots[v + u]) * p.Dh + d];
#pragma unroll
          for (int h = 0; h < kMaxHeadTile; ++h)
            if (h < nh) {
              const float4 P = *reinterpret_cast<const float4*>(zs + h * K + v);
              acc[h] = __fmaf_rn(P.x, x[0], acc[h]);
              acc[h] = __fmaf_rn(P.y, x[1], acc[h]);
              acc[h] = __fmaf_rn(P.z, x[2], acc[h]);
              acc[h] = __fmaf_rn(P.w, x[3], acc[h]);
            }
        }
      }
      for (; v < nv; ++v) {
        const float x = p.kv[int64_t(slots[v]) * p.Dh + d];
#pragma unroll
        for (int h = 0; h < kMaxHeadTile; ++h)
          if (h < nh) acc[h] = __fmaf_rn(zs[h * K + v], x, acc[h]);
      }
#pragma unroll
      for (int h = 0; h < kMaxHeadTile; ++h)
        if (h < nh) p.o[(t * p.H + h0 + h) * p.Dh + d] = num::bf16_round(acc[h]);
    }
    __syncthreads();
  }
}

// Lse_i / combine weights kept per head by the split kernel: at most min(splits, K) parts.
int64_t split_slots(const SparseAttnParams& p) {
  return p.splits <= 0 ? 0 : (p.K < p.splits ? p.K : int64_t(p.splits));
}

__global__ void __launch_bounds__(kThreads)
    sparse_attention_split_kernel(SparseAttnParams p, int ht, int64_t np) {
  extern __shared__ float sh[];
  float* zs = sh;                                                        // [ht][K]: z, then P
  float* qs = sh + int64_t(ht) * p.K;                                    // [ht][Dh]: q of the tile
  int32_t* slots = reinterpret_cast<int32_t*>(qs + int64_t(ht) * p.Dh);  // [K] valid kv rows, slot order
  float* cs = reinterpret_cast<float*>(slots + p.K);                     // [ht][np]: lse_i, then c_i
  __shared__ int red[32];
  const int tid = threadIdx.x;
  const int tiles = (p.H + ht - 1) / ht;
  const int64_t K = p.K;

  for (int64_t item = blockIdx.x; item < p.T * tiles; item += gridDim.x) {
    const int64_t t = item / tiles;
    const int h0 = int(item % tiles) * ht;
    const int nh = p.H - h0 < ht ? p.H - h0 : ht;

    // 1, 2. valid slots in slot order; scores
    const int nv = row_scores<1>(p, t, h0, nh, tid, zs, qs, slots, red);
    if (nv == 0) continue;  // only the sink: o = 0, lse = sink

    // 3. each part's softmax without the sink, one thread per (head, part)
    const int64_t L = common::attn_split_len(nv, p.splits), n = common::attn_split_parts(nv, p.splits);
    for (int64_t q = tid; q < int64_t(nh) * n; q += kThreads) {
      const int h = int(q / n);
      const int64_t i = q % n, b = i * L, len = b + L < nv ? L : nv - b;
      cs[h * np + i] = common::attn_part_softmax(zs + h * K + b, len);
    }
    __syncthreads();

    // 4. combine weights and lse, one thread per head
    if (tid < nh) {
      const float lse = common::attn_combine_weights(cs + tid * np, n, p.sink[h0 + tid]);
      if (p.lse) p.lse[t * p.H + h0 + tid] = lse;
    }
    __syncthreads();

    // 5. o, one thread per output element
    for (int64_t e = tid; e < int64_t(nh) * p.Dh; e += kThreads) {
      const int h = int(e / p.Dh);
      const int64_t d = e % p.Dh;
      p.o[(t * p.H + h0) * p.Dh + e] =
          common::attn_split_out(zs + h * K, cs + h * np, slots, nv, L, p.kv, p.Dh, d);
    }
    __syncthreads();
  }
}

__global__ void __launch_bounds__(kThreads) sparse_attention_online_kernel(SparseAttnParams p, int ht) {
  extern __shared__ float sh[];
  float* zs = sh;                                                        // [ht][K]: z, then bf16 P
  float* qs = sh + int64_t(ht) * p.K;                                    // [ht][Dh]: q of the tile
  int32_t* slots = reinterpret_cast<int32_t*>(qs + int64_t(ht) * p.Dh);  // [K] valid kv rows, slot order
  float* as = reinterpret_cast<float*>(slots + p.K);                     // [ht][K]: alpha factors
  __shared__ int red[32];
  __shared__ float ls[kMaxHeadTile];
  const int tid = threadIdx.x;
  const int tiles = (p.H + ht - 1) / ht;
  const int64_t K = p.K;

  for (int64_t item = blockIdx.x; item < p.T * tiles; item += gridDim.x) {
    const int64_t t = item / tiles;
    const int h0 = int(item % tiles) * ht;
    const int nh = p.H - h0 < ht ? p.H - h0 : ht;

    // 1, 2. valid slots in slot order; scores
    const int nv = row_scores<1>(p, t, h0, nh, tid, zs, qs, slots, red);
    if (nv == 0) continue;  // only the sink: o = 0, lse = sink

    // 3. the online scan, one thread per head
    if (tid < nh) {
      float l = 0.0f;
      const float lse = common::attn_online_row(zs + tid * K, as + tid * K, nv, p.online_block, p.sink[h0 + tid], &l);
      ls[tid] = l;
      if (p.lse) p.lse[t * p.H + h0 + tid] = lse;
    }
    __syncthreads();

    // 4. o, one thread per output element
    for (int64_t e = tid; e < int64_t(nh) * p.Dh; e += kThreads) {
      const int h = int(e / p.Dh);
      const int64_t d = e % p.Dh;
      p.o[(t * p.H + h0) * p.Dh + e] = common::attn_online_out(zs + h * K, as + h * K, slots, nv, p.kv, p.Dh, d, ls[h]);
    }
    __syncthreads();
  }
}

// ---- the 64-head kernel: the exact two-pass order for many heads ---------------------------------
namespace lanes = detail::lanes;
using detail::ceil_div;
using detail::Frag;
using detail::lanes_clear;
using detail::lanes_fma;
using detail::lanes_gm;
using detail::lanes_gn;
using detail::lanes_load;
using detail::lanes_out_col;
using detail::lanes_out_row;
using detail::lanes_reduce;
using detail::lanes_stage;
using detail::lanes_stage_chunk;
using detail::lanes_stage_row;
using detail::lanes_stash;

namespace heads {
constexpr int HT = lanes::BN;              // heads a block: the w rows of the score tiles
constexpr int SB = lanes::BM;              // slots a score tile: its x rows
constexpr int VS = 8;                      // kv rows a P·V stage
constexpr int kMaxDh = 512;                // P·V keeps up to kMaxDh / 128 float4 columns a lane
constexpr int HW = HT / (lanes::NT / 32);  // heads a warp in P·V
constexpr size_t kMaxShared = 220 * 1024;  // dynamic shared memory of a block (an H100 / H200 allows 227 KiB)
// The score stages (lanes.cuh); the P·V stages use the same memory once the scores are done.
constexpr int kStageFloats = 2 * lanes::KS * lanes::SX + 2 * lanes::KS * lanes::SW;
static_assert(2 * VS * kMaxDh <= kStageFloats, "the P.V stages fit in the score stages");
static_assert(lanes::NT == kThreads, "the block helpers above count kThreads threads");
}  // namespace heads

// A block's shared memory: the stages (kStageFloats), the scores [slot][HT] of a whole number of score
// tiles (heads_score_floats), then the K valid slots. One rule for the host's size and the kernel's pointers.
__host__ __device__ constexpr int64_t heads_score_floats(int64_t K) {
  return (K + heads::SB - 1) / heads::SB * heads::SB * heads::HT;
}
size_t heads_smem(const SparseAttnParams& p) {
  return sizeof(float) * size_t(heads::kStageFloats + heads_score_floats(p.K)) +
         sizeof(int32_t) * size_t(p.K);
}

// Kernel contract (sparse_attention_heads_kernel<CW>): the exact order of kernels/attention.h (splits
// == 0, online_block == 0) for rows of many heads. One block of 256 threads per (row t, tile of 64
// heads), grid-stride over those pairs; every value is formed by the operations of the kernel above.
//   1. The valid slots, as above (compact_valid_slots).
//   2. zs[v][h] = dot(q[t, h0 + h], kv[slot v], order) by the exact GEMM's lane-split tiles
//      (lanes.cuh): 64 slots (x rows) by the 64 heads (w rows) a tile, k = Dh in stages of 32, one
//      lane of each 8-lane chain per thread, the chains folded into zs left to right. Each kv row is
//      loaded once for all 64 heads. Slots past nv and heads past nh read the last valid row; their
//      scores are never used.
//   3. z = scale * dot, then softmax_rows (the kernel above's step 3) down the columns of zs.
//   4. Warp w takes heads 8w .. 8w + 7 of the tile, lane u the float4 columns u + 32c (c < CW =
//      ceil(Dh / 128)); each output keeps one fp32 accumulator and runs the fma chain over the valid
//      slots in slot order, kv rows staged 8 at a time in shared memory (warp w copies row w of a
//      stage); o = bf16(acc). The heads past nh run on the rows of zs past nh and are not stored.
// Needs Dh % 32 == 0, Dh <= 512, q, kv and o 16-byte aligned and the scores of 64 heads in shared
// memory (heads_fits).
template <int CW>
__global__ void __launch_bounds__(lanes::NT, 1)
    sparse_attention_heads_kernel(SparseAttnParams p, int64_t chain_steps) {
  using namespace lanes;
  using heads::HT;
  using heads::SB;
  using heads::VS;
  static_assert(VS == NT / 32, "warp w stages kv row w of a P.V stage");
  static_assert(HT == 64, "the column walks below take h = q % 64");
  extern __shared__ float4 heads_shared[];
  float* const stage = reinterpret_cast<float*>(heads_shared);
  auto Xs = reinterpret_cast<float(*)[KS][SX]>(stage);         // [2][KS][SX]: kv rows of a score tile
  auto Ws = reinterpret_cast<float(*)[KS][SW]>(&Xs[2][0][0]);  // [2][KS][SW]: q rows of the heads
  float* const zs = stage + heads::kStageFloats;               // [slot][HT]: z, then e, then P
  int32_t* const slots = reinterpret_cast<int32_t*>(zs + heads_score_floats(p.K));  // [K] valid kv rows
  __shared__ int red[32];
  __shared__ float Ms[HT], Zs[HT];
  const int tid = threadIdx.x, l = tid & 7, u = tid & 31, warp = tid >> 5;
  const int gm = lanes_gm(tid), gn = lanes_gn(tid);
  const int tiles = (p.H + HT - 1) / HT;
  const int64_t Dh = p.Dh, nst = Dh / KS;
  const int nc4 = int(Dh / 4);  // float4 columns of a row
  // The P.V columns of this lane: u + 32c, the last chunk's past nc4 clamped (computed, not stored).
  int col[CW];
#pragma unroll
  for (int c = 0; c < CW; ++c) col[c] = u + 32 * c < nc4 ? u + 32 * c : nc4 - 1;
  const bool last_col = u + 32 * (CW - 1) < nc4;  // whether the last chunk's column is this lane's own

  for (int64_t item = blockIdx.x; item < p.T * tiles; item += gridDim.x) {
    const int64_t t = item / tiles;
    const int h0 = int(item % tiles) * HT;
    const int nh = p.H - h0 < HT ? p.H - h0 : HT;

    // 1. valid slots in slot order
    const int nv = detail::compact_valid_slots<kThreads>(p.idx + t * p.K, p.K, p.N, tid, slots, red);
    if (nv == 0) {
      write_empty_rows(p, t, h0, nh, tid);
      __syncthreads();
      continue;
    }

    // 2. the dot products, tile by tile; stage s is (tile s / nst, k from (s % nst) KS)
    const int64_t nstages = (nv + SB - 1) / SB * nst;
    const float* xp[XCH];
    const float* wp[WCH];
#pragma unroll
    for (int i = 0; i < WCH; ++i) {
      const int h = lanes_stage_row(warp, u, i);
      wp[i] = p.q + (t * p.H + h0 + (h < nh ? h : nh - 1)) * Dh + 4 * lanes_stage_chunk(warp, u, i);
    }
    auto place = [&](int64_t tile) {
#pragma unroll
      for (int i = 0; i < XCH; ++i) {
        const int64_t v = tile * SB + lanes_stage_row(warp, u, i);
        xp[i] = p.kv + int64_t(slots[v < nv ? v : nv - 1]) * Dh + 4 * lanes_stage_chunk(warp, u, i);
      }
    };
    float4 xr[XCH], wr[WCH];
    auto fetch = [&](int64_t k0) {
#pragma unroll
      for (int i = 0; i < XCH; ++i) xr[i] = __ldg(reinterpret_cast<const float4*>(xp[i] + k0));
#pragma unroll
      for (int i = 0; i < WCH; ++i) wr[i] = __ldg(reinterpret_cast<const float4*>(wp[i] + k0));
    };
    place(0);
    fetch(0);
    lanes_stash(Xs[0], Ws[0], xr, wr, warp, u);
    __syncthreads();
    float acc[TM][TN];
    lanes_clear(acc);
    int64_t pos = 0;       // steps of the current chain done
    bool started = false;  // a chain of this tile has been folded into zs
    // End of a chain: its results go into zs (the first chain of a tile stores, later ones add).
    auto fold = [&](int64_t tile) {
      lanes_reduce(acc);
#pragma unroll
      for (int r = 0; r < 4; ++r) {
        float4* z = reinterpret_cast<float4*>(zs + (tile * SB + gm * TM + lanes_out_row(l, r)) * HT +
                                              gn * TN + lanes_out_col(l, 0));
        float4 v = make_float4(acc[r][0], acc[r][1], acc[r][2], acc[r][3]);
        if (started) {
          const float4 o = *z;
          v = make_float4(o.x + v.x, o.y + v.y, o.z + v.z, o.w + v.w);
        }
        *z = v;
      }
      lanes_clear(acc);
      started = true;
      pos = 0;
    };
    for (int64_t s = 0; s < nstages; ++s) {
      const int buf = int(s & 1);
      const int64_t tile = s / nst, st = s % nst;
      const bool last = st + 1 == nst;  // the tile's last stage: its chains end with it
      if (s + 1 < nstages) {
        if (last) place(tile + 1);
        fetch((last ? 0 : st + 1) * KS);  // in flight while this stage is consumed
      }
      const float* xs = &Xs[buf][l][gm * TM];
      const float* ws = &Ws[buf][l][gn * TN];
      // Every branch below is uniform over the block.
      if (pos + STEPS <= chain_steps) {  // the stage lies inside one chain (which may end with it)
        lanes_stage(acc, xs, ws);
        pos += STEPS;
        if (pos == chain_steps || last) fold(tile);
      } else {
        for (int j = 0; j < STEPS; ++j) {
          Frag f;
          lanes_load(f, xs + 8 * j * SX, ws + 8 * j * SW);
          lanes_fma(acc, f);
          if (++pos == chain_steps || (last && j + 1 == STEPS)) fold(tile);
        }
      }
      if (last) started = false;
      if (s + 1 < nstages) lanes_stash(Xs[buf ^ 1], Ws[buf ^ 1], xr, wr, warp, u);
      __syncthreads();
    }

    // 3. z = scale * dot, the softmax with the sink
    auto each = [&](auto f) {  // the scores of the nh heads, a row of zs per 4 passes of the block
      for (int64_t q = tid; q < int64_t(nv) * HT; q += kThreads) {
        const int h = int(q % HT);
        if (h < nh) f(zs[q], h);
      }
    };
    each([&](float& z, int) { z = p.scale * z; });
    __syncthreads();
    softmax_rows(p, t, h0, nh, nv, zs, 1, HT, Ms, Zs, tid, each);

    // 4. o = P . kv: the fma chains over the valid slots, kv rows staged VS at a time
    float* const vs = stage;  // [2][VS][Dh]
    float4 pre[CW];
    auto fetch_row = [&](int v0) {  // row `warp` of the stage at slot v0
      if (v0 + warp < nv) {
        const float4* row = reinterpret_cast<const float4*>(p.kv + int64_t(slots[v0 + warp]) * Dh);
#pragma unroll
        for (int c = 0; c < CW; ++c) pre[c] = __ldg(row + col[c]);
      }
    };
    auto stash_row = [&](int buf, int v0) {
      if (v0 + warp < nv) {
        float4* row = reinterpret_cast<float4*>(vs + (buf * VS + warp) * Dh);
#pragma unroll
        for (int c = 0; c < CW; ++c)
          if (c + 1 < CW || last_col) row[col[c]] = pre[c];
      }
    };
    const int hw = warp * heads::HW;  // the warp's first head
    float o[heads::HW][CW][4];
#pragma unroll
    for (int i = 0; i < heads::HW; ++i)
#pragma unroll
      for (int c = 0; c < CW; ++c)
#pragma unroll
        for (int e = 0; e < 4; ++e) o[i][c][e] = 0.0f;
    // One slot: o += P[head] * kv row, P of the warp's 8 heads as two float4.
    auto slot_step = [&](const float* prob, const float* row) {
      const float4 pa = *reinterpret_cast<const float4*>(prob),
                   pb = *reinterpret_cast<const float4*>(prob + 4);
      const float P[heads::HW] = {pa.x, pa.y, pa.z, pa.w, pb.x, pb.y, pb.z, pb.w};
#pragma unroll
      for (int c = 0; c < CW; ++c) {
        const float4 x = reinterpret_cast<const float4*>(row)[col[c]];
#pragma unroll
        for (int i = 0; i < heads::HW; ++i) {
          o[i][c][0] = __fmaf_rn(P[i], x.x, o[i][c][0]);
          o[i][c][1] = __fmaf_rn(P[i], x.y, o[i][c][1]);
          o[i][c][2] = __fmaf_rn(P[i], x.z, o[i][c][2]);
          o[i][c][3] = __fmaf_rn(P[i], x.w, o[i][c][3]);
        }
      }
    };
    static_assert(heads::HW == 8, "two float4 of P a slot");
    fetch_row(0);
    stash_row(0, 0);
    __syncthreads();
    for (int v0 = 0; v0 < nv; v0 += VS) {
      const int buf = (v0 / VS) & 1;
      if (v0 + VS < nv) fetch_row(v0 + VS);
      const float* rows = vs + buf * VS * Dh;
      const float* prob = zs + int64_t(v0) * HT + hw;
      if (nv - v0 >= VS) {
#pragma unroll
        for (int vv = 0; vv < VS; ++vv) slot_step(prob + vv * HT, rows + vv * Dh);
      } else {
        for (int vv = 0; vv < nv - v0; ++vv) slot_step(prob + vv * HT, rows + vv * Dh);
      }
      if (v0 + VS < nv) stash_row(buf ^ 1, v0 + VS);
      __syncthreads();
    }
#pragma unroll
    for (int i = 0; i < heads::HW; ++i) {
      if (hw + i >= nh) continue;
      float4* out = reinterpret_cast<float4*>(p.o + (t * p.H + h0 + hw + i) * Dh);
#pragma unroll
      for (int c = 0; c < CW; ++c)
        if (c + 1 < CW || last_col)
          out[col[c]] = make_float4(num::bf16_round(o[i][c][0]), num::bf16_round(o[i][c][1]),
                                    num::bf16_round(o[i][c][2]), num::bf16_round(o[i][c][3]));
    }
  }
}

bool aligned16(const void* ptr) {
  return reinterpret_cast<uintptr_t>(ptr) % 16 == 0;
}

// Whether sparse_attention_heads_kernel takes the call: the exact two-pass order, at least 32 heads
// (a tile of 64 is then at least half used), whole stages of Dh, aligned rows, and the scores of 64
// heads beside the stages in one block's shared memory.
bool heads_fits(const SparseAttnParams& p) {
  if (p.order.tensor_core || p.splits > 0 || p.online_block > 0) return false;
  if (p.H < 32 || p.Dh % lanes::KS != 0 || p.Dh > heads::kMaxDh || p.K <= 0) return false;
  if (!aligned16(p.q) || !aligned16(p.kv) || !aligned16(p.o)) return false;
  return heads_smem(p) <= heads::kMaxShared;
}

// The online kernel's extra shared memory per head (alpha), in floats.
int64_t online_per_head(const SparseAttnParams& p) {
  return p.splits <= 0 && p.online_block > 0 ? p.K : 0;
}

// Heads per block: as many as fit (at most 8) next to the slot list in shared memory (with the split
// kernel's lse_i / c_i when p.splits > 0).
int head_tile(const SparseAttnParams& p) {
  const int64_t per_head = sizeof(float) * (p.K + p.Dh + split_slots(p) + online_per_head(p)),
                fixed = sizeof(int32_t) * p.K;
  int ht = kMaxHeadTile < p.H ? kMaxHeadTile : p.H;
  while (ht > 1 && size_t(fixed + ht * per_head) > kMaxShared) --ht;
  return ht;
}

}  // namespace

const char* sparse_attention_check(const SparseAttnParams& p) {
  if (const char* why = common::sparse_attention_check_dims(p)) return why;
  if (p.N > INT32_MAX) return "N";
  if (p.order.tensor_core) {
    if (const char* why = detail::sparse_attention_tensor_core_check(p)) return why;
    return common::sparse_attention_check_pointers(p);
  }
  if (size_t(p.K) * 8 + size_t(p.Dh) * 4 + size_t(split_slots(p) + online_per_head(p)) * 4 >
      kMaxShared)
    return "K or Dh (too large for one block)";
  return common::sparse_attention_check_pointers(p);
}

namespace {

// The exact orders; heads_allowed: the 64-head kernel where it fits (heads_fits).
void exact_attention(const SparseAttnParams& p, bool heads_allowed, cudaStream_t stream) {
  const int ht = head_tile(p);
  const int64_t np = split_slots(p);
  const size_t shmem = sizeof(float) * size_t(ht) * size_t(p.K + p.Dh + np + online_per_head(p)) +
                       sizeof(int32_t) * size_t(p.K);
  const int64_t items = p.T * ((p.H + ht - 1) / ht);
  if (p.splits > 0) {
    CUDA_CHECK(cudaFuncSetAttribute(sparse_attention_split_kernel,
                                    cudaFuncAttributeMaxDynamicSharedMemorySize, int(shmem)));
    sparse_attention_split_kernel<<<detail::grid_for(items, 1, 1 << 20), kThreads, shmem, stream>>>(p, ht,
                                                                                                    np);
    DSV4_LAUNCH_CHECK();
    return;
  }
  if (p.online_block > 0) {
    CUDA_CHECK(cudaFuncSetAttribute(sparse_attention_online_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                    int(shmem)));
    sparse_attention_online_kernel<<<detail::grid_for(items, 1, 1 << 20), kThreads, shmem, stream>>>(p, ht);
    DSV4_LAUNCH_CHECK();
    return;
  }
  if (heads_allowed && heads_fits(p)) {
    const size_t bytes = heads_smem(p);
    const int64_t pairs = p.T * ceil_div(p.H, heads::HT);
    const int64_t wave = detail::device_attribute(cudaDevAttrMultiProcessorCount);  // one block an SM
    const unsigned grid = unsigned(pairs < wave ? pairs : wave);
    const int64_t chain_steps = (p.order.block > 0 && p.Dh > p.order.block) ? p.order.block / 8 : INT64_MAX;
    auto launch = [&](auto kernel) {
      CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(bytes)));
      kernel<<<grid, kThreads, bytes, stream>>>(p, chain_steps);
      DSV4_LAUNCH_CHECK();
    };
    switch (ceil_div(p.Dh, 128)) {  // float4 columns a lane in P.V
      case 1:
        return launch(sparse_attention_heads_kernel<1>);
      case 2:
        return launch(sparse_attention_heads_kernel<2>);
      case 3:
        return launch(sparse_attention_heads_kernel<3>);
      default:
        return launch(sparse_attention_heads_kernel<4>);
    }
  }
  CUDA_CHECK(
      cudaFuncSetAttribute(sparse_attention_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(shmem)));
  sparse_attention_kernel<<<detail::grid_for(items, 1, 1 << 20), kThreads, shmem, stream>>>(p, ht);
  DSV4_LAUNCH_CHECK();
}

}  // namespace

void sparse_attention(const SparseAttnParams& p, cudaStream_t stream) {
  require(cuda::sparse_attention_check(p), "sparse_attention");
  if (p.T <= 0) return;
  if (p.order.tensor_core) return detail::sparse_attention_tensor_core(p, /*wgmma_allowed=*/true, stream);
  exact_attention(p, /*heads_allowed=*/true, stream);
}

void sparse_attention_small_tiles(const SparseAttnParams& p, cudaStream_t stream) {
  require(cuda::sparse_attention_check(p), "sparse_attention");
  if (p.order.tensor_core) throw Error("sparse_attention_small_tiles: the call is in the tensor_core order");
  if (p.T > 0) exact_attention(p, /*heads_allowed=*/false, stream);
}

bool sparse_attention_uses_head_tiles(const SparseAttnParams& p) {
  return heads_fits(p);
}

void sparse_attention_mma_sync(const SparseAttnParams& p, cudaStream_t stream) {
  require(cuda::sparse_attention_check(p), "sparse_attention");
  if (!p.order.tensor_core) throw Error("sparse_attention_mma_sync: the call is not in the tensor_core order");
  if (p.T > 0) detail::sparse_attention_tensor_core(p, /*wgmma_allowed=*/false, stream);
}

bool sparse_attention_uses_wgmma(const SparseAttnParams& p) {
  return p.order.tensor_core && detail::sparse_attention_tensor_core_uses_wgmma(p);
}

}  // namespace dsv4::cuda
