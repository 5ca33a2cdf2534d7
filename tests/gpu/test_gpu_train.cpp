// The training step on the CUDA backend against the CPU reference: the same per-sample activation
// gradients, summed gradients, loss, updated weights and optimizer state, bit for bit, for the tiny
// and tiny-b presets, with and without forced decisions, full and legacy mHC backward.
#include <gtest/gtest.h>

#include <cstring>
#include <random>

#include "gpu_test_util.h"
#include "model/device.h"
#include "train/step.h"

namespace dsv4 {
namespace {

std::vector<train::TrainSample> samples(int vocab) {
  std::mt19937_64 g(3);
  std::vector<train::TrainSample> out;
  const int sizes[][2] = {{5, 9}, {30, 50}, {3, 140}};
  for (int i = 0; i < 3; ++i) {
    train::TrainSample s;
    s.id = "s" + std::to_string(i);
    for (int t = 0; t < sizes[i][0]; ++t) s.prompt.push_back(int32_t(g() % uint64_t(vocab)));
    for (int t = 0; t < sizes[i][1]; ++t) s.response.push_back(int32_t(g() % uint64_t(vocab)));
    s.reward = double(i % 2);
    s.group = "g";
    out.push_back(std::move(s));
  }
  return out;
}

struct StepRun {
  train::TrainStepResult r;
  Weights after;
  train::OptimizerState state;
  std::vector<std::pair<std::string, std::vector<float>>> act;  // activation gradients in order
};

StepRun run(const Weights& w, const std::vector<train::TrainSample>& s, Device dev, bool mixer) {
  train::TrainStepOptions o;
  o.device = dev;
  o.train_mixer = mixer;
  o.adamw.lr = 1e-3;
  o.groups.train("router");
  StepRun x{{}, w, train::fresh_optimizer_state(w, o.groups), {}};
  train::TrainStepHooks h;
  h.on_grad = [&](const GradRecord& g) {
    x.act.emplace_back(std::to_string(g.seq) + ":" + std::to_string(g.layer) + ":" + g.name,
                       std::vector<float>(g.values(), g.values() + g.rows * g.cols));
  };
  x.r = train::train_step(w, s, x.state, o, h, &x.after);
  return x;
}

bool same(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && (a.empty() || std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0);
}

TEST(GpuTrain, StepEqualsTheCpuStep) {
  DSV4_REQUIRE_CUDA_DEVICE();
  for (const char* preset : {"tiny", "tiny-b"}) {
    for (bool mixer : {true, false}) {
      SCOPED_TRACE(std::string(preset) + (mixer ? " full mHC" : " legacy mHC"));
      const Weights w = Weights::init(dsv4::preset(preset), 7);
      const auto s = samples(w.config().vocab_size);
      const StepRun c = run(w, s, Device::cpu, mixer), g = run(w, s, Device::cuda, mixer);
      ASSERT_EQ(c.act.size(), g.act.size());
      for (size_t i = 0; i < c.act.size(); ++i) {
        ASSERT_EQ(c.act[i].first, g.act[i].first);
        ASSERT_TRUE(same(c.act[i].second, g.act[i].second)) << "first differing gradient: " << c.act[i].first;
      }
      ASSERT_EQ(c.r.grads.size(), g.r.grads.size());
      for (const auto& [name, v] : c.r.grads) EXPECT_TRUE(same(v, g.r.grads.at(name))) << name;
      EXPECT_EQ(std::memcmp(&c.r.metrics.loss, &g.r.metrics.loss, sizeof(double)), 0);
      for (const auto& [name, t] : c.after.tensors()) EXPECT_TRUE(same(t.f, g.after.get(name).f)) << name;
      for (const auto& [name, v] : c.state.m) EXPECT_TRUE(same(v, g.state.m.at(name))) << name;
      for (const auto& [name, v] : c.state.v) EXPECT_TRUE(same(v, g.state.v.at(name))) << name;
    }
  }
}

}  // namespace
}  // namespace dsv4
