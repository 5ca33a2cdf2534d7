// MoE router and experts (MODEL.md §3.9) in the operation order documented in kernels/moe.h.
#include "kernels/moe.h"

#include <algorithm>
#include <limits>
#include <string>
#include <vector>

#include "kernels/detail/moe.h"
#include "kernels/error.h"
#include "kernels/indexer.h"
#include "kernels/linear.h"

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
      for (int e = 0; e < E; ++e) s[size_t(e)] = common::router_score(l[e]);
      if (p.scores) std::copy(s.begin(), s.end(), p.scores + t * E);
      int32_t* ids = p.ids + t * k;
      float margin = inf;
      if (p.tid2eid) {
        std::copy(p.tid2eid + int64_t(p.tokens[t]) * k, p.tid2eid + int64_t(p.tokens[t] + 1) * k, ids);
        common::sort_ids(ids, k);
      } else if (p.forced) {
        std::copy(p.forced + t * k, p.forced + (t + 1) * k, ids);
        common::sort_ids(ids, k);
        // worst forced minus best other on the selection score (negative: not the free choice).
        margin = common::router_forced_margin(s.data(), p.bias, E, ids, k);
      } else {
        for (int e = 0; e < E; ++e) sel[size_t(e)] = s[size_t(e)] + p.bias[e];
        margin = topk_row(sel.data(), E, k, ids, scratch.data());
      }
      if (p.margin) p.margin[t] = margin;
      common::router_weights(s.data(), ids, k, p.norm_topk_prob, p.routed_scaling_factor, p.weights + t * k);
    }
  }
}

const char* moe_check(const MoeParams& p) {
  if (const char* why = common::moe_check_dims(p)) return why;
  if (p.T == 0) return nullptr;
  if (const char* why = common::moe_check_pointers(p)) return why;
  for (int64_t i = 0; i < p.T * p.k; ++i) {
    if (p.ids[i] < 0 || p.ids[i] >= p.E) return "moe: expert id out of range";
    if (i % p.k != 0 && p.ids[i] < p.ids[i - 1]) return "moe: the ids of a token must be ascending";
  }
  return common::moe_check_expert_weights(p);
}

namespace {

// One SwiGLU expert on m contiguous rows xs [m, D]: out [m, D] fp32. weight[r] scales row r's
// activation (nullptr: shared expert, no weight); `down` rounds the w2 output (MoeParams::round_each).
// gu is scratch for [2, m, I].
void swiglu_expert(const ExpertWeights& ew, int64_t m, int64_t D, int64_t I, const float* xs,
                   const float* weight, bool clamp, float L, ReduceOrder o, OutRound down, float* gu, float* out) {
  float* g = gu;
  float* u = gu + m * I;
  gemm(linear_params(m, I, D, xs, ew.w1, g, OutRound::bf16, o));
  gemm(linear_params(m, I, D, xs, ew.w3, u, OutRound::bf16, o));
#pragma omp parallel for schedule(static) if (m * I >= kParallelMin)
  for (int64_t r = 0; r < m; ++r) {
    const float* wr = weight ? weight + r : nullptr;
    for (int64_t i = 0; i < I; ++i)  // a overwrites g in place
      g[r * I + i] = common::swiglu_act(g[r * I + i], u[r * I + i], clamp, L, wr);
  }
  gemm(linear_params(m, D, I, g, ew.w2, out, down, o));
}


// The end of the MoE sum of every token: acc (+)= each shared expert's output in order, then
// p.out = bf16(acc). gu and y: scratch of at least [2, T, I_shared] and [T, D].
void finish_sum(const MoeParams& p, std::vector<float>& acc, float* gu, float* y) {
  const int64_t T = p.T, D = p.D, Is = p.I_shared > 0 ? p.I_shared : p.I;
  for (int sidx = 0; sidx < p.n_shared; ++sidx) {
    swiglu_expert(p.shared[sidx], T, D, Is, p.x, nullptr, p.clamp_shared, p.swiglu_limit, p.order,
                  common::expert_output_round(p), gu, y);
#pragma omp parallel for schedule(static) if (T * D >= kParallelMin)
    for (int64_t i = 0; i < T * D; ++i) acc[size_t(i)] += y[i];
  }
#pragma omp parallel for schedule(static) if (T * D >= kParallelMin)
  for (int64_t i = 0; i < T * D; ++i) p.out[i] = num::bf16_round(acc[size_t(i)]);
  if (p.out_sums) bf16_row_sums(p.out, T, D, D, p.out_sums);
}

}  // namespace

void moe_experts(const MoeParams& p) {
  if (const char* why = cpu_order_check(p.order)) throw Error(std::string("moe_experts: ") + why);
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
    swiglu_expert(p.experts[e], m, D, I, xs.data(), wgt.data(), true, p.swiglu_limit, p.order,
                  common::expert_output_round(p), gu.data(),
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
  finish_sum(p, acc, gu.data(), y.data());
}

}  // namespace dsv4

namespace dsv4 {

std::vector<int64_t> moe_pairs(const MoeParams& p, int e0, int e1) {
  const int64_t TK = p.T * p.k;
  std::vector<int64_t> start(size_t(e1 - e0) + 1, 0);
  for (int64_t q = 0; q < TK; ++q)
    if (p.ids[q] >= e0 && p.ids[q] < e1) ++start[size_t(p.ids[q] - e0) + 1];
  for (int e = 0; e < e1 - e0; ++e) start[size_t(e) + 1] += start[size_t(e)];
  std::vector<int64_t> fill(start.begin(), start.end() - 1), out(size_t(start.back()));
  for (int64_t q = 0; q < TK; ++q)
    if (p.ids[q] >= e0 && p.ids[q] < e1) out[size_t(fill[size_t(p.ids[q] - e0)]++)] = q;
  return out;
}

void moe_routed_outputs(const MoeParams& p, int e0, int e1, float* y) {
  const std::vector<int64_t> pairs = moe_pairs(p, e0, e1);
  const int64_t D = p.D, I = p.I, k = p.k;
  int64_t a = 0;
  while (a < int64_t(pairs.size())) {  // one run of pairs per expert
    const int e = p.ids[pairs[size_t(a)]];
    int64_t b = a;
    while (b < int64_t(pairs.size()) && p.ids[pairs[size_t(b)]] == e) ++b;
    const int64_t m = b - a;
    std::vector<float> xs(static_cast<size_t>(m * D)), wgt(static_cast<size_t>(m)), gu(static_cast<size_t>(2 * m * I));
#pragma omp parallel for schedule(static) if (m * D >= kParallelMin)
    for (int64_t r = 0; r < m; ++r) {
      const int64_t q = pairs[size_t(a + r)];
      std::copy(p.x + (q / k) * D, p.x + (q / k + 1) * D, xs.begin() + r * D);
      wgt[size_t(r)] = p.weights[q];
    }
    swiglu_expert(p.experts[e], m, D, I, xs.data(), wgt.data(), true, p.swiglu_limit, p.order,
                  common::expert_output_round(p), gu.data(),
                  y + a * D);
    a = b;
  }
}

void moe_combine(const MoeParams& p, const float* y_slot, float* out) {
  if (p.T <= 0) return;
  const int64_t T = p.T, D = p.D, k = p.k;
  std::vector<float> acc(size_t(T * D), 0.0f);
#pragma omp parallel for schedule(static) if (T * D >= kParallelMin)
  for (int64_t t = 0; t < T; ++t)
    for (int64_t i = 0; i < k; ++i) {
      const float* ys = y_slot + (t * k + i) * D;
      float* dst = acc.data() + t * D;
      for (int64_t d = 0; d < D; ++d) dst[d] += ys[d];
    }
  const int64_t Is = p.I_shared > 0 ? p.I_shared : p.I;
  std::vector<float> gu(size_t(p.n_shared > 0 ? 2 * T * Is : 0)), y(size_t(p.n_shared > 0 ? T * D : 0));
  MoeParams q = p;
  q.out = out;
  finish_sum(q, acc, gu.data(), y.data());
}

}  // namespace dsv4
