// Backward of the sparse attention with a sink on the GPU (kernels/grad.h SparseAttnBwdParams), bit for
// bit the CPU reference kernels/cpu/grad_attention.cpp: the same two passes, the arithmetic of
// kernels/detail/grad_attention.h, the canonical dots split over groups of 8 threads (dot8,
// multi_dot8 of kernels/cuda/common.cuh, equal to dsv4::dot bit for bit).
//
// Pass 1, rows_kernel: one block of 256 threads per (row t, tile of HT <= 8 heads), grid-stride.
//   1. The valid slots of idx[t] (inside [0, N); anything else is a hole, never loaded) are compacted
//      in slot order (their kv row and their slot j) with a block prefix sum over contiguous chunks.
//   2. q and dO of the tile are staged in shared memory; group h of 8 threads forms
//      Δ_h = dot(o[t,h], dO[t,h]).
//   3. One group of 8 threads per valid slot v forms dot(q[t,h], kv) and dot(dO[t,h], kv) for every
//      head of the tile (multi_dot8: each kv element loaded once for all heads); lane h of the group
//      then forms z, P = exp_f(z - lse), dz for head h with the CPU's functions and writes P and
//      scale * dz to the [T * K, H] scratch at flat slot t * K + j (holes are never written or read).
//   4. Thread d keeps one accumulator per head and runs acc = fma(dz_v, kv[slot v][d], acc) over the
//      valid slots in slot order; dq = scale * acc (an empty row gives scale * 0, as on the CPU).
//   5. Thread h of the tile writes the row's sink term Δ_h * exp_f(sink - lse) to the [T, H] scratch.
//
// The inverse map of idx (kernels/cuda/inverse_map.cu): for each kv row its flat slots tj = t * K + j
// in increasing order, i.e. t increasing then j increasing, the CPU's CSR order, without atomics.
//
// Pass 2, dkv_kernel: one block per kv row n (grid-stride), one thread per column d (strided):
//   acc = 0, then acc = acc + attn_bwd_kv_term(scale * dz, q[t,h,d], P, dO[t,h,d]) over the row's
//   slots in key order and the heads h increasing inside each slot; dkv[n, d] = acc. Rows without a
//   slot get 0. This is common::attn_bwd_kv_row's loop for one column, its accumulator in a register.
//
// sink_kernel: one thread per head, common::attn_bwd_sink (sequential over t increasing).
//
// idx values outside [-1, N) are not detected on the device (that would need the data on the host):
// they are treated as holes, as the forward kernel does. The CPU check rejects them.
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/grad.h"
#include "kernels/cuda/grad_common.cuh"
#include "kernels/detail/grad_attention.h"

namespace dsv4::cuda {

namespace {

constexpr int kThreads = 256, kGroups = kThreads / 8, kMaxHeadTile = 8;
constexpr size_t kMaxShared = 200 * 1024;

// ---- pass 1 -----------------------------------------------------------------------------------------

// All threads of the block: the valid slots of idx [K] (inside [0, N)) compacted in slot order, their
// kv rows into rows and their slot indices into js; returns their count nv (the same in every thread).
__device__ int compact_valid_slots(const int32_t* idx, int64_t K, int64_t N, int tid, int32_t* rows,
                                   int32_t* js, int* red) {
  const int64_t chunk = (K + kThreads - 1) / kThreads, lo = tid * chunk, hi = lo + chunk < K ? lo + chunk : K;
  int mine = 0;
  for (int64_t j = lo; j < hi; ++j) mine += idx[j] >= 0 && idx[j] < N;
  int nv = 0;
  int pos = detail::block_exclusive_scan(mine, red, &nv);
  for (int64_t j = lo; j < hi; ++j)
    if (idx[j] >= 0 && idx[j] < N) {
      rows[pos] = idx[j];
      js[pos++] = int32_t(j);
    }
  __syncthreads();
  return nv;
}

// P, sdz: [T * K, H] scratch; ds: [T, H] the rows' sink terms.
__global__ void __launch_bounds__(kThreads)
    rows_kernel(SparseAttnBwdParams p, int ht, float* P, float* sdz, float* ds) {
  extern __shared__ float sh[];
  const int64_t K = p.K, Dh = p.Dh;
  float* qs = sh;                                                     // [ht][Dh] q of the tile
  float* dOs = qs + int64_t(ht) * Dh;                                 // [ht][Dh] dO of the tile
  float* dzs = dOs + int64_t(ht) * Dh;                                // [ht][K] dz per valid slot
  int32_t* rows = reinterpret_cast<int32_t*>(dzs + int64_t(ht) * K);  // [K] kv rows, slot order
  int32_t* js = rows + K;                                             // [K] their slots j
  __shared__ int red[32];
  __shared__ float deltas[kMaxHeadTile];
  const int tid = threadIdx.x, lane = tid & 7, group = tid >> 3;
  const unsigned mask = detail::group8_mask();
  const int tiles = (p.H + ht - 1) / ht;

  for (int64_t item = blockIdx.x; item < p.T * tiles; item += gridDim.x) {
    const int64_t t = item / tiles;
    const int h0 = int(item % tiles) * ht;
    const int nh = p.H - h0 < ht ? p.H - h0 : ht;
    const int64_t row0 = t * p.H + h0;  // (t, h0) in [T, H]

    // 1. valid slots in slot order
    const int nv = compact_valid_slots(p.idx + t * K, K, p.N, tid, rows, js, red);

    // 2. q and dO of the tile; Δ per head
    for (int64_t e = tid; e < int64_t(nh) * Dh; e += kThreads) {
      qs[e] = p.q[row0 * Dh + e];
      dOs[e] = p.dO[row0 * Dh + e];
    }
    __syncthreads();
    if (group < nh) {  // uniform over the group
      const float delta =
          detail::dot8(p.o + (row0 + group) * Dh, dOs + int64_t(group) * Dh, Dh, p.order.block, lane, mask);
      if (lane == 0) deltas[group] = delta;
    }
    __syncthreads();

    // 3. per valid slot: z, P, dz for every head of the tile
    for (int64_t v = group; v < nv; v += kGroups) {
      const float* kvr = p.kv + int64_t(rows[v]) * Dh;
      float zq[kMaxHeadTile], zo[kMaxHeadTile];
      detail::multi_dot8<kMaxHeadTile>(qs, Dh, nh, kvr, Dh, p.order.block, lane, mask, zq);
      detail::multi_dot8<kMaxHeadTile>(dOs, Dh, nh, kvr, Dh, p.order.block, lane, mask, zo);
      const int64_t flat = (t * K + js[v]) * p.H + h0;
#pragma unroll
      for (int h = 0; h < kMaxHeadTile; ++h) {
        if (h < nh && h == lane) {
          const float z = p.scale * zq[h];
          const float pr = common::attn_bwd_prob(z, p.lse[row0 + h]);
          const float dz = common::attn_bwd_dz(pr, zo[h], deltas[h]);
          dzs[h * K + v] = dz;
          P[flat + h] = pr;
          sdz[flat + h] = p.scale * dz;
        }
      }
    }
    __syncthreads();

    // 4. dq = scale * (fma chain of dz_v * kv[slot v] in slot order), one accumulator per head
    for (int64_t d = tid; d < Dh; d += kThreads) {
      float acc[kMaxHeadTile];
#pragma unroll
      for (int h = 0; h < kMaxHeadTile; ++h) acc[h] = 0.0f;
      for (int v = 0; v < nv; ++v) {
        const float x = p.kv[int64_t(rows[v]) * Dh + d];
#pragma unroll
        for (int h = 0; h < kMaxHeadTile; ++h)
          if (h < nh) acc[h] = __fmaf_rn(dzs[h * K + v], x, acc[h]);
      }
#pragma unroll
      for (int h = 0; h < kMaxHeadTile; ++h)
        if (h < nh) p.dq[(row0 + h) * Dh + d] = p.scale * acc[h];
    }

    // 5. the row's sink term
    if (tid < nh) ds[row0 + tid] = deltas[tid] * common::attn_bwd_prob(p.sink[h0 + tid], p.lse[row0 + tid]);
    __syncthreads();
  }
}

// Heads per block: as many as fit (at most 8) next to the slot lists in shared memory.
int head_tile(const SparseAttnBwdParams& p) {
  const int64_t per_head = sizeof(float) * (p.K + 2 * p.Dh), fixed = 2 * sizeof(int32_t) * p.K;
  int ht = kMaxHeadTile < p.H ? kMaxHeadTile : p.H;
  while (ht > 1 && size_t(fixed + ht * per_head) > kMaxShared) --ht;
  return ht;
}

// ---- pass 2 and the sink ----------------------------------------------------------------------------

__global__ void dkv_kernel(SparseAttnBwdParams p, const uint64_t* keys, const int64_t* begin, const float* P,
                           const float* sdz) {
  const int64_t Dh = p.Dh, K = p.K;
  const int H = p.H;
  for (int64_t n = blockIdx.x; n < p.N; n += gridDim.x) {
    const int64_t b = begin[n], e = begin[n + 1];
    for (int64_t d = threadIdx.x; d < Dh; d += blockDim.x) {
      float acc = 0.0f;
      for (int64_t s = b; s < e; ++s) {
        const int64_t tj = int64_t(keys[s] & 0xffffffffull), t = tj / K;
        for (int h = 0; h < H; ++h) {
          const int64_t th = (t * H + h) * Dh + d;
          acc = acc + common::attn_bwd_kv_term(sdz[tj * H + h], p.q[th], P[tj * H + h], p.dO[th]);
        }
      }
      p.dkv[n * Dh + d] = acc;
    }
  }
}

__global__ void sink_kernel(const float* ds, int64_t T, int H, float* dsink) {
  const int h = int(blockIdx.x) * blockDim.x + threadIdx.x;
  if (h < H) dsink[h] = common::attn_bwd_sink(ds, T, H, h, dsink[h]);
}

// Shape-only validation (the CPU check also scans idx, which lives on the device here).
const char* check(const SparseAttnBwdParams& p) {
  if (const char* why = common::sparse_attention_backward_check_dims(p)) return why;
  if (p.N > INT32_MAX) return "sparse_attention_backward: N must be below 2^31";
  if (p.K > 0 && p.T > int64_t(0xffffffffll) / p.K)
    return "sparse_attention_backward: T * K must be below 2^32";
  if (size_t(p.K) * 12 + size_t(p.Dh) * 8 > kMaxShared)
    return "sparse_attention_backward: K or Dh too large for one block";
  return common::sparse_attention_backward_check_pointers(p);
}

}  // namespace

void sparse_attention_backward(const SparseAttnBwdParams& p, cudaStream_t stream) {
  require(check(p), "sparse_attention_backward");
  const int64_t TK = p.T * p.K, TH = p.T * p.H;
  const bool any_slot = TK > 0 && p.N > 0;
  if (p.N > 0 && !any_slot) CUDA_CHECK(cudaMemsetAsync(p.dkv, 0, size_t(p.N * p.Dh) * sizeof(float), stream));
  if (p.T == 0) return;

  // pass 1
  detail::Scratch<float> P(TK * p.H, stream), sdz(TK * p.H, stream), ds(TH, stream);
  const int ht = head_tile(p);
  const size_t shmem =
      sizeof(float) * size_t(ht) * size_t(p.K + 2 * p.Dh) + 2 * sizeof(int32_t) * size_t(p.K);
  CUDA_CHECK(cudaFuncSetAttribute(rows_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(shmem)));
  const int64_t items = p.T * ((p.H + ht - 1) / ht);
  rows_kernel<<<detail::grid_for(items, 1, 1 << 20), kThreads, shmem, stream>>>(p, ht, P.get(), sdz.get(),
                                                                                ds.get());
  DSV4_LAUNCH_CHECK();

  // the inverse map, then pass 2
  if (any_slot) {
    const int64_t n = detail::inverse_map_size(TK);
    detail::Scratch<uint64_t> keys(n, stream);
    detail::Scratch<int64_t> begin(p.N + 1, stream);
    detail::inverse_map(p.idx, TK, p.N, keys.get(), begin.get(), stream);
    const int kv_threads = p.Dh >= 256 ? 256 : int((p.Dh + 31) / 32 * 32);
    dkv_kernel<<<detail::grid_for(p.N, 1, 1 << 20), kv_threads, 0, stream>>>(p, keys.get(), begin.get(),
                                                                             P.get(), sdz.get());
    DSV4_LAUNCH_CHECK();
  }

  if (p.dsink) {
    sink_kernel<<<unsigned(detail::ceil_div(p.H, 128)), 128, 0, stream>>>(ds.get(), p.T, p.H, p.dsink);
    DSV4_LAUNCH_CHECK();
  }
}

}  // namespace dsv4::cuda
