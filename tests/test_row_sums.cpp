// Row digests formed by the ops that write the rows (kernels/row_sums.h): the XXH3 of an input of whole
// blocks from its blocks' sums equals libxxhash's; the CPU ops' sums of their outputs give the trace's
// row digests (capture/digest.h) and leave the outputs as they are; rows that have no sums are refused.
#include <xxhash.h>

#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "capture/digest.h"
#include "kernels/error.h"
#include "kernels/mhc.h"
#include "kernels/norm.h"
#include "kernels/row_sums.h"
#include "test_util.h"

namespace dsv4 {
namespace {

using test::bitwise_equal;
using test::rng_for;

std::vector<uint8_t> random_bytes(size_t n, uint32_t seed) {
  std::mt19937 g(seed);
  std::vector<uint8_t> b(n);
  for (auto& x : b) x = uint8_t(g());
  return b;
}

// XXH3-64 of each row of the sums array [rows, n / 512, 8].
std::vector<uint64_t> from_sums(const std::vector<uint64_t>& sums, int64_t rows, int64_t n) {
  const int64_t nb = n / xxh3::kSumRowValues;
  std::vector<uint64_t> d;
  for (int64_t r = 0; r < rows; ++r)
    d.push_back(xxh3::hash_from_sums(sums.data() + r * nb * 8, nb, xxh3::kSecret));
  return d;
}

// The trace's digests of rows [rows, n] (row r at x + r * ld) reported as bf16.
std::vector<uint64_t> trace_digests(const float* x, int64_t rows, int64_t n, int64_t ld) {
  std::vector<float> packed;
  for (int64_t r = 0; r < rows; ++r) packed.insert(packed.end(), x + r * ld, x + r * ld + n);
  TensorRecord t;
  t.name = "rows";
  t.dtype = DType::bf16;
  t.shape = {rows, n};
  t.host = packed.data();
  return digest_rows(t);
}

std::vector<uint64_t> sums_for(int64_t rows, int64_t n) {
  return std::vector<uint64_t>(size_t(rows * (n / xxh3::kSumRowValues) * 8), 0xdeadbeefULL);
}

TEST(RowSums, RowsOfWholeBlocksOnly) {
  for (int64_t n : {512, 1024, 7168, 4 * 4096}) EXPECT_TRUE(xxh3::bf16_row_has_sums(n)) << n;
  for (int64_t n : {0, -512, 1, 128, 256, 96, 1000, 1536 + 64}) EXPECT_FALSE(xxh3::bf16_row_has_sums(n)) << n;
}

// Blocks summed one at a time, in reverse order, then hashed from the sums: libxxhash's XXH3_64bits
// of the whole input (its last block takes the last-stripe key for its 16th stripe).
TEST(RowSums, HashFromBlockSumsIsLibxxhashs) {
  for (int64_t nb = 1; nb <= 6; ++nb) {
    const std::vector<uint8_t> in = random_bytes(size_t(nb * xxh3::kBlockLen), uint32_t(nb));
    std::vector<uint64_t> sums(size_t(nb * 8));
    for (int64_t b = nb - 1; b >= 0; --b)
      xxh3::block_sums(in.data() + b * xxh3::kBlockLen, b == nb - 1, xxh3::kSecret, sums.data() + b * 8);
    EXPECT_EQ(xxh3::hash_from_sums(sums.data(), nb, xxh3::kSecret), XXH3_64bits(in.data(), in.size())) << nb;
    // A flipped bit in any block changes the hash.
    std::vector<uint8_t> flipped = in;
    flipped[size_t((nb - 1) * xxh3::kBlockLen + 1000)] ^= 4;
    std::vector<uint64_t> fs = sums;
    xxh3::block_sums(flipped.data() + (nb - 1) * xxh3::kBlockLen, true, xxh3::kSecret,
                     fs.data() + (nb - 1) * 8);
    EXPECT_NE(xxh3::hash_from_sums(fs.data(), nb, xxh3::kSecret), XXH3_64bits(in.data(), in.size())) << nb;
  }
}

TEST(RowSums, Bf16RowSumsGiveTheTracesDigests) {
  auto g = rng_for("row-sums");
  const int64_t rows = 5, n = 1536, ld = 1600;
  std::vector<float> x = test::randn_bf16(g, size_t(rows * ld));
  x[10] = 1.00001f, x[11] = 3.14159265f;  // rounded to bf16 when hashed
  x[7] = -0.0f, x[8] = std::numeric_limits<float>::infinity(), x[9] = std::numeric_limits<float>::quiet_NaN();
  std::vector<uint64_t> sums = sums_for(rows, n);
  bf16_row_sums(x.data(), rows, n, ld, sums.data());
  EXPECT_EQ(from_sums(sums, rows, n), trace_digests(x.data(), rows, n, ld));
}

struct PostCase {
  std::vector<float> f, R, post, comb;
};

PostCase post_case(int64_t T, int hc, int64_t D) {
  auto g = rng_for("row-sums-post");
  return {test::randn_bf16(g, size_t(T * D)), test::randn_bf16(g, size_t(T * hc * D)),
          test::randn_bf16(g, size_t(T * hc)), test::randn_bf16(g, size_t(T * hc * hc))};
}

TEST(RowSums, HcPostFormsItsOutputsSums) {
  const int64_t T = 3;
  for (auto [hc, D] : {std::pair{4, int64_t(128)}, std::pair{1, int64_t(1024)}, std::pair{3, int64_t(512)}}) {
    const PostCase c = post_case(T, hc, D);
    HcPostParams p;
    p.T = T, p.hc = hc, p.D = D, p.f = c.f.data(), p.R = c.R.data(), p.post = c.post.data(),
    p.comb = c.comb.data();
    std::vector<float> plain(size_t(T * hc * D)), with(plain.size());
    p.out = plain.data();
    hc_post(p);
    std::vector<uint64_t> sums = sums_for(T, hc * D);
    p.out = with.data();
    p.out_sums = sums.data();
    hc_post(p);
    EXPECT_TRUE(bitwise_equal(plain, with)) << hc << " " << D;
    EXPECT_EQ(from_sums(sums, T, hc * D), trace_digests(with.data(), T, hc * D, hc * D)) << hc << " " << D;
  }
}

TEST(RowSums, HcPreAndHcHeadFormYsSums) {
  auto g = rng_for("row-sums-pre");
  const int hc = 4;
  const int64_t T = 3, D = 512, rows = (2 + hc) * hc;
  const auto X = test::randn_bf16(g, size_t(T * hc * D));
  std::vector<float> fn = test::randn_bf16(g, size_t(rows * hc * D));
  for (auto& v : fn) v *= 0.01f;
  const std::vector<float> scale{0.5f, 0.7f, 0.9f}, base = test::randn_bf16(g, size_t(rows));
  std::vector<float> pre(size_t(T * hc)), post(pre.size()), comb(size_t(T * hc * hc)), y(size_t(T * D)),
      y_plain(y.size());
  HcPreParams p;
  p.T = T, p.hc = hc, p.D = D, p.X = X.data(), p.fn = fn.data(), p.scale = scale.data(), p.base = base.data();
  p.pre = pre.data(), p.post = post.data(), p.comb = comb.data();
  p.y = y_plain.data();
  ASSERT_EQ(hc_pre_check(p), nullptr);
  hc_pre(p);
  std::vector<uint64_t> sums = sums_for(T, D);
  p.y = y.data();
  p.y_sums = sums.data();
  ASSERT_EQ(hc_pre_check(p), nullptr);
  hc_pre(p);
  EXPECT_TRUE(bitwise_equal(y_plain, y));
  EXPECT_EQ(from_sums(sums, T, D), trace_digests(y.data(), T, D, D));

  HcHeadParams h;
  h.T = T, h.hc = hc, h.D = D, h.X = X.data(), h.fn = fn.data(), h.scale = scale.data(), h.base = base.data();
  std::vector<float> yh(size_t(T * D));
  std::vector<uint64_t> hsums = sums_for(T, D);
  h.y = yh.data();
  h.y_sums = hsums.data();
  hc_head(h);
  EXPECT_EQ(from_sums(hsums, T, D), trace_digests(yh.data(), T, D, D));
}

TEST(RmsNormRowSums, FormsYsSumsInBothArithmeticsAndStrided) {
  auto g = rng_for("row-sums-norm");
  const int64_t rows = 4, dim = 1024, ld = 1040;
  const auto x = test::randn_bf16(g, size_t(rows * ld));
  const auto w = test::randn_bf16(g, size_t(dim));
  for (bool bf16 : {false, true}) {
    RmsNormParams p;
    p.rows = rows, p.dim = dim, p.x = x.data(), p.ldx = ld, p.w = bf16 ? nullptr : w.data(), p.ldy = ld;
    p.bf16_arith = bf16;
    std::vector<float> plain(size_t(rows * ld), 0.0f), with(plain.size(), 0.0f);
    p.y = plain.data();
    rmsnorm(p);
    std::vector<uint64_t> sums = sums_for(rows, dim);
    p.y = with.data();
    p.y_sums = sums.data();
    ASSERT_EQ(rmsnorm_check(p), nullptr);
    rmsnorm(p);
    EXPECT_TRUE(bitwise_equal(plain, with)) << bf16;
    EXPECT_EQ(from_sums(sums, rows, dim), trace_digests(with.data(), rows, dim, ld)) << bf16;
  }
}

TEST(RowSums, RowsWithoutSumsAreRefused) {
  uint64_t sums[8] = {};
  RmsNormParams n;
  n.rows = 0, n.dim = 1000, n.y_sums = sums;
  ASSERT_NE(rmsnorm_check(n), nullptr);
  EXPECT_NE(std::string(rmsnorm_check(n)).find("multiple of 512"), std::string::npos);
  HcPreParams p;
  p.D = 96, p.y_sums = sums;
  ASSERT_NE(hc_pre_check(p), nullptr);
  EXPECT_NE(std::string(hc_pre_check(p)).find("y_sums"), std::string::npos);
  const PostCase c = post_case(1, 4, 100);
  std::vector<float> out(400);
  HcPostParams q;
  q.T = 1, q.hc = 4, q.D = 100, q.f = c.f.data(), q.R = c.R.data(), q.post = c.post.data(),
  q.comb = c.comb.data();
  q.out = out.data(), q.out_sums = sums;
  EXPECT_THROW(hc_post(q), Error);
  HcHeadParams h;
  h.D = 100, h.y_sums = sums;
  EXPECT_THROW(hc_head(h), Error);
}

}  // namespace
}  // namespace dsv4
