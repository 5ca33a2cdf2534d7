// The training step on the CUDA backend against the CPU reference: the same per-sample activation
// gradients, summed gradients, loss, updated weights and optimizer state, bit for bit, for the tiny
// and tiny-b presets, with and without forced decisions, full and legacy mHC backward.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <cstring>
#include <random>

#include "gpu_test_util.h"
#include "model/device.h"
#include "train/step.h"
#ifdef DSV4_HAVE_NCCL
#include "parallel/nccl_communicator.h"
#endif

namespace dsv4 {
namespace {

std::vector<train::TrainSample> samples(int vocab) {
  std::mt19937_64 g(3);
  std::vector<train::TrainSample> out;
  const int sizes[][2] = {{5, 9}, {30, 50}, {3, 140}};
  for (int i = 0; i < 3; ++i) {
    train::TrainSample s;
    s.id = fmt::format("s{}", i);
    for (int t = 0; t < sizes[i][0]; ++t) s.prompt.push_back(int32_t(g() % uint64_t(vocab)));
    for (int t = 0; t < sizes[i][1]; ++t) s.response.push_back(int32_t(g() % uint64_t(vocab)));
    s.reward = double(i % 2);
    s.group = std::string(1, 'g');  // GCC 12 warns falsely (-Wrestrict) on assigning the literal
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

// variant 0: full mHC; 1: legacy mHC; 2: full mHC with the mixer frozen and the indexer trained by
// its KL objective.
StepRun run(const Weights& w, const std::vector<train::TrainSample>& s, Device dev, int variant,
            Communicator* experts = nullptr) {
  train::TrainStepOptions o;
  o.device = dev;
  o.experts = experts;
  o.train_mixer = variant != 1;
  o.adamw.lr = 1e-3;
  o.groups.train("router");
  if (variant == 2) {
    o.groups.freeze("mixer");
    o.indexer_kl_coeff = 0.5;
    o.groups.trained.insert(train::ParamGroup::indexer);
  }
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

#ifdef DSV4_HAVE_NCCL
// train-step --ep on the GPU with one NCCL rank: the expert-parallel forward and backward (this rank's
// experts' parts, the pairs' gradients and the experts' weight gradients gathered through NCCL) give
// the local GPU step's activation gradients, summed gradients and update, bit for bit.
TEST(GpuTrain, NcclOneRankStepIsTheLocalStep) {
  DSV4_REQUIRE_CUDA_DEVICE();
  const std::unique_ptr<Communicator> comm = nccl_world(nullptr);
  for (const char* preset : {"tiny", "tiny-b"}) {
    SCOPED_TRACE(preset);
    const Weights w = Weights::init(dsv4::preset(preset), 7);
    const auto s = samples(w.config().vocab_size);
    const StepRun a = run(w, s, Device::cuda, 0), b = run(w, s, Device::cuda, 0, comm.get());
    ASSERT_EQ(a.act.size(), b.act.size());
    for (size_t i = 0; i < a.act.size(); ++i)
      ASSERT_TRUE(same(a.act[i].second, b.act[i].second)) << "first differing gradient: " << a.act[i].first;
    ASSERT_EQ(a.r.grads.size(), b.r.grads.size());
    for (const auto& [name, v] : a.r.grads) EXPECT_TRUE(same(v, b.r.grads.at(name))) << name;
    for (const auto& [name, v] : a.state.master) EXPECT_TRUE(same(v, b.state.master.at(name))) << name;
  }
}
#endif

TEST(GpuTrain, StepEqualsTheCpuStep) {
  DSV4_REQUIRE_CUDA_DEVICE();
  for (const char* preset : {"tiny", "tiny-b"}) {
    for (int variant : {0, 1, 2}) {
      SCOPED_TRACE(std::string(preset) + (variant == 0 ? " full mHC" : variant == 1 ? " legacy mHC" : " indexer KL"));
      const Weights w = Weights::init(dsv4::preset(preset), 7);
      const auto s = samples(w.config().vocab_size);
      const StepRun c = run(w, s, Device::cpu, variant), g = run(w, s, Device::cuda, variant);
      ASSERT_EQ(c.act.size(), g.act.size());
      for (size_t i = 0; i < c.act.size(); ++i) {
        ASSERT_EQ(c.act[i].first, g.act[i].first);
        ASSERT_TRUE(same(c.act[i].second, g.act[i].second)) << "first differing gradient: " << c.act[i].first;
      }
      ASSERT_EQ(c.r.grads.size(), g.r.grads.size());
      for (const auto& [name, v] : c.r.grads) EXPECT_TRUE(same(v, g.r.grads.at(name))) << name;
      EXPECT_EQ(std::memcmp(&c.r.metrics.loss, &g.r.metrics.loss, sizeof(double)), 0);
      EXPECT_EQ(std::memcmp(&c.r.indexer_kl, &g.r.indexer_kl, sizeof(double)), 0);
      if (variant == 2) {
        EXPECT_GT(c.r.indexer_kl, 0.0);
      }
      for (const auto& [name, t] : c.after.tensors()) EXPECT_TRUE(same(t.f, g.after.get(name).f)) << name;
      for (const auto& [name, v] : c.state.m) EXPECT_TRUE(same(v, g.state.m.at(name))) << name;
      for (const auto& [name, v] : c.state.v) EXPECT_TRUE(same(v, g.state.v.at(name))) << name;
    }
  }
}

}  // namespace
}  // namespace dsv4
