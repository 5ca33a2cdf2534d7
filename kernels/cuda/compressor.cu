// KV compressor and Walsh-Hadamard rotation on the GPU in the operation order of
// kernels/compressor.h.
//
// compressor(): kvp = x . wkv^T and sc = x . wgate^T as two fp32 GEMMs over the G * ratio complete
// rows (as on the CPU); pool_kernel then runs one thread per (group g, channel c): the slot scores
// sc + ape[slot] (the CPU adds ape into sc first: the same single addition), their max, the
// exp_f terms and their sum in slot order, and the weighted sum as an fma chain in slot order
// (the exp_f terms are recomputed in the last loop: the same inputs give the same bits). Then the
// RMSNorm, RoPE (position g * ratio) and Hadamard kernels run on the G output rows in place.
//
// hadamard_kernel: one block per row, the row in shared memory; each butterfly stage h pairs
// (j, j + h) disjointly, one pair per thread, with a barrier between stages, so every value sees
// exactly the CPU's sequence of additions; then v = bf16(v * (1 / sqrt(n))).
#include <cmath>

#include "kernels/cuda/common.cuh"

namespace dsv4::cuda {

namespace {

constexpr int kThreads = 256;

struct PoolArgs {
  int64_t G = 0, d = 0, cw = 0;
  int r = 4;
  bool overlap = true;
  const float* kvp = nullptr;  // [G * r, cw]
  const float* sc = nullptr;   // [G * r, cw]
  const float* ape = nullptr;  // [r, cw]
  float* out = nullptr;        // [G, d]
};

__global__ void __launch_bounds__(kThreads) pool_kernel(PoolArgs a) {
  const int r = a.r, nslot = a.overlap ? 2 * r : r;
  const float ninf = -__int_as_float(0x7f800000);
  const int64_t total = a.G * a.d;
  for (int64_t e = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; e < total;
       e += int64_t(gridDim.x) * blockDim.x) {
    const int64_t g = e / a.d, c = e % a.d;
    // (kv, score) of slot s in the contract's order; group 0's previous-group slots are kv 0 / -inf.
    auto row_of = [&](int s, int64_t& row, int64_t& col) -> bool {
      if (!a.overlap) {
        row = g * r + s, col = c;
        return true;
      }
      if (s < r) {
        row = (g - 1) * r + s, col = c;
        return g > 0;
      }
      row = g * r + (s - r), col = a.d + c;
      return true;
    };
    auto sc_at = [&](int s) -> float {
      int64_t row, col;
      if (!row_of(s, row, col)) return ninf;
      return a.sc[row * a.cw + col] + a.ape[(row % r) * a.cw + col];
    };
    auto kv_at = [&](int s) -> float {
      int64_t row, col;
      if (!row_of(s, row, col)) return 0.0f;
      return a.kvp[row * a.cw + col];
    };
    float m = ninf;
    for (int s = 0; s < nslot; ++s) {
      const float v = sc_at(s);
      if (v > m) m = v;
    }
    float Z = 0.0f;
    for (int s = 0; s < nslot; ++s) Z = Z + num::exp_f(sc_at(s) - m);
    float acc = 0.0f;
    for (int s = 0; s < nslot; ++s) acc = __fmaf_rn(num::exp_f(sc_at(s) - m) / Z, kv_at(s), acc);
    a.out[g * a.d + c] = num::bf16_round(acc);
  }
}

// Grid: one block per row (grid-stride); dynamic shared memory n floats.
__global__ void __launch_bounds__(kThreads)
    hadamard_kernel(float* x, int64_t rows, int64_t n, int64_t ld, float scale) {
  extern __shared__ float v[];
  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    float* xr = x + row * ld;
    for (int64_t i = threadIdx.x; i < n; i += blockDim.x) v[i] = xr[i];
    __syncthreads();
    for (int64_t h = 1; h < n; h *= 2) {
      for (int64_t q = threadIdx.x; q < n / 2; q += blockDim.x) {
        const int64_t j = (q / h) * 2 * h + q % h;
        const float a = v[j], b = v[j + h];
        v[j] = a + b;
        v[j + h] = a - b;
      }
      __syncthreads();
    }
    for (int64_t i = threadIdx.x; i < n; i += blockDim.x) xr[i] = num::bf16_round(v[i] * scale);
    __syncthreads();
  }
}

bool is_pow2(int64_t n) {
  return n > 0 && (n & (n - 1)) == 0;
}

}  // namespace

void hadamard(float* x, int64_t rows, int64_t n, int64_t ld, cudaStream_t stream) {
  if (rows < 0) require("rows", "hadamard");
  if (!is_pow2(n)) require("n must be a power of two", "hadamard");
  if (ld < n) require("ld < n", "hadamard");
  if (rows == 0) return;
  if (!x) require("x", "hadamard");
  if (n > 12 * 1024) require("n is too large for one block", "hadamard");
  const float scale = 1.0f / std::sqrt(float(n));
  hadamard_kernel<<<detail::grid_for(rows, 1, 65535), kThreads, size_t(n) * sizeof(float), stream>>>(
      x, rows, n, ld, scale);
  DSV4_LAUNCH_CHECK();
}

void compressor(const CompressorParams& p, cudaStream_t stream) {
  require(dsv4::compressor_check(p), "compressor");
  const int64_t G = compressor_groups(p.T, p.ratio);
  if (G == 0) return;
  const int r = p.ratio;
  const bool overlap = (r == 4);
  const int64_t coff = overlap ? 2 : 1, d = p.d, cw = coff * d, rows = G * r;

  detail::Scratch<float> kvp(rows * cw, stream), sc(rows * cw, stream);
  GemmParams gp;
  gp.m = rows;
  gp.n = cw;
  gp.k = p.D;
  gp.x = p.x;
  gp.ldx = p.D;
  gp.ldw = p.D;
  gp.ldy = cw;
  gp.round = OutRound::f32;
  gp.order = p.order;
  gp.w = p.wkv;
  gp.y = kvp.get();
  gemm(gp, stream);
  gp.w = p.wgate;
  gp.y = sc.get();
  gemm(gp, stream);

  PoolArgs a;
  a.G = G, a.d = d, a.cw = cw, a.r = r, a.overlap = overlap;
  a.kvp = kvp.get(), a.sc = sc.get(), a.ape = p.ape, a.out = p.out;
  pool_kernel<<<detail::grid_for(G * d, kThreads), kThreads, 0, stream>>>(a);
  DSV4_LAUNCH_CHECK();

  RmsNormParams np;
  np.rows = G;
  np.dim = d;
  np.x = p.out;
  np.ldx = d;
  np.w = p.norm;
  np.y = p.out;
  np.ldy = d;
  np.eps = p.rms_eps;
  np.order = p.order;
  rmsnorm(np, stream);

  RopeApplyParams rp;
  rp.rows = G;
  rp.heads = 1;
  rp.x = p.out;
  rp.ld = d;
  rp.head_stride = d;
  rp.offset = d - p.rd;
  rp.pos = nullptr;  // position g * ratio
  rp.freq = p.freq;
  rp.rd = p.rd;
  rp.inverse = false;
  rp.round_bf16 = true;
  detail::rope_rows(rp, r, stream);

  if (p.hadamard) hadamard(p.out, G, d, d, stream);
}

}  // namespace dsv4::cuda
