// RoPE / YaRN (kernels/rope.h, MODEL.md §3.3) against long-double and double references.
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "kernels/rope.h"
#include "test_util.h"

namespace dsv4 {
namespace {

using test::bitwise_equal;
using test::rng_for;
using test::ulp_distance;

// The table of §3.3 in long double, written from the formula (1 / base^(2i/dim), YaRN ramp).
struct RefTable {
  std::vector<long double> freq;
  long double low = 0, high = 0;
};
RefTable ref_table(const RopeSpec& s) {
  RefTable r;
  const int half = s.rd / 2;
  r.freq.resize(half);
  for (int i = 0; i < half; ++i) r.freq[i] = 1.0L / std::pow((long double)s.base, (2.0L * i) / s.rd);
  if (!s.yarn) return r;
  const long double pi = 3.141592653589793238462643383279502884L;
  auto corr = [&](long double n) {
    return s.rd * std::log((long double)s.original_max_position / (n * 2 * pi)) /
           (2 * std::log((long double)s.base));
  };
  r.low = std::max(std::floor(corr(s.beta_fast)), 0.0L);
  r.high = std::min(std::ceil(corr(s.beta_slow)), (long double)(s.rd - 1));
  if (r.low == r.high) r.high += 0.001L;
  for (int i = 0; i < half; ++i) {
    long double ramp = std::clamp((i - r.low) / (r.high - r.low), 0.0L, 1.0L);
    long double smooth = 1 - ramp;
    r.freq[i] = r.freq[i] / s.factor * (1 - smooth) + r.freq[i] * smooth;
  }
  return r;
}

int64_t max_ulp(const std::vector<float>& got, const std::vector<long double>& want) {
  int64_t m = 0;
  for (size_t i = 0; i < got.size(); ++i) m = std::max(m, ulp_distance(got[i], float(want[i])));
  return m;
}

TEST(RopeFreqs, YarnBase160000MatchesLongDouble) {
  RopeSpec s;
  s.rd = 64;
  s.base = 160000.0f;
  s.yarn = true;
  const RefTable ref = ref_table(s);
  EXPECT_EQ(ref.low, 15.0L);
  EXPECT_EQ(ref.high, 25.0L);
  std::vector<float> f(32);
  rope_freqs(s, f.data());
  EXPECT_LE(max_ulp(f, ref.freq), 32);
  // Pairs below `low` (high frequencies) are untouched, pairs from `high` on are divided by the
  // factor (interpolated), in between they are blended.
  for (int i = 0; i <= 15; ++i)
    EXPECT_NEAR(f[i] / (1.0L / std::pow(160000.0L, 2.0L * i / 64)), 1.0L, 1e-5L) << i;
  for (int i = 25; i < 32; ++i)
    EXPECT_NEAR(f[i] * 16.0L / (1.0L / std::pow(160000.0L, 2.0L * i / 64)), 1.0L, 1e-5L) << i;
}

TEST(RopeFreqs, NoYarnBase10000MatchesLongDouble) {
  RopeSpec s;
  s.rd = 64;
  s.base = 10000.0f;
  s.yarn = false;
  const RefTable ref = ref_table(s);
  std::vector<float> f(32);
  rope_freqs(s, f.data());
  EXPECT_EQ(f[0], 1.0f);
  EXPECT_LE(max_ulp(f, ref.freq), 32);
}

TEST(RopeFreqs, OtherDimsAndBases) {
  for (int rd : {2, 8, 16, 64, 128})
    for (float base : {10000.0f, 160000.0f})
      for (bool yarn : {false, true}) {
        RopeSpec s;
        s.rd = rd;
        s.base = base;
        s.yarn = yarn;
        std::vector<float> f(rd / 2);
        rope_freqs(s, f.data());
        EXPECT_LE(max_ulp(f, ref_table(s).freq), 32) << rd << " " << base << " " << yarn;
      }
}

// A buffer of `rows` rows, each `heads` vectors of length dh plus `pad` trailing values per row.
struct Layout {
  int64_t rows, dh, pad;
  int heads, rd;
  int64_t ld() const { return heads * dh + pad; }
  RopeApplyParams params(float* x, const int64_t* pos, const float* freq, bool inverse, bool bf16) const {
    RopeApplyParams p;
    p.rows = rows;
    p.heads = heads;
    p.x = x;
    p.ld = ld();
    p.head_stride = dh;
    p.offset = dh - rd;
    p.pos = pos;
    p.freq = freq;
    p.rd = rd;
    p.inverse = inverse;
    p.round_bf16 = bf16;
    return p;
  }
};

std::vector<float> yarn_table(int rd) {
  RopeSpec s;
  s.rd = rd;
  s.base = 160000.0f;
  s.yarn = true;
  std::vector<float> f(rd / 2);
  rope_freqs(s, f.data());
  return f;
}

TEST(RopeApply, MatchesDoubleRotationAndTouchesOnlyLastRdDims) {
  auto g = rng_for("RopeApply.MatchesDouble");
  for (int heads : {1, 3, 5}) {
    const Layout L{37, 192, 7, heads, 64};
    const auto freq = yarn_table(L.rd);
    std::vector<int64_t> pos(L.rows);
    std::uniform_int_distribution<int64_t> pd(0, 200000);
    for (auto& v : pos) v = pd(g);
    pos[0] = 0;
    pos[1] = 1;
    const auto x0 = test::randn_bf16(g, size_t(L.rows * L.ld()));
    for (bool inverse : {false, true}) {
      auto x = x0;
      auto p = L.params(x.data(), pos.data(), freq.data(), inverse, true);
      ASSERT_EQ(rope_apply_check(p), nullptr);
      rope_apply(p);
      for (int64_t t = 0; t < L.rows; ++t)
        for (int64_t c = 0; c < L.ld(); ++c) {
          const int64_t h = c / L.dh, e = c % L.dh;
          const size_t k = size_t(t * L.ld() + c);
          if (h >= heads || e < L.dh - L.rd) {
            EXPECT_EQ(num::f32_bits(x[k]), num::f32_bits(x0[k])) << t << " " << c;
            continue;
          }
          const int64_t j = e - (L.dh - L.rd), i = j / 2;
          const size_t base = k - size_t(j % 2);
          const double angle = double(float(pos[t]) * freq[i]);  // the angle is an fp32 product
          const double cs = std::cos(angle), sn = inverse ? -std::sin(angle) : std::sin(angle);
          const double a = x0[base], b = x0[base + 1];
          const double want = (j % 2 == 0) ? a * cs - b * sn : a * sn + b * cs;
          const double tol = std::ldexp(std::abs(want), -8) + 1e-5 * (std::abs(a) + std::abs(b));
          EXPECT_NEAR(x[k], want, tol) << "t=" << t << " c=" << c << " inverse=" << inverse;
          EXPECT_EQ(x[k], num::bf16_round(x[k]));
        }
    }
  }
}

TEST(RopeApply, InverseUndoesForward) {
  auto g = rng_for("RopeApply.Inverse");
  const Layout L{64, 128, 0, 2, 64};
  const auto freq = yarn_table(L.rd);
  std::vector<int64_t> pos(L.rows);
  for (int64_t t = 0; t < L.rows; ++t) pos[t] = t * 977;
  const auto x0 = test::randn_bf16(g, size_t(L.rows * L.ld()));
  for (bool bf16 : {false, true}) {
    auto x = x0;
    rope_apply(L.params(x.data(), pos.data(), freq.data(), false, bf16));
    rope_apply(L.params(x.data(), pos.data(), freq.data(), true, bf16));
    const double rel = bf16 ? 1.0 / 64 : 1e-5;
    for (size_t k = 0; k < x.size(); ++k) EXPECT_NEAR(x[k], x0[k], rel * (1.0 + std::abs(x0[k]))) << k;
  }
}

TEST(RopeApply, InterleavedPairsNotNeox) {
  const int rd = 16;
  RopeSpec s;
  s.rd = rd;
  s.base = 10000.0f;
  std::vector<float> freq(rd / 2);
  rope_freqs(s, freq.data());
  const int64_t pos[1] = {3};
  for (int i = 0; i < rd / 2; ++i) {
    std::vector<float> x(rd, 0.0f);
    x[2 * i] = 1.0f;  // the pair (x[2i], x[2i+1]) = (1, 0) rotates to (cos, sin)
    RopeApplyParams p;
    p.rows = 1;
    p.x = x.data();
    p.ld = rd;
    p.head_stride = rd;
    p.pos = pos;
    p.freq = freq.data();
    p.rd = rd;
    p.round_bf16 = false;
    rope_apply(p);
    const double angle = double(3.0f * freq[i]);
    for (int c = 0; c < rd; ++c) {
      const double want = c == 2 * i ? std::cos(angle) : c == 2 * i + 1 ? std::sin(angle) : 0.0;
      EXPECT_NEAR(x[c], want, 1e-6) << "pair " << i << " dim " << c;
    }
  }
}

TEST(RopeApply, PositionZeroIsIdentityAndThreadCountInvariant) {
  auto g = rng_for("RopeApply.Threads");
  const Layout L{257, 64, 3, 3, 64};  // enough work for a parallel region
  const auto freq = yarn_table(L.rd);
  std::vector<int64_t> pos(L.rows);
  for (int64_t t = 0; t < L.rows; ++t) pos[t] = t * 131;
  const auto x0 = test::randn_bf16(g, size_t(L.rows * L.ld()));
  std::vector<std::vector<float>> outs;
  for (int threads : {1, 2, 3}) {
    omp_set_num_threads(threads);
    auto x = x0;
    rope_apply(L.params(x.data(), pos.data(), freq.data(), false, true));
    outs.push_back(x);
  }
  omp_set_num_threads(omp_get_num_procs());
  EXPECT_TRUE(bitwise_equal(outs[0], outs[1]));
  EXPECT_TRUE(bitwise_equal(outs[0], outs[2]));
  for (int64_t c = 0; c < L.ld(); ++c) EXPECT_NEAR(outs[0][c], x0[c], 1e-6) << c;  // pos 0
}

TEST(RopeApply, CheckNamesBadFields) {
  float x[8] = {};
  int64_t pos[1] = {0};
  float freq[4] = {};
  RopeApplyParams p;
  p.rows = 1;
  p.x = x;
  p.ld = 8;
  p.head_stride = 8;
  p.pos = pos;
  p.freq = freq;
  p.rd = 8;
  EXPECT_EQ(rope_apply_check(p), nullptr);
  auto q = p;
  q.rd = 7;
  EXPECT_STREQ(rope_apply_check(q), "rd");
  q = p;
  q.pos = nullptr;
  EXPECT_STREQ(rope_apply_check(q), "pos");
  q = p;
  q.heads = 0;
  EXPECT_STREQ(rope_apply_check(q), "heads");
}

}  // namespace
}  // namespace dsv4
