// The lane-split tile of the exact GEMM (kernels/cuda/linear.cu): 256 threads compute a 64 x 64 tile
// of canonical dot products (kernels/reduce.h), one lane of the 8-lane chain per thread. The GEMM
// kernels and the exact sparse attention's scores (kernels/cuda/attention.cu) are built from these
// pieces, so both reduce in the same order with the same shuffles. Included by .cu files only.
#pragma once

#include "kernels/cuda/common.cuh"

namespace dsv4::cuda::detail {

namespace lanes {
constexpr int NT = 256;                                // threads: 32 groups of 8 lanes, 8 warps
constexpr int TM = 8, TN = 16;                         // outputs of a group: TM x rows by TN w rows
constexpr int GM = 8, GN = 4;                          // groups along m and n; a warp holds 2 x 2 groups
constexpr int BM = GM * TM, BN = GN * TN;              // 64 x 64 block tile
constexpr int KS = 32, STEPS = KS / 8;                 // k per shared-memory stage, steps per stage
constexpr int SX = BM + 4, SW = BN + 4;                // shared row strides (floats)
constexpr int XCH = (BM / 16) * (KS / 8) / (NT / 32);  // 4-float chunks of x staged per thread per stage
constexpr int WCH = (BN / 16) * (KS / 8) / (NT / 32);  // and of w
// Dynamic shared memory: two stages of x and w, then the running sums (4 float4 per thread).
constexpr int SMEM = int(sizeof(float)) * (2 * KS * SX + 2 * KS * SW + 16 * NT);
static_assert(GM * GN * 8 == NT && GM % 2 == 0 && GN % 2 == 0, "the warps hold 2 x 2 groups each");
static_assert(SX % 32 == 4 && SW % 32 == 4, "the 8 lanes of a group read 8 rows: distinct bank quads");
static_assert(XCH == 2 && WCH == 2, "staging divides evenly over the warps");
}  // namespace lanes

// Shared layout of a stage: Xs[kr][.] holds k row kr (stage-relative) of the BM x rows, k-major, with
// column m stored at m ^ (4 ((kr >> 2) & 1)); Ws[kr][.] holds the BN w rows, column n at n ^ (4 (kr & 3)).
// The swizzles move 4-float chunks inside one group's 8 x columns and 16 w columns. Lane l reads
// k row 8t + l at the same physical chunks as the other lanes of its group (so the 8 rows it reads
// hit distinct bank quads), which leaves the logical values in its registers in a lane-dependent
// order: register x row r holds logical row r ^ (4 (l >> 2)), register w column c holds logical
// column c ^ (4 (l & 3)). That order lets every shuffle round below pair equal registers.
//
// The operands of one step of lane l: the x and w values of k row kr = 8t + l of the stage (`xs`
// and `ws` point at k row kr, group columns), in register order.
struct Frag {
  float x[lanes::TM], w[lanes::TN];
};
__device__ __forceinline__ void lanes_load(Frag& f, const float* xs, const float* ws) {
#pragma unroll
  for (int q = 0; q < lanes::TM / 4; ++q) {
    const float4 v = *reinterpret_cast<const float4*>(xs + 4 * q);
    f.x[4 * q] = v.x, f.x[4 * q + 1] = v.y, f.x[4 * q + 2] = v.z, f.x[4 * q + 3] = v.w;
  }
#pragma unroll
  for (int q = 0; q < lanes::TN / 4; ++q) {
    const float4 v = *reinterpret_cast<const float4*>(ws + 4 * q);
    f.w[4 * q] = v.x, f.w[4 * q + 1] = v.y, f.w[4 * q + 2] = v.z, f.w[4 * q + 3] = v.w;
  }
}
// The step itself: accumulator acc[r][c] (register row r, register column c) gets x[r] * w[c].
__device__ __forceinline__ void lanes_fma(float (&acc)[lanes::TM][lanes::TN], const Frag& f) {
#pragma unroll
  for (int r = 0; r < lanes::TM; ++r)
#pragma unroll
    for (int c = 0; c < lanes::TN; ++c) acc[r][c] = __fmaf_rn(f.x[r], f.w[c], acc[r][c]);
}

// A whole stage of STEPS steps (`xs` and `ws` at lane l's k row of the stage, group columns); the
// operands of step j + 1 are loaded while step j is computed.
__device__ __forceinline__ void lanes_stage(float (&acc)[lanes::TM][lanes::TN], const float* xs,
                                            const float* ws) {
  using namespace lanes;
  Frag f[2];
  lanes_load(f[0], xs, ws);
#pragma unroll
  for (int j = 0; j < STEPS; ++j) {
    if (j + 1 < STEPS) lanes_load(f[(j + 1) & 1], xs + 8 * (j + 1) * SX, ws + 8 * (j + 1) * SW);
    lanes_fma(acc, f[j & 1]);
  }
}

// End of a chain, the shuffles: the 8 threads of a group combine their lanes in three rounds (all 32
// threads of the warp take part). Round 1 (partner l ^ 4) keeps register rows 0..3 and adds the
// partner's rows 4..7, which hold the same logical rows: (l0 + l4), (l1 + l5), (l2 + l6) or (l3 + l7).
// Round 2 (partner l ^ 2) keeps register w chunks 0, 1 and adds the partner's chunks 2, 3: (v0 + v2)
// or (v1 + v3). Round 3 (partner l ^ 1) keeps chunk 0 and adds the partner's chunk 1: the chain
// result. Afterwards acc[r][c] (r, c < 4) of lane l holds the chain result at logical x row
// 4 (l >> 2) + r and w column 4 (l & 3) + c of the group's tile (lanes_out_row / lanes_out_col).
__device__ __forceinline__ void lanes_reduce(float (&acc)[lanes::TM][lanes::TN]) {
  constexpr unsigned all = 0xffffffffu;
#pragma unroll
  for (int r = 0; r < 4; ++r)
#pragma unroll
    for (int c = 0; c < 16; ++c) acc[r][c] = acc[r][c] + __shfl_xor_sync(all, acc[r + 4][c], 4);
#pragma unroll
  for (int r = 0; r < 4; ++r)
#pragma unroll
    for (int c = 0; c < 8; ++c) acc[r][c] = acc[r][c] + __shfl_xor_sync(all, acc[r][c + 8], 2);
#pragma unroll
  for (int r = 0; r < 4; ++r)
#pragma unroll
    for (int c = 0; c < 4; ++c) acc[r][c] = acc[r][c] + __shfl_xor_sync(all, acc[r][c + 4], 1);
}
// The lanes restart at +0 for the next chain.
__device__ __forceinline__ void lanes_clear(float (&acc)[lanes::TM][lanes::TN]) {
#pragma unroll
  for (int r = 0; r < lanes::TM; ++r)
#pragma unroll
    for (int c = 0; c < lanes::TN; ++c) acc[r][c] = 0.0f;
}
// Where lanes_reduce leaves the results of lane l: the x row (within the group's TM) of acc[r][.] and
// the w row (within the group's TN) of acc[.][c].
__device__ __forceinline__ int lanes_out_row(int l, int r) {
  return 4 * (l >> 2) + r;
}
__device__ __forceinline__ int lanes_out_col(int l, int c) {
  return 4 * (l & 3) + c;
}

// End of a chain in the GEMM: lanes_reduce, the chain results folded into the running sums, the lanes
// cleared. `sums` is this thread's first running-sum float4 (row r at sums[r * NT]).
__device__ __forceinline__ void lanes_combine(float (&acc)[lanes::TM][lanes::TN], float4* sums,
                                              bool started) {
  lanes_reduce(acc);
#pragma unroll
  for (int r = 0; r < 4; ++r) {
    float4 v = make_float4(acc[r][0], acc[r][1], acc[r][2], acc[r][3]);
    if (started) {
      const float4 o = sums[r * lanes::NT];
      v = make_float4(o.x + v.x, o.y + v.y, o.z + v.z, o.w + v.w);
    }
    sums[r * lanes::NT] = v;
  }
  lanes_clear(acc);
}

// ---- staging ------------------------------------------------------------------------------------------
// Thread tid stages XCH chunks of x and WCH of w per stage. Chunk i is tile row R = 16 (combo % 4) + u / 2
// and k chunk c = 2 (combo / 4) + u % 2 (k = 4c .. 4c + 3 of the stage), combo = warp + 8 i (u = tid % 32):
// the two threads of a pair read 32 contiguous bytes, and the transposing stores of a warp hit 32
// distinct banks for every k row (16 rows per half of the warp, halves 16 banks apart).
static_assert(lanes::BM / 16 == 4 && lanes::BN / 16 == 4, "staging index math below");
__device__ __forceinline__ int lanes_stage_row(int warp, int u, int i) {
  return 16 * ((warp + 8 * i) % 4) + u / 2;
}
__device__ __forceinline__ int lanes_stage_chunk(int warp, int u, int i) {
  return 2 * ((warp + 8 * i) / 4) + u % 2;
}
// Stores the staged chunks (k values 4c .. 4c + 3 of tile rows R), swizzled, into one stage's Xs and
// Ws ([KS][SX], [KS][SW]): k row kr = 4c + e has (kr >> 2) & 1 == c & 1 and kr & 3 == e.
__device__ __forceinline__ void lanes_stash(float (*Xs)[lanes::SX], float (*Ws)[lanes::SW],
                                            const float4 (&xr)[lanes::XCH], const float4 (&wr)[lanes::WCH],
                                            int warp, int u) {
#pragma unroll
  for (int i = 0; i < lanes::XCH; ++i) {
    const int R = lanes_stage_row(warp, u, i), c = lanes_stage_chunk(warp, u, i), col = R ^ ((c & 1) << 2);
    Xs[4 * c][col] = xr[i].x;
    Xs[4 * c + 1][col] = xr[i].y;
    Xs[4 * c + 2][col] = xr[i].z;
    Xs[4 * c + 3][col] = xr[i].w;
  }
#pragma unroll
  for (int i = 0; i < lanes::WCH; ++i) {
    const int R = lanes_stage_row(warp, u, i), c = lanes_stage_chunk(warp, u, i);
    Ws[4 * c][R] = wr[i].x;
    Ws[4 * c + 1][R ^ 4] = wr[i].y;
    Ws[4 * c + 2][R ^ 8] = wr[i].z;
    Ws[4 * c + 3][R ^ 12] = wr[i].w;
  }
}

// The group tile of thread tid: the 4 groups of a warp form a 2 x 2 block of group tiles, the warps a
// 4 x 2 grid of those. gm counts group tiles along x (TM rows each), gn along w (TN rows each).
__device__ __forceinline__ int lanes_gm(int tid) {
  return ((tid >> 5) / (lanes::GN / 2)) * 2 + (((tid >> 3) & 3) >> 1);
}
__device__ __forceinline__ int lanes_gn(int tid) {
  return ((tid >> 5) % (lanes::GN / 2)) * 2 + (((tid >> 3) & 3) & 1);
}

}  // namespace dsv4::cuda::detail
