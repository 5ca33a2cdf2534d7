// Sparse attention with an attention sink (MODEL.md §3.8) on the CPU. The operation order is the
// contract of kernels/attention.h.
#include "kernels/attention.h"

#include <cmath>
#include <string>
#include <vector>

#include "kernels/detail/attention.h"
#include "kernels/error.h"

namespace dsv4 {

namespace {
// Below this much work (multiply-adds or elements) a parallel region costs more than it saves. The
// thread count never changes the result, so the threshold is free to tune.
constexpr int64_t kParallelWork = int64_t(1) << 15;
}  // namespace

const char* sparse_attention_check(const SparseAttnParams& p) {
  if (const char* why = common::sparse_attention_check_dims(p)) return why;
  if (const char* why = common::sparse_attention_check_pointers(p)) return why;
  if (const char* why = cpu_order_check(p.order)) return why;
  for (int64_t i = 0; i < p.T * p.K; ++i)
    if (p.idx[i] < -1 || p.idx[i] >= p.N) return "idx";
  return nullptr;
}

namespace {

// The scores of row th = t * H + h: the valid slots of idx[t] (not -1) in slot order, their kv rows in
// slots and z = scale * dot(q[t,h], kv row) in z. Returns their count nv; when it is 0 the row is only
// the sink and is written here (o = 0, lse = sink exactly). Masked slots are never loaded.
int64_t row_scores(const SparseAttnParams& p, int64_t th, float* z, int32_t* slots) {
  const int32_t* idx = p.idx + (th / p.H) * p.K;
  const float* q = p.q + th * p.Dh;
  int64_t nv = 0;
  for (int64_t j = 0; j < p.K; ++j) {
    if (idx[j] < 0) continue;
    slots[nv] = idx[j];
    z[nv++] = p.scale * dot(q, p.kv + int64_t(idx[j]) * p.Dh, p.Dh, p.order);
  }
  if (nv == 0) {
    float* o = p.o + th * p.Dh;
    for (int64_t d = 0; d < p.Dh; ++d) o[d] = 0.0f;
    if (p.lse) p.lse[th] = p.sink[th % p.H];
  }
  return nv;
}

// The split-KV order (p.splits > 0), one (t, h) per iteration like the exact order below; the whole
// row's arithmetic is in kernels/detail/attention.h, shared with the CUDA kernel.
void sparse_attention_split(const SparseAttnParams& p) {
  const int64_t TH = p.T * p.H;
  const int64_t max_parts = p.K < p.splits ? p.K : p.splits;
#pragma omp parallel if (TH * p.K * p.Dh >= kParallelWork)
  {
    std::vector<float> e(size_t(p.K));                     // z, then P, of the valid slots in slot order
    std::vector<int32_t> slots(size_t(p.K));               // their kv rows
    std::vector<float> c(static_cast<size_t>(max_parts));  // lse_i, then the combine weights c_i
#pragma omp for schedule(static)
    for (int64_t th = 0; th < TH; ++th) {
      float* o = p.o + th * p.Dh;
      const float sink = p.sink[th % p.H];
      const int64_t nv = row_scores(p, th, e.data(), slots.data());
      if (nv == 0) continue;
      const int64_t L = common::attn_split_len(nv, p.splits), n = common::attn_split_parts(nv, p.splits);
      for (int64_t i = 0; i < n; ++i) {
        const int64_t b = i * L, len = b + L < nv ? L : nv - b;
        c[size_t(i)] = common::attn_part_softmax(e.data() + b, len);
      }
      const float lse = common::attn_combine_weights(c.data(), n, sink);
      for (int64_t d = 0; d < p.Dh; ++d)
        o[d] = common::attn_split_out(e.data(), c.data(), slots.data(), nv, L, p.kv, p.Dh, d);
      if (p.lse) p.lse[th] = lse;
    }
  }
}

// The online order (p.online_block > 0): the row's scan and the accumulator steps are
// kernels/detail/attention.h's, shared with the CUDA kernel; the output runs slot by slot over
// contiguous kv rows (each o[d] sees the same steps in the same order as common::attn_online_out).
void sparse_attention_online(const SparseAttnParams& p) {
  const int64_t TH = p.T * p.H;
#pragma omp parallel if (TH * p.K * p.Dh >= kParallelWork)
  {
    std::vector<float> e(size_t(p.K)), a(size_t(p.K));  // z then P; alpha factors
    std::vector<int32_t> slots(size_t(p.K));            // kv rows of the valid slots
#pragma omp for schedule(static)
    for (int64_t th = 0; th < TH; ++th) {
      float* o = p.o + th * p.Dh;
      const float sink = p.sink[th % p.H];
      const int64_t nv = row_scores(p, th, e.data(), slots.data());
      if (nv == 0) continue;
      float l = 0.0f;
      const float lse = common::attn_online_row(e.data(), a.data(), nv, p.online_block, sink, &l);
      for (int64_t d = 0; d < p.Dh; ++d) o[d] = 0.0f;  // the accumulators
      for (int64_t v = 0; v < nv; ++v) {
        const float P = e[size_t(v)], alpha = a[size_t(v)];
        const float* kv = p.kv + int64_t(slots[size_t(v)]) * p.Dh;
        for (int64_t d = 0; d < p.Dh; ++d) o[d] = common::attn_online_acc(o[d], P, alpha, kv[d]);
      }
      for (int64_t d = 0; d < p.Dh; ++d) o[d] = common::attn_online_final(o[d], l);
      if (p.lse) p.lse[th] = lse;
    }
  }
}

}  // namespace

// One (t, h) per iteration. Masked (-1) slots are never loaded (no address is formed from them), so
// garbage can never reach the sums; each iteration writes only its own o[t,h] and lse[t,h].
void sparse_attention(const SparseAttnParams& p) {
  if (const char* why = cpu_order_check(p.order)) throw Error(std::string("sparse_attention: ") + why);
  if (p.splits > 0) {
    sparse_attention_split(p);
    return;
  }
  if (p.online_block > 0) {
    sparse_attention_online(p);
    return;
  }
  const int64_t TH = p.T * p.H;
#pragma omp parallel if (TH * p.K * p.Dh >= kParallelWork)
  {
    std::vector<float> e(size_t(p.K));        // z_j, then P_j, of the valid slots in slot order
    std::vector<int32_t> slots(size_t(p.K));  // their kv rows
#pragma omp for schedule(static)
    for (int64_t th = 0; th < TH; ++th) {
      float* o = p.o + th * p.Dh;
      const int64_t nv = row_scores(p, th, e.data(), slots.data());
      if (nv == 0) continue;  // only the sink: P_sink = 1
      const float lse = common::attn_softmax_row(e.data(), nv, p.sink[th % p.H]);
      for (int64_t d = 0; d < p.Dh; ++d) o[d] = 0.0f;
      for (int64_t v = 0; v < nv; ++v) {
        const float P = e[size_t(v)];
        const float* kv = p.kv + int64_t(slots[size_t(v)]) * p.Dh;
        for (int64_t d = 0; d < p.Dh; ++d) o[d] = std::fma(P, kv[d], o[d]);
      }
      for (int64_t d = 0; d < p.Dh; ++d) o[d] = num::bf16_round(o[d]);
      if (p.lse) p.lse[th] = lse;
    }
  }
}

}  // namespace dsv4
