// The CUDA ops of the indexer's KL objective (kernels/cuda/grad.h) against the CPU reference
// (kernels/grad.h), bitwise, on guarded device buffers: the Hadamard transpose, the attention mass
// over a column range (holes, empty rows), the KL rows (both targets, empty rows, a vanishing
// probability) and the score backward (holes, a key twice in a row, keys no slot reads, enough slots
// for every stage of the inverse map's sort, both reduce orders). Outputs start from a NaN pattern.
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
#include "test_util.h"

namespace dsv4 {
namespace {

using test::DeviceBuffers;
using test::same_floats;

TEST(GpuIndexerKl, HadamardBackwardEqualsTheCpu) {
  DSV4_REQUIRE_CUDA_DEVICE();
  for (int64_t n : {1, 16, 128, 512}) {
    auto g = test::rng_for("gpu-hadamard-bwd" + std::to_string(n));
    const int64_t rows = 37, ld = n + 3;
    std::vector<float> x = test::randn_bf16(g, size_t(rows * ld));
    DeviceBuffers d;
    float* gx = d.upload(x, "x");
    hadamard_backward(x.data(), rows, n, ld);
    cuda::hadamard_backward(gx, rows, n, ld, nullptr);
    EXPECT_TRUE(same_floats(x, d.download(gx, x.size()), "hadamard_backward n=" + std::to_string(n)));
    EXPECT_TRUE(d.guards_intact());
  }
}

struct AttnCase {
  int64_t T, Dh, N, K, c0, n;
  int H;
};

TEST(GpuIndexerKl, AttentionMassEqualsTheCpu) {
  DSV4_REQUIRE_CUDA_DEVICE();
  for (const AttnCase& c : {AttnCase{5, 24, 20, 9, 3, 6, 3}, AttnCase{300, 128, 400, 160, 128, 32, 16},
                            AttnCase{64, 72, 90, 40, 0, 40, 5}}) {
    const std::string name = "mass T=" + std::to_string(c.T) + " H=" + std::to_string(c.H);
    auto g = test::rng_for(name);
    std::vector<float> q = test::randn_bf16(g, size_t(c.T * c.H * c.Dh)), kv = test::randn_bf16(g, size_t(c.N * c.Dh)),
                       sink = test::randn_bf16(g, size_t(c.H)), o(size_t(c.T * c.H * c.Dh)), lse(size_t(c.T * c.H));
    std::vector<int32_t> idx(size_t(c.T * c.K));
    std::uniform_int_distribution<int32_t> pick(0, int32_t(c.N - 1));
    std::bernoulli_distribution hole(0.3);
    for (auto& v : idx) v = hole(g) ? -1 : pick(g);
    for (int64_t j = 0; j < c.K; ++j) idx[size_t(j)] = -1;
    SparseAttnParams a;
    a.T = c.T, a.H = c.H, a.Dh = c.Dh, a.N = c.N, a.K = c.K;
    a.q = q.data(), a.kv = kv.data(), a.idx = idx.data(), a.sink = sink.data();
    a.scale = 1.0f / std::sqrt(float(c.Dh));
    a.o = o.data(), a.lse = lse.data();
    sparse_attention(a);
    for (ReduceOrder order : {ReduceOrder{}, ReduceOrder{32}}) {
      std::vector<float> mass(size_t(c.T * c.n), test::fill_value());
      AttentionMassParams p;
      p.T = c.T, p.H = c.H, p.Dh = c.Dh, p.N = c.N, p.K = c.K, p.c0 = c.c0, p.n = c.n;
      p.q = q.data(), p.kv = kv.data(), p.idx = idx.data(), p.lse = lse.data(), p.scale = a.scale;
      p.order = order;
      DeviceBuffers d;
      AttentionMassParams gp = p;
      gp.q = d.upload(q, "q"), gp.kv = d.upload(kv, "kv"), gp.idx = d.upload(idx, "idx");
      gp.lse = d.upload(lse, "lse");
      gp.mass = d.upload(mass, "mass");
      p.mass = mass.data();
      attention_mass(p);
      cuda::attention_mass(gp, nullptr);
      EXPECT_TRUE(same_floats(mass, d.download(gp.mass, mass.size()), name));
      EXPECT_TRUE(d.guards_intact());
    }
  }
}

TEST(GpuIndexerKl, KlRowsEqualTheCpu) {
  DSV4_REQUIRE_CUDA_DEVICE();
  auto g = test::rng_for("gpu-kl-rows");
  const int64_t T = 700;
  const int k = 24;
  std::vector<int32_t> ids(size_t(T * k));
  std::vector<float> score(size_t(T * k)), mass(size_t(T * k));
  std::uniform_real_distribution<float> u(-4.0f, 4.0f), m(0.0f, 0.3f);
  std::bernoulli_distribution hole(0.2);
  for (size_t i = 0; i < ids.size(); ++i) {
    ids[i] = hole(g) ? -1 : int32_t(i % 97);
    score[i] = u(g);
    mass[i] = i % 11 == 0 ? 0.0f : m(g);
  }
  for (int j = 0; j < k; ++j) ids[size_t(j)] = -1;  // an empty row
  score[size_t(k + 3)] = -300.0f;                   // a vanishing probability
  for (bool l1 : {true, false}) {
    std::vector<float> loss(size_t(T), test::fill_value()), ds(size_t(T * k), test::fill_value());
    IndexerKlParams p;
    p.T = T, p.k = k, p.ids = ids.data(), p.score = score.data(), p.mass = mass.data();
    p.l1_target = l1, p.coeff = 0.0625f;
    DeviceBuffers d;
    IndexerKlParams gp = p;
    gp.ids = d.upload(ids, "ids"), gp.score = d.upload(score, "score"), gp.mass = d.upload(mass, "mass");
    gp.loss = d.upload(loss, "loss"), gp.dscore = d.upload(ds, "dscore");
    p.loss = loss.data(), p.dscore = ds.data();
    indexer_kl(p);
    cuda::indexer_kl(gp, nullptr);
    EXPECT_TRUE(same_floats(loss, d.download(gp.loss, loss.size()), l1 ? "loss l1" : "loss heads_sum"));
    EXPECT_TRUE(same_floats(ds, d.download(gp.dscore, ds.size()), l1 ? "dscore l1" : "dscore heads_sum"));
    EXPECT_TRUE(d.guards_intact());
  }
}

struct ScoreShape {
  int64_t T, Di, G;
  int Hi, k;
};

TEST(GpuIndexerKl, ScoreBackwardEqualsTheCpu) {
  DSV4_REQUIRE_CUDA_DEVICE();
  for (const ScoreShape& s : {ScoreShape{7, 16, 9, 3, 4}, ScoreShape{1000, 128, 250, 8, 64},
                              ScoreShape{129, 40, 33, 5, 17}, ScoreShape{3, 8, 0, 2, 2}}) {
    for (ReduceOrder order : {ReduceOrder{}, ReduceOrder{16}}) {
      const std::string name = "score_bwd T=" + std::to_string(s.T) + " Di=" + std::to_string(s.Di) +
                               " G=" + std::to_string(s.G) + " block=" + std::to_string(order.block);
      auto g = test::rng_for(name);
      std::vector<float> qi = test::randn_bf16(g, size_t(s.T * s.Hi * s.Di)),
                         ki = test::randn_bf16(g, size_t(s.G * s.Di)), wt = test::randn_bf16(g, size_t(s.T * s.Hi)),
                         dscore = test::randn_bf16(g, size_t(s.T * s.k));
      std::vector<int32_t> ids(size_t(s.T * s.k), -1);
      if (s.G > 1) {
        std::uniform_int_distribution<int32_t> pick(0, int32_t(s.G - 2));  // key G-1 in no slot
        for (int64_t t = 1; t < s.T; ++t)
          for (int j = 0; j < s.k; ++j) ids[size_t(t * s.k + j)] = (t + j) % 6 == 5 ? -1 : pick(g);
        if (s.T > 2 && s.k > 2) ids[size_t(2 * s.k)] = ids[size_t(2 * s.k + 2)] = 0;
      }
      std::vector<float> dqi(qi.size(), test::fill_value()), dwt(wt.size(), test::fill_value()),
          dki(ki.size(), test::fill_value());
      IndexerScoreBwdParams p;
      p.T = s.T, p.Hi = s.Hi, p.Di = s.Di, p.G = s.G, p.k = s.k;
      p.qi = qi.data(), p.ki = ki.data(), p.wt = wt.data(), p.ids = ids.data(), p.dscore = dscore.data();
      p.wt_scale = 0.03125f, p.order = order;
      DeviceBuffers d;
      IndexerScoreBwdParams gp = p;
      gp.qi = d.upload(qi, "qi"), gp.ki = d.upload(ki, "ki"), gp.wt = d.upload(wt, "wt");
      gp.ids = d.upload(ids, "ids"), gp.dscore = d.upload(dscore, "dscore");
      gp.dqi = d.upload(dqi, "dqi"), gp.dwt = d.upload(dwt, "dwt"), gp.dki = d.upload(dki, "dki");
      p.dqi = dqi.data(), p.dwt = dwt.data(), p.dki = dki.data();
      ASSERT_EQ(indexer_score_backward_check(p), nullptr) << name;
      indexer_score_backward(p);
      cuda::indexer_score_backward(gp, nullptr);
      EXPECT_TRUE(same_floats(dqi, d.download(gp.dqi, dqi.size()), name + " dqi"));
      EXPECT_TRUE(same_floats(dwt, d.download(gp.dwt, dwt.size()), name + " dwt"));
      EXPECT_TRUE(same_floats(dki, d.download(gp.dki, dki.size()), name + " dki"));
      EXPECT_TRUE(d.guards_intact());
    }
  }
}

}  // namespace
}  // namespace dsv4
