// MoE router and experts on the GPU in the operation order of kernels/moe.h.
//
// router_kernel: one thread per token (grid-stride). s_e = sqrt(softplus_f(logit_e)); hash, forced and
// learned routing exactly as kernels/cpu/moe.cpp; the learned top-k picks the best remaining expert
// k times (k + 1 for the margin) under topk_row's strict total order, which selects the same set and
// the same worst-chosen / best-unchosen pair as the CPU's nth_element; ids are then sorted ascending.
//
// moe_experts: the (token, slot) pairs q = t * k + i are grouped per expert on the device (one block
// per expert counts and then lists its pairs in increasing q with a block prefix sum: no atomics);
// the counts come back to the host, which launches grouped GEMMs over the non-empty experts:
//   G = bf16(x[tok] . w1^T), U = bf16(x[tok] . w3^T)  (gather of token rows),
//   A = bf16(w * (silu_f(clamp G) * clamp U))          (swiglu_kernel, element-wise),
//   Y[q] = A . w2^T (fp32)                              (scatter to the pair's row).
// The shared experts run the same steps over all tokens into Ys. In the tensor_core order the GEMMs'
// bf16 copies of x and of A are made once by this file (x gathered for both w1 and w3, A written by the
// activation), not by each GEMM call: the same values, so the same bits. combine_kernel (one thread per
// (t, d)) then adds, from an fp32 zero, Y[t*k + i] for i ascending (the CPU's expert order, since a
// token's ids ascend) and each shared expert's Ys in order, and rounds to bf16. Every GEMM element
// has the canonical order, so a token's result does not depend on which tokens share its expert.
//
// Expert parallelism uses the same steps in parts (kernels/cuda/ops.h): routed_outputs over a range of
// experts writes its pairs' rows compactly instead of scattering them, moe_scatter_pairs puts the
// gathered rows of every range back in slot order, and moe_combine is the shared experts plus
// combine_kernel; moe_experts is routed_outputs over [0, E) scattering directly, then moe_combine.
#include <vector>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/mma.cuh"
#include "kernels/cuda/xxh3_sums.cuh"
#include "kernels/detail/indexer.h"
#include "kernels/detail/moe.h"

namespace dsv4::cuda {

namespace {

constexpr int kThreads = 256, kMaxK = 64;

__global__ void __launch_bounds__(kThreads) router_kernel(RouterParams p, float* s_all) {
  const int E = p.E, k = p.k;
  const float inf = __int_as_float(0x7f800000);
  for (int64_t t = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; t < p.T;
       t += int64_t(gridDim.x) * blockDim.x) {
    const float* l = p.logits + t * E;
    float* s = s_all + t * E;
    for (int e = 0; e < E; ++e) s[e] = common::router_score(l[e]);
    int32_t ids[kMaxK];
    float margin = inf;
    if (p.tid2eid) {
      for (int i = 0; i < k; ++i) ids[i] = p.tid2eid[int64_t(p.tokens[t]) * k + i];
      common::sort_ids(ids, k);
    } else if (p.forced) {
      for (int i = 0; i < k; ++i) ids[i] = p.forced[t * k + i];
      common::sort_ids(ids, k);
      margin = common::router_forced_margin(s, p.bias, E, ids, k);
    } else {
      const int picks = k < E ? k + 1 : k;
      int32_t extra = -1;
      for (int n = 0; n < picks; ++n) {
        int best = -1;
        float bv = 0.0f;
        for (int e = 0; e < E; ++e) {
          bool taken = false;
          for (int i = 0; i < n && i < k; ++i) taken |= ids[i] == e;
          if (taken) continue;
          const float v = s[e] + p.bias[e];
          if (best < 0 || common::ranks_before(v, e, bv, best)) best = e, bv = v;
        }
        if (n < k)
          ids[n] = best;
        else
          extra = best;
      }
      if (k < E) margin = (s[ids[k - 1]] + p.bias[ids[k - 1]]) - (s[extra] + p.bias[extra]);
      common::sort_ids(ids, k);
    }
    if (p.margin) p.margin[t] = margin;
    for (int i = 0; i < k; ++i) p.ids[t * k + i] = ids[i];
    common::router_weights(s, ids, k, p.norm_topk_prob, p.routed_scaling_factor, p.weights + t * k);
  }
}

// Grid: one block per expert. count[e] = #{q : ids[q] == e}.
__global__ void __launch_bounds__(kThreads)
    expert_count_kernel(const int32_t* ids, int64_t TK, int64_t* count) {
  __shared__ int64_t red[32];
  int64_t c = 0;
  for (int64_t q = threadIdx.x; q < TK; q += kThreads) c += ids[q] == int32_t(blockIdx.x);
  c = detail::block_sum(c, red);
  if (threadIdx.x == 0) count[blockIdx.x] = c;
}

// Grid: one block per expert. Lists the pairs of expert e in increasing q at src_q[start[e]...],
// with their token rows in src_tok. start[] is the exclusive prefix sum of count[] (sequential).
__global__ void __launch_bounds__(kThreads)
    expert_list_kernel(const int32_t* ids, int64_t TK, int k, const int64_t* count, int E, int32_t* src_q,
                       int32_t* src_tok) {
  __shared__ int64_t red[32];
  int64_t start = 0;
  for (int e = 0; e < int(blockIdx.x); ++e) start += count[e];
  const int64_t chunk = (TK + kThreads - 1) / kThreads, lo = threadIdx.x * chunk;
  const int64_t hi = lo + chunk < TK ? lo + chunk : TK;
  int64_t mine = 0;
  for (int64_t q = lo; q < hi; ++q) mine += ids[q] == int32_t(blockIdx.x);
  int64_t total = 0;
  int64_t pos = start + detail::block_exclusive_scan(mine, red, &total);
  for (int64_t q = lo; q < hi; ++q)
    if (ids[q] == int32_t(blockIdx.x)) {
      src_q[pos] = int32_t(q);
      src_tok[pos] = int32_t(q / k);
      ++pos;
    }
  (void)E;
}

// One thread per (row r, i): a = bf16(w * (silu_f(g) * u)) with the clamps, written over g.
// weight == nullptr: no weight (shared experts); else the pair's routing weight weights[src_q[r]].
// The clamps apply when do_clamp and L > 0, as on the CPU.
__global__ void __launch_bounds__(kThreads)
    swiglu_kernel(float* g, const float* u, int64_t rows, int64_t I, const float* weights,
                  const int32_t* src_q, bool do_clamp, float L) {
  for (int64_t e = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; e < rows * I;
       e += int64_t(gridDim.x) * blockDim.x) {
    g[e] = common::swiglu_act(g[e], u[e], do_clamp, L, weights ? weights + src_q[e / I] : nullptr);
  }
}

// The same activation written as the w2 GEMM's bf16 copy of A (tensor_core order): a16 rows of width
// values, zeros past I. A is a bf16 value already, so the copy holds it exactly.
__global__ void __launch_bounds__(kThreads)
    swiglu_bf16_kernel(const float* g, const float* u, int64_t rows, int64_t I, const float* weights,
                       const int32_t* src_q, bool do_clamp, float L, __nv_bfloat16* a16, int64_t width) {
  for (int64_t e = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; e < rows * width;
       e += int64_t(gridDim.x) * blockDim.x) {
    const int64_t r = e / width, i = e - r * width;
    const float a =
        i < I ? common::swiglu_act(g[r * I + i], u[r * I + i], do_clamp, L, weights ? weights + src_q[r] : nullptr)
              : 0.0f;
    a16[e] = __float2bfloat16_rn(a);
  }
}

// A of rows x I: into g in place (fp32), or, with a16, as the w2 GEMM's bf16 copy (width values a row).
void activation(float* g, const float* u, int64_t rows, int64_t I, const float* weights, const int32_t* src_q,
                bool do_clamp, float L, __nv_bfloat16* a16, int64_t width, cudaStream_t stream) {
  if (a16)
    swiglu_bf16_kernel<<<detail::grid_for(rows * width, kThreads), kThreads, 0, stream>>>(g, u, rows, I, weights, src_q,
                                                                                        do_clamp, L, a16, width);
  else
    swiglu_kernel<<<detail::grid_for(rows * I, kThreads), kThreads, 0, stream>>>(g, u, rows, I, weights, src_q,
                                                                                   do_clamp, L);
  DSV4_LAUNCH_CHECK();
}

// The same for a warp per 512 consecutive d of a token (D % 512 == 0, rows 16-byte aligned), lane l
// the 4 d at 4 (l + 32 i), i < 4, with the chunk's block sums into sums (kernels/row_sums.h) when asked.
__global__ void __launch_bounds__(kThreads)
    combine_blocks_kernel(const float* Y, int64_t T, int k, int64_t D, const float* Ys, int n_shared,
                          float* out, uint64_t* sums) {
  constexpr int kW = sums::kWordsPerLane;
  const int lane = threadIdx.x & 31;
  const int64_t chunks = D / xxh3::kSumRowValues, D4 = D / 4;
  const int64_t warps = int64_t(gridDim.x) * (blockDim.x / 32);
  for (int64_t wi = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) / 32; wi < T * chunks; wi += warps) {
    const int64_t t = wi / chunks, c = wi - t * chunks, q0 = c * 128 + lane;
    float4 acc[kW];
#pragma unroll
    for (int i = 0; i < kW; ++i) acc[i] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    auto add = [&](const float* rows) {
      float4 v[kW];
#pragma unroll
      for (int i = 0; i < kW; ++i) v[i] = reinterpret_cast<const float4*>(rows)[q0 + 32 * i];
#pragma unroll
      for (int i = 0; i < kW; ++i)
        acc[i] = make_float4(acc[i].x + v[i].x, acc[i].y + v[i].y, acc[i].z + v[i].z, acc[i].w + v[i].w);
    };
    for (int i = 0; i < k; ++i) add(Y + (t * k + i) * D);
    for (int s = 0; s < n_shared; ++s) add(Ys + (int64_t(s) * T + t) * D);
    uint64_t words[kW];
#pragma unroll
    for (int i = 0; i < kW; ++i) {
      const float4 o = make_float4(num::bf16_round(acc[i].x), num::bf16_round(acc[i].y),
                                   num::bf16_round(acc[i].z), num::bf16_round(acc[i].w));
      reinterpret_cast<float4*>(out + t * D4 * 4)[q0 + 32 * i] = o;
      words[i] = sums::bf16_word(o);
    }
    if (sums) sums::warp_block_sums(words, c == chunks - 1, lane, sums + wi * 8);
  }
}

// One thread per (t, d): out = bf16(((0 + Y[t,0]) + Y[t,1]) ... + Ys[0][t] + ...).
__global__ void __launch_bounds__(kThreads)
    combine_kernel(const float* Y, int64_t T, int k, int64_t D, const float* Ys, int n_shared, float* out) {
  for (int64_t e = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; e < T * D;
       e += int64_t(gridDim.x) * blockDim.x) {
    const int64_t t = e / D, d = e % D;
    float acc = 0.0f;
    for (int i = 0; i < k; ++i) acc = acc + Y[(t * k + i) * D + d];
    for (int s = 0; s < n_shared; ++s) acc = acc + Ys[(int64_t(s) * T + t) * D + d];
    out[e] = num::bf16_round(acc);
  }
}

}  // namespace

void router(const RouterParams& p, cudaStream_t stream) {
  require(dsv4::router_check(p), "router");
  if (p.T <= 0) return;
  if (p.k > kMaxK) require("k is larger than 64", "router");
  detail::Scratch<float> s(p.scores ? 0 : p.T * p.E, stream);
  router_kernel<<<detail::grid_for(p.T, 128), 128, 0, stream>>>(p, p.scores ? p.scores : s.get());
  DSV4_LAUNCH_CHECK();
}

const char* moe_check(const MoeParams& p) {
  if (const char* why = common::moe_check_dims(p)) return why;
  if (p.T * p.k > INT32_MAX) return "moe: T * k is too large";
  if (p.T == 0) return nullptr;
  if (const char* why = common::moe_check_pointers(p)) return why;
  return common::moe_check_expert_weights(p);
}

namespace {

// The (token, slot) pairs grouped per expert, as moe_experts runs them: count[e] (device and host),
// and src_q / src_tok listing each expert's pairs (q increasing, experts in order) and their tokens.
struct PairLists {
  PairLists(const MoeParams& p, cudaStream_t stream)
      : count(p.E, stream), src_q(p.T * p.k, stream), src_tok(p.T * p.k, stream), host(size_t(p.E)) {
    const int64_t TK = p.T * p.k;
    expert_count_kernel<<<p.E, kThreads, 0, stream>>>(p.ids, TK, count.get());
    DSV4_LAUNCH_CHECK();
    expert_list_kernel<<<p.E, kThreads, 0, stream>>>(p.ids, TK, p.k, count.get(), p.E, src_q.get(), src_tok.get());
    DSV4_LAUNCH_CHECK();
    CUDA_CHECK(cudaMemcpyAsync(host.data(), count.get(), sizeof(int64_t) * size_t(p.E), cudaMemcpyDeviceToHost,
                               stream));
    CUDA_CHECK(cudaStreamSynchronize(stream));
  }
  // The first pair of expert e in the lists (e = E: the number of pairs with a valid expert).
  int64_t start(int e) const {
    int64_t a = 0;
    for (int x = 0; x < e; ++x) a += host[size_t(x)];
    return a;
  }
  detail::Scratch<int64_t> count;
  detail::Scratch<int32_t> src_q, src_tok;
  std::vector<int64_t> host;
};

// The routed outputs y_i(t) (fp32) of the pairs of experts [e0, e1): row of pair q at y + q * D
// (to_slots) or, compact, the lists' order from y. In the tensor_core order the GEMMs' bf16 copies of
// their x are made here once: the gathered token rows for both w1 and w3, and A by the activation
// itself (the same values the GEMMs would copy, so the same bits).
void routed_outputs(const MoeParams& p, const PairLists& l, int e0, int e1, float* y, bool to_slots,
                    cudaStream_t stream) {
  const int64_t D = p.D, I = p.I;
  const int64_t a0 = l.start(e0), rows = l.start(e1) - a0;
  if (rows == 0) return;
  detail::Scratch<float> gu(2 * rows * I, stream);
  float* G = gu.get();
  float* U = gu.get() + rows * I;
  const bool tc = p.order.tensor_core;
  const int64_t wD = tc ? detail::gemm_bf16_width(D) : 0, wI = tc ? detail::gemm_bf16_width(I) : 0;
  detail::Scratch<__nv_bfloat16> x16(rows * wD, stream), a16(rows * wI, stream);
  if (tc) detail::gathered_rows_to_bf16(p.x, D, l.src_tok.get() + a0, rows, D, int(wD), x16.get(), stream);
  std::vector<detail::GemmProblem> g1, g3, g2;
  int64_t a = 0;
  for (int e = e0; e < e1; ++e) {
    const int64_t m = l.host[size_t(e)];
    if (m > 0) {
      detail::GemmProblem pr;
      pr.m = m;
      pr.x = p.x;
      pr.ldx = D;
      pr.xrow = l.src_tok.get() + a0 + a;
      if (tc) pr.x16 = x16.get() + a * wD;
      pr.ldw = D;
      pr.ldy = I;
      pr.y = G + a * I;
      pr.w = p.experts[e].w1;
      g1.push_back(pr);
      pr.y = U + a * I;
      pr.w = p.experts[e].w3;
      g3.push_back(pr);
      detail::GemmProblem down;
      down.m = m;
      down.x = G + a * I;
      down.ldx = I;
      if (tc) down.x16 = a16.get() + a * wI;
      down.w = p.experts[e].w2;
      down.ldw = I;
      down.ldy = D;
      if (to_slots) {
        down.y = y;
        down.yrow = l.src_q.get() + a0 + a;
      } else {
        down.y = y + a * D;
      }
      g2.push_back(down);
    }
    a += m;
  }
  detail::gemm_group(detail::GemmShape{I, D, OutRound::bf16, p.order}, g1.data(), int(g1.size()), stream);
  detail::gemm_group(detail::GemmShape{I, D, OutRound::bf16, p.order}, g3.data(), int(g3.size()), stream);
  activation(G, U, rows, I, p.weights, l.src_q.get() + a0, true, p.swiglu_limit, tc ? a16.get() : nullptr, wI,
             stream);
  detail::gemm_group(detail::GemmShape{D, I, common::expert_output_round(p), p.order}, g2.data(), int(g2.size()),
                     stream);
}

// One thread per (pair row j, d): y_slot[src_q[j]] = y_pairs[j].
__global__ void __launch_bounds__(kThreads)
    scatter_pairs_kernel(const float* y_pairs, const int32_t* src_q, int64_t rows, int64_t D, float* y_slot) {
  for (int64_t e = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; e < rows * D;
       e += int64_t(gridDim.x) * blockDim.x)
    y_slot[int64_t(src_q[e / D]) * D + e % D] = y_pairs[e];
}

}  // namespace

void moe_experts(const MoeParams& p, cudaStream_t stream) {
  require(cuda::moe_check(p), "moe_experts");
  if (p.T <= 0) return;
  const PairLists l(p, stream);
  detail::Scratch<float> Y(p.T * p.k * p.D, stream);
  // Pairs whose id is outside [0, E) belong to no expert: their rows of Y stay 0.
  CUDA_CHECK(cudaMemsetAsync(Y.get(), 0, sizeof(float) * size_t(p.T * p.k * p.D), stream));
  routed_outputs(p, l, 0, p.E, Y.get(), true, stream);
  moe_combine(p, Y.get(), p.out, stream);
}

std::vector<int64_t> moe_expert_counts(const MoeParams& p, cudaStream_t stream) {
  require(cuda::moe_check(p), "moe_expert_counts");
  if (p.T <= 0) return std::vector<int64_t>(size_t(p.E), 0);
  return PairLists(p, stream).host;
}

void moe_routed_outputs(const MoeParams& p, int e0, int e1, float* y, cudaStream_t stream) {
  require(cuda::moe_check(p), "moe_routed_outputs");
  if (e0 < 0 || e1 < e0 || e1 > p.E) require("the expert range is outside [0, E)", "moe_routed_outputs");
  if (p.T <= 0) return;
  routed_outputs(p, PairLists(p, stream), e0, e1, y, false, stream);
}

void moe_scatter_pairs(const MoeParams& p, const float* y_pairs, float* y_slot, cudaStream_t stream) {
  require(cuda::moe_check(p), "moe_scatter_pairs");
  if (p.T <= 0) return;
  const PairLists l(p, stream);
  CUDA_CHECK(cudaMemsetAsync(y_slot, 0, sizeof(float) * size_t(p.T * p.k * p.D), stream));
  const int64_t rows = l.start(p.E);
  if (rows == 0) return;
  scatter_pairs_kernel<<<detail::grid_for(rows * p.D, kThreads), kThreads, 0, stream>>>(y_pairs, l.src_q.get(),
                                                                                          rows, p.D, y_slot);
  DSV4_LAUNCH_CHECK();
}

void moe_combine(const MoeParams& p, const float* y_slot, float* out, cudaStream_t stream) {
  if (p.T <= 0) return;
  const int64_t T = p.T, D = p.D, I = p.I;
  const int64_t Is = p.I_shared > 0 ? p.I_shared : I;
  detail::Scratch<float> gus(p.n_shared > 0 ? 2 * T * Is : 0, stream), Ys(int64_t(p.n_shared) * T * D, stream);
  // In the tensor_core order x's bf16 copy is made once for every shared expert's w1 and w3, and A's
  // by the activation (as in routed_outputs).
  const bool tc = p.order.tensor_core && p.n_shared > 0;
  const int64_t wD = tc ? detail::gemm_bf16_width(D) : 0, wI = tc ? detail::gemm_bf16_width(Is) : 0;
  detail::Scratch<__nv_bfloat16> x16(T * wD, stream), a16(T * wI, stream);
  if (tc) detail::rows_to_bf16(p.x, T, D, int(wD), x16.get(), stream);
  for (int s = 0; s < p.n_shared; ++s) {
    float* Gs = gus.get();
    float* Us = gus.get() + T * Is;
    detail::GemmProblem up;
    up.m = T, up.x = p.x, up.ldx = D, up.x16 = tc ? x16.get() : nullptr, up.ldw = D, up.ldy = Is;
    up.w = p.shared[s].w1, up.y = Gs;
    detail::gemm_group(detail::GemmShape{Is, D, OutRound::bf16, p.order}, &up, 1, stream);
    up.w = p.shared[s].w3, up.y = Us;
    detail::gemm_group(detail::GemmShape{Is, D, OutRound::bf16, p.order}, &up, 1, stream);
    activation(Gs, Us, T, Is, nullptr, nullptr, p.clamp_shared, p.swiglu_limit, tc ? a16.get() : nullptr, wI, stream);
    detail::GemmProblem down;
    down.m = T, down.x = Gs, down.ldx = Is, down.x16 = tc ? a16.get() : nullptr, down.w = p.shared[s].w2;
    down.ldw = Is, down.y = Ys.get() + int64_t(s) * T * D, down.ldy = D;
    detail::gemm_group(detail::GemmShape{D, Is, common::expert_output_round(p), p.order}, &down, 1, stream);
  }
  const bool blocks = D % xxh3::kSumRowValues == 0 && reinterpret_cast<uintptr_t>(y_slot) % 16 == 0 &&
                      reinterpret_cast<uintptr_t>(Ys.get()) % 16 == 0 &&
                      reinterpret_cast<uintptr_t>(out) % 16 == 0;
  if (blocks) {
    combine_blocks_kernel<<<detail::grid_for(T * (D / xxh3::kSumRowValues), kThreads / 32), kThreads, 0,
                            stream>>>(y_slot, T, p.k, D, Ys.get(), p.n_shared, out, p.out_sums);
  } else {
    combine_kernel<<<detail::grid_for(T * D, kThreads), kThreads, 0, stream>>>(y_slot, T, p.k, D, Ys.get(),
                                                                               p.n_shared, out);
  }
  DSV4_LAUNCH_CHECK();
  if (p.out_sums && !blocks) row_sums_bf16(out, T, D, D, p.out_sums, stream);
}

}  // namespace dsv4::cuda
