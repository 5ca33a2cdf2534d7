// gemm(): bitwise equal to gemm_reference() (one canonical dot() per element) for many shapes,
// strides, reduce orders and thread counts; batch invariant; accurate against a float64 reference.
#include <omp.h>

#include <cmath>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include "kernels/linear.h"
#include "test_util.h"

namespace dsv4 {
namespace {

using test::bitwise_equal;
using test::rng_for;

struct Case {
  int64_t m, n, k;
  int64_t padx = 0, padw = 0, pady = 0;
  OutRound round = OutRound::f32;
  ReduceOrder order{};
};

std::string name_of(const Case& c) {
  std::string s = "m";
  for (auto [tag, v] : {std::pair<const char*, int64_t>{"", c.m},
                        {"n", c.n},
                        {"k", c.k},
                        {"px", c.padx},
                        {"pw", c.padw},
                        {"py", c.pady},
                        {"r", int64_t(c.round)},
                        {"b", c.order.block}}) {
    s += tag;
    s += std::to_string(v);
  }
  return s;
}

// Operands with NaN in the stride padding: reading past k would poison the result.
struct Operands {
  Case c;
  std::vector<float> x, w;
  explicit Operands(const Case& cs) : c(cs) {
    auto g = rng_for(name_of(c));
    const float nan = std::numeric_limits<float>::quiet_NaN();
    x.assign(size_t(c.m * (c.k + c.padx)), nan);
    w.assign(size_t(c.n * (c.k + c.padw)), nan);
    const auto xv = test::randn_bf16(g, size_t(c.m * c.k));
    const auto wv = test::randn_bf16(g, size_t(c.n * c.k), 0.05f);
    for (int64_t i = 0; i < c.m; ++i)
      for (int64_t j = 0; j < c.k; ++j) x[size_t(i * (c.k + c.padx) + j)] = xv[size_t(i * c.k + j)];
    for (int64_t i = 0; i < c.n; ++i)
      for (int64_t j = 0; j < c.k; ++j) w[size_t(i * (c.k + c.padw) + j)] = wv[size_t(i * c.k + j)];
  }
  // Runs fn (gemm or gemm_reference) into a fresh output whose padding is a sentinel.
  template <typename Fn>
  std::vector<float> run(Fn fn) const {
    std::vector<float> y(size_t(c.m * (c.n + c.pady)), -12345.0f);
    GemmParams p;
    p.m = c.m;
    p.n = c.n;
    p.k = c.k;
    p.x = x.data();
    p.ldx = c.k + c.padx;
    p.w = w.data();
    p.ldw = c.k + c.padw;
    p.y = y.data();
    p.ldy = c.n + c.pady;
    p.round = c.round;
    p.order = c.order;
    EXPECT_EQ(gemm_check(p), nullptr);
    fn(p);
    return y;
  }
};

class ThreadGuard {
 public:
  explicit ThreadGuard(int n) : saved_(omp_get_max_threads()) { omp_set_num_threads(n); }
  ~ThreadGuard() { omp_set_num_threads(saved_); }

 private:
  int saved_;
};

TEST(Gemm, BitwiseEqualsReferenceOverShapes) {
  const int64_t sizes[] = {1, 2, 3, 7, 8, 9, 17, 64, 100, 257, 1000};
  int cases = 0;
  for (int64_t m : sizes)
    for (int64_t n : sizes)
      for (int64_t k : sizes) {
        if (m * n * k > 300000) continue;  // keep the scalar reference cheap
        for (int block : {0, 64, 256}) {
          Case c{m, n, k};
          c.order.block = block;
          c.round = (m + n + k + block) % 2 ? OutRound::bf16 : OutRound::f32;
          const Operands o(c);
          ASSERT_TRUE(bitwise_equal(o.run(gemm), o.run(gemm_reference))) << name_of(c);
          ++cases;
        }
      }
  EXPECT_GT(cases, 1000);
}

// Products that underflow to -0: a lane that only ever received -0 must stay -0 (an fma with
// padding, fma(0, 0, -0), would make it +0). The optimised GEMM must keep the reference's sign of
// zero for every k % 8 and block order.
TEST(Gemm, NegativeZeroLanesSurvive) {
  for (int64_t k : {8, 9, 12, 15, 16, 17, 70, 129}) {
    for (int block : {0, 8, 64}) {
      const int64_t m = 5, n = 7;
      std::vector<float> x(size_t(m * k), -1e-30f), w(size_t(n * k), 1e-30f);
      std::vector<float> y(size_t(m * n), 1.0f), ref(size_t(m * n), 1.0f);
      GemmParams p;
      p.m = m, p.n = n, p.k = k, p.x = x.data(), p.ldx = k, p.w = w.data(), p.ldw = k, p.ldy = n;
      p.round = OutRound::f32;
      p.order.block = block;
      p.y = y.data();
      gemm(p);
      p.y = ref.data();
      gemm_reference(p);
      for (size_t i = 0; i < y.size(); ++i) {
        EXPECT_EQ(y[i], 0.0f);
        // One chain over k >= 8 has every lane at -0; with blocks, a last block shorter than 8
        // leaves +0 lanes, and -0 + +0 is +0.
        if (block == 0) {
          EXPECT_TRUE(std::signbit(ref[i])) << "k " << k;
        }
        EXPECT_EQ(std::signbit(y[i]), std::signbit(ref[i])) << "k " << k << " block " << block << " i " << i;
      }
    }
  }
}

TEST(Gemm, LargeShapesAndBlockOrders) {
  for (const Case& c0 : {Case{100, 257, 1000}, Case{257, 100, 1000}, Case{64, 1000, 257}, Case{1000, 64, 100},
                         Case{3, 1000, 1000}, Case{1, 257, 1000}}) {
    for (int block : {0, 64, 256})
      for (OutRound r : {OutRound::f32, OutRound::bf16}) {
        Case c = c0;
        c.order.block = block;
        c.round = r;
        const Operands o(c);
        ASSERT_TRUE(bitwise_equal(o.run(gemm), o.run(gemm_reference))) << name_of(c);
      }
  }
}

TEST(Gemm, LongReductions) {
  // Long k: reductions that a blocked GEMM splits into several k tiles, with blocks shorter and
  // longer than such a tile, and tails.
  for (int64_t k : {1025, 2500, 3001})
    for (int block : {0, 64, 1032, 2048}) {
      Case c{5, 14, k, 1, 3, 0};
      c.order.block = block;
      const Operands o(c);
      ASSERT_TRUE(bitwise_equal(o.run(gemm), o.run(gemm_reference))) << name_of(c);
    }
}

TEST(Gemm, OddStridesLeavePaddingAlone) {
  for (const Case& c0 : {Case{7, 9, 17, 3, 5, 7}, Case{64, 100, 257, 1, 13, 3}, Case{17, 1000, 9, 5, 1, 11},
                         Case{1, 64, 1000, 7, 7, 1}}) {
    for (int block : {0, 64, 256})
      for (OutRound r : {OutRound::f32, OutRound::bf16}) {
        Case c = c0;
        c.order.block = block;
        c.round = r;
        const Operands o(c);
        const auto y = o.run(gemm);
        ASSERT_TRUE(bitwise_equal(y, o.run(gemm_reference))) << name_of(c);
        for (int64_t i = 0; i < c.m; ++i)
          for (int64_t j = 0; j < c.n + c.pady; ++j) {
            const float v = y[size_t(i * (c.n + c.pady) + j)];
            if (j >= c.n)
              ASSERT_EQ(v, -12345.0f) << name_of(c) << " wrote padding";
            else
              ASSERT_FALSE(std::isnan(v)) << name_of(c) << " read padding";
          }
      }
  }
}

TEST(Gemm, ThreadCountsGiveIdenticalBits) {
  for (const Case& c0 : {Case{257, 100, 1000}, Case{1, 1000, 257}, Case{1000, 1, 257}, Case{64, 64, 64}}) {
    for (int block : {0, 64}) {
      Case c = c0;
      c.order.block = block;
      const Operands o(c);
      std::vector<float> y1, y2, y3;
      {
        ThreadGuard g(1);
        y1 = o.run(gemm);
      }
      {
        ThreadGuard g(2);
        y2 = o.run(gemm);
      }
      {
        ThreadGuard g(3);
        y3 = o.run(gemm);
      }
      ASSERT_TRUE(bitwise_equal(y1, y2)) << name_of(c);
      ASSERT_TRUE(bitwise_equal(y1, y3)) << name_of(c);
    }
  }
}

TEST(Gemm, BatchInvariance) {
  for (int block : {0, 64}) {
    Case c{100, 257, 1000};
    c.order.block = block;
    c.round = OutRound::bf16;
    const Operands o(c);
    const auto all = o.run(gemm);
    for (int64_t r : {0, 1, 37, 63, 64, 99}) {
      std::vector<float> one(size_t(c.n));
      GemmParams p;
      p.m = 1;
      p.n = c.n;
      p.k = c.k;
      p.x = o.x.data() + r * c.k;
      p.ldx = c.k;
      p.w = o.w.data();
      p.ldw = c.k;
      p.y = one.data();
      p.ldy = c.n;
      p.round = c.round;
      p.order = c.order;
      gemm(p);
      const std::vector<float> row(all.begin() + r * c.n, all.begin() + (r + 1) * c.n);
      ASSERT_TRUE(bitwise_equal(one, row)) << "row " << r << " block " << block;
    }
  }
}

TEST(Gemm, AccurateAgainstFloat64) {
  for (int block : {0, 64, 256}) {
    Case c{33, 65, 1000};
    c.order.block = block;
    const Operands o(c);
    const auto y = o.run(gemm);
    for (int64_t i = 0; i < c.m; ++i)
      for (int64_t j = 0; j < c.n; ++j) {
        double s = 0, mag = 0;
        for (int64_t q = 0; q < c.k; ++q) {
          const double prod = double(o.x[size_t(i * c.k + q)]) * double(o.w[size_t(j * c.k + q)]);
          s += prod;
          mag += std::fabs(prod);
        }
        ASSERT_LE(std::fabs(double(y[size_t(i * c.n + j)]) - s), 1e-5 * mag) << i << "," << j;
      }
  }
}

TEST(Gemm, DyadicInputsAreExact) {
  auto g = rng_for("dyadic");
  const int64_t m = 19, n = 23, k = 777;
  const auto x = test::dyadic(g, size_t(m * k));
  const auto w = test::dyadic(g, size_t(n * k));
  for (int block : {0, 64, 256})
    for (OutRound r : {OutRound::f32, OutRound::bf16}) {
      std::vector<float> y(size_t(m * n));
      GemmParams p;
      p.m = m;
      p.n = n;
      p.k = k;
      p.x = x.data();
      p.ldx = k;
      p.w = w.data();
      p.ldw = k;
      p.y = y.data();
      p.ldy = n;
      p.round = r;
      p.order.block = block;
      gemm(p);
      for (int64_t i = 0; i < m; ++i)
        for (int64_t j = 0; j < n; ++j) {
          double s = 0;
          for (int64_t q = 0; q < k; ++q) s += double(x[size_t(i * k + q)]) * double(w[size_t(j * k + q)]);
          const float want = r == OutRound::bf16 ? num::bf16_round(float(s)) : float(s);
          ASSERT_EQ(y[size_t(i * n + j)], want) << i << "," << j << " block " << block;
        }
    }
}

TEST(Gemm, Bf16OutIsRoundedF32Out) {
  Case c{37, 91, 300};
  const Operands o(c);
  const auto f = o.run(gemm);
  c.round = OutRound::bf16;
  Operands ob(c);
  ob.x = o.x;
  ob.w = o.w;
  const auto b = ob.run(gemm);
  for (size_t i = 0; i < f.size(); ++i) ASSERT_EQ(b[i], num::bf16_round(f[i])) << i;
}

TEST(Gemm, EmptyReductionGivesZero) {
  std::vector<float> y(6, 7.0f);
  GemmParams p;
  p.m = 2;
  p.n = 3;
  p.k = 0;
  p.ldx = p.ldw = 0;
  p.y = y.data();
  p.ldy = 3;
  p.round = OutRound::f32;
  gemm(p);
  for (float v : y) EXPECT_EQ(v, 0.0f);
}

TEST(Gemm, CheckRejectsBadParams) {
  std::vector<float> b(64);
  GemmParams p;
  p.m = 2;
  p.n = 2;
  p.k = 4;
  p.x = p.w = b.data();
  p.y = b.data() + 32;
  p.ldx = p.ldw = 4;
  p.ldy = 2;
  EXPECT_EQ(gemm_check(p), nullptr);
  GemmParams q = p;
  q.ldx = 3;
  EXPECT_NE(gemm_check(q), nullptr);
  q = p;
  q.ldw = 3;
  EXPECT_NE(gemm_check(q), nullptr);
  q = p;
  q.ldy = 1;
  EXPECT_NE(gemm_check(q), nullptr);
  q = p;
  q.order.block = 12;
  EXPECT_NE(gemm_check(q), nullptr);
  q = p;
  q.y = nullptr;
  EXPECT_NE(gemm_check(q), nullptr);
  q = p;
  q.m = -1;
  EXPECT_NE(gemm_check(q), nullptr);
  // A bf16 copy of x is for the tensor_core order only.
  const std::vector<uint16_t> x16(64);
  q = p;
  q.x16 = x16.data();
  ASSERT_NE(gemm_check(q), nullptr);
  EXPECT_NE(std::string(gemm_check(q)).find("x16"), std::string::npos) << gemm_check(q);
  q.order.tensor_core = true;
  EXPECT_EQ(gemm_check(q), nullptr);
}

}  // namespace
}  // namespace dsv4
