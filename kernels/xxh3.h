// XXH3-64 (seed 0, the default 192-byte secret), bit-identical to libxxhash's XXH3_64bits for every
// length, as one source usable on the host and in CUDA device code, plus the GPU row digest of
// capture/digest.h: one XXH3-64 per row of a device buffer. The host uses its pieces too: the trace
// seal (capture/trace_seal.cpp) forms XXH3-128's block sums and merge with them.
//
// The hash functions below take the secret as a pointer so that host code passes kSecret and device
// code its __constant__ copy (kernels/cuda/xxh3.cu). Input bytes may be at any alignment; they are read
// little endian byte by byte (8-byte aligned words are loaded directly).
#pragma once

#include <cstddef>
#include <cstdint>

#if defined(__CUDACC__)
#define DSV4_XXH3_HD __host__ __device__ __forceinline__
#else
#define DSV4_XXH3_HD inline
#endif

// The default secret of XXH3 (XXH3_kSecret of xxhash.h 0.8).
#define DSV4_XXH3_SECRET_BYTES                                                                              \
  0xb8, 0xfe, 0x6c, 0x39, 0x23, 0xa4, 0x4b, 0xbe, 0x7c, 0x01, 0x81, 0x2c, 0xf7, 0x21, 0xad, 0x1c, 0xde,     \
      0xd4, 0x6d, 0xe9, 0x83, 0x90, 0x97, 0xdb, 0x72, 0x40, 0xa4, 0xa4, 0xb7, 0xb3, 0x67, 0x1f, 0xcb, 0x79, \
      0xe6, 0x4e, 0xcc, 0xc0, 0xe5, 0x78, 0x82, 0x5a, 0xd0, 0x7d, 0xcc, 0xff, 0x72, 0x21, 0xb8, 0x08, 0x46, \
      0x74, 0xf7, 0x43, 0x24, 0x8e, 0xe0, 0x35, 0x90, 0xe6, 0x81, 0x3a, 0x26, 0x4c, 0x3c, 0x28, 0x52, 0xbb, \
      0x91, 0xc3, 0x00, 0xcb, 0x88, 0xd0, 0x65, 0x8b, 0x1b, 0x53, 0x2e, 0xa3, 0x71, 0x64, 0x48, 0x97, 0xa2, \
      0x0d, 0xf9, 0x4e, 0x38, 0x19, 0xef, 0x46, 0xa9, 0xde, 0xac, 0xd8, 0xa8, 0xfa, 0x76, 0x3f, 0xe3, 0x9c, \
      0x34, 0x3f, 0xf9, 0xdc, 0xbb, 0xc7, 0xc7, 0x0b, 0x4f, 0x1d, 0x8a, 0x51, 0xe0, 0x4b, 0xcd, 0xb4, 0x59, \
      0x31, 0xc8, 0x9f, 0x7e, 0xc9, 0xd9, 0x78, 0x73, 0x64, 0xea, 0xc5, 0xac, 0x83, 0x34, 0xd3, 0xeb, 0xc3, \
      0xc5, 0x81, 0xa0, 0xff, 0xfa, 0x13, 0x63, 0xeb, 0x17, 0x0d, 0xdd, 0x51, 0xb7, 0xf0, 0xda, 0x49, 0xd3, \
      0x16, 0x55, 0x26, 0x29, 0xd4, 0x68, 0x9e, 0x2b, 0x16, 0xbe, 0x58, 0x7d, 0x47, 0xa1, 0xfc, 0x8f, 0xf8, \
      0xb8, 0xd1, 0x7a, 0xd0, 0x31, 0xce, 0x45, 0xcb, 0x3a, 0x8f, 0x95, 0x16, 0x04, 0x28, 0xaf, 0xd7, 0xfb, \
      0xca, 0xbb, 0x4b, 0x40, 0x7e

namespace dsv4::xxh3 {

inline constexpr uint8_t kSecret[192] = {DSV4_XXH3_SECRET_BYTES};
inline constexpr int kSecretSize = 192;
inline constexpr int kStripeLen = 64;
inline constexpr int kStripesPerBlock = (kSecretSize - kStripeLen) / 8;  // 16
inline constexpr int kBlockLen = kStripeLen * kStripesPerBlock;          // 1024

inline constexpr uint64_t kP32_1 = 0x9E3779B1U, kP32_2 = 0x85EBCA77U, kP32_3 = 0xC2B2AE3DU;
inline constexpr uint64_t kP64_1 = 0x9E3779B185EBCA87ULL, kP64_2 = 0xC2B2AE3D27D4EB4FULL,
                          kP64_3 = 0x165667B19E3779F9ULL, kP64_4 = 0x85EBCA77C2B2AE63ULL,
                          kP64_5 = 0x27D4EB2F165667C5ULL;
inline constexpr uint64_t kPMx1 = 0x165667919E3779F9ULL, kPMx2 = 0x9FB21C651E98DF25ULL;

DSV4_XXH3_HD uint32_t read32(const uint8_t* p) {
  return uint32_t(p[0]) | uint32_t(p[1]) << 8 | uint32_t(p[2]) << 16 | uint32_t(p[3]) << 24;
}
DSV4_XXH3_HD uint64_t read64(const uint8_t* p) {
  if ((reinterpret_cast<uintptr_t>(p) & 7) == 0) return *reinterpret_cast<const uint64_t*>(p);
  return uint64_t(read32(p)) | uint64_t(read32(p + 4)) << 32;
}
DSV4_XXH3_HD uint64_t rotl64(uint64_t x, int r) {
  return (x << r) | (x >> (64 - r));
}
DSV4_XXH3_HD uint32_t swap32(uint32_t x) {
  return (x << 24) | ((x << 8) & 0xff0000u) | ((x >> 8) & 0xff00u) | (x >> 24);
}
DSV4_XXH3_HD uint64_t swap64(uint64_t x) {
  return uint64_t(swap32(uint32_t(x))) << 32 | swap32(uint32_t(x >> 32));
}
// The low 64 bits of the 128-bit product xor its high 64 bits.
DSV4_XXH3_HD uint64_t mul128_fold64(uint64_t a, uint64_t b) {
#if defined(__CUDA_ARCH__)
  return (a * b) ^ __umul64hi(a, b);
#else
  const unsigned __int128 p = static_cast<unsigned __int128>(a) * b;
  return uint64_t(p) ^ uint64_t(p >> 64);
#endif
}
DSV4_XXH3_HD uint64_t xxh64_avalanche(uint64_t h) {
  h ^= h >> 33;
  h *= kP64_2;
  h ^= h >> 29;
  h *= kP64_3;
  return h ^ (h >> 32);
}
DSV4_XXH3_HD uint64_t avalanche(uint64_t h) {
  h ^= h >> 37;
  h *= kPMx1;
  return h ^ (h >> 32);
}
DSV4_XXH3_HD uint64_t rrmxmx(uint64_t h, uint64_t len) {
  h ^= rotl64(h, 49) ^ rotl64(h, 24);
  h *= kPMx2;
  h ^= (h >> 35) + len;
  h *= kPMx2;
  return h ^ (h >> 28);
}
DSV4_XXH3_HD uint64_t mix16(const uint8_t* in, const uint8_t* s) {
  return mul128_fold64(read64(in) ^ read64(s), read64(in + 8) ^ read64(s + 8));
}

// Lengths 0..240 (seed 0).
DSV4_XXH3_HD uint64_t hash_short(const uint8_t* in, uint64_t len, const uint8_t* s) {
  if (len == 0) return xxh64_avalanche(read64(s + 56) ^ read64(s + 64));
  if (len <= 3) {
    const uint32_t combined = (uint32_t(in[0]) << 16) | (uint32_t(in[len >> 1]) << 24) |
                              uint32_t(in[len - 1]) | (uint32_t(len) << 8);
    return xxh64_avalanche(uint64_t(combined) ^ uint64_t(read32(s) ^ read32(s + 4)));
  }
  if (len <= 8) {
    const uint64_t in64 = uint64_t(read32(in + len - 4)) + (uint64_t(read32(in)) << 32);
    return rrmxmx(in64 ^ (read64(s + 8) ^ read64(s + 16)), len);
  }
  if (len <= 16) {
    const uint64_t lo = read64(in) ^ (read64(s + 24) ^ read64(s + 32));
    const uint64_t hi = read64(in + len - 8) ^ (read64(s + 40) ^ read64(s + 48));
    return avalanche(len + swap64(lo) + hi + mul128_fold64(lo, hi));
  }
  uint64_t acc = len * kP64_1;
  if (len <= 128) {
    if (len > 32) {
      if (len > 64) {
        if (len > 96) acc += mix16(in + 48, s + 96) + mix16(in + len - 64, s + 112);
        acc += mix16(in + 32, s + 64) + mix16(in + len - 48, s + 80);
      }
      acc += mix16(in + 16, s + 32) + mix16(in + len - 32, s + 48);
    }
    acc += mix16(in, s) + mix16(in + len - 16, s + 16);
    return avalanche(acc);
  }
  // 129..240
  for (int i = 0; i < 8; ++i) acc += mix16(in + 16 * i, s + 16 * i);
  acc = avalanche(acc);
  const int rounds = int(len / 16);
  for (int i = 8; i < rounds; ++i) acc += mix16(in + 16 * i, s + 16 * (i - 8) + 3);
  acc += mix16(in + len - 16, s + 136 - 17);
  return avalanche(acc);
}

// One stripe's contribution to accumulator lane j (0..7): data of lane j^1 plus the 32x32 product of
// the keyed lane j. Contributions of the stripes of one block add up in any order (mod 2^64).
DSV4_XXH3_HD uint64_t stripe_term(const uint8_t* stripe, const uint8_t* s, int j) {
  const uint64_t key = read64(stripe + 8 * j) ^ read64(s + 8 * j);
  return read64(stripe + 8 * (j ^ 1)) + (key & 0xFFFFFFFFULL) * (key >> 32);
}
DSV4_XXH3_HD uint64_t scramble(uint64_t acc, const uint8_t* s, int j) {
  acc ^= acc >> 47;
  acc ^= read64(s + 8 * j);
  return acc * kP32_1;
}
DSV4_XXH3_HD void init_acc(uint64_t acc[8]) {
  acc[0] = kP32_3, acc[1] = kP64_1, acc[2] = kP64_2, acc[3] = kP64_3;
  acc[4] = kP64_4, acc[5] = kP32_2, acc[6] = kP64_5, acc[7] = kP32_1;
}
// XXH3_mergeAccs: the accumulators folded against 64 bytes of secret at `s`, from `start`.
DSV4_XXH3_HD uint64_t merge_accs(const uint64_t acc[8], const uint8_t* s, uint64_t start) {
  uint64_t r = start;
  for (int i = 0; i < 4; ++i)
    r += mul128_fold64(acc[2 * i] ^ read64(s + 16 * i), acc[2 * i + 1] ^ read64(s + 16 * i + 8));
  return avalanche(r);
}
// The 64-bit result of a long input; XXH3-128's low half is the same, its high half
// merge_accs(acc, s + kSecretSize - 64 - 11, ~(len * kP64_2)).
DSV4_XXH3_HD uint64_t merge(const uint64_t acc[8], const uint8_t* s, uint64_t len) {
  return merge_accs(acc, s + 11, len * kP64_1);
}
// The secret offset of the key XXH3 hashes a long input's last 64 bytes with.
inline constexpr int kLastStripeKey = kSecretSize - kStripeLen - 7;

// The end of a long input after its whole blocks: the `nb_stripes` stripes of the last, partial block
// at `partial`, then the input's last 64 bytes at `last` (which may overlap them).
DSV4_XXH3_HD void accumulate_tail(uint64_t acc[8], const uint8_t* partial, int nb_stripes,
                                  const uint8_t* last, const uint8_t* s) {
  for (int st = 0; st < nb_stripes; ++st)
    for (int j = 0; j < 8; ++j) acc[j] += stripe_term(partial + st * kStripeLen, s + 8 * st, j);
  for (int j = 0; j < 8; ++j) acc[j] += stripe_term(last, s + kLastStripeKey, j);
}

// ---- Block sums: the hash of an input of whole blocks, formed block by block in any order
// An input of nb * kBlockLen bytes (nb >= 1) hashes as: for blocks 0 .. nb - 2, acc += the block's
// stripe terms, then scramble; for the last block, acc += its first 15 stripes' terms and the term of
// the input's last 64 bytes (= its 16th stripe) under the last-stripe key; then merge. So a block's 8
// sums (one per accumulator lane j, each the sum mod 2^64 of its 16 stripes' terms, the last block's
// 16th under kLastStripeKey) can be formed by whichever thread holds the block, and hash_from_sums
// gives XXH3_64bits of the input from them. A bf16 row of n values is such an input when n is a
// multiple of kSumRowValues: the kernel that writes the row can then form its sums (the row digests
// of capture/digest.h).
inline constexpr int64_t kSumRowValues = kBlockLen / 2;  // bf16 values of a block
DSV4_XXH3_HD bool bf16_row_has_sums(int64_t n) {
  return n > 0 && n % kSumRowValues == 0;
}
// The secret offset of the key of stripe `st` (0 .. 15) of a block; `last`: the input's last block.
constexpr DSV4_XXH3_HD int block_stripe_key(int st, bool last) {
  return last && st == kStripesPerBlock - 1 ? kLastStripeKey : 8 * st;
}
// The 8 sums of the block at `block` (kBlockLen bytes).
DSV4_XXH3_HD void block_sums(const uint8_t* block, bool last, const uint8_t* s, uint64_t sums[8]) {
  for (int j = 0; j < 8; ++j) sums[j] = 0;
  for (int st = 0; st < kStripesPerBlock; ++st)
    for (int j = 0; j < 8; ++j)
      sums[j] += stripe_term(block + st * kStripeLen, s + block_stripe_key(st, last), j);
}
// XXH3_64bits of an input of nb blocks (nb >= 1) from its blocks' sums, sums[8 * b + j].
DSV4_XXH3_HD uint64_t hash_from_sums(const uint64_t* sums, int64_t nb, const uint8_t* s) {
  uint64_t acc[8];
  init_acc(acc);
  for (int64_t b = 0; b + 1 < nb; ++b)
    for (int j = 0; j < 8; ++j) acc[j] = scramble(acc[j] + sums[8 * b + j], s + kSecretSize - kStripeLen, j);
  for (int j = 0; j < 8; ++j) acc[j] += sums[8 * (nb - 1) + j];
  return merge(acc, s, uint64_t(nb) * kBlockLen);
}

// Lengths > 240, sequentially (the scalar path of libxxhash).
DSV4_XXH3_HD uint64_t hash_long(const uint8_t* in, uint64_t len, const uint8_t* s) {
  uint64_t acc[8];
  init_acc(acc);
  const uint64_t nb_blocks = (len - 1) / kBlockLen;
  for (uint64_t b = 0; b < nb_blocks; ++b) {
    for (int st = 0; st < kStripesPerBlock; ++st)
      for (int j = 0; j < 8; ++j) acc[j] += stripe_term(in + b * kBlockLen + st * kStripeLen, s + 8 * st, j);
    for (int j = 0; j < 8; ++j) acc[j] = scramble(acc[j], s + kSecretSize - kStripeLen, j);
  }
  const int nb_stripes = int(((len - 1) - kBlockLen * nb_blocks) / kStripeLen);
  accumulate_tail(acc, in + nb_blocks * kBlockLen, nb_stripes, in + len - kStripeLen, s);
  return merge(acc, s, len);
}

// XXH3_64bits(data, len) with `secret` = the default secret (kSecret, or its device copy).
DSV4_XXH3_HD uint64_t hash64(const void* data, uint64_t len, const uint8_t* secret) {
  const uint8_t* in = static_cast<const uint8_t*>(data);
  return len <= 240 ? hash_short(in, len, secret) : hash_long(in, len, secret);
}

}  // namespace dsv4::xxh3

#if defined(__CUDACC__) || __has_include(<cuda_runtime_api.h>)
#include <cuda_runtime_api.h>

namespace dsv4::cuda {

// out[r] = XXH3_64bits(data + r * row_bytes, row_bytes) for r in [0, rows). `data` and `out` are
// device pointers; `data` may have any alignment. One warp per row: rows longer than 240 bytes are
// hashed block by block with the 16 stripes x 8 lanes of a block spread over the warp (integer sums,
// so the result does not depend on the split). Enqueued on `stream`; throws dsv4::Error for negative
// sizes and on CUDA errors.
void digest_rows(const void* data, int64_t rows, int64_t row_bytes, uint64_t* out, cudaStream_t stream);

// The same for an fp32 matrix [rows, elems] hashed as its 2-byte bf16 patterns (num::bf16_bits of each
// value: the trace's storage bytes, capture/digest.h), converted as they are read: the matrix is read
// once and nothing else is written.
void digest_rows_bf16(const float* data, int64_t rows, int64_t elems, uint64_t* out, cudaStream_t stream);

// The block sums (xxh3::block_sums) of an fp32 matrix [rows, elems] (row r at data + r * ld) taken as
// its bf16 patterns, as the
// kernels that write such rows form them (kernels/cuda/xxh3_sums.cuh): sums[(r * nb + b) * 8 + j] with
// nb = elems / kSumRowValues blocks a row. elems must satisfy bf16_row_has_sums (Error otherwise). For
// rows whose producer cannot form them (kernels/cuda/mhc.cu and norm.cu fall back to this).
void row_sums_bf16(const float* data, int64_t rows, int64_t elems, int64_t ld, uint64_t* sums,
                   cudaStream_t stream);
// out[r] = XXH3-64 of row r (rows of nb blocks) from its block sums (xxh3::hash_from_sums), one
// thread a row.
void digests_from_sums(const uint64_t* sums, int64_t rows, int64_t nb, uint64_t* out, cudaStream_t stream);

// Tests of the digest stream only: one thread on `stream` waits `microseconds` (the device's global
// timer), so that digests enqueued after it run late. A report kernel (capture/cupti.h).
void digest_delay(int microseconds, cudaStream_t stream);

}  // namespace dsv4::cuda
#endif
