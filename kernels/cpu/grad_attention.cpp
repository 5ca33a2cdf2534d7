// Backward of the sparse attention with a sink (MODEL.md §5.1) on the CPU. The operation order is the
// contract of kernels/grad.h; the arithmetic is kernels/detail/grad_attention.h.
#include <cstdint>
#include <vector>

#include "kernels/detail/grad_attention.h"
#include "kernels/cpu/inverse_map.h"
#include "kernels/grad.h"

namespace dsv4 {

namespace {
// Below this much work (multiply-adds or elements) a parallel region costs more than it saves. The
// thread count never changes the result, so the threshold is free to tune.
constexpr int64_t kParallelWork = int64_t(1) << 15;
}  // namespace

const char* sparse_attention_backward_check(const SparseAttnBwdParams& p) {
  if (const char* why = common::sparse_attention_backward_check_dims(p)) return why;
  if (const char* why = common::sparse_attention_backward_check_pointers(p)) return why;
  for (int64_t i = 0; i < p.T * p.K; ++i)
    if (p.idx[i] < -1 || p.idx[i] >= p.N)
      return "sparse_attention_backward: idx holds a value outside [-1, N)";
  return nullptr;
}

// Pass 1 over the (t, h) rows (each writes its own dq row, its slots' P and scale * dz, and its sink
// term); the inverse map of idx (for each kv row, its flat slots t * K + j in increasing order, built
// sequentially); pass 2 over the kv rows (each writes its own dkv row); the sink's sums per head.
void sparse_attention_backward(const SparseAttnBwdParams& p) {
  const int64_t TH = p.T * p.H, TK = p.T * p.K, H = p.H;
  std::vector<float> P(static_cast<size_t>(TK * H)), sdz(static_cast<size_t>(TK * H)),
      ds(static_cast<size_t>(TH));

#pragma omp parallel for schedule(static) if (TH * p.K * p.Dh >= kParallelWork)
  for (int64_t th = 0; th < TH; ++th) {
    const int64_t t = th / H, h = th % H;
    ds[size_t(th)] =
        common::attn_bwd_row(p.q + th * p.Dh, p.dO + th * p.Dh, p.o + th * p.Dh, p.kv, p.idx + t * p.K, p.K,
                             p.Dh, p.scale, p.sink[h], p.lse[th], p.order, p.dq + th * p.Dh,
                             P.data() + t * p.K * H + h, sdz.data() + t * p.K * H + h, H);
  }

  // Inverse map in CSR form: the slots of kv row n are slots[begin[n] .. begin[n + 1]).
  const cpu::InverseMap inv = cpu::inverse_map(p.idx, TK, p.N);
  const std::vector<int64_t>&begin = inv.begin, &slots = inv.slots;

#pragma omp parallel for schedule(static) if (int64_t(slots.size()) * H * p.Dh + p.N * p.Dh >= kParallelWork)
  for (int64_t n = 0; n < p.N; ++n) {
    const int64_t b = begin[size_t(n)];
    common::attn_bwd_kv_row(slots.data() + b, begin[size_t(n + 1)] - b, p.K, p.H, p.Dh, p.q, p.dO, P.data(),
                            sdz.data(), p.dkv + n * p.Dh, 0, 1);
  }

  if (p.dsink && p.T > 0)
    for (int h = 0; h < p.H; ++h) p.dsink[h] = common::attn_bwd_sink(ds.data(), p.T, p.H, h, p.dsink[h]);
}

}  // namespace dsv4
