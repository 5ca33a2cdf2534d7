// MoE router and experts (MODEL.md §3.9) in the operation order documented in kernels/moe.h.
#include "kernels/moe.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "kernels/indexer.h"
#include "kernels/linear.h"
#include "kernels/numerics/numerics.h"

namespace dsv4 {

namespace {
// Below this many elements a parallel region costs more than it saves (the split is over
// independent outputs, so results do not depend on it).
constexpr int64_t kParallelMin = int64_t(1) << 14;
}  // namespace

const char* router_check(const RouterParams& p) {
  if (p.T < 0) return "router: T < 0";
  if (p.E < 1) return "router: E < 1";
  if (p.k < 1 || p.k > p.E) return "router: k must be in [1, E]";
  if (p.T == 0) return nullptr;
  if (!p.logits || !p.ids || !p.weights) return "router: null logits, ids or weights";
  if (p.tid2eid && !p.tokens) return "router: hash routing needs tokens";
  if (!p.tid2eid && !p.bias) return "router: learned routing needs bias";
  return nullptr;
}

void router(const RouterParams& p) {
  if (p.T <= 0) return;
  const int E = p.E, k = p.k;
  const float inf = std::numeric_limits<float>::infinity();
#pragma omp parallel if (p.T * E >= kParallelMin)
  {
    std::vector<float> s(static_cast<size_t>(E)), sel(static_cast<size_t>(E));
    std::vector<int32_t> scratch(static_cast<size_t>(E));
#pragma omp for schedule(static)
    for (int64_t t = 0; t < p.T; ++t) {
      const float* l = p.logits + t * E;
      for (int e = 0; e < E; ++e) s[size_t(e)] = std::sqrt(num::softplus_f(l[e]));
      if (p.scores) std::copy(s.begin(), s.end(), p.scores + t * E);
      int32_t* ids = p.ids + t * k;
      float margin = inf;
      if (p.tid2eid) {
        std::copy(p.tid2eid + int64_t(p.tokens[t]) * k, p.tid2eid + int64_t(p.tokens[t] + 1) * k, ids);
        std::sort(ids, ids + k);
      } else {
        for (int e = 0; e < E; ++e) sel[size_t(e)] = s[size_t(e)] + p.bias[e];
        if (p.forced) {
          std::copy(p.forced + t * k, p.forced + (t + 1) * k, ids);
          std::sort(ids, ids + k);
          if (k < E) {
            // worst forced minus best other on the selection score (negative: not the free choice).
            std::fill(scratch.begin(), scratch.end(), 0);
            for (int i = 0; i < k; ++i) scratch[size_t(ids[i])] = 1;
            float worst = inf, best = -inf;
            for (int e = 0; e < E; ++e) {
              const float v = sel[size_t(e)];
              if (scratch[size_t(e)])
                worst = v < worst ? v : worst;
              else
                best = v > best ? v : best;
            }
            margin = worst - best;
          }
        } else {
          margin = topk_row(sel.data(), E, k, ids, scratch.data());
        }
      }
      if (p.margin) p.margin[t] = margin;
      float* w = p.weights + t * k;
      float sum = 0.0f;
      for (int i = 0; i < k; ++i) sum += s[size_t(ids[i])];
      for (int i = 0; i < k; ++i) {
        const float si = s[size_t(ids[i])];
        w[i] = (p.norm_topk_prob ? si / sum : si) * p.routed_scaling_factor;
      }
    }
  }
}

const char* moe_check(const MoeParams& p) {
  if (p.T < 0) return "moe: T < 0";
  if (p.D < 1 || p.I < 1) return "moe: D and I must be >= 1";
  if (p.E < 1 || p.k < 1 || p.k > p.E) return "moe: need E >= 1 and 1 <= k <= E";
  if (p.n_shared < 0) return "moe: n_shared < 0";
  if (p.I_shared < 0) return "moe: I_shared < 0";
  if (p.order.block < 0 || p.order.block % 8 != 0)
    return "moe: reduce block must be 0 or a positive multiple of 8";
  if (p.T == 0) return nullptr;
  if (!p.x || !p.ids || !p.weights || !p.experts || !p.out) return "moe: null pointer";
  if (p.n_shared > 0 && !p.shared) return "moe: null shared experts";
  for (int64_t i = 0; i < p.T * p.k; ++i) {
    if (p.ids[i] < 0 || p.ids[i] >= p.E) return "moe: expert id out of range";
    if (i % p.k != 0 && p.ids[i] < p.ids[i - 1]) return "moe: the ids of a token must be ascending";
  }
  for (int e = 0; e < p.E; ++e)
    if (!p.experts[e].w1 || !p.experts[e].w3 || !p.experts[e].w2) return "moe: null expert weights";
  for (int e = 0; e < p.n_shared; ++e)
    if (!p.shared[e].w1 || !p.shared[e].w3 || !p.shared[e].w2) return "moe: null shared expert weights";
  return nullptr;
}

namespace {

GemmParams linear(int64_t m, int64_t n, int64_t k, const float* x, const float* w, float* y, OutRound r,
                  ReduceOrder o) {
  GemmParams g;
  g.m = m;
  g.n = n;
  g.k = k;
  g.x = x;
  g.ldx = k;
  g.w = w;
  g.ldw = k;
  g.y = y;
  g.ldy = n;
  g.round = r;
  g.order = o;
  return g;
}

// One SwiGLU expert on m contiguous rows xs [m, D]: out [m, D] fp32. weight[r] scales row r's
// activation (nullptr: shared expert, no weight). gu is scratch for [2, m, I].
void swiglu_expert(const ExpertWeights& ew, int64_t m, int64_t D, int64_t I, const float* xs,
                   const float* weight, bool clamp, float L, ReduceOrder o, float* gu, float* out) {
  float* g = gu;
  float* u = gu + m * I;
  gemm(linear(m, I, D, xs, ew.w1, g, OutRound::bf16, o));
  gemm(linear(m, I, D, xs, ew.w3, u, OutRound::bf16, o));
  const bool do_clamp = clamp && L > 0.0f;
#pragma omp parallel for schedule(static) if (m * I >= kParallelMin)
  for (int64_t r = 0; r < m; ++r) {
    for (int64_t i = 0; i < I; ++i) {
      float gv = g[r * I + i], uv = u[r * I + i];
      if (do_clamp) {
        gv = gv > L ? L : gv;
        uv = uv > L ? L : (uv < -L ? -L : uv);
      }
      const float h = num::silu_f(gv) * uv;
      g[r * I + i] = num::bf16_round(weight ? weight[r] * h : h);  // a overwrites g in place
    }
  }
  gemm(linear(m, D, I, g, ew.w2, out, OutRound::f32, o));
}

}  // namespace

void moe_experts(const MoeParams& p) {
  if (p.T <= 0) return;
  const int64_t T = p.T, D = p.D, I = p.I, k = p.k, TK = T * k;
  const int E = p.E;

  // Group the (token, slot) pairs q = t * k + i per expert, in increasing q.
  std::vector<int64_t> start(size_t(E) + 1, 0);
  for (int64_t q = 0; q < TK; ++q) ++start[size_t(p.ids[q]) + 1];
  int64_t mmax = 0;
  for (int e = 0; e < E; ++e) {
    mmax = std::max(mmax, start[size_t(e) + 1]);
    start[size_t(e) + 1] += start[size_t(e)];
  }
  std::vector<int64_t> fill(start.begin(), start.end() - 1), src(static_cast<size_t>(TK));
  for (int64_t q = 0; q < TK; ++q) src[size_t(fill[size_t(p.ids[q])]++)] = q;

  // A token's ids are ascending, so visiting the experts in increasing id adds its routed outputs
  // to its accumulator in slot order, as the contract asks, without keeping them all.
  const int64_t Is = p.I_shared > 0 ? p.I_shared : I;
  const int64_t rows = std::max(mmax, p.n_shared > 0 ? T : int64_t(0));
  std::vector<float> acc(size_t(T * D), 0.0f), xs(size_t(mmax * D)), wgt(static_cast<size_t>(mmax)),
      gu(size_t(2 * std::max(mmax * I, p.n_shared > 0 ? T * Is : int64_t(0)))), y(size_t(rows * D));
  for (int e = 0; e < E; ++e) {
    const int64_t a = start[size_t(e)], m = start[size_t(e) + 1] - a;
    if (m == 0) continue;
    const int64_t* q = src.data() + a;
#pragma omp parallel for schedule(static) if (m * D >= kParallelMin)
    for (int64_t r = 0; r < m; ++r) {
      std::copy(p.x + (q[r] / k) * D, p.x + (q[r] / k + 1) * D, xs.begin() + r * D);
      wgt[size_t(r)] = p.weights[q[r]];
    }
    swiglu_expert(p.experts[e], m, D, I, xs.data(), wgt.data(), true, p.swiglu_limit, p.order, gu.data(),
                  y.data());
    // Split over dims, rows in order: a token listed twice (repeated id) still adds in slot order.
#pragma omp parallel for schedule(static) if (m * D >= kParallelMin)
    for (int64_t d0 = 0; d0 < D; d0 += 64) {
      const int64_t d1 = std::min(D, d0 + 64);
      for (int64_t r = 0; r < m; ++r) {
        float* dst = acc.data() + (q[r] / k) * D;
        const float* ys = y.data() + r * D;
        for (int64_t d = d0; d < d1; ++d) dst[d] += ys[d];
      }
    }
  }
  for (int sidx = 0; sidx < p.n_shared; ++sidx) {
    swiglu_expert(p.shared[sidx], T, D, Is, p.x, nullptr, p.clamp_shared, p.swiglu_limit, p.order, gu.data(),
                  y.data());
#pragma omp parallel for schedule(static) if (T * D >= kParallelMin)
    for (int64_t i = 0; i < T * D; ++i) acc[size_t(i)] += y[size_t(i)];
  }
#pragma omp parallel for schedule(static) if (T * D >= kParallelMin)
  for (int64_t i = 0; i < T * D; ++i) p.out[i] = num::bf16_round(acc[size_t(i)]);
}

}  // namespace dsv4
