// Backward of the MoE router and experts on the GPU (kernels/grad.h), in the operation orders of the
// CPU reference kernels/cpu/grad_moe.cpp, with the shared arithmetic of kernels/detail/grad_moe.h.
//
// router_bwd_kernel: one thread per token runs common::router_backward_row over its row. The ids live
// on the device and are not scanned on the host: a row holding an id outside [0, E) gets NaN
// everywhere instead of reading out of bounds (the CPU check rejects such ids).
//
// moe_experts_backward: the ids are downloaded (the CPU check scans them: range, ascending per token)
// and the (token, slot) pairs q = t * k + i are listed per expert on the host in increasing q, as the
// CPU lists them; the lists go back to the device and every product is a GEMM whose elements are
// canonical dots, so a token's results do not depend on the other tokens. Per chunk of non-empty
// experts (bounded by the scratch of their transposed weights), grouped GEMMs (gather of token rows,
// scatter of output rows) form
//   G = bf16(x[tok] . w1^T), U = bf16(x[tok] . w3^T)     (the forward's GEMMs)
//   DA[r, i] = dot_D(dout[tok], w2[:, i])                  (w2 transposed: [I, D])
// swiglu_bwd_kernel turns G, U, DA in place into A (the forward's bf16 activation), dG and dU and
// writes dweights; then, for dx,
//   Y1[q, d] = dot_I(dG[r], w1[:, d]),  Y3[q, d] = dot_I(dU[r], w3[:, d])  (scatter to the pair's row).
// The weight gradients run per expert (their reduction length is the expert's token count): the
// gathered rows are transposed so that the token axis is innermost, one GEMM per weight into a
// staging buffer, and one add per element (dw2 = dot_m(dout[:, r], A[:, c]), dw1 / dw3 = dot_m(dG or
// dU [:, r], x[:, c])). The shared experts run the same steps over all tokens in order into Ys1, Ys3.
// dx_combine_kernel (one thread per (t, d)) sums, from an fp32 zero, (Y1 + Y3)[t * k + i] for i
// ascending (the CPU's expert order, since a token's ids ascend) and each shared expert's (Ys1 + Ys3)
// in order, then adds the sum to dx once.
#include <algorithm>
#include <cstdint>
#include <vector>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/grad.h"
#include "kernels/cuda/grad_common.cuh"
#include "kernels/detail/grad_moe.h"

namespace dsv4::cuda {

namespace {

constexpr int kThreads = 256, kRowsPerBlock = kThreads / 8;
// Bound (floats) of the transposed expert weights held at once (several experts share one chunk).
constexpr int64_t kWeightChunkFloats = int64_t(1) << 28;

#define DSV4_GRID_STRIDE(i, n)                                              \
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < (n); \
       i += int64_t(gridDim.x) * blockDim.x)

// ---- router -------------------------------------------------------------------------------------------

__global__ void __launch_bounds__(kThreads) router_bwd_kernel(RouterBwdParams p) {
  DSV4_GRID_STRIDE(t, p.T) {
    const int32_t* ids = p.ids + t * p.k;
    float* out = p.dlogits + t * p.E;
    bool ok = true;
    for (int i = 0; i < p.k; ++i) ok = ok && ids[i] >= 0 && ids[i] < p.E;
    if (!ok) {
      for (int e = 0; e < p.E; ++e) out[e] = common::quiet_nan();
      continue;
    }
    common::router_backward_row(p.logits + t * p.E, p.E, ids, p.k, p.dweights + t * p.k, p.norm_topk_prob,
                                p.routed_scaling_factor, out);
  }
}

// router_backward_check without the scan of the ids (they live on the device).
const char* router_backward_shape_check(const RouterBwdParams& p) {
  if (p.T < 0) return "router_backward: T < 0";
  if (p.E < 1) return "router_backward: E < 1";
  if (p.k < 1 || p.k > p.E) return "router_backward: k must be in [1, E]";
  if (p.T == 0) return nullptr;
  if (!p.logits || !p.ids || !p.dweights || !p.dlogits)
    return "router_backward: null logits, ids, dweights or dlogits";
  return nullptr;
}

// ---- experts ------------------------------------------------------------------------------------------

// 256 threads, one aligned group of 8 per row r < rows of G, U, DA [rows, I] (grid-stride). Row r is
// the pair q = src_q[r] with routing weight weights[q] (routed), or a token with no weight (src_q
// null: shared experts). With the forward's bf16 g, u in G, U and da in DA, writes in place
//   G = swiglu_act(g, u) (weighted), U = dg, DA = du    (common::swiglu_backward with dh = w * da or da)
// and, routed with dweights, dweights[q] = dot_I(da, swiglu_h(g, u)) (dweights[r] when dw_by_row).
// Lane l reads and writes only the elements i = l (mod 8), so in place is safe.
__global__ void __launch_bounds__(kThreads)
    swiglu_bwd_kernel(float* G, float* U, float* DA, int64_t rows, int64_t I, const float* weights,
                      const int32_t* src_q, bool clamp, float L, int block, float* dweights, bool dw_by_row) {
  const int lane = threadIdx.x & 7;
  const unsigned mask = detail::group8_mask();
  for (int64_t row = int64_t(blockIdx.x) * kRowsPerBlock + threadIdx.x / 8; row < rows;
       row += int64_t(gridDim.x) * kRowsPerBlock) {
    float* g = G + row * I;
    float* u = U + row * I;
    float* da = DA + row * I;
    const float* wr = src_q ? weights + src_q[row] : nullptr;
    if (wr && dweights) {  // uniform over the group
      const float dw = detail::dot8_by(I, block, lane, mask, [&](int64_t i, float& a, float& b) {
        a = da[i];
        b = common::swiglu_h(g[i], u[i], clamp, L);
      });
      if (lane == 0) dweights[dw_by_row ? row : src_q[row]] = dw;
    }
    for (int64_t i = lane; i < I; i += 8) {
      const float gi = g[i], ui = u[i], dai = da[i];
      const float dh = wr ? *wr * dai : dai;
      float dg, du;
      common::swiglu_backward(gi, ui, clamp, L, dh, dg, du);
      g[i] = common::swiglu_act(gi, ui, clamp, L, wr);
      u[i] = dg;
      da[i] = du;
    }
    __syncwarp(mask);
  }
}

// One thread per (t, d): dx[t, d] = dx[t, d] + acc with acc = 0, then acc = acc + (Y1 + Y3)[t * k + i, d]
// for i ascending, then acc = acc + (Ys1 + Ys3)[s, t, d] for the shared experts s in order.
__global__ void __launch_bounds__(kThreads)
    dx_combine_kernel(const float* Y1, const float* Y3, int64_t T, int k, int64_t D, const float* Ys1,
                      const float* Ys3, int n_shared, float* dx) {
  DSV4_GRID_STRIDE(e, T * D) {
    const int64_t t = e / D, d = e % D;
    float acc = 0.0f;
    for (int i = 0; i < k; ++i) {
      const int64_t o = (t * k + i) * D + d;
      acc = acc + (Y1[o] + Y3[o]);
    }
    for (int s = 0; s < n_shared; ++s) {
      const int64_t o = (int64_t(s) * T + t) * D + d;
      acc = acc + (Ys1[o] + Ys3[o]);
    }
    dx[e] = dx[e] + acc;
  }
}

// dw [n, kk] (+=) dot_m(a^T row r, b^T row c): at [n, m] and bt [kk, m] hold the columns of the two
// [m, *] operands with the token axis innermost; the GEMM writes `stage` [n, kk], then one add per element.
void weight_grad(int64_t m, int64_t n, int64_t kk, const float* at, const float* bt, float* stage, float* dw,
                 ReduceOrder order, cudaStream_t stream) {
  gemm(GemmParams{.m = n,
                  .n = kk,
                  .k = m,
                  .x = at,
                  .ldx = m,
                  .w = bt,
                  .ldw = m,
                  .y = stage,
                  .ldy = kk,
                  .round = OutRound::f32,
                  .order = order},
       stream);
  detail::store_block(dw, kk, stage, kk, n, kk, true, stream);
}

bool any_grad(const ExpertGrads* g) {
  return g && (g->dw1 || g->dw2 || g->dw3);
}

}  // namespace

// ---- router -------------------------------------------------------------------------------------------

void router_backward(const RouterBwdParams& p, cudaStream_t stream) {
  require(router_backward_shape_check(p), "router_backward");
  if (p.T <= 0) return;
  router_bwd_kernel<<<detail::grid_for(p.T, 128), 128, 0, stream>>>(p);
  DSV4_LAUNCH_CHECK();
}

// ---- experts ------------------------------------------------------------------------------------------

namespace {

// The pairs q of each expert in increasing q, from the ids downloaded and checked on the host (the full
// CPU check: it reads them and the host arrays of weights): start [E + 1] on the host, src_q and src_tok
// (= q / k) on the device.
class BwdLists {
 public:
  BwdLists(const MoeBwdParams& p, const char* op, cudaStream_t stream)
      : TK_(p.fwd.T * p.fwd.k), lists_(2 * TK_, stream), start(size_t(p.fwd.E) + 1, 0) {
    const MoeParams& f = p.fwd;
    std::vector<int32_t> ids;
    if (f.ids) {
      ids.resize(size_t(TK_));
      CUDA_CHECK(cudaMemcpyAsync(ids.data(), f.ids, sizeof(int32_t) * size_t(TK_), cudaMemcpyDeviceToHost, stream));
      CUDA_CHECK(cudaStreamSynchronize(stream));
    }
    MoeBwdParams hp = p;
    hp.fwd.ids = f.ids ? ids.data() : nullptr;
    require(dsv4::moe_experts_backward_check(hp), op);
    for (int64_t q = 0; q < TK_; ++q) ++start[size_t(ids[size_t(q)]) + 1];
    for (int e = 0; e < f.E; ++e) start[size_t(e) + 1] += start[size_t(e)];
    std::vector<int32_t> lists(size_t(2 * TK_));  // [0, TK): src_q; [TK, 2 TK): src_tok = q / k
    std::vector<int64_t> fill(start.begin(), start.end() - 1);
    for (int64_t q = 0; q < TK_; ++q) {
      const int64_t pos = fill[size_t(ids[size_t(q)])]++;
      lists[size_t(pos)] = int32_t(q);
      lists[size_t(TK_ + pos)] = int32_t(q / f.k);
    }
    CUDA_CHECK(cudaMemcpyAsync(lists_.get(), lists.data(), sizeof(int32_t) * size_t(2 * TK_), cudaMemcpyHostToDevice,
                               stream));
  }
  const int32_t* src_q() const { return lists_.get(); }
  const int32_t* src_tok() const { return lists_.get() + TK_; }

 private:
  int64_t TK_;
  detail::Scratch<int32_t> lists_;

 public:
  std::vector<int64_t> start;
};

// The routed experts [e0, e1) of moe_experts_backward: their weight gradients (+=), and each of their
// pairs' input-gradient halves (dG . w1 into Y1, dU . w3 into Y3; skipped when Y1 is null) and
// routing-weight gradient (into dw unless null): at the pair's slot q (to_slots: row q of Y1 / Y3,
// dw[q]) or compactly from the range's first pair (row r - start[e0]).
void routed_backward(const MoeBwdParams& p, const BwdLists& l, int e0, int e1, float* Y1, float* Y3, float* dw,
                     bool to_slots, cudaStream_t stream) {
  const MoeParams& f = p.fwd;
  const int64_t D = f.D, I = f.I;
  const ReduceOrder o = f.order;
  const float L = f.swiglu_limit;
  const int32_t* src_q = l.src_q();
  const int32_t* src_tok = l.src_tok();
  const int64_t a0 = l.start[size_t(e0)], rows = l.start[size_t(e1)] - a0;
  if (rows == 0) return;
  std::vector<int> used;  // non-empty experts, ascending
  int64_t mmax = 0;
  for (int e = e0; e < e1; ++e) {
    const int64_t m = l.start[size_t(e) + 1] - l.start[size_t(e)];
    if (m > 0) used.push_back(e);
    mmax = std::max(mmax, m);
  }
  // Rows of G, U, DA are the range's pairs from a0.
  detail::Scratch<float> gud(3 * rows * I, stream);
  float* G = gud.get();
  float* U = G + rows * I;
  float* DA = U + rows * I;
  {
    std::vector<detail::GemmProblem> g1, g3;
    for (const int e : used) {
      const int64_t b = l.start[size_t(e)], m = l.start[size_t(e) + 1] - b;
      detail::GemmProblem pr;
      pr.m = m;
      pr.x = f.x;
      pr.ldx = D;
      pr.xrow = src_tok + b;
      pr.ldw = D;
      pr.ldy = I;
      pr.w = f.experts[e].w1;
      pr.y = G + (b - a0) * I;
      g1.push_back(pr);
      pr.w = f.experts[e].w3;
      pr.y = U + (b - a0) * I;
      g3.push_back(pr);
    }
    const detail::GemmShape up{I, D, OutRound::bf16, o};
    detail::gemm_group(up, g1.data(), int(g1.size()), stream);
    detail::gemm_group(up, g3.data(), int(g3.size()), stream);
  }
  // Chunks of experts: w2^T [I, D], then (for dx) w1^T and w3^T [D, I] of each.
  const bool dx = Y1 != nullptr;
  const int64_t per = (dx ? 3 : 1) * I * D;
  const int64_t cap = std::max<int64_t>(1, kWeightChunkFloats / per);
  const int64_t nused = int64_t(used.size());
  detail::Scratch<float> wt(std::min(cap, nused) * per, stream);
  for (int64_t c0 = 0; c0 < nused; c0 += cap) {
    const int64_t n = std::min(cap, nused - c0);
    std::vector<detail::GemmProblem> pda, py1, py3;
    for (int64_t j = 0; j < n; ++j) {
      const int e = used[size_t(c0 + j)];
      const int64_t b = l.start[size_t(e)], m = l.start[size_t(e) + 1] - b;
      float* w2t = wt.get() + j * per;
      detail::transpose_rows(f.experts[e].w2, I, nullptr, D, 0, I, w2t, stream);
      detail::GemmProblem pr;
      pr.m = m;
      pr.x = p.dout;
      pr.ldx = D;
      pr.xrow = src_tok + b;
      pr.w = w2t;
      pr.ldw = D;
      pr.y = DA + (b - a0) * I;
      pr.ldy = I;
      pda.push_back(pr);
      if (dx) {
        float* w1t = w2t + I * D;
        float* w3t = w1t + I * D;
        detail::transpose_rows(f.experts[e].w1, D, nullptr, I, 0, D, w1t, stream);
        detail::transpose_rows(f.experts[e].w3, D, nullptr, I, 0, D, w3t, stream);
        detail::GemmProblem q;
        q.m = m;
        q.x = U + (b - a0) * I;  // dG after swiglu_bwd_kernel
        q.ldx = I;
        q.w = w1t;
        q.ldw = I;
        q.ldy = D;
        if (to_slots) {
          q.y = Y1;
          q.yrow = src_q + b;
        } else {
          q.y = Y1 + (b - a0) * D;
        }
        py1.push_back(q);
        q.x = DA + (b - a0) * I;  // dU
        q.w = w3t;
        q.y = to_slots ? Y3 : Y3 + (b - a0) * D;
        py3.push_back(q);
      }
    }
    detail::gemm_group(detail::GemmShape{I, D, OutRound::f32, o}, pda.data(), int(pda.size()), stream);
    const int64_t rb = l.start[size_t(used[size_t(c0)])], re = l.start[size_t(used[size_t(c0 + n - 1)]) + 1];
    swiglu_bwd_kernel<<<detail::grid_for(re - rb, kRowsPerBlock, 65535), kThreads, 0, stream>>>(
        G + (rb - a0) * I, U + (rb - a0) * I, DA + (rb - a0) * I, re - rb, I, f.weights, src_q + rb, true, L, o.block,
        dw && !to_slots ? dw + (rb - a0) : dw, !to_slots);
    DSV4_LAUNCH_CHECK();
    if (dx) {
      const detail::GemmShape down{D, I, OutRound::f32, o};
      detail::gemm_group(down, py1.data(), int(py1.size()), stream);
      detail::gemm_group(down, py3.data(), int(py3.size()), stream);
    }
  }
  // Weight gradients, expert by expert (A in G, dG in U, dU in DA).
  bool routed_grads = false;
  if (p.grads)
    for (const int e : used) routed_grads = routed_grads || any_grad(p.grads + e);
  if (!routed_grads) return;
  detail::Scratch<float> doutt(D * mmax, stream), xt(D * mmax, stream), ht(I * mmax, stream), stage(I * D, stream);
  for (const int e : used) {
    const ExpertGrads& gr = p.grads[e];
    if (!any_grad(&gr)) continue;
    const int64_t b = l.start[size_t(e)], m = l.start[size_t(e) + 1] - b;
    const int64_t r = b - a0;
    if (gr.dw2) {
      detail::transpose_rows(p.dout, D, src_tok + b, m, 0, D, doutt.get(), stream);
      detail::transpose_rows(G + r * I, I, nullptr, m, 0, I, ht.get(), stream);
      weight_grad(m, D, I, doutt.get(), ht.get(), stage.get(), gr.dw2, o, stream);
    }
    if (gr.dw1 || gr.dw3) detail::transpose_rows(f.x, D, src_tok + b, m, 0, D, xt.get(), stream);
    if (gr.dw1) {
      detail::transpose_rows(U + r * I, I, nullptr, m, 0, I, ht.get(), stream);
      weight_grad(m, I, D, ht.get(), xt.get(), stage.get(), gr.dw1, o, stream);
    }
    if (gr.dw3) {
      detail::transpose_rows(DA + r * I, I, nullptr, m, 0, I, ht.get(), stream);
      weight_grad(m, I, D, ht.get(), xt.get(), stage.get(), gr.dw3, o, stream);
    }
  }
}

// The shared experts (every token, in order; their weight gradients +=), then dx += the slot-order
// sum of Y1 + Y3 and the shared experts' halves (dx_combine_kernel); Y1 / Y3 [T * k, D] in slot order.
void shared_backward_and_dx(const MoeBwdParams& p, const float* Y1, const float* Y3, cudaStream_t stream) {
  const MoeParams& f = p.fwd;
  const int64_t T = f.T, D = f.D, I = f.I, k = f.k;
  const int64_t Is = f.I_shared > 0 ? f.I_shared : I;
  const ReduceOrder o = f.order;
  const float L = f.swiglu_limit;
  const int ns = f.n_shared;
  detail::Scratch<float> Ys(p.dx ? 2 * int64_t(ns) * T * D : 0, stream);
  float* Ys1 = Ys.get();
  float* Ys3 = p.dx ? Ys1 + int64_t(ns) * T * D : nullptr;
  if (ns > 0) {
    detail::Scratch<float> gus(3 * T * Is, stream), wts((p.dx ? 3 : 1) * Is * D, stream);
    float* Gs = gus.get();
    float* Us = Gs + T * Is;
    float* DAs = Us + T * Is;
    bool shared_grads = false;
    if (p.shared_grads)
      for (int s = 0; s < ns; ++s) shared_grads = shared_grads || any_grad(p.shared_grads + s);
    detail::Scratch<float> doutt(shared_grads ? D * T : 0, stream), xt(shared_grads ? D * T : 0, stream),
        ht(shared_grads ? Is * T : 0, stream), stage(shared_grads ? Is * D : 0, stream);
    if (shared_grads) {
      detail::transpose_rows(p.dout, D, nullptr, T, 0, D, doutt.get(), stream);
      detail::transpose_rows(f.x, D, nullptr, T, 0, D, xt.get(), stream);
    }
    for (int s = 0; s < ns; ++s) {
      const ExpertWeights& sw = f.shared[s];
      gemm(linear_params(T, Is, D, f.x, sw.w1, Gs, OutRound::bf16, o), stream);
      gemm(linear_params(T, Is, D, f.x, sw.w3, Us, OutRound::bf16, o), stream);
      float* w2t = wts.get();
      detail::transpose_rows(sw.w2, Is, nullptr, D, 0, Is, w2t, stream);  // [Is, D]
      gemm(linear_params(T, Is, D, p.dout, w2t, DAs, OutRound::f32, o), stream);
      swiglu_bwd_kernel<<<detail::grid_for(T, kRowsPerBlock, 65535), kThreads, 0, stream>>>(
          Gs, Us, DAs, T, Is, nullptr, nullptr, f.clamp_shared, L, o.block, nullptr, false);
      DSV4_LAUNCH_CHECK();
      if (p.dx) {
        float* w1t = w2t + Is * D;
        float* w3t = w1t + Is * D;
        detail::transpose_rows(sw.w1, D, nullptr, Is, 0, D, w1t, stream);  // [D, Is]
        detail::transpose_rows(sw.w3, D, nullptr, Is, 0, D, w3t, stream);
        gemm(linear_params(T, D, Is, Us, w1t, Ys1 + int64_t(s) * T * D, OutRound::f32, o), stream);
        gemm(linear_params(T, D, Is, DAs, w3t, Ys3 + int64_t(s) * T * D, OutRound::f32, o), stream);
      }
      const ExpertGrads* gr = p.shared_grads ? p.shared_grads + s : nullptr;
      if (!any_grad(gr)) continue;
      if (gr->dw2) {
        detail::transpose_rows(Gs, Is, nullptr, T, 0, Is, ht.get(), stream);
        weight_grad(T, D, Is, doutt.get(), ht.get(), stage.get(), gr->dw2, o, stream);
      }
      if (gr->dw1) {
        detail::transpose_rows(Us, Is, nullptr, T, 0, Is, ht.get(), stream);
        weight_grad(T, Is, D, ht.get(), xt.get(), stage.get(), gr->dw1, o, stream);
      }
      if (gr->dw3) {
        detail::transpose_rows(DAs, Is, nullptr, T, 0, Is, ht.get(), stream);
        weight_grad(T, Is, D, ht.get(), xt.get(), stage.get(), gr->dw3, o, stream);
      }
    }
  }

  if (!p.dx) return;
  dx_combine_kernel<<<detail::grid_for(T * D, kThreads), kThreads, 0, stream>>>(Y1, Y3, T, int(k), D, Ys1, Ys3,
                                                                               ns, p.dx);
  DSV4_LAUNCH_CHECK();
}

// One thread per (pair row j, d): dst[src_q[j] * D + d] = src[j * D + d].
__global__ void __launch_bounds__(kThreads)
    scatter_rows_kernel(const float* src, const int32_t* src_q, int64_t rows, int64_t D, float* dst) {
  DSV4_GRID_STRIDE(e, rows * D) dst[int64_t(src_q[e / D]) * D + e % D] = src[e];
}

}  // namespace

void moe_experts_backward(const MoeBwdParams& p, cudaStream_t stream) {
  const MoeParams& f = p.fwd;
  require(common::moe_check_dims(f), "moe_experts_backward");
  if (f.T <= 0) return;
  if (f.T * f.k > INT32_MAX) require("moe_backward: T * k is too large", "moe_experts_backward");
  const BwdLists l(p, "moe_experts_backward", stream);
  const int64_t TK = f.T * f.k;
  detail::Scratch<float> Y(p.dx ? 2 * TK * f.D : 0, stream);
  float* Y1 = p.dx ? Y.get() : nullptr;
  float* Y3 = p.dx ? Y.get() + TK * f.D : nullptr;
  routed_backward(p, l, 0, f.E, Y1, Y3, p.dweights, true, stream);
  shared_backward_and_dx(p, Y1, Y3, stream);
}

void moe_backward_routed(const MoeBwdParams& p, int e0, int e1, float* dx1_pairs, float* dx3_pairs, float* dw_pairs,
                         cudaStream_t stream) {
  const MoeParams& f = p.fwd;
  require(common::moe_check_dims(f), "moe_backward_routed");
  if (e0 < 0 || e1 < e0 || e1 > f.E) require("the expert range is outside [0, E)", "moe_backward_routed");
  if (f.T <= 0) return;
  if (f.T * f.k > INT32_MAX) require("moe_backward: T * k is too large", "moe_backward_routed");
  const BwdLists l(p, "moe_backward_routed", stream);
  routed_backward(p, l, e0, e1, p.dx ? dx1_pairs : nullptr, p.dx ? dx3_pairs : nullptr, dw_pairs, false, stream);
}

void moe_backward_combine(const MoeBwdParams& p, const float* dx1_pairs, const float* dx3_pairs, const float* dw_pairs,
                          cudaStream_t stream) {
  const MoeParams& f = p.fwd;
  require(common::moe_check_dims(f), "moe_backward_combine");
  if (f.T <= 0) return;
  if (f.T * f.k > INT32_MAX) require("moe_backward: T * k is too large", "moe_backward_combine");
  const BwdLists l(p, "moe_backward_combine", stream);
  const int64_t TK = f.T * f.k, D = f.D;
  if (p.dweights) {
    scatter_rows_kernel<<<detail::grid_for(TK, kThreads), kThreads, 0, stream>>>(dw_pairs, l.src_q(), TK, 1,
                                                                                  p.dweights);
    DSV4_LAUNCH_CHECK();
  }
  detail::Scratch<float> Y(p.dx ? 2 * TK * D : 0, stream);
  float* Y1 = p.dx ? Y.get() : nullptr;
  float* Y3 = p.dx ? Y.get() + TK * D : nullptr;
  if (p.dx) {
    scatter_rows_kernel<<<detail::grid_for(TK * D, kThreads), kThreads, 0, stream>>>(dx1_pairs, l.src_q(), TK, D, Y1);
    DSV4_LAUNCH_CHECK();
    scatter_rows_kernel<<<detail::grid_for(TK * D, kThreads), kThreads, 0, stream>>>(dx3_pairs, l.src_q(), TK, D, Y3);
    DSV4_LAUNCH_CHECK();
  }
  shared_backward_and_dx(p, Y1, Y3, stream);
}

}  // namespace dsv4::cuda
