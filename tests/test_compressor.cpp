// KV compressor and Hadamard rotation (kernels/compressor.h, MODEL.md §3.5, §3.7) against a double
// reference written from the spec, plus causality, prefix invariance and thread-count invariance.
#include <omp.h>

#include <cmath>
#include <limits>
#include <vector>

#include "kernels/compressor.h"
#include "kernels/rope.h"
#include "test_util.h"

namespace dsv4 {
namespace {

using test::bitwise_equal;
using test::rng_for;

// Explicit Sylvester matrix: H_1 = [1], H_2n = [[H_n, H_n], [H_n, -H_n]].
std::vector<double> sylvester(int64_t n) {
  std::vector<double> h{1.0};
  for (int64_t m = 1; m < n; m *= 2) {
    std::vector<double> h2(size_t(4 * m * m));
    for (int64_t i = 0; i < m; ++i)
      for (int64_t j = 0; j < m; ++j) {
        const double v = h[size_t(i * m + j)];
        h2[size_t(i * 2 * m + j)] = v;
        h2[size_t(i * 2 * m + j + m)] = v;
        h2[size_t((i + m) * 2 * m + j)] = v;
        h2[size_t((i + m) * 2 * m + j + m)] = -v;
      }
    h = std::move(h2);
  }
  return h;
}

// One compressor's inputs for up to Tmax tokens (shorter T use a prefix of x).
struct Case {
  int64_t Tmax, D, d;
  int ratio, rd;
  bool hadamard;
  int64_t coff() const { return ratio == 4 ? 2 : 1; }
  std::vector<float> x, wkv, wgate, ape, norm, freq;

  Case(const std::string& name, int64_t Tmax_, int64_t D_, int ratio_, int64_t d_, int rd_, bool had)
      : Tmax(Tmax_), D(D_), d(d_), ratio(ratio_), rd(rd_), hadamard(had) {
    auto g = rng_for(name);
    const int64_t cw = coff() * d;
    x = test::randn_bf16(g, size_t(Tmax * D));
    wkv = test::randn_bf16(g, size_t(cw * D), 1.0f / std::sqrt(float(D)));
    wgate = test::randn_bf16(g, size_t(cw * D), 1.0f / std::sqrt(float(D)));
    ape = test::randn_bf16(g, size_t(ratio * cw), 0.5f);
    std::uniform_real_distribution<float> u(0.5f, 1.5f);
    norm.resize(size_t(d));
    for (auto& v : norm) v = u(g);
    RopeSpec s;
    s.rd = rd;
    s.base = 160000.0f;
    s.yarn = true;
    freq.resize(size_t(rd / 2));
    rope_freqs(s, freq.data());
  }

  CompressorParams params(int64_t T, const float* xs, float* out) const {
    CompressorParams p;
    p.T = T;
    p.D = D;
    p.ratio = ratio;
    p.d = d;
    p.rd = rd;
    p.x = xs;
    p.wkv = wkv.data();
    p.wgate = wgate.data();
    p.ape = ape.data();
    p.norm = norm.data();
    p.freq = freq.data();
    p.hadamard = hadamard;
    p.out = out;
    return p;
  }

  // Runs the kernel; the returned buffer has two guard rows after the G output rows.
  std::vector<float> run(int64_t T, const float* xs) const {
    const int64_t G = T / ratio;
    std::vector<float> out(size_t((G + 2) * d), 12345.0f);
    const auto p = params(T, xs, out.data());
    EXPECT_EQ(compressor_check(p), nullptr);
    compressor(p);
    for (size_t i = size_t(G * d); i < out.size(); ++i)
      if (out[i] != 12345.0f) {
        ADD_FAILURE() << "write past row G=" << G << " at " << i;
        break;
      }
    out.resize(size_t(G * d));
    return out;
  }

  // §3.5 in double: projections, ape, overlap shuffle, per-channel softmax pooling, RMSNorm, RoPE at
  // g*r (fp32 angle, as the table defines it), optional Hadamard.
  std::vector<double> reference(int64_t T, const float* xs) const {
    const int64_t G = T / ratio, cw = coff() * d;
    auto proj = [&](const std::vector<float>& w, int64_t t, int64_t f) {
      double s = 0;
      for (int64_t k = 0; k < D; ++k) s += double(xs[t * D + k]) * double(w[size_t(f * D + k)]);
      return s;
    };
    std::vector<double> out(size_t(G * d));
    const std::vector<double> H = hadamard ? sylvester(d) : std::vector<double>{};
    for (int64_t g = 0; g < G; ++g) {
      std::vector<double> c(static_cast<size_t>(d));
      for (int64_t ch = 0; ch < d; ++ch) {
        std::vector<double> kv, sc;
        if (ratio == 4) {
          for (int s = 0; s < 4; ++s) {
            if (g == 0) {
              kv.push_back(0.0);
              sc.push_back(-std::numeric_limits<double>::infinity());
            } else {
              const int64_t t = (g - 1) * 4 + s;
              kv.push_back(proj(wkv, t, ch));
              sc.push_back(proj(wgate, t, ch) + ape[size_t(s * cw + ch)]);
            }
          }
          for (int s = 0; s < 4; ++s) {
            const int64_t t = g * 4 + s;
            kv.push_back(proj(wkv, t, d + ch));
            sc.push_back(proj(wgate, t, d + ch) + ape[size_t(s * cw + d + ch)]);
          }
        } else {
          for (int s = 0; s < ratio; ++s) {
            const int64_t t = g * ratio + s;
            kv.push_back(proj(wkv, t, ch));
            sc.push_back(proj(wgate, t, ch) + ape[size_t(s * cw + ch)]);
          }
        }
        double m = -std::numeric_limits<double>::infinity();
        for (double v : sc) m = std::max(m, v);
        double z = 0, acc = 0;
        for (double v : sc) z += std::exp(v - m);
        for (size_t s = 0; s < sc.size(); ++s) acc += std::exp(sc[s] - m) / z * kv[s];
        c[size_t(ch)] = acc;
      }
      double ss = 0;
      for (double v : c) ss += v * v;
      const double rinv = 1.0 / std::sqrt(ss / double(d) + 1e-6);
      for (int64_t ch = 0; ch < d; ++ch) c[size_t(ch)] = c[size_t(ch)] * rinv * norm[size_t(ch)];
      for (int i = 0; i < rd / 2; ++i) {
        const double angle = double(float(g * ratio) * freq[size_t(i)]);
        const size_t a = size_t(d - rd + 2 * i);
        const double x0 = c[a], x1 = c[a + 1];
        c[a] = x0 * std::cos(angle) - x1 * std::sin(angle);
        c[a + 1] = x0 * std::sin(angle) + x1 * std::cos(angle);
      }
      if (hadamard) {
        std::vector<double> h(size_t(d), 0.0);
        for (int64_t i = 0; i < d; ++i)
          for (int64_t j = 0; j < d; ++j) h[size_t(i)] += H[size_t(i * d + j)] * c[size_t(j)];
        for (int64_t i = 0; i < d; ++i) c[size_t(i)] = h[size_t(i)] / std::sqrt(double(d));
      }
      for (int64_t ch = 0; ch < d; ++ch) out[size_t(g * d + ch)] = c[size_t(ch)];
    }
    return out;
  }

  void expect_close(int64_t T) const {
    const auto got = run(T, x.data());
    const auto want = reference(T, x.data());
    ASSERT_EQ(got.size(), size_t((T / ratio) * d)) << "T=" << T;
    for (int64_t g = 0; g < T / ratio; ++g) {
      double ss = 0, err2 = 0, maxerr = 0;
      for (int64_t c = 0; c < d; ++c) {
        const double w = want[size_t(g * d + c)], e = got[size_t(g * d + c)] - w;
        ss += w * w;
        err2 += e * e;
        maxerr = std::max(maxerr, std::abs(e));
        ASSERT_EQ(got[size_t(g * d + c)], num::bf16_round(got[size_t(g * d + c)]));
      }
      const double rms = std::sqrt(ss / double(d));
      EXPECT_LE(std::sqrt(err2 / double(d)), 8e-3 * rms) << "T=" << T << " g=" << g;
      EXPECT_LE(maxerr, 3e-2 * rms) << "T=" << T << " g=" << g;
    }
    if (T >= ratio) {
      EXPECT_FALSE(test::all_zero(got));
    }
  }
};

TEST(Compressor, Ratio4EveryTUpTo300MatchesDouble) {
  const Case c("Compressor.Ratio4", 300, 16, 4, 16, 8, false);
  for (int64_t T = 1; T <= 300; ++T) c.expect_close(T);
}

TEST(Compressor, Ratio4IndexerShapeWithHadamardMatchesDouble) {
  const Case c("Compressor.Ratio4Hadamard", 129, 64, 4, 128, 64, true);
  for (int64_t T : {1, 3, 4, 7, 8, 129}) c.expect_close(T);
}

TEST(Compressor, Ratio128MatchesDouble) {
  const Case c("Compressor.Ratio128", 300, 16, 128, 32, 16, false);
  for (int64_t T : {1, 127, 128, 129, 255, 256, 257, 300}) c.expect_close(T);
}

TEST(Compressor, OtherRatioMainShapeMatchesDouble) {
  const Case c("Compressor.Ratio8", 40, 24, 8, 64, 64, false);
  for (int64_t T : {7, 8, 9, 40}) c.expect_close(T);
}

// Group g reads only tokens < (g+1)*r: changing token j leaves every group with (g+1)*r <= j
// bit-identical, and changes the group holding j (and, for C4, the next group through the overlap).
TEST(Compressor, CausalityIsBitwise) {
  for (int ratio : {4, 128}) {
    const Case c("Compressor.Causality" + std::to_string(ratio), 300, 16, ratio, 16, 8, false);
    const int64_t T = 300, G = T / ratio;
    const auto base = c.run(T, c.x.data());
    auto g = rng_for("perturb");
    for (int64_t j : {0, 1, 3, 4, 5, 127, 128, 130, 255, 256, 299}) {
      auto x = c.x;
      const auto fresh = test::randn_bf16(g, size_t(c.D));
      for (int64_t k = 0; k < c.D; ++k) x[size_t(j * c.D + k)] = fresh[size_t(k)];
      const auto out = c.run(T, x.data());
      for (int64_t gr = 0; gr < G; ++gr) {
        const std::vector<float> a(base.begin() + gr * c.d, base.begin() + (gr + 1) * c.d);
        const std::vector<float> b(out.begin() + gr * c.d, out.begin() + (gr + 1) * c.d);
        if ((gr + 1) * ratio <= j) {
          EXPECT_TRUE(bitwise_equal(a, b)) << "ratio " << ratio << " token " << j << " group " << gr;
        } else if (gr == j / ratio || (ratio == 4 && gr == j / ratio + 1)) {
          EXPECT_FALSE(bitwise_equal(a, b)) << "ratio " << ratio << " token " << j << " group " << gr;
        }
      }
    }
  }
}

// The rows of a shorter sequence are the leading rows of a longer one, bit for bit, and the
// result does not depend on the thread count.
TEST(Compressor, PrefixAndThreadCountInvariance) {
  const Case c("Compressor.Prefix", 300, 32, 4, 64, 64, true);
  const auto full = c.run(300, c.x.data());
  for (int64_t T : {4, 5, 17, 128, 129, 257}) {
    const auto part = c.run(T, c.x.data());
    EXPECT_TRUE(bitwise_equal(part, std::vector<float>(full.begin(), full.begin() + part.size()))) << T;
  }
  for (int threads : {1, 2, 3}) {
    omp_set_num_threads(threads);
    EXPECT_TRUE(bitwise_equal(c.run(300, c.x.data()), full)) << threads << " threads";
  }
  omp_set_num_threads(omp_get_num_procs());
}

TEST(Compressor, CheckNamesBadFields) {
  const Case c("Compressor.Check", 8, 8, 4, 16, 8, false);
  std::vector<float> out(64);
  auto p = c.params(8, c.x.data(), out.data());
  EXPECT_EQ(compressor_check(p), nullptr);
  auto q = p;
  q.ratio = 0;
  EXPECT_STREQ(compressor_check(q), "ratio");
  q = p;
  q.rd = 7;
  EXPECT_STREQ(compressor_check(q), "rd");
  q = p;
  q.d = 12;
  q.rd = 8;
  q.hadamard = true;
  EXPECT_STREQ(compressor_check(q), "d");
  q = p;
  q.wgate = nullptr;
  EXPECT_STREQ(compressor_check(q), "wgate");
}

TEST(Hadamard, MatchesSylvesterProductInDouble) {
  auto g = rng_for("Hadamard.Sylvester");
  for (int64_t n : {1, 2, 4, 8, 64, 128, 512}) {
    const int64_t rows = 3, ld = n + 5;
    const auto x0 = test::randn_bf16(g, size_t(rows * ld));
    auto x = x0;
    hadamard(x.data(), rows, n, ld);
    const auto H = sylvester(n);
    for (int64_t r = 0; r < rows; ++r) {
      double l1 = 0;
      for (int64_t j = 0; j < n; ++j) l1 += std::abs(x0[size_t(r * ld + j)]);
      for (int64_t i = 0; i < n; ++i) {
        double want = 0;
        for (int64_t j = 0; j < n; ++j) want += H[size_t(i * n + j)] * x0[size_t(r * ld + j)];
        want /= std::sqrt(double(n));
        const float got = x[size_t(r * ld + i)];
        EXPECT_NEAR(got, want, std::ldexp(std::abs(want), -8) + 1e-6 * l1) << "n=" << n << " i=" << i;
        EXPECT_EQ(got, num::bf16_round(got));
      }
      for (int64_t j = n; j < ld; ++j)
        EXPECT_EQ(num::f32_bits(x[size_t(r * ld + j)]), num::f32_bits(x0[size_t(r * ld + j)]));
    }
  }
}

TEST(Hadamard, IsItsOwnInverseUpToBf16) {
  auto g = rng_for("Hadamard.Involution");
  for (int64_t n : {2, 16, 128, 512}) {
    const int64_t rows = 4;
    const auto x0 = test::randn_bf16(g, size_t(rows * n));
    auto x = x0;
    hadamard(x.data(), rows, n, n);
    hadamard(x.data(), rows, n, n);
    double err2 = 0, ss = 0;
    for (size_t i = 0; i < x.size(); ++i) {
      err2 += (double(x[i]) - x0[i]) * (double(x[i]) - x0[i]);
      ss += double(x0[i]) * x0[i];
    }
    EXPECT_LE(std::sqrt(err2 / ss), std::ldexp(1.0, -7)) << n;
  }
}

}  // namespace
}  // namespace dsv4
