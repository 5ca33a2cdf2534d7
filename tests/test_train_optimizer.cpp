// AdamW (train/optimizer.h) against an independent float64 AdamW, its clipping, weight decay, bias
// correction, determinism, the state file (round trip and every refusal), and the gradient summation
// tree (train/grad_tree.h) against an explicitly written recursive reference of the same tree.
#include <gtest/gtest.h>
#include <omp.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include "model/error.h"
#include "model/safetensors.h"
#include "test_util.h"
#include "train/grad_tree.h"
#include "train/optimizer.h"

namespace dsv4 {
namespace {

using train::AdamWConfig;
using train::GradTree;
using train::OptimizerState;
using train::TensorSet;

std::vector<float> randn(std::mt19937_64& g, size_t n, float std = 1.0f) {
  std::normal_distribution<float> d(0.0f, std);
  std::vector<float> v(n);
  for (auto& x : v) x = d(g);
  return v;
}

// A state with a 2-D weight, a 1-D bias and a 0-D scalar (sizes odd).
OptimizerState make_state(std::mt19937_64& g) {
  OptimizerState s;
  const std::vector<std::pair<std::string, std::pair<size_t, int>>> tensors{
      {"layers.0.w", {35, 2}}, {"layers.0.bias", {7, 1}}, {"scale", {1, 0}}};
  for (const auto& [name, sz] : tensors) {
    s.master[name] = randn(g, sz.first);
    s.m[name].assign(sz.first, 0.0f);
    s.v[name].assign(sz.first, 0.0f);
    s.ndim[name] = sz.second;
  }
  return s;
}

TensorSet random_grads(std::mt19937_64& g, const OptimizerState& s, float std) {
  TensorSet out;
  for (const auto& [name, p] : s.master) out[name] = randn(g, p.size(), std);
  return out;
}

// ---- an independent float64 AdamW ----------------------------------------------------------------

struct RefTensor {
  std::vector<double> p, m, v;
  std::vector<double> m_mag;  // m with |g| in place of g: the scale of m's rounding errors
  int ndim = 1;
};
using RefState = std::map<std::string, RefTensor>;

RefState to_ref(const OptimizerState& s) {
  RefState r;
  for (const auto& [name, p] : s.master) {
    RefTensor& t = r[name];
    t.p.assign(p.begin(), p.end());
    t.m.assign(s.m.at(name).begin(), s.m.at(name).end());
    t.v.assign(s.v.at(name).begin(), s.v.at(name).end());
    for (double x : t.m) t.m_mag.push_back(std::fabs(x));
    t.ndim = s.ndim.at(name);
  }
  return r;
}

// Returns the gradient norm before clipping.
double ref_step(const AdamWConfig& c, const TensorSet& grads, RefState& st, int step) {
  double sq = 0;
  for (const auto& [name, g] : grads)
    for (float x : g) sq += double(x) * double(x);
  const double norm = std::sqrt(sq);
  const double coef = c.clip_grad > 0 ? std::min(1.0, c.clip_grad / (norm + 1e-6)) : 1.0;
  for (const auto& [name, g] : grads) {
    RefTensor& t = st.at(name);
    for (size_t i = 0; i < g.size(); ++i) {
      const double gi = g[i] * coef;
      t.m[i] = c.beta1 * t.m[i] + (1 - c.beta1) * gi;
      t.m_mag[i] = c.beta1 * t.m_mag[i] + (1 - c.beta1) * std::fabs(gi);
      t.v[i] = c.beta2 * t.v[i] + (1 - c.beta2) * gi * gi;
      const double mh = t.m[i] / (1 - std::pow(c.beta1, step));
      const double vh = t.v[i] / (1 - std::pow(c.beta2, step));
      if (t.ndim >= 2) t.p[i] -= c.lr * c.weight_decay * t.p[i];
      t.p[i] -= c.lr * mh / (std::sqrt(vh) + c.eps);
    }
  }
  return norm;
}

double ulp_of(double x) {
  const float f = float(std::fabs(x));
  return double(std::nextafter(f, INFINITY) - f);
}

void expect_close_to_ref(const OptimizerState& s, const RefState& r, int steps, double lr) {
  for (const auto& [name, t] : r) {
    SCOPED_TRACE(name);
    const auto& p = s.master.at(name);
    const auto& m = s.m.at(name);
    const auto& v = s.v.at(name);
    for (size_t i = 0; i < p.size(); ++i) {
      // Per step: the fp32 rounding of p (half an ulp) and a few fp32 roundings in an update of
      // size ~lr; m and v carry a few fp32 roundings per step, relative to the magnitude of their
      // terms (m's terms cancel, v's do not).
      EXPECT_NEAR(p[i], t.p[i], steps * (ulp_of(t.p[i]) + 1e-6 * lr)) << "index " << i;
      EXPECT_NEAR(m[i], t.m[i], steps * 4e-7 * t.m_mag[i]) << "index " << i;
      EXPECT_NEAR(v[i], t.v[i], steps * 4e-7 * t.v[i]) << "index " << i;
    }
  }
}

TEST(AdamW, MatchesFloat64ReferenceOverSeveralSteps) {
  auto g = test::rng_for("AdamW.Reference");
  AdamWConfig c;
  c.lr = 1e-2;  // updates far above the fp32 resolution of the weights
  c.weight_decay = 0.1;
  c.clip_grad = 0;  // clipping is tested separately
  OptimizerState s = make_state(g);
  RefState r = to_ref(s);
  const int steps = 6;
  for (int k = 1; k <= steps; ++k) {
    const TensorSet grads = random_grads(g, s, 0.5f);
    const auto st = train::adamw_step(c, grads, s);
    const double norm = ref_step(c, grads, r, k);
    EXPECT_EQ(s.step, k);
    EXPECT_NEAR(st.grad_norm, norm, 1e-14 * norm);
    EXPECT_EQ(st.clip_coef, 1.0);
  }
  expect_close_to_ref(s, r, steps, c.lr);
}

TEST(AdamW, ClipsByTheGlobalNormAndReportsItBeforeClipping) {
  auto g = test::rng_for("AdamW.Clip");
  AdamWConfig c;
  c.lr = 1e-2;
  c.clip_grad = 1.0;
  OptimizerState s = make_state(g);
  RefState r = to_ref(s);
  for (int k = 1; k <= 3; ++k) {
    const TensorSet grads = random_grads(g, s, 2.0f);  // norm ~ 2 * sqrt(43) >> 1
    const double norm = train::global_norm(grads);
    ASSERT_GT(norm, 5.0);
    const auto st = train::adamw_step(c, grads, s);
    ref_step(c, grads, r, k);
    EXPECT_EQ(st.grad_norm, norm);
    EXPECT_EQ(st.clip_coef, double(float(1.0 / (norm + 1e-6))));
    // The moments see the clipped gradient.
    if (k == 1) {
      const float g0 = grads.at("scale")[0];
      EXPECT_NEAR(s.m.at("scale")[0], (1 - c.beta1) * g0 / norm, 1e-6 * std::fabs(g0 / norm));
    }
  }
  expect_close_to_ref(s, r, 3, c.lr);

  // Below the threshold or with clipping off the gradient is used as it is.
  OptimizerState s2 = make_state(g);
  const TensorSet small = random_grads(g, s2, 0.01f);
  EXPECT_LT(train::global_norm(small), 1.0);
  EXPECT_EQ(train::adamw_step(c, small, s2).clip_coef, 1.0);
  c.clip_grad = 0;
  const TensorSet big = random_grads(g, s2, 10.0f);
  const auto st = train::adamw_step(c, big, s2);
  EXPECT_EQ(st.clip_coef, 1.0);
  EXPECT_GT(st.grad_norm, 10.0);
}

TEST(AdamW, GlobalNormSumsSquaresInFp64) {
  TensorSet g{{"a", {3.0f}}, {"b", {0.0f, 4.0f}}};
  EXPECT_EQ(train::global_norm(g), 5.0);
  EXPECT_EQ(train::global_norm({}), 0.0);
  // 1e20^2 overflows fp32 but not fp64.
  TensorSet big{{"x", {1e20f, 1e20f}}};
  EXPECT_NEAR(train::global_norm(big), std::sqrt(2.0) * double(1e20f), 1e6);
}

// Decoupled weight decay on tensors of 2 or more dims only: with zero gradients and zero moments
// the Adam term is exactly 0, so the step is the decay alone.
TEST(AdamW, WeightDecayOnlyForTwoOrMoreDims) {
  auto g = test::rng_for("AdamW.Decay");
  AdamWConfig c;
  c.lr = 0.01;
  c.weight_decay = 0.5;
  OptimizerState s = make_state(g);
  const OptimizerState before = s;
  TensorSet zero;
  for (const auto& [name, p] : s.master) zero[name].assign(p.size(), 0.0f);
  const auto st = train::adamw_step(c, zero, s);
  EXPECT_EQ(st.grad_norm, 0.0);
  const float k = float(c.lr * c.weight_decay);
  const auto& w0 = before.master.at("layers.0.w");
  std::vector<float> decayed(w0.size());
  for (size_t i = 0; i < w0.size(); ++i) decayed[i] = w0[i] - k * w0[i];
  EXPECT_TRUE(test::bitwise_equal(s.master.at("layers.0.w"), decayed));
  EXPECT_TRUE(test::bitwise_equal(s.master.at("layers.0.bias"), before.master.at("layers.0.bias")));
  EXPECT_TRUE(test::bitwise_equal(s.master.at("scale"), before.master.at("scale")));
  double upd = 0;
  for (size_t i = 0; i < w0.size(); ++i) upd += std::pow(double(decayed[i]) - double(w0[i]), 2);
  EXPECT_EQ(st.update_norm, std::sqrt(upd));
}

// Step 1 with bias correction: mhat = g, vhat = g^2, so every weight without decay moves by
// lr * |g| / (|g| + eps) ~ lr against the gradient's sign, whatever the gradient's scale.
TEST(AdamW, BiasCorrectionMakesTheFirstStepLr) {
  auto g = test::rng_for("AdamW.BiasCorrection");
  AdamWConfig c;
  c.lr = 1e-3;
  c.clip_grad = 0;
  for (float scale : {1e-3f, 1.0f, 50.0f}) {
    OptimizerState s = make_state(g);
    const OptimizerState before = s;
    const TensorSet grads = random_grads(g, s, scale);
    train::adamw_step(c, grads, s);
    const auto& b = grads.at("layers.0.bias");
    for (size_t i = 0; i < b.size(); ++i) {
      const double moved =
          double(s.master.at("layers.0.bias")[i]) - double(before.master.at("layers.0.bias")[i]);
      const double gi = std::fabs(double(b[i]));
      EXPECT_NEAR(moved, -c.lr * (b[i] > 0 ? 1 : -1) * gi / (gi + c.eps),
                  1e-6 * c.lr + ulp_of(before.master.at("layers.0.bias")[i]))
          << "scale " << scale << " index " << i;
    }
  }
}

TEST(AdamW, UpdateNormIsTheNormOfTheChange) {
  auto g = test::rng_for("AdamW.UpdateNorm");
  AdamWConfig c;
  c.lr = 1e-2;
  OptimizerState s = make_state(g);
  const OptimizerState before = s;
  const auto st = train::adamw_step(c, random_grads(g, s, 1.0f), s);
  double sq = 0;
  for (const auto& [name, p] : s.master)
    for (size_t i = 0; i < p.size(); ++i) sq += std::pow(double(p[i]) - double(before.master.at(name)[i]), 2);
  EXPECT_EQ(st.update_norm, std::sqrt(sq));
  EXPECT_GT(st.update_norm, 0.0);
}

TEST(AdamW, DeterministicAcrossRunsAndThreadCounts) {
  auto g = test::rng_for("AdamW.Determinism");
  AdamWConfig c;
  c.lr = 1e-3;
  OptimizerState s0 = make_state(g);
  // Large enough for the parallel path.
  s0.master["big"] = randn(g, 50001);
  s0.m["big"] = randn(g, 50001, 0.01f);
  s0.v["big"].assign(50001, 0.0f);
  for (auto& x : s0.v["big"]) x = float(std::fabs(randn(g, 1, 0.01f)[0]));
  s0.ndim["big"] = 2;
  s0.step = 3;
  std::vector<TensorSet> grads;
  for (int k = 0; k < 3; ++k) grads.push_back(random_grads(g, s0, 1.0f));

  auto run = [&](int threads) {
    const int saved = omp_get_max_threads();
    omp_set_num_threads(threads);
    OptimizerState s = s0;
    std::vector<double> stats;
    for (const auto& gr : grads) {
      const auto st = train::adamw_step(c, gr, s);
      stats.insert(stats.end(), {st.grad_norm, st.clip_coef, st.update_norm});
    }
    omp_set_num_threads(saved);
    return std::make_pair(s, stats);
  };
  const auto [a, sa] = run(1);
  const auto [b, sb] = run(1);
  const auto [t3, s3] = run(3);
  for (const auto* other : {&b, &t3}) {
    for (const auto& [name, p] : a.master) {
      SCOPED_TRACE(name);
      EXPECT_TRUE(test::bitwise_equal(p, other->master.at(name)));
      EXPECT_TRUE(test::bitwise_equal(a.m.at(name), other->m.at(name)));
      EXPECT_TRUE(test::bitwise_equal(a.v.at(name), other->v.at(name)));
    }
  }
  EXPECT_TRUE(test::bitwise_equal(sa, sb));
  EXPECT_TRUE(test::bitwise_equal(sa, s3));
  EXPECT_FALSE(test::bitwise_equal(a.master.at("big"), s0.master.at("big")));
}

TEST(AdamW, MissingOrMisSizedTensorsThrowAndLeaveTheStateAlone) {
  auto g = test::rng_for("AdamW.Errors");
  AdamWConfig c;
  OptimizerState s = make_state(g);
  const OptimizerState before = s;
  auto expect_error = [&](const TensorSet& grads, const std::string& name, const std::string& what) {
    try {
      train::adamw_step(c, grads, s);
      ADD_FAILURE() << "no error for " << name;
    } catch (const Error& e) {
      const std::string msg = e.what();
      EXPECT_NE(msg.find("'" + name + "'"), std::string::npos) << msg;
      EXPECT_NE(msg.find(what), std::string::npos) << msg;
    }
    EXPECT_EQ(s.step, before.step);
    for (const auto& [n, p] : before.master) EXPECT_TRUE(test::bitwise_equal(s.master.at(n), p));
  };
  TensorSet grads = random_grads(g, s, 1.0f);
  grads["extra"] = {1.0f};
  expect_error(grads, "extra", "not in the optimizer state");
  grads = random_grads(g, s, 1.0f);
  grads["layers.0.bias"].push_back(1.0f);
  expect_error(grads, "layers.0.bias", "8 values");
  grads = random_grads(g, s, 1.0f);
  s.m["scale"].clear();
  expect_error(grads, "scale", "'m'");
  s = before;
  s.ndim.erase("scale");
  expect_error(grads, "scale", "ndim");
  s = before;
  grads["layers.0.w"][3] = NAN;
  expect_error(grads, "layers.0.w", "index 3");

  // A subset of the state is fine: the others stay as they are.
  TensorSet some{{"scale", {0.5f}}};
  train::adamw_step(c, some, s);
  EXPECT_EQ(s.step, before.step + 1);
  EXPECT_TRUE(test::bitwise_equal(s.master.at("layers.0.w"), before.master.at("layers.0.w")));
  EXPECT_FALSE(test::bitwise_equal(s.master.at("scale"), before.master.at("scale")));
}

TEST(AdamW, ConfigCheckNamesTheField) {
  auto expect_bad = [](AdamWConfig c, const std::string& field) {
    try {
      train::check(c);
      ADD_FAILURE() << "no InputError for " << field;
    } catch (const InputError& e) {
      EXPECT_NE(std::string(e.what()).find("'" + field + "'"), std::string::npos) << e.what();
    }
  };
  AdamWConfig c;
  EXPECT_NO_THROW(train::check(c));
  c.lr = 0;
  c.beta1 = 0;
  c.weight_decay = 0;
  c.clip_grad = 0;
  EXPECT_NO_THROW(train::check(c));
  c = {};
  c.lr = -1e-5;
  expect_bad(c, "lr");
  c = {};
  c.beta1 = 1.0;
  expect_bad(c, "beta1");
  c = {};
  c.beta2 = -0.1;
  expect_bad(c, "beta2");
  c = {};
  c.eps = 0;
  expect_bad(c, "eps");
  c = {};
  c.weight_decay = NAN;
  expect_bad(c, "weight_decay");
  c = {};
  c.clip_grad = -1;
  expect_bad(c, "clip_grad");
  c = {};
  c.lr = INFINITY;
  expect_bad(c, "lr");
}

// ---- the state file ------------------------------------------------------------------------------

void expect_same_state(const OptimizerState& a, const OptimizerState& b) {
  EXPECT_EQ(a.step, b.step);
  EXPECT_EQ(a.ndim, b.ndim);
  ASSERT_EQ(a.master.size(), b.master.size());
  for (const auto& [name, p] : a.master) {
    SCOPED_TRACE(name);
    ASSERT_TRUE(b.master.count(name));
    EXPECT_TRUE(test::bitwise_equal(p, b.master.at(name)));
    EXPECT_TRUE(test::bitwise_equal(a.m.at(name), b.m.at(name)));
    EXPECT_TRUE(test::bitwise_equal(a.v.at(name), b.v.at(name)));
  }
  EXPECT_EQ(a.m.size(), b.m.size());
  EXPECT_EQ(a.v.size(), b.v.size());
}

TEST(OptimizerStateFile, RoundTripIsBitwiseAndStepsChain) {
  auto g = test::rng_for("OptimizerState.RoundTrip");
  test::TempDir dir;
  AdamWConfig c;
  c.lr = 1e-3;
  OptimizerState s = make_state(g);
  s.master["empty"] = {};
  s.m["empty"] = {};
  s.v["empty"] = {};
  s.ndim["empty"] = 3;
  std::vector<TensorSet> grads;
  for (int k = 0; k < 4; ++k) {
    grads.push_back(random_grads(g, s, 1.0f));
    grads.back().erase("empty");
  }
  train::adamw_step(c, grads[0], s);
  train::adamw_step(c, grads[1], s);
  // Special values survive too.
  s.master["scale"][0] = -0.0f;
  s.v["layers.0.bias"][2] = std::numeric_limits<float>::denorm_min();
  s.save(dir / "opt.safetensors");
  const OptimizerState l = OptimizerState::load(dir / "opt.safetensors");
  expect_same_state(s, l);
  EXPECT_EQ(l.step, 2);
  const auto meta = SafetensorsReader::open(dir / "opt.safetensors").metadata();
  EXPECT_EQ(meta.at("format"), "dsv4-optimizer");
  EXPECT_EQ(meta.at("version"), "1");
  EXPECT_EQ(meta.at("step"), "2");

  // Two more steps on the loaded state equal two more steps on the original.
  OptimizerState a = s, b = l;
  for (int k = 2; k < 4; ++k) {
    train::adamw_step(c, grads[size_t(k)], a);
    train::adamw_step(c, grads[size_t(k)], b);
  }
  expect_same_state(a, b);

  // An empty state round-trips too.
  OptimizerState e;
  e.save(dir / "empty.safetensors");
  expect_same_state(e, OptimizerState::load(dir / "empty.safetensors"));
}

class StateFileErrors : public ::testing::Test {
 protected:
  // A valid file's contents, to be edited: the writer gets the tensors of a small state.
  SafetensorsWriter writer(bool with_v_b = true) {
    SafetensorsWriter w;
    w.add_f32("master.a", {3}, {1, 2, 3});
    w.add_f32("m.a", {3}, {0, 0, 0});
    w.add_f32("v.a", {3}, {0, 0, 0});
    w.add_f32("master.b", {2}, {1, 2});
    w.add_f32("m.b", {2}, {0, 0});
    if (with_v_b) w.add_f32("v.b", {2}, {0, 0});
    w.set_metadata("format", "dsv4-optimizer");
    w.set_metadata("version", "1");
    w.set_metadata("step", "5");
    w.set_metadata("ndim", R"({"a": 2, "b": 1})");
    return w;
  }
  std::string path() { return dir_ / ("s" + std::to_string(n_++) + ".safetensors"); }

  // load() throws InputError naming the file and every part.
  void expect_error(const std::string& file, const std::vector<std::string>& parts) {
    try {
      OptimizerState::load(file);
      ADD_FAILURE() << "no InputError for " << file;
    } catch (const InputError& e) {
      const std::string msg = e.what();
      EXPECT_NE(msg.find(file), std::string::npos) << msg;
      for (const auto& p : parts)
        EXPECT_NE(msg.find(p), std::string::npos) << "'" << p << "' not in: " << msg;
    }
  }
  void expect_error(const SafetensorsWriter& w, const std::vector<std::string>& parts) {
    const std::string p = path();
    w.write(p);
    expect_error(p, parts);
  }

  test::TempDir dir_;
  int n_ = 0;
};

TEST_F(StateFileErrors, TheBaseFileIsValid) {
  const std::string p = path();
  writer().write(p);
  const OptimizerState s = OptimizerState::load(p);
  EXPECT_EQ(s.step, 5);
  EXPECT_EQ(s.ndim.at("a"), 2);
  EXPECT_EQ(s.master.at("a"), (std::vector<float>{1, 2, 3}));
}

TEST_F(StateFileErrors, MissingExtraAndMisShapedTensors) {
  expect_error(writer(false), {"'v.b'", "missing"});
  auto w = writer();
  w.add_f32("master.c", {1}, {1});
  expect_error(w, {"'master.c'", "'c'", "ndim"});
  w = writer();
  w.add_f32("other", {1}, {1});
  expect_error(w, {"'other'", "unexpected"});
  w = writer(false);
  w.add_f32("v.b", {3}, {0, 0, 0});
  expect_error(w, {"'v.b'", "3 values", "2"});
  w = writer(false);
  w.add_f32("v.b", {1, 2}, {0, 0});
  expect_error(w, {"'v.b'", "2 dims"});
  w = writer(false);
  w.add_bf16("v.b", {2}, {0, 0});
  expect_error(w, {"'v.b'", "BF16", "F32"});
  // A name listed in ndim without tensors.
  w = writer();
  w.set_metadata("ndim", R"({"a": 2, "b": 1, "c": 1})");
  expect_error(w, {"'master.c'", "missing"});
}

TEST_F(StateFileErrors, MetadataFormatVersionStep) {
  auto w = writer();
  w.set_metadata("format", "something-else");
  expect_error(w, {"'format'", "something-else", "dsv4-optimizer"});
  w = writer();
  w.set_metadata("version", "2");
  expect_error(w, {"version 2", "newer"});
  w = writer();
  w.set_metadata("version", "one");
  expect_error(w, {"'version'", "one"});
  w = writer();
  w.set_metadata("step", "-3");
  expect_error(w, {"'step'", "-3"});
  w = writer();
  w.set_metadata("ndim", "{\"a\": 2, ");
  expect_error(w, {"'ndim'", "JSON"});
  w = writer();
  w.set_metadata("ndim", R"({"a": 2, "b": -1})");
  expect_error(w, {"'ndim'", "'b'"});
  SafetensorsWriter bare;
  bare.add_f32("master.a", {1}, {1});
  expect_error(bare, {"'format'", "missing"});
}

TEST_F(StateFileErrors, TruncatedCorruptOrMissingFile) {
  const std::string good = path();
  writer().write(good);
  const auto size = std::filesystem::file_size(good);
  std::ifstream in(good, std::ios::binary);
  std::string bytes((std::istreambuf_iterator<char>(in)), {});

  const std::string truncated = path();
  std::ofstream(truncated, std::ios::binary) << bytes.substr(0, size - 7);
  expect_error(truncated, {});
  const std::string header_cut = path();
  std::ofstream(header_cut, std::ios::binary) << bytes.substr(0, 20);
  expect_error(header_cut, {});
  const std::string garbage = path();
  std::ofstream(garbage, std::ios::binary) << "this is not a safetensors file at all";
  expect_error(garbage, {});
  expect_error(dir_ / "absent.safetensors", {});
}

TEST(OptimizerStateFile, SaveRefusesAnInconsistentState) {
  test::TempDir dir;
  OptimizerState s;
  s.master["w"] = {1, 2};
  s.m["w"] = {0, 0};
  s.v["w"] = {0};
  s.ndim["w"] = 2;
  try {
    s.save(dir / "x.safetensors");
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("'w'"), std::string::npos) << e.what();
  }
  s.v["w"] = {0, 0};
  s.m["orphan"] = {1};
  EXPECT_THROW(s.save(dir / "x.safetensors"), Error);
  s.m.erase("orphan");
  s.ndim.erase("w");
  EXPECT_THROW(s.save(dir / "x.safetensors"), Error);
  EXPECT_FALSE(std::filesystem::exists(dir / "x.safetensors"));
}

// ---- the gradient tree ---------------------------------------------------------------------------

TensorSet add_sets(const TensorSet& a, const TensorSet& b) {
  TensorSet out = a;
  for (auto& [name, x] : out)
    for (size_t i = 0; i < x.size(); ++i) x[i] = a.at(name)[i] + b.at(name)[i];
  return out;
}

// The perfect pairwise tree over x[lo, lo + size), size a power of two.
TensorSet pairwise(const std::vector<TensorSet>& x, size_t lo, size_t size) {
  if (size == 1) return x[lo];
  return add_sets(pairwise(x, lo, size / 2), pairwise(x, lo + size / 2, size / 2));
}

// The tree of grad_tree.h written out: n splits into power-of-two blocks by its binary digits,
// largest (oldest) first; each block is a pairwise tree; the blocks are added newest to oldest.
TensorSet reference_tree(const std::vector<TensorSet>& x) {
  std::vector<TensorSet> blocks;
  size_t lo = 0;
  for (int bit = 62; bit >= 0; --bit) {
    const size_t size = size_t(1) << bit;
    if (x.size() & size) {
      blocks.push_back(pairwise(x, lo, size));
      lo += size;
    }
  }
  TensorSet acc = blocks.back();
  for (size_t k = blocks.size() - 1; k-- > 0;) acc = add_sets(blocks[k], acc);
  return acc;
}

std::vector<TensorSet> random_samples(std::mt19937_64& g, size_t n) {
  std::vector<TensorSet> x;
  std::uniform_real_distribution<float> scale(-6.0f, 6.0f);
  for (size_t i = 0; i < n; ++i) {
    TensorSet s;
    // Mixed magnitudes so that the summation order shows in the bits.
    for (const auto& [name, size] : std::vector<std::pair<std::string, size_t>>{{"a", 5}, {"b.weight", 13}}) {
      auto v = randn(g, size);
      for (auto& e : v) e *= std::exp2(scale(g));
      s[name] = v;
    }
    x.push_back(s);
  }
  return x;
}

TensorSet tree_sum(const std::vector<TensorSet>& x) {
  GradTree t;
  for (const auto& s : x) t.add(s);
  EXPECT_EQ(t.count(), int64_t(x.size()));
  return t.finish();
}

TEST(GradTree, EqualsTheRecursiveReferenceBitwise) {
  auto g = test::rng_for("GradTree.Reference");
  bool order_shows = false;
  for (size_t n = 1; n <= 9; ++n) {
    SCOPED_TRACE(n);
    const auto x = random_samples(g, n);
    const TensorSet got = tree_sum(x);
    const TensorSet want = reference_tree(x);
    ASSERT_EQ(got.size(), want.size());
    for (const auto& [name, v] : want) {
      EXPECT_TRUE(test::bitwise_equal(got.at(name), v)) << name;
      EXPECT_FALSE(test::all_zero(v));
    }
    // The test can tell orders apart: a left-to-right sum differs somewhere.
    TensorSet seq = x[0];
    for (size_t i = 1; i < n; ++i) seq = add_sets(seq, x[i]);
    for (const auto& [name, v] : want) order_shows = order_shows || !test::bitwise_equal(seq.at(name), v);
  }
  EXPECT_TRUE(order_shows);
}

// The documented shapes: n = 3 is (x0 + x1) + x2, n = 7 is ((x0+x1)+(x2+x3)) + ((x4+x5) + x6).
TEST(GradTree, SmallTreesWrittenOut) {
  auto g = test::rng_for("GradTree.Small");
  const auto x = random_samples(g, 7);
  auto v = [&](size_t i) { return x[i].at("a"); };
  auto add = [](const std::vector<float>& a, const std::vector<float>& b) {
    std::vector<float> o(a.size());
    for (size_t i = 0; i < a.size(); ++i) o[i] = a[i] + b[i];
    return o;
  };
  const auto t3 = tree_sum({x.begin(), x.begin() + 3});
  EXPECT_TRUE(test::bitwise_equal(t3.at("a"), add(add(v(0), v(1)), v(2))));
  const auto t7 = tree_sum(x);
  EXPECT_TRUE(test::bitwise_equal(t7.at("a"),
                                  add(add(add(v(0), v(1)), add(v(2), v(3))), add(add(v(4), v(5)), v(6)))));
}

TEST(GradTree, CloseToTheFloat64Sum) {
  auto g = test::rng_for("GradTree.Float64");
  for (size_t n : {1, 2, 5, 16, 23, 40}) {
    SCOPED_TRACE(n);
    const auto x = random_samples(g, n);
    const TensorSet got = tree_sum(x);
    // Every leaf is at depth <= 2 * (floor(log2 n) + 1) (its block's depth plus the final chain).
    const double depth = 2 * (std::floor(std::log2(double(n))) + 1);
    for (const auto& [name, v] : got)
      for (size_t i = 0; i < v.size(); ++i) {
        double exact = 0, mag = 0;
        for (const auto& s : x) {
          exact += s.at(name)[i];
          mag += std::fabs(s.at(name)[i]);
        }
        EXPECT_LE(std::fabs(v[i] - exact), depth * 0x1p-24 * mag) << name << " " << i;
      }
  }
}

TEST(GradTree, SameForAnyThreadCount) {
  auto g = test::rng_for("GradTree.Threads");
  std::vector<TensorSet> x;
  for (int i = 0; i < 6; ++i) x.push_back({{"big", randn(g, 70001)}, {"small", randn(g, 3)}});
  const int saved = omp_get_max_threads();
  omp_set_num_threads(1);
  const TensorSet a = tree_sum(x);
  omp_set_num_threads(3);
  const TensorSet b = tree_sum(x);
  omp_set_num_threads(saved);
  for (const auto& [name, v] : a) EXPECT_TRUE(test::bitwise_equal(v, b.at(name))) << name;
  EXPECT_TRUE(test::bitwise_equal(a.at("big"), reference_tree(x).at("big")));
}

TEST(GradTree, EmptyAndReuse) {
  GradTree t;
  EXPECT_TRUE(t.finish().empty());
  EXPECT_EQ(t.count(), 0);
  t.add({{"a", {1.0f, 2.0f}}});
  t.add({{"a", {0.5f, 0.25f}}});
  EXPECT_EQ(t.count(), 2);
  EXPECT_EQ(t.finish().at("a"), (std::vector<float>{1.5f, 2.25f}));
  EXPECT_EQ(t.count(), 0);
  // After finish() a new sum starts, with new names allowed.
  t.add({{"b", {3.0f}}});
  EXPECT_EQ(t.finish().at("b"), (std::vector<float>{3.0f}));
}

TEST(GradTree, MismatchedSetsNameTheTensor) {
  auto expect_error = [](const TensorSet& second, const std::vector<std::string>& parts) {
    GradTree t;
    t.add({{"w", {1, 2, 3}}, {"b", {1}}});
    t.add({{"w", {1, 2, 3}}, {"b", {1}}});  // merged into a level-1 sum
    try {
      t.add(second);
      ADD_FAILURE() << "no error";
    } catch (const Error& e) {
      const std::string msg = e.what();
      EXPECT_NE(msg.find("sample 2"), std::string::npos) << msg;
      for (const auto& p : parts)
        EXPECT_NE(msg.find(p), std::string::npos) << "'" << p << "' not in: " << msg;
    }
    EXPECT_EQ(t.count(), 2);
  };
  expect_error({{"w", {1, 2}}, {"b", {1}}}, {"'w'", "2 values", "3"});
  expect_error({{"w", {1, 2, 3}}}, {"'b'", "missing"});
  expect_error({{"w", {1, 2, 3}}, {"b", {1}}, {"c", {1}}}, {"'c'"});
}

}  // namespace
}  // namespace dsv4
