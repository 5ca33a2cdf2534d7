// The indexer's KL objective in the training step (MODEL.md §5.5, docs/TRAINING.md "Indexer KL"): its
// gradient against directional finite differences of the real forward's KL, that it changes nothing
// but the indexer's gradients, determinism across threads and micro-batches byte for byte, a short
// run that lowers it (recorded and replayed bit for bit), its settings in the trace, and the refusals.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>

#include <fmt/format.h>

#include "model/backward.h"
#include "model/checkpoint.h"
#include "model/decision_sets.h"
#include "model/error.h"
#include "model/forward.h"
#include "model/tape.h"
#include "replay/replay.h"
#include "test_util.h"
#include "tiny_model.h"
#include "train/record.h"
#include "train/step.h"
#include "train_test_util.h"

namespace dsv4 {
namespace {

using test::bitwise_equal;
using train::ParamGroup;
using train::TrainSample;

std::vector<TrainSample> batch_of(int n, int vocab) {
  std::vector<TrainSample> b;
  for (int i = 0; i < n; ++i)
    b.push_back(test::make_sample("s" + std::to_string(i), 9 + 7 * i, 12 + 5 * (i % 3), vocab, 300 + uint64_t(i),
                                  i % 2 ? -0.5 : 1.0));
  return b;
}

train::TrainStepOptions kl_options(double coeff) {
  train::TrainStepOptions o;
  o.adamw.lr = 1e-3;
  o.indexer_kl_coeff = coeff;
  o.groups.trained.insert(ParamGroup::indexer);
  return o;
}

train::TrainStepResult run_step(const Weights& w, const std::vector<TrainSample>& s, const train::TrainStepOptions& o,
                                Weights* after = nullptr) {
  train::OptimizerState st = train::fresh_optimizer_state(w, o.groups);
  Weights tmp = w;
  return train::train_step(w, s, st, o, {}, after ? after : &tmp);
}

bool is_indexer(const std::string& name) {
  return train::param_group(name) == ParamGroup::indexer;
}

// The sum over C4 layers and rows of the KL of one sequence (row weight 1), and optionally the
// gradient of that sum with respect to the indexer's weights. `forced`: the decisions to use.
double kl_and_grad(const Weights& w, const std::vector<int32_t>& toks, const Overrides* forced, GradSet* grads,
                   DecisionLog* log = nullptr) {
  auto be = backend::make_backend(Device::cpu, w);
  Tape tape;
  tape.keep_indexer = true;
  RunOptions ro;
  ro.overrides = forced;
  ro.observer = log;
  forward_with_tape(*be, w, 0, toks, ro, tape);
  BackwardOptions bo;
  bo.trainable = [&](const std::string& n) { return grads && is_indexer(n); };
  bo.indexer_kl.enabled = true;
  bo.indexer_kl.row_weight = 1.0f;
  double sum = 0;
  bo.on_indexer_kl = [&](int, double s) { sum += s; };
  GradSet g = backward(*be, w, tape, 0, std::vector<float>(toks.size() - 1, 0.0f), ro, bo);
  if (grads) *grads = std::move(g);
  return sum;
}

// As the whole-model check of test_train_step.cpp, for f = the KL sum: the indexer's selections are
// forced to the unperturbed ones (so the target, which only the main attention decides, is fixed and
// f is smooth up to the forward's bf16 / FP8 roundings, straight-through in the backward). Per kind of
// indexer weight: a step along its gradient aimed at a change of 0.5 in f with at most 5% relative
// change of any tensor; central difference against the gradient's prediction.
TEST(IndexerKlObjective, DirectionalDerivativesOfTheIndexerWeights) {
  for (const std::string preset : {"tiny", "tiny-b"}) {
    const Weights& w = test::tiny_by_name(preset);
    const std::vector<int32_t> toks = test::seq_tokens(200, w.config().vocab_size, 17);
    DecisionLog log;
    GradSet grads;
    const double f0 = kl_and_grad(w, toks, nullptr, &grads, &log);
    ASSERT_GT(f0, 0.0) << preset;
    const Overrides forced = log.to_overrides();
    EXPECT_EQ(kl_and_grad(w, toks, &forced, nullptr), f0) << "forcing the free choice changes nothing";

    std::map<std::string, std::vector<std::string>> by_kind;
    for (const auto& [name, g] : grads) {
      ASSERT_TRUE(is_indexer(name)) << name;
      by_kind[param_site(name).kind].push_back(name);
    }
    int judged = 0;
    auto f = [&](const Weights& ww) { return kl_and_grad(ww, toks, &forced, nullptr); };
    for (const auto& [kind, names] : by_kind) {
      const auto d = test::directional_step(w, grads, names, 0.5, 0.05, f);
      if (!d) continue;
      ++judged;
      EXPECT_NEAR(d->actual / d->predicted, 1.0, 0.25)
          << preset << " " << kind << ": central difference " << d->actual << ", gradient predicts " << d->predicted;
    }
    std::printf("%s: KL %.6g, %d kinds of indexer weights judged of %zu\n", preset.c_str(), f0, judged,
                by_kind.size());
    EXPECT_GE(judged, 4) << preset;
  }
}

// The objective is detached from the rest of the model: every other gradient is bit-identical with
// it on or off, every indexer tensor of every C4 layer receives a gradient, and a frozen indexer
// still reports the same KL.
TEST(IndexerKlObjective, ChangesOnlyTheIndexerGradients) {
  const Weights& w = test::tiny();
  const std::vector<TrainSample> s = batch_of(3, w.config().vocab_size);
  const train::TrainStepResult off = run_step(w, s, train::TrainStepOptions{});
  const train::TrainStepResult on = run_step(w, s, kl_options(0.25));
  int indexer_tensors = 0;
  for (const auto& [name, g] : on.grads) {
    if (is_indexer(name)) {
      ++indexer_tensors;
      EXPECT_FALSE(test::all_zero(g)) << name;
      continue;
    }
    ASSERT_TRUE(off.grads.count(name)) << name;
    EXPECT_TRUE(bitwise_equal(g, off.grads.at(name))) << name;
  }
  int expected = 0;
  for (const auto& [name, t] : w.tensors()) expected += is_indexer(name) && !t.f.empty();
  EXPECT_EQ(indexer_tensors, expected);
  EXPECT_GT(expected, 0);
  EXPECT_EQ(std::memcmp(&off.metrics.loss, &on.metrics.loss, sizeof(double)), 0);
  EXPECT_GT(on.indexer_kl, 0.0);
  EXPECT_EQ(off.indexer_kl, 0.0);

  train::TrainStepOptions frozen = kl_options(0.25);
  frozen.groups.trained.erase(ParamGroup::indexer);
  const train::TrainStepResult metric_only = run_step(w, s, frozen);
  for (const auto& [name, g] : metric_only.grads) EXPECT_FALSE(is_indexer(name)) << name;
  EXPECT_EQ(std::memcmp(&metric_only.indexer_kl, &on.indexer_kl, sizeof(double)), 0);
}

TEST(IndexerKlObjective, IsDeterministicAcrossThreadsAndMicroBatches) {
  const Weights& w = test::tiny_by_name("tiny-b");
  const std::vector<TrainSample> s = batch_of(4, w.config().vocab_size);
  train::TrainStepOptions o = kl_options(0.5);
  o.indexer_kl_target = "heads_sum";
  o.threads = 1;
  Weights a1 = w;
  const train::TrainStepResult r1 = run_step(w, s, o, &a1);
  for (int threads : {2, 1})
    for (int mb : {2, 4}) {
      o.threads = threads;
      o.micro_batch = mb;
      Weights a2 = w;
      const train::TrainStepResult r2 = run_step(w, s, o, &a2);
      SCOPED_TRACE(testing::Message() << "threads " << threads << " micro-batch " << mb);
      ASSERT_EQ(r1.grads.size(), r2.grads.size());
      for (const auto& [name, g] : r1.grads) EXPECT_TRUE(bitwise_equal(g, r2.grads.at(name))) << name;
      EXPECT_EQ(std::memcmp(&r1.indexer_kl, &r2.indexer_kl, sizeof(double)), 0);
      for (const auto& [name, t] : a1.tensors()) EXPECT_TRUE(bitwise_equal(t.f, a2.get(name).f)) << name;
    }
}

// Training the indexer alone on its objective lowers it; every step is recorded and replays bit for
// bit (the trace holds the objective's settings and its metric).
TEST(IndexerKlObjective, ShortRunLowersTheKlAndReplays) {
  Weights w = test::tiny();
  const std::vector<TrainSample> s = batch_of(2, w.config().vocab_size);
  train::TrainStepOptions o = kl_options(1.0);
  o.groups.trained = {ParamGroup::indexer};
  o.adamw.lr = 2e-3;
  o.adamw.weight_decay = 0;
  train::OptimizerState st = train::fresh_optimizer_state(w, o.groups);
  test::TempDir d;
  std::vector<double> kl;
  const int steps = 6;
  for (int step = 0; step < steps; ++step) {
    train::RecordTrainOptions ro;
    ro.seed = 3;
    if (step > 0) {
      ro.optimizer_state_path = d / fmt::format("state{}.safetensors", step);
      st.save(ro.optimizer_state_path);
    }
    Weights next = w;
    const train::TrainStepResult r =
        train::record_train_step(w, s, st, o, {}, &next, d / fmt::format("step{}.h5", step), ro);
    kl.push_back(r.indexer_kl);
    next.save(d / fmt::format("model{}", step + 1));
    w = open_checkpoint(d / fmt::format("model{}", step + 1));
  }
  std::string trail;
  for (double v : kl) trail += fmt::format(" {:.5g}", v);
  std::printf("indexer KL per step:%s\n", trail.c_str());
  EXPECT_LT(kl.back(), 0.8 * kl.front()) << "indexer KL per step:" << trail;
  for (int step = 0; step < steps; ++step) {
    const ReplayReport rep = replay_trace(d / fmt::format("step{}.h5", step), ReplayOptions{});
    ASSERT_EQ(rep.steps.size(), 1u);
    EXPECT_TRUE(rep.identical()) << "step " << step;
  }
}

TEST(IndexerKlObjective, SettingsRoundTripAndOlderSettingsReadAsOff) {
  train::TrainStepOptions o = kl_options(0.125);
  o.indexer_kl_target = "heads_sum";
  const train::TrainStepOptions back = train::TrainStepOptions::from_json(o.to_json());
  EXPECT_EQ(back.indexer_kl_coeff, 0.125);
  EXPECT_EQ(back.indexer_kl_target, "heads_sum");
  EXPECT_TRUE(back.groups.trained.count(ParamGroup::indexer));
  const train::TrainStepOptions old = train::TrainStepOptions::from_json(train::TrainStepOptions{}.to_json());
  EXPECT_EQ(old.indexer_kl_coeff, 0.0);
  EXPECT_EQ(train::TrainStepOptions{}.to_json().find("indexer_kl"), std::string::npos);
}

TEST(IndexerKlObjective, RefusesTheIndexerWithoutItsObjectiveAndBadSettings) {
  const Weights& w = test::tiny();
  const std::vector<TrainSample> s = batch_of(1, w.config().vocab_size);
  train::TrainStepOptions o = kl_options(0.0);
  try {
    run_step(w, s, o);
    FAIL() << "the indexer trained without its objective";
  } catch (const InputError& e) {
    EXPECT_NE(std::string(e.what()).find("--indexer-kl"), std::string::npos) << e.what();
  }
  o = kl_options(-1.0);
  EXPECT_THROW(run_step(w, s, o), InputError);
  o = kl_options(std::nan(""));
  EXPECT_THROW(run_step(w, s, o), InputError);
  o = kl_options(1.0);
  o.indexer_kl_target = "mean";
  EXPECT_THROW(run_step(w, s, o), InputError);
}

}  // namespace
}  // namespace dsv4
