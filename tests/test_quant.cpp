// Block FP8 / FP4 simulation (kernels/quant.h, MODEL.md §4.1-4.3) against an independent float64
// reference: the power-of-two scale comes from frexp/ldexp instead of the fp32 bit pattern, and the
// e4m3 / e2m1 rounding from a nearest-value search instead of bit manipulation.
#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "kernels/quant.h"
#include "test_util.h"

namespace dsv4 {
namespace {

// ---- reference -----------------------------------------------------------------------------------

// fp32 product a * b: exact in double (48-bit product), then one rounding to float.
float mul_f32(float a, float b) {
  return float(double(a) * double(b));
}

// 2^ceil(log2 v) for a positive normal v, via frexp: v = m 2^e with m in [0.5, 1).
double ref_ceil_pow2(float v) {
  int e;
  const double m = std::frexp(double(v), &e);
  return m == 0.5 ? std::ldexp(1.0, e - 1) : std::ldexp(1.0, e);
}

double ref_fp8_scale(const float* x, int n, ScaleFmt fmt) {
  double amax = 0;
  for (int i = 0; i < n; ++i) amax = std::max(amax, std::fabs(double(x[i])));
  amax = std::max(amax, double(1e-4f));
  const float v = mul_f32(float(amax), 1.0f / 448.0f);
  return fmt == ScaleFmt::ue8m0 ? ref_ceil_pow2(v) : double(v);
}

// Finite e4m3 values in increasing code order (code c <-> value for c in [0, 0x7e]).
std::vector<double> e4m3_positive_values() {
  std::vector<double> v;
  for (int c = 0; c <= 0x7e; ++c) {
    const int e = c >> 3, m = c & 7;
    v.push_back(e == 0 ? std::ldexp(double(m), -9) : std::ldexp(double(8 + m), e - 10));
  }
  return v;
}

// Nearest e4m3 code of a double (ties to the even code), saturating at 448.
uint8_t ref_e4m3(double y) {
  static const std::vector<double> vals = e4m3_positive_values();
  const double a = std::fabs(y);
  int best = 0;
  for (int c = 1; c <= 0x7e; ++c) {
    const double dc = std::fabs(a - vals[c]), db = std::fabs(a - vals[best]);
    if (dc < db || (dc == db && (c & 1) == 0)) best = c;
  }
  return uint8_t(best | (std::signbit(y) ? 0x80 : 0));
}

double ref_e4m3_value(uint8_t c) {
  static const std::vector<double> vals = e4m3_positive_values();
  return (c & 0x80) ? -vals[c & 0x7f] : vals[c & 0x7f];
}

// x / s as an fp32 division: the correctly rounded quotient of two floats, obtained in double
// (double division of fp32 operands rounds to fp32 without a double-rounding error).
float div_f32(float x, float s) {
  return float(double(x) / double(s));
}

struct RefQuant {
  std::vector<uint8_t> q;
  std::vector<float> scale;
};

RefQuant ref_act_quant(const std::vector<float>& x, int64_t rows, int64_t cols, int block, ScaleFmt fmt) {
  RefQuant r;
  r.q.resize(x.size());
  for (int64_t i = 0; i < rows; ++i)
    for (int64_t b = 0; b < cols / block; ++b) {
      const float* xb = x.data() + i * cols + b * block;
      const double s = ref_fp8_scale(xb, block, fmt);
      r.scale.push_back(float(s));
      for (int j = 0; j < block; ++j) {
        const double y = std::clamp(double(div_f32(xb[j], float(s))), -448.0, 448.0);
        r.q[i * cols + b * block + j] = ref_e4m3(y);
      }
    }
  return r;
}

// ---- act_quant ---------------------------------------------------------------------------------

std::vector<float> mixed_input(const std::string& name, size_t n) {
  auto g = test::rng_for(name);
  auto v = test::randn_bf16(g, n, 1.0f);
  std::uniform_real_distribution<float> e(-20.0f, 12.0f);
  // vary the magnitude per 16 elements so blocks have very different scales
  for (size_t i = 0; i < n; ++i) v[i] *= std::ldexp(1.0f, int(e(g)) * int((i / 16) % 3 != 0));
  return v;
}

TEST(ActQuant, MatchesFloat64Reference) {
  for (ScaleFmt fmt : {ScaleFmt::ue8m0, ScaleFmt::none}) {
    for (int block : {32, 128}) {
      const int64_t rows = 7, cols = 4 * block;
      auto x = mixed_input("ActQuant.MatchesFloat64Reference" + std::to_string(block), size_t(rows * cols));
      std::vector<uint8_t> q(x.size());
      std::vector<float> s(size_t(rows * cols / block));
      ActQuantParams p{rows, cols, block, fmt, x.data(), q.data(), s.data()};
      ASSERT_EQ(act_quant_check(p), nullptr);
      act_quant(p);
      const RefQuant r = ref_act_quant(x, rows, cols, block, fmt);
      EXPECT_TRUE(test::bitwise_equal(s, r.scale)) << "block " << block;
      EXPECT_TRUE(test::bitwise_equal(q, r.q)) << "block " << block;
      // dequantised values are close: |fp32(q) s - x| <= half an e4m3 step of the block
      for (size_t i = 0; i < x.size(); ++i) {
        const double sc = s[i / block];
        const double deq = ref_e4m3_value(q[i]) * sc;
        EXPECT_LE(std::fabs(deq - x[i]), std::max(std::fabs(double(x[i])) / 16.0, 0x1p-10 * sc) * 1.0001)
            << i;
      }
    }
  }
}

TEST(ActQuant, PowerOfTwoBoundary) {
  // amax exactly 448 * 2^k: v = amax * fp32(1/448) decides which side of 2^k the scale lands on;
  // the reference computes the same fp32 product and reads the power with frexp.
  for (int k = -10; k <= 10; ++k) {
    const int block = 32;
    std::vector<float> x(block, 0.0f);
    const float amax = std::ldexp(448.0f, k);
    x[3] = amax;
    x[7] = -amax * 0.25f;
    x[11] = std::nextafter(amax, 0.0f);
    std::vector<uint8_t> q(block);
    float s = 0;
    act_quant({1, block, block, ScaleFmt::ue8m0, x.data(), q.data(), &s});
    const float v = mul_f32(amax, 1.0f / 448.0f);
    EXPECT_EQ(double(s), ref_ceil_pow2(v)) << k;
    EXPECT_EQ(s, std::ldexp(1.0f, k)) << k;  // 448 * fp32(1/448) rounds to exactly 1 in fp32
    EXPECT_EQ(q[3], 0x7e) << k;              // the maximum maps to 448
    EXPECT_EQ(q[7], num::e4m3_bits(-112.0f)) << k;
    EXPECT_LE(std::fabs(num::e4m3_to_f32(q[11])), 448.0f);
  }
  // one ulp above the boundary: the scale doubles
  std::vector<float> x(32, 0.0f);
  x[0] = std::nextafter(448.0f, 1000.0f);
  std::vector<uint8_t> q(32);
  float s = 0;
  act_quant({1, 32, 32, ScaleFmt::ue8m0, x.data(), q.data(), &s});
  EXPECT_EQ(double(s), ref_ceil_pow2(mul_f32(x[0], 1.0f / 448.0f)));
  EXPECT_EQ(s, 2.0f);
}

TEST(ActQuant, AmaxFloorAndClamp) {
  // all-zero and tiny blocks use amax = 1e-4
  std::vector<float> x(64, 0.0f);
  x[40] = 1e-7f;
  std::vector<uint8_t> q(64);
  float s[2];
  act_quant({1, 64, 32, ScaleFmt::none, x.data(), q.data(), s});
  EXPECT_EQ(s[0], mul_f32(1e-4f, 1.0f / 448.0f));
  EXPECT_EQ(s[1], s[0]);
  for (int i = 0; i < 32; ++i) EXPECT_EQ(q[i], 0);
  EXPECT_EQ(q[40], ref_e4m3(div_f32(1e-7f, s[1])));
  act_quant({1, 64, 32, ScaleFmt::ue8m0, x.data(), q.data(), s});
  EXPECT_EQ(double(s[0]), ref_ceil_pow2(mul_f32(1e-4f, 1.0f / 448.0f)));

  // ScaleFmt::none: s = fl(amax * fl(1/448)) with fl(1/448) = (1 + 0.75 * 2^-24) / 448, so amax / s
  // stays <= 448 (checked over a whole binade; scaling by 2^k changes nothing) and the block maximum
  // always becomes +-448; the clamp in the contract never changes a code (e4m3 saturates anyway).
  for (uint32_t b = 0x3f800000u; b < 0x40000000u; b += 7) {
    const float a = num::f32_from_bits(b);
    ASSERT_LE(div_f32(a, mul_f32(a, 1.0f / 448.0f)), 448.0f) << a;
  }
  auto g = test::rng_for("ActQuant.AmaxFloorAndClamp");
  std::uniform_real_distribution<float> d(1.0f, 1000.0f);
  for (int t = 0; t < 2000; ++t) {
    std::vector<float> y(32, 0.5f);
    y[5] = d(g) * (t % 2 ? -1.0f : 1.0f);
    float sc;
    act_quant({1, 32, 32, ScaleFmt::none, y.data(), q.data(), &sc});
    ASSERT_EQ(q[5], t % 2 ? 0xfe : 0x7e) << y[5];
  }
}

TEST(ActQuant, ThreadsDoNotMatter) {
  // a tensor large enough to use OpenMP; rows are independent, so the result equals a row-by-row run
  const int64_t rows = 300, cols = 256;
  auto x = mixed_input("ActQuant.ThreadsDoNotMatter", size_t(rows * cols));
  std::vector<uint8_t> q(x.size()), q1(x.size());
  std::vector<float> s(size_t(rows * 2)), s1(s.size());
  act_quant({rows, cols, 128, ScaleFmt::ue8m0, x.data(), q.data(), s.data()});
  for (int64_t r = 0; r < rows; ++r)
    act_quant({1, cols, 128, ScaleFmt::ue8m0, x.data() + r * cols, q1.data() + r * cols, s1.data() + r * 2});
  EXPECT_TRUE(test::bitwise_equal(q, q1));
  EXPECT_TRUE(test::bitwise_equal(s, s1));
  EXPECT_FALSE(test::all_zero(s));
}

// ---- fp8_sim -----------------------------------------------------------------------------------

TEST(Fp8Sim, DequantOfActQuantOnFirstColsOnly) {
  const int64_t rows = 5, cols = 448, ld = 512;
  auto g = test::rng_for("Fp8Sim.DequantOfActQuantOnFirstColsOnly");
  auto x = test::randn_bf16(g, size_t(rows * ld), 3.0f);
  x[ld + 450] = std::numeric_limits<float>::quiet_NaN();  // beyond cols: must stay untouched
  auto y = x;
  Fp8SimParams p{rows, cols, ld, 64, ScaleFmt::ue8m0, y.data()};
  ASSERT_EQ(fp8_sim_check(p), nullptr);
  fp8_sim(p);
  int changed = 0;
  for (int64_t r = 0; r < rows; ++r) {
    std::vector<float> row(x.begin() + r * ld, x.begin() + r * ld + cols);
    const RefQuant rq = ref_act_quant(row, 1, cols, 64, ScaleFmt::ue8m0);
    for (int64_t i = 0; i < cols; ++i) {
      const float want = num::bf16_round(float(ref_e4m3_value(rq.q[i]) * rq.scale[i / 64]));
      ASSERT_EQ(num::f32_bits(y[r * ld + i]), num::f32_bits(want)) << r << "," << i;
      changed += y[r * ld + i] != x[r * ld + i];
    }
    for (int64_t i = cols; i < ld; ++i)
      ASSERT_EQ(num::f32_bits(y[r * ld + i]), num::f32_bits(x[r * ld + i])) << "rope part changed at " << i;
  }
  EXPECT_GT(changed, 0);
}

// MODEL.md §4.2: with ue8m0 scales x / s is a power-of-two rescale of a bf16 value, so the bf16
// inner cast is exact and the whole call is the identity on bf16 inputs.
TEST(Fp8Sim, InplaceBf16CastIsIdentityWithUe8m0) {
  const int64_t rows = 9, cols = 512, ld = 512;
  auto x = mixed_input("Fp8Sim.InplaceBf16CastIsIdentityWithUe8m0", size_t(rows * ld));
  auto y = x;
  fp8_sim_inplace_bf16_cast({rows, cols, ld, 64, ScaleFmt::ue8m0, y.data()});
  EXPECT_TRUE(test::bitwise_equal(y, x));

  // with ScaleFmt::none the scale is not a power of two and x / s is re-rounded to bf16
  auto z = x;
  fp8_sim_inplace_bf16_cast({rows, cols, ld, 64, ScaleFmt::none, z.data()});
  int differ = 0;
  for (size_t i = 0; i < x.size(); ++i) {
    differ += num::f32_bits(z[i]) != num::f32_bits(x[i]);
    const float s = float(ref_fp8_scale(x.data() + (i / 64) * 64, 64, ScaleFmt::none));
    const float want = num::bf16_round(num::bf16_round(std::clamp(div_f32(x[i], s), -448.0f, 448.0f)) * s);
    ASSERT_EQ(num::f32_bits(z[i]), num::f32_bits(want)) << i;
  }
  EXPECT_GT(differ, 0);
}

// ---- fp4_sim -----------------------------------------------------------------------------------

TEST(Fp4Sim, GridAndScale) {
  const float grid[8] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f};
  // values already on the grid times a power of two whose block amax is 6 * 2^k: unchanged
  for (int k = -6; k <= 6; ++k) {
    std::vector<float> x(32);
    for (int i = 0; i < 32; ++i) x[i] = std::ldexp(grid[i % 8] * ((i / 8) % 2 ? -1.0f : 1.0f), k);
    auto y = x;
    fp4_sim({1, 32, 32, 32, ScaleFmt::ue8m0, y.data()});
    EXPECT_TRUE(test::bitwise_equal(y, x)) << k;
  }
  // random values against a float64 reference with a nearest-grid search (ties to the even code)
  const int64_t rows = 6, cols = 128, ld = 160;
  auto x = mixed_input("Fp4Sim.GridAndScale", size_t(rows * ld));
  auto y = x;
  Fp8SimParams p{rows, cols, ld, 32, ScaleFmt::ue8m0, y.data()};
  ASSERT_EQ(fp8_sim_check(p), nullptr);
  fp4_sim(p);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t b = 0; b < cols / 32; ++b) {
      const float* xb = x.data() + r * ld + b * 32;
      double amax = 0;
      for (int i = 0; i < 32; ++i) amax = std::max(amax, std::fabs(double(xb[i])));
      amax = std::max(amax, 6.0 * 0x1p-126);
      const double s = ref_ceil_pow2(mul_f32(float(amax), 1.0f / 6.0f));
      for (int i = 0; i < 32; ++i) {
        const double a = std::clamp(std::fabs(double(div_f32(xb[i], float(s)))), 0.0, 6.0);
        int best = 0;
        for (int c = 1; c < 8; ++c) {
          const double dc = std::fabs(a - grid[c]), db = std::fabs(a - grid[best]);
          if (dc < db || (dc == db && (c & 1) == 0)) best = c;
        }
        const float want = num::bf16_round(float((xb[i] < 0 ? -grid[best] : grid[best]) * s));
        ASSERT_EQ(num::f32_bits(y[r * ld + b * 32 + i]), num::f32_bits(want)) << r << "," << b * 32 + i;
      }
    }
    for (int64_t i = cols; i < ld; ++i) ASSERT_EQ(num::f32_bits(y[r * ld + i]), num::f32_bits(x[r * ld + i]));
  }
}

// ---- parameter checks --------------------------------------------------------------------------

TEST(QuantCheck, RejectsBadParams) {
  float xf[64] = {};
  uint8_t q[64];
  float s[4];
  const ActQuantParams ok{2, 32, 32, ScaleFmt::ue8m0, xf, q, s};
  EXPECT_EQ(act_quant_check(ok), nullptr);
  auto bad = [&](auto mutate) {
    ActQuantParams p = ok;
    mutate(p);
    const char* e = act_quant_check(p);
    return e ? std::string(e) : std::string();
  };
  EXPECT_NE(bad([](ActQuantParams& p) { p.cols = 48; }).find("multiple of block"), std::string::npos);
  EXPECT_NE(bad([](ActQuantParams& p) { p.block = 0; }).find("block"), std::string::npos);
  EXPECT_NE(bad([](ActQuantParams& p) { p.rows = -1; }).find("rows"), std::string::npos);
  EXPECT_NE(bad([](ActQuantParams& p) { p.cols = -32; }).find("cols"), std::string::npos);
  EXPECT_NE(bad([](ActQuantParams& p) { p.x = nullptr; }).find("x"), std::string::npos);
  EXPECT_NE(bad([](ActQuantParams& p) { p.q = nullptr; }).find("q"), std::string::npos);
  EXPECT_NE(bad([](ActQuantParams& p) { p.scale = nullptr; }).find("scale"), std::string::npos);

  const Fp8SimParams fok{2, 32, 32, 32, ScaleFmt::ue8m0, xf};
  EXPECT_EQ(fp8_sim_check(fok), nullptr);
  auto fbad = [&](auto mutate) {
    Fp8SimParams p = fok;
    mutate(p);
    const char* e = fp8_sim_check(p);
    return e ? std::string(e) : std::string();
  };
  EXPECT_NE(fbad([](Fp8SimParams& p) { p.ld = 16; }).find("ld"), std::string::npos);
  EXPECT_NE(fbad([](Fp8SimParams& p) { p.block = 24; }).find("multiple of block"), std::string::npos);
  EXPECT_NE(fbad([](Fp8SimParams& p) { p.block = -64; }).find("block"), std::string::npos);
  EXPECT_NE(fbad([](Fp8SimParams& p) { p.x = nullptr; }).find("x"), std::string::npos);
  EXPECT_NE(fbad([](Fp8SimParams& p) { p.rows = -2; }).find("rows"), std::string::npos);
  // empty tensors are fine
  EXPECT_EQ(fp8_sim_check({0, 32, 32, 32, ScaleFmt::ue8m0, nullptr}), nullptr);
}

}  // namespace
}  // namespace dsv4
