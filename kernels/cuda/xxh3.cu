// GPU row digests (XXH3-64, seed 0): see kernels/xxh3.h.
#include "kernels/xxh3.h"

#include <cstdint>
#include <string>
#include <type_traits>

#include "kernels/cuda/check.h"
#include "kernels/cuda/xxh3_sums.cuh"
#include "kernels/numerics/numerics.h"

namespace dsv4::cuda {
namespace {

constexpr int kWarpsPerBlock = 4;
constexpr unsigned kFullWarp = 0xffffffffu;

__constant__ uint8_t c_secret[xxh3::kSecretSize] = {DSV4_XXH3_SECRET_BYTES};

// The bytes a row digest hashes, read 8 at a time at even offsets (little endian).
// A row of raw bytes, at any alignment.
struct RawBytes {
  const uint8_t* row;
  __device__ uint64_t word(uint64_t off) const { return xxh3::read64(row + off); }
};
// The 2-byte bf16 patterns of a row of fp32 values (capture/digest.h): bytes 2i, 2i+1 are
// num::bf16_bits(row[i]), so the 8 bytes at an even offset are 4 whole values, converted as they are
// read (one float4 load where the values are 16-byte aligned).
struct Bf16Patterns {
  const float* row;
  __device__ uint64_t word(uint64_t off) const {
    const float* p = row + off / 2;
    const float4 v = (reinterpret_cast<uintptr_t>(p) & 15) == 0 ? __ldg(reinterpret_cast<const float4*>(p))
                                                                : make_float4(p[0], p[1], p[2], p[3]);
    return uint64_t(num::bf16_bits(v.x)) | uint64_t(num::bf16_bits(v.y)) << 16 |
           uint64_t(num::bf16_bits(v.z)) << 32 | uint64_t(num::bf16_bits(v.w)) << 48;
  }
};

// xxh3::stripe_term for lane j of a stripe whose word j this lane read as `w` (lane j ^ 1 of the same
// quarter of the warp read the other word the term needs): each word is read once.
__device__ uint64_t stripe_term(uint64_t w, const uint8_t* s, int j) {
  const uint64_t other = __shfl_xor_sync(kFullWarp, w, 1);
  const uint64_t key = w ^ xxh3::read64(s + 8 * j);
  return other + (key & 0xFFFFFFFFULL) * (key >> 32);
}

// XXH3-64 of one row > 240 bytes by one warp. Lane t accumulates lane j = t % 8 of the stripes
// t / 8, t / 8 + 4, ... of each block; the four partial sums of a lane are added with shuffles (mod 2^64,
// so any order gives libxxhash's sum), then every thread applies the block's scramble to its copy of acc[j].
// The words of kBlocksAhead blocks are loaded before any is hashed (the scrambles are a chain, the loads
// are not), and those of the last, partial block with the final stripe's. Every lane runs every
// iteration (the shuffles need the whole warp); lanes past the stripes add nothing.
constexpr int kBlocksAhead = 4;
constexpr int kWordsPerBlock = xxh3::kStripesPerBlock / 4;  // a lane's words of one block

template <typename Src>
__device__ uint64_t warp_hash_long(const Src& in, uint64_t len, const uint8_t* s, int lane) {
  const int j = lane & 7, q = lane >> 3;
  uint64_t init[8];
  xxh3::init_acc(init);
  uint64_t acc = init[0];
#pragma unroll
  for (int k = 1; k < 8; ++k) acc = j == k ? init[k] : acc;  // init[j] by selects, not from the stack
  const uint64_t nb_blocks = (len - 1) / xxh3::kBlockLen;
  for (uint64_t b0 = 0; b0 < nb_blocks; b0 += kBlocksAhead) {
    uint64_t w[kBlocksAhead][kWordsPerBlock];
#pragma unroll
    for (int a = 0; a < kBlocksAhead; ++a)
#pragma unroll
      for (int i = 0; i < kWordsPerBlock; ++i)
        w[a][i] = b0 + a < nb_blocks ? in.word((b0 + a) * xxh3::kBlockLen + (q + 4 * i) * xxh3::kStripeLen + 8 * j) : 0;
#pragma unroll
    for (int a = 0; a < kBlocksAhead; ++a) {
      if (b0 + a >= nb_blocks) break;  // the same for the whole warp
      uint64_t sum = 0;
#pragma unroll
      for (int i = 0; i < kWordsPerBlock; ++i) sum += stripe_term(w[a][i], s + 8 * (q + 4 * i), j);
      sum += __shfl_xor_sync(kFullWarp, sum, 8);
      sum += __shfl_xor_sync(kFullWarp, sum, 16);
      acc = xxh3::scramble(acc + sum, s + xxh3::kSecretSize - xxh3::kStripeLen, j);
    }
  }
  const uint64_t blk = nb_blocks * xxh3::kBlockLen;
  const int nb_stripes = int(((len - 1) - blk) / xxh3::kStripeLen);  // 0 .. 15
  uint64_t w[kWordsPerBlock];
#pragma unroll
  for (int i = 0; i < kWordsPerBlock; ++i) {
    const int st = q + 4 * i;
    w[i] = st < nb_stripes ? in.word(blk + st * xxh3::kStripeLen + 8 * j) : 0;
  }
  const uint64_t last = in.word(len - xxh3::kStripeLen + 8 * j);
  uint64_t sum = 0;
#pragma unroll
  for (int i = 0; i < kWordsPerBlock; ++i) {
    const int st = q + 4 * i;
    const uint64_t term = stripe_term(w[i], s + 8 * (st < nb_stripes ? st : 0), j);
    if (st < nb_stripes) sum += term;
  }
  sum += __shfl_xor_sync(kFullWarp, sum, 8);
  sum += __shfl_xor_sync(kFullWarp, sum, 16);
  acc += sum + stripe_term(last, s + xxh3::kSecretSize - xxh3::kStripeLen - 7, j);
  uint64_t all[8];
#pragma unroll
  for (int k = 0; k < 8; ++k) all[k] = __shfl_sync(kFullWarp, acc, k);
  return xxh3::merge(all, s, len);
}

// out[r] = XXH3-64 of row r's bytes (len bytes a row), one warp a row.
template <typename Src>
__global__ void digest_rows_kernel(Src data, int64_t rows, int64_t row_stride, uint64_t len, uint64_t* out) {
  __shared__ alignas(16) uint8_t s[xxh3::kSecretSize];
  __shared__ alignas(16) uint8_t short_rows[kWarpsPerBlock][240];  // a short bf16 row's patterns
  for (int i = threadIdx.x; i < xxh3::kSecretSize; i += blockDim.x) s[i] = c_secret[i];
  __syncthreads();
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int64_t r = int64_t(blockIdx.x) * kWarpsPerBlock + warp;
  if (r >= rows) return;  // whole warps only: the shuffles below need all 32 lanes of a warp
  const Src in{data.row + r * row_stride};
  if (len > 240) {
    const uint64_t h = warp_hash_long(in, len, s, lane);
    if (lane == 0) out[r] = h;
    return;
  }
  if constexpr (std::is_same_v<Src, RawBytes>) {
    if (lane == 0) out[r] = xxh3::hash_short(in.row, len, s);
  } else {  // the patterns of at most 120 values, staged for the short-input reads at any offset
    uint16_t* bits = reinterpret_cast<uint16_t*>(short_rows[warp]);
    for (uint64_t i = lane; i < len / 2; i += 32) bits[i] = num::bf16_bits(in.row[i]);
    __syncwarp();
    if (lane == 0) out[r] = xxh3::hash_short(short_rows[warp], len, s);
  }
}

template <typename Src>
void launch_digests(Src data, int64_t rows, int64_t row_stride, uint64_t len, uint64_t* out, cudaStream_t stream) {
  const int64_t blocks = (rows + kWarpsPerBlock - 1) / kWarpsPerBlock;
  if (blocks > 0x7fffffff) throw Error("cuda digest_rows cannot run: too many rows");
  digest_rows_kernel<<<unsigned(blocks), 32 * kWarpsPerBlock, 0, stream>>>(data, rows, row_stride, len, out);
  CUDA_CHECK(cudaGetLastError());
}

// The block sums of rows of fp32 values taken as bf16 patterns: one warp a block (row r = the warp's
// index / nb, block b = its remainder), lane l reading words l + 32 i.
__global__ void digest_row_sums_kernel(const float* data, int64_t rows, int64_t elems, int64_t ld,
                                       uint64_t* out) {
  const int lane = threadIdx.x & 31;
  const int64_t nb = elems / xxh3::kSumRowValues;
  const int64_t blk = int64_t(blockIdx.x) * kWarpsPerBlock + (threadIdx.x >> 5);
  if (blk >= rows * nb) return;  // whole warps only
  const int64_t r = blk / nb, b = blk - r * nb;
  const Bf16Patterns in{data + r * ld};
  uint64_t w[sums::kWordsPerLane];
#pragma unroll
  for (int i = 0; i < sums::kWordsPerLane; ++i)
    w[i] = in.word(uint64_t(b) * xxh3::kBlockLen + 8 * uint64_t(lane + 32 * i));
  sums::warp_block_sums(w, b == nb - 1, lane, out + blk * 8);
}

// out[r] = xxh3::hash_from_sums of row r's nb blocks, one thread a row.
__global__ void digest_from_sums_kernel(const uint64_t* sums, int64_t rows, int64_t nb, uint64_t* out) {
  const int64_t r = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (r < rows) out[r] = xxh3::hash_from_sums(sums + r * nb * 8, nb, c_secret);
}

__global__ void digest_delay_kernel(uint64_t ns) {
  uint64_t start = 0, now = 0;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
  do {
    __nanosleep(1000);
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
  } while (now - start < ns);
}

}  // namespace

void digest_delay(int microseconds, cudaStream_t stream) {
  if (microseconds <= 0) return;
  digest_delay_kernel<<<1, 1, 0, stream>>>(uint64_t(microseconds) * 1000);
  CUDA_CHECK(cudaGetLastError());
}

void row_sums_bf16(const float* data, int64_t rows, int64_t elems, int64_t ld, uint64_t* sums,
                   cudaStream_t stream) {
  if (rows < 0 || !xxh3::bf16_row_has_sums(elems) || ld < elems)
    throw Error("cuda row_sums_bf16 cannot run: " + std::to_string(rows) + " rows of " +
                std::to_string(elems) + " values " + std::to_string(ld) +
                " apart (rows of a positive multiple of " + std::to_string(xxh3::kSumRowValues) +
                " values only)");
  if (rows == 0) return;
  if (!data || !sums) throw Error("cuda row_sums_bf16 cannot run: null data or sums");
  const int64_t blocks = (rows * (elems / xxh3::kSumRowValues) + kWarpsPerBlock - 1) / kWarpsPerBlock;
  if (blocks > 0x7fffffff) throw Error("cuda row_sums_bf16 cannot run: too many rows");
  digest_row_sums_kernel<<<unsigned(blocks), 32 * kWarpsPerBlock, 0, stream>>>(data, rows, elems, ld, sums);
  CUDA_CHECK(cudaGetLastError());
}

void digests_from_sums(const uint64_t* sums, int64_t rows, int64_t nb, uint64_t* out, cudaStream_t stream) {
  if (rows < 0 || nb < 1)
    throw Error("cuda digests_from_sums cannot run: " + std::to_string(rows) + " rows of " +
                std::to_string(nb) + " blocks");
  if (rows == 0) return;
  if (!sums || !out) throw Error("cuda digests_from_sums cannot run: null sums or out");
  constexpr int kThreads = 128;
  const int64_t blocks = (rows + kThreads - 1) / kThreads;
  if (blocks > 0x7fffffff) throw Error("cuda digests_from_sums cannot run: too many rows");
  digest_from_sums_kernel<<<unsigned(blocks), kThreads, 0, stream>>>(sums, rows, nb, out);
  CUDA_CHECK(cudaGetLastError());
}

void digest_rows(const void* data, int64_t rows, int64_t row_bytes, uint64_t* out, cudaStream_t stream) {
  if (rows < 0 || row_bytes < 0)
    throw Error("cuda digest_rows cannot run: negative rows (" + std::to_string(rows) + ") or row_bytes (" +
                std::to_string(row_bytes) + ")");
  if (rows == 0) return;
  if (!out || (!data && row_bytes > 0)) throw Error("cuda digest_rows cannot run: null data or out");
  launch_digests(RawBytes{static_cast<const uint8_t*>(data)}, rows, row_bytes, uint64_t(row_bytes), out, stream);
}

void digest_rows_bf16(const float* data, int64_t rows, int64_t elems, uint64_t* out, cudaStream_t stream) {
  if (rows < 0 || elems < 0)
    throw Error("cuda digest_rows_bf16 cannot run: negative rows (" + std::to_string(rows) + ") or elems (" +
                std::to_string(elems) + ")");
  if (rows == 0) return;
  if (!out || (!data && elems > 0)) throw Error("cuda digest_rows_bf16 cannot run: null data or out");
  launch_digests(Bf16Patterns{data}, rows, elems, uint64_t(elems) * 2, out, stream);
}

}  // namespace dsv4::cuda
