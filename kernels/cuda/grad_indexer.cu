// The indexer's KL objective on the GPU (kernels/grad.h AttentionMassParams, IndexerKlParams,
// IndexerScoreBwdParams), bit for bit the CPU reference kernels/cpu/grad_indexer.cpp: every output
// element is formed by one thread with the shared functions of kernels/detail/grad_indexer.h.
//   mass_kernel: one thread per (row t, slot column j): common::attention_mass_slot.
//   kl_kernel:   one thread per row: common::indexer_kl_row.
//   Score backward, pass 1 (rows_kernel): one thread per (t, h): common::indexer_bwd_row writes dwt,
//   dqi and the row's slot terms e into a [T * k, Hi] scratch (flat slot, then head).
//   The inverse map of ids (kernels/cuda/inverse_map.cu): each key row's flat slots in increasing
//   order, the CPU's CSR order, without atomics.
//   Pass 2 (keys_kernel): one block per key row g (grid-stride), its threads sharing the columns:
//   common::indexer_bwd_key_row (an fma chain per column over the row's slots in order, heads inside).
// The Hadamard transpose is kernels/cuda/compressor.cu's rotation kernel without the bf16 rounding.
// Indices outside their range are not detected on the device (the CPU checks scan them); they are
// treated as holes.
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/grad.h"
#include "kernels/cuda/grad_common.cuh"
#include "kernels/detail/grad_indexer.h"

namespace dsv4::cuda {

namespace {

constexpr int kThreads = 256;

__global__ void mass_kernel(AttentionMassParams p) {
  const int64_t total = p.T * p.n;
  for (int64_t e = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; e < total;
       e += int64_t(gridDim.x) * blockDim.x) {
    const int64_t t = e / p.n, j = e % p.n;
    const int32_t r = p.idx[t * p.K + p.c0 + j];
    p.mass[e] = (r < 0 || r >= p.N) ? 0.0f
                                    : common::attention_mass_slot(p.q + t * p.H * p.Dh, p.kv + int64_t(r) * p.Dh,
                                                                  p.lse + t * p.H, p.H, p.Dh, p.scale, p.order);
  }
}

__global__ void kl_kernel(IndexerKlParams p) {
  for (int64_t t = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; t < p.T; t += int64_t(gridDim.x) * blockDim.x)
    p.loss[t] = common::indexer_kl_row(p.ids + t * p.k, p.score + t * p.k, p.mass + t * p.k, p.k, p.l1_target,
                                       p.coeff, p.dscore + t * p.k);
}

__global__ void rows_kernel(IndexerScoreBwdParams p, float* e) {
  const int64_t TH = p.T * p.Hi;
  for (int64_t th = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; th < TH;
       th += int64_t(gridDim.x) * blockDim.x) {
    const int64_t t = th / p.Hi, h = th % p.Hi;
    p.dwt[th] = common::indexer_bwd_row(p.qi + th * p.Di, p.ki, p.ids + t * p.k, p.dscore + t * p.k, p.k, p.G,
                                        p.Di, p.wt[th], p.wt_scale, p.order, p.dqi + th * p.Di,
                                        e + t * p.k * p.Hi + h, p.Hi);
  }
}

__global__ void keys_kernel(IndexerScoreBwdParams p, const int64_t* slots, const int64_t* begin, const float* e) {
  for (int64_t g = blockIdx.x; g < p.G; g += gridDim.x) {
    const int64_t b = begin[g];
    common::indexer_bwd_key_row(slots + b, begin[g + 1] - b, p.k, p.Hi, p.Di, p.qi, e, p.dki + g * p.Di,
                                threadIdx.x, blockDim.x);
  }
}

}  // namespace

void attention_mass(const AttentionMassParams& p, cudaStream_t stream) {
  require(common::attention_mass_check_shape(p), "attention_mass");
  if (p.T * p.n == 0) return;
  mass_kernel<<<detail::grid_for(p.T * p.n, kThreads), kThreads, 0, stream>>>(p);
  DSV4_LAUNCH_CHECK();
}

void indexer_kl(const IndexerKlParams& p, cudaStream_t stream) {
  require(common::indexer_kl_check_shape(p), "indexer_kl");
  if (p.T == 0) return;
  kl_kernel<<<detail::grid_for(p.T, 128), 128, 0, stream>>>(p);
  DSV4_LAUNCH_CHECK();
}

void indexer_score_backward(const IndexerScoreBwdParams& p, cudaStream_t stream) {
  require(common::indexer_score_backward_check_shape(p), "indexer_score_backward");
  if (p.T * int64_t(p.k) > int64_t(0xffffffffll)) require("T * k must be below 2^32", "indexer_score_backward");
  const int64_t Tk = p.T * p.k;
  if (p.G > 0 && Tk == 0) CUDA_CHECK(cudaMemsetAsync(p.dki, 0, size_t(p.G * p.Di) * sizeof(float), stream));
  if (p.T == 0) return;
  detail::Scratch<float> e(Tk * p.Hi, stream);
  rows_kernel<<<detail::grid_for(p.T * p.Hi, 128), 128, 0, stream>>>(p, e.get());
  DSV4_LAUNCH_CHECK();
  if (p.G == 0 || Tk == 0) return;
  const int64_t n = detail::inverse_map_size(Tk);
  detail::Scratch<uint64_t> keys(n, stream);
  detail::Scratch<int64_t> begin(p.G + 1, stream), slots(Tk, stream);
  detail::inverse_map(p.ids, Tk, p.G, keys.get(), begin.get(), stream);
  detail::inverse_map_slots(keys.get(), Tk, slots.get(), stream);
  const int threads = p.Di >= 128 ? 128 : int((p.Di + 31) / 32 * 32);
  keys_kernel<<<detail::grid_for(p.G, 1, 1 << 20), threads, 0, stream>>>(p, slots.get(), begin.get(), e.get());
  DSV4_LAUNCH_CHECK();
}

}  // namespace dsv4::cuda
