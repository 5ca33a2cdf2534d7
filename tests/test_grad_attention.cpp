// Backward of the sparse attention with sink (kernels/grad.h, MODEL.md §5.1) against central finite
// differences of an independent float64 forward (a dense masked softmax over all kv rows with the
// sink as one more column, no roundings), plus exact zeros, the documented dkv / dsink order, thread
// count and batch invariance, and the parameter check.
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <type_traits>
#include <vector>

#include "kernels/attention.h"
#include "kernels/grad.h"
#include "test_util.h"

namespace dsv4 {
namespace {

using test::bitwise_equal;
using test::rng_for;

// One attention problem with its upstream gradient dO. idx: random slots with about a quarter -1,
// and the shapes the backward must handle: token 0 has no valid slot, token 1 exactly one, token 2
// the same kv row in two slots, kv row 0 is in a slot of every token from 2 on, and the last two kv
// rows are in no slot.
struct Case {
  int64_t T, Dh, N, K;
  int H;
  float scale;
  std::vector<float> q, kv, sink, dO;
  std::vector<int32_t> idx;

  Case(const std::string& name, int64_t T_, int H_, int64_t Dh_, int64_t N_, int64_t K_)
      : T(T_), Dh(Dh_), N(N_), K(K_), H(H_), scale(1.0f / std::sqrt(float(Dh_))) {
    auto g = rng_for(name);
    q = test::randn_bf16(g, size_t(T * H * Dh));
    kv = test::randn_bf16(g, size_t(N * Dh));
    sink = test::randn_bf16(g, size_t(H));
    dO = test::randn_bf16(g, size_t(T * H * Dh));
    idx.resize(size_t(T * K));
    std::uniform_int_distribution<int32_t> pick(1, int32_t(N - 3));
    std::bernoulli_distribution hole(0.25);
    for (auto& v : idx) v = hole(g) ? -1 : pick(g);
    for (int64_t j = 0; j < K; ++j) idx[size_t(j)] = -1;
    if (T > 1)
      for (int64_t j = 0; j < K; ++j) idx[size_t(K + j)] = (j == K / 2) ? pick(g) : -1;
    if (T > 2 && K >= 3) idx[size_t(2 * K + 1)] = idx[size_t(2 * K + K - 1)] = 5;
    for (int64_t t = 2; t < T; ++t) idx[size_t(t * K + t % K)] = 0;
  }

  int64_t qsize() const { return T * H * Dh; }
};

// The forward in float64 without any rounding, from the definition: for each (t, h), every kv row n
// is a column with multiplicity m_n (how many slots of idx[t] hold n; 0 = masked), the sink one more
// column with no value: o = sum_n m_n e^(z_n) kv_n / (sum_n m_n e^(z_n) + e^sink). Returns
// L = sum dO · o; o and lse when asked.
struct Ref {
  const Case& c;
  explicit Ref(const Case& c_) : c(c_) {}

  double loss(const std::vector<double>& q, const std::vector<double>& kv, const std::vector<double>& sink,
              std::vector<double>* o_out = nullptr, std::vector<double>* lse_out = nullptr) const {
    double L = 0;
    std::vector<int> mult(size_t(c.N));
    std::vector<double> z(size_t(c.N)), o(size_t(c.Dh));
    for (int64_t t = 0; t < c.T; ++t) {
      std::fill(mult.begin(), mult.end(), 0);
      for (int64_t j = 0; j < c.K; ++j)
        if (c.idx[size_t(t * c.K + j)] >= 0) ++mult[size_t(c.idx[size_t(t * c.K + j)])];
      for (int h = 0; h < c.H; ++h) {
        const size_t qo = size_t((t * c.H + h) * c.Dh);
        double M = sink[size_t(h)];
        for (int64_t n = 0; n < c.N; ++n) {
          if (!mult[size_t(n)]) continue;
          double s = 0;
          for (int64_t d = 0; d < c.Dh; ++d) s += q[qo + size_t(d)] * kv[size_t(n * c.Dh + d)];
          z[size_t(n)] = double(c.scale) * s;
          M = std::max(M, z[size_t(n)]);
        }
        double Z = std::exp(sink[size_t(h)] - M);
        std::fill(o.begin(), o.end(), 0.0);
        for (int64_t n = 0; n < c.N; ++n) {
          if (!mult[size_t(n)]) continue;
          const double e = mult[size_t(n)] * std::exp(z[size_t(n)] - M);
          Z += e;
          for (int64_t d = 0; d < c.Dh; ++d) o[size_t(d)] += e * kv[size_t(n * c.Dh + d)];
        }
        for (int64_t d = 0; d < c.Dh; ++d) {
          o[size_t(d)] /= Z;
          L += double(c.dO[qo + size_t(d)]) * o[size_t(d)];
          if (o_out) (*o_out)[qo + size_t(d)] = o[size_t(d)];
        }
        if (lse_out) (*lse_out)[size_t(t * c.H + h)] = M + std::log(Z);
      }
    }
    return L;
  }

  // Central differences of L in every coordinate of q, kv and sink (step 1e-5: truncation ~1e-10,
  // cancellation ~1e-11 for these O(1) inputs, far below the tolerances).
  void fd(std::vector<double>& gq, std::vector<double>& gkv, std::vector<double>& gsink) const {
    std::vector<double> q(c.q.begin(), c.q.end()), kv(c.kv.begin(), c.kv.end()),
        sink(c.sink.begin(), c.sink.end());
    const double step = 1e-5;
    auto grad = [&](std::vector<double>& x, std::vector<double>& g) {
      g.assign(x.size(), 0.0);
      for (size_t i = 0; i < x.size(); ++i) {
        const double x0 = x[i];
        x[i] = x0 + step;
        const double lp = loss(q, kv, sink);
        x[i] = x0 - step;
        const double lm = loss(q, kv, sink);
        x[i] = x0;
        g[i] = (lp - lm) / (2 * step);
      }
    };
    grad(q, gq);
    grad(kv, gkv);
    grad(sink, gsink);
  }
};

struct Grads {
  std::vector<float> dq, dkv, dsink;
};

constexpr float kSinkInit = 0.375f;  // dsink accumulates: start from a nonzero value

Grads backward(const Case& c, const std::vector<float>& o, const std::vector<float>& lse,
               ReduceOrder order = {}) {
  Grads g;
  g.dq.assign(size_t(c.qsize()), std::nanf(""));  // overwritten everywhere
  g.dkv.assign(size_t(c.N * c.Dh), std::nanf(""));
  g.dsink.assign(size_t(c.H), kSinkInit);
  SparseAttnBwdParams p;
  p.T = c.T;
  p.H = c.H;
  p.Dh = c.Dh;
  p.N = c.N;
  p.K = c.K;
  p.q = c.q.data();
  p.kv = c.kv.data();
  p.idx = c.idx.data();
  p.sink = c.sink.data();
  p.scale = c.scale;
  p.o = o.data();
  p.lse = lse.data();
  p.dO = c.dO.data();
  p.order = order;
  p.dq = g.dq.data();
  p.dkv = g.dkv.data();
  p.dsink = g.dsink.data();
  EXPECT_EQ(sparse_attention_backward_check(p), nullptr);
  sparse_attention_backward(p);
  return g;
}

// The kernel's forward: o (bf16) and lse.
void forward(const Case& c, std::vector<float>& o, std::vector<float>& lse) {
  o.assign(size_t(c.qsize()), 0.0f);
  lse.assign(size_t(c.T * c.H), 0.0f);
  SparseAttnParams p;
  p.T = c.T;
  p.H = c.H;
  p.Dh = c.Dh;
  p.N = c.N;
  p.K = c.K;
  p.q = c.q.data();
  p.kv = c.kv.data();
  p.idx = c.idx.data();
  p.sink = c.sink.data();
  p.scale = c.scale;
  p.o = o.data();
  p.lse = lse.data();
  ASSERT_EQ(sparse_attention_check(p), nullptr);
  sparse_attention(p);
}

// |got - want| <= max_rel * max|want| for every element, and the rms error <= rms_rel * rms(want).
template <typename F>
void expect_grad_close(const std::string& what, const std::vector<F>& got, const std::vector<double>& want,
                       double max_rel, double rms_rel) {
  ASSERT_EQ(got.size(), want.size()) << what;
  double mx = 0, ss = 0, es = 0, worst = 0;
  size_t at = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    mx = std::max(mx, std::abs(want[i]));
    ss += want[i] * want[i];
  }
  ASSERT_GT(mx, 0.0) << what << ": the reference gradient is all zero";
  for (size_t i = 0; i < want.size(); ++i) {
    ASSERT_TRUE(std::isfinite(got[i])) << what << "[" << i << "] = " << got[i];
    const double e = std::abs(double(got[i]) - want[i]);
    es += e * e;
    if (e > worst) worst = e, at = i;
  }
  EXPECT_LE(worst, max_rel * mx) << what << ": worst at " << at << ": got " << got[at] << ", want "
                                 << want[at] << " (max |want| " << mx << ")";
  EXPECT_LE(std::sqrt(es), rms_rel * std::sqrt(ss)) << what << ": rms error";
}

void expect_structure(const Case& c, const Grads& g) {
  for (int h = 0; h < c.H; ++h)  // token 0 has no valid slot
    for (int64_t d = 0; d < c.Dh; ++d) EXPECT_EQ(g.dq[size_t(h * c.Dh + d)], 0.0f);
  for (int64_t n = c.N - 2; n < c.N; ++n)  // rows no slot points to
    for (int64_t d = 0; d < c.Dh; ++d) EXPECT_EQ(g.dkv[size_t(n * c.Dh + d)], 0.0f) << "row " << n;
}

std::vector<double> sink_delta(const Grads& g) {
  std::vector<double> v;
  for (float s : g.dsink) v.push_back(double(s) - double(kSinkInit));
  return v;
}

// Fed with o and lse of the float64 forward (rounded to fp32), the backward differs from the finite
// differences by fp32 rounding only: products and sums of a few dozen O(1) terms, relative error
// a few 1e-7 of the largest gradient (measured <= 3.5e-7); bounds 5e-6 of the largest element, 2e-6
// rms. Rounding P to bf16 (as the forward's P·V does) would already miss them by 500x.
TEST(SparseAttentionBackward, MatchesFiniteDifferencesOfFloat64Forward) {
  struct Shape {
    int64_t T;
    int H;
    int64_t Dh, N, K;
  };
  for (const Shape s :
       {Shape{7, 1, 24, 17, 9}, Shape{9, 3, 40, 23, 12}, Shape{6, 5, 13, 11, 5}, Shape{8, 5, 40, 30, 16}}) {
    const std::string name =
        "SABwd.fd." + std::to_string(s.T) + "." + std::to_string(s.H) + "." + std::to_string(s.Dh);
    SCOPED_TRACE(name);
    const Case c(name, s.T, s.H, s.Dh, s.N, s.K);
    const Ref ref(c);
    std::vector<double> o64(size_t(c.qsize())), lse64(size_t(c.T * c.H));
    std::vector<double> q(c.q.begin(), c.q.end()), kv(c.kv.begin(), c.kv.end()),
        sink(c.sink.begin(), c.sink.end());
    ref.loss(q, kv, sink, &o64, &lse64);
    const std::vector<float> o(o64.begin(), o64.end()), lse(lse64.begin(), lse64.end());
    std::vector<double> gq, gkv, gsink;
    ref.fd(gq, gkv, gsink);

    const Grads g = backward(c, o, lse);
    expect_grad_close("dq", g.dq, gq, 5e-6, 2e-6);
    expect_grad_close("dkv", g.dkv, gkv, 5e-6, 2e-6);
    expect_grad_close("dsink", sink_delta(g), gsink, 5e-6, 2e-6);
    expect_structure(c, g);
  }
}

// The training path: o is the kernel's bf16 output, so Δ = dot(o, dO) carries o's rounding (2^-9
// relative per element, and the forward's bf16 P before P·V adds as much): 1e-3 .. 3e-3 of the
// gradient's scale against the unrounded reference. Bounds: 1.5e-2 of the largest element, 5e-3 rms.
TEST(SparseAttentionBackward, WithTheKernelsForwardMatchesFiniteDifferences) {
  for (int H : {1, 3, 5}) {
    const std::string name = "SABwd.kernel_fwd." + std::to_string(H);
    SCOPED_TRACE(name);
    const Case c(name, 9, H, 40, 21, 11);
    std::vector<float> o, lse;
    forward(c, o, lse);
    std::vector<double> gq, gkv, gsink;
    Ref(c).fd(gq, gkv, gsink);
    const Grads g = backward(c, o, lse);
    expect_grad_close("dq", g.dq, gq, 1e-2, 8e-3);
    expect_grad_close("dkv", g.dkv, gkv, 1e-2, 8e-3);
    expect_grad_close("dsink", sink_delta(g), gsink, 1e-2, 8e-3);
    expect_structure(c, g);
  }
}

// dkv and dsink in the order kernels/grad.h documents, recomputed here in fp32 from the contract's
// formulas (slots t increasing then j, heads inside; the sink's sum over t): bit for bit.
TEST(SparseAttentionBackward, DkvAndDsinkFollowTheDocumentedOrder) {
  const Case c("SABwd.order", 11, 3, 24, 15, 10);
  std::vector<float> o, lse;
  forward(c, o, lse);
  const ReduceOrder order{};
  const Grads g = backward(c, o, lse, order);
  std::vector<float> dkv(size_t(c.N * c.Dh), 0.0f), S(size_t(c.H), 0.0f);
  for (int64_t t = 0; t < c.T; ++t) {
    std::vector<float> delta(size_t(c.H));
    for (int h = 0; h < c.H; ++h) {
      const size_t r = size_t((t * c.H + h) * c.Dh);
      delta[size_t(h)] = dot(o.data() + r, c.dO.data() + r, c.Dh, order);
      S[size_t(h)] =
          S[size_t(h)] + delta[size_t(h)] * num::exp_f(c.sink[size_t(h)] - lse[size_t(t * c.H + h)]);
    }
    for (int64_t j = 0; j < c.K; ++j) {
      const int32_t n = c.idx[size_t(t * c.K + j)];
      if (n < 0) continue;
      const float* kvn = c.kv.data() + n * c.Dh;
      for (int h = 0; h < c.H; ++h) {
        const size_t r = size_t((t * c.H + h) * c.Dh);
        const float P =
            num::exp_f(c.scale * dot(c.q.data() + r, kvn, c.Dh, order) - lse[size_t(t * c.H + h)]);
        const float dz = P * (dot(c.dO.data() + r, kvn, c.Dh, order) - delta[size_t(h)]);
        for (int64_t d = 0; d < c.Dh; ++d)
          dkv[size_t(n * c.Dh + d)] =
              dkv[size_t(n * c.Dh + d)] + ((c.scale * dz) * c.q[r + size_t(d)] + P * c.dO[r + size_t(d)]);
      }
    }
  }
  EXPECT_TRUE(bitwise_equal(g.dkv, dkv));
  std::vector<float> dsink(size_t(c.H));
  for (int h = 0; h < c.H; ++h) dsink[size_t(h)] = kSinkInit - S[size_t(h)];
  EXPECT_TRUE(bitwise_equal(g.dsink, dsink));
  EXPECT_FALSE(test::all_zero(g.dkv));
}

// Parallel over (t, h) rows and over kv rows: 1 and 3 threads give the same bits, in both reduce
// orders; a token's dq does not depend on the other tokens of the batch.
TEST(SparseAttentionBackward, ThreadCountAndBatchInvariant) {
  const Case c("SABwd.threads", 64, 5, 40, 97, 24);
  std::vector<float> o, lse;
  forward(c, o, lse);
  for (const ReduceOrder order : {ReduceOrder{0}, ReduceOrder{16}}) {
    omp_set_num_threads(1);
    const Grads one = backward(c, o, lse, order);
    omp_set_num_threads(3);
    const Grads three = backward(c, o, lse, order);
    EXPECT_TRUE(bitwise_equal(one.dq, three.dq));
    EXPECT_TRUE(bitwise_equal(one.dkv, three.dkv));
    EXPECT_TRUE(bitwise_equal(one.dsink, three.dsink));
    EXPECT_FALSE(test::all_zero(one.dkv));

    for (int64_t t : {int64_t(1), int64_t(2), int64_t(37)}) {  // one valid slot, a repeated row, a random row
      Case alone = c;
      alone.T = 1;
      auto take = [&](const auto& v, int64_t w) {
        return std::remove_cvref_t<decltype(v)>(v.begin() + t * w, v.begin() + (t + 1) * w);
      };
      alone.q = take(c.q, c.H * c.Dh);
      alone.dO = take(c.dO, c.H * c.Dh);
      alone.idx = take(c.idx, c.K);
      const Grads a = backward(alone, take(o, c.H * c.Dh), take(lse, int64_t(c.H)), order);
      EXPECT_TRUE(bitwise_equal(a.dq, take(one.dq, c.H * c.Dh))) << "token " << t;
    }
  }
  omp_set_num_threads(1);
}

// T == 0 still zeroes dkv; dsink is optional.
TEST(SparseAttentionBackward, NoTokensZeroDkvAndNullDsink) {
  std::vector<float> dkv(12, 5.0f);
  SparseAttnBwdParams p;
  p.T = 0;
  p.H = 2;
  p.Dh = 4;
  p.N = 3;
  p.K = 2;
  p.dkv = dkv.data();
  ASSERT_EQ(sparse_attention_backward_check(p), nullptr);
  sparse_attention_backward(p);
  EXPECT_TRUE(test::all_zero(dkv));

  const Case c("SABwd.nosink", 5, 3, 24, 9, 4);
  std::vector<float> o, lse;
  forward(c, o, lse);
  const Grads with = backward(c, o, lse);
  std::vector<float> dq(size_t(c.qsize())), dkv2(size_t(c.N * c.Dh));
  SparseAttnBwdParams q;
  q.T = c.T;
  q.H = c.H;
  q.Dh = c.Dh;
  q.N = c.N;
  q.K = c.K;
  q.q = c.q.data();
  q.kv = c.kv.data();
  q.idx = c.idx.data();
  q.sink = c.sink.data();
  q.scale = c.scale;
  q.o = o.data();
  q.lse = lse.data();
  q.dO = c.dO.data();
  q.dq = dq.data();
  q.dkv = dkv2.data();
  ASSERT_EQ(sparse_attention_backward_check(q), nullptr);
  sparse_attention_backward(q);
  EXPECT_TRUE(bitwise_equal(dq, with.dq));
  EXPECT_TRUE(bitwise_equal(dkv2, with.dkv));
}

TEST(SparseAttentionBackward, CheckNamesTheBadField) {
  const Case c("SABwd.check", 3, 2, 8, 6, 4);
  std::vector<float> o(size_t(c.qsize())), lse(size_t(c.T * c.H)), dq(o.size()), dkv(size_t(c.N * c.Dh)),
      ds(2);
  SparseAttnBwdParams p;
  p.T = c.T;
  p.H = c.H;
  p.Dh = c.Dh;
  p.N = c.N;
  p.K = c.K;
  p.q = c.q.data();
  p.kv = c.kv.data();
  p.idx = c.idx.data();
  p.sink = c.sink.data();
  p.scale = c.scale;
  p.o = o.data();
  p.lse = lse.data();
  p.dO = c.dO.data();
  p.dq = dq.data();
  p.dkv = dkv.data();
  p.dsink = ds.data();
  ASSERT_EQ(sparse_attention_backward_check(p), nullptr);
  auto expect_mentions = [](const SparseAttnBwdParams& bad, const char* word) {
    const char* why = sparse_attention_backward_check(bad);
    ASSERT_NE(why, nullptr) << word;
    EXPECT_NE(std::string(why).find(word), std::string::npos) << why;
  };
  SparseAttnBwdParams bad = p;
  bad.lse = nullptr;
  expect_mentions(bad, "lse");
  bad = p;
  bad.dkv = nullptr;
  expect_mentions(bad, "dkv");
  bad = p;
  bad.H = 0;
  expect_mentions(bad, "H");
  bad = p;
  bad.order.block = 12;
  expect_mentions(bad, "order");
  std::vector<int32_t> idx = c.idx;
  idx[5] = int32_t(c.N);
  bad = p;
  bad.idx = idx.data();
  expect_mentions(bad, "idx");
  idx[5] = -2;
  expect_mentions(bad, "idx");
}

}  // namespace
}  // namespace dsv4
