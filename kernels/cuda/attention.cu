// Sparse attention with an attention sink on the GPU, in the operation order of kernels/attention.h.
//
// Kernel contract (sparse_attention_kernel): one block of 256 threads per (row t, tile of HT heads),
// grid-stride over those pairs.
//   1. The valid slots of idx[t] (not -1, and inside [0, N): anything else is never loaded) are
//      compacted in slot order with a block prefix sum over contiguous slot chunks.
//   2. The tile's q rows are staged in shared memory; 32 groups of 8 threads take one valid slot each
//      and form z[h][v] = scale * dot(q[t,h], kv[slot v]) for every head of the tile with multi_dot8
//      (the canonical order per head; each kv element is loaded once for all heads).
//   3. Thread h of the tile forms M = max(sink, z...) and then Z = (sum of exp_f(z - M) in slot order)
//      + exp_f(sink - M) sequentially, with the CPU's functions of kernels/detail/attention.h; the
//      exp_f terms and P = bf16(e / Z) are computed by all threads in between (element-wise).
//   4. Thread d (d = tid, tid + 256, ...) keeps one fp32 accumulator per head of the tile and runs the
//      fma chain over the valid slots in slot order, loading kv[slot][d] once for all heads of the
//      tile; o = bf16(acc). An empty row gives o = 0 and lse = sink exactly.
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
// threads per slot (multi_dot8, the canonical order).
__device__ void tile_scores(const SparseAttnParams& p, int64_t t, int h0, int nh, const int32_t* slots,
                            int nv, int tid, float* qs, float* zs) {
  const int lane = tid & 7, group = tid >> 3;
  const unsigned mask = detail::group8_mask();
  for (int64_t e = tid; e < int64_t(nh) * p.Dh; e += kThreads) qs[e] = p.q[(t * p.H + h0) * p.Dh + e];
  __syncthreads();
  for (int64_t v = group; v < nv; v += kGroups) {
    float d[kMaxHeadTile];
    detail::multi_dot8<kMaxHeadTile>(qs, p.Dh, nh, p.kv + int64_t(slots[v]) * p.Dh, p.Dh, p.order.block, lane,
                                     mask, d);
    if (lane == 0) {
#pragma unroll
      for (int h = 0; h < kMaxHeadTile; ++h)
        if (h < nh) zs[h * p.K + v] = p.scale * d[h];
    }
  }
  __syncthreads();
}

// Steps 1 and 2 of every order for the item (row t, heads h0 .. h0 + nh - 1), all threads of the
// block: the valid slots and the tile's scores. Returns nv; 0 means the row is only the sink and was
// written (o = 0, lse = sink), and the block is past a barrier.
__device__ int row_scores(const SparseAttnParams& p, int64_t t, int h0, int nh, int tid, float* zs, float* qs,
                          int32_t* slots, int* red) {
  const int nv = detail::compact_valid_slots<kThreads>(p.idx + t * p.K, p.K, p.N, tid, slots, red);
  if (nv == 0) {
    write_empty_rows(p, t, h0, nh, tid);
    __syncthreads();
    return 0;
  }
  tile_scores(p, t, h0, nh, slots, nv, tid, qs, zs);
  return nv;
}

__global__ void __launch_bounds__(kThreads) sparse_attention_kernel(SparseAttnParams p, int ht) {
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

    // 1, 2. valid slots in slot order; scores, one group per valid slot, all heads of the tile at once
    const int nv = row_scores(p, t, h0, nh, tid, zs, qs, slots, red);
    if (nv == 0) continue;  // only the sink: o = 0, lse = sink

    // 3. softmax with the sink, sequential where the CPU is
    if (tid < nh) Ms[tid] = common::attn_row_max(zs + tid * K, nv, p.sink[h0 + tid]);
    __syncthreads();
    for (int64_t q = tid; q < int64_t(nh) * nv; q += kThreads) {
      const int h = int(q / nv);
      const int64_t v = q % nv;
      zs[h * K + v] = common::attn_exp(zs[h * K + v], Ms[h]);
    }
    __syncthreads();
    if (tid < nh) {
      const float Z = common::attn_row_sum(zs + tid * K, nv, p.sink[h0 + tid], Ms[tid]);
      Zs[tid] = Z;
      if (p.lse) p.lse[t * p.H + h0 + tid] = common::attn_lse(Ms[tid], Z);
    }
    __syncthreads();
    for (int64_t q = tid; q < int64_t(nh) * nv; q += kThreads) {
      const int h = int(q / nv);
      const int64_t v = q % nv;
      zs[h * K + v] = common::attn_prob(zs[h * K + v], Zs[h]);
    }
    __syncthreads();

    // 4. o = P . kv, one accumulator per head of the tile
    for (int64_t d = tid; d < p.Dh; d += kThreads) {
      float acc[kMaxHeadTile];
#pragma unroll
      for (int h = 0; h < kMaxHeadTile; ++h) acc[h] = 0.0f;
      for (int v = 0; v < nv; ++v) {
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
    const int nv = row_scores(p, t, h0, nh, tid, zs, qs, slots, red);
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
    const int nv = row_scores(p, t, h0, nh, tid, zs, qs, slots, red);
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

void sparse_attention(const SparseAttnParams& p, cudaStream_t stream) {
  require(cuda::sparse_attention_check(p), "sparse_attention");
  if (p.T <= 0) return;
  if (p.order.tensor_core) return detail::sparse_attention_tensor_core(p, /*wgmma_allowed=*/true, stream);
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
  CUDA_CHECK(
      cudaFuncSetAttribute(sparse_attention_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(shmem)));
  sparse_attention_kernel<<<detail::grid_for(items, 1, 1 << 20), kThreads, shmem, stream>>>(p, ht);
  DSV4_LAUNCH_CHECK();
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
