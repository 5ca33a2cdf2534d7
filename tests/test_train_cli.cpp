// `dsv4 train-step` end to end: steps chain through the written checkpoint and optimizer state, a
// recorded step replays bit-identically (exit 0), a doctored gradient digest or weight is named
// exactly (exit 1), R3 from a recorded rollout trace, and bad input gets a clear message (exit 2).
#include <gtest/gtest.h>

#include <fstream>
#include <map>
#include <nlohmann/json.hpp>

#include "cli_util.h"
#include "h5_edit.h"
#include "model/checkpoint.h"
#include "test_util.h"

namespace {

using dsv4::test::run_cli;
using dsv4::test::TempDir;

// Four samples of two groups with rewards (prompt + response ids of the tiny vocabulary).
void write_samples(const std::string& path) {
  std::ofstream f(path);
  f << R"({"id": "a", "prompt": [1, 2, 3, 4, 5], "response": [9, 8, 7, 6, 5, 4, 3], "reward": 1, "group": "g0"})"
    << "\n"
    << R"({"id": "b", "prompt": [1, 2, 3, 4, 5], "response": [11, 12, 13, 14], "reward": 0, "group": "g0"})"
    << "\n"
    << R"({"id": "c", "prompt": [40, 41, 42], "response": [50, 51, 52, 53, 54, 55, 56, 57, 58], "reward": 0.5, "group": "g1"})"
    << "\n"
    << R"({"id": "d", "prompt": [40, 41, 42], "response": [60, 61], "reward": 0, "group": "g1"})"
    << "\n";
}

TEST(TrainStepCli, StepsChainAndReplayBitIdentically) {
  TempDir d;
  write_samples(d / "samples.jsonl");
  auto r = run_cli("model init --preset tiny --seed 7 --out " + (d / "m0"));
  ASSERT_EQ(r.code, 0) << r.out;
  r = run_cli("train-step --model " + (d / "m0") + " --data " + (d / "samples.jsonl") + " --lr 1e-3 --out-model " +
              (d / "m1") + " --record " + (d / "step1.h5") + " --capture-params '*.attn_sink,lm_head.weight' --json");
  ASSERT_EQ(r.code, 0) << r.out;
  const auto j1 = nlohmann::json::parse(r.out.substr(r.out.find('{')));
  EXPECT_EQ(j1["step"], 1);
  EXPECT_EQ(j1["tokens"], 22);
  r = run_cli("train-step --model " + (d / "m1") + " --optimizer-state " + (d / "m1/optimizer.safetensors") +
              " --data " + (d / "samples.jsonl") + " --lr 1e-3 --out-model " + (d / "m2") + " --record " +
              (d / "step2.h5") + " --json");
  ASSERT_EQ(r.code, 0) << r.out;
  const auto j2 = nlohmann::json::parse(r.out.substr(r.out.find('{')));
  EXPECT_EQ(j2["step"], 2);

  r = run_cli("replay " + (d / "step1.h5"));
  EXPECT_EQ(r.code, 0) << r.out;
  r = run_cli("replay --threads 1 " + (d / "step2.h5"));
  EXPECT_EQ(r.code, 0) << r.out;

  // A state that is not the one the step started from is refused by name.
  r = run_cli("replay " + (d / "step2.h5") + " --optimizer-state " + (d / "m2/optimizer.safetensors"));
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_NE(r.out.find("not the one step 0 started from"), std::string::npos) << r.out;
  // The same step with another micro-batch size gives the same checkpoint, byte for byte.
  r = run_cli("train-step --model " + (d / "m0") + " --data " + (d / "samples.jsonl") +
              " --lr 1e-3 --micro-batch 3 --threads 1 --quiet --out-model " + (d / "m1b"));
  ASSERT_EQ(r.code, 0) << r.out;
  r = dsv4::test::run_shell("cmp " + (d / "m1/model.safetensors") + " " + (d / "m1b/model.safetensors") + " && cmp " +
                            (d / "m1/optimizer.safetensors") + " " + (d / "m1b/optimizer.safetensors"));
  EXPECT_EQ(r.code, 0) << r.out;
}

// The indexer's KL objective from the command line: the indexer is trained (its weights change, the
// metric is printed), the step replays bit-identically, and a frozen indexer keeps the metric only.
TEST(TrainStepCli, IndexerKlObjectiveTrainsTheIndexerAndReplays) {
  TempDir d;
  write_samples(d / "samples.jsonl");
  auto r = run_cli("model init --preset tiny --seed 7 --out " + (d / "m0"));
  ASSERT_EQ(r.code, 0) << r.out;
  r = run_cli("train-step --model " + (d / "m0") + " --data " + (d / "samples.jsonl") +
              " --indexer-kl 0.5 --lr 1e-3 --out-model " + (d / "m1") + " --record " + (d / "kl.h5") + " --json");
  ASSERT_EQ(r.code, 0) << r.out;
  const auto j = nlohmann::json::parse(r.out.substr(r.out.find('{')));
  ASSERT_TRUE(j.contains("indexer_kl")) << r.out;
  EXPECT_GT(j["indexer_kl"].get<double>(), 0.0);
  const dsv4::Weights w0 = dsv4::open_checkpoint(d / "m0"), w1 = dsv4::open_checkpoint(d / "m1");
  const std::string wq = "model.layers.1.self_attn.indexer.wq_b.weight";
  EXPECT_NE(w0.get(wq).f, w1.get(wq).f) << "the indexer was not trained";
  r = run_cli("replay " + (d / "kl.h5"));
  EXPECT_EQ(r.code, 0) << r.out;
  r = run_cli("train-step --model " + (d / "m0") + " --data " + (d / "samples.jsonl") +
              " --indexer-kl 0.5 --freeze indexer --out-model " + (d / "m2"));
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("indexer KL"), std::string::npos) << r.out;
  EXPECT_EQ(dsv4::open_checkpoint(d / "m2").get(wq).f, w0.get(wq).f);
}

// A rollout trace as training data: a generation's requests with rewards from --rewards train exactly
// like the same samples given as JSONL (generate's --out plus the rewards), and the step replays; a
// prefill trace needs each sample's prompt length; missing rewards are named.
TEST(TrainStepCli, RolloutTraceAsData) {
  TempDir d;
  {
    std::ofstream f(d / "prompts.jsonl");
    f << R"({"id": "a", "prompt": [1, 2, 3, 4, 5, 6, 7], "seed": 1})" << "\n"
      << R"({"id": "b", "prompt": [1, 2, 3, 4, 5, 6, 7], "seed": 2})" << "\n"
      << R"({"id": "c", "prompt": [30, 31, 32], "seed": 3})" << "\n";
  }
  auto r = run_cli("generate --preset tiny --seed 7 --prompts " + (d / "prompts.jsonl") +
                   " --max-new-tokens 9 --quiet --out " + (d / "gen.jsonl") + " --record " + (d / "gen.h5"));
  ASSERT_EQ(r.code, 0) << r.out;
  const std::map<std::string, double> reward = {{"a", 1.0}, {"b", 0.0}, {"c", 0.5}};
  {
    std::ofstream f(d / "rewards.jsonl");
    for (const auto& [id, v] : reward) f << nlohmann::json{{"id", id}, {"reward", v}}.dump() << "\n";
    // The same samples as JSONL: generate's lines with the rewards and the groups trace data defaults
    // to (the requests of one prompt).
    std::ifstream in(d / "gen.jsonl");
    std::ofstream out(d / "samples.jsonl");
    for (std::string line; std::getline(in, line);) {
      auto j = nlohmann::json::parse(line);
      const std::string id = j["id"];
      j["reward"] = reward.at(id);
      j["group"] = id == "c" ? "prompt of c" : "prompt of a";
      out << j.dump() << "\n";
    }
  }
  r = run_cli("train-step --preset tiny --seed 7 --data " + (d / "gen.h5") + " --rewards " + (d / "rewards.jsonl") +
              " --replay-decisions-from " + (d / "gen.h5") + " --lr 1e-3 --quiet --out-model " + (d / "mt") +
              " --record " + (d / "step.h5"));
  ASSERT_EQ(r.code, 0) << r.out;
  r = run_cli("train-step --preset tiny --seed 7 --data " + (d / "samples.jsonl") + " --replay-decisions-from " +
              (d / "gen.h5") + " --lr 1e-3 --quiet --out-model " + (d / "mj"));
  ASSERT_EQ(r.code, 0) << r.out;
  r = dsv4::test::run_shell("cmp " + (d / "mt/model.safetensors") + " " + (d / "mj/model.safetensors"));
  EXPECT_EQ(r.code, 0) << "trace data and JSONL data trained differently: " << r.out;
  r = run_cli("replay " + (d / "step.h5"));
  EXPECT_EQ(r.code, 0) << r.out;

  // Errors: no --rewards; a sample without a line; a prefill step without prompt lengths.
  r = run_cli("train-step --preset tiny --seed 7 --data " + (d / "gen.h5") + " --out-model " + (d / "m"));
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_NE(r.out.find("--rewards"), std::string::npos) << r.out;
  {
    std::ofstream f(d / "two.jsonl");
    f << R"({"id": "a", "reward": 1})" << "\n" << R"({"id": "c", "reward": 0})" << "\n";
  }
  r = run_cli("train-step --preset tiny --seed 7 --data " + (d / "gen.h5") + " --rewards " + (d / "two.jsonl") +
              " --out-model " + (d / "m"));
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_NE(r.out.find("no line for sample 'b'"), std::string::npos) << r.out;
  r = run_cli("record --preset tiny --seed 7 --profile rollout --batch " + (d / "gen.jsonl") + " --out " +
              (d / "rec.h5"));
  ASSERT_EQ(r.code, 0) << r.out;
  {
    std::ofstream f(d / "rec_rewards.jsonl");
    f << R"({"seq": 0, "advantage": 1})" << "\n"
      << R"({"seq": 1, "advantage": -1, "prompt_length": 7})" << "\n"
      << R"({"seq": 2, "advantage": 0.5, "prompt_length": 3})" << "\n";
  }
  r = run_cli("train-step --preset tiny --seed 7 --data " + (d / "rec.h5") + " --rewards " +
              (d / "rec_rewards.jsonl") + " --out-model " + (d / "m"));
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_NE(r.out.find("line 1: field 'prompt_length' is needed"), std::string::npos) << r.out;
  {
    std::ofstream f(d / "rec_rewards.jsonl");
    f << R"({"seq": 0, "advantage": 1, "prompt_length": 7})" << "\n"
      << R"({"seq": 1, "advantage": -1, "prompt_length": 7})" << "\n"
      << R"({"seq": 2, "advantage": 0.5, "prompt_length": 3})" << "\n";
  }
  r = run_cli("train-step --preset tiny --seed 7 --data " + (d / "rec.h5") + " --rewards " +
              (d / "rec_rewards.jsonl") + " --json --out-model " + (d / "m"));
  ASSERT_EQ(r.code, 0) << r.out;
  const auto j = nlohmann::json::parse(r.out.substr(r.out.find('{')));
  EXPECT_EQ(j["tokens"], 27);  // the responses: 9 + 9 + 9 generated tokens
  EXPECT_GT(j["mismatch"]["tokens"].get<int>(), 0) << "the recorded log-probs are the rollout log-probs";
}

// A doctored gradient digest is named exactly: the parameter and row of a parameter gradient, or the
// activation gradient, sample, layer, row and the backward op that produced it; other weights are
// named too.
TEST(TrainStepCli, DoctoredStepIsNamedExactly) {
  TempDir d;
  write_samples(d / "samples.jsonl");
  auto r = run_cli("model init --preset tiny --seed 7 --out " + (d / "m0"));
  ASSERT_EQ(r.code, 0) << r.out;
  r = run_cli("train-step --model " + (d / "m0") + " --data " + (d / "samples.jsonl") + " --quiet --out-model " +
              (d / "m1") + " --record " + (d / "step.h5"));
  ASSERT_EQ(r.code, 0) << r.out;
  const std::string t = "/steps/000000/training/";
  // Parameters are in name order: lm_head.weight comes first and is trained.
  std::filesystem::copy_file(d / "step.h5", d / "grad.h5");
  {
    dsv4::test::H5Edit e(d / "grad.h5");
    auto g = e.read<uint64_t>(t + "params/grad", H5T_NATIVE_UINT64);
    ASSERT_GT(g.size(), 3u);
    g[3] ^= 1;
    e.write(t + "params/grad", H5T_NATIVE_UINT64, g);
  }
  r = run_cli("replay " + (d / "grad.h5"));
  EXPECT_EQ(r.code, 1) << r.out;
  EXPECT_NE(r.out.find("tensor grad:lm_head.weight row 3"), std::string::npos) << r.out;
  // The first activation gradient is sample 0's d logits.
  std::filesystem::copy_file(d / "step.h5", d / "act.h5");
  {
    dsv4::test::H5Edit e(d / "act.h5");
    auto g = e.read<uint64_t>(t + "act_grads/digests", H5T_NATIVE_UINT64);
    g[5] ^= 1;
    e.write(t + "act_grads/digests", H5T_NATIVE_UINT64, g);
  }
  r = run_cli("replay " + (d / "act.h5"));
  EXPECT_EQ(r.code, 1) << r.out;
  EXPECT_NE(r.out.find("sequence 0 layer -1 tensor grad.logits row 5"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("log_softmax_backward"), std::string::npos) << r.out;
  // A moment of the optimizer.
  std::filesystem::copy_file(d / "step.h5", d / "v.h5");
  {
    dsv4::test::H5Edit e(d / "v.h5");
    auto g = e.read<uint64_t>(t + "params/v", H5T_NATIVE_UINT64);
    g[0] ^= 1;
    e.write(t + "params/v", H5T_NATIVE_UINT64, g);
  }
  r = run_cli("replay " + (d / "v.h5"));
  EXPECT_EQ(r.code, 1) << r.out;
  EXPECT_NE(r.out.find("tensor adam_v:lm_head.weight row 0"), std::string::npos) << r.out;
  // Other weights (one tensor changed): named, and the replay diverges.
  {
    const dsv4::Weights w = dsv4::open_checkpoint(d / "m0");
    std::vector<float> n = w.get("model.norm.weight").f;
    n[7] = n[7] * 2.0f;
    w.with_values({{"model.norm.weight", n}}, "doctored").save(d / "mx");
  }
  r = run_cli("replay " + (d / "step.h5") + " --model " + (d / "mx"));
  EXPECT_EQ(r.code, 1) << r.out;
  EXPECT_NE(r.out.find("WEIGHTS DIFFER from the recorded model: model.norm.weight"), std::string::npos) << r.out;
}

TEST(TrainStepCli, ReplicatesRolloutDecisionsAndRefusesOtherWeights) {
  TempDir d;
  write_samples(d / "samples.jsonl");
  // The rollout: the samples' tokens recorded in the rollout profile.
  {
    std::ofstream f(d / "batch.jsonl");
    f << "[1, 2, 3, 4, 5, 9, 8, 7, 6, 5, 4, 3]\n[1, 2, 3, 4, 5, 11, 12, 13, 14]\n"
      << "[40, 41, 42, 50, 51, 52, 53, 54, 55, 56, 57, 58]\n[40, 41, 42, 60, 61]\n";
  }
  auto r = run_cli("record --preset tiny --seed 7 --profile rollout --batch " + (d / "batch.jsonl") + " --out " +
                   (d / "rollout.h5"));
  ASSERT_EQ(r.code, 0) << r.out;
  r = run_cli("train-step --preset tiny --seed 7 --data " + (d / "samples.jsonl") + " --replay-decisions-from " +
              (d / "rollout.h5") + " --out-model " + (d / "m1") + " --record " + (d / "r3.h5") + " --quiet");
  ASSERT_EQ(r.code, 0) << r.out;
  r = run_cli("replay " + (d / "r3.h5"));
  EXPECT_EQ(r.code, 0) << r.out;
  // Decisions made with other weights: refused by default, used with a warning on request.
  r = run_cli("train-step --preset tiny --seed 8 --data " + (d / "samples.jsonl") + " --replay-decisions-from " +
              (d / "rollout.h5") + " --out-model " + (d / "m2"));
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_NE(r.out.find("made with other weights"), std::string::npos) << r.out;
  r = run_cli("train-step --preset tiny --seed 8 --data " + (d / "samples.jsonl") + " --replay-decisions-from " +
              (d / "rollout.h5") + " --on-other-weights warn --quiet --out-model " + (d / "m2"));
  EXPECT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("warning"), std::string::npos) << r.out;
  // A sample the rollout never saw.
  {
    std::ofstream f(d / "other.jsonl");
    f << R"({"prompt": [3, 3, 3], "response": [4, 4], "advantage": 1})" << "\n";
  }
  r = run_cli("train-step --preset tiny --seed 7 --data " + (d / "other.jsonl") + " --replay-decisions-from " +
              (d / "rollout.h5") + " --out-model " + (d / "m3"));
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_NE(r.out.find("no sequence with the tokens of sample '0'"), std::string::npos) << r.out;
}

TEST(TrainStepCli, BadInputIsNamed) {
  TempDir d;
  {
    std::ofstream f(d / "bad.jsonl");
    f << R"({"prompt": [1, 2], "response": [99999], "advantage": 1})" << "\n";
  }
  auto r = run_cli("train-step --preset tiny --seed 7 --data " + (d / "bad.jsonl") + " --out-model " + (d / "m"));
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_NE(r.out.find("bad.jsonl"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("line 1"), std::string::npos) << r.out;
  write_samples(d / "s.jsonl");
  r = run_cli("train-step --preset tiny --seed 7 --data " + (d / "s.jsonl") + " --train indexer --out-model " +
              (d / "m"));
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_NE(r.out.find("cannot be trained without its KL objective"), std::string::npos) << r.out;
  r = run_cli("train-step --preset tiny --seed 7 --data " + (d / "s.jsonl") + " --train expert_bias --out-model " +
              (d / "m"));
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_NE(r.out.find("cannot be trained"), std::string::npos) << r.out;
  r = run_cli("train-step --preset tiny --seed 7 --data " + (d / "s.jsonl") + " --indexer-kl -1 --out-model " +
              (d / "m"));
  EXPECT_NE(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("--indexer-kl"), std::string::npos) << r.out;
  r = run_cli("train-step --preset tiny --seed 7 --data " + (d / "s.jsonl") + " --optimizer-state " +
              (d / "missing.safetensors") + " --out-model " + (d / "m"));
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_NE(r.out.find("missing.safetensors"), std::string::npos) << r.out;
}

}  // namespace
