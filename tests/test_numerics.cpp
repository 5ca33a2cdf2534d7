// Numerics (kernels/numerics/numerics.h): storage-type rounding checked against independent
// implementations, and the accuracy of the transcendental functions measured in ulp against the
// long double functions of the C library (the only place libm is used: as the reference).
#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "test_util.h"

namespace dsv4 {
namespace {

using num::f32_bits;
using num::f32_from_bits;

constexpr float kInf = std::numeric_limits<float>::infinity();
constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();

// The accuracy bounds documented in numerics.h.
constexpr double kExpUlp = 1.0, kLogUlp = 1.0, kLog1pUlp = 1.0, kSinCosUlp = 1.0;
constexpr double kSigmoidUlp = 1.0, kSoftplusUlp = 2.0;

// ---- ulp error against a long double reference -------------------------------------------------

// Size of one fp32 ulp at the magnitude of r (the binade of r; 2^-149 in the subnormal range).
long double ulp_of(long double r) {
  r = std::fabs(r);
  if (r < 0x1p-126L) return 0x1p-149L;
  int e;
  std::frexp(r, &e);  // r = m 2^e, m in [0.5, 1)
  return std::ldexp(1.0L, e - 24);
}

// |f - ref| in ulps of ref (fractional). NaN must match NaN. An infinite result or reference counts
// as 2^128 (where fp32 rounding sends everything beyond FLT_MAX + ulp/2), so returning inf is exact
// when the reference rounds to inf and costs at least one ulp otherwise.
double ulp_error(float f, long double ref) {
  if (std::isnan(ref) || std::isnan(f)) return std::isnan(ref) && std::isnan(f) ? 0.0 : INFINITY;
  auto clip = [](long double v) { return std::fabs(v) >= 0x1p128L ? std::copysign(0x1p128L, v) : v; };
  const long double r = std::isinf(float(ref)) ? std::copysign(0x1p128L, ref) : clip(ref);
  const long double v = std::isinf(f) ? std::copysign(0x1p128L, (long double)f) : (long double)f;
  return double(std::fabs(v - r) / ulp_of(r));
}

struct UlpStats {
  std::string name;
  double max_ulp = 0;
  float worst_x = 0;
  int64_t count = 0;
  void add(float x, float f, long double ref) {
    const double e = ulp_error(f, ref);
    ++count;
    if (!(e <= max_ulp)) {
      max_ulp = e;
      worst_x = x;
    }
  }
  void report(double bound) const {
    std::printf("[ measured ] %-10s max %.3f ulp (bound %.1f) at x = %a over %lld inputs\n", name.c_str(),
                max_ulp, bound, double(worst_x), (long long)count);
    EXPECT_LE(max_ulp, bound) << name << " at x = " << worst_x;
  }
};

// Inputs: the special values, a dense uniform sweep of [lo, hi], and random bit patterns in [lo, hi]
// (uniform over the floats, so every binade is covered).
std::vector<float> inputs_for(const std::string& name, float lo, float hi, int dense, int random_bits) {
  std::vector<float> v = {kInf, -kInf, kNaN, -kNaN};
  for (float s : {0.0f, -0.0f, 0x1p-149f, -0x1p-149f, FLT_MIN, -FLT_MIN, 1.0f, -1.0f, FLT_MAX, -FLT_MAX})
    if (s >= lo && s <= hi) v.push_back(s);
  for (int i = 0; dense > 0 && i <= dense; ++i)
    v.push_back(float(lo + (double(hi) - double(lo)) * i / dense));
  auto key = [](float x) {
    const int32_t i = int32_t(f32_bits(x));
    return i < 0 ? int64_t(INT32_MIN) - i : int64_t(i);
  };
  auto unkey = [](int64_t k) {
    const int32_t i = k < 0 ? int32_t(int64_t(INT32_MIN) - k) : int32_t(k);
    return f32_from_bits(uint32_t(i));
  };
  auto g = test::rng_for(name);
  std::uniform_int_distribution<int64_t> d(key(lo), key(hi));
  for (int i = 0; i < random_bits; ++i) v.push_back(unkey(d(g)));
  return v;
}

void measure(UlpStats& st, const std::vector<float>& xs, const std::function<float(float)>& f,
             const std::function<long double(long double)>& ref) {
  for (float x : xs) st.add(x, f(x), ref((long double)x));
}

// ---- bf16 --------------------------------------------------------------------------------------

// Independent bf16 rounding: the two bf16 neighbours by truncation, nearest by long double distance,
// ties to the even mantissa.
uint16_t bf16_reference(float x) {
  if (std::isnan(x)) return uint16_t((f32_bits(x) >> 16) | 0x40);
  const uint16_t lo = uint16_t(f32_bits(x) >> 16);  // truncation toward zero
  const uint16_t hi = uint16_t(lo + 1);             // next magnitude (may be inf)
  const long double a = std::fabs((long double)x);
  const long double vlo = std::fabs((long double)num::bf16_to_f32(lo));
  // the next magnitude above the largest finite bf16 is 2^128 for rounding purposes
  const long double vhi = (lo & 0x7fff) == 0x7f7f ? 0x1p128L : std::fabs((long double)num::bf16_to_f32(hi));
  if (a - vlo < vhi - a) return lo;
  if (a - vlo > vhi - a) return hi;
  return (lo & 1) ? hi : lo;
}

TEST(Bf16, TiesAndSpecials) {
  EXPECT_EQ(num::bf16_bits(1.0f + 0x1p-8f), 0x3f80);             // tie -> even (down)
  EXPECT_EQ(num::bf16_bits(1.0f + 3 * 0x1p-8f), 0x3f82);         // tie -> even (up)
  EXPECT_EQ(num::bf16_bits(1.0f + 0x1p-8f + 0x1p-23f), 0x3f81);  // above the tie
  EXPECT_EQ(num::bf16_bits(-(1.0f + 0x1p-8f)), 0xbf80);          // sign kept
  EXPECT_EQ(num::bf16_bits(-0.0f), 0x8000);
  EXPECT_EQ(num::bf16_bits(kInf), 0x7f80);
  EXPECT_EQ(num::bf16_bits(-kInf), 0xff80);
  EXPECT_EQ(num::bf16_bits(FLT_MAX), 0x7f80);  // rounds up to inf
  EXPECT_EQ(num::bf16_bits(-FLT_MAX), 0xff80);
  EXPECT_EQ(num::bf16_bits(f32_from_bits(0x7f7f7fff)), 0x7f7f);  // just below the tie: largest finite
  EXPECT_EQ(num::bf16_bits(f32_from_bits(0x7f7f8000)), 0x7f80);  // tie at the top, odd -> inf
  EXPECT_EQ(num::bf16_bits(0x1p-149f), 0x0000);                  // below half of the bf16 subnormal step
  for (uint32_t nan : {0x7fc00000u, 0x7f800001u, 0xffc00000u, 0xff800001u, 0x7fffffffu}) {
    const uint16_t b = num::bf16_bits(f32_from_bits(nan));
    EXPECT_TRUE(std::isnan(num::bf16_to_f32(b))) << std::hex << nan;
    EXPECT_EQ(b & 0x8000, (nan >> 16) & 0x8000) << std::hex << nan;
    EXPECT_EQ(b & 0x0040, 0x0040) << std::hex << nan;  // quiet
  }
}

TEST(Bf16, MatchesIndependentRounding) {
  auto g = test::rng_for("Bf16.MatchesIndependentRounding");
  std::uniform_int_distribution<uint32_t> d;
  for (int i = 0; i < 1000000; ++i) {
    uint32_t u = d(g);
    if (i % 4 == 0) u = (u & 0xffff0000u) | 0x8000u;  // exact ties
    const float x = f32_from_bits(u);
    ASSERT_EQ(num::bf16_bits(x), bf16_reference(x)) << std::hex << u;
  }
  for (uint32_t hi = 0; hi < 0x10000; ++hi) {  // every bf16 value round-trips
    const float x = num::bf16_to_f32(uint16_t(hi));
    if (!std::isnan(x)) {
      ASSERT_EQ(num::bf16_bits(x), hi);
    }
  }
}

// ---- fp16 --------------------------------------------------------------------------------------

TEST(F16, ExhaustiveDecode) {
  for (uint32_t h = 0; h < 0x10000; ++h) {
    const int s = h >> 15, e = (h >> 10) & 31, m = h & 1023;
    const float f = num::f16_to_f32(uint16_t(h));
    if (e == 31) {
      if (m == 0) {
        ASSERT_TRUE(std::isinf(f)) << h;
      } else {
        ASSERT_TRUE(std::isnan(f)) << h;
      }
      ASSERT_EQ(std::signbit(f), s == 1) << h;
      continue;
    }
    const long double mag =
        e == 0 ? std::ldexp((long double)m, -24) : std::ldexp((long double)(1024 + m), e - 25);
    const long double want = s ? -mag : mag;
    ASSERT_EQ((long double)f, want) << h;
    ASSERT_EQ(std::signbit(f), s == 1) << h;
  }
}

// ---- e4m3 --------------------------------------------------------------------------------------

long double e4m3_value(int c) {  // independent decode of a non-NaN code
  const int s = c >> 7, e = (c >> 3) & 15, m = c & 7;
  const long double mag = e == 0 ? std::ldexp((long double)m, -9) : std::ldexp((long double)(8 + m), e - 10);
  return s ? -mag : mag;
}

// Nearest of the finite e4m3 values (saturating), ties to the even code; by exhaustive search.
uint8_t e4m3_reference(float x) {
  if (std::isnan(x)) return std::signbit(x) ? 0xff : 0x7f;
  const long double a = std::fabs((long double)x);
  int best = 0;
  for (int c = 1; c <= 0x7e; ++c) {
    const long double dc = std::fabs(a - e4m3_value(c)), db = std::fabs(a - e4m3_value(best));
    if (dc < db || (dc == db && (c & 1) == 0)) best = c;
  }
  return uint8_t(best | (std::signbit(x) ? 0x80 : 0));
}

TEST(E4m3, ExhaustiveDecodeAndRoundTrip) {
  for (int c = 0; c < 256; ++c) {
    const float f = num::e4m3_to_f32(uint8_t(c));
    if ((c & 0x7f) == 0x7f) {
      EXPECT_TRUE(std::isnan(f)) << c;
      EXPECT_EQ(num::e4m3_bits(f), uint8_t(c)) << c;  // NaN -> NaN with the sign kept
      continue;
    }
    EXPECT_EQ((long double)f, e4m3_value(c)) << c;
    EXPECT_EQ(std::signbit(f), c >= 128) << c;
    EXPECT_EQ(num::e4m3_bits(f), uint8_t(c)) << c;
  }
  EXPECT_EQ(num::e4m3_to_f32(0x7e), 448.0f);
  EXPECT_EQ(num::e4m3_to_f32(0x01), 0x1p-9f);
  EXPECT_EQ(num::e4m3_to_f32(0x08), 0x1p-6f);
}

TEST(E4m3, MidpointsRoundToEven) {
  for (int c = 0; c < 0x7e; ++c) {
    const float a = num::e4m3_to_f32(uint8_t(c)), b = num::e4m3_to_f32(uint8_t(c + 1));
    const float mid = (a + b) * 0.5f;  // exact
    const int even = (c & 1) ? c + 1 : c;
    EXPECT_EQ(num::e4m3_bits(mid), even) << "midpoint of codes " << c << " and " << c + 1;
    EXPECT_EQ(num::e4m3_bits(std::nextafter(mid, 0.0f)), c) << c;
    EXPECT_EQ(num::e4m3_bits(std::nextafter(mid, kInf)), c + 1) << c;
    EXPECT_EQ(num::e4m3_bits(-mid), 0x80 | even) << c;
  }
}

TEST(E4m3, Saturation) {
  for (float x : {448.0f, 449.0f, 463.99f, 464.0f, 480.0f, 1e6f, FLT_MAX, kInf}) {
    EXPECT_EQ(num::e4m3_bits(x), 0x7e) << x;
    EXPECT_EQ(num::e4m3_bits(-x), 0xfe) << x;
  }
  EXPECT_EQ(num::e4m3_bits(0x1p-10f), 0x00);  // half the smallest subnormal: tie -> 0
  EXPECT_EQ(num::e4m3_bits(std::nextafter(0x1p-10f, 1.0f)), 0x01);
  EXPECT_EQ(num::e4m3_bits(-0.0f), 0x80);
  EXPECT_EQ(num::e4m3_bits(0x1p-149f), 0x00);
  EXPECT_EQ(num::e4m3_bits(kNaN), 0x7f);
  EXPECT_EQ(num::e4m3_bits(-kNaN), 0xff);
}

TEST(E4m3, MatchesExhaustiveSearch) {
  auto g = test::rng_for("E4m3.MatchesExhaustiveSearch");
  std::uniform_real_distribution<float> mag(-12.0f, 9.5f);
  std::uniform_int_distribution<uint32_t> bits;
  for (int i = 0; i < 100000; ++i) {
    float x = std::exp2(mag(g)) * (i % 2 ? -1.0f : 1.0f);
    if (i % 10 == 0) x = f32_from_bits(bits(g));
    ASSERT_EQ(num::e4m3_bits(x), e4m3_reference(x)) << x;
  }
}

// ---- e2m1 --------------------------------------------------------------------------------------

TEST(E2m1, GridTiesAndSaturation) {
  const float grid[8] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f};
  for (int c = 0; c < 16; ++c) {
    const float want = (c & 8) ? -grid[c & 7] : grid[c & 7];
    const float f = num::e2m1_to_f32(uint8_t(c));
    EXPECT_EQ(f, want) << c;
    EXPECT_EQ(std::signbit(f), c >= 8) << c;
    EXPECT_EQ(num::e2m1_bits(f), c) << c;
  }
  // midpoints between grid[lo] and grid[lo + 1]: ties go to the even code; either side is decided
  const struct {
    float x;
    int lo, even;
  } ties[] = {{0.25f, 0, 0}, {0.75f, 1, 2}, {1.25f, 2, 2}, {1.75f, 3, 4},
              {2.5f, 4, 4},  {3.5f, 5, 6},  {5.0f, 6, 6}};
  for (auto t : ties) {
    EXPECT_EQ(num::e2m1_bits(t.x), t.even) << t.x;
    EXPECT_EQ(num::e2m1_bits(-t.x), 8 | t.even) << t.x;
    EXPECT_EQ(num::e2m1_bits(std::nextafter(t.x, 0.0f)), t.lo) << t.x;
    EXPECT_EQ(num::e2m1_bits(std::nextafter(t.x, kInf)), t.lo + 1) << t.x;
  }
  // brute-force nearest for random values, saturating at 6
  auto g = test::rng_for("E2m1.GridTiesAndSaturation");
  std::uniform_real_distribution<float> d(-8.0f, 8.0f);
  for (int i = 0; i < 100000; ++i) {
    const float x = d(g);
    const float a = std::fabs(x);
    int best = 0;
    for (int c = 1; c < 8; ++c) {
      const float dc = std::fabs(a - grid[c]), db = std::fabs(a - grid[best]);
      if (dc < db || (dc == db && (c & 1) == 0)) best = c;
    }
    ASSERT_EQ(num::e2m1_bits(x), best | (x < 0 ? 8 : 0)) << x;
  }
  EXPECT_EQ(num::e2m1_bits(kInf), 7);
  EXPECT_EQ(num::e2m1_bits(-kInf), 15);
  EXPECT_EQ(num::e2m1_bits(1e30f), 7);
  EXPECT_EQ(num::e2m1_bits(kNaN) & 7, 7);  // no NaN code: saturates
}

// ---- transcendental functions ------------------------------------------------------------------

TEST(Transcendental, Exp) {
  UlpStats st{"exp_f"};
  auto xs = inputs_for("exp", -110.0f, 90.0f, 1 << 20, 1 << 20);
  // the overflow and underflow thresholds, and the subnormal results
  for (float c : {88.7228f, -87.3365f, -103.2789f, -103.9721f, 0.0f}) {
    float x = c;
    for (int i = 0; i < 2000; ++i) x = std::nextafter(x, -kInf);
    for (int i = 0; i < 4000; ++i, x = std::nextafter(x, kInf)) xs.push_back(x);
  }
  measure(st, xs, num::exp_f, [](long double x) { return std::exp(x); });
  st.report(kExpUlp);
  EXPECT_EQ(num::exp_f(0.0f), 1.0f);
  EXPECT_EQ(num::exp_f(-0.0f), 1.0f);
  EXPECT_EQ(num::exp_f(kInf), kInf);
  EXPECT_EQ(num::exp_f(-kInf), 0.0f);
  EXPECT_TRUE(std::isnan(num::exp_f(kNaN)));
  EXPECT_TRUE(std::isinf(num::exp_f(88.72283936f)));   // e^x > FLT_MAX rounds to inf
  EXPECT_FALSE(std::isinf(num::exp_f(88.72283172f)));  // the largest x with a finite result
  EXPECT_EQ(num::exp_f(-104.0f), 0.0f);
  EXPECT_GT(num::exp_f(-103.0f), 0.0f);  // subnormal results are produced
}

// exp_fast_nonpos (the tensor_core order's softmax exponent) against long double on its domain [-87, 0]:
// every 61st float of it, a dense sweep, random bit patterns, and the neighbourhoods of -87 (the cut),
// of each k's boundary near it and of 0, float by float. Below -87 it returns 0 (where e^x < 1.7e-38),
// NaN stays NaN and the results are non-increasing as x goes down over every 61st float of the domain.
TEST(Transcendental, ExpFastNonPositive) {
  UlpStats st{"exp_fast"};
  auto xs = inputs_for("exp_fast", -87.0f, 0.0f, 1 << 20, 1 << 20);
  xs.erase(std::remove_if(xs.begin(), xs.end(), [](float x) { return !(x >= -87.0f && x <= 0.0f); }),
           xs.end());
  for (float c : {-87.0f, -86.6434f, -0.3466f, 0.0f}) {
    float x = c;
    for (int i = 0; i < 3000 && x > -87.0f; ++i) x = std::nextafter(x, -kInf);
    for (int i = 0; i < 6000 && x <= 0.0f; ++i, x = std::nextafter(x, kInf)) xs.push_back(x);
  }
  float prev = 1.0f;
  int64_t rising = 0;
  for (uint32_t b = 0x80000000u; b <= f32_bits(-87.0f); b += 61) {
    const float x = f32_from_bits(b), y = num::exp_fast_nonpos(x);
    xs.push_back(x);
    if (y > prev && rising++ < 3)
      ADD_FAILURE() << "exp_fast rises at x = " << x << ": " << y << " > " << prev;
    prev = y;
  }
  EXPECT_EQ(rising, 0);
  measure(st, xs, num::exp_fast_nonpos, [](long double x) { return std::exp(x); });
  st.report(1.0);
  EXPECT_EQ(num::exp_fast_nonpos(0.0f), 1.0f);
  EXPECT_EQ(num::exp_fast_nonpos(-0.0f), 1.0f);
  EXPECT_GT(num::exp_fast_nonpos(-87.0f), FLT_MIN);  // normal down to the cut
  for (float x : {std::nextafter(-87.0f, -kInf), -100.0f, -104.0f, -FLT_MAX, -kInf})
    EXPECT_EQ(f32_bits(num::exp_fast_nonpos(x)), 0u) << x;
  for (float x : {kNaN, -kNaN}) EXPECT_TRUE(std::isnan(num::exp_fast_nonpos(x)));
}

// exp_f64 (the loss's and the diff's fp64 exp) against long double: a dense sweep of [-745, 710], random
// bit patterns in the finite range, the thresholds and specials. Error in fp64 ulps of the reference.
TEST(Transcendental, ExpF64) {
  auto ulp64 = [](double f, long double ref) {
    if (std::isinf(f) || ref >= 0x1p1024L) return std::isinf(f) && ref >= 0x1p1024L ? 0.0 : INFINITY;
    const long double r = std::fabs(ref);
    int e;
    std::frexp(r, &e);
    const long double ulp = r < 0x1p-1022L ? 0x1p-1074L : std::ldexp(1.0L, e - 53);
    return double(std::fabs((long double)f - ref) / ulp);
  };
  double worst = 0, worst_x = 0, worst_sub = 0;
  std::mt19937_64 g(11);
  std::uniform_real_distribution<double> u(-745.0, 709.7);
  std::vector<double> xs;
  for (int i = 0; i <= 200000; ++i) xs.push_back(-745.0 + 1454.7 * i / 200000.0);
  for (int i = 0; i < 200000; ++i) xs.push_back(u(g));
  for (double c : {0.0, 1e-300, -1e-300, 0.5, -0.5, 1.0, 700.0, -700.0, 709.78, -708.39, -744.4}) xs.push_back(c);
  for (double x : xs) {
    const long double ref = std::exp((long double)x);
    const double e = ulp64(num::exp_f64(x), ref);
    if (ref < 0x1p-1022L) {  // subnormal results: the scaling rounds once more
      worst_sub = std::max(worst_sub, e);
      continue;
    }
    if (e > worst) worst = e, worst_x = x;
  }
  std::printf("exp_f64: max %.3f ulp at x = %.17g (normal results), %.3f ulp (subnormal results), %zu points\n",
              worst, worst_x, worst_sub, xs.size());
  EXPECT_LE(worst, 2.0) << "at x = " << worst_x;
  EXPECT_LE(worst_sub, 2.0);
  EXPECT_EQ(num::exp_f64(0.0), 1.0);
  EXPECT_EQ(num::exp_f64(-0.0), 1.0);
  EXPECT_TRUE(std::isinf(num::exp_f64(710.0)));
  EXPECT_EQ(num::exp_f64(-746.0), 0.0);
  EXPECT_EQ(num::exp_f64(-INFINITY), 0.0);
  EXPECT_TRUE(std::isinf(num::exp_f64(INFINITY)));
  EXPECT_TRUE(std::isnan(num::exp_f64(std::nan(""))));
}

TEST(Transcendental, Log) {
  UlpStats st{"log_f"};
  auto xs = inputs_for("log", 0.0f, FLT_MAX, 1 << 18, 1 << 20);
  for (int i = 0; i <= (1 << 19); ++i) xs.push_back(0.5f + 1.5f * float(i) / float(1 << 19));  // near 1
  measure(st, xs, num::log_f, [](long double x) { return std::log(x); });
  st.report(kLogUlp);
  EXPECT_EQ(num::log_f(1.0f), 0.0f);
  EXPECT_EQ(num::log_f(0.0f), -kInf);
  EXPECT_EQ(num::log_f(-0.0f), -kInf);
  EXPECT_EQ(num::log_f(kInf), kInf);
  EXPECT_TRUE(std::isnan(num::log_f(-1.0f)));
  EXPECT_TRUE(std::isnan(num::log_f(-kInf)));
  EXPECT_TRUE(std::isnan(num::log_f(kNaN)));
}

TEST(Transcendental, Log1p) {
  UlpStats st{"log1p_f"};
  auto xs = inputs_for("log1p", -1.0f, FLT_MAX, 0, 1 << 20);
  auto dense = inputs_for("log1p-dense", -1.0f, 4.0f, 1 << 20, 0);
  xs.insert(xs.end(), dense.begin(), dense.end());
  measure(st, xs, num::log1p_f, [](long double x) { return std::log1p(x); });
  st.report(kLog1pUlp);
  EXPECT_EQ(num::log1p_f(-1.0f), -kInf);
  EXPECT_TRUE(std::isnan(num::log1p_f(-1.5f)));
  EXPECT_EQ(f32_bits(num::log1p_f(-0.0f)), f32_bits(-0.0f));
  EXPECT_EQ(f32_bits(num::log1p_f(0.0f)), 0u);
  EXPECT_EQ(num::log1p_f(0x1p-149f), 0x1p-149f);
  EXPECT_EQ(num::log1p_f(kInf), kInf);
  EXPECT_TRUE(std::isnan(num::log1p_f(kNaN)));
}

TEST(Transcendental, SinCos) {
  UlpStats ss{"sin_f"}, cs{"cos_f"};
  auto xs = inputs_for("sincos", -0x1p20f, 0x1p20f, 1 << 19, 1 << 19);
  auto small = inputs_for("sincos-small", -8.0f, 8.0f, 1 << 18, 0);
  xs.insert(xs.end(), small.begin(), small.end());
  // floats next to multiples of pi/2 (where the reduction cancels most)
  for (int64_t k = 1; k < (int64_t(1) << 20) * 2 / 3; k = k * 9 / 8 + 1) {
    float x = float((long double)k * 1.5707963267948966192313216916397514L);
    for (int i = 0; i < 8; ++i) x = std::nextafter(x, 0.0f);
    for (int i = 0; i < 17; ++i, x = std::nextafter(x, kInf)) xs.push_back(x);
  }
  // RoPE-like angles: position * inv_freq, positions up to 2^20, frequencies base^(-2i/d)
  for (int i = 0; i < 32; ++i) {
    const float inv_freq = float(std::pow(10000.0L, -2.0L * i / 64.0L));
    for (int64_t p = 0; p <= (int64_t(1) << 20); p += 997) xs.push_back(float(p) * inv_freq);
    for (int64_t p = (int64_t(1) << 20) - 64; p <= (int64_t(1) << 20); ++p) xs.push_back(float(p) * inv_freq);
  }
  measure(ss, xs, num::sin_f, [](long double x) { return std::sin(x); });
  measure(cs, xs, num::cos_f, [](long double x) { return std::cos(x); });
  ss.report(kSinCosUlp);
  cs.report(kSinCosUlp);
  EXPECT_EQ(f32_bits(num::sin_f(-0.0f)), f32_bits(-0.0f));
  EXPECT_EQ(num::sin_f(0.0f), 0.0f);
  EXPECT_EQ(num::cos_f(0.0f), 1.0f);
  EXPECT_EQ(num::cos_f(-0.0f), 1.0f);
  EXPECT_EQ(num::sin_f(0x1p-149f), 0x1p-149f);
  for (float s : {kInf, -kInf, kNaN}) {
    EXPECT_TRUE(std::isnan(num::sin_f(s)));
    EXPECT_TRUE(std::isnan(num::cos_f(s)));
  }
  // outside the contract: still finite and bounded
  for (float x : {0x1p23f, 1e10f, -3e30f, FLT_MAX}) {
    EXPECT_LE(std::fabs(num::sin_f(x)), 1.0f) << x;
    EXPECT_LE(std::fabs(num::cos_f(x)), 1.0f) << x;
  }
}

TEST(Transcendental, Sigmoid) {
  UlpStats st{"sigmoid_f"};
  auto xs = inputs_for("sigmoid", -120.0f, 120.0f, 1 << 20, 1 << 20);
  auto wide = inputs_for("sigmoid-wide", -FLT_MAX, FLT_MAX, 0, 1 << 18);
  xs.insert(xs.end(), wide.begin(), wide.end());
  measure(st, xs, num::sigmoid_f, [](long double x) { return 1.0L / (1.0L + std::exp(-x)); });
  st.report(kSigmoidUlp);
  EXPECT_EQ(num::sigmoid_f(0.0f), 0.5f);
  EXPECT_EQ(num::sigmoid_f(kInf), 1.0f);
  EXPECT_EQ(num::sigmoid_f(-kInf), 0.0f);
  EXPECT_TRUE(std::isnan(num::sigmoid_f(kNaN)));
  EXPECT_EQ(num::silu_f(0.0f), 0.0f);
}

TEST(Transcendental, Softplus) {
  UlpStats st{"softplus_f"};
  auto xs = inputs_for("softplus", -120.0f, 30.0f, 1 << 20, 1 << 20);
  auto wide = inputs_for("softplus-wide", -FLT_MAX, FLT_MAX, 0, 1 << 18);
  xs.insert(xs.end(), wide.begin(), wide.end());
  measure(st, xs, num::softplus_f, [](long double x) { return x > 20 ? x : std::log1p(std::exp(x)); });
  st.report(kSoftplusUlp);
  EXPECT_EQ(num::softplus_f(20.5f), 20.5f);  // x > 20: exactly x, as torch does
  EXPECT_EQ(num::softplus_f(1e30f), 1e30f);
  EXPECT_EQ(num::softplus_f(kInf), kInf);
  EXPECT_EQ(num::softplus_f(-kInf), 0.0f);
  EXPECT_TRUE(std::isnan(num::softplus_f(kNaN)));
}

// NaN inputs come back untouched (no arithmetic on them), so CPU and GPU give the same bits.
TEST(Transcendental, NanInputsReturnedUnchanged) {
  for (uint32_t bits : {0x7fc00000u, 0xffc12345u, 0x7f800001u, 0xffffffffu}) {
    const float x = f32_from_bits(bits);
    for (auto f :
         {num::exp_f, num::log_f, num::log1p_f, num::sin_f, num::cos_f, num::sigmoid_f, num::softplus_f})
      EXPECT_EQ(f32_bits(f(x)), bits) << std::hex << bits;
  }
  EXPECT_EQ(f32_bits(num::log_f(-1.0f)), 0x7fc00000u);  // created NaNs are the canonical quiet NaN
  EXPECT_EQ(f32_bits(num::sin_f(kInf)), 0x7fc00000u);
}

TEST(Pow2, CeilPow2FromBits) {
  EXPECT_EQ(num::ceil_pow2(1.0f), 1.0f);
  EXPECT_EQ(num::ceil_pow2(std::nextafter(1.0f, 2.0f)), 2.0f);
  EXPECT_EQ(num::ceil_pow2(std::nextafter(1.0f, 0.0f)), 1.0f);
  EXPECT_EQ(num::ceil_pow2(0.75f), 1.0f);
  EXPECT_EQ(num::ceil_pow2(3e-7f), 0x1p-21f);
  EXPECT_EQ(num::ceil_pow2(FLT_MIN), FLT_MIN);
}

}  // namespace
}  // namespace dsv4
