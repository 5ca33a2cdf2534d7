// The cached-row codec on the GPU (kernels/kvcache.h): one thread per row, grid-stride, running the
// CPU's common::kv_encode_row / kv_decode_row. Rows are independent; a slot is written by one thread.
#include "kernels/cuda/common.cuh"
#include "kernels/detail/kvcache.h"

namespace dsv4::cuda {

namespace {

constexpr int kThreads = 128;

__global__ void __launch_bounds__(kThreads) kv_store_kernel(KvStoreParams p, int64_t bytes) {
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < p.n;
       i += int64_t(gridDim.x) * blockDim.x)
    common::kv_encode_row(p.f, p.src + i * p.ld, p.pool + p.slot_ids[i] * bytes);
}

__global__ void __launch_bounds__(kThreads) kv_load_kernel(KvLoadParams p, int64_t bytes) {
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < p.n;
       i += int64_t(gridDim.x) * blockDim.x)
    common::kv_decode_row(p.f, p.pool + p.slot_ids[i] * bytes, p.dst + i * p.ld);
}

}  // namespace

void kv_store(const KvStoreParams& p, cudaStream_t stream) {
  require(dsv4::kv_store_check(p), "kv_store");
  if (p.n == 0) return;
  kv_store_kernel<<<detail::grid_for(p.n, kThreads), kThreads, 0, stream>>>(p, p.f.bytes());
  DSV4_LAUNCH_CHECK();
}

void kv_load(const KvLoadParams& p, cudaStream_t stream) {
  require(dsv4::kv_load_check(p), "kv_load");
  if (p.n == 0) return;
  kv_load_kernel<<<detail::grid_for(p.n, kThreads), kThreads, 0, stream>>>(p, p.f.bytes());
  DSV4_LAUNCH_CHECK();
}

}  // namespace dsv4::cuda
