// XXH3-64 on the GPU (kernels/xxh3.h) against libxxhash's XXH3_64bits (header-only, so the GPU
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
#include <tuple>
#include <vector>

#include "gpu_test_util.h"
#include "kernels/cuda/ops.h"
#include "kernels/xxh3.h"
#include "kernels/mhc.h"
#include "kernels/norm.h"
#include "kernels/numerics/numerics.h"
#include "kernels/row_sums.h"
#include "test_util.h"

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

// ---- block sums (kernels/row_sums.h)

// cuda::row_sums_bf16 (strided rows) then cuda::digests_from_sums: the one-pass row digests'.
TEST(Xxh3, GpuRowSumsGiveTheRowDigests) {
  DSV4_REQUIRE_CUDA_DEVICE();
  for (auto [rows, n, ld] : {std::tuple{int64_t(7), int64_t(512), int64_t(512)},
                             std::tuple{int64_t(300), int64_t(4096), int64_t(4096)},
                             std::tuple{int64_t(5), int64_t(1536), int64_t(1601)}}) {
    const std::vector<float> host = random_floats(size_t(rows * ld), uint32_t(n));
    test::DeviceBuffers bufs;
    const float* d = bufs.upload(host, "data");
    const int64_t nb = n / xxh3::kSumRowValues;
    uint64_t* sums = bufs.upload(std::vector<uint64_t>(size_t(rows * nb * 8), 0), "sums");
    uint64_t* out = bufs.upload(std::vector<uint64_t>(size_t(rows), 0), "out");
    cuda::row_sums_bf16(d, rows, n, ld, sums, nullptr);
    cuda::digests_from_sums(sums, rows, nb, out, nullptr);
    std::vector<uint64_t> want(static_cast<size_t>(rows)), cpu_sums(static_cast<size_t>(rows * nb * 8));
    bf16_row_sums(host.data(), rows, n, ld, cpu_sums.data());
    std::vector<uint16_t> bits(static_cast<size_t>(n));
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t i = 0; i < n; ++i) bits[size_t(i)] = num::bf16_bits(host[size_t(r * ld + i)]);
      want[size_t(r)] = XXH3_64bits(bits.data(), size_t(2 * n));
    }
    EXPECT_EQ(bufs.download(sums, cpu_sums.size()), cpu_sums) << n;
    EXPECT_EQ(bufs.download(out, size_t(rows)), want) << n;
    EXPECT_TRUE(bufs.guards_intact());
  }
  EXPECT_THROW(cuda::row_sums_bf16(nullptr, 1, 1000, 1000, nullptr, nullptr), Error);
  EXPECT_THROW(cuda::digests_from_sums(nullptr, 1, 0, nullptr, nullptr), Error);
}

std::vector<float> bf16_values(size_t n, uint32_t seed, float scale = 1.0f) {
  std::mt19937 g(seed);
  std::normal_distribution<float> normal(0.0f, scale);
  std::vector<float> v(n);
  for (auto& x : v) x = num::bf16_round(normal(g));
  return v;
}

// hc_post with its outputs' block sums on the GPU: outputs and sums as the CPU's, for the kernel that
// forms them (hc = 4, D % 512 == 0) and for the shapes whose sums come from a second pass.
TEST(Xxh3, GpuHcPostFormsTheCpusSums) {
  DSV4_REQUIRE_CUDA_DEVICE();
  for (auto [T, hc, D] :
       {std::tuple{int64_t(37), 4, int64_t(1024)}, std::tuple{int64_t(5), 4, int64_t(128)},
        std::tuple{int64_t(3), 3, int64_t(512)}, std::tuple{int64_t(1), 4, int64_t(3584)}}) {
    const auto f = bf16_values(size_t(T * D), 1), R = bf16_values(size_t(T * hc * D), 2),
               post = bf16_values(size_t(T * hc), 3), comb = bf16_values(size_t(T * hc * hc), 4, 0.3f);
    const int64_t n = hc * D, nb = n / xxh3::kSumRowValues;
    HcPostParams p;
    p.T = T, p.hc = hc, p.D = D, p.f = f.data(), p.R = R.data(), p.post = post.data(), p.comb = comb.data();
    std::vector<float> out(size_t(T * n));
    std::vector<uint64_t> sums(size_t(T * nb * 8));
    p.out = out.data(), p.out_sums = sums.data();
    hc_post(p);
    test::DeviceBuffers bufs;
    HcPostParams q = p;
    q.f = bufs.upload(f, "f"), q.R = bufs.upload(R, "R"), q.post = bufs.upload(post, "post");
    q.comb = bufs.upload(comb, "comb");
    q.out = bufs.upload(std::vector<float>(out.size(), 0.0f), "out");
    q.out_sums = bufs.upload(std::vector<uint64_t>(sums.size(), 0), "sums");
    cuda::hc_post(q, nullptr);
    EXPECT_TRUE(test::bitwise_equal(bufs.download(q.out, out.size()), out)) << hc << " " << D;
    EXPECT_EQ(bufs.download(q.out_sums, sums.size()), sums) << hc << " " << D;
    EXPECT_TRUE(bufs.guards_intact());
  }
}

// hc_pre's and hc_head's y with its block sums (mix4_blocks_kernel at D % 512 == 0), as the CPU's: the
// fused weights kernel before it in blocks of 4 tokens (T = 37 and 3) and of 32 (T = 2700).
TEST(Xxh3, GpuHcPreAndHeadFormTheCpusSums) {
  DSV4_REQUIRE_CUDA_DEVICE();
  const int hc = 4;
  for (auto [T, D] : {std::pair{int64_t(37), int64_t(512)}, std::pair{int64_t(3), int64_t(2048)},
                      std::pair{int64_t(2700), int64_t(512)}}) {
    const int64_t rows = (2 + hc) * hc, nb = D / xxh3::kSumRowValues;
    const auto X = bf16_values(size_t(T * hc * D), 5), fn = bf16_values(size_t(rows * hc * D), 6, 0.02f),
               base = bf16_values(size_t(rows), 7);
    const std::vector<float> scale{0.5f, 0.7f, 0.9f};
    std::vector<float> pre(size_t(T * hc)), post(pre.size()), comb(size_t(T * hc * hc)), y(size_t(T * D));
    std::vector<uint64_t> sums(size_t(T * nb * 8));
    HcPreParams p;
    p.T = T, p.hc = hc, p.D = D, p.X = X.data(), p.fn = fn.data(), p.scale = scale.data(),
    p.base = base.data();
    p.pre = pre.data(), p.post = post.data(), p.comb = comb.data(), p.y = y.data(), p.y_sums = sums.data();
    hc_pre(p);
    test::DeviceBuffers bufs;
    HcPreParams q = p;
    q.X = bufs.upload(X, "X"), q.fn = bufs.upload(fn, "fn"), q.scale = bufs.upload(scale, "scale");
    q.base = bufs.upload(base, "base");
    q.pre = bufs.upload(pre, "pre"), q.post = bufs.upload(post, "post"), q.comb = bufs.upload(comb, "comb");
    q.y = bufs.upload(std::vector<float>(y.size(), 0.0f), "y");
    q.y_sums = bufs.upload(std::vector<uint64_t>(sums.size(), 0), "sums");
    cuda::hc_pre(q, nullptr);
    EXPECT_TRUE(test::bitwise_equal(bufs.download(q.y, y.size()), y)) << D;
    EXPECT_EQ(bufs.download(q.y_sums, sums.size()), sums) << D;

    HcHeadParams h;
    h.T = T, h.hc = hc, h.D = D, h.X = X.data(), h.fn = fn.data(), h.scale = scale.data(),
    h.base = base.data();
    std::vector<float> yh(y.size());
    std::vector<uint64_t> hsums(sums.size());
    h.y = yh.data(), h.y_sums = hsums.data();
    hc_head(h);
    HcHeadParams g = h;
    g.X = q.X, g.fn = q.fn, g.scale = q.scale, g.base = bufs.upload(base, "head base");
    g.y = bufs.upload(std::vector<float>(y.size(), 0.0f), "head y");
    g.y_sums = bufs.upload(std::vector<uint64_t>(sums.size(), 0), "head sums");
    cuda::hc_head(g, nullptr);
    EXPECT_TRUE(test::bitwise_equal(bufs.download(g.y, y.size()), yh)) << D;
    EXPECT_EQ(bufs.download(g.y_sums, sums.size()), hsums) << D;
    EXPECT_TRUE(bufs.guards_intact());
  }
}

// rmsnorm's y with its block sums: the staged kernel forms them (dim 1024, rows 16-byte aligned or
// not), the other one's rows get a second pass (dim 512), in both arithmetics; as the CPU's.
TEST(Xxh3, GpuRmsNormFormsTheCpusSums) {
  DSV4_REQUIRE_CUDA_DEVICE();
  for (auto [rows, dim, ld] : {std::tuple{int64_t(37), int64_t(1024), int64_t(1024)},
                               std::tuple{int64_t(9), int64_t(1024), int64_t(1026)},
                               std::tuple{int64_t(9), int64_t(512), int64_t(512)}}) {
    for (bool bf16 : {false, true}) {
      const auto x = bf16_values(size_t(rows * ld), 8), w = bf16_values(size_t(dim), 9);
      const int64_t nb = dim / xxh3::kSumRowValues;
      RmsNormParams p;
      p.rows = rows, p.dim = dim, p.x = x.data(), p.ldx = ld, p.w = bf16 ? nullptr : w.data(), p.ldy = ld;
      p.bf16_arith = bf16;
      std::vector<float> y(size_t(rows * ld), 0.0f);
      std::vector<uint64_t> sums(size_t(rows * nb * 8));
      p.y = y.data(), p.y_sums = sums.data();
      rmsnorm(p);
      test::DeviceBuffers bufs;
      RmsNormParams q = p;
      q.x = bufs.upload(x, "x");
      q.w = bf16 ? nullptr : bufs.upload(w, "w");
      q.y = bufs.upload(std::vector<float>(y.size(), 0.0f), "y");
      q.y_sums = bufs.upload(std::vector<uint64_t>(sums.size(), 0), "sums");
      cuda::rmsnorm(q, nullptr);
      EXPECT_TRUE(test::bitwise_equal(bufs.download(q.y, y.size()), y)) << dim << " " << ld << " " << bf16;
      EXPECT_EQ(bufs.download(q.y_sums, sums.size()), sums) << dim << " " << ld << " " << bf16;
      EXPECT_TRUE(bufs.guards_intact());
    }
  }
}

TEST(Xxh3, GpuRejectsNegativeSizes) {
  EXPECT_THROW(cuda::digest_rows(nullptr, -1, 4, nullptr, nullptr), Error);
  EXPECT_THROW(cuda::digest_rows(nullptr, 1, -4, nullptr, nullptr), Error);
  EXPECT_THROW(cuda::digest_rows_bf16(nullptr, -1, 4, nullptr, nullptr), Error);
  EXPECT_THROW(cuda::digest_rows_bf16(nullptr, 1, -4, nullptr, nullptr), Error);
}

}  // namespace
}  // namespace dsv4
