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
// Inputs are rounded to bf16 (round to nearest even) as they are staged: the model's activations and
// weights are bf16 values already, so for them this changes nothing.
//
// Kernel: block tile 128 x 128 outputs, 256 threads (8 warps, 2 x 4, each 64 x 32 outputs, i.e. 4 x 4
// mma tiles of 16 x 8), k staged 32 at a time in shared memory as bf16 (rows padded to 40 elements, so
// the eight 16-byte rows an ldmatrix phase reads fall in distinct banks), double-buffered: the next
// tile is loaded into registers (fp32, float4 where aligned) while the current one is consumed.
// Functions named *tensor_core* are the only ones scripts/kernel-audit.py lets use tensor cores.

#include <string>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/mma.cuh"
#include "kernels/detail/linear.h"

namespace dsv4::cuda::detail {
namespace {

constexpr int kBM = 128, kBN = 128, kBK = 32, kThreads = 256;
constexpr int kLds = kBK + 8;  // bf16 elements per staged row
constexpr int kRowsPerPass = kThreads / (kBK / 4);  // 32 rows staged per pass of float4 loads
constexpr int kPasses = kBM / kRowsPerPass;          // 4
static_assert(kBM == kBN, "x and w tiles are staged alike");

template <bool VEC>
__device__ __forceinline__ float4 load4(const float* row, int64_t k, int64_t K) {
  if (row == nullptr) return make_float4(0.f, 0.f, 0.f, 0.f);
  if (VEC && k + 4 <= K) return *reinterpret_cast<const float4*>(row + k);
  float v[4];
#pragma unroll
  for (int j = 0; j < 4; ++j) v[j] = k + j < K ? row[k + j] : 0.f;
  return make_float4(v[0], v[1], v[2], v[3]);
}

template <bool VEC>
__global__ void __launch_bounds__(kThreads, 2)
    gemm_tensor_core_kernel(GemmShape s, GemmProblem one, const GemmProblem* many) {
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 800  // the host pass sees the body too
  const GemmProblem& P = many ? many[blockIdx.z] : one;
  const int64_t m0 = int64_t(blockIdx.y) * kBM, n0 = int64_t(blockIdx.x) * kBN;
  if (m0 >= P.m) return;
  __shared__ __align__(16) __nv_bfloat16 xs[2][kBM * kLds];
  __shared__ __align__(16) __nv_bfloat16 ws[2][kBN * kLds];

  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  // Staging: thread tid loads k columns [4 (tid % 8), +4) of tile rows tid / 8 + 32 i.
  const int srow = tid / (kBK / 4), scol = (tid % (kBK / 4)) * 4;
  const float* xrow[kPasses];
  const float* wrow[kPasses];
#pragma unroll
  for (int i = 0; i < kPasses; ++i) {
    const int64_t r = m0 + srow + kRowsPerPass * i, c = n0 + srow + kRowsPerPass * i;
    xrow[i] = r < P.m ? P.x + (P.xrow ? int64_t(P.xrow[r]) : r) * P.ldx : nullptr;
    wrow[i] = c < s.n ? P.w + c * P.ldw : nullptr;
  }
  float4 xa[kPasses], wa[kPasses];
  auto load = [&](int64_t k0) {
#pragma unroll
    for (int i = 0; i < kPasses; ++i) {
      xa[i] = load4<VEC>(xrow[i], k0 + scol, s.k);
      wa[i] = load4<VEC>(wrow[i], k0 + scol, s.k);
    }
  };
  auto stage = [&](int buf) {
#pragma unroll
    for (int i = 0; i < kPasses; ++i) {
      const int at = (srow + kRowsPerPass * i) * kLds + scol;
      *reinterpret_cast<uint2*>(&xs[buf][at]) = make_uint2(pack_bf16(xa[i].x, xa[i].y), pack_bf16(xa[i].z, xa[i].w));
      *reinterpret_cast<uint2*>(&ws[buf][at]) = make_uint2(pack_bf16(wa[i].x, wa[i].y), pack_bf16(wa[i].z, wa[i].w));
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

  const int64_t tiles = (s.k + kBK - 1) / kBK;
  load(0);
  stage(0);
  __syncthreads();
  for (int64_t t = 0; t < tiles; ++t) {
    const int buf = int(t & 1);
    if (t + 1 < tiles) load((t + 1) * kBK);
#pragma unroll
    for (int kk = 0; kk < kBK; kk += 16) {
      uint32_t a[4][4], b[4][2];
#pragma unroll
      for (int mi = 0; mi < 4; ++mi)  // rows lane % 16, k half lane / 16
        ldmatrix_x4(a[mi], &xs[buf][(wm * 64 + mi * 16 + lane % 16) * kLds + kk + (lane / 16) * 8]);
#pragma unroll
      for (int nj = 0; nj < 2; ++nj) {  // n rows lane % 8 (+8 for lanes 16..31), k half (lane / 8) % 2
        uint32_t r[4];
        ldmatrix_x4(r, &ws[buf][(wn * 32 + nj * 16 + lane % 8 + (lane / 16) * 8) * kLds + kk + ((lane / 8) % 2) * 8]);
        b[2 * nj][0] = r[0], b[2 * nj][1] = r[1], b[2 * nj + 1][0] = r[2], b[2 * nj + 1][1] = r[3];
      }
#pragma unroll
      for (int mi = 0; mi < 4; ++mi)
#pragma unroll
        for (int ni = 0; ni < 4; ++ni) mma_bf16_tensor_core(acc[mi][ni], a[mi], b[ni][0], b[ni][1]);
    }
    if (t + 1 < tiles) stage(buf ^ 1);
    __syncthreads();
  }

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
#pragma unroll
        for (int c = 0; c < 2; ++c) {
          const int64_t col = n0 + wn * 32 + ni * 8 + pair + c;
          if (col < s.n) y[col] = common::gemm_out(acc[mi][ni][2 * h + c], s.round);
        }
    }
#else
  __trap();  // the host refuses devices below compute capability 8.0 before launching
#endif
}

bool aligned16(const void* p, int64_t ld) { return reinterpret_cast<uintptr_t>(p) % 16 == 0 && ld % 4 == 0; }

}  // namespace

void require_tensor_core_device() {
  int dev = 0, major = 0;
  CUDA_CHECK(cudaGetDevice(&dev));
  CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev));
  if (major < 8)
    throw Error(
        "the tensor_core reduction order (fast numerics) needs a GPU of compute capability 8.0 or newer "
        "(bf16 mma.sync); this device is " + std::to_string(major) + ".x");
}

void gemm_tensor_core_group(const GemmShape& s, const GemmProblem* problems, int count, int64_t mmax,
                            cudaStream_t stream) {
  require_tensor_core_device();
  if (ceil_div(mmax, kBM) > 65535) throw Error("cuda gemm cannot run: m is too large for one launch");
  bool vec = true;
  for (int i = 0; i < count; ++i)
    vec = vec && (problems[i].m <= 0 || (aligned16(problems[i].x, problems[i].ldx) &&
                                         aligned16(problems[i].w, problems[i].ldw)));
  const dim3 grid(unsigned(ceil_div(s.n, kBN)), unsigned(ceil_div(mmax, kBM)), unsigned(count));
  auto kernel = vec ? gemm_tensor_core_kernel<true> : gemm_tensor_core_kernel<false>;
  if (count == 1) {
    kernel<<<grid, kThreads, 0, stream>>>(s, problems[0], nullptr);
    DSV4_LAUNCH_CHECK();
    return;
  }
  Scratch<GemmProblem> dev_problems(count, stream);
  CUDA_CHECK(cudaMemcpyAsync(dev_problems.get(), problems, sizeof(GemmProblem) * size_t(count),
                             cudaMemcpyHostToDevice, stream));
  kernel<<<grid, kThreads, 0, stream>>>(s, GemmProblem{}, dev_problems.get());
  DSV4_LAUNCH_CHECK();
}

}  // namespace dsv4::cuda::detail
