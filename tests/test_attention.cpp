// Sparse attention with sink (kernels/attention.h, MODEL.md §3.8) against a dense masked softmax in
// double with the sink as one extra logit, plus edge cases and thread-count invariance.
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "kernels/attention.h"
#include "test_util.h"

namespace dsv4 {
namespace {

using test::bitwise_equal;
using test::rng_for;

struct AttnCase {
  int64_t T, Dh, N, K;
  int H;
  std::vector<float> q, kv, sink;
  std::vector<int32_t> idx;
  AttnCase(const std::string& name, int64_t T_, int H_, int64_t Dh_, int64_t N_, int64_t K_, double p_empty)
      : T(T_), Dh(Dh_), N(N_), K(K_), H(H_) {
    auto g = rng_for(name);
    q = test::randn_bf16(g, size_t(T * H * Dh));
    kv = test::randn_bf16(g, size_t(N * Dh));
    sink = test::randn_bf16(g, size_t(H), 2.0f);
    idx.resize(size_t(T * K));
    std::uniform_int_distribution<int32_t> pick(0, int32_t(N - 1));
    std::bernoulli_distribution empty(p_empty);
    for (auto& v : idx) v = empty(g) ? -1 : pick(g);
  }
  SparseAttnParams params(float* o, float* lse) const {
    SparseAttnParams p;
    p.T = T;
    p.H = H;
    p.Dh = Dh;
    p.N = N;
    p.K = K;
    p.q = q.data();
    p.kv = kv.data();
    p.idx = idx.data();
    p.sink = sink.data();
    p.scale = 1.0f / std::sqrt(float(Dh));
    p.o = o;
    p.lse = lse;
    return p;
  }
  int online_block = 0;  // SparseAttnParams::online_block
  void run(std::vector<float>& o, std::vector<float>& lse) const {
    o.assign(size_t(T * H * Dh), 777.0f);
    lse.assign(size_t(T * H), 777.0f);
    auto p = params(o.data(), lse.data());
    p.online_block = online_block;
    ASSERT_EQ(sparse_attention_check(p), nullptr);
    sparse_attention(p);
  }
};

// Dense reference: every kv row is a column; columns not listed in idx[t] (counting multiplicity)
// are masked out; the sink is one more logit with no value.
void expect_matches_dense(const AttnCase& c, const std::vector<float>& o, const std::vector<float>& lse) {
  const double scale = double(1.0f / std::sqrt(float(c.Dh)));
  for (int64_t t = 0; t < c.T; ++t) {
    std::vector<int> mult(size_t(c.N), 0);
    for (int64_t j = 0; j < c.K; ++j)
      if (c.idx[size_t(t * c.K + j)] >= 0) ++mult[size_t(c.idx[size_t(t * c.K + j)])];
    for (int h = 0; h < c.H; ++h) {
      const float* q = c.q.data() + (t * c.H + h) * c.Dh;
      std::vector<double> logit(size_t(c.N));
      double mx = c.sink[size_t(h)];
      for (int64_t n = 0; n < c.N; ++n) {
        double s = 0;
        for (int64_t d = 0; d < c.Dh; ++d) s += double(q[d]) * c.kv[size_t(n * c.Dh + d)];
        logit[size_t(n)] = s * scale;
        if (mult[size_t(n)]) mx = std::max(mx, logit[size_t(n)]);
      }
      double z = std::exp(c.sink[size_t(h)] - mx);
      for (int64_t n = 0; n < c.N; ++n) z += mult[size_t(n)] * std::exp(logit[size_t(n)] - mx);
      const double want_lse = mx + std::log(z);
      EXPECT_NEAR(lse[size_t(t * c.H + h)], want_lse, 2e-5 * (1 + std::abs(want_lse)))
          << "t=" << t << " h=" << h;
      for (int64_t d = 0; d < c.Dh; ++d) {
        double want = 0, mag = 0;
        for (int64_t n = 0; n < c.N; ++n) {
          if (!mult[size_t(n)]) continue;
          const double p = mult[size_t(n)] * std::exp(logit[size_t(n)] - mx) / z;
          want += p * c.kv[size_t(n * c.Dh + d)];
          mag += p * std::abs(c.kv[size_t(n * c.Dh + d)]);
        }
        const float got = o[size_t((t * c.H + h) * c.Dh + d)];
        // bf16 probabilities (2^-9 relative each) and a bf16 output (2^-9 of the value).
        EXPECT_NEAR(got, want, std::ldexp(mag, -8) + std::ldexp(std::abs(want), -8) + 1e-6)
            << "t=" << t << " h=" << h << " d=" << d;
        ASSERT_EQ(got, num::bf16_round(got));
      }
    }
  }
}

TEST(SparseAttention, MatchesDenseMaskedSoftmaxWithSink) {
  for (int H : {1, 3, 5, 6})
    for (int64_t Dh : {64, 192, 256}) {
      const AttnCase c("Attn.Dense." + std::to_string(H) + "." + std::to_string(Dh), 17, H, Dh, 40, 13, 0.3);
      std::vector<float> o, lse;
      c.run(o, lse);
      EXPECT_FALSE(test::all_zero(o));
      expect_matches_dense(c, o, lse);
    }
}

TEST(SparseAttention, EmptyRowGivesZeroAndSinkExactly) {
  AttnCase c("Attn.Empty", 7, 5, 64, 9, 6, 0.2);
  for (int64_t j = 0; j < c.K; ++j) c.idx[size_t(2 * c.K + j)] = -1;  // row 2 empty
  for (int64_t j = 0; j < c.K; ++j) c.idx[size_t(4 * c.K + j)] = -1;  // row 4 empty
  std::vector<float> o, lse;
  c.run(o, lse);
  for (int64_t t : {2, 4})
    for (int h = 0; h < c.H; ++h) {
      EXPECT_EQ(num::f32_bits(lse[size_t(t * c.H + h)]), num::f32_bits(c.sink[size_t(h)]));
      for (int64_t d = 0; d < c.Dh; ++d) EXPECT_EQ(num::f32_bits(o[size_t((t * c.H + h) * c.Dh + d)]), 0u);
    }
  expect_matches_dense(c, o, lse);
  // K = 0: every row is empty.
  AttnCase z("Attn.K0", 3, 2, 64, 4, 0, 0.0);
  z.run(o, lse);
  EXPECT_TRUE(test::all_zero(o));
  for (int64_t t = 0; t < 3; ++t)
    for (int h = 0; h < 2; ++h) EXPECT_EQ(lse[size_t(t * 2 + h)], z.sink[size_t(h)]);
}

TEST(SparseAttention, OneValidKey) {
  AttnCase c("Attn.One", 5, 3, 192, 6, 7, 0.0);
  for (int64_t t = 0; t < c.T; ++t)
    for (int64_t j = 0; j < c.K; ++j) c.idx[size_t(t * c.K + j)] = j == (t % c.K) ? int32_t(t) : -1;
  std::vector<float> o, lse;
  c.run(o, lse);
  expect_matches_dense(c, o, lse);
}

TEST(SparseAttention, SlotOrderOnlyAffectsRounding) {
  const AttnCase c("Attn.Perm", 9, 3, 256, 30, 24, 0.25);
  std::vector<float> o, lse;
  c.run(o, lse);
  auto g = rng_for("Attn.Perm.shuffle");
  // Moving -1 slots around without reordering the valid ones leaves the bits unchanged.
  AttnCase moved = c;
  for (int64_t t = 0; t < c.T; ++t) {
    std::vector<int32_t> valid;
    for (int64_t j = 0; j < c.K; ++j)
      if (c.idx[size_t(t * c.K + j)] >= 0) valid.push_back(c.idx[size_t(t * c.K + j)]);
    std::vector<int32_t> row(size_t(c.K), -1);
    std::vector<int64_t> slots(size_t(c.K));
    for (int64_t j = 0; j < c.K; ++j) slots[size_t(j)] = j;
    std::shuffle(slots.begin(), slots.end(), g);
    slots.resize(valid.size());
    std::sort(slots.begin(), slots.end());
    for (size_t v = 0; v < valid.size(); ++v) row[size_t(slots[v])] = valid[v];
    std::copy(row.begin(), row.end(), moved.idx.begin() + t * c.K);
  }
  std::vector<float> o2, lse2;
  moved.run(o2, lse2);
  EXPECT_TRUE(bitwise_equal(o, o2));
  EXPECT_TRUE(bitwise_equal(lse, lse2));
  // A full permutation of the slots: same result up to rounding.
  AttnCase perm = c;
  for (int64_t t = 0; t < c.T; ++t)
    std::shuffle(perm.idx.begin() + t * c.K, perm.idx.begin() + (t + 1) * c.K, g);
  perm.run(o2, lse2);
  expect_matches_dense(perm, o2, lse2);
  for (size_t i = 0; i < lse.size(); ++i) EXPECT_NEAR(lse2[i], lse[i], 1e-5 * (1 + std::abs(lse[i])));
}

TEST(SparseAttention, CheckRejectsOutOfRangeIndices) {
  AttnCase c("Attn.Check", 4, 2, 64, 10, 5, 0.2);
  std::vector<float> o(size_t(4 * 2 * 64)), lse(8);
  EXPECT_EQ(sparse_attention_check(c.params(o.data(), lse.data())), nullptr);
  for (int32_t bad : {10, 11, -2, std::numeric_limits<int32_t>::min()}) {
    AttnCase b = c;
    b.idx[7] = bad;
    EXPECT_STREQ(sparse_attention_check(b.params(o.data(), lse.data())), "idx") << bad;
  }
  auto p = c.params(o.data(), lse.data());
  p.H = 0;
  EXPECT_STREQ(sparse_attention_check(p), "H");
  p = c.params(o.data(), nullptr);
  EXPECT_EQ(sparse_attention_check(p), nullptr);  // lse is optional
  p.sink = nullptr;
  EXPECT_STREQ(sparse_attention_check(p), "sink");
}

TEST(SparseAttention, ThreadCountInvariance) {
  for (int H : {1, 5, 61}) {
    const AttnCase c("Attn.Threads." + std::to_string(H), 43, H, 64, 60, 33, 0.3);
    std::vector<float> o1, l1, o, l;
    omp_set_num_threads(1);
    c.run(o1, l1);
    for (int threads : {2, 3}) {
      omp_set_num_threads(threads);
      c.run(o, l);
      EXPECT_TRUE(bitwise_equal(o1, o)) << threads << " threads, H=" << H;
      EXPECT_TRUE(bitwise_equal(l1, l)) << threads << " threads, H=" << H;
    }
    omp_set_num_threads(omp_get_num_procs());
  }
}

TEST(SparseAttention, LseIsOptionalAndDoesNotChangeO) {
  const AttnCase c("Attn.NoLse", 5, 3, 64, 12, 8, 0.3);
  std::vector<float> o, lse;
  c.run(o, lse);
  std::vector<float> o2(o.size(), 0.0f);
  sparse_attention(c.params(o2.data(), nullptr));
  EXPECT_TRUE(bitwise_equal(o, o2));
}

// ---- the online order (SparseAttnParams::online_block: a flash kernel's softmax in blocks) ----

// The documented recurrence, written as a single pass over the raw idx row (no compaction): a block
// closes after every B valid slots; each block's max, alpha, p, l and the output accumulators follow
// kernels/attention.h. exp_f / log_f are the runtime's (they are the definition); the scores use the
// canonical dot.
void online_reference(const AttnCase& c, int B, std::vector<float>& o, std::vector<float>& lse) {
  o.assign(size_t(c.T * c.H * c.Dh), 0.0f);
  lse.assign(size_t(c.T * c.H), 0.0f);
  const float scale = 1.0f / std::sqrt(float(c.Dh));
  for (int64_t t = 0; t < c.T; ++t)
    for (int h = 0; h < c.H; ++h) {
      const float* q = c.q.data() + (t * c.H + h) * c.Dh;
      std::vector<int32_t> rows;  // the valid slots' kv rows, slot order
      for (int64_t j = 0; j < c.K; ++j)
        if (c.idx[size_t(t * c.K + j)] >= 0) rows.push_back(c.idx[size_t(t * c.K + j)]);
      float* out = o.data() + (t * c.H + h) * c.Dh;
      if (rows.empty()) {
        lse[size_t(t * c.H + h)] = c.sink[size_t(h)];
        continue;
      }
      float m = -std::numeric_limits<float>::infinity(), l = 0.0f;
      std::vector<float> acc(size_t(c.Dh), 0.0f);
      for (size_t b0 = 0; b0 < rows.size(); b0 += size_t(B)) {
        const size_t b1 = std::min(rows.size(), b0 + size_t(B));
        std::vector<float> z;
        for (size_t v = b0; v < b1; ++v) z.push_back(scale * dot(q, c.kv.data() + int64_t(rows[v]) * c.Dh, c.Dh, {}));
        float mb = -std::numeric_limits<float>::infinity();
        for (float x : z) mb = x > mb ? x : mb;
        const float mn = std::max(m, mb);
        const float alpha = num::exp_f(m - mn);
        float sum = 0.0f;
        for (float& d : acc) d = d * alpha;
        for (size_t v = b0; v < b1; ++v) {
          const float pv = num::exp_f(z[v - b0] - mn);
          sum = sum + pv;
          const float P = test::bf16_ref(pv);
          for (int64_t d = 0; d < c.Dh; ++d)
            acc[size_t(d)] = std::fma(P, c.kv[size_t(int64_t(rows[v]) * c.Dh + d)], acc[size_t(d)]);
        }
        l = l * alpha + sum;
        m = mn;
      }
      l = l + num::exp_f(c.sink[size_t(h)] - m);
      for (int64_t d = 0; d < c.Dh; ++d) out[d] = test::bf16_ref(acc[size_t(d)] / l);
      lse[size_t(t * c.H + h)] = m + num::log_f(l);
    }
}

TEST(SparseAttentionOnline, FollowsTheDocumentedRecurrence) {
  for (int B : {1, 3, 8, 64, 1000})
    for (int H : {1, 3, 7}) {
      AttnCase c("Attn.Online." + std::to_string(B) + "." + std::to_string(H), 11, H, 64, 90, 70, 0.2);
      c.online_block = B;
      std::vector<float> o, lse, wo, wl;
      c.run(o, lse);
      online_reference(c, B, wo, wl);
      ASSERT_TRUE(bitwise_equal(o, wo)) << "B " << B << " H " << H;
      ASSERT_TRUE(bitwise_equal(lse, wl)) << "B " << B << " H " << H;
    }
}

TEST(SparseAttentionOnline, MatchesDenseMaskedSoftmaxWithSink) {
  for (int B : {1, 16, 64})
    for (int64_t Dh : {64, 256}) {
      AttnCase c("Attn.OnlineDense." + std::to_string(B) + "." + std::to_string(Dh), 13, 4, Dh, 120, 100, 0.3);
      c.online_block = B;
      std::vector<float> o, lse;
      c.run(o, lse);
      expect_matches_dense(c, o, lse);
    }
}

// Blocks are taken over the valid slots: moving -1 padding leaves the bits unchanged (a decode row
// equals the prefill row); the result differs from the two-pass order by rounding only; empty rows
// give o = 0 and lse = sink; the thread count changes nothing.
TEST(SparseAttentionOnline, PaddingEmptyRowsAndThreads) {
  AttnCase c("Attn.OnlinePad", 9, 3, 128, 80, 72, 0.3);
  c.online_block = 16;
  for (int64_t j = 0; j < c.K; ++j) c.idx[size_t(4 * c.K + j)] = -1;  // row 4 empty
  std::vector<float> o, lse;
  c.run(o, lse);
  for (int h = 0; h < c.H; ++h) {
    EXPECT_EQ(num::f32_bits(lse[size_t(4 * c.H + h)]), num::f32_bits(c.sink[size_t(h)]));
    for (int64_t d = 0; d < c.Dh; ++d) EXPECT_EQ(num::f32_bits(o[size_t((4 * c.H + h) * c.Dh + d)]), 0u);
  }
  AttnCase moved = c;
  for (int64_t t = 0; t < c.T; ++t) {  // valid slots first, then the padding
    auto first = moved.idx.begin() + t * c.K;
    std::stable_partition(first, first + c.K, [](int32_t v) { return v >= 0; });
  }
  std::vector<float> o2, lse2;
  moved.run(o2, lse2);
  EXPECT_TRUE(bitwise_equal(o, o2));
  EXPECT_TRUE(bitwise_equal(lse, lse2));
  AttnCase two_pass = c;
  two_pass.online_block = 0;
  two_pass.run(o2, lse2);
  EXPECT_FALSE(bitwise_equal(o, o2)) << "the online order changed no bit: the site would not be seen";
  omp_set_num_threads(1);
  c.run(o2, lse2);
  omp_set_num_threads(omp_get_num_procs());
  EXPECT_TRUE(bitwise_equal(o, o2));
  EXPECT_TRUE(bitwise_equal(lse, lse2));
  auto p = c.params(o.data(), lse.data());
  p.online_block = -1;
  EXPECT_STREQ(sparse_attention_check(p), "online_block");
}

}  // namespace
}  // namespace dsv4
