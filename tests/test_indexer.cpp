// Indexer top-k and index construction (kernels/indexer.h, MODEL.md §3.6, §3.7) against brute-force
// and double references.
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <set>
#include <vector>

#include "kernels/indexer.h"
#include "test_util.h"

namespace dsv4 {
namespace {

using test::bitwise_equal;
using test::rng_for;

constexpr float kInf = std::numeric_limits<float>::infinity();

// Brute force: stable sort of (NaN last, larger score first, smaller index first).
struct BruteTopk {
  std::vector<int32_t> ids;  // ascending
  float margin;
};
BruteTopk brute_topk(const std::vector<float>& s, int k) {
  std::vector<int32_t> order(s.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int32_t a, int32_t b) {
    const bool na = std::isnan(s[a]), nb = std::isnan(s[b]);
    if (na || nb) return !na && nb;
    return s[a] > s[b];
  });
  BruteTopk r;
  r.ids.assign(order.begin(), order.begin() + k);
  std::sort(r.ids.begin(), r.ids.end());
  r.margin = (k > 0 && size_t(k) < s.size()) ? s[order[k - 1]] - s[order[k]] : kInf;
  return r;
}

TEST(TopkRow, MatchesBruteForceWithPlantedTies) {
  auto g = rng_for("TopkRow.Ties");
  for (int n : {1, 2, 3, 5, 8, 17, 64, 300}) {
    for (int trial = 0; trial < 20; ++trial) {
      // Few distinct values, so ties at the cut are common; sometimes NaN and +-inf.
      std::uniform_int_distribution<int> v(-3, 3), special(0, 19);
      std::vector<float> s(static_cast<size_t>(n));
      for (auto& x : s) {
        const int sp = special(g);
        x = sp == 0   ? std::numeric_limits<float>::quiet_NaN()
            : sp == 1 ? -kInf
            : sp == 2 ? kInf
                      : v(g) * 0.5f;
      }
      for (int k : {0, 1, n / 2, n - 1, n}) {
        if (k < 0) continue;
        std::vector<int32_t> ids(size_t(k) + 1, -7), scratch(static_cast<size_t>(n));
        const float m = topk_row(s.data(), n, k, ids.data(), scratch.data());
        const auto want = brute_topk(s, k);
        EXPECT_EQ(std::vector<int32_t>(ids.begin(), ids.begin() + k), want.ids) << "n=" << n << " k=" << k;
        EXPECT_EQ(ids[size_t(k)], -7) << "wrote past k";
        if (std::isnan(want.margin))
          EXPECT_TRUE(std::isnan(m));
        else
          EXPECT_EQ(m, want.margin) << "n=" << n << " k=" << k;
      }
    }
  }
}

TEST(TopkRow, TiesGoToSmallerIndexAndMarginIsZero) {
  const std::vector<float> s = {1, 2, 2, 0, 2, 2};
  std::vector<int32_t> ids(3), scratch(6);
  const float m = topk_row(s.data(), 6, 3, ids.data(), scratch.data());
  EXPECT_EQ(ids, (std::vector<int32_t>{1, 2, 4}));
  EXPECT_EQ(m, 0.0f);
  // No competitor left: +inf.
  std::vector<int32_t> all(6);
  EXPECT_EQ(topk_row(s.data(), 6, 6, all.data(), scratch.data()), kInf);
  EXPECT_EQ(all, (std::vector<int32_t>{0, 1, 2, 3, 4, 5}));
  // A NaN is never chosen before a number.
  const std::vector<float> t = {std::numeric_limits<float>::quiet_NaN(), -5.0f, -kInf};
  std::vector<int32_t> one(1);
  EXPECT_EQ(topk_row(t.data(), 3, 1, one.data(), scratch.data()), kInf);
  EXPECT_EQ(one[0], 1);
}

// Indexer inputs and a double reference of the scores.
struct IdxCase {
  int64_t T, Di, G;
  int Hi, k, ratio = 4;
  bool bf16_scores = false;
  std::vector<float> qi, ki, wt;
  IdxCase(const std::string& name, int64_t T_, int Hi_, int64_t Di_, int Ki) : T(T_), Di(Di_), Hi(Hi_) {
    auto g = rng_for(name);
    G = T / ratio;
    k = int(std::min<int64_t>(Ki, G));
    qi = test::randn_bf16(g, size_t(T * Hi * Di));
    ki = test::randn_bf16(g, size_t(std::max<int64_t>(G, 1) * Di));
    wt = test::randn_bf16(g, size_t(T * Hi), 1.0f / std::sqrt(float(Hi * Di)));
  }
  IndexerParams params(int32_t* ids, float* margin, float* score) const {
    IndexerParams p;
    p.T = T;
    p.Hi = Hi;
    p.Di = Di;
    p.G = G;
    p.k = k;
    p.ratio = ratio;
    p.qi = qi.data();
    p.ki = ki.data();
    p.wt = wt.data();
    p.bf16_scores = bf16_scores;
    p.ids = ids;
    p.margin = margin;
    p.score = score;
    return p;
  }
  // ReLU inside the head sum, before weighting.
  double ref_score(int64_t t, int64_t g) const {
    double s = 0;
    for (int h = 0; h < Hi; ++h) {
      double d = 0;
      for (int64_t i = 0; i < Di; ++i)
        d += double(qi[size_t((t * Hi + h) * Di + i)]) * ki[size_t(g * Di + i)];
      s += double(wt[size_t(t * Hi + h)]) * std::max(d, 0.0);
    }
    return s;
  }
};

struct IdxOut {
  std::vector<int32_t> ids;
  std::vector<float> margin, score;
};
IdxOut run_indexer(const IdxCase& c) {
  IdxOut o;
  o.ids.assign(size_t(c.T * c.k), -9);
  o.margin.assign(size_t(c.T), -9.0f);
  o.score.assign(size_t(c.T * c.k), -9.0f);
  const auto p = c.params(o.ids.data(), o.margin.data(), o.score.data());
  EXPECT_EQ(indexer_check(p), nullptr);
  indexer_topk(p);
  return o;
}

TEST(Indexer, ScoresAndSelectionMatchDoubleWithCausalMask) {
  for (int64_t T : {1, 2, 3, 4, 5, 7, 17, 127, 129, 300}) {
    for (int Hi : {1, 3, 5}) {
      const int Ki = 8;
      const IdxCase c("Indexer.Double." + std::to_string(T) + "." + std::to_string(Hi), T, Hi, 32, Ki);
      EXPECT_EQ(c.k, std::min<int64_t>(Ki, T / 4));
      const auto o = run_indexer(c);
      for (int64_t p = 0; p < T; ++p) {
        const int64_t vis = std::min<int64_t>(c.G, (p + 1) / 4);
        const int64_t want_n = std::min<int64_t>(c.k, vis);
        const int32_t* ids = o.ids.data() + p * c.k;
        std::set<int32_t> chosen;
        for (int j = 0; j < c.k; ++j) {
          if (j < want_n) {
            ASSERT_GE(ids[j], 0) << "p=" << p << " j=" << j;
            ASSERT_LT(ids[j], vis) << "causal mask violated at p=" << p;
            if (j > 0) {
              EXPECT_LT(ids[j - 1], ids[j]) << "not ascending";
            }
            chosen.insert(ids[j]);
            const double want = c.ref_score(p, ids[j]);
            EXPECT_NEAR(o.score[size_t(p * c.k + j)], want, 1e-4 * (1 + std::abs(want)));
          } else {
            EXPECT_EQ(ids[j], -1) << "p=" << p << " j=" << j;
            EXPECT_TRUE(std::isnan(o.score[size_t(p * c.k + j)]));
          }
        }
        // The chosen set is a top set under the double scores (up to fp32 rounding).
        double worst_chosen = std::numeric_limits<double>::infinity();
        double best_other = -std::numeric_limits<double>::infinity();
        for (int64_t gr = 0; gr < vis; ++gr) {
          const double s = c.ref_score(p, gr);
          if (chosen.count(int32_t(gr)))
            worst_chosen = std::min(worst_chosen, s);
          else
            best_other = std::max(best_other, s);
        }
        if (vis > c.k) {
          EXPECT_GE(worst_chosen, best_other - 1e-4) << "p=" << p;
          EXPECT_GE(o.margin[size_t(p)], 0.0f);
          EXPECT_NEAR(o.margin[size_t(p)], worst_chosen - best_other, 2e-4 * (1 + std::abs(best_other)));
        } else {
          EXPECT_EQ(o.margin[size_t(p)], kInf) << "p=" << p;
        }
      }
    }
  }
}

// Two heads with opposite queries and positive weights: a ReLU outside the head sum would give 0.
TEST(Indexer, ReluIsInsideTheHeadSum) {
  IdxCase c("Indexer.Relu", 8, 2, 8, 2);
  for (int64_t t = 0; t < c.T; ++t) {
    for (int64_t i = 0; i < c.Di; ++i) c.qi[size_t((t * 2 + 1) * c.Di + i)] = -c.qi[size_t(t * 2 * c.Di + i)];
    c.wt[size_t(t * 2)] = c.wt[size_t(t * 2 + 1)] = 0.25f;
  }
  const auto o = run_indexer(c);
  for (int64_t p = 3; p < c.T; ++p)
    for (int j = 0; j < c.k; ++j) {
      if (o.ids[size_t(p * c.k + j)] < 0) continue;
      const double want = c.ref_score(p, o.ids[size_t(p * c.k + j)]);
      EXPECT_GT(want, 0.0);
      EXPECT_NEAR(o.score[size_t(p * c.k + j)], want, 1e-5 * (1 + want));
    }
}

TEST(Indexer, ShortSequencesHaveZeroWidth) {
  for (int64_t T : {1, 2, 3}) {
    const IdxCase c("Indexer.Short", T, 2, 16, 512);
    EXPECT_EQ(c.G, 0);
    EXPECT_EQ(c.k, 0);
    const auto o = run_indexer(c);
    for (float m : o.margin) EXPECT_EQ(m, kInf);
    IndexBuildParams b;
    b.T = T;
    b.W = 128;
    b.kind = CompressedKind::c4;
    b.ratio = 4;
    b.k = c.k;
    EXPECT_EQ(index_width(b), T);
  }
}

TEST(Indexer, ScoreIdsMatchesTopkScoresAndThreadCountInvariance) {
  const IdxCase c("Indexer.ScoreIds", 129, 3, 64, 16);
  std::vector<IdxOut> outs;
  for (int threads : {1, 2, 3}) {
    omp_set_num_threads(threads);
    outs.push_back(run_indexer(c));
  }
  omp_set_num_threads(omp_get_num_procs());
  for (int i = 1; i < 3; ++i) {
    EXPECT_TRUE(bitwise_equal(outs[0].ids, outs[i].ids));
    EXPECT_TRUE(bitwise_equal(outs[0].margin, outs[i].margin));
    EXPECT_TRUE(bitwise_equal(outs[0].score, outs[i].score));
  }
  std::vector<float> s(size_t(c.T * c.k));
  const auto p = c.params(nullptr, nullptr, nullptr);
  indexer_score_ids(p, outs[0].ids.data(), s.data());
  EXPECT_TRUE(bitwise_equal(s, outs[0].score));
  // Forced ids: any id, -1 gives NaN.
  std::vector<int32_t> forced(size_t(c.T * c.k));
  for (size_t i = 0; i < forced.size(); ++i) forced[i] = (i % 5 == 0) ? -1 : int32_t(i % size_t(c.G));
  indexer_score_ids(p, forced.data(), s.data());
  for (size_t i = 0; i < forced.size(); ++i) {
    if (forced[i] < 0) {
      EXPECT_TRUE(std::isnan(s[i]));
    } else {
      const double want = c.ref_score(int64_t(i) / c.k, forced[i]);
      EXPECT_NEAR(s[i], want, 1e-4 * (1 + std::abs(want)));
    }
  }
}

TEST(Indexer, CheckNamesBadFields) {
  const IdxCase c("Indexer.Check", 16, 2, 8, 4);
  std::vector<int32_t> ids(64);
  auto p = c.params(ids.data(), nullptr, nullptr);
  EXPECT_EQ(indexer_check(p), nullptr);
  auto q = p;
  q.k = int(c.G) + 1;
  EXPECT_STREQ(indexer_check(q), "k");
  q = p;
  q.qi = nullptr;
  EXPECT_STREQ(indexer_check(q), "qi");
  q = p;
  q.Hi = 0;
  EXPECT_STREQ(indexer_check(q), "Hi");
}

// Index rows built from the spec's wording: the window lists the last min(p+1, W) positions in
// increasing order, padded with -1 to Kw; compressed entries are offset by T.
std::vector<int32_t> ref_index_row(int64_t T, int W, CompressedKind kind, int ratio, int k,
                                   const std::vector<int32_t>& sel, int64_t p) {
  std::vector<int32_t> row;
  const int64_t kw = std::min<int64_t>(T, W);
  std::vector<int32_t> win;
  for (int64_t q = p; q >= 0 && p - q < W; --q) win.insert(win.begin(), int32_t(q));
  row = win;
  while (int64_t(row.size()) < kw) row.push_back(-1);
  if (kind == CompressedKind::c128) {
    for (int64_t g = 0; g < T / ratio; ++g) row.push_back((g + 1) * ratio <= p + 1 ? int32_t(g + T) : -1);
  } else if (kind == CompressedKind::c4) {
    for (int j = 0; j < k; ++j) {
      const int32_t s = sel[size_t(p * k + j)];
      row.push_back(s == -1 ? -1 : int32_t(s + T));
    }
  }
  return row;
}

// ---- bf16 scores (IndexerParams::bf16_scores: an engine that runs the score in bf16) ----

// The score of every candidate by the documented chain with an independent bf16 rounding: per head
// bf16(dot) (the canonical dot: reduce.h is the definition of every fp32 sum), ReLU, the bf16 product
// with the head weight, an fp32 sum over heads from 0, then bf16. The selection must be the top-k of
// those scores under the documented tie-break (larger first, then the smaller group), and the
// margins and reported scores the ones of those scores.
TEST(IndexerBf16, ScoresFollowTheDocumentedChainAndSelectionItsTopk) {
  for (int Hi : {1, 3, 8})
    for (int64_t T : {16, 129, 300}) {
      IdxCase c("Indexer.Bf16." + std::to_string(T) + "." + std::to_string(Hi), T, Hi, 64, 8);
      c.bf16_scores = true;
      const auto o = run_indexer(c);
      int64_t ties = 0;
      for (int64_t p = 0; p < T; ++p) {
        const int64_t vis = std::min<int64_t>(c.G, (p + 1) / 4);
        std::vector<float> want(static_cast<size_t>(vis));
        for (int64_t g = 0; g < vis; ++g) {
          float sum = 0.0f;
          for (int h = 0; h < Hi; ++h) {
            const float d = test::bf16_ref(
                dot(c.qi.data() + (p * Hi + h) * c.Di, c.ki.data() + g * c.Di, c.Di, ReduceOrder{}));
            const float r = d < 0.0f ? 0.0f : d;
            sum = float(double(sum) + double(test::bf16_ref(float(double(c.wt[size_t(p * Hi + h)]) * double(r)))));
          }
          want[size_t(g)] = test::bf16_ref(sum);
        }
        const int kk = int(std::min<int64_t>(c.k, vis));
        const auto top = brute_topk(want, kk);
        const std::vector<int32_t> got(o.ids.begin() + p * c.k, o.ids.begin() + p * c.k + kk);
        ASSERT_EQ(got, top.ids) << "T " << T << " Hi " << Hi << " row " << p;
        for (int j = 0; j < kk; ++j) ASSERT_EQ(o.score[size_t(p * c.k + j)], want[size_t(got[size_t(j)])]);
        if (vis > c.k) {
          ASSERT_EQ(o.margin[size_t(p)], top.margin) << "row " << p;
          ties += top.margin == 0.0f;
        }
      }
      (void)ties;  // bf16 scores tie often; the tie-break above decides them
    }
}

// The forced-ids path reports the same bf16 scores as the free selection, and the site changes the
// scores (bf16 is not fp32).
TEST(IndexerBf16, ScoreIdsAgreeAndDifferFromFp32) {
  IdxCase c("Indexer.Bf16.Ids", 200, 4, 64, 16);
  c.bf16_scores = true;
  const auto o = run_indexer(c);
  std::vector<float> s(o.score.size(), -9.0f);
  const auto p = c.params(nullptr, nullptr, nullptr);
  indexer_score_ids(p, o.ids.data(), s.data());
  EXPECT_TRUE(bitwise_equal(s, o.score));
  IdxCase f = c;
  f.bf16_scores = false;
  std::vector<float> s32(o.score.size(), -9.0f);
  indexer_score_ids(f.params(nullptr, nullptr, nullptr), o.ids.data(), s32.data());
  EXPECT_FALSE(bitwise_equal(s32, s)) << "bf16 scores equal the fp32 ones: the site would not be seen";
}

TEST(BuildIndex, MatchesSpecForManyShapes) {
  auto g = rng_for("BuildIndex");
  for (int64_t T : {1, 2, 3, 5, 7, 17, 127, 128, 129, 300}) {
    for (int W : {1, 4, 128}) {
      for (auto kind : {CompressedKind::none, CompressedKind::c128, CompressedKind::c4}) {
        for (int ratio : {4, 128}) {
          if (kind == CompressedKind::c4 && ratio != 4) continue;
          if (kind == CompressedKind::none && ratio != 4) continue;
          const int64_t G = T / ratio;
          const int k = kind == CompressedKind::c4 ? int(std::min<int64_t>(8, G)) : 0;
          std::vector<int32_t> sel(size_t(T * k));
          for (int64_t p = 0; p < T; ++p) {
            const int64_t vis = (p + 1) / ratio;
            std::uniform_int_distribution<int64_t> d(0, std::max<int64_t>(vis - 1, 0));
            for (int j = 0; j < k; ++j)
              sel[size_t(p * k + j)] = (vis == 0 || j % 3 == 2) ? -1 : int32_t(d(g));
          }
          IndexBuildParams b;
          b.T = T;
          b.W = W;
          b.kind = kind;
          b.ratio = ratio;
          b.k = k;
          b.sel = sel.data();
          const int64_t width = index_width(b);
          const int64_t want_width = std::min<int64_t>(T, W) + (kind == CompressedKind::c128 ? G : 0) + k;
          ASSERT_EQ(width, want_width);
          std::vector<int32_t> idx(size_t(T * width) + 3, -77);
          b.idx = idx.data();
          build_index(b);
          for (int64_t p = 0; p < T; ++p) {
            const auto want = ref_index_row(T, W, kind, ratio, k, sel, p);
            const std::vector<int32_t> got(idx.begin() + p * width, idx.begin() + (p + 1) * width);
            ASSERT_EQ(got, want) << "T=" << T << " W=" << W << " kind=" << int(kind) << " p=" << p;
          }
          for (size_t i = size_t(T * width); i < idx.size(); ++i) EXPECT_EQ(idx[i], -77);
        }
      }
    }
  }
}

TEST(BuildIndex, WindowEdgeCases) {
  // p < W - 1: [0..p] then -1; later rows: exactly the last W positions including p.
  IndexBuildParams b;
  b.T = 6;
  b.W = 4;
  std::vector<int32_t> idx(size_t(6 * 4));
  b.idx = idx.data();
  build_index(b);
  const std::vector<int32_t> want = {0, -1, -1, -1, 0, 1, -1, -1, 0, 1, 2, -1,
                                     0, 1,  2,  3,  1, 2, 3,  4,  2, 3, 4, 5};
  EXPECT_EQ(idx, want);
  // C128 visibility: group g becomes visible at p = (g+1)*128 - 1.
  b.T = 300;
  b.W = 128;
  b.kind = CompressedKind::c128;
  b.ratio = 128;
  ASSERT_EQ(index_width(b), 130);
  std::vector<int32_t> big(size_t(300 * 130));
  b.idx = big.data();
  build_index(b);
  EXPECT_EQ(big[size_t(126 * 130 + 128)], -1);
  EXPECT_EQ(big[size_t(127 * 130 + 128)], 300);
  EXPECT_EQ(big[size_t(254 * 130 + 129)], -1);
  EXPECT_EQ(big[size_t(255 * 130 + 129)], 301);
}

}  // namespace
}  // namespace dsv4
