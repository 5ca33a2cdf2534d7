// Log-probabilities: float64 reference, large logits without overflow, -inf entries, rows without
// a target, thread-count invariance.
#include <omp.h>

#include <cmath>
#include <limits>
#include <vector>

#include "kernels/logits.h"
#include "test_util.h"

namespace dsv4 {
namespace {

using test::bitwise_equal;
using test::rng_for;

double lse_d(const float* l, int64_t V) {
  double m = -INFINITY;
  for (int64_t v = 0; v < V; ++v) m = std::max(m, double(l[v]));
  double z = 0;
  for (int64_t v = 0; v < V; ++v) z += std::exp(double(l[v]) - m);
  return m + std::log(z);
}

TEST(Logits, LogSoftmaxMatchesFloat64) {
  auto g = rng_for("logits");
  for (int64_t V : {1, 7, 8, 9, 1000, 4099}) {
    const int64_t rows = 6;
    std::vector<float> l(size_t(rows * V));
    std::normal_distribution<float> d(0.0f, 4.0f);
    for (auto& v : l) v = d(g);
    std::vector<int32_t> target(static_cast<size_t>(rows));
    std::uniform_int_distribution<int32_t> pick(0, int32_t(V - 1));
    for (auto& t : target) t = pick(g);
    std::vector<float> lp(static_cast<size_t>(rows));
    log_softmax_gather(l.data(), rows, V, target.data(), lp.data());
    for (int64_t r = 0; r < rows; ++r) {
      const double lse = lse_d(l.data() + r * V, V);
      EXPECT_NEAR(logsumexp_row(l.data() + r * V, V), lse, 4e-6 * std::max(1.0, std::fabs(lse))) << V;
      const double want = double(l[size_t(r * V + target[size_t(r)])]) - lse;
      EXPECT_NEAR(lp[size_t(r)], want, 4e-6 * std::max(1.0, std::fabs(lse))) << V;
      EXPECT_LE(lp[size_t(r)], 0.0f);
    }
  }
}

TEST(Logits, LargeLogitsDoNotOverflow) {
  std::vector<float> l = {10000.0f, 10001.0f, 9999.5f, -10000.0f, 10000.25f};
  const double want = lse_d(l.data(), 5);
  EXPECT_TRUE(std::isfinite(logsumexp_row(l.data(), 5)));
  EXPECT_NEAR(logsumexp_row(l.data(), 5), want, 2e-3);  // ulp(1e4) ~ 1e-3
  const std::vector<int32_t> target = {1};
  float lp = 0;
  log_softmax_gather(l.data(), 1, 5, target.data(), &lp);
  EXPECT_NEAR(lp, 10001.0 - want, 2e-3);
  // One dominant logit: log-prob ~ 0, others very negative but finite.
  std::vector<float> m = {1e30f, 0.0f, -1e30f};
  EXPECT_EQ(logsumexp_row(m.data(), 3), 1e30f);
}

TEST(Logits, MinusInfinityEntriesAreIgnored) {
  const float ninf = -std::numeric_limits<float>::infinity();
  std::vector<float> l = {ninf, 0.0f, ninf, 0.0f};
  EXPECT_NEAR(logsumexp_row(l.data(), 4), std::log(2.0), 1e-6);
  std::vector<float> all = {ninf, ninf};
  EXPECT_EQ(logsumexp_row(all.data(), 2), ninf);
}

TEST(Logits, RowsWithoutTargetAreLeftAlone) {
  std::vector<float> l = {1.0f, 2.0f, 3.0f, 4.0f, 5.0f, 6.0f};
  const std::vector<int32_t> target = {-1, 2};
  std::vector<float> lp = {42.0f, 42.0f};
  log_softmax_gather(l.data(), 2, 3, target.data(), lp.data());
  EXPECT_EQ(lp[0], 42.0f);
  EXPECT_NEAR(lp[1], 6.0 - lse_d(l.data() + 3, 3), 1e-6);
}

TEST(Logits, ThreadCountsAndRowIndependence) {
  auto g = rng_for("logits-threads");
  const int64_t rows = 33, V = 777;
  const auto l = test::randn_bf16(g, size_t(rows * V), 3.0f);
  std::vector<int32_t> target(static_cast<size_t>(rows));
  for (int64_t r = 0; r < rows; ++r) target[size_t(r)] = int32_t((r * 37) % V);
  const int saved = omp_get_max_threads();
  std::vector<float> a(static_cast<size_t>(rows)), b(static_cast<size_t>(rows));
  omp_set_num_threads(1);
  log_softmax_gather(l.data(), rows, V, target.data(), a.data());
  omp_set_num_threads(3);
  log_softmax_gather(l.data(), rows, V, target.data(), b.data());
  omp_set_num_threads(saved);
  EXPECT_TRUE(bitwise_equal(a, b));
  for (int64_t r = 0; r < rows; ++r)
    EXPECT_EQ(a[size_t(r)], l[size_t(r * V + target[size_t(r)])] - logsumexp_row(l.data() + r * V, V));
}

}  // namespace
}  // namespace dsv4
