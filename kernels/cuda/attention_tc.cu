// Sparse attention with an attention sink in the `tensor_core` order (the fast numerics of
// docs/NUMERICS.md; kernels/attention.h "tensor_core order"): the scores and P·V as bf16 tensor-core
// products with fp32 accumulation, an online softmax over blocks of 64 valid slots.
//
// The order, for one row t and head h, with the nv valid slots of idx[t] (not -1, inside [0, N)) in
// slot order v = 0 .. nv-1:
//   q and the kv rows are rounded to bf16; Dh is zero-padded to DP (64, 128, 256 or 512: the smallest
//   that holds it).
//   The valid slots are cut into blocks of 64 from v = 0: [64b, min(64b + 64, nv)). For each block b
//   in order, with m = -inf and l = 0 before the first:
//     s_v  = q . kv_v: DP / 16 mma.sync.m16n8k16 steps (k = 0..15, 16..31, ...) into one fp32
//            accumulator from 0; z_v = scale * s_v (one fp32 multiply)
//     mb   = max over the block's z (`z > m` scans: a NaN never becomes the maximum);
//            mn = max(m, mb); alpha = exp_fast_nonpos(m - mn) (0 for the first block)
//     p_v  = exp_fast_nonpos(z_v - mn) (kernels/numerics: e^x within 1 ulp, 0 below -87); the block's
//            sum s = (sum over its first 32 slots) + (sum over its last 32), each half summed per row in the
//            fixed order of the kernel's fragments (a thread's eight values in order, then the four threads
//            of a row by xor-1 then xor-2 butterflies)
//     l    = l * alpha + s
//     acc  = acc * alpha, then acc += bf16(p_v) . kv_v by mma over the block's slots in steps of 16
//            (a step past nv is skipped; the slots of a partial step past nv enter as 0 · 0)
//     m    = mn
//   then l = l + exp_f(sink[h] - m); o[t,h,d] = bf16(acc[d] / l); lse[t,h] = m + log_f(l).
//   An empty row gives o = 0 and lse = sink[h] exactly.
// What one mma does inside is the hardware's, fixed per architecture (sm_80 and newer). A row's
// result depends only on q[t,h], sink[h], scale and the values of its valid kv rows in slot order:
// not on T, the other rows or heads, where -1 padding sits, the grid or the number of SMs (no split
// over slots, no atomics), so run to run, batch composition and a decode step (a row of a prefill)
// give the same bytes on one architecture. It is not the exact orders' arithmetic: the CPU cannot
// compute it (kernels/cpu refuses the order).
//
// Kernel (sparse_attention_tensor_core_kernel): one block of 256 threads (8 warps) per (row t, tile of
// 64 heads), grid-stride over those pairs. Shared memory holds the tile's q (bf16, [64][DP + 8]), one
// or two kv blocks ([64][DP + 8], double-buffered when the device has the room), the block's bf16 P
// ([64][72]), the compacted slot list and the row statistics of the two slot halves.
//   1. The valid slots are compacted in slot order (common.cuh compact_valid_slots); q is staged.
//   2. kv block b + 1 is requested (cp.async from a bf16 copy of kv made once per call, when the call
//      touches at least half of kv's rows; otherwise read directly from the fp32 rows and converted)
//      while block b is consumed.
//   3. Warp w computes the scores of heads 16 (w % 4) .. +15 against the block's slot half w / 4
//      (4 n-tiles of 8), masks slots past nv with -inf and publishes its per-row maxima; every warp
//      then forms mn and alpha for its rows, writes bf16(p) to shared memory and publishes its
//      per-row sums.
//   4. Warp w accumulates P·V for heads 16 (w % 4) .. +15 and output columns (w / 4) DP/2 .. +DP/2
//      (128 fp32 accumulators per thread at DP = 512) from P and the kv block (ldmatrix .trans).
//   5. After the last block every warp divides and stores its outputs; warps 0-3 store the lse.
// Functions named *tensor_core* are the only ones scripts/kernel-audit.py lets use tensor cores.
#include <cuda_bf16.h>

#include <string>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/mma.cuh"
#include "kernels/cuda/wgmma.cuh"
#include "kernels/detail/attention.h"

namespace dsv4::cuda {
namespace {

constexpr int kThreads = 256;  // 8 warps
constexpr int kRows = 64;      // heads per block (zero rows past H)
constexpr int kSlots = 64;     // valid slots per kv block
constexpr int kLdp = kSlots + 8;  // bf16 per row of P in shared memory
constexpr int kMaxDp = 512;

// Shared-memory layout of a block, in bytes, for padded head dimension DP and `bufs` kv buffers.
struct TcLayout {
  int64_t ld;  // bf16 per staged q / kv row: DP + 8 (the eight rows an ldmatrix phase reads fall in
               // distinct banks)
  size_t kv, p, red, slots;
  size_t bytes(int64_t K) const { return slots + sizeof(int32_t) * size_t(K); }
};
__host__ __device__ inline TcLayout tc_layout(int dp, int bufs) {
  TcLayout L{};
  L.ld = dp + 8;
  L.kv = sizeof(__nv_bfloat16) * size_t(kRows) * size_t(L.ld);  // q first, at 0
  L.p = L.kv + sizeof(__nv_bfloat16) * size_t(bufs) * size_t(kSlots) * size_t(L.ld);
  L.red = L.p + sizeof(__nv_bfloat16) * size_t(kRows) * kLdp;
  L.slots = L.red + sizeof(float) * 4 * kRows;  // max and sum of the two slot halves
  return L;
}

int padded_dh(int64_t Dh) {
  return Dh <= 64 ? 64 : Dh <= 128 ? 128 : Dh <= 256 ? 256 : 512;
}

// One (row t, tile of 64 heads) item of the grid-stride loop: its valid slots compacted into `slots` by
// the block's Threads threads (in slot order); a row with none gets o = 0 and lse = sink here (nv = 0).
struct TileItem {
  int64_t t;
  int h0, nh, nv;
};
template <int Threads>
__device__ TileItem begin_item(const SparseAttnParams& p, int64_t item, int tiles, int tid, int32_t* slots,
                               int* scan_red) {
  TileItem it;
  it.t = item / tiles;
  it.h0 = int(item % tiles) * kRows;
  it.nh = p.H - it.h0 < kRows ? p.H - it.h0 : kRows;
  it.nv = detail::compact_valid_slots<Threads>(p.idx + it.t * p.K, p.K, p.N, tid, slots, scan_red);
  if (it.nv == 0) {  // only the sink
    for (int64_t e = tid; e < int64_t(it.nh) * p.Dh; e += Threads) p.o[(it.t * p.H + it.h0) * p.Dh + e] = 0.0f;
    if (p.lse && tid < it.nh) p.lse[it.t * p.H + it.h0 + tid] = p.sink[it.h0 + tid];
  }
  return it;
}

template <int DP, bool BF16KV>
__global__ void __launch_bounds__(kThreads, 1)
    sparse_attention_tensor_core_kernel(SparseAttnParams p, const __nv_bfloat16* kvb, int bufs, bool vec) {
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 800  // the host pass sees the body too
  using detail::ldmatrix_x4;
  using detail::mma_bf16_tensor_core;
  using detail::pack_bf16;
  constexpr int kHalf = DP / 2, kNt = kHalf / 8;  // output columns of a warp, in n-tiles of 8
  const TcLayout L = tc_layout(DP, bufs);
  const int64_t ld = L.ld;
  extern __shared__ __align__(16) unsigned char sh[];
  __nv_bfloat16* qs = reinterpret_cast<__nv_bfloat16*>(sh);           // [kRows][ld]
  __nv_bfloat16* kvs = reinterpret_cast<__nv_bfloat16*>(sh + L.kv);   // [bufs][kSlots][ld]
  __nv_bfloat16* ps = reinterpret_cast<__nv_bfloat16*>(sh + L.p);     // [kRows][kLdp]
  float* red_max = reinterpret_cast<float*>(sh + L.red);              // [2 halves][kRows]
  float* red_sum = red_max + 2 * kRows;                               // [2 halves][kRows]
  int32_t* slots = reinterpret_cast<int32_t*>(sh + L.slots);          // [K] valid kv rows, slot order
  __shared__ int scan_red[32];

  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const int g = lane / 4, c = lane % 4;
  const int wr = (warp % 4) * 16;  // the warp's 16 heads of the tile
  const int half = warp / 4;       // its slot half of a kv block (scores) and column half (output)
  const int tiles = (p.H + kRows - 1) / kRows;
  const float neg_inf = num::f32_from_bits(0xff800000u);

  for (int64_t item = blockIdx.x; item < p.T * tiles; item += gridDim.x) {
    // 1. valid slots in slot order; q of the tile as bf16
    const auto [t, h0, nh, nv] = begin_item<kThreads>(p, item, tiles, tid, slots, scan_red);
    if (nv == 0) continue;
    const float* q0 = p.q + (t * p.H + h0) * p.Dh;
    detail::stage_rows_bf16<kRows, DP, kThreads>(qs, ld, p.Dh, vec, [&](int r) { return r < nh ? q0 + r * p.Dh : nullptr; }, tid);

    // 2. kv block b (valid slots [64b, 64b + 64)) into buffer buf; rows past nv are zeros
    auto load_kv = [&](int b, int buf) {
      __nv_bfloat16* dst = kvs + int64_t(buf) * kSlots * ld;
      const int v0 = b * kSlots;
      if constexpr (BF16KV) {
        constexpr int kChunks = DP / 8;  // 16-byte chunks of a bf16 row
        for (int e = tid; e < kSlots * kChunks; e += kThreads) {
          const int r = e / kChunks, ch = e % kChunks;
          const bool ok = v0 + r < nv;
          detail::cp_async16(dst + r * ld + ch * 8, kvb + (ok ? int64_t(slots[v0 + r]) * DP + ch * 8 : 0),
                             ok ? 16 : 0);
        }
        detail::cp_async_commit();
      } else {
        detail::stage_rows_bf16<kSlots, DP, kThreads>(dst, ld, p.Dh, vec,
                       [&](int r) { return v0 + r < nv ? p.kv + int64_t(slots[v0 + r]) * p.Dh : nullptr; }, tid);
      }
    };

    float acc[kNt][4];
#pragma unroll
    for (int j = 0; j < kNt; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[j][e] = 0.0f;
    float m[2] = {neg_inf, neg_inf}, l[2] = {0.0f, 0.0f};  // rows wr + g and wr + g + 8
    const int nb = (nv + kSlots - 1) / kSlots;
    const bool prefetch = bufs > 1;
    if (prefetch) load_kv(0, 0);
    for (int b = 0; b < nb; ++b) {
      const int buf = prefetch ? (b & 1) : 0;
      if (!prefetch) {
        load_kv(b, 0);
        if constexpr (BF16KV) detail::cp_async_wait<0>();
      } else if (b + 1 < nb) {
        load_kv(b + 1, buf ^ 1);
        if constexpr (BF16KV) detail::cp_async_wait<1>();
      } else if constexpr (BF16KV) {
        detail::cp_async_wait<0>();
      }
      __syncthreads();  // (A) block b's kv (and, for b = 0, q) visible to every warp
      const __nv_bfloat16* kvt = kvs + int64_t(buf) * kSlots * ld;
      const int vb = b * kSlots, nvb = nv - vb < kSlots ? nv - vb : kSlots;

      // 3. scores of the warp's heads against its slot half: s[j] is n-tile j (slots 8j .. 8j+7)
      float s[4][4];
#pragma unroll
      for (int j = 0; j < 4; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) s[j][e] = 0.0f;
      if (half * 32 < nvb) {
#pragma unroll 4
        for (int k0 = 0; k0 < DP; k0 += 16) {
          uint32_t a[4];
          ldmatrix_x4(a, &qs[(wr + lane % 16) * ld + k0 + (lane / 16) * 8]);
#pragma unroll
          for (int nj = 0; nj < 2; ++nj) {
            uint32_t r[4];
            ldmatrix_x4(r, &kvt[(half * 32 + nj * 16 + lane % 8 + (lane / 16) * 8) * ld + k0 + ((lane / 8) % 2) * 8]);
            mma_bf16_tensor_core(s[2 * nj], a, r[0], r[1]);
            mma_bf16_tensor_core(s[2 * nj + 1], a, r[2], r[3]);
          }
        }
      }
      // z = scale * s (slots past nv: -inf) and the half's maximum per row
      float mx[2] = {neg_inf, neg_inf};
#pragma unroll
      for (int j = 0; j < 4; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int v = vb + half * 32 + j * 8 + 2 * c + (e & 1);
          s[j][e] = v < nv ? p.scale * s[j][e] : neg_inf;
          if (s[j][e] > mx[e / 2]) mx[e / 2] = s[j][e];
        }
#pragma unroll
      for (int i = 0; i < 2; ++i)
#pragma unroll
        for (int o = 1; o <= 2; o <<= 1) {
          const float x = __shfl_xor_sync(0xffffffffu, mx[i], o);
          if (x > mx[i]) mx[i] = x;
        }
      if (c == 0) red_max[half * kRows + wr + g] = mx[0], red_max[half * kRows + wr + g + 8] = mx[1];
      __syncthreads();  // (B)
      float alpha[2], mn[2], sum[2] = {0.0f, 0.0f};
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        const int r = wr + g + 8 * i;
        float mb = red_max[r];
        if (red_max[kRows + r] > mb) mb = red_max[kRows + r];
        mn[i] = mb > m[i] ? mb : m[i];
        alpha[i] = num::exp_fast_nonpos(m[i] - mn[i]);  // m <= mn; the first block: exp(-inf) = 0
      }
#pragma unroll
      for (int j = 0; j < 4; ++j)
#pragma unroll
        for (int i = 0; i < 2; ++i) {
          const int v = vb + half * 32 + j * 8 + 2 * c;
          const float p0 = v < nv ? num::exp_fast_nonpos(s[j][2 * i] - mn[i]) : 0.0f;
          const float p1 = v + 1 < nv ? num::exp_fast_nonpos(s[j][2 * i + 1] - mn[i]) : 0.0f;
          sum[i] = sum[i] + p0;
          sum[i] = sum[i] + p1;
          *reinterpret_cast<uint32_t*>(&ps[(wr + g + 8 * i) * kLdp + half * 32 + j * 8 + 2 * c]) = pack_bf16(p0, p1);
        }
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        sum[i] = sum[i] + __shfl_xor_sync(0xffffffffu, sum[i], 1);
        sum[i] = sum[i] + __shfl_xor_sync(0xffffffffu, sum[i], 2);
      }
      if (c == 0) red_sum[half * kRows + wr + g] = sum[0], red_sum[half * kRows + wr + g + 8] = sum[1];
      __syncthreads();  // (C) P and both halves' sums visible
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        const int r = wr + g + 8 * i;
        l[i] = l[i] * alpha[i] + (red_sum[r] + red_sum[kRows + r]);
        m[i] = mn[i];
      }

      // 4. acc = acc * alpha + P . kv over the block's 16-slot steps up to nv
#pragma unroll
      for (int j = 0; j < kNt; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[j][e] = acc[j][e] * alpha[e / 2];
      const int steps = (nvb + 15) / 16;
      for (int kk = 0; kk < steps; ++kk) {
        uint32_t a[4];
        ldmatrix_x4(a, &ps[(wr + lane % 16) * kLdp + kk * 16 + (lane / 16) * 8]);
#pragma unroll
        for (int nj = 0; nj < kNt / 2; ++nj) {
          uint32_t r[4];
          detail::ldmatrix_x4_trans(
              r, &kvt[(kk * 16 + lane % 8 + ((lane / 8) % 2) * 8) * ld + half * kHalf + nj * 16 + (lane / 16) * 8]);
          mma_bf16_tensor_core(acc[2 * nj], a, r[0], r[1]);
          mma_bf16_tensor_core(acc[2 * nj + 1], a, r[2], r[3]);
        }
      }
      __syncthreads();  // (D) kv buffer, P and the statistics free for the next block
    }

    // 5. the sink, the division and the stores
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const int r = wr + g + 8 * i;
      if (r >= nh) continue;
      const float lf = l[i] + num::exp_f(p.sink[h0 + r] - m[i]);
      float* orow = p.o + (t * p.H + h0 + r) * p.Dh;
#pragma unroll
      for (int j = 0; j < kNt; ++j)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int64_t col = half * kHalf + j * 8 + 2 * c + e;
          if (col < p.Dh) orow[col] = num::bf16_round(acc[j][2 * i + e] / lf);
        }
      if (p.lse && half == 0 && c == 0) p.lse[t * p.H + h0 + r] = m[i] + num::log_f(lf);
    }
  }
#else
  __trap();  // the host refuses devices below compute capability 8.0 before launching
#endif
}


// ---- the same order on Hopper's warpgroup tensor cores (sm_90a) -----------------------------------
// sparse_attention_wgmma_tensor_core_kernel computes every value above with the same operations in the
// same order (tests/gpu/test_gpu_fast.cpp FastAttention.WgmmaKernelEqualsMmaSyncKernel compares the
// bytes): each score is the same DP / 16 k16 steps into one fp32 accumulator from +0, as
// wgmma.mma_async.m64n32k16 instead of mma.sync.m16n8k16; the maxima, the probabilities and the
// sums are formed from the same accumulator fragments in the same order (a wgmma m64nN accumulator
// holds, per warp and n-tile of 8, the fragment of an m16n8 mma); P·V is the same 16-slot steps, as
// wgmma.m64n{DP/2}k16 reading P (K-major) and the kv block transposed (MN-major), skipped past nv as
// above (accumulators rescaled by alpha can be -0, so a zero step would not be neutral).
// One block of 256 threads (two warpgroups, half = 0, 1) per (row t, tile of 64 heads), grid-stride:
//   - q (bf16) and the kv blocks live in shared memory as DP / 64 panels of [64 rows][64 values] in
//     the 128B swizzle (kernels/cuda/wgmma.cuh); kv block b + 1 (its valid slots [64b + 64, +64), rows
//     past nv zeros) is copied with cp.async from the call's bf16 copy of kv into the other of two
//     stages while block b is consumed; each thread waits for its own copies and fences them for the
//     async proxy before the block's first barrier.
//   - warpgroup `half` computes the scores of all 64 heads against the block's slots [32 half, +32)
//     (step 3 above), publishes its maxima and, after a barrier, its bf16 P half (into a swizzled
//     [64][64] panel) and sums; after another barrier it rescales and accumulates P·V into output
//     columns [half DP/2, +DP/2) (128 fp32 accumulators per thread at DP = 512). P and the statistics
//     are double-buffered by block parity.
// The host runs this kernel where the device is compute capability 9.0 and the binary holds sm_90a
// code, DP is 256 or 512, the call reads the bf16 copy of kv and the layout fits; elsewhere the
// mma.sync kernel above (the same bits).
constexpr int kPanel = kSlots * 128;  // bytes of one [64 rows][64 bf16] swizzled panel

template <int DP>
struct WgLayout {  // byte offsets from the 1024-aligned base
  static constexpr int kPanels = DP / 64;
  static constexpr int kStage = kPanels * kPanel;      // one kv block (and q: the same size)
  static constexpr int kKv = kStage;                   // q at 0, then two kv stages
  static constexpr int kP = kKv + 2 * kStage;          // two P panels
  static constexpr int kRed = kP + 2 * kPanel;         // two [max half 0, max half 1, sum 0, sum 1][64]
  static constexpr int kSlotList = kRed + 2 * 4 * kRows * 4;
  static size_t bytes(int64_t K) { return 1024 + size_t(kSlotList) + sizeof(int32_t) * size_t(K); }
};

// Byte offset of bf16 element (r, d) in DP / 64 swizzled panels of [64 rows][64].
[[maybe_unused]] __device__ __forceinline__ uint32_t panel_offset(int r, int d) {  // unused by the host pass
  return uint32_t((d / 64) * kPanel + r * 128 + ((((d % 64) / 8) ^ (r % 8)) * 16) + (d % 8) * 2);
}

template <int DP>
__global__ void __launch_bounds__(kThreads, 1)
    sparse_attention_wgmma_tensor_core_kernel(SparseAttnParams p, const __nv_bfloat16* kvb, bool vec, bool ovec) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using L = WgLayout<DP>;
  using detail::pack_bf16;
  constexpr int kHalfN = DP / 2, kAcc = kHalfN / 2;  // a warpgroup's output columns; its accumulators
  extern __shared__ __align__(16) unsigned char wsh[];
  const uint32_t raw = detail::smem_addr(wsh), base = (raw + 1023u) & ~1023u;
  unsigned char* gb = wsh + (base - raw);  // the aligned base as a generic pointer
  float* red = reinterpret_cast<float*>(gb + L::kRed);
  int32_t* slots = reinterpret_cast<int32_t*>(gb + L::kSlotList);
  __shared__ int scan_red[32];

  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const int half = warp / 4, g = lane / 4, c = lane % 4;
  const int row0 = 16 * (warp % 4) + g;  // this thread's rows row0 and row0 + 8 of the tile
  const int tiles = (p.H + kRows - 1) / kRows;
  const float neg_inf = num::f32_from_bits(0xff800000u);

  for (int64_t item = blockIdx.x; item < p.T * tiles; item += gridDim.x) {
    const auto [t, h0, nh, nv] = begin_item<kThreads>(p, item, tiles, tid, slots, scan_red);
    if (nv == 0) continue;
    const int nb = (nv + kSlots - 1) / kSlots;

    // kv block b into stage b % 2: thread tid copies 16-byte chunk tid % kChunks of rows tid / kChunks
    // + kPass i
    auto load_kv = [&](int b) {
      constexpr int kChunks = DP / 8, kPass = kThreads / kChunks;  // chunks of a bf16 row; rows a pass
      const int ch = tid % kChunks, r0 = tid / kChunks, v0 = b * kSlots;
      unsigned char* dst = gb + L::kKv + (b % 2) * L::kStage + (ch / 8) * kPanel;
      const __nv_bfloat16* src = kvb + ch * 8;
#pragma unroll
      for (int i = 0; i < kSlots / kPass; ++i) {
        const int r = r0 + i * kPass;
        const bool ok = v0 + r < nv;
        detail::cp_async16(dst + r * 128 + (((ch % 8) ^ (r % 8)) * 16), src + (ok ? int64_t(slots[v0 + r]) * DP : 0),
                           ok ? 16 : 0);
      }
      detail::cp_async_commit();
    };
    load_kv(0);
    {  // q of the tile as bf16, zeros past nh and Dh; sixteen loads in flight before their stores (two
       // round trips to memory at DP = 512; with four in flight, 3% slower on the H200's Flash-shaped layer)
      const float* q0 = p.q + (t * p.H + h0) * p.Dh;
      constexpr int kPer = kRows * (DP / 4) / kThreads, kBatch = kPer < 16 ? kPer : 16;
#pragma unroll 1
      for (int b0 = 0; b0 < kPer; b0 += kBatch) {
        float4 v[kBatch];
#pragma unroll
        for (int u = 0; u < kBatch; ++u) {
          const int e = tid + (b0 + u) * kThreads, r = e / (DP / 4), d = (e % (DP / 4)) * 4;
          const float* src = q0 + int64_t(r) * p.Dh + d;
          v[u] = make_float4(0.f, 0.f, 0.f, 0.f);
          if (r < nh) {
            if (vec) {
              if (d < p.Dh) v[u] = *reinterpret_cast<const float4*>(src);
            } else {
              v[u] = make_float4(d < p.Dh ? src[0] : 0.f, d + 1 < p.Dh ? src[1] : 0.f, d + 2 < p.Dh ? src[2] : 0.f,
                                 d + 3 < p.Dh ? src[3] : 0.f);
            }
          }
        }
#pragma unroll
        for (int u = 0; u < kBatch; ++u) {
          const int e = tid + (b0 + u) * kThreads, r = e / (DP / 4), d = (e % (DP / 4)) * 4;
          *reinterpret_cast<uint2*>(gb + panel_offset(r, d)) =
              make_uint2(pack_bf16(v[u].x, v[u].y), pack_bf16(v[u].z, v[u].w));
        }
      }
    }

    float acc[kAcc];
#pragma unroll
    for (int i = 0; i < kAcc; ++i) acc[i] = 0.0f;
    float m[2] = {neg_inf, neg_inf}, l[2] = {0.0f, 0.0f};  // rows row0 and row0 + 8
    for (int b = 0; b < nb; ++b) {
      const int pb = b % 2;
      float* R = red + pb * 4 * kRows;  // [max half 0][max half 1][sum half 0][sum half 1]
      const uint32_t kv = base + L::kKv + uint32_t(pb * L::kStage), P = base + L::kP + uint32_t(pb * kPanel);
      const int vb = b * kSlots, nvb = nv - vb < kSlots ? nv - vb : kSlots;
      detail::cp_async_wait<0>();
      detail::fence_proxy_async_shared();  // this thread's copies (and q) for the async proxy
      __syncthreads();                     // (A) block b's kv and q for both warpgroups; stage b + 1 free
      if (b + 1 < nb) load_kv(b + 1);

      // scores of the 64 heads against slots [32 half, +32) of the block: DP / 16 k16 steps
      float s[16];
#pragma unroll
      for (int i = 0; i < 16; ++i) s[i] = 0.0f;
      if (half * 32 < nvb) {
        // descriptors advance by their address field (16-byte units; shared addresses stay below 2^18)
        const uint64_t dq = detail::wgmma_desc_sw128(base), dk = detail::wgmma_desc_sw128(kv + uint32_t(half * 32 * 128));
        detail::wgmma_fence_tensor_core();
#pragma unroll
        for (int kk = 0; kk < DP / 16; ++kk) {
          const uint64_t off = uint64_t(((kk / 4) * kPanel + 32 * (kk % 4)) >> 4);
          detail::wgmma_m64n32k16_tensor_core(s, dq + off, dk + off);
        }
        detail::wgmma_commit_tensor_core();
        detail::wgmma_wait_tensor_core<0>();
        detail::wgmma_pin(s);
      }
      // z = scale * s (slots past nv: -inf) and the half's maximum per row; s[4 j + e] is the mma
      // kernel's s[j][e]
      float mx[2] = {neg_inf, neg_inf};
#pragma unroll
      for (int j = 0; j < 4; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int v = vb + half * 32 + j * 8 + 2 * c + (e & 1);
          s[4 * j + e] = v < nv ? p.scale * s[4 * j + e] : neg_inf;
          if (s[4 * j + e] > mx[e / 2]) mx[e / 2] = s[4 * j + e];
        }
#pragma unroll
      for (int i = 0; i < 2; ++i)
#pragma unroll
        for (int o = 1; o <= 2; o <<= 1) {
          const float x = __shfl_xor_sync(0xffffffffu, mx[i], o);
          if (x > mx[i]) mx[i] = x;
        }
      if (c == 0) R[half * kRows + row0] = mx[0], R[half * kRows + row0 + 8] = mx[1];
      __syncthreads();  // (B) both halves' maxima
      float alpha[2], mn[2], sum[2] = {0.0f, 0.0f};
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        const int r = row0 + 8 * i;
        float mb = R[r];
        if (R[kRows + r] > mb) mb = R[kRows + r];
        mn[i] = mb > m[i] ? mb : m[i];
        alpha[i] = num::exp_fast_nonpos(m[i] - mn[i]);  // m <= mn; the first block: exp(-inf) = 0
      }
#pragma unroll
      for (int j = 0; j < 4; ++j)
#pragma unroll
        for (int i = 0; i < 2; ++i) {
          const int v = vb + half * 32 + j * 8 + 2 * c, r = row0 + 8 * i;
          const float p0 = v < nv ? num::exp_fast_nonpos(s[4 * j + 2 * i] - mn[i]) : 0.0f;
          const float p1 = v + 1 < nv ? num::exp_fast_nonpos(s[4 * j + 2 * i + 1] - mn[i]) : 0.0f;
          sum[i] = sum[i] + p0;
          sum[i] = sum[i] + p1;
          *reinterpret_cast<uint32_t*>(gb + L::kP + pb * kPanel + panel_offset(r, half * 32 + j * 8 + 2 * c)) =
              pack_bf16(p0, p1);
        }
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        sum[i] = sum[i] + __shfl_xor_sync(0xffffffffu, sum[i], 1);
        sum[i] = sum[i] + __shfl_xor_sync(0xffffffffu, sum[i], 2);
      }
      if (c == 0) R[(2 + half) * kRows + row0] = sum[0], R[(2 + half) * kRows + row0 + 8] = sum[1];
      detail::fence_proxy_async_shared();  // P is read by wgmma
      __syncthreads();                     // (C) P and both halves' sums
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        const int r = row0 + 8 * i;
        l[i] = l[i] * alpha[i] + (R[2 * kRows + r] + R[3 * kRows + r]);
        m[i] = mn[i];
      }

      // acc = acc * alpha + P . kv over the block's 16-slot steps up to nv
#pragma unroll
      for (int i = 0; i < kAcc; ++i) acc[i] = acc[i] * alpha[(i % 4) / 2];
      const uint64_t dp = detail::wgmma_desc_sw128(P),  // P; the kv block's columns of this half, transposed
          dv = detail::wgmma_desc_sw128_mn(kv + uint32_t(half * (kHalfN / 64) * kPanel), kPanel);
      auto step = [&](int kk) {
        const uint64_t da = dp + uint64_t((32 * kk) >> 4), db = dv + uint64_t((kk * 16 * 128) >> 4);
        if constexpr (kHalfN == 256)
          detail::wgmma_m64n256k16_tensor_core<1>(acc, da, db);
        else
          detail::wgmma_m64n128k16_tensor_core<1>(acc, da, db);
      };
      detail::wgmma_pin(acc);
      detail::wgmma_fence_tensor_core();
      switch ((nvb + 15) / 16) {  // whole branches: no wgmma under a condition of its own
        case 4: step(0), step(1), step(2), step(3); break;
        case 3: step(0), step(1), step(2); break;
        case 2: step(0), step(1); break;
        default: step(0); break;
      }
      detail::wgmma_commit_tensor_core();
      detail::wgmma_wait_tensor_core<0>();
      detail::wgmma_pin(acc);
    }

    // the sink and the division into a [64][DP + 8] fp32 tile over q and the kv stages (both warpgroups
    // are past their last wgmma after the barrier), then whole rows of o stored from it
    constexpr int kLdo = DP + 8;  // the float2 writes of a half-warp fall in distinct banks
    static_assert(sizeof(float) * kRows * kLdo <= size_t(L::kP), "the output tile fits over q and the kv stages");
    float* ot = reinterpret_cast<float*>(gb);
    float lf[2];
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const int r = row0 + 8 * i;
      lf[i] = l[i] + num::exp_f(p.sink[h0 + (r < nh ? r : 0)] - m[i]);
      if (p.lse && half == 0 && c == 0 && r < nh) p.lse[t * p.H + h0 + r] = m[i] + num::log_f(lf[i]);
    }
    __syncthreads();
#pragma unroll
    for (int j = 0; j < kHalfN / 8; ++j)
#pragma unroll
      for (int i = 0; i < 2; ++i)
        *reinterpret_cast<float2*>(&ot[(row0 + 8 * i) * kLdo + half * kHalfN + j * 8 + 2 * c]) =
            make_float2(num::bf16_round(acc[4 * j + 2 * i] / lf[i]), num::bf16_round(acc[4 * j + 2 * i + 1] / lf[i]));
    __syncthreads();
    float* o0 = p.o + (t * p.H + h0) * p.Dh;
    if (ovec) {
      for (int e = tid; e < nh * (DP / 4); e += kThreads) {
        const int r = e / (DP / 4), d = (e % (DP / 4)) * 4;
        if (d < p.Dh) *reinterpret_cast<float4*>(o0 + int64_t(r) * p.Dh + d) = *reinterpret_cast<const float4*>(&ot[r * kLdo + d]);
      }
    } else {
      for (int64_t e = tid; e < int64_t(nh) * p.Dh; e += kThreads) o0[e] = ot[(e / p.Dh) * kLdo + e % p.Dh];
    }
  }
#else
  __trap();  // the host launches it only where wgmma_available() said sm_90a code runs
#endif
}

// A call reads a bf16 copy of kv made once when it touches at least half of kv's rows; a decode step
// (few rows, a long cache) converts the rows it reads. Both round alike.
bool reads_bf16_copy(const SparseAttnParams& p) {
  return p.N <= 2 * p.T * p.K;
}

// Whether the Hopper kernel runs p (the rule of the kernel's comment above).
bool runs_wgmma(const SparseAttnParams& p, int dp) {
  if (dp < 256 || !reads_bf16_copy(p) || !detail::wgmma_available()) return false;
  const size_t need = dp == 512 ? WgLayout<512>::bytes(p.K) : WgLayout<256>::bytes(p.K);
  return need + sizeof(int) * 32 <= size_t(detail::device_attribute(cudaDevAttrMaxSharedMemoryPerBlockOptin));  // + scan_red
}

template <int DP>
void launch_tc(const SparseAttnParams& p, bool wgmma_allowed, cudaStream_t stream) {
  const int optin = detail::device_attribute(cudaDevAttrMaxSharedMemoryPerBlockOptin);
  const bool bf16kv = reads_bf16_copy(p);
  detail::Scratch<__nv_bfloat16> kvb(bf16kv ? p.N * DP : 0, stream);
  if (bf16kv) detail::rows_to_bf16(p.kv, p.N, p.Dh, DP, kvb.get(), stream);
  const int64_t items = p.T * ((p.H + kRows - 1) / kRows);
  const bool vec = p.Dh % 4 == 0 && reinterpret_cast<uintptr_t>(p.q) % 16 == 0 &&
                   reinterpret_cast<uintptr_t>(p.kv) % 16 == 0;
  if constexpr (DP >= 256) {
    if (wgmma_allowed && runs_wgmma(p, DP)) {
      const size_t shmem = WgLayout<DP>::bytes(p.K);
      auto kernel = sparse_attention_wgmma_tensor_core_kernel<DP>;
      CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(shmem)));
      const int64_t sms = detail::device_attribute(cudaDevAttrMultiProcessorCount);
      const bool ovec = p.Dh % 4 == 0 && reinterpret_cast<uintptr_t>(p.o) % 16 == 0;
      kernel<<<unsigned(items < sms ? items : sms), kThreads, shmem, stream>>>(p, kvb.get(), vec, ovec);
      DSV4_LAUNCH_CHECK();
      return;
    }
  }
  const int bufs = tc_layout(DP, 2).bytes(p.K) <= size_t(optin) ? 2 : 1;
  const size_t shmem = tc_layout(DP, bufs).bytes(p.K);
  if (shmem > size_t(optin))
    throw Error("sparse_attention (tensor_core order): K = " + std::to_string(p.K) + " slots with Dh = " +
                std::to_string(p.Dh) + " need " + std::to_string(shmem) +
                " bytes of shared memory per block; this device allows " + std::to_string(optin));
  auto kernel = bf16kv ? sparse_attention_tensor_core_kernel<DP, true> : sparse_attention_tensor_core_kernel<DP, false>;
  CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(shmem)));
  kernel<<<detail::grid_for(items, 1, 1 << 20), kThreads, shmem, stream>>>(p, kvb.get(), bufs, vec);
  DSV4_LAUNCH_CHECK();
}

__global__ void exp_fast_nonpos_kernel(const float* x, float* y, int64_t n) {
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x)
    y[i] = num::exp_fast_nonpos(x[i]);
}

}  // namespace

void exp_fast_nonpos(const float* x, float* y, int64_t n, cudaStream_t stream) {
  if (n <= 0) return;
  exp_fast_nonpos_kernel<<<detail::grid_for(n, kThreads, 1 << 16), kThreads, 0, stream>>>(x, y, n);
  DSV4_LAUNCH_CHECK();
}

namespace detail {

const char* sparse_attention_tensor_core_check(const SparseAttnParams& p) {
  if (p.Dh > kMaxDp) return "Dh (the tensor_core order takes at most 512)";
  // one kv buffer must fit the largest shared memory of a block of any sm_80+ device (227 KiB)
  if (tc_layout(padded_dh(p.Dh), 1).bytes(p.K) > size_t(227) * 1024) return "K (too large for one block)";
  return nullptr;
}

void sparse_attention_tensor_core(const SparseAttnParams& p, bool wgmma_allowed, cudaStream_t stream) {
  require_tensor_core_device();
  switch (padded_dh(p.Dh)) {
    case 64: return launch_tc<64>(p, wgmma_allowed, stream);
    case 128: return launch_tc<128>(p, wgmma_allowed, stream);
    case 256: return launch_tc<256>(p, wgmma_allowed, stream);
    default: return launch_tc<512>(p, wgmma_allowed, stream);
  }
}

bool sparse_attention_tensor_core_uses_wgmma(const SparseAttnParams& p) {
  return p.T > 0 && runs_wgmma(p, padded_dh(p.Dh));
}

}  // namespace detail
}  // namespace dsv4::cuda
