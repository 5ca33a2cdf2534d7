// Row digests formed by the kernels that write the rows (kernels/xxh3.h "Block sums"): a bf16
// row of n values (n a multiple of xxh3::kSumRowValues = 512) is n / 512 blocks of 128 8-byte words
// of bf16 patterns. One warp that holds a block's 128 words (lane l: words l + 32 i, i < 4) forms its
// 8 sums with shuffles; digests_from_sums turns a row's sums into its XXH3-64 later, on the digest
// stream. The sums are integer sums (mod 2^64), so how the words are split never changes them.
#pragma once

#include <cstdint>

#include "kernels/xxh3.h"
#include "kernels/numerics/numerics.h"

namespace dsv4::cuda::sums {

constexpr int kWordsPerLane = xxh3::kBlockLen / 8 / 32;  // 4
constexpr unsigned kFullWarp = 0xffffffffu;

// The key of lane l's word i (word l + 32 i of a block: lane j = l % 8 of stripe l / 8 + 4 i) at
// [i][l]; [kWordsPerLane][l]: word kWordsPerLane - 1's in a row's last block, whose 16th stripe takes
// the last-stripe key. In global memory, so that the 32 lanes' different keys come in one load.
struct LaneKeyTable {
  uint64_t key[kWordsPerLane + 1][32];
};
constexpr LaneKeyTable lane_key_table() {
  LaneKeyTable t{};
  for (int i = 0; i <= kWordsPerLane; ++i)
    for (int l = 0; l < 32; ++l) {
      const int word = i < kWordsPerLane ? i : kWordsPerLane - 1;
      const int at = xxh3::block_stripe_key(l / 8 + 4 * word, i == kWordsPerLane) + 8 * (l % 8);
      for (int b = 0; b < 8; ++b) t.key[i][l] |= uint64_t(xxh3::kSecret[at + b]) << (8 * b);
    }
  return t;
}
namespace {
__device__ const LaneKeyTable g_lane_keys = lane_key_table();
}  // namespace

// The 8 bytes of bf16 patterns of 4 consecutive values (little endian, capture/digest.h).
__device__ __forceinline__ uint64_t bf16_word(float4 v) {
  return uint64_t(num::bf16_bits(v.x)) | uint64_t(num::bf16_bits(v.y)) << 16 |
         uint64_t(num::bf16_bits(v.z)) << 32 | uint64_t(num::bf16_bits(v.w)) << 48;
}

// Warp-collective (all 32 lanes): lane l holds w = word l + 32 i of a block (`last`: the row's last
// block) and gets its stripe term (xxh3::stripe_term), taking word l ^ 1 by shuffle. A block's sums
// are its lanes' terms summed over i, then over the lanes of one accumulator lane (block_sums_out).
__device__ __forceinline__ uint64_t word_term(uint64_t w, int i, bool last, int lane) {
  const uint64_t other = __shfl_xor_sync(kFullWarp, w, 1);
  const uint64_t key = w ^ __ldg(&g_lane_keys.key[i == kWordsPerLane - 1 && last ? kWordsPerLane : i][lane]);
  return other + (key & 0xFFFFFFFFULL) * (key >> 32);
}
// Warp-collective: `terms` = lane l's terms of one block summed over i; lanes 0..7 write the block's
// sums, out[j] for j = lane.
__device__ __forceinline__ void block_sums_out(uint64_t terms, int lane, uint64_t* out) {
  terms += __shfl_xor_sync(kFullWarp, terms, 8);
  terms += __shfl_xor_sync(kFullWarp, terms, 16);
  if (lane < 8) out[lane] = terms;
}
// Both, for a lane holding all its words of the block: w[i] = word l + 32 i.
__device__ __forceinline__ void warp_block_sums(const uint64_t (&w)[kWordsPerLane], bool last, int lane,
                                                uint64_t* out) {
  uint64_t terms = 0;
#pragma unroll
  for (int i = 0; i < kWordsPerLane; ++i) terms += word_term(w[i], i, last, lane);
  block_sums_out(terms, lane, out);
}

}  // namespace dsv4::cuda::sums
