// The indexer's KL objective and its backward (MODEL.md §5.5) on the CPU (the Hadamard transpose is
// in compressor.cpp, beside the rotation). The operation order is the
// contract of kernels/grad.h; the arithmetic is kernels/detail/grad_indexer.h.
#include <cstdint>
#include <vector>

#include "kernels/cpu/inverse_map.h"
#include "kernels/detail/grad_indexer.h"
#include "kernels/grad.h"

namespace dsv4 {

namespace {
// Below this much work a parallel region costs more than it saves (the thread count never changes
// the result).
constexpr int64_t kParallelWork = int64_t(1) << 15;
}  // namespace

const char* attention_mass_check(const AttentionMassParams& p) {
  if (const char* why = common::attention_mass_check_shape(p)) return why;
  for (int64_t t = 0; t < p.T; ++t)
    for (int64_t j = p.c0; j < p.c0 + p.n; ++j) {
      const int32_t v = p.idx[t * p.K + j];
      if (v < -1 || v >= p.N) return "attention_mass: idx holds a value outside [-1, N)";
    }
  return nullptr;
}

void attention_mass(const AttentionMassParams& p) {
#pragma omp parallel for schedule(static) if (p.T * p.n * p.H * p.Dh >= kParallelWork)
  for (int64_t t = 0; t < p.T; ++t)
    for (int64_t j = 0; j < p.n; ++j) {
      const int32_t r = p.idx[t * p.K + p.c0 + j];
      p.mass[t * p.n + j] = r < 0 ? 0.0f
                                  : common::attention_mass_slot(p.q + t * p.H * p.Dh, p.kv + int64_t(r) * p.Dh,
                                                                p.lse + t * p.H, p.H, p.Dh, p.scale, p.order);
    }
}

const char* indexer_kl_check(const IndexerKlParams& p) {
  return common::indexer_kl_check_shape(p);
}

void indexer_kl(const IndexerKlParams& p) {
#pragma omp parallel for schedule(static) if (p.T * p.k * 64 >= kParallelWork)
  for (int64_t t = 0; t < p.T; ++t)
    p.loss[t] = common::indexer_kl_row(p.ids + t * p.k, p.score + t * p.k, p.mass + t * p.k, p.k, p.l1_target,
                                       p.coeff, p.dscore + t * p.k);
}

const char* indexer_score_backward_check(const IndexerScoreBwdParams& p) {
  if (const char* why = common::indexer_score_backward_check_shape(p)) return why;
  for (int64_t i = 0; i < p.T * p.k; ++i)
    if (p.ids[i] < -1 || p.ids[i] >= p.G) return "indexer_score_backward: ids holds a value outside [-1, G)";
  return nullptr;
}

// Pass 1 over the (t, h) rows; the inverse map of ids (each key row's flat slots in increasing order,
// built sequentially); pass 2 over the key rows.
void indexer_score_backward(const IndexerScoreBwdParams& p) {
  const int64_t TH = p.T * p.Hi, Tk = p.T * p.k;
  std::vector<float> e(static_cast<size_t>(Tk * p.Hi), 0.0f);
#pragma omp parallel for schedule(static) if (TH * p.k * p.Di >= kParallelWork)
  for (int64_t th = 0; th < TH; ++th) {
    const int64_t t = th / p.Hi, h = th % p.Hi;
    p.dwt[th] = common::indexer_bwd_row(p.qi + th * p.Di, p.ki, p.ids + t * p.k, p.dscore + t * p.k, p.k, p.G,
                                        p.Di, p.wt[th], p.wt_scale, p.order, p.dqi + th * p.Di,
                                        e.data() + t * p.k * p.Hi + h, p.Hi);
  }
  if (p.G == 0) return;
  const cpu::InverseMap inv = cpu::inverse_map(p.ids, Tk, p.G);
  const std::vector<int64_t>&begin = inv.begin, &slots = inv.slots;
#pragma omp parallel for schedule(static) if (int64_t(slots.size()) * p.Hi * p.Di >= kParallelWork)
  for (int64_t g = 0; g < p.G; ++g) {
    const int64_t b = begin[size_t(g)];
    common::indexer_bwd_key_row(slots.data() + b, begin[size_t(g + 1)] - b, p.k, p.Hi, p.Di, p.qi, e.data(),
                                p.dki + g * p.Di, 0, 1);
  }
}

}  // namespace dsv4
