// Backward of the compressor pooling (kernels/grad.h, MODEL.md §3.5, §5.3) against central finite
// differences of an independent float64 pooling (ape, the ratio-4 overlap gather with group 0's
// previous slots kv 0 / score -inf, per-channel softmax, RMSNorm with weight, RoPE at g * ratio, no
// roundings), plus exact zeros where no group reads, chunk / whole-sequence and thread-count
// invariance, and the parameter check.
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "kernels/compressor.h"
#include "kernels/grad.h"
#include "kernels/rope.h"
#include "test_util.h"

namespace dsv4 {
namespace {

using test::bitwise_equal;
using test::rng_for;

constexpr float kAccInit = 0.5f;  // dape and dnorm accumulate: start from a nonzero value

// Groups g0 .. g0+G-1 over the projections of tokens [row0, row0 + rows), with dout [G, d].
struct Case {
  int ratio;
  int64_t d;
  int rd;
  int64_t g0, G, row0, rows;
  std::vector<float> kvp, sc, ape, norm, freq, dout;

  int64_t cw() const { return (ratio == 4 ? 2 : 1) * d; }

  // Random inputs: kvp, sc ~ N(0, 1), ape ~ N(0, 0.5), norm in [0.5, 1.5], dout ~ N(0, 1).
  Case(const std::string& name, int ratio_, int64_t d_, int rd_, int64_t g0_, int64_t G_, int64_t row0_,
       int64_t rows_)
      : ratio(ratio_), d(d_), rd(rd_), g0(g0_), G(G_), row0(row0_), rows(rows_) {
    auto g = rng_for(name);
    kvp = test::randn_bf16(g, size_t(rows * cw()));
    sc = test::randn_bf16(g, size_t(rows * cw()));
    ape = test::randn_bf16(g, size_t(ratio * cw()), 0.5f);
    std::uniform_real_distribution<float> u(0.5f, 1.5f);
    norm.resize(size_t(d));
    for (auto& v : norm) v = u(g);
    dout = test::randn_bf16(g, size_t(G * d));
    RopeSpec s;
    s.rd = rd;
    s.base = 160000.0f;
    s.yarn = true;
    freq.resize(size_t(rd / 2));
    rope_freqs(s, freq.data());
  }

  // A point where every pooled value is exact in bf16 (so the forward's bf16 cast does nothing): all
  // scores equal (sc 0.5, ape 0.25: the weights are 1 / (number of live slots), a power of two) and kvp
  // = k/8 with |k| small enough that a group's sum has at most 8 significant bits.
  void make_pooled_rows_exact(const std::string& name) {
    auto g = rng_for(name + ".exact");
    const int nslot = ratio == 4 ? 8 : ratio;
    std::uniform_int_distribution<int> k(-std::min(8, 256 / nslot), std::min(8, 256 / nslot));
    for (auto& v : kvp) v = float(k(g)) / 8.0f;
    std::fill(sc.begin(), sc.end(), 0.5f);
    std::fill(ape.begin(), ape.end(), 0.25f);
  }
};

// The pooling, norm and rotation in float64, written from MODEL.md §3.5; L = sum dout · out.
double ref_loss(const Case& c, const std::vector<double>& kvp, const std::vector<double>& sc,
                const std::vector<double>& ape, const std::vector<double>& norm) {
  const int64_t cw = c.cw(), d = c.d;
  double L = 0;
  std::vector<double> y(static_cast<size_t>(d));
  for (int64_t g = 0; g < c.G; ++g) {
    const int64_t ga = c.g0 + g;
    for (int64_t ch = 0; ch < d; ++ch) {
      std::vector<double> kv, score;
      auto take = [&](int64_t token, int64_t col) {
        const size_t at = size_t((token - c.row0) * cw + col);
        kv.push_back(kvp[at]);
        score.push_back(sc[at] + ape[size_t((token % c.ratio) * cw + col)]);
      };
      if (c.ratio == 4) {
        for (int s = 0; s < 4; ++s) {
          if (ga == 0) {
            kv.push_back(0.0);
            score.push_back(-std::numeric_limits<double>::infinity());
          } else {
            take((ga - 1) * 4 + s, ch);
          }
        }
        for (int s = 0; s < 4; ++s) take(ga * 4 + s, d + ch);
      } else {
        for (int s = 0; s < c.ratio; ++s) take(ga * c.ratio + s, ch);
      }
      double m = -std::numeric_limits<double>::infinity(), Z = 0, acc = 0;
      for (double v : score) m = std::max(m, v);
      for (double v : score) Z += std::exp(v - m);
      for (size_t s = 0; s < kv.size(); ++s) acc += std::exp(score[s] - m) / Z * kv[s];
      y[size_t(ch)] = acc;
    }
    double ss = 0;
    for (double v : y) ss += v * v;
    const double r = 1.0 / std::sqrt(ss / double(d) + 1e-6);
    for (int64_t ch = 0; ch < d; ++ch) y[size_t(ch)] *= r * norm[size_t(ch)];
    for (int i = 0; i < c.rd / 2; ++i) {
      const double angle = double(float(ga * c.ratio) * c.freq[size_t(i)]);
      const size_t a = size_t(d - c.rd + 2 * i);
      const double x0 = y[a], x1 = y[a + 1];
      y[a] = x0 * std::cos(angle) - x1 * std::sin(angle);
      y[a + 1] = x0 * std::sin(angle) + x1 * std::cos(angle);
    }
    for (int64_t ch = 0; ch < d; ++ch) L += double(c.dout[size_t(g * d + ch)]) * y[size_t(ch)];
  }
  return L;
}

// Central differences of L at the coordinates `at` of one of the four inputs (which: 0 kvp, 1 sc,
// 2 ape, 3 norm). Step 1e-5: truncation ~1e-10 and cancellation ~1e-11 for these O(1) inputs.
std::vector<double> ref_fd(const Case& c, int which, const std::vector<size_t>& at) {
  std::vector<double> in[4] = {{c.kvp.begin(), c.kvp.end()},
                               {c.sc.begin(), c.sc.end()},
                               {c.ape.begin(), c.ape.end()},
                               {c.norm.begin(), c.norm.end()}};
  const double step = 1e-5;
  std::vector<double> g;
  for (size_t i : at) {
    double& x = in[which][i];
    const double x0 = x;
    x = x0 + step;
    const double lp = ref_loss(c, in[0], in[1], in[2], in[3]);
    x = x0 - step;
    const double lm = ref_loss(c, in[0], in[1], in[2], in[3]);
    x = x0;
    g.push_back((lp - lm) / (2 * step));
  }
  return g;
}

struct Grads {
  std::vector<float> dkvp, dsc, dape, dnorm;
};

CompressorPoolBwdParams params(const Case& c, Grads& g) {
  CompressorPoolBwdParams p;
  p.g0 = c.g0;
  p.G = c.G;
  p.row0 = c.row0;
  p.rows = c.rows;
  p.ratio = c.ratio;
  p.d = c.d;
  p.rd = c.rd;
  p.kvp = c.kvp.data();
  p.sc = c.sc.data();
  p.ape = c.ape.data();
  p.norm = c.norm.data();
  p.freq = c.freq.data();
  p.dout = c.dout.data();
  p.dkvp = g.dkvp.data();
  p.dsc = g.dsc.data();
  p.dape = g.dape.data();
  p.dnorm = g.dnorm.data();
  return p;
}

Grads backward(const Case& c, ReduceOrder order = {}) {
  Grads g;
  g.dkvp.assign(size_t(c.rows * c.cw()), std::nanf(""));  // overwritten everywhere
  g.dsc.assign(g.dkvp.size(), std::nanf(""));
  g.dape.assign(size_t(c.ratio * c.cw()), kAccInit);
  g.dnorm.assign(size_t(c.d), kAccInit);
  CompressorPoolBwdParams p = params(c, g);
  p.order = order;
  EXPECT_EQ(compressor_pool_backward_check(p), nullptr);
  compressor_pool_backward(p);
  return g;
}

std::vector<double> minus_init(const std::vector<float>& v) {
  std::vector<double> r;
  for (float x : v) r.push_back(double(x) - double(kAccInit));
  return r;
}

// Every coordinate, or `samples` random ones when the tensor is larger.
std::vector<size_t> coords(size_t n, size_t samples, std::mt19937_64& g) {
  std::vector<size_t> at;
  if (n <= samples) {
    for (size_t i = 0; i < n; ++i) at.push_back(i);
    return at;
  }
  std::uniform_int_distribution<size_t> u(0, n - 1);
  for (size_t i = 0; i < samples; ++i) at.push_back(u(g));
  return at;
}

// |got - want| <= max_rel * max|want| at every coordinate and rms error <= rms_rel * rms(want).
void expect_close(const std::string& what, const std::vector<double>& got, const std::vector<size_t>& at,
                  const std::vector<double>& want, double max_rel, double rms_rel) {
  double mx = 0, ss = 0, es = 0, worst = 0;
  size_t wi = 0;
  for (size_t k = 0; k < at.size(); ++k) {
    mx = std::max(mx, std::abs(want[k]));
    ss += want[k] * want[k];
    ASSERT_TRUE(std::isfinite(got[at[k]])) << what << "[" << at[k] << "]";
    const double e = std::abs(got[at[k]] - want[k]);
    es += e * e;
    if (e > worst) worst = e, wi = k;
  }
  ASSERT_GT(mx, 0.0) << what << ": the reference gradient is all zero";
  EXPECT_LE(worst, max_rel * mx) << what << ": worst at " << at[wi] << ": got " << got[at[wi]] << ", want "
                                 << want[wi] << " (max |want| " << mx << ")";
  EXPECT_LE(std::sqrt(es), rms_rel * std::sqrt(ss)) << what << ": rms error";
}

// Which (token, column) elements the groups read, from the slot rule of MODEL.md §3.5: everything
// else must be exactly 0 in dkvp and dsc.
std::vector<char> read_mask(const Case& c) {
  std::vector<char> m(size_t(c.rows * c.cw()), 0);
  for (int64_t ga = c.g0; ga < c.g0 + c.G; ++ga) {
    for (int s = 0; s < c.ratio; ++s)
      for (int64_t ch = 0; ch < c.d; ++ch) {
        if (c.ratio == 4) {
          m[size_t((ga * 4 + s - c.row0) * c.cw() + c.d + ch)] = 1;
          if (ga > 0) m[size_t(((ga - 1) * 4 + s - c.row0) * c.cw() + ch)] = 1;
        } else {
          m[size_t((ga * c.ratio + s - c.row0) * c.cw() + ch)] = 1;
        }
      }
  }
  return m;
}

void check_case(const Case& c, double max_rel, double rms_rel, size_t samples) {
  const Grads g = backward(c);
  const std::vector<double> got[4] = {
      {g.dkvp.begin(), g.dkvp.end()}, {g.dsc.begin(), g.dsc.end()}, minus_init(g.dape), minus_init(g.dnorm)};
  const char* names[4] = {"dkvp", "dsc", "dape", "dnorm"};
  auto rng = rng_for("coords." + std::to_string(c.ratio) + "." + std::to_string(c.g0));
  for (int which = 0; which < 4; ++which) {
    const auto at = coords(got[which].size(), samples, rng);
    expect_close(names[which], got[which], at, ref_fd(c, which, at), max_rel, rms_rel);
  }
  const auto mask = read_mask(c);
  int64_t unread = 0;
  for (size_t i = 0; i < mask.size(); ++i) {
    if (mask[i]) continue;
    ++unread;
    ASSERT_EQ(g.dkvp[i], 0.0f) << "dkvp element " << i << " is read by no group";
    ASSERT_EQ(g.dsc[i], 0.0f) << "dsc element " << i << " is read by no group";
  }
  EXPECT_GT(unread, 0);  // every case has a tail or unread rows
}

struct Shape {
  int ratio;
  int64_t d;
  int rd;
  int64_t g0, G, row0, rows;
};
// Whole sequences with an incomplete tail, and chunks (g0 > 0) whose rows start before the first
// token they read; ratio 4 overlaps, 8, 16 and 128 do not.
const Shape kShapes[] = {
    {4, 36, 12, 0, 5, 0, 23},       // tail of 3 tokens
    {4, 20, 8, 3, 3, 4, 27},        // chunk: group 1's tokens unread, group 2's read for its first half
    {8, 40, 16, 0, 3, 0, 29},       // tail of 5
    {8, 24, 8, 2, 2, 8, 28},        // chunk: tokens of group 1 unread
    {16, 24, 8, 0, 2, 0, 35},       // tail of 3
    {128, 64, 16, 1, 2, 128, 263},  // chunk with a tail of 7
};

// At a random point the forward's bf16 cast of the pooled row (2^-9 relative) sits between the kernel
// (which differentiates at the rounded row, straight-through) and the unrounded reference: measured
// <= 2.5e-3 of the gradient's scale (dnorm, whose terms are products with the rounded row). Bounds
// 1e-2 (about 5 * 2^-9) of the largest element, 8e-3 rms.
TEST(CompressorPoolBackward, MatchesFiniteDifferencesOfFloat64Pooling) {
  for (const Shape& s : kShapes) {
    const std::string name = "CPBwd.random." + std::to_string(s.ratio) + "." + std::to_string(s.g0);
    SCOPED_TRACE(name);
    const Case c(name, s.ratio, s.d, s.rd, s.g0, s.G, s.row0, s.rows);
    check_case(c, 1e-2, 8e-3, s.ratio == 128 ? 300 : 100000);
  }
}

// Where the pooled rows are exact in bf16 the kernel and the reference differ by fp32 rounding only
// (sums of at most 128 terms, the norm, cos_f / sin_f within 1 ulp): measured <= 2.1e-7 of the
// largest element; bounds 5e-6 of the largest element, 2e-6 rms.
TEST(CompressorPoolBackward, MatchesFiniteDifferencesTightlyWherePooledRowsAreExact) {
  for (const Shape& s : kShapes) {
    const std::string name = "CPBwd.exact." + std::to_string(s.ratio) + "." + std::to_string(s.g0);
    SCOPED_TRACE(name);
    Case c(name, s.ratio, s.d, s.rd, s.g0, s.G, s.row0, s.rows);
    c.make_pooled_rows_exact(name);
    check_case(c, 5e-6, 2e-6, s.ratio == 128 ? 300 : 100000);
  }
}

// Parallel over groups (dkvp, dsc) and over elements (dnorm, dape): 1 and 3 threads give the same
// bits in both reduce orders.
TEST(CompressorPoolBackward, ThreadCountInvariant) {
  for (const Shape s : {Shape{4, 64, 16, 0, 64, 0, 259}, Shape{128, 64, 16, 0, 4, 0, 600}}) {
    const Case c("CPBwd.threads." + std::to_string(s.ratio), s.ratio, s.d, s.rd, s.g0, s.G, s.row0, s.rows);
    for (const ReduceOrder order : {ReduceOrder{0}, ReduceOrder{16}}) {
      omp_set_num_threads(1);
      const Grads one = backward(c, order);
      omp_set_num_threads(3);
      const Grads three = backward(c, order);
      EXPECT_TRUE(bitwise_equal(one.dkvp, three.dkvp));
      EXPECT_TRUE(bitwise_equal(one.dsc, three.dsc));
      EXPECT_TRUE(bitwise_equal(one.dape, three.dape));
      EXPECT_TRUE(bitwise_equal(one.dnorm, three.dnorm));
      EXPECT_FALSE(test::all_zero(one.dsc));
    }
  }
  omp_set_num_threads(1);
}

// A chunk of groups gives the dkvp / dsc elements of its groups with the same bits as the whole
// sequence (each element gets one term, from the one group that reads it).
TEST(CompressorPoolBackward, ChunkMatchesWholeSequenceBitwise) {
  for (int ratio : {4, 8}) {
    const int64_t d = 24, G = 9;
    const Case whole("CPBwd.whole." + std::to_string(ratio), ratio, d, 8, 0, G, 0, G * ratio + 2);
    const Grads gw = backward(whole);
    const int64_t g0 = 4, Gc = 3, row0 = (ratio == 4 ? g0 - 1 : g0) * ratio;
    Case chunk = whole;
    chunk.g0 = g0;
    chunk.G = Gc;
    chunk.row0 = row0;
    chunk.rows = (g0 + Gc) * ratio - row0;
    const int64_t cw = whole.cw();
    chunk.kvp.assign(whole.kvp.begin() + row0 * cw, whole.kvp.begin() + (row0 + chunk.rows) * cw);
    chunk.sc.assign(whole.sc.begin() + row0 * cw, whole.sc.begin() + (row0 + chunk.rows) * cw);
    chunk.dout.assign(whole.dout.begin() + g0 * d, whole.dout.begin() + (g0 + Gc) * d);
    const Grads gc = backward(chunk);
    const auto mask = read_mask(chunk);
    int64_t compared = 0;
    for (size_t i = 0; i < mask.size(); ++i) {
      if (!mask[i]) continue;
      const size_t w = size_t(row0 * cw) + i;
      ASSERT_TRUE(
          bitwise_equal(std::vector<float>{gc.dkvp[i], gc.dsc[i]}, std::vector<float>{gw.dkvp[w], gw.dsc[w]}))
          << "ratio " << ratio << " element " << i;
      ++compared;
    }
    EXPECT_EQ(compared, Gc * ratio * d * (ratio == 4 ? 2 : 1));
  }
}

// No group: dkvp / dsc are zeroed, dape / dnorm untouched.
TEST(CompressorPoolBackward, NoGroupZeroesAndLeavesSumsAlone) {
  Case c("CPBwd.nogroup", 4, 16, 8, 0, 0, 0, 3);
  const Grads g = backward(c);
  EXPECT_TRUE(test::all_zero(g.dkvp));
  EXPECT_TRUE(test::all_zero(g.dsc));
  for (float v : g.dape) EXPECT_EQ(v, kAccInit);
  for (float v : g.dnorm) EXPECT_EQ(v, kAccInit);
}

// Null dape / dnorm: the same dkvp / dsc.
TEST(CompressorPoolBackward, OptionalSums) {
  const Case c("CPBwd.optional", 4, 16, 8, 0, 3, 0, 12);
  const Grads full = backward(c);
  Grads g;
  g.dkvp.assign(full.dkvp.size(), 1.0f);
  g.dsc.assign(full.dsc.size(), 1.0f);
  CompressorPoolBwdParams p = params(c, g);
  p.dape = nullptr;
  p.dnorm = nullptr;
  ASSERT_EQ(compressor_pool_backward_check(p), nullptr);
  compressor_pool_backward(p);
  EXPECT_TRUE(bitwise_equal(g.dkvp, full.dkvp));
  EXPECT_TRUE(bitwise_equal(g.dsc, full.dsc));
}

TEST(CompressorPoolBackward, CheckNamesTheBadField) {
  const Case c("CPBwd.check", 4, 16, 8, 2, 2, 4, 12);
  Grads g;
  g.dkvp.resize(size_t(c.rows * c.cw()));
  g.dsc.resize(g.dkvp.size());
  g.dape.resize(size_t(c.ratio * c.cw()));
  g.dnorm.resize(size_t(c.d));
  const CompressorPoolBwdParams p = params(c, g);
  ASSERT_EQ(compressor_pool_backward_check(p), nullptr);
  auto expect_mentions = [](const CompressorPoolBwdParams& bad, const char* word) {
    const char* why = compressor_pool_backward_check(bad);
    ASSERT_NE(why, nullptr) << word;
    EXPECT_NE(std::string(why).find(word), std::string::npos) << why;
  };
  CompressorPoolBwdParams bad = p;
  bad.row0 = 8;  // group 2 reads group 1's tokens (ratio 4 overlap), which start at 4
  bad.rows = 8;
  expect_mentions(bad, "outside");
  bad = p;
  bad.rows = 11;  // group 3's last token is 15
  expect_mentions(bad, "outside");
  bad = p;
  bad.row0 = 2;
  expect_mentions(bad, "row0");
  bad = p;
  bad.rd = 7;
  expect_mentions(bad, "rd");
  bad = p;
  bad.rd = 18;
  expect_mentions(bad, "rd");
  bad = p;
  bad.dout = nullptr;
  expect_mentions(bad, "dout");
  bad = p;
  bad.dsc = nullptr;
  expect_mentions(bad, "dsc");
  bad = p;
  bad.order.block = 4;
  expect_mentions(bad, "order");
}

}  // namespace
}  // namespace dsv4
