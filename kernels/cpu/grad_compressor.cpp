// Backward of the compressor pooling (MODEL.md §3.5, §5.3) on the CPU. The operation order is the
// contract of kernels/grad.h; the arithmetic is kernels/detail/grad_compressor.h.
#include <algorithm>
#include <cstdint>
#include <vector>

#include "kernels/detail/grad_compressor.h"
#include "kernels/grad.h"

namespace dsv4 {

namespace {
// Below this much work (multiply-adds or elements) a parallel region costs more than it saves. The
// thread count never changes the result, so the threshold is free to tune.
constexpr int64_t kParallelWork = int64_t(1) << 15;
}  // namespace

const char* compressor_pool_backward_check(const CompressorPoolBwdParams& p) {
  return common::compressor_pool_backward_check_params(p);
}

// dkvp / dsc are zeroed, then one group per iteration: its pooled row recomputed, dout unrotated, the
// RMSNorm backward (dnorm's terms kept per group), each channel's pooling backward scattered to the
// elements only this group reads. Then dnorm and dape, one element per iteration, each a sum over
// the groups in increasing order.
void compressor_pool_backward(const CompressorPoolBwdParams& p) {
  const int64_t d = p.d, G = p.G, cw = common::compressor_row_width(p.ratio, d);
  if (p.rows > 0) {
    std::fill(p.dkvp, p.dkvp + p.rows * cw, 0.0f);
    std::fill(p.dsc, p.dsc + p.rows * cw, 0.0f);
  }
  if (G == 0) return;
  const common::CompressorPool a = common::compressor_pool_backward_shape(p);
  const int nslot = a.overlap ? 2 * a.r : a.r;
  std::vector<float> dwt(p.dnorm ? size_t(G * d) : 0);  // dnorm's term of each group

#pragma omp parallel if (G * d * nslot >= kParallelWork)
  {
    std::vector<float> x(static_cast<size_t>(d)), dc(static_cast<size_t>(d));
#pragma omp for schedule(static)
    for (int64_t g = 0; g < G; ++g) {
      const int64_t ga = p.g0 + g;
      for (int64_t c = 0; c < d; ++c) x[size_t(c)] = common::compressor_pool(a, ga, c);
      std::copy(p.dout + g * d, p.dout + (g + 1) * d, dc.begin());
      common::compressor_bwd_unrotate(dc.data(), d, p.rd, ga * p.ratio, p.freq, 0, 1);
      common::compressor_bwd_norm(x.data(), p.norm, dc.data(), d, p.rms_eps, p.order, dc.data(),
                                  p.dnorm ? dwt.data() + g * d : nullptr);
      for (int64_t c = 0; c < d; ++c) common::compressor_bwd_channel(a, ga, c, dc[size_t(c)], p.dkvp, p.dsc);
    }
  }

  if (p.dnorm) {
#pragma omp parallel for schedule(static) if (G * d >= kParallelWork)
    for (int64_t i = 0; i < d; ++i) {
      float S = 0.0f;
      for (int64_t g = 0; g < G; ++g) S = S + dwt[size_t(g * d + i)];
      p.dnorm[i] = p.dnorm[i] + S;
    }
  }
  if (p.dape) {
#pragma omp parallel for schedule(static) if (G * p.ratio * cw >= kParallelWork)
    for (int64_t e = 0; e < p.ratio * cw; ++e) {
      const int k = int(e / cw);
      const int64_t col = e % cw;
      p.dape[e] = p.dape[e] + common::compressor_bwd_ape(a, p.g0, G, k, col, p.dsc);
    }
  }
}

}  // namespace dsv4
