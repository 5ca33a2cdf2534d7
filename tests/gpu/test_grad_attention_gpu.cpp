// The CUDA backward of the sparse attention and of the compressor pooling (kernels/cuda/grad.h)
// against the CPU reference (kernels/grad.h), bitwise, on guarded device buffers: odd head dims,
// 1 to 16 heads (head tiles that do not divide H), holes, empty rows, a kv row in many slots (also
// twice in one row), kv rows no slot reads, enough slots for every stage of the inverse map's sort,
// both reduce orders; the compressor's ratios 4 / 8 / 128 with chunks starting at g0 > 0, incomplete
// tails, odd d, dape / dnorm accumulated or not formed. Accumulated outputs start from a nonzero value,
// overwritten ones from a NaN pattern. The parameter checks run without a device.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "gpu_test_util.h"
#include "kernels/attention.h"
#include "kernels/cuda/grad.h"
#include "kernels/grad.h"
#include "kernels/rope.h"
#include "test_util.h"

namespace dsv4 {
namespace {

using test::DeviceBuffers;
using test::same_floats;

std::string order_name(ReduceOrder o) {
  return o.block ? "block=" + std::to_string(o.block) : "chain";
}

// ---- sparse attention ---------------------------------------------------------------------------

struct AttnShape {
  int64_t T;
  int H;
  int64_t Dh, N, K;
  ReduceOrder order;
  bool dsink = true;
};

std::string attn_name(const AttnShape& s) {
  return "ATTN_BWD(T=" + std::to_string(s.T) + ",H=" + std::to_string(s.H) + ",Dh=" + std::to_string(s.Dh) +
         ",N=" + std::to_string(s.N) + ",K=" + std::to_string(s.K) + "," + order_name(s.order) +
         (s.dsink ? "" : ",no-dsink") + ")";
}

// idx: about a quarter holes; token 0 empty, token 1 one valid slot; token 2 the same kv row in two
// slots; kv row 0 in one slot of every token from 2 on and kv row 1 in every third slot of the tokens
// from 3 on (a row with many slots); the last two kv rows in no slot. N == 0: all holes.
std::vector<int32_t> make_idx(std::mt19937_64& g, int64_t T, int64_t N, int64_t K) {
  std::vector<int32_t> idx(size_t(T * K), -1);
  if (N == 0 || T == 0) return idx;
  const int32_t hi = int32_t(N > 3 ? N - 3 : N - 1);
  std::uniform_int_distribution<int32_t> pick(0, hi);
  std::bernoulli_distribution hole(0.25);
  for (auto& v : idx) v = hole(g) ? -1 : pick(g);
  for (int64_t j = 0; j < K; ++j) idx[size_t(j)] = -1;
  if (T > 1)
    for (int64_t j = 0; j < K; ++j) idx[size_t(K + j)] = (j == K / 2) ? pick(g) : -1;
  if (T > 2 && K >= 3) idx[size_t(2 * K + 1)] = idx[size_t(2 * K + K - 1)] = pick(g);
  for (int64_t t = 2; t < T && K > 0; ++t) idx[size_t(t * K + t % K)] = 0;
  if (N > 1)
    for (int64_t t = 3; t < T; ++t)
      for (int64_t j = 1; j < K; j += 3) idx[size_t(t * K + j)] = 1;
  return idx;
}

void attention_case(const AttnShape& s) {
  const std::string name = attn_name(s);
  SCOPED_TRACE(name);
  auto g = test::rng_for(name);
  const auto q = test::randn_bf16(g, size_t(s.T * s.H * s.Dh)), kv = test::randn_bf16(g, size_t(s.N * s.Dh)),
             sink = test::randn_bf16(g, size_t(s.H)), dO = test::randn_bf16(g, size_t(s.T * s.H * s.Dh));
  const auto idx = make_idx(g, s.T, s.N, s.K);
  const float scale = 1.0f / std::sqrt(float(s.Dh));

  // the forward's o (bf16) and lse
  std::vector<float> o(q.size()), lse(size_t(s.T * s.H));
  {
    SparseAttnParams f;
    f.T = s.T, f.H = s.H, f.Dh = s.Dh, f.N = s.N, f.K = s.K, f.scale = scale, f.order = s.order;
    f.q = q.data(), f.kv = s.N ? kv.data() : nullptr, f.idx = idx.data(), f.sink = sink.data();
    f.o = o.data(), f.lse = lse.data();
    ASSERT_EQ(sparse_attention_check(f), nullptr);
    sparse_attention(f);
  }

  const float fv = test::fill_value(), sink0 = 0.375f;
  std::vector<float> dq(q.size(), fv), dkv(kv.size(), fv), dsink(size_t(s.H), sink0);
  SparseAttnBwdParams p;
  p.T = s.T, p.H = s.H, p.Dh = s.Dh, p.N = s.N, p.K = s.K, p.scale = scale, p.order = s.order;
  p.q = q.data(), p.kv = s.N ? kv.data() : nullptr, p.idx = idx.data(), p.sink = sink.data();
  p.o = o.data(), p.lse = lse.data(), p.dO = dO.data();
  p.dq = dq.data(), p.dkv = s.N ? dkv.data() : nullptr, p.dsink = s.dsink ? dsink.data() : nullptr;
  ASSERT_EQ(sparse_attention_backward_check(p), nullptr);
  sparse_attention_backward(p);

  DeviceBuffers d;
  p.q = d.upload(q, "q"), p.kv = s.N ? d.upload(kv, "kv") : nullptr, p.idx = d.upload(idx, "idx");
  p.sink = d.upload(sink, "sink"), p.o = d.upload(o, "o"), p.lse = d.upload(lse, "lse");
  p.dO = d.upload(dO, "dO");
  p.dq = d.upload(std::vector<float>(dq.size(), fv), "dq");
  p.dkv = s.N ? d.upload(std::vector<float>(dkv.size(), fv), "dkv") : nullptr;
  float* gsink = d.upload(std::vector<float>(size_t(s.H), sink0), "dsink");
  p.dsink = s.dsink ? gsink : nullptr;
  cuda::sparse_attention_backward(p, nullptr);
  ASSERT_TRUE(d.guards_intact());
  const auto gdq = d.download(p.dq, dq.size());
  EXPECT_TRUE(same_floats(dq, gdq, "dq"));
  if (s.N) {
    const auto gdkv = d.download(p.dkv, dkv.size());
    EXPECT_TRUE(same_floats(dkv, gdkv, "dkv"));
    if (s.T > 2 && s.K > 0) {
      EXPECT_FALSE(test::all_zero(gdkv));
    }
  }
  EXPECT_TRUE(same_floats(dsink, d.download(gsink, dsink.size()), "dsink"));
  if (s.T > 1 && s.K > 0 && s.N > 0) {
    EXPECT_FALSE(test::all_zero(gdq));
  }
}

TEST(GradAttentionGpu, SmallOddShapesMatchCpuBitwise) {
  DSV4_REQUIRE_CUDA_DEVICE();
  for (const ReduceOrder o : {ReduceOrder{0}, ReduceOrder{16}}) {
    attention_case({9, 1, 7, 12, 5, o});
    attention_case({9, 3, 33, 20, 11, o});
    attention_case({17, 5, 129, 40, 24, o});
    attention_case({6, 11, 65, 9, 13, o});  // head tiles of 8 and 3, 9 kv rows in many slots
    attention_case({9, 3, 33, 20, 11, o, /*dsink=*/false});
  }
  attention_case({17, 5, 129, 40, 24, ReduceOrder{64}});
}

// Enough slots for the sort's global steps (16384 and 131072 keys) and a kv row in thousands of slots.
TEST(GradAttentionGpu, ManySlotsMatchCpuBitwise) {
  DSV4_REQUIRE_CUDA_DEVICE();
  attention_case({70, 3, 40, 90, 200, ReduceOrder{}});
  attention_case({300, 2, 16, 310, 300, ReduceOrder{}});
  attention_case({70, 3, 40, 90, 200, ReduceOrder{16}});
}

// Flash-like: head dim 512, 16 heads, a 640-slot index.
TEST(GradAttentionGpu, FlashLikeMatchesCpuBitwise) {
  DSV4_REQUIRE_CUDA_DEVICE();
  attention_case({5, 16, 512, 640, 640, ReduceOrder{}});
  attention_case({5, 16, 512, 640, 640, ReduceOrder{64}});
}

// No token (dkv zeroed, dsink untouched), no slot (every row empty), no kv row (all holes).
TEST(GradAttentionGpu, DegenerateShapesMatchCpuBitwise) {
  DSV4_REQUIRE_CUDA_DEVICE();
  attention_case({0, 3, 9, 7, 4, ReduceOrder{}});
  attention_case({4, 3, 9, 6, 0, ReduceOrder{}});
  attention_case({3, 2, 9, 0, 4, ReduceOrder{}});
}

// ---- compressor pooling -------------------------------------------------------------------------

struct PoolShape {
  int ratio;
  int64_t d;
  int rd;
  int64_t g0, G, row0, rows;
  ReduceOrder order;
  bool dape = true, dnorm = true;
};

std::string pool_name(const PoolShape& s) {
  return "POOL_BWD(r=" + std::to_string(s.ratio) + ",d=" + std::to_string(s.d) +
         ",rd=" + std::to_string(s.rd) + ",g0=" + std::to_string(s.g0) + ",G=" + std::to_string(s.G) +
         ",row0=" + std::to_string(s.row0) + ",rows=" + std::to_string(s.rows) + "," + order_name(s.order) +
         (s.dape ? "" : ",no-dape") + (s.dnorm ? "" : ",no-dnorm") + ")";
}

void pool_case(const PoolShape& s) {
  const std::string name = pool_name(s);
  SCOPED_TRACE(name);
  auto g = test::rng_for(name);
  const int64_t cw = (s.ratio == 4 ? 2 : 1) * s.d;
  const auto kvp = test::randn_bf16(g, size_t(s.rows * cw)), sc = test::randn_bf16(g, size_t(s.rows * cw)),
             ape = test::randn_bf16(g, size_t(s.ratio * cw), 0.5f),
             dout = test::randn_bf16(g, size_t(s.G * s.d));
  std::vector<float> norm(size_t(s.d));
  std::uniform_real_distribution<float> u(0.5f, 1.5f);
  for (auto& v : norm) v = u(g);
  RopeSpec spec;
  spec.rd = s.rd, spec.base = 160000.0f, spec.yarn = true;
  std::vector<float> freq(size_t(s.rd / 2));
  rope_freqs(spec, freq.data());

  const float fv = test::fill_value(), acc0 = 0.5f;
  std::vector<float> dkvp(kvp.size(), fv), dsc(sc.size(), fv), dape(ape.size(), acc0),
      dnorm(size_t(s.d), acc0);
  CompressorPoolBwdParams p;
  p.g0 = s.g0, p.G = s.G, p.row0 = s.row0, p.rows = s.rows, p.ratio = s.ratio, p.d = s.d, p.rd = s.rd;
  p.order = s.order;
  p.kvp = kvp.data(), p.sc = sc.data(), p.ape = ape.data(), p.norm = norm.data(), p.freq = freq.data();
  p.dout = dout.data();
  p.dkvp = dkvp.data(), p.dsc = dsc.data();
  p.dape = s.dape ? dape.data() : nullptr, p.dnorm = s.dnorm ? dnorm.data() : nullptr;
  ASSERT_EQ(compressor_pool_backward_check(p), nullptr);
  compressor_pool_backward(p);

  DeviceBuffers d;
  p.kvp = d.upload(kvp, "kvp"), p.sc = d.upload(sc, "sc"), p.ape = d.upload(ape, "ape");
  p.norm = d.upload(norm, "norm"), p.freq = d.upload(freq, "freq"), p.dout = d.upload(dout, "dout");
  p.dkvp = d.upload(std::vector<float>(dkvp.size(), fv), "dkvp");
  p.dsc = d.upload(std::vector<float>(dsc.size(), fv), "dsc");
  float* gape = d.upload(std::vector<float>(ape.size(), acc0), "dape");
  float* gnorm = d.upload(std::vector<float>(size_t(s.d), acc0), "dnorm");
  p.dape = s.dape ? gape : nullptr, p.dnorm = s.dnorm ? gnorm : nullptr;
  cuda::compressor_pool_backward(p, nullptr);
  ASSERT_TRUE(d.guards_intact());
  const auto gdsc = d.download(p.dsc, dsc.size());
  EXPECT_TRUE(same_floats(dkvp, d.download(p.dkvp, dkvp.size()), "dkvp"));
  EXPECT_TRUE(same_floats(dsc, gdsc, "dsc"));
  EXPECT_TRUE(same_floats(dape, d.download(gape, dape.size()), "dape"));
  EXPECT_TRUE(same_floats(dnorm, d.download(gnorm, dnorm.size()), "dnorm"));
  if (s.G > 0) {
    EXPECT_FALSE(test::all_zero(gdsc));
  }
}

TEST(GradCompressorGpu, RatiosAndChunksMatchCpuBitwise) {
  DSV4_REQUIRE_CUDA_DEVICE();
  for (const ReduceOrder o : {ReduceOrder{0}, ReduceOrder{16}}) {
    pool_case({4, 37, 16, 0, 9, 0, 9 * 4 + 3, o});              // whole sequence, incomplete tail
    pool_case({4, 37, 16, 5, 4, 16, (5 + 4) * 4 - 16 + 2, o});  // chunk from g0 = 5
    pool_case({4, 24, 8, 3, 5, 0, (3 + 5) * 4, o});             // chunk, rows from 0 (unread rows)
    pool_case({8, 24, 8, 3, 6, 24, 6 * 8, o});                  // ratio 8 chunk
    pool_case({128, 64, 64, 2, 3, 256, 3 * 128 + 5, o});        // ratio 128, rd = d
    pool_case({4, 37, 16, 5, 4, 16, (5 + 4) * 4 - 16, o, false, true});
    pool_case({8, 24, 8, 0, 7, 0, 7 * 8, o, true, false});
    pool_case({128, 64, 64, 0, 2, 0, 2 * 128, o, false, false});
  }
}

// Flash-like: d = 512, rd = 64, 33 groups.
TEST(GradCompressorGpu, FlashLikeMatchesCpuBitwise) {
  DSV4_REQUIRE_CUDA_DEVICE();
  pool_case({4, 512, 64, 0, 33, 0, 33 * 4 + 1, ReduceOrder{}});
  pool_case({4, 512, 64, 7, 26, 24, 26 * 4 + 4, ReduceOrder{64}});
  pool_case({128, 512, 64, 1, 3, 128, 3 * 128, ReduceOrder{64}});
}

// No group: dkvp / dsc zeroed, dape / dnorm untouched.
TEST(GradCompressorGpu, NoGroupMatchesCpuBitwise) {
  DSV4_REQUIRE_CUDA_DEVICE();
  pool_case({4, 16, 8, 0, 0, 0, 3, ReduceOrder{}});
  pool_case({8, 16, 8, 2, 0, 8, 5, ReduceOrder{}});
}

// ---- parameter checks (host side: no device needed, nothing is launched) ------------------------

template <typename F>
std::string thrown(F&& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

TEST(GradAttentionGpu, BadParametersThrowBeforeLaunching) {
  SparseAttnBwdParams p;
  p.T = 2, p.H = 0, p.Dh = 8, p.N = 3, p.K = 2;
  EXPECT_NE(thrown([&] { cuda::sparse_attention_backward(p, nullptr); }).find("H must be"),
            std::string::npos);
  p.H = 2;
  EXPECT_NE(thrown([&] { cuda::sparse_attention_backward(p, nullptr); }).find("dkv is null"),
            std::string::npos);
  p.K = 1 << 20;
  EXPECT_NE(thrown([&] { cuda::sparse_attention_backward(p, nullptr); }).find("too large"),
            std::string::npos);
  p.K = 2, p.order.block = 12;
  EXPECT_NE(thrown([&] { cuda::sparse_attention_backward(p, nullptr); }).find("order.block"),
            std::string::npos);
}

TEST(GradCompressorGpu, BadParametersThrowBeforeLaunching) {
  CompressorPoolBwdParams p;
  p.ratio = 4, p.d = 16, p.rd = 7, p.G = 0, p.rows = 0;
  EXPECT_NE(thrown([&] { cuda::compressor_pool_backward(p, nullptr); }).find("rd must be"),
            std::string::npos);
  p.rd = 8, p.g0 = 2, p.G = 1, p.row0 = 8, p.rows = 4;  // group 2 reads tokens 4 .. 11
  EXPECT_NE(thrown([&] { cuda::compressor_pool_backward(p, nullptr); }).find("outside"), std::string::npos);
  float dummy = 0.0f;
  p.row0 = 4, p.rows = 8, p.d = 1 << 20, p.rd = 8;
  p.kvp = p.sc = p.ape = p.norm = p.freq = p.dout = &dummy;
  p.dkvp = p.dsc = &dummy;
  EXPECT_NE(thrown([&] { cuda::compressor_pool_backward(p, nullptr); }).find("too large"), std::string::npos);
}

}  // namespace
}  // namespace dsv4
