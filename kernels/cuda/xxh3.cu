// GPU row digests (XXH3-64, seed 0): see kernels/cuda/xxh3.h.
#include "kernels/cuda/xxh3.h"

#include <algorithm>
#include <string>

#include "kernels/cuda/check.h"
#include "kernels/numerics/numerics.h"

namespace dsv4::cuda {
namespace {

constexpr int kWarpsPerBlock = 4;

__constant__ uint8_t c_secret[xxh3::kSecretSize] = {DSV4_XXH3_SECRET_BYTES};

// XXH3-64 of one row > 240 bytes by one warp. Lane t accumulates lane j = t % 8 of the stripes
// t / 8, t / 8 + 4, ... of each block; the four partial sums of a lane are added with shuffles (mod 2^64,
// so any order gives libxxhash's sum), then every thread applies the block's scramble to its copy of acc[j].
__device__ uint64_t warp_hash_long(const uint8_t* in, uint64_t len, const uint8_t* s, int lane) {
  const int j = lane & 7, q = lane >> 3;
  uint64_t init[8];
  xxh3::init_acc(init);
  uint64_t acc = init[j];
  const uint64_t nb_blocks = (len - 1) / xxh3::kBlockLen;
  for (uint64_t b = 0; b < nb_blocks; ++b) {
    const uint8_t* blk = in + b * xxh3::kBlockLen;
    uint64_t sum = 0;
    for (int st = q; st < xxh3::kStripesPerBlock; st += 4)
      sum += xxh3::stripe_term(blk + st * xxh3::kStripeLen, s + 8 * st, j);
    sum += __shfl_xor_sync(0xffffffffu, sum, 8);
    sum += __shfl_xor_sync(0xffffffffu, sum, 16);
    acc = xxh3::scramble(acc + sum, s + xxh3::kSecretSize - xxh3::kStripeLen, j);
  }
  const uint8_t* blk = in + nb_blocks * xxh3::kBlockLen;
  const int nb_stripes = int(((len - 1) - xxh3::kBlockLen * nb_blocks) / xxh3::kStripeLen);
  uint64_t sum = 0;
  for (int st = q; st < nb_stripes; st += 4)
    sum += xxh3::stripe_term(blk + st * xxh3::kStripeLen, s + 8 * st, j);
  sum += __shfl_xor_sync(0xffffffffu, sum, 8);
  sum += __shfl_xor_sync(0xffffffffu, sum, 16);
  acc +=
      sum + xxh3::stripe_term(in + len - xxh3::kStripeLen, s + xxh3::kSecretSize - xxh3::kStripeLen - 7, j);
  uint64_t all[8];
  for (int k = 0; k < 8; ++k) all[k] = __shfl_sync(0xffffffffu, acc, k);
  return xxh3::merge(all, s, len);
}

__global__ void digest_rows_kernel(const uint8_t* data, int64_t rows, int64_t row_bytes, uint64_t* out) {
  __shared__ uint8_t s[xxh3::kSecretSize];
  for (int i = threadIdx.x; i < xxh3::kSecretSize; i += blockDim.x) s[i] = c_secret[i];
  __syncthreads();
  const int lane = threadIdx.x & 31;
  const int64_t r = int64_t(blockIdx.x) * kWarpsPerBlock + (threadIdx.x >> 5);
  if (r >= rows) return;  // whole warps only: the shuffles below need all 32 lanes of a warp
  const uint8_t* in = data + r * row_bytes;
  const uint64_t len = uint64_t(row_bytes);
  if (len <= 240) {
    if (lane == 0) out[r] = xxh3::hash_short(in, len, s);
  } else {
    const uint64_t h = warp_hash_long(in, len, s, lane);
    if (lane == 0) out[r] = h;
  }
}

__global__ void bf16_bits_kernel(const float* x, int64_t n, uint16_t* bits) {
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x)
    bits[i] = num::bf16_bits(x[i]);
}

}  // namespace

void digest_rows(const void* data, int64_t rows, int64_t row_bytes, uint64_t* out, cudaStream_t stream) {
  if (rows < 0 || row_bytes < 0)
    throw Error("cuda digest_rows cannot run: negative rows (" + std::to_string(rows) + ") or row_bytes (" +
                std::to_string(row_bytes) + ")");
  if (rows == 0) return;
  if (!out || (!data && row_bytes > 0)) throw Error("cuda digest_rows cannot run: null data or out");
  const int64_t blocks = (rows + kWarpsPerBlock - 1) / kWarpsPerBlock;
  if (blocks > 0x7fffffff) throw Error("cuda digest_rows cannot run: too many rows");
  digest_rows_kernel<<<unsigned(blocks), 32 * kWarpsPerBlock, 0, stream>>>(static_cast<const uint8_t*>(data),
                                                                           rows, row_bytes, out);
  CUDA_CHECK(cudaGetLastError());
}

void digest_rows_bf16(const float* data, int64_t rows, int64_t elems, uint64_t* out, uint16_t* scratch,
                      cudaStream_t stream) {
  if (rows < 0 || elems < 0)
    throw Error("cuda digest_rows_bf16 cannot run: negative rows (" + std::to_string(rows) + ") or elems (" +
                std::to_string(elems) + ")");
  if (rows == 0) return;
  const int64_t n = rows * elems;
  if (n == 0) return digest_rows(nullptr, rows, 0, out, stream);
  if (!data || !scratch) throw Error("cuda digest_rows_bf16 cannot run: null data or scratch");
  constexpr int kThreads = 256;
  const int64_t blocks = std::min<int64_t>((n + kThreads - 1) / kThreads, int64_t(1) << 20);
  bf16_bits_kernel<<<unsigned(blocks), kThreads, 0, stream>>>(data, n, scratch);
  CUDA_CHECK(cudaGetLastError());
  digest_rows(scratch, rows, elems * 2, out, stream);
}

void digest_rows_bf16(const float* data, int64_t rows, int64_t elems, uint64_t* out, cudaStream_t stream) {
  if (rows <= 0 || elems <= 0) return digest_rows_bf16(data, rows, elems, out, nullptr, stream);
  void* bits = nullptr;
  CUDA_CHECK(cudaMallocAsync(&bits, size_t(rows * elems) * 2, stream));
  try {
    digest_rows_bf16(data, rows, elems, out, static_cast<uint16_t*>(bits), stream);
  } catch (...) {
    cudaFreeAsync(bits, stream);
    throw;
  }
  CUDA_CHECK(cudaFreeAsync(bits, stream));
}

}  // namespace dsv4::cuda
