// Dense GEMM on the GPU with the canonical per-element reduction order (kernels/linear.h,
// kernels/reduce.h): every output element is exactly dsv4::dot(x_row, w_row, k, order), rounded once.
//
// Kernel contract (gemm_kernel<TM, TN>): grid (ceil(n / BN), ceil(m / BM), problems), 256 threads,
// BM = 16 TM, BN = 16 TN. A block computes a BM x BN tile of one problem; thread (ty, tx) =
// (tid / 16, tid % 16) owns the TM x TN outputs (ty + 16 r, tx + 16 c) and keeps, per output, the 8 lane
// accumulators of dot_chain: k is consumed in aligned groups of 8 and element (group start + l) goes to lane
// l with one __fmaf_rn, in increasing k. Chains start at multiples of 8 (0 and multiples of the ReduceOrder
// block), so when a chain ends (after the group that reaches a block boundary or k) the lanes are combined as
// ((l0 + l4) + (l2 + l6)) + ((l1 + l5) + (l3 + l7)) and added to the running sum (the first chain
// initialises it), exactly as dot() does. Positions past k (and rows past m or n) are loaded as 0:
// fma(0, 0, acc) == acc because an accumulator that starts at +0 is never -0. A row's result never
// depends on other rows, the tile shape or the grid (batch invariance).
#include "kernels/cuda/common.cuh"

namespace dsv4::cuda {

namespace detail {
namespace {

constexpr int kThreads = 256;
constexpr int BK = 32;       // k per shared-memory stage (a multiple of 8)
constexpr int LDS = BK + 4;  // padded row stride: the rows tx + 16c of a warp hit distinct banks
static_assert(BK % 8 == 0, "k stages must hold whole groups of 8");

__device__ __forceinline__ float combine_lanes(const float* a) {
  return ((a[0] + a[4]) + (a[2] + a[6])) + ((a[1] + a[5]) + (a[3] + a[7]));
}

// Tile: thread (ty, tx) = (tid / 16, tid % 16) owns outputs (ty + 16 r, tx + 16 c), r < TM, c < TN;
// the block tile is BM x BN = 16 TM x 16 TN. Thread tid stages column tid % BK of x rows
// tid / BK + 8 i and of w rows tid / BK + 8 j; the next stage is loaded into registers while the
// current one is consumed from shared memory.
template <int TM, int TN>
__global__ void __launch_bounds__(kThreads)
    gemm_kernel(GemmShape s, int64_t chain_groups, GemmProblem one, const GemmProblem* many) {
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
          for (int l = 0; l < 8; ++l) acc[r][c][l] = __fmaf_rn(xv[r][l], wv[l], acc[r][c][l]);
      }
      // Uniform over the block: every thread walks the same k groups.
      if (--left == 0 || k0 + kk + 8 >= s.k) {
#pragma unroll
        for (int r = 0; r < TM; ++r)
#pragma unroll
          for (int c = 0; c < TN; ++c) {
            const float v = combine_lanes(acc[r][c]);
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
      if (col < s.n) y[col] = s.round == OutRound::bf16 ? num::bf16_round(sum[r][c]) : sum[r][c];
    }
  }
}

template <int TM, int TN>
void launch(const GemmShape& s, int64_t chain_groups, const GemmProblem* problems, int count, int64_t mmax,
            cudaStream_t stream) {
  constexpr int BM = 16 * TM, BN = 16 * TN;
  if (ceil_div(mmax, BM) > 65535) throw Error("cuda gemm cannot run: m is too large for one launch");
  const dim3 grid(unsigned(ceil_div(s.n, BN)), unsigned(ceil_div(mmax, BM)), unsigned(count));
  if (count == 1) {
    gemm_kernel<TM, TN><<<grid, kThreads, 0, stream>>>(s, chain_groups, problems[0], nullptr);
    DSV4_LAUNCH_CHECK();
    return;
  }
  Scratch<GemmProblem> dev(count, stream);
  CUDA_CHECK(cudaMemcpyAsync(dev.get(), problems, sizeof(GemmProblem) * size_t(count), cudaMemcpyHostToDevice,
                             stream));
  gemm_kernel<TM, TN><<<grid, kThreads, 0, stream>>>(s, chain_groups, GemmProblem{}, dev.get());
  DSV4_LAUNCH_CHECK();
}

}  // namespace

void gemm_group(const GemmShape& s, const GemmProblem* problems, int count, cudaStream_t stream) {
  if (count <= 0 || s.n <= 0) return;
  int64_t mmax = 0;
  for (int i = 0; i < count; ++i) mmax = problems[i].m > mmax ? problems[i].m : mmax;
  if (mmax <= 0) return;
  if (count > 65535) throw Error("cuda gemm cannot run: too many problems in one group");
  // Chain length in groups of 8: the ReduceOrder block, or "never" for a single chain.
  const int64_t chain_groups = (s.order.block > 0 && s.k > s.order.block) ? s.order.block / 8 : INT64_MAX;
  // The tile only changes which thread computes an element, never its order: narrow outputs (router,
  // head weights, mHC mixes) take narrow tiles so that more blocks share the work.
  if (s.n <= 16)
    launch<1, 1>(s, chain_groups, problems, count, mmax, stream);
  else if (s.n <= 32)
    launch<2, 2>(s, chain_groups, problems, count, mmax, stream);
  else
    launch<2, 4>(s, chain_groups, problems, count, mmax, stream);
}

}  // namespace detail

bool device_available() {
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
}

void gemm(const GemmParams& p, cudaStream_t stream) {
  require(dsv4::gemm_check(p), "gemm");
  if (p.m <= 0 || p.n <= 0) return;
  detail::GemmShape s{p.n, p.k, p.round, p.order};
  detail::GemmProblem g;
  g.x = p.x;
  g.ldx = p.ldx;
  g.w = p.w;
  g.ldw = p.ldw;
  g.y = p.y;
  g.ldy = p.ldy;
  g.m = p.m;
  detail::gemm_group(s, &g, 1, stream);
}

}  // namespace dsv4::cuda
