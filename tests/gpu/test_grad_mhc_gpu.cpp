// The CUDA mHC backward (kernels/cuda/grad.h: hc_post_backward, hc_pre_backward, hc_head_backward)
// against the CPU reference (kernels/cpu/grad_mhc.cpp), bit for bit: full and legacy modes, hc 2/3/4
// (plus 1, 5 and 16 at the edges), odd D, T 1/5/37 (and 700001 for the grid-stride paths), the
// single-chain and blocked reduce orders. The
// accumulated outputs start from the same non-zero values on both sides, the overwritten ones from a
// NaN pattern; every output must match bitwise, guard regions must be intact, the accumulated
// outputs must have changed and (legacy mode) the mixer gradients must be left untouched.
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "gpu_test_util.h"
#include "kernels/cuda/grad.h"
#include "kernels/grad.h"
#include "test_util.h"

namespace dsv4 {
namespace {

using test::DeviceBuffers;
using test::same_floats;
using V = std::vector<float>;

enum class Op { post, pre, head };

struct Case {
  Op op = Op::post;
  int64_t T = 1;
  int hc = 4;
  int64_t D = 37;
  bool mixer = true;
  int iters = 20;
  int block = 0;
};

std::string case_name(const Case& c) {
  std::string s = c.op == Op::post ? "post" : (c.op == Op::pre ? "pre" : "head");
  s += "_T" + std::to_string(c.T) + "_hc" + std::to_string(c.hc) + "_D" + std::to_string(c.D);
  if (c.op != Op::post) s += c.mixer ? "_full" : "_legacy";
  if (c.op == Op::pre) s += "_it" + std::to_string(c.iters);
  s += c.block ? "_block" + std::to_string(c.block) : "_chain";
  return s;
}

std::vector<Case> all_cases() {
  std::vector<Case> v;
  for (const int64_t T : {1, 5, 37})
    for (const int hc : {2, 3, 4})
      for (const int block : {0, 16}) {
        v.push_back({Op::post, T, hc, 37, true, 20, block});
        for (const bool mixer : {true, false}) {
          v.push_back({Op::pre, T, hc, 37, mixer, 20, block});
          v.push_back({Op::head, T, hc, 37, mixer, 20, block});
        }
      }
  // Edges: D = 1, a blocked order with several blocks per token, few or one Sinkhorn iteration,
  // hc = 1 / 5 (hc_post has no bound) and the largest hc of hc_pre / hc_head.
  v.push_back({Op::post, 5, 3, 1, true, 20, 0});
  v.push_back({Op::post, 3, 1, 9, true, 20, 0});
  v.push_back({Op::post, 3, 5, 129, true, 20, 64});
  v.push_back({Op::pre, 5, 3, 1, true, 3, 0});
  v.push_back({Op::pre, 5, 4, 37, true, 1, 0});
  v.push_back({Op::pre, 5, 4, 129, true, 20, 64});
  v.push_back({Op::pre, 2, 16, 3, true, 20, 0});
  v.push_back({Op::pre, 2, 16, 3, false, 20, 0});
  v.push_back({Op::head, 5, 3, 1, true, 20, 0});
  v.push_back({Op::head, 5, 4, 129, true, 20, 64});
  v.push_back({Op::head, 2, 16, 3, true, 20, 0});
  // Many tokens: more (t, k) dots and per-token groups than one grid covers, more tokens than
  // grid y holds (the grid-stride paths).
  v.push_back({Op::post, 700001, 2, 1, true, 20, 0});
  v.push_back({Op::pre, 700001, 2, 1, true, 1, 0});
  v.push_back({Op::head, 700001, 2, 1, true, 20, 0});
  return v;
}

// Some element of `after` differs from `before` (the op did add something).
bool changed(const V& before, const V& after) {
  for (size_t i = 0; i < before.size(); ++i)
    if (std::memcmp(&before[i], &after[i], 4) != 0) return true;
  return false;
}

void run_post(const Case& c, std::mt19937_64& g) {
  const int64_t T = c.T, D = c.D, hc = c.hc, hcD = hc * D;
  const V f = test::randn_bf16(g, size_t(T * D)), R = test::randn_bf16(g, size_t(T * hcD));
  const V post = test::randn_bf16(g, size_t(T * hc)), comb = test::randn_bf16(g, size_t(T * hc * hc), 0.3f);
  const V dout = test::randn_bf16(g, size_t(T * hcD));
  const V df0 = test::randn_bf16(g, size_t(T * D)), dR0 = test::randn_bf16(g, size_t(T * hcD));
  const float fv = test::fill_value();
  V df = df0, dR = dR0, dpost(size_t(T * hc), fv), dcomb(size_t(T * hc * hc), fv);

  HcPostBwdParams p;
  p.T = T, p.hc = c.hc, p.D = D, p.order.block = c.block;
  p.f = f.data(), p.R = R.data(), p.post = post.data(), p.comb = comb.data(), p.dout = dout.data();
  p.df = df.data(), p.dR = dR.data(), p.dpost = dpost.data(), p.dcomb = dcomb.data();
  ASSERT_EQ(hc_post_backward_check(p), nullptr);
  hc_post_backward(p);

  DeviceBuffers d;
  p.f = d.upload(f, "f"), p.R = d.upload(R, "R"), p.post = d.upload(post, "post");
  p.comb = d.upload(comb, "comb"), p.dout = d.upload(dout, "dout");
  p.df = d.upload(df0, "df"), p.dR = d.upload(dR0, "dR");
  p.dpost = d.upload(V(dpost.size(), fv), "dpost"), p.dcomb = d.upload(V(dcomb.size(), fv), "dcomb");
  cuda::hc_post_backward(p, nullptr);
  ASSERT_TRUE(d.guards_intact());
  EXPECT_TRUE(same_floats(df, d.download(p.df, df.size()), "df"));
  EXPECT_TRUE(same_floats(dR, d.download(p.dR, dR.size()), "dR"));
  EXPECT_TRUE(same_floats(dpost, d.download(p.dpost, dpost.size()), "dpost"));
  EXPECT_TRUE(same_floats(dcomb, d.download(p.dcomb, dcomb.size()), "dcomb"));
  EXPECT_TRUE(changed(df0, df));
  EXPECT_TRUE(changed(dR0, dR));
  EXPECT_FALSE(test::all_zero(dpost));
}

// hc_pre_backward (head = false) or hc_head_backward (head = true).
void run_mixer(const Case& c, std::mt19937_64& g) {
  const bool head = c.op == Op::head;
  const int64_t T = c.T, D = c.D, hc = c.hc, hcD = hc * D;
  const int64_t rows = head ? hc : (2 + hc) * hc, groups = head ? 1 : 3;
  const V X = test::randn_bf16(g, size_t(T * hcD));
  const V fn = test::randn_bf16(g, size_t(rows * hcD), 0.05f);
  const V scale = test::randn_bf16(g, size_t(groups), 0.5f), base = test::randn_bf16(g, size_t(rows), 0.5f);
  const V dy = test::randn_bf16(g, size_t(T * D));
  const V dpost = test::randn_bf16(g, size_t(T * hc)), dcomb = test::randn_bf16(g, size_t(T * hc * hc));
  const V dX0 = test::randn_bf16(g, size_t(T * hcD)), dfn0 = test::randn_bf16(g, size_t(rows * hcD));
  const V dscale0 = test::randn_bf16(g, size_t(groups)), dbase0 = test::randn_bf16(g, size_t(rows));
  V dX = dX0, dfn = dfn0, dscale = dscale0, dbase = dbase0;

  // The CPU reference, then the same call on device copies of the same inputs and initial outputs.
  // Legacy hc_pre gets no dpost / dcomb (they are not read); dfn / dscale / dbase are passed in both
  // modes so that "untouched" is checked.
  auto run = [&](const float* X_, const float* fn_, const float* scale_, const float* base_, const float* dy_,
                 const float* dpost_, const float* dcomb_, float* dX_, float* dfn_, float* dscale_,
                 float* dbase_, bool gpu) {
    if (head) {
      HcHeadBwdParams p;
      p.T = T, p.hc = c.hc, p.D = D, p.order.block = c.block, p.train_mixer = c.mixer;
      p.X = X_, p.fn = fn_, p.scale = scale_, p.base = base_, p.dy = dy_;
      p.dX = dX_, p.dfn = dfn_, p.dscale = dscale_, p.dbase = dbase_;
      ASSERT_EQ(hc_head_backward_check(p), nullptr);
      gpu ? cuda::hc_head_backward(p, nullptr) : hc_head_backward(p);
    } else {
      HcPreBwdParams p;
      p.T = T, p.hc = c.hc, p.D = D, p.order.block = c.block, p.train_mixer = c.mixer;
      p.sinkhorn_iters = c.iters;
      p.X = X_, p.fn = fn_, p.scale = scale_, p.base = base_, p.dy = dy_;
      p.dpost = c.mixer ? dpost_ : nullptr, p.dcomb = c.mixer ? dcomb_ : nullptr;
      p.dX = dX_, p.dfn = dfn_, p.dscale = dscale_, p.dbase = dbase_;
      ASSERT_EQ(hc_pre_backward_check(p), nullptr);
      gpu ? cuda::hc_pre_backward(p, nullptr) : hc_pre_backward(p);
    }
  };
  run(X.data(), fn.data(), scale.data(), base.data(), dy.data(), dpost.data(), dcomb.data(), dX.data(),
      dfn.data(), dscale.data(), dbase.data(), false);

  DeviceBuffers d;
  float* gdX = d.upload(dX0, "dX");
  float* gdfn = d.upload(dfn0, "dfn");
  float* gdscale = d.upload(dscale0, "dscale");
  float* gdbase = d.upload(dbase0, "dbase");
  run(d.upload(X, "X"), d.upload(fn, "fn"), d.upload(scale, "scale"), d.upload(base, "base"), d.upload(dy, "dy"),
      d.upload(dpost, "dpost"), d.upload(dcomb, "dcomb"), gdX, gdfn, gdscale, gdbase, true);
  ASSERT_TRUE(d.guards_intact());
  EXPECT_TRUE(same_floats(dX, d.download(gdX, dX.size()), "dX"));
  EXPECT_TRUE(same_floats(dfn, d.download(gdfn, dfn.size()), "dfn"));
  EXPECT_TRUE(same_floats(dscale, d.download(gdscale, dscale.size()), "dscale"));
  EXPECT_TRUE(same_floats(dbase, d.download(gdbase, dbase.size()), "dbase"));
  EXPECT_TRUE(changed(dX0, dX));
  if (c.mixer) {
    EXPECT_TRUE(changed(dfn0, dfn));
    EXPECT_TRUE(changed(dscale0, dscale));
    EXPECT_TRUE(changed(dbase0, dbase));
  } else {
    EXPECT_TRUE(test::bitwise_equal(dfn0, dfn));
    EXPECT_TRUE(test::bitwise_equal(dscale0, dscale));
    EXPECT_TRUE(test::bitwise_equal(dbase0, dbase));
  }
}

class GradMhcGpu : public ::testing::TestWithParam<Case> {};

TEST_P(GradMhcGpu, MatchesCpuBitwise) {
  DSV4_REQUIRE_CUDA_DEVICE();
  const Case& c = GetParam();
  auto g = test::rng_for(case_name(c));
  if (c.op == Op::post)
    run_post(c, g);
  else
    run_mixer(c, g);
}

INSTANTIATE_TEST_SUITE_P(Cases, GradMhcGpu, ::testing::ValuesIn(all_cases()),
                         [](const ::testing::TestParamInfo<Case>& info) { return case_name(info.param); });

// Bad parameters are rejected on the host before anything touches the device (so this runs without
// one), with the CPU check's reason; T = 0 is a no-op.
TEST(GradMhcGpuChecks, RejectBeforeLaunch) {
  V buf(64, 0.0f);
  float* b = buf.data();
  HcPreBwdParams p;
  p.T = 1, p.hc = 17, p.D = 4;
  p.X = p.fn = p.scale = p.base = p.dy = p.dpost = p.dcomb = b;
  p.dX = p.dfn = p.dscale = p.dbase = b + 32;
  try {
    cuda::hc_pre_backward(p, nullptr);
    ADD_FAILURE() << "hc = 17 accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("hc must be in [1, 16]"), std::string::npos) << e.what();
  }
  p.hc = 2, p.dX = const_cast<float*>(p.X);
  EXPECT_THROW(cuda::hc_pre_backward(p, nullptr), Error);

  HcHeadBwdParams h;
  h.T = 1, h.hc = 2, h.D = 4, h.order.block = 12;
  h.X = h.fn = h.scale = h.base = h.dy = b;
  h.dX = h.dfn = h.dscale = h.dbase = b + 32;
  EXPECT_THROW(cuda::hc_head_backward(h, nullptr), Error);
  h.order.block = 0, h.dbase = nullptr;
  EXPECT_THROW(cuda::hc_head_backward(h, nullptr), Error);

  HcPostBwdParams q;
  q.T = 1, q.hc = 2, q.D = 0;
  q.f = q.R = q.post = q.comb = q.dout = b;
  q.df = q.dR = q.dpost = q.dcomb = b + 32;
  EXPECT_THROW(cuda::hc_post_backward(q, nullptr), Error);
  q.D = 4, q.dR = const_cast<float*>(q.R);
  EXPECT_THROW(cuda::hc_post_backward(q, nullptr), Error);

  // T = 0: valid and nothing to do (no pointer is needed, nothing is launched).
  HcPreBwdParams z;
  z.T = 0, z.D = 4;
  EXPECT_NO_THROW(cuda::hc_pre_backward(z, nullptr));
  HcHeadBwdParams zh;
  zh.T = 0, zh.D = 4;
  EXPECT_NO_THROW(cuda::hc_head_backward(zh, nullptr));
  HcPostBwdParams zp;
  zp.T = 0, zp.D = 4;
  EXPECT_NO_THROW(cuda::hc_post_backward(zp, nullptr));
}

}  // namespace
}  // namespace dsv4
