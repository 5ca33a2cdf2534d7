// Backward of the MoE router and experts (kernels/grad.h, MODEL.md §5.3) in the operation orders
// documented there. Like the forward (kernels/cpu/moe.cpp), the (token, slot) pairs are gathered per
// expert in increasing token order and every product is a gemm / gemm_dx / gemm_dw whose elements are
// canonical dots, so a token's dx and dweights do not depend on the other tokens or the thread count,
// and an expert's weight gradient sums its tokens in increasing order.
#include <algorithm>
#include <cstdint>
#include <vector>

#include "kernels/detail/grad_moe.h"
#include "kernels/grad.h"
#include "kernels/linear.h"

namespace dsv4 {

namespace {

// Below this many elements a parallel region costs more than it saves (the split is over
// independent outputs, so results do not depend on it).
constexpr int64_t kParallelMin = int64_t(1) << 14;

// The (token, slot) pairs q = t * k + i of each expert, in increasing q: src[start[e] .. start[e+1]).
struct ExpertLists {
  std::vector<int64_t> start, src;
  int64_t mmax = 0;
};

ExpertLists group_by_expert(const int32_t* ids, int64_t TK, int E) {
  ExpertLists g;
  g.start.assign(size_t(E) + 1, 0);
  for (int64_t q = 0; q < TK; ++q) ++g.start[size_t(ids[q]) + 1];
  for (int e = 0; e < E; ++e) {
    g.mmax = std::max(g.mmax, g.start[size_t(e) + 1]);
    g.start[size_t(e) + 1] += g.start[size_t(e)];
  }
  std::vector<int64_t> fill(g.start.begin(), g.start.end() - 1);
  g.src.resize(size_t(TK));
  for (int64_t q = 0; q < TK; ++q) g.src[size_t(fill[size_t(ids[q])]++)] = q;
  return g;
}

// y [m, n] = x [m, k] . w [n, k]^T, fp32 or bf16 out, on dense rows.
void linear(int64_t m, int64_t n, int64_t k, const float* x, const float* w, float* y, OutRound round,
            ReduceOrder o) {
  gemm(linear_params(m, n, k, x, w, y, round, o));
}

// dx [m, k] = dy [m, n] . w [n, k] (column c of w gathered), overwritten.
void linear_dx(int64_t m, int64_t n, int64_t k, const float* dy, const float* w, float* dx, ReduceOrder o) {
  gemm_dx(GemmDxParams{.m = m,
                       .n = n,
                       .k = k,
                       .dy = dy,
                       .lddy = n,
                       .w = w,
                       .ldw = k,
                       .dx = dx,
                       .lddx = k,
                       .accumulate = false,
                       .order = o});
}

// dw [n, k] += dy [m, n]^T . x [m, k] over the m rows in order.
void linear_dw(int64_t m, int64_t n, int64_t k, const float* dy, const float* x, float* dw, ReduceOrder o) {
  gemm_dw(GemmDwParams{.m = m,
                       .n = n,
                       .k = k,
                       .dy = dy,
                       .lddy = n,
                       .x = x,
                       .ldx = k,
                       .dw = dw,
                       .lddw = k,
                       .accumulate = true,
                       .order = o});
}

// Scratch of one expert's backward, sized for the largest call.
struct ExpertScratch {
  std::vector<float> g, u, a, h, da, dg, du, t;
  void reserve(int64_t m, int64_t D, int64_t I) {
    for (auto* v : {&g, &u, &a, &h, &da, &dg, &du}) v->resize(std::max(v->size(), size_t(m * I)));
    t.resize(std::max(t.size(), size_t(m * D)));
  }
};

// One SwiGLU expert's backward on m contiguous rows xs [m, D] with output gradient dos [m, D]:
// recomputes g, u (bf16), a as the forward's swiglu_expert does; weight[r] is row r's routing weight
// (nullptr: shared expert). Writes dxe [m, D] (dot_I(dg, w1 col) + dot_I(du, w3 col); skipped when
// null), dwt [m] (dot_I(da, h); routed only, skipped when null) and adds the weight gradients.
void expert_backward(const ExpertWeights& ew, const ExpertGrads* gr, int64_t m, int64_t D, int64_t I,
                     const float* xs, const float* dos, const float* weight, bool clamp, float L,
                     ReduceOrder o, ExpertScratch& s, float* dxe, float* dwt) {
  float *g = s.g.data(), *u = s.u.data(), *a = s.a.data(), *h = s.h.data();
  float *da = s.da.data(), *dg = s.dg.data(), *du = s.du.data();
  linear(m, I, D, xs, ew.w1, g, OutRound::bf16, o);
  linear(m, I, D, xs, ew.w3, u, OutRound::bf16, o);
  linear_dx(m, D, I, dos, ew.w2, da, o);  // da[r, i] = dot_D(dout[r], w2[:, i])
#pragma omp parallel for schedule(static) if (m * I >= kParallelMin)
  for (int64_t r = 0; r < m; ++r) {
    const float* wr = weight ? weight + r : nullptr;
    const int64_t b = r * I;
    for (int64_t i = 0; i < I; ++i) {
      a[b + i] = common::swiglu_act(g[b + i], u[b + i], clamp, L, wr);
      h[b + i] = common::swiglu_h(g[b + i], u[b + i], clamp, L);
    }
    if (wr && dwt) dwt[r] = dot(da + b, h + b, I, o);
    for (int64_t i = 0; i < I; ++i) {
      const float dh = wr ? *wr * da[b + i] : da[b + i];
      common::swiglu_backward(g[b + i], u[b + i], clamp, L, dh, dg[b + i], du[b + i]);
    }
  }
  if (dxe) {
    float* t = s.t.data();
    linear_dx(m, I, D, dg, ew.w1, dxe, o);
    linear_dx(m, I, D, du, ew.w3, t, o);
#pragma omp parallel for schedule(static) if (m * D >= kParallelMin)
    for (int64_t i = 0; i < m * D; ++i) dxe[i] = dxe[i] + t[i];
  }
  if (gr) {
    if (gr->dw2) linear_dw(m, D, I, dos, a, gr->dw2, o);
    if (gr->dw1) linear_dw(m, I, D, dg, xs, gr->dw1, o);
    if (gr->dw3) linear_dw(m, I, D, du, xs, gr->dw3, o);
  }
}

}  // namespace

// ---- router -------------------------------------------------------------------------------------

const char* router_backward_check(const RouterBwdParams& p) {
  if (p.T < 0) return "router_backward: T < 0";
  if (p.E < 1) return "router_backward: E < 1";
  if (p.k < 1 || p.k > p.E) return "router_backward: k must be in [1, E]";
  if (p.T == 0) return nullptr;
  if (!p.logits || !p.ids || !p.dweights || !p.dlogits)
    return "router_backward: null logits, ids, dweights or dlogits";
  for (int64_t i = 0; i < p.T * p.k; ++i)
    if (p.ids[i] < 0 || p.ids[i] >= p.E) return "router_backward: expert id out of range";
  return nullptr;
}

void router_backward(const RouterBwdParams& p) {
  if (p.T <= 0) return;
#pragma omp parallel for schedule(static) if (p.T * p.E >= kParallelMin)
  for (int64_t t = 0; t < p.T; ++t)
    common::router_backward_row(p.logits + t * p.E, p.E, p.ids + t * p.k, p.k, p.dweights + t * p.k,
                                p.norm_topk_prob, p.routed_scaling_factor, p.dlogits + t * p.E);
}

// ---- experts ------------------------------------------------------------------------------------

const char* moe_experts_backward_check(const MoeBwdParams& p) {
  const MoeParams& f = p.fwd;
  if (const char* why = common::moe_check_dims(f)) return why;
  if (f.T == 0) return nullptr;
  if (!f.x || !f.ids || !f.weights || !f.experts) return "moe_backward: null x, ids, weights or experts";
  if (f.n_shared > 0 && !f.shared) return "moe_backward: null shared experts";
  if (!p.dout) return "moe_backward: dout is null";
  for (int64_t i = 0; i < f.T * f.k; ++i) {
    if (f.ids[i] < 0 || f.ids[i] >= f.E) return "moe_backward: expert id out of range";
    if (i % f.k != 0 && f.ids[i] < f.ids[i - 1]) return "moe_backward: the ids of a token must be ascending";
  }
  for (int e = 0; e < f.E; ++e)
    if (!f.experts[e].w1 || !f.experts[e].w3 || !f.experts[e].w2) return "moe_backward: null expert weights";
  for (int e = 0; e < f.n_shared; ++e)
    if (!f.shared[e].w1 || !f.shared[e].w3 || !f.shared[e].w2)
      return "moe_backward: null shared expert weights";
  return nullptr;
}

namespace {

// The backward of expert e's pairs (its list q[0..m)): weight gradients (+=), each pair's routing-weight
// gradient into dwt[r] and, with dxe, each pair's input gradient into row r of dxe.
void routed_backward(const MoeBwdParams& p, int e, const int64_t* q, int64_t m, ExpertScratch& s,
                     std::vector<float>& xs, std::vector<float>& dos, std::vector<float>& wgt, float* dxe,
                     float* dwt) {
  const MoeParams& f = p.fwd;
  const int64_t D = f.D, k = f.k;
#pragma omp parallel for schedule(static) if (m * D >= kParallelMin)
  for (int64_t r = 0; r < m; ++r) {
    const int64_t t = q[r] / k;
    std::copy(f.x + t * D, f.x + (t + 1) * D, xs.begin() + r * D);
    std::copy(p.dout + t * D, p.dout + (t + 1) * D, dos.begin() + r * D);
    wgt[size_t(r)] = f.weights[q[r]];
  }
  expert_backward(f.experts[e], p.grads ? p.grads + e : nullptr, m, D, f.I, xs.data(), dos.data(), wgt.data(), true,
                  f.swiglu_limit, f.order, s, dxe, dwt);
}

// acc[token of q[r]] += dxe row r, r increasing: a token listed twice (repeated id) adds in slot order.
// Split over dims, rows in order.
void add_pair_rows(const MoeParams& f, const int64_t* q, int64_t m, const float* dxe, float* acc) {
  const int64_t D = f.D, k = f.k;
#pragma omp parallel for schedule(static) if (m * D >= kParallelMin)
  for (int64_t d0 = 0; d0 < D; d0 += 64) {
    const int64_t d1 = std::min(D, d0 + 64);
    for (int64_t r = 0; r < m; ++r) {
      float* dst = acc + (q[r] / k) * D;
      const float* src = dxe + r * D;
      for (int64_t d = d0; d < d1; ++d) dst[d] += src[d];
    }
  }
}

// The shared experts (their gradients +=, their input gradients into acc), then dx += acc.
void shared_backward_and_dx(const MoeBwdParams& p, ExpertScratch& s, std::vector<float>& acc) {
  const MoeParams& f = p.fwd;
  const int64_t T = f.T, D = f.D;
  const int64_t Is = f.I_shared > 0 ? f.I_shared : f.I;
  std::vector<float> dxe(p.dx && f.n_shared > 0 ? size_t(T * D) : 0);
  for (int si = 0; si < f.n_shared; ++si) {
    expert_backward(f.shared[si], p.shared_grads ? p.shared_grads + si : nullptr, T, D, Is, f.x, p.dout, nullptr,
                    f.clamp_shared, f.swiglu_limit, f.order, s, p.dx ? dxe.data() : nullptr, nullptr);
    if (!p.dx) continue;
#pragma omp parallel for schedule(static) if (T * D >= kParallelMin)
    for (int64_t i = 0; i < T * D; ++i) acc[size_t(i)] += dxe[size_t(i)];
  }
  if (!p.dx) return;
#pragma omp parallel for schedule(static) if (T * D >= kParallelMin)
  for (int64_t i = 0; i < T * D; ++i) p.dx[i] = p.dx[i] + acc[size_t(i)];
}

}  // namespace

// acc[t] sums the token's terms from 0; a token's ids are ascending, so visiting the experts in
// increasing id adds its routed terms in slot order (a repeated id: its slots are consecutive in the
// expert's list, in slot order). moe_backward_routed + moe_backward_combine visit the same pairs in the
// same order.
void moe_experts_backward(const MoeBwdParams& p) {
  const MoeParams& f = p.fwd;
  if (f.T <= 0) return;
  const int64_t T = f.T, D = f.D, I = f.I;
  const int64_t Is = f.I_shared > 0 ? f.I_shared : I;
  const ExpertLists lists = group_by_expert(f.ids, T * f.k, f.E);
  const int64_t mmax = lists.mmax;
  ExpertScratch s;
  s.reserve(mmax, D, I);
  if (f.n_shared > 0) s.reserve(T, D, Is);
  std::vector<float> acc(p.dx ? size_t(T * D) : 0, 0.0f), xs(size_t(mmax * D)), dos(size_t(mmax * D)),
      wgt(static_cast<size_t>(mmax)), dwt(static_cast<size_t>(mmax)), dxe(p.dx ? size_t(mmax * D) : 0);
  for (int e = 0; e < f.E; ++e) {
    const int64_t b = lists.start[size_t(e)], m = lists.start[size_t(e) + 1] - b;
    if (m == 0) continue;
    const int64_t* q = lists.src.data() + b;
    routed_backward(p, e, q, m, s, xs, dos, wgt, p.dx ? dxe.data() : nullptr, p.dweights ? dwt.data() : nullptr);
    if (p.dweights)
      for (int64_t r = 0; r < m; ++r) p.dweights[q[r]] = dwt[size_t(r)];
    if (p.dx) add_pair_rows(f, q, m, dxe.data(), acc.data());
  }
  shared_backward_and_dx(p, s, acc);
}

void moe_backward_routed(const MoeBwdParams& p, int e0, int e1, float* dx_pairs, float* dw_pairs) {
  const MoeParams& f = p.fwd;
  if (f.T <= 0) return;
  const ExpertLists lists = group_by_expert(f.ids, f.T * f.k, f.E);
  const int64_t mmax = lists.mmax, D = f.D;
  ExpertScratch s;
  s.reserve(mmax, D, f.I);
  std::vector<float> xs(size_t(mmax * D)), dos(size_t(mmax * D)), wgt(static_cast<size_t>(mmax)),
      dwt(static_cast<size_t>(mmax));
  const int64_t a0 = lists.start[size_t(e0)];
  for (int e = e0; e < e1; ++e) {
    const int64_t b = lists.start[size_t(e)], m = lists.start[size_t(e) + 1] - b;
    if (m == 0) continue;
    routed_backward(p, e, lists.src.data() + b, m, s, xs, dos, wgt, dx_pairs ? dx_pairs + (b - a0) * D : nullptr,
                    dwt.data());
    std::copy(dwt.begin(), dwt.begin() + m, dw_pairs + (b - a0));
  }
}

void moe_backward_combine(const MoeBwdParams& p, const float* dx_pairs, const float* dw_pairs) {
  const MoeParams& f = p.fwd;
  if (f.T <= 0) return;
  const ExpertLists lists = group_by_expert(f.ids, f.T * f.k, f.E);
  const int64_t pairs = lists.start[size_t(f.E)];
  if (p.dweights)
    for (int64_t j = 0; j < pairs; ++j) p.dweights[lists.src[size_t(j)]] = dw_pairs[j];
  std::vector<float> acc(p.dx ? size_t(f.T * f.D) : 0, 0.0f);
  if (p.dx) add_pair_rows(f, lists.src.data(), pairs, dx_pairs, acc.data());
  ExpertScratch s;
  if (f.n_shared > 0) s.reserve(f.T, f.D, f.I_shared > 0 ? f.I_shared : f.I);
  shared_backward_and_dx(p, s, acc);
}

}  // namespace dsv4
