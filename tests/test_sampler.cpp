// The counter-based sampler (rollout/sampler.h) and Philox4x32-10 (kernels/numerics/philox.h).
//
// The distribution tests are deterministic (the draws are a function of seed, request and
// position), so they cannot flake; each also scores a deliberately wrong distribution against the
// same counts to show the bound can fail.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <numeric>
#include <string>
#include <thread>
#include <vector>

#include "kernels/logits.h"
#include "kernels/numerics/philox.h"
#include "model/error.h"
#include "rollout/sampler.h"
#include "test_util.h"

namespace dsv4 {
namespace {

using rollout::sample_token;
using rollout::SampleResult;
using rollout::SamplingParams;

// ---- Philox4x32-10 -----------------------------------------------------------------------------

// The published Random123 known-answer vectors for philox4x32 with 10 rounds (counter, key, result).
TEST(Philox, KnownAnswerVectors) {
  struct Kat {
    uint32_t ctr[4], key[2], want[4];
  };
  const Kat kats[] = {
      {{0x00000000, 0x00000000, 0x00000000, 0x00000000},
       {0x00000000, 0x00000000},
       {0x6627e8d5, 0xe169c58d, 0xbc57ac4c, 0x9b00dbd8}},
      {{0xffffffff, 0xffffffff, 0xffffffff, 0xffffffff},
       {0xffffffff, 0xffffffff},
       {0x408f276d, 0x41c83b0e, 0xa20bc7c6, 0x6d5451fd}},
      {{0x243f6a88, 0x85a308d3, 0x13198a2e, 0x03707344},
       {0xa4093822, 0x299f31d0},
       {0xd16cfe09, 0x94fdcceb, 0x5001e420, 0x24126ea1}},
  };
  for (const Kat& k : kats) {
    const num::PhiloxWords out = num::philox4x32_10(k.key, k.ctr);
    for (int i = 0; i < 4; ++i) EXPECT_EQ(out.w[i], k.want[i]) << "word " << i << " of counter " << k.ctr[0];
  }
}

TEST(Philox, UniformIsOpenExactAndMidpoint) {
  EXPECT_EQ(num::uniform_open01(0u), 0x1p-24f);
  EXPECT_EQ(num::uniform_open01(0xffffffffu), 1.0f - 0x1p-24f);
  EXPECT_LT(num::uniform_open01(0xffffffffu), 1.0f);
  // Every value is (2k + 1) 2^-24 exactly: scaling back gives an odd integer below 2^24.
  auto g = test::rng_for("uniform");
  for (int i = 0; i < 100000; ++i) {
    const uint32_t w = uint32_t(g());
    const float u = num::uniform_open01(w);
    ASSERT_GT(u, 0.0f);
    ASSERT_LT(u, 1.0f);
    const double k2 = double(u) * 16777216.0;
    ASSERT_EQ(k2, std::floor(k2));
    ASSERT_EQ(uint64_t(k2), 2ull * (w >> 9) + 1ull);
  }
}

// ---- helpers -------------------------------------------------------------------------------------

// Softmax of logits / temperature in float64 (an independent reference, libm exp).
std::vector<double> softmax64(const std::vector<float>& logits, double temperature) {
  double m = -INFINITY;
  for (float x : logits) m = std::max(m, double(x) / temperature);
  std::vector<double> p(logits.size());
  double s = 0;
  for (size_t i = 0; i < p.size(); ++i) s += p[i] = std::exp(double(logits[i]) / temperature - m);
  for (double& x : p) x /= s;
  return p;
}

// Counts of `n` draws of request `request`, positions 0..n-1.
std::vector<int64_t> draw_counts(const std::vector<float>& logits, const SamplingParams& p, int n,
                                 uint64_t request = 3) {
  std::vector<int64_t> c(logits.size(), 0);
  for (int i = 0; i < n; ++i) ++c[sample_token(logits.data(), int64_t(logits.size()), p, request, i).token];
  return c;
}

// Pearson's chi-square of counts against probabilities `expect` over the ids where expect > 0.
// Returns +inf when a count falls on an id with expect == 0 (a token outside the allowed set).
double chi_square(const std::vector<int64_t>& counts, const std::vector<double>& expect) {
  int64_t n = 0;
  for (int64_t c : counts) n += c;
  double x2 = 0;
  for (size_t i = 0; i < counts.size(); ++i) {
    if (expect[i] == 0) {
      if (counts[i] != 0) return INFINITY;
      continue;
    }
    const double e = double(n) * expect[i];
    x2 += (double(counts[i]) - e) * (double(counts[i]) - e) / e;
  }
  return x2;
}

// Upper 1e-9 quantiles of the chi-square distribution with df = 1..9 degrees of freedom.
double chi2_bound(int df) {
  static const double q[] = {0,       37.3249, 41.4465, 44.8413, 47.8795,
                             50.6922, 53.3446, 55.8748, 58.3076, 60.6603};
  return q[df];
}

// Keeps the first top_k (if > 0) candidates of p by (p desc, id asc), then the shortest prefix with
// mass >= top_p of theirs; returns the renormalised probabilities (0 outside the kept set).
std::vector<double> truncate64(const std::vector<double>& p, int top_k, double top_p) {
  std::vector<int> ids(p.size());
  std::iota(ids.begin(), ids.end(), 0);
  std::stable_sort(ids.begin(), ids.end(), [&](int a, int b) { return p[a] > p[b]; });
  const size_t n = top_k > 0 ? std::min(p.size(), size_t(top_k)) : p.size();
  double mass = 0;
  for (size_t i = 0; i < n; ++i) mass += p[ids[i]];
  std::vector<double> out(p.size(), 0.0);
  double run = 0;
  for (size_t i = 0; i < n; ++i) {
    run += p[ids[i]];
    out[ids[i]] = p[ids[i]];
    if (run >= top_p * mass) break;
  }
  for (double& x : out) x /= run;
  return out;
}

const std::vector<float> kSpread = {-2.0f, -1.0f, -0.5f, 0.0f, 0.3f, 0.7f, 1.0f, 1.5f, 2.0f, 2.5f};
constexpr int kDraws = 200000;

// ---- greedy --------------------------------------------------------------------------------------

TEST(Sampler, GreedyTakesArgmaxTiesToSmallerId) {
  SamplingParams p;
  p.temperature = 0.0f;
  const std::vector<float> l = {1.0f, 3.0f, -2.0f, 3.0f, 2.0f};
  for (int pos = 0; pos < 50; ++pos) EXPECT_EQ(sample_token(l.data(), 5, p, 9, pos).token, 1);
  const std::vector<float> flat(7, -4.0f);
  EXPECT_EQ(sample_token(flat.data(), 7, p, 0, 0).token, 0);
  const std::vector<float> last = {-1.0f, -1.0f, 0.5f};
  EXPECT_EQ(sample_token(last.data(), 3, p, 0, 0).token, 2);
}

TEST(Sampler, GreedyLogprobIsTheRawLogSoftmax) {
  SamplingParams p;
  p.temperature = 0.0f;
  auto g = test::rng_for("greedy logprob");
  const auto l = test::randn_bf16(g, 1000, 3.0f);
  const SampleResult r = sample_token(l.data(), 1000, p, 1, 2);
  float want = 0.0f;
  log_softmax_gather(l.data(), 1, 1000, &r.token, &want);
  EXPECT_EQ(num::f32_bits(r.logprob), num::f32_bits(want));
}

// ---- distribution --------------------------------------------------------------------------------

TEST(Sampler, TwoEqualLogitsSplitAtOneHalfExactly) {
  // p = (0.5, 0.5): the first candidate is id 0 (tie -> smaller id), its running sum 0.5 > u * 1 iff
  // u < 0.5. So the token is exactly [u >= 0.5] with u the documented uniform.
  const std::vector<float> l = {0.25f, 0.25f};
  SamplingParams p;
  p.seed = 11;
  for (int pos = 0; pos < 2000; ++pos) {
    const float u = rollout::sampling_uniform(p.seed, 4, pos);
    ASSERT_EQ(sample_token(l.data(), 2, p, 4, pos).token, u < 0.5f ? 0 : 1) << "position " << pos;
  }
}

TEST(Sampler, MatchesSoftmaxOverManyDraws) {
  SamplingParams p;
  p.seed = 42;
  const auto counts = draw_counts(kSpread, p, kDraws);
  const double x2 = chi_square(counts, softmax64(kSpread, 1.0));
  EXPECT_LT(x2, chi2_bound(9));
  // Power: the same counts against the softmax at temperature 1.05 (a 5% bias) score 376, far above
  // the bound of 60.7 (the correct softmax scores 5.8); a sampler that returned uniform ids would
  // score above 10^5.
  const double biased = chi_square(counts, softmax64(kSpread, 1.05));
  EXPECT_GT(biased, chi2_bound(9));
  std::printf("chi-square (9 dof, bound %.1f): softmax %.2f, softmax at T = 1.05 %.1f\n", chi2_bound(9), x2,
              biased);
}

TEST(Sampler, TemperatureScalesTheDistribution) {
  for (const float t : {0.5f, 2.0f}) {
    SamplingParams p;
    p.temperature = t;
    p.seed = 5;
    const auto counts = draw_counts(kSpread, p, kDraws);
    EXPECT_LT(chi_square(counts, softmax64(kSpread, t)), chi2_bound(9)) << "temperature " << t;
    EXPECT_GT(chi_square(counts, softmax64(kSpread, 1.0)), chi2_bound(9)) << "temperature " << t;
  }
  // The argmax's share grows as the temperature falls.
  std::vector<double> share;
  for (const float t : {4.0f, 1.0f, 0.25f}) {
    SamplingParams p;
    p.temperature = t;
    share.push_back(double(draw_counts(kSpread, p, 20000)[9]) / 20000);
  }
  EXPECT_LT(share[0], share[1]);
  EXPECT_LT(share[1], share[2]);
  EXPECT_GT(share[2], 0.8);
}

TEST(Sampler, TopKKeepsOnlyTheTopKAndRenormalises) {
  SamplingParams p;
  p.top_k = 4;
  p.seed = 8;
  const auto counts = draw_counts(kSpread, p, kDraws);
  for (int v = 0; v < 6; ++v) EXPECT_EQ(counts[v], 0) << "token " << v << " is outside the top 4";
  const auto want = truncate64(softmax64(kSpread, 1.0), 4, 1.0);
  EXPECT_LT(chi_square(counts, want), chi2_bound(3));
  // Power: scored against the untruncated softmax, the same counts are impossible (+inf) and against
  // the top 5 renormalised they score about 15000.
  const double top5 = chi_square(counts, truncate64(softmax64(kSpread, 1.0), 5, 1.0));
  EXPECT_GT(top5, chi2_bound(4));
  std::printf("chi-square (3 dof, bound %.1f): top 4 %.2f; against the top 5 (4 dof) %.0f\n", chi2_bound(3),
              chi_square(counts, want), top5);
}

TEST(Sampler, TopPKeepsTheSmallestPrefixAndRenormalises) {
  // Softmax of kSpread, sorted: 0.378, 0.229, 0.139, 0.084, 0.063, 0.042, 0.031, 0.019, 0.011, 0.004
  // (approximately), running sums 0.378, 0.607, 0.746, 0.830, ...; top_p = 0.8 keeps 4 ids, away
  // from the boundary.
  SamplingParams p;
  p.top_p = 0.8f;
  p.seed = 13;
  const auto probs = softmax64(kSpread, 1.0);
  const auto want = truncate64(probs, 0, 0.8);
  int kept = 0;
  for (double x : want) kept += x > 0;
  ASSERT_EQ(kept, 4);
  const auto counts = draw_counts(kSpread, p, kDraws);
  EXPECT_LT(chi_square(counts, want), chi2_bound(3));
  for (size_t v = 0; v < want.size(); ++v)
    if (want[v] == 0) {
      EXPECT_EQ(counts[v], 0) << "token " << v << " is outside the top-p set";
    }

  // top_k and top_p together: top_p applies to the top_k candidates' mass. top_k = 4 leaves 0.830;
  // 0.7 of it is 0.581, reached by 2 ids (0.607), where top_p = 0.7 alone would keep 3.
  p.top_k = 4;
  p.top_p = 0.7f;
  const auto want_kp = truncate64(probs, 4, 0.7);
  kept = 0;
  for (double x : want_kp) kept += x > 0;
  ASSERT_EQ(kept, 2);
  const auto counts_kp = draw_counts(kSpread, p, kDraws);
  EXPECT_LT(chi_square(counts_kp, want_kp), chi2_bound(1));
  EXPECT_EQ(counts_kp[9] + counts_kp[8], kDraws);

  // A tiny top_p keeps only the most likely token.
  p.top_k = 0;
  p.top_p = 1e-6f;
  const auto one = draw_counts(kSpread, p, 1000);
  EXPECT_EQ(one[9], 1000);
}

TEST(Sampler, TopKLargerThanVocabularyIsNoTruncation) {
  SamplingParams a, b;
  a.seed = b.seed = 3;
  b.top_k = 1000;
  for (int pos = 0; pos < 500; ++pos) {
    const auto ra = sample_token(kSpread.data(), 10, a, 1, pos);
    const auto rb = sample_token(kSpread.data(), 10, b, 1, pos);
    ASSERT_EQ(ra.token, rb.token);
  }
}

// ---- determinism ---------------------------------------------------------------------------------

TEST(Sampler, CounterIsPositionThenRequest) {
  SamplingParams p;
  p.seed = 0x0123456789abcdefull;
  const int64_t pos = (int64_t(1) << 33) + 5;
  const uint64_t req = (uint64_t(1) << 40) + 7;
  const SampleResult r = sample_token(kSpread.data(), 10, p, req, pos);
  EXPECT_EQ(r.counter[0], 5u);
  EXPECT_EQ(r.counter[1], 2u);
  EXPECT_EQ(r.counter[2], 7u);
  EXPECT_EQ(r.counter[3], 256u);
  // The uniform by hand: key = (seed low, seed high), word 0.
  const uint32_t key[2] = {0x89abcdefu, 0x01234567u};
  const float u = num::uniform_open01(num::philox4x32_10(key, r.counter).w[0]);
  EXPECT_EQ(u, rollout::sampling_uniform(p.seed, req, pos));
}

TEST(Sampler, SameInputsSameDrawInAnyOrderAndThread) {
  auto g = test::rng_for("determinism");
  const int64_t V = 300;
  std::vector<std::vector<float>> rows;
  for (int i = 0; i < 4; ++i) rows.push_back(test::randn_bf16(g, V, 2.0f));
  SamplingParams p;
  p.seed = 77;
  p.top_k = 50;
  p.top_p = 0.9f;
  p.temperature = 0.8f;
  const int kPos = 64;
  // Request r at position t uses row (r + t) % 4. Sequential order: request by request.
  std::vector<SampleResult> seq(4 * kPos);
  for (int r = 0; r < 4; ++r)
    for (int t = 0; t < kPos; ++t) seq[r * kPos + t] = sample_token(rows[(r + t) % 4].data(), V, p, r, t);
  // Interleaved, positions reversed (as a batch of 4 would, in another order).
  std::vector<SampleResult> inter(4 * kPos);
  for (int t = kPos - 1; t >= 0; --t)
    for (int r = 3; r >= 0; --r) inter[r * kPos + t] = sample_token(rows[(r + t) % 4].data(), V, p, r, t);
  // One thread per request.
  std::vector<SampleResult> threaded(4 * kPos);
  std::vector<std::thread> th;
  for (int r = 0; r < 4; ++r)
    th.emplace_back([&, r] {
      for (int t = 0; t < kPos; ++t)
        threaded[r * kPos + t] = sample_token(rows[(r + t) % 4].data(), V, p, r, t);
    });
  for (auto& x : th) x.join();
  int differ_between_requests = 0;
  for (int i = 0; i < 4 * kPos; ++i) {
    for (const auto* other : {&inter, &threaded}) {
      ASSERT_EQ(seq[i].token, (*other)[i].token) << "draw " << i;
      ASSERT_EQ(num::f32_bits(seq[i].logprob), num::f32_bits((*other)[i].logprob)) << "draw " << i;
      ASSERT_EQ(0, std::memcmp(seq[i].counter, (*other)[i].counter, sizeof seq[i].counter));
    }
  }
  // Different requests on the same row and position draw different uniforms.
  for (int t = 0; t < kPos; ++t)
    differ_between_requests +=
        rollout::sampling_uniform(p.seed, 0, t) != rollout::sampling_uniform(p.seed, 1, t);
  EXPECT_EQ(differ_between_requests, kPos);
  // And another seed gives another stream.
  int differ_between_seeds = 0;
  for (int t = 0; t < kPos; ++t)
    differ_between_seeds += rollout::sampling_uniform(1, 0, t) != rollout::sampling_uniform(2, 0, t);
  EXPECT_EQ(differ_between_seeds, kPos);
}

// ---- logprob -------------------------------------------------------------------------------------

TEST(Sampler, LogprobIsFullVocabularyLogSoftmaxOfTheScaledRow) {
  // The log-prob is z[token] - lse in fp32, so its error against float64 is bounded by the rounding
  // at the size of lse: 1e-6 holds while |lse| < 8 (ulp 9.5e-7); for the wide row (logits ~ N(0, 16),
  // lse ~ 20, ulp 1.9e-6) the bound is 2 ulp of lse.
  struct Row {
    int64_t V;
    float std;
  };
  for (const Row row : {Row{512, 1.0f}, Row{4099, 4.0f}}) {
    auto g = test::rng_for("logprob " + std::to_string(row.V));
    const auto l = test::randn_bf16(g, size_t(row.V), row.std);
    for (const float t : {1.0f, 0.7f, 1.3f}) {
      SamplingParams p;
      p.temperature = t;
      p.top_k = 20;  // truncation must not change the log-prob
      p.top_p = 0.5f;
      std::vector<float> z(l.size());
      for (size_t v = 0; v < l.size(); ++v) z[v] = l[v] / t;
      // float64 reference with libm, on the same fp32 quotients
      double m = -INFINITY;
      for (float x : z) m = std::max(m, double(x));
      double s = 0;
      for (float x : z) s += std::exp(double(x) - m);
      const double lse = m + std::log(s);
      const double tol = row.std == 1.0f ? 1e-6 : 2.0 * std::ldexp(1.0, std::ilogb(std::fabs(lse)) - 23);
      ASSERT_LT(std::fabs(lse), row.std == 1.0f ? 8.0 : 32.0);
      for (int pos = 0; pos < 200; ++pos) {
        const SampleResult r = sample_token(l.data(), row.V, p, 6, pos);
        ASSERT_NEAR(r.logprob, double(z[r.token]) - lse, tol) << "V " << row.V << " temperature " << t;
        // the model's kernel on the divided row, bit for bit
        float kernel = 0.0f;
        log_softmax_gather(z.data(), 1, row.V, &r.token, &kernel);
        ASSERT_EQ(num::f32_bits(r.logprob), num::f32_bits(kernel)) << "V " << row.V << " temperature " << t;
      }
    }
  }
}

// ---- errors --------------------------------------------------------------------------------------

// Runs f, expecting an InputError whose message contains every string of `parts`.
void expect_input_error(const std::function<void()>& f, const std::vector<std::string>& parts) {
  try {
    f();
    ADD_FAILURE() << "no InputError thrown; expected one naming " << parts.front();
  } catch (const InputError& e) {
    for (const auto& s : parts) EXPECT_NE(std::string(e.what()).find(s), std::string::npos) << e.what();
  }
}

TEST(Sampler, BadParametersNameTheField) {
  const auto bad = [](auto set, const std::string& field) {
    SamplingParams p;
    set(p);
    expect_input_error([&] { rollout::check_sampling(p, "prompts.jsonl line 3"); },
                       {field, "prompts.jsonl line 3"});
    expect_input_error([&] { sample_token(kSpread.data(), 10, p, 5, 17); },
                       {field, "request 5", "position 17"});
  };
  bad([](SamplingParams& p) { p.temperature = -0.5f; }, "temperature");
  bad([](SamplingParams& p) { p.temperature = NAN; }, "temperature");
  bad([](SamplingParams& p) { p.temperature = INFINITY; }, "temperature");
  bad([](SamplingParams& p) { p.top_k = -1; }, "top_k");
  bad([](SamplingParams& p) { p.top_p = 0.0f; }, "top_p");
  bad([](SamplingParams& p) { p.top_p = 1.5f; }, "top_p");
  bad([](SamplingParams& p) { p.top_p = NAN; }, "top_p");
  SamplingParams ok;
  ok.temperature = 0.0f;
  ok.top_p = 1.0f;
  EXPECT_NO_THROW(rollout::check_sampling(ok, "x"));
}

TEST(Sampler, NonFiniteLogitsAndBadShapesThrow) {
  for (const float x : {NAN, INFINITY, -INFINITY}) {
    std::vector<float> l = kSpread;
    l[6] = x;
    for (const float t : {0.0f, 1.0f}) {
      SamplingParams p;
      p.temperature = t;
      expect_input_error([&] { sample_token(l.data(), 10, p, 5, 17); },
                         {"logits[6]", "request 5", "position 17"});
    }
  }
  SamplingParams p;
  expect_input_error([&] { sample_token(kSpread.data(), 0, p, 5, 17); }, {"V", "request 5", "position 17"});
  expect_input_error([&] { sample_token(kSpread.data(), 10, p, 5, -1); }, {"position"});
  // A temperature so small that logits / temperature overflows.
  p.temperature = 1e-39f;
  expect_input_error([&] { sample_token(kSpread.data(), 10, p, 5, 17); }, {"temperature", "position 17"});
}

}  // namespace
}  // namespace dsv4
