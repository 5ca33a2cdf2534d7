// Row digests formed by the kernels that write the rows (kernels/cuda/xxh3.h "Block sums"): a bf16
// row of n values (n a multiple of xxh3::kSumRowValues = 512) is n / 512 blocks of 128 8-byte words
// of bf16 patterns. One warp that holds a block's 128 words (lane l: words l + 32 i, i < 4) forms its
// 8 sums with shuffles; digests_from_sums turns a row's sums into its XXH3-64 later, on the digest
// stream. The sums are integer sums (mod 2^64), so how the words are split never changes them.
#pragma once

#include <cstdint>

#include "kernels/cuda/xxh3.h"
#include "kernels/numerics/numerics.h"

namespace dsv4::cuda::sums {

namespace {
__constant__ uint8_t c_sums_secret[xxh3::kSecretSize] = {DSV4_XXH3_SECRET_BYTES};
}  // namespace

constexpr int kWordsPerLane = xxh3::kBlockLen / 8 / 32;  // 4
constexpr unsigned kFullWarp = 0xffffffffu;

// The 8 bytes of bf16 patterns of 4 consecutive values (little endian, capture/digest.h).
__device__ __forceinline__ uint64_t bf16_word(float4 v) {
  return uint64_t(num::bf16_bits(v.x)) | uint64_t(num::bf16_bits(v.y)) << 16 |
         uint64_t(num::bf16_bits(v.z)) << 32 | uint64_t(num::bf16_bits(v.w)) << 48;
}

// A lane's keys: word l + 32 i of a block is lane j = l % 8 of stripe l / 8 + 4 i; `last` replaces the
// key of the last stripe (lanes 24..31, i = 3) in the row's last block.
struct LaneKeys {
  uint64_t key[kWordsPerLane];
  uint64_t last;
};
__device__ __forceinline__ LaneKeys lane_keys(int lane) {
  const int j = lane & 7;
  LaneKeys k;
#pragma unroll
  for (int i = 0; i < kWordsPerLane; ++i)
    k.key[i] = xxh3::read64(c_sums_secret + xxh3::block_stripe_key(lane / 8 + 4 * i, false) + 8 * j);
  k.last =
      xxh3::read64(c_sums_secret + xxh3::block_stripe_key(lane / 8 + 4 * (kWordsPerLane - 1), true) + 8 * j);
  return k;
}

// Warp-collective (all 32 lanes): lane l holds w[i] = word l + 32 i of one block; `last`: the row's
// last block. Lanes 0..7 write the block's sums: out[j] for j = lane.
__device__ __forceinline__ void warp_block_sums(const uint64_t (&w)[kWordsPerLane], bool last,
                                                const LaneKeys& k, int lane, uint64_t* out) {
  uint64_t sum = 0;
#pragma unroll
  for (int i = 0; i < kWordsPerLane; ++i) {
    const uint64_t other = __shfl_xor_sync(kFullWarp, w[i], 1);  // lane j ^ 1 of the same stripe
    const uint64_t key = w[i] ^ (i == kWordsPerLane - 1 && last ? k.last : k.key[i]);
    sum += other + (key & 0xFFFFFFFFULL) * (key >> 32);
  }
  sum += __shfl_xor_sync(kFullWarp, sum, 8);
  sum += __shfl_xor_sync(kFullWarp, sum, 16);
  if (lane < 8) out[lane] = sum;
}

}  // namespace dsv4::cuda::sums
