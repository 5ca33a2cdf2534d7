// XXH3-64 on the GPU (kernels/cuda/xxh3.h) against libxxhash's XXH3_64bits (header-only, so the GPU
// machine needs no libxxhash library): every length 0..2048 and many up to 64 KiB, at byte offsets
// 0..7 into a buffer, several rows per launch (so rows also start at odd addresses); fp32 rows hashed as
// their bf16 patterns likewise, against libxxhash over patterns made on the host. The shared
// host/device source is also checked on the host, which needs no device.
#ifndef XXH_INLINE_ALL
#define XXH_INLINE_ALL
#endif
#include <xxhash.h>

#include <gtest/gtest.h>

#include <cstdint>
#include <limits>
#include <random>
#include <vector>

#include "gpu_test_util.h"
#include "kernels/cuda/xxh3.h"
#include "kernels/numerics/numerics.h"

namespace dsv4 {
namespace {

std::vector<uint8_t> random_bytes(size_t n, uint32_t seed) {
  std::mt19937 g(seed);
  std::vector<uint8_t> b(n);
  for (auto& x : b) x = uint8_t(g());
  return b;
}

std::vector<size_t> long_lengths() {
  std::vector<size_t> v;
  for (size_t n = 2049; n <= 65536; n = n * 5 / 4 + 7) v.push_back(n);
  for (size_t n : {4095, 4096, 4097, 8192, 16383, 16384, 16385, 32768, 65535, 65536}) v.push_back(n);
  return v;
}

TEST(Xxh3, HostSourceMatchesLibxxhash) {
  const std::vector<uint8_t> buf = random_bytes(65536 + 64, 1);
  for (size_t off = 0; off < 8; ++off)
    for (size_t n = 0; n <= 2048; ++n)
      ASSERT_EQ(xxh3::hash64(buf.data() + off, n, xxh3::kSecret), XXH3_64bits(buf.data() + off, n))
          << "len " << n << " offset " << off;
  for (size_t n : long_lengths())
    ASSERT_EQ(xxh3::hash64(buf.data() + 5, n, xxh3::kSecret), XXH3_64bits(buf.data() + 5, n)) << "len " << n;
}

// Hashes `rows` rows of `n` bytes starting `off` bytes into a guarded device copy of `host`.
void check_rows(const std::vector<uint8_t>& host, size_t off, int64_t rows, size_t n) {
  test::DeviceBuffers bufs;
  const uint8_t* d = bufs.upload(host, "data");
  uint64_t* out = bufs.upload(std::vector<uint64_t>(size_t(rows), 0), "out");
  cuda::digest_rows(d + off, rows, int64_t(n), out, nullptr);
  const std::vector<uint64_t> got = bufs.download(out, size_t(rows));
  for (int64_t r = 0; r < rows; ++r)
    ASSERT_EQ(got[size_t(r)], XXH3_64bits(host.data() + off + size_t(r) * n, n))
        << "len " << n << " offset " << off << " row " << r;
  ASSERT_TRUE(bufs.guards_intact());
}

TEST(Xxh3, GpuMatchesLibxxhashShortAndMid) {
  DSV4_REQUIRE_CUDA_DEVICE();
  const std::vector<uint8_t> host = random_bytes(3 * 2048 + 16, 2);
  for (size_t off = 0; off < 8; ++off)
    for (size_t n = 0; n <= 2048; ++n) check_rows(host, off, 3, n);
}

TEST(Xxh3, GpuMatchesLibxxhashLong) {
  DSV4_REQUIRE_CUDA_DEVICE();
  const std::vector<uint8_t> host = random_bytes(2 * 65536 + 16, 3);
  for (size_t off = 0; off < 8; ++off)
    for (size_t n : long_lengths()) check_rows(host, off, 2, n);
}

TEST(Xxh3, GpuManyRows) {
  DSV4_REQUIRE_CUDA_DEVICE();
  const int64_t rows = 1001;
  for (size_t n : {size_t(0), size_t(7), size_t(240), size_t(241), size_t(1024), size_t(3000)})
    check_rows(random_bytes(size_t(rows) * n + 8, uint32_t(n)), 1, rows, n);
}

// Rows of `elems` fp32 values starting `off` values into a guarded device copy of `host`, hashed as
// their bf16 patterns, against libxxhash over the patterns made here.
void check_bf16_rows(const std::vector<float>& host, size_t off, int64_t rows, size_t elems) {
  test::DeviceBuffers bufs;
  const float* d = bufs.upload(host, "data");
  uint64_t* out = bufs.upload(std::vector<uint64_t>(size_t(rows), 0), "out");
  cuda::digest_rows_bf16(d + off, rows, int64_t(elems), out, nullptr);
  const std::vector<uint64_t> got = bufs.download(out, size_t(rows));
  std::vector<uint16_t> bits(elems);
  for (int64_t r = 0; r < rows; ++r) {
    for (size_t i = 0; i < elems; ++i) bits[i] = num::bf16_bits(host[off + size_t(r) * elems + i]);
    ASSERT_EQ(got[size_t(r)], XXH3_64bits(bits.data(), 2 * elems))
        << "elems " << elems << " offset " << off << " row " << r;
  }
  ASSERT_TRUE(bufs.guards_intact());
}

// Values that are not bf16-exact (rounded by the patterns), signed zeros, infinities and NaNs.
std::vector<float> random_floats(size_t n, uint32_t seed) {
  std::mt19937 g(seed);
  std::normal_distribution<float> normal(0.0f, 3.0f);
  const float specials[] = {0.0f, -0.0f, std::numeric_limits<float>::infinity(),
                            -std::numeric_limits<float>::infinity(), std::numeric_limits<float>::quiet_NaN(),
                            std::numeric_limits<float>::denorm_min(), 3.3895314e38f};
  std::vector<float> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = g() % 97 == 0 ? specials[g() % 7] : normal(g);
  return v;
}

TEST(Xxh3, GpuBf16PatternsMatchLibxxhash) {
  DSV4_REQUIRE_CUDA_DEVICE();
  const std::vector<float> shortish = random_floats(3 * 1100 + 8, 4);
  for (size_t off = 0; off < 4; ++off)  // rows at every 4-byte alignment of a 16-byte load
    for (size_t elems = 0; elems <= 1100; ++elems) check_bf16_rows(shortish, off, 3, elems);
  const std::vector<float> longer = random_floats(2 * 32768 + 8, 5);
  for (size_t n : long_lengths())
    for (size_t off : {size_t(0), size_t(1), size_t(2)}) check_bf16_rows(longer, off, 2, n / 2);
  for (size_t elems : {size_t(120), size_t(121), size_t(1024), size_t(4096)})
    check_bf16_rows(random_floats(1001 * elems + 4, uint32_t(elems)), 3, 1001, elems);
}

TEST(Xxh3, GpuRejectsNegativeSizes) {
  EXPECT_THROW(cuda::digest_rows(nullptr, -1, 4, nullptr, nullptr), Error);
  EXPECT_THROW(cuda::digest_rows(nullptr, 1, -4, nullptr, nullptr), Error);
  EXPECT_THROW(cuda::digest_rows_bf16(nullptr, -1, 4, nullptr, nullptr), Error);
  EXPECT_THROW(cuda::digest_rows_bf16(nullptr, 1, -4, nullptr, nullptr), Error);
}

}  // namespace
}  // namespace dsv4
