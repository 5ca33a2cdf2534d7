// The training step (docs/TRAINING.md): the training forward equals the forward bit for bit; the
// whole-model backward against directional finite differences of the real forward; the determinism
// properties (runs, threads, micro-batch sizes, a sample alone or in a batch) byte for byte; what is
// trained and frozen; a short training run whose loss falls; R3 with the Overrides seam.
#include <gtest/gtest.h>
#include <omp.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>

#include <fmt/format.h>

#include "model/backward.h"
#include "model/checkpoint.h"
#include "model/collect.h"
#include "model/decision_sets.h"
#include "model/error.h"
#include "model/profile.h"
#include "model/forward.h"
#include "model/tape.h"
#include "test_util.h"
#include "train_test_util.h"
#include "tiny_model.h"
#include "train/grad_tree.h"
#include "replay/replay.h"
#include "train/record.h"
#include "train/step.h"

namespace dsv4 {
namespace {

using test::bitwise_equal;
using train::TrainSample;

using test::make_sample;
using test::seq_tokens;

std::vector<TrainSample> batch_of(int n, int vocab) {
  std::vector<TrainSample> b;
  for (int i = 0; i < n; ++i)
    b.push_back(make_sample("s" + std::to_string(i), 5 + 3 * i, 9 + 5 * (i % 3), vocab, 100 + uint64_t(i),
                            i % 2 ? -0.75 : 1.25));
  return b;
}

train::TrainStepResult run_step(const Weights& w, const std::vector<TrainSample>& s, train::TrainStepOptions o,
                                Weights* after = nullptr, train::OptimizerState* st = nullptr) {
  train::OptimizerState fresh = train::fresh_optimizer_state(w, o.groups);
  train::OptimizerState& state = st ? *st : fresh;
  Weights tmp = w;
  return train::train_step(w, s, state, o, {}, after ? after : &tmp);
}

void expect_same_grads(const train::TensorSet& a, const train::TensorSet& b) {
  ASSERT_EQ(a.size(), b.size());
  for (const auto& [name, g] : a) {
    ASSERT_TRUE(b.count(name)) << name;
    EXPECT_TRUE(bitwise_equal(g, b.at(name))) << name;
  }
}

TEST(TrainForward, TapeForwardEqualsForward) {
  for (const std::string preset : {"tiny", "tiny-b"}) {
    const Weights& w = test::tiny_by_name(preset);
    const std::vector<int32_t> toks = seq_tokens(301, w.config().vocab_size, 3);
    RunOptions ro;
    const ForwardResult ref = forward(w, {toks}, ro);
    auto be = backend::make_backend(Device::cpu, w);
    Tape tape;
    const SequenceResult r = forward_with_tape(*be, w, 0, toks, ro, tape);
    EXPECT_TRUE(bitwise_equal(ref.seqs[0].logprobs, r.logprobs)) << preset;
    EXPECT_EQ(tape.attn.size(), size_t(w.config().num_hidden_layers));
  }
}

// f(w) = sum_t c_t * logprob_t(w). The gradient from backward() against the central difference
// f(w+) - f(w-), w± = round(w ± alpha * g) along the gradient of one parameter group (the rounding to
// each tensor's storage dtype included: the prediction uses the realised w+ - w-). The forward's
// discrete decisions are forced to the unperturbed ones (as R3 does), so f is smooth up to the
// forward's bf16 roundings, which the backward treats as identities and which leave a noise of about
// 0.02 in f at T = 200. The step aims at a change of 0.5 in f with at most 5% relative change of
// any tensor; kinds of tensors whose gradient cannot move f by 0.2 within that limit are near the
// noise and are not judged (most kinds are, and the test requires it).
TEST(TrainBackward, DirectionalDerivativesOfTheWholeModel) {
  for (const std::string preset : {"tiny", "tiny-b"}) {
    const Weights& w = test::tiny_by_name(preset);
    const ModelConfig& c = w.config();
    const std::vector<int32_t> toks = seq_tokens(200, c.vocab_size, 5);
    std::mt19937_64 g(11);
    std::uniform_real_distribution<float> u(-1.0f, 1.0f);
    std::vector<float> coef(toks.size() - 1);
    for (auto& x : coef) x = u(g);
    DecisionLog decisions;
    RunOptions ro;
    ro.observer = &decisions;
    auto be = backend::make_backend(Device::cpu, w);
    Tape tape;
    forward_with_tape(*be, w, 0, toks, ro, tape);
    const Overrides forced_ids = decisions.to_overrides();
    RunOptions forced;
    forced.overrides = &forced_ids;
    auto f = [&](const Weights& ww) {
      const ForwardResult r = forward(ww, {toks}, forced);
      double s = 0;
      for (size_t t = 0; t < coef.size(); ++t) s += double(coef[t]) * double(r.seqs[0].logprobs[t]);
      return s;
    };
    train::TrainGroups all = train::TrainGroups::miles_default();
    all.train("router");
    BackwardOptions bo;
    bo.trainable = [&](const std::string& n) { return all.trains(n); };
    const GradSet grads = backward(*be, w, tape, 0, coef, RunOptions{}, bo);

    int judged = 0;
    auto check = [&](const std::vector<std::string>& names, const std::string& what) {
      const auto d = test::directional_step(w, grads, names, 0.5, 0.2, f);
      if (!d) return;
      ++judged;
      EXPECT_NEAR(d->actual / d->predicted, 1.0, 0.25)
          << preset << " " << what << ": central difference " << d->actual << ", gradient predicts " << d->predicted;
    };
    std::map<std::string, std::vector<std::string>> by_kind;  // one group per tensor kind, all layers
    for (const auto& [name, gv] : grads) {
      by_kind[param_site(name).kind].push_back(name);
    }
    for (const auto& [kind, names] : by_kind) check(names, kind);
    std::printf("%s: %d kinds of weights judged\n", preset.c_str(), judged);
    EXPECT_GE(judged, 15) << preset << ": too few kinds of weights above the noise";
  }
}

TEST(TrainStep, IsDeterministicAcrossRunsThreadsAndMicroBatches) {
  const Weights& w = test::tiny();
  const std::vector<TrainSample> s = batch_of(4, w.config().vocab_size);
  train::TrainStepOptions o;
  o.adamw.lr = 1e-3;
  o.threads = 1;
  Weights a1 = w;
  const train::TrainStepResult r1 = run_step(w, s, o, &a1);
  for (int threads : {1, 2}) {
    for (int mb : {1, 2, 4}) {
      o.threads = threads;
      o.micro_batch = mb;
      Weights a2 = w;
      const train::TrainStepResult r2 = run_step(w, s, o, &a2);
      SCOPED_TRACE(testing::Message() << "threads " << threads << " micro-batch " << mb);
      expect_same_grads(r1.grads, r2.grads);
      EXPECT_EQ(std::memcmp(&r1.stats.grad_norm, &r2.stats.grad_norm, sizeof(double)), 0);
      EXPECT_EQ(std::memcmp(&r1.metrics.loss, &r2.metrics.loss, sizeof(double)), 0);
      for (const auto& [name, t] : a1.tensors()) EXPECT_TRUE(bitwise_equal(t.f, a2.get(name).f)) << name;
    }
  }
}

// A sample's gradient is the same alone or in a batch: the batch's gradient is the fixed tree over
// the gradients of the samples computed one by one.
TEST(TrainStep, BatchGradientIsTheTreeOfSampleGradients) {
  const Weights& w = test::tiny();
  std::vector<TrainSample> s = batch_of(3, w.config().vocab_size);
  train::TrainStepOptions o;
  const train::TrainStepResult whole = run_step(w, s, o);
  int64_t n_tokens = 0;
  for (const auto& x : s) n_tokens += int64_t(x.response.size());
  train::GradTree tree;
  for (const TrainSample& x : s) {
    // Alone, with the batch's token count as the loss normaliser (scaled advantage keeps dlogp equal).
    auto be = backend::make_backend(Device::cpu, w);
    Tape tape;
    RunOptions ro;
    const SequenceResult fr = forward_with_tape(*be, w, 0, x.tokens(), ro, tape);
    train::SampleLogprobs sl;
    const int64_t P = int64_t(x.prompt.size());
    sl.logp.assign(fr.logprobs.begin() + (P - 1), fr.logprobs.end());
    sl.old = sl.logp;
    sl.advantage = *x.advantage;
    std::vector<std::vector<float>> dl;
    train::policy_loss(o.loss, {sl}, &dl, n_tokens);
    std::vector<float> d(fr.logprobs.size(), 0.0f);
    std::copy(dl[0].begin(), dl[0].end(), d.begin() + (P - 1));
    BackwardOptions bo;
    bo.trainable = [&](const std::string& n) { return o.groups.trains(n); };
    GradSet g = backward(*be, w, tape, 0, d, ro, bo);
    for (const auto& [name, gv] : whole.grads)
      if (!g.count(name)) g[name] = std::vector<float>(gv.size(), 0.0f);
    tree.add(std::move(g));
  }
  expect_same_grads(whole.grads, tree.finish());
}

TEST(TrainStep, TrainsTheMilesGroupsAndNothingElse) {
  const Weights& w = test::tiny();
  const std::vector<TrainSample> s = batch_of(2, w.config().vocab_size);
  train::TrainStepOptions o;
  o.adamw.lr = 1e-3;
  Weights after = w;
  const train::TrainStepResult r = run_step(w, s, o, &after);
  for (const auto& [name, t] : w.tensors()) {
    const train::ParamGroup g = train::param_group(name);
    const bool trained = o.groups.trains(name);
    EXPECT_EQ(r.grads.count(name) != 0, trained) << name;
    if (!trained) {
      EXPECT_TRUE(bitwise_equal(t.f, after.get(name).f)) << name << " (" << train::to_string(g) << ") changed";
      EXPECT_TRUE(bitwise_equal(t.i, after.get(name).i)) << name;
    }
  }
  for (const char* frozen : {"model.layers.2.mlp.gate.weight", "model.layers.2.mlp.gate.e_score_correction_bias",
                             "model.layers.1.self_attn.indexer.wq_b.weight"})
    EXPECT_EQ(r.grads.count(frozen), 0u) << frozen;
  // The sink, the compressor's ape and the mixer are trained, with a non-zero gradient.
  for (const char* trained : {"model.layers.1.self_attn.attn_sink", "model.layers.1.self_attn.compressor.ape",
                              "model.layers.2.hc_attn_fn", "model.hc_head_base", "lm_head.weight"}) {
    ASSERT_TRUE(r.grads.count(trained)) << trained;
    EXPECT_FALSE(test::all_zero(r.grads.at(trained))) << trained;
  }
}

TEST(TrainStep, LegacyMixerModeGivesTheMixerNoGradient) {
  const Weights& w = test::tiny();
  const std::vector<TrainSample> s = batch_of(2, w.config().vocab_size);
  train::TrainStepOptions o;
  o.train_mixer = false;
  const train::TrainStepResult r = run_step(w, s, o);
  for (const auto& [name, g] : r.grads)
    if (train::param_group(name) == train::ParamGroup::mixer) {
      EXPECT_TRUE(test::all_zero(g)) << name;
    }
}

// A frozen mixer (full mode) still passes its whole gradient to the streams: every other gradient is
// bit-identical to the step that trains it.
TEST(TrainStep, FreezingTheMixerKeepsTheGradientFlowingThroughIt) {
  const Weights& w = test::tiny();
  const std::vector<TrainSample> s = batch_of(2, w.config().vocab_size);
  train::TrainStepOptions o;
  const train::TrainStepResult trained = run_step(w, s, o);
  o.groups.freeze("mixer");
  const train::TrainStepResult frozen = run_step(w, s, o);
  for (const auto& [name, g] : trained.grads) {
    if (train::param_group(name) == train::ParamGroup::mixer) {
      EXPECT_EQ(frozen.grads.count(name), 0u) << name;
      continue;
    }
    ASSERT_TRUE(frozen.grads.count(name)) << name;
    EXPECT_TRUE(bitwise_equal(g, frozen.grads.at(name))) << name;
  }
}

TEST(TrainStep, ShortTrainingRunLowersTheLoss) {
  Weights w = test::tiny();
  const int V = w.config().vocab_size;
  // Two prompts, two responses each; the better response of each group gets reward 1.
  std::vector<TrainSample> s;
  for (int q = 0; q < 2; ++q)
    for (int r = 0; r < 2; ++r) {
      TrainSample x = make_sample(fmt::format("q{}r{}", q, r), 6, 10, V, 500 + uint64_t(q * 2 + r), 0);
      x.advantage.reset();
      x.reward = r == 0 ? 1.0 : 0.0;
      x.group = "q" + std::to_string(q);
      s.push_back(std::move(x));
    }
  train::TrainStepOptions o;
  o.adamw.lr = 2e-3;
  o.adamw.weight_decay = 0.0;
  train::OptimizerState st = train::fresh_optimizer_state(w, o.groups);
  auto good_logp = [&](const train::TrainStepResult& r) {
    double m = 0;
    for (int i : {0, 2})
      for (float x : r.logprobs[size_t(i)]) m += x;
    return m;
  };
  // Every step is recorded (a trace per step: a trace holds one model), its checkpoint and the
  // optimizer state it started from saved as `train-step` writes them, and the run replays step by
  // step bit for bit.
  test::TempDir d;
  double first = 0, last = 0;
  for (int step = 0; step < 12; ++step) {
    Weights next = w;
    train::RecordTrainOptions ro;
    ro.seed = 7;
    if (step > 0) {
      ro.optimizer_state_path = d / fmt::format("state{}.safetensors", step);
      st.save(ro.optimizer_state_path);
    }
    const train::TrainStepResult r =
        train::record_train_step(w, s, st, o, {}, &next, d / fmt::format("step{}.h5", step), ro);
    if (step == 0) first = good_logp(r);
    last = good_logp(r);
    next.save(d / fmt::format("model{}", step + 1));
    w = open_checkpoint(d / fmt::format("model{}", step + 1));
  }
  EXPECT_EQ(st.step, 12);
  EXPECT_GT(last, first + 1.0) << "the rewarded responses' log-probability did not rise";
  for (int step = 0; step < 12; ++step) {
    const ReplayReport rep = replay_trace(d / fmt::format("step{}.h5", step), ReplayOptions{});
    ASSERT_EQ(rep.steps.size(), 1u);
    EXPECT_TRUE(rep.identical()) << "step " << step << ": "
                                 << (rep.steps[0].first ? rep.steps[0].first->tensor + " " + rep.steps[0].first->reason
                                                        : "decisions or weights");
  }
}

TEST(TrainStep, RejectsAStateOfOtherWeightsAndUntrainableGroups) {
  const Weights& w = test::tiny();
  train::TrainStepOptions o;
  train::OptimizerState st = train::fresh_optimizer_state(w, o.groups);
  st.master.begin()->second[0] += 1.0f;
  const std::vector<TrainSample> s = batch_of(1, w.config().vocab_size);
  Weights after = w;
  EXPECT_THROW(train::train_step(w, s, st, o, {}, &after), InputError);
  train::TrainGroups g;
  EXPECT_THROW(g.train("expert_bias"), InputError);
  EXPECT_THROW(g.train("nonsense"), InputError);
  EXPECT_EQ(g.describe(), "(none)");  // what the step's JSON says of the groups trained
  g.train("head,embed");
  EXPECT_EQ(g.describe(), "embed,head");  // enum order
  g.freeze("embed");
  EXPECT_EQ(g.describe(), "head");
}

// R3: forcing the decisions recorded by a forward of other numerics makes the training forward use
// them (as sets), hash layers excepted; a forced id out of range is refused naming sample and layer.
TEST(TrainStep, ReplaysForcedDecisions) {
  const Weights& w = test::tiny();
  const ModelConfig& c = w.config();
  std::vector<TrainSample> s = batch_of(2, c.vocab_size);
  s[1] = make_sample("long", 30, 50, c.vocab_size, 9, 1.0);  // T = 80 > 4 * index_topk: selection active
  // Decisions of the rollout profile.
  DecisionLog rollout, trained;
  RunOptions ro;
  ro.profile = profile_by_name("rollout");
  ro.observer = &rollout;
  forward(w, {s[0].tokens(), s[1].tokens()}, ro);
  const Overrides ov = rollout.to_overrides();
  train::TrainStepOptions o;
  train::TrainStepHooks h;
  h.decisions = &ov;
  h.observer = &trained;
  train::OptimizerState st = train::fresh_optimizer_state(w, o.groups);
  Weights after = w;
  train::train_step(w, s, st, o, h, &after);
  ASSERT_FALSE(rollout.indexer.empty());
  for (const auto& [key, x] : rollout.indexer) {
    const IndexerRecord& y = trained.indexer.at(key);
    for (int64_t t = 0; t < x.T; ++t)
      EXPECT_EQ(valid_ids(x.ids, x.k, t), valid_ids(y.ids, y.k, t))
          << "sample " << key.first << " layer " << key.second << " token " << t;
  }
  for (const auto& [key, x] : rollout.routing) {
    if (x.hashed) continue;
    const RoutingRecord& y = trained.routing.at(key);
    for (int64_t t = 0; t < x.T; ++t) EXPECT_EQ(valid_ids(x.ids, x.k, t), valid_ids(y.ids, y.k, t));
  }
  // Hash layers are never forced.
  Overrides hash;
  hash.force_experts(0, 0, ForcedSelection{int64_t(s[0].tokens().size()), c.num_experts_per_tok,
                                           std::vector<int32_t>(s[0].tokens().size() * 2, 0)});
  h.decisions = &hash;
  h.observer = nullptr;
  st = train::fresh_optimizer_state(w, o.groups);
  EXPECT_THROW(train::train_step(w, s, st, o, h, &after), OverrideError);
  // An expert id out of range names the sample, the layer and the token.
  Overrides bad = ov;
  auto sel = *ov.experts(1, 3);
  sel.ids[5] = c.n_routed_experts;
  bad.force_experts(1, 3, sel);
  h.decisions = &bad;
  st = train::fresh_optimizer_state(w, o.groups);
  try {
    train::train_step(w, s, st, o, h, &after);
    FAIL() << "no error";
  } catch (const OverrideError& e) {
    EXPECT_NE(std::string(e.what()).find("sequence 1 layer 3 token 2"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace dsv4
