// Numerics profiles as data (model/profile.h, docs/PROFILES.md): the text format and its errors, the
// built-ins, what each site does to a forward, the recorded profile in traces (replay, validate, diff)
// and the bisect.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>
#include <random>
#include <set>

#include "capture/trace_reader.h"
#include "cli_util.h"
#include "h5_edit.h"
#include "kernels/attention.h"
#include "kernels/indexer.h"
#include "kernels/linear.h"
#include "model/collect.h"
#include "model/device.h"
#include "model/error.h"
#include "model/forward.h"
#include "model/profile.h"
#include "model/tokens.h"
#include "replay/bisect.h"
#include "test_util.h"
#include "tiny_model.h"

namespace dsv4 {
namespace {

std::vector<int32_t> tokens(const ModelConfig& c, int64_t T, uint64_t seed) {
  return random_tokens(T, c.vocab_size, seed);
}

std::string write_file(const test::TempDir& d, const std::string& name, const std::string& text) {
  const std::string p = d / name;
  std::ofstream(p) << text;
  return p;
}

// The message of the InputError `f` throws ("" when it throws nothing).
template <typename F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const InputError& e) {
    return e.what();
  }
  return "";
}

// ---- the format ---------------------------------------------------------------------------------

TEST(ProfileFormat, BuiltinsRoundTripThroughTheirCanonicalText) {
  const auto names = profile_names();
  EXPECT_EQ(names,
            (std::vector<std::string>{"train", "rollout", "deepseek-inference", "deepseek-inference-v2"}));
  for (const auto& n : names) {
    const NumericsProfile p = profile_by_name(n);
    EXPECT_EQ(p.name, n);
    const std::string text = profile_text(p);
    const NumericsProfile q = parse_profile(text, "canonical " + n);
    EXPECT_EQ(profile_text(q), text) << n;
    EXPECT_TRUE(profile_diff(p, q).empty()) << n;
    EXPECT_EQ(profile_digest(p).size(), 16u);
    // The shipped file (comments and all) parses to the same map.
    EXPECT_EQ(profile_text(parse_profile(builtin_profile_source(n), n)), text);
  }
  std::set<std::string> digests;
  for (const auto& n : names) digests.insert(profile_digest(profile_by_name(n)));
  EXPECT_EQ(digests.size(), names.size()) << "two built-ins with one precision map";
}

// `train` and `rollout` as files are the precision maps that were hard-wired before profiles were
// data: bf16/fp32 without FP8 and reduction chains; FP8 KV and indexer caches and blocks of 64.
TEST(ProfileFormat, TrainAndRolloutAreTheMapsTheyWere) {
  const NumericsProfile t = profile_train(), r = profile_rollout();
  for (const ReduceOrder& o : {t.reduce.gemm, t.reduce.norm, t.reduce.compressor, t.reduce.mhc, t.reduce.indexer,
                               t.reduce.attention, t.reduce.moe})
    EXPECT_EQ(o.block, 0);
  EXPECT_EQ(t.kv_quant, QuantSim::none);
  EXPECT_EQ(t.indexer_quant, QuantSim::none);
  for (const ReduceOrder& o : {r.reduce.gemm, r.reduce.norm, r.reduce.compressor, r.reduce.mhc, r.reduce.indexer,
                               r.reduce.attention, r.reduce.moe})
    EXPECT_EQ(o.block, 64);
  EXPECT_EQ(r.kv_quant, QuantSim::fp8);
  EXPECT_EQ(r.indexer_quant, QuantSim::fp8);
  for (const NumericsProfile* p : {&t, &r}) {
    EXPECT_EQ(p->q_norm, Arith::fp32);
    EXPECT_EQ(p->attention_online_block, 0);
    EXPECT_EQ(p->decode_attention_splits, 0);
    EXPECT_EQ(p->indexer_score, Arith::fp32);
    EXPECT_FALSE(p->expert_output_bf16);
    EXPECT_FALSE(p->clamp_shared_expert);
  }
}

TEST(ProfileFormat, DiffListsExactlyTheSitesThatDiffer) {
  std::vector<std::string> keys;
  for (const auto& d : profile_diff(profile_train(), profile_by_name("deepseek-inference")))
    keys.push_back(d.key);
  EXPECT_EQ(keys, (std::vector<std::string>{"attention.q_norm", "attention.softmax", "kv.quant",
                                            "indexer.quant", "indexer.score", "moe.expert_output"}));
  const auto v =
      profile_diff(profile_by_name("deepseek-inference"), profile_by_name("deepseek-inference-v2"));
  ASSERT_EQ(v.size(), 2u);
  EXPECT_EQ(v[0].key, "kv.quant");
  EXPECT_EQ(v[0].a, "fp8_inplace_bf16_cast");
  EXPECT_EQ(v[0].b, "fp8");
  EXPECT_EQ(v[1].key, "moe.shared_clamp");
  NumericsProfile p = profile_train();
  copy_profile_site(p, profile_by_name("deepseek-inference"), "indexer.quant");
  EXPECT_EQ(p.indexer_quant, QuantSim::fp4);
  EXPECT_EQ(profile_diff(profile_train(), p).size(), 1u);
}

TEST(ProfileFormat, FilesWithABaseAndFromDisk) {
  test::TempDir d;
  const std::string f = write_file(d, "mine.profile",
                                   "# my engine\ndsv4-profile = 1\nname = mine\nbase = train\n"
                                   "attention.q_norm = bf16\n  indexer.score=bf16  \n");
  const NumericsProfile p = load_profile(f);
  EXPECT_EQ(p.name, "mine");
  const auto diff = profile_diff(profile_train(), p);
  ASSERT_EQ(diff.size(), 2u);
  EXPECT_EQ(diff[0].key, "attention.q_norm");
  EXPECT_EQ(diff[1].key, "indexer.score");
  EXPECT_EQ(load_profile("rollout").name, "rollout");  // a built-in's name wins over a file lookup
}

struct BadProfile {
  const char* text;
  const char* expect;  // a part of the message (besides the source and line)
  int line;
};

TEST(ProfileFormat, BadInputNamesTheFileTheLineAndTheSite) {
  const std::vector<BadProfile> cases = {
      {"dsv4-profile = 1\nname = x\nbase = train\nkv.qunt = fp8\n", "unknown site 'kv.qunt'", 4},
      {"dsv4-profile = 1\nname = x\nbase = train\nattention.softmax = online:0\n", "site 'attention.softmax'",
       4},
      {"dsv4-profile = 1\nname = x\nbase = train\nreduce.gemm = 12\n", "multiple of 8", 4},
      {"dsv4-profile = 1\nname = x\nbase = train\nreduce.moe = -8\n", "site 'reduce.moe'", 4},
      {"dsv4-profile = 1\nname = x\nbase = train\nindexer.quant = fp6\n", "site 'indexer.quant'", 4},
      {"dsv4-profile = 1\nname = x\nbase = train\nkv.quant = fp4\n", "site 'kv.quant'", 4},
      {"dsv4-profile = 1\nname = x\nbase = train\ntopk.ties = higher_index\n", "only tie-break", 4},
      {"dsv4-profile = 1\nname = x\nbase = train\nkv.quant_block = 0\n", "a block of 0 is impossible", 4},
      {"dsv4-profile = 1\nname = x\nbase = train\nkv.quant_scale = e4m3\n", "site 'kv.quant_scale'", 4},
      {"dsv4-profile = 1\nname = x\nbase = train\nindexer.quant_block = none\n", "site 'indexer.quant_block'", 4},
      {"dsv4-profile = 1\nname = x\nbase = deepseek-inference\n\nindexer.quant_scale = fp32\n", "FP4 (e2m1) scales",
       5},
      {"dsv4-profile = 2\nname = x\n", "newer than this build reads", 1},
      {"name = x\n", "first line must be 'dsv4-profile = 1'", 1},
      {"dsv4-profile = 1\nname = x\nbase = train\nkv.quant = fp8\nkv.quant = none\n", "given twice", 5},
      {"dsv4-profile = 1\nname = x\nbase = nowhere\n", "base 'nowhere'", 3},
      {"dsv4-profile = 1\nname = x y\n", "name 'x y'", 2},
      {"dsv4-profile = 1\nname = x\njust words\n", "expected 'key = value'", 3},
      {"dsv4-profile = 1\nname = x\nbase = train\nreduce.norm = tensor_core\n", "attention sites only", 4},
      {"dsv4-profile = 1\nname = x\nbase = train\nreduce.mhc = tensor_core\n", "attention sites only", 4},
      {"dsv4-profile = 1\nname = x\nbase = train\nreduce.gemm = tensorcore\n", "or tensor_core", 4},
  };
  test::TempDir d;
  for (const auto& c : cases) {
    const std::string f = write_file(d, "bad.profile", c.text);
    const std::string msg = error_of([&] { load_profile(f); });
    EXPECT_NE(msg.find(f + ":" + std::to_string(c.line) + ":"), std::string::npos) << msg;
    EXPECT_NE(msg.find(c.expect), std::string::npos) << msg;
  }
  // Whole-file problems name the file.
  EXPECT_NE(error_of([&] { load_profile(write_file(d, "e.profile", "# nothing\n")); }).find("empty profile"),
            std::string::npos);
  EXPECT_NE(
      error_of([&] { load_profile(write_file(d, "n.profile", "dsv4-profile = 1\n")); }).find("no 'name"),
      std::string::npos);
  const std::string missing =
      error_of([&] { load_profile(write_file(d, "m.profile", "dsv4-profile = 1\nname = x\n")); });
  EXPECT_NE(missing.find("sites not set: reduce.gemm, reduce.norm"), std::string::npos) << missing;
  EXPECT_NE(error_of([&] { load_profile("no-such-profile"); }).find("neither a built-in"), std::string::npos);
  EXPECT_NE(error_of([&] { profile_by_name("no-such"); }).find("known: train, rollout"), std::string::npos);
}

// ---- fast numerics ------------------------------------------------------------------------------

// with_numerics: the GEMM, expert, indexer and attention sites in the tensor_core order, its own name, the round trip of
// the text, and nothing else changed.
TEST(FastNumerics, TheProfileOfFastNumerics) {
  for (const std::string& name : profile_names()) {
    SCOPED_TRACE(name);
    const NumericsProfile exact = profile_by_name(name), fast = with_numerics(exact, Numerics::fast);
    EXPECT_EQ(numerics_of(exact), Numerics::exact);
    EXPECT_TRUE(tensor_core_sites(exact).empty());
    EXPECT_EQ(numerics_of(fast), Numerics::fast);
    EXPECT_EQ(tensor_core_sites(fast), (std::vector<std::string>{"reduce.gemm", "reduce.indexer", "reduce.attention", "reduce.moe"}));
    EXPECT_EQ(fast.name, name + ".fast");
    EXPECT_EQ(numerics_base_name(fast), name);
    EXPECT_EQ(numerics_base_name(exact), name);
    std::set<std::string> differ;
    for (const auto& d : profile_diff(exact, fast)) differ.insert(d.key);
    EXPECT_EQ(differ, (std::set<std::string>{"reduce.gemm", "reduce.indexer", "reduce.attention", "reduce.moe"}));
    EXPECT_EQ(profile_text(parse_profile(profile_text(fast), "round trip")), profile_text(fast));
    EXPECT_NE(profile_text(fast).find("reduce.gemm = tensor_core"), std::string::npos);
    EXPECT_EQ(profile_text(with_numerics(fast, Numerics::fast)), profile_text(fast));  // fast stays fast
    EXPECT_EQ(profile_text(with_numerics(exact, Numerics::exact)), profile_text(exact));
    EXPECT_EQ(profile_text(load_profile(name, Numerics::fast)), profile_text(fast));
  }
  EXPECT_EQ(parse_numerics("fast"), Numerics::fast);
  EXPECT_EQ(parse_numerics("exact"), Numerics::exact);
  EXPECT_NE(error_of([] { parse_numerics("quick"); }).find("accepted: exact, fast"), std::string::npos);
  // A profile file may set the order itself; it is then fast under any name of its own.
  test::TempDir d;
  const NumericsProfile own = load_profile(
      write_file(d, "tc.profile", "dsv4-profile = 1\nname = mine\nbase = rollout\nreduce.moe = tensor_core\n"));
  EXPECT_EQ(tensor_core_sites(own), std::vector<std::string>{"reduce.moe"});
  EXPECT_EQ(numerics_base_name(own), "mine");
}

// Fast numerics run on CUDA only and in forward passes only: the CPU forward, the generation engine's
// CPU backend, the CPU kernels and the training step each refuse them with a message that says why and
// what to do, before anything runs.
TEST(FastNumerics, TheCpuAndTheTrainingStepRefuseThem) {
  const Weights& w = test::tiny();
  const NumericsProfile fast = with_numerics(profile_train(), Numerics::fast);
  RunOptions o;
  o.profile = fast;
  const std::string msg = error_of([&] { forward(w, {{1, 2, 3}}, o); });
  EXPECT_NE(msg.find("forward: profile 'train.fast' is in fast numerics (reduce.gemm, reduce.indexer, reduce.attention, "
                     "reduce.moe = tensor_core)"),
            std::string::npos)
      << msg;
  EXPECT_NE(msg.find("--device cuda"), std::string::npos) << msg;
  EXPECT_NO_THROW(require_profile_runs_on(fast, Device::cuda, "forward"));
  EXPECT_NO_THROW(require_profile_runs_on(profile_train(), Device::cpu, "forward"));
  const std::string train = error_of([&] { require_exact_numerics(fast, "train-step"); });
  EXPECT_NE(train.find("train-step: profile 'train.fast' is in fast numerics"), std::string::npos) << train;
  EXPECT_NE(train.find("forward passes only"), std::string::npos) << train;
  EXPECT_NO_THROW(require_exact_numerics(profile_rollout(), "train-step"));
  // The CPU kernels refuse the order too (a caller that skipped the checks above).
  std::vector<float> x(8, 1.0f), y(4);
  GemmParams g = linear_params(1, 1, 8, x.data(), x.data(), y.data(), OutRound::f32,
                               ReduceOrder{.block = 0, .tensor_core = true});
  try {
    gemm(g);
    ADD_FAILURE() << "the CPU GEMM ran the tensor_core order";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("gemm: the tensor_core order"), std::string::npos) << e.what();
  }
  std::vector<int32_t> idx{0};
  SparseAttnParams a;
  a.T = 1, a.H = 1, a.Dh = 8, a.N = 1, a.K = 1, a.q = x.data(), a.kv = x.data(), a.idx = idx.data(),
  a.sink = x.data(), a.scale = 1.0f, a.o = x.data(), a.order = ReduceOrder{.block = 0, .tensor_core = true};
  EXPECT_NE(std::string(sparse_attention_check(a) ? sparse_attention_check(a) : "").find("tensor_core order"),
            std::string::npos);
  try {
    sparse_attention(a);
    ADD_FAILURE() << "the CPU attention ran the tensor_core order";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("sparse_attention: the tensor_core order"), std::string::npos) << e.what();
  }
  std::vector<int32_t> ids(1);
  IndexerParams ip;
  ip.T = 4, ip.Hi = 1, ip.Di = 2, ip.G = 1, ip.k = 1, ip.qi = x.data(), ip.ki = x.data(), ip.wt = x.data(),
  ip.ids = ids.data(), ip.order = ReduceOrder{.block = 0, .tensor_core = true};
  for (const auto& run : std::vector<std::function<void()>>{[&] { indexer_topk(ip); },
                                                            [&] { indexer_score_ids(ip, ids.data(), y.data()); }}) {
    try {
      run();
      ADD_FAILURE() << "the CPU indexer ran the tensor_core order";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("indexer_"), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find("the tensor_core order"), std::string::npos) << e.what();
    }
  }
}

// The CLI: --numerics fast on the CPU exits 2 with the sentence; an unknown value is refused by name.
TEST(FastNumerics, CliRefusesFastOnTheCpu) {
  const auto r = test::run_cli("forward --preset tiny --random 8 --numerics fast");
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_NE(r.out.find("fast numerics"), std::string::npos) << r.out;
  const auto bad = test::run_cli("forward --preset tiny --random 8 --numerics quick");
  EXPECT_NE(bad.code, 0);
  EXPECT_NE(bad.out.find("--numerics"), std::string::npos) << bad.out;
  test::TempDir d;
  const auto rec = test::run_cli("record --preset tiny --random 8 --numerics fast --out " + (d / "t.h5"));
  EXPECT_EQ(rec.code, 2) << rec.out;
  EXPECT_NE(rec.out.find("record: profile 'train.fast' is in fast numerics"), std::string::npos) << rec.out;
  EXPECT_FALSE(std::filesystem::exists(d / "t.h5"));
}

// ---- the sites in a forward ---------------------------------------------------------------------

struct Run {
  ForwardResult r;
  DecisionLog log;
};

std::unique_ptr<Run> run(const Weights& w, const std::vector<int32_t>& toks, const NumericsProfile& p,
                         int threads = 0) {
  auto out = std::make_unique<Run>();
  RunOptions o;
  o.profile = p;
  o.threads = threads;
  o.observer = &out->log;
  out->r = forward(w, {toks}, o);
  return out;
}

bool same(const Run& a, const Run& b) {
  if (!test::bitwise_equal(a.r.seqs[0].logprobs, b.r.seqs[0].logprobs)) return false;
  for (const auto& [k, ia] : a.log.indexer)
    if (ia.ids != b.log.indexer.at(k).ids) return false;
  for (const auto& [k, ra] : a.log.routing)
    if (ra.ids != b.log.routing.at(k).ids) return false;
  return true;
}

// MODEL.md §4.2: the official code's in-place FP8 of the KV is an identity under ue8m0 scales, so
// `kv.quant = fp8_inplace_bf16_cast` must leave every bit of a forward unchanged.
TEST(ProfileSites, InPlaceBf16CastKvIsAnIdentity) {
  const Weights& w = test::tiny();
  const auto toks = tokens(w.config(), 200, 3);
  NumericsProfile p = profile_train();
  p.kv_quant = QuantSim::fp8_inplace_bf16_cast;
  EXPECT_TRUE(same(*run(w, toks, profile_train()), *run(w, toks, p)));
}

// Every site that chooses an arithmetic changes a forward of tiny at T = 200 (so each is wired
// through), and the deepseek-inference profiles are deterministic across runs and thread counts.
TEST(ProfileSites, EverySiteReachesTheForwardAndTheNewProfilesAreDeterministic) {
  const Weights& w = test::tiny();
  const auto toks = tokens(w.config(), 200, 5);
  const auto base = run(w, toks, profile_train());
  const NumericsProfile di = profile_by_name("deepseek-inference");
  for (const char* key :
       {"attention.q_norm", "attention.softmax", "indexer.quant", "indexer.score", "moe.expert_output"}) {
    NumericsProfile p = profile_train();
    copy_profile_site(p, di, key);
    EXPECT_FALSE(test::bitwise_equal(base->r.seqs[0].logprobs, run(w, toks, p)->r.seqs[0].logprobs)) << key;
  }
  for (const char* name : {"deepseek-inference", "deepseek-inference-v2"}) {
    const auto a = run(w, toks, profile_by_name(name), 1);
    EXPECT_TRUE(same(*a, *run(w, toks, profile_by_name(name), 2))) << name;
    EXPECT_TRUE(same(*a, *run(w, toks, profile_by_name(name), 1))) << name;
    EXPECT_FALSE(same(*a, *base)) << name;
  }
}

// A block the row cannot be cut into is refused when the layer runs, naming the profile, the site
// key, the tensor and the layer; block and scale change the values the simulation gives the tensors
// it is applied to (the window KV of layer 0, the indexer queries of a C4 layer).
TEST(ProfileSites, QuantBlockAndScale) {
  const Weights& w = test::tiny();  // nope dims 192
  const auto toks = tokens(w.config(), 60, 4);
  NumericsProfile p = profile_rollout();
  p.name = "kv-128";
  p.kv_quant_block = 128;
  const std::string msg = error_of([&] { run(w, toks, p); });
  EXPECT_NE(msg.find("profile 'kv-128': FP8 simulation of the window KV at layer 0"), std::string::npos) << msg;
  EXPECT_NE(msg.find("kv.quant_block"), std::string::npos) << msg;
  // The reported tensor `name` of the first layer that has it.
  auto tensor = [&](const NumericsProfile& q, const std::string& name) {
    DecisionLog log(true);
    RunOptions o;
    o.profile = q;
    o.observer = &log;
    forward(w, {toks}, o);
    for (const auto& [key, t] : log.tensors)
      if (key.second == name) return t.f;
    ADD_FAILURE() << "no tensor " << name;
    return std::vector<float>{};
  };
  const NumericsProfile r = profile_rollout();
  const auto kv = tensor(r, "attn.kv"), qi = tensor(r, "indexer.q");
  // Power-of-two scales make e4m3 rounding all but scale-free (only values near its subnormal range
  // see the block), so the block is seen through fp32 scales.
  p.kv_quant_block = 64;
  p.kv_quant_scale = ScaleFmt::none;
  const auto kv_fp32 = tensor(p, "attn.kv");
  EXPECT_FALSE(test::bitwise_equal(kv, kv_fp32)) << "kv.quant_scale fp32";
  p.kv_quant_block = 8;
  EXPECT_FALSE(test::bitwise_equal(kv_fp32, tensor(p, "attn.kv"))) << "kv.quant_block 8";
  p = r;
  p.indexer_quant_scale = ScaleFmt::none;
  const auto qi_fp32 = tensor(p, "indexer.q");
  EXPECT_FALSE(test::bitwise_equal(qi, qi_fp32)) << "indexer.quant_scale fp32";
  p.indexer_quant_block_size = 32;
  EXPECT_FALSE(test::bitwise_equal(qi_fp32, tensor(p, "indexer.q"))) << "indexer.quant_block 32";
}

// ---- recorded profiles --------------------------------------------------------------------------

TEST(RecordedProfile, ReplayUsesTheStoredTextValidateChecksIt) {
  test::TempDir d;
  // A profile file that exists only while recording: replay must take the trace's copy.
  const std::string f =
      write_file(d, "engine.profile",
                 "dsv4-profile = 1\nname = my-engine\nbase = deepseek-inference\nreduce.attention = 32\n");
  const std::string t = d / "t.h5";
  auto r = test::run_cli("record --preset tiny --seed 7 --random 120 --profile " + f + " --out " + t);
  ASSERT_EQ(r.code, 0) << r.out;
  std::filesystem::remove(f);
  const TraceReader rd = TraceReader::open(t);
  const TraceStepInfo s = rd.steps()[0];
  EXPECT_EQ(s.profile, "my-engine");
  const NumericsProfile p = recorded_profile(s, t);
  EXPECT_EQ(p.reduce.attention.block, 32);
  EXPECT_EQ(p.reduce.gemm.block, 0);
  EXPECT_EQ(p.indexer_quant, QuantSim::fp4);
  EXPECT_EQ(s.profile_digest, profile_digest(p));
  r = test::run_cli("replay " + t);
  EXPECT_EQ(r.code, 0) << r.out;
  r = test::run_cli("trace validate " + t);
  EXPECT_EQ(r.code, 0) << r.out;

  // A doctored text: validate names the step and the digest; replay refuses.
  const std::string bad = d / "bad.h5";
  std::filesystem::copy_file(t, bad);
  {
    test::H5Edit e(bad);
    const std::string text = profile_text(p);
    e.set_attr("/steps/000000", "profile_text",
               text.substr(0, text.find("reduce.attention")) + "reduce.attention = 0\n" +
                   text.substr(text.find("reduce.moe")));
  }
  r = test::run_cli("trace validate " + bad);
  EXPECT_NE(r.code, 0);
  EXPECT_NE(r.out.find("/steps/000000"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("does not match the stored profile text"), std::string::npos) << r.out;
  r = test::run_cli("replay " + bad);
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_NE(r.out.find("does not match the stored profile text"), std::string::npos) << r.out;
}

TEST(RecordedProfile, DiffListsTheSitesOfTheTwoSteps) {
  test::TempDir d;
  const std::string a = d / "a.h5", b = d / "b.h5";
  ASSERT_EQ(test::run_cli("record --preset tiny --seed 7 --random 100 --profile train --out " + a).code, 0);
  ASSERT_EQ(
      test::run_cli("record --preset tiny --seed 7 --random 100 --profile deepseek-inference-v2 --out " + b)
          .code,
      0);
  const std::string out = d / "diff.json";
  const auto r = test::run_cli("diff " + a + " " + b + " --json " + out);
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("profile sites that differ (7):"), std::string::npos) << r.out;
  const auto j = nlohmann::json::parse(std::ifstream(out));
  std::vector<std::string> keys;
  for (const auto& s : j.at("profile_sites")) keys.push_back(s.at("site").get<std::string>());
  std::vector<std::string> want;
  for (const auto& s : profile_diff(profile_train(), profile_by_name("deepseek-inference-v2")))
    want.push_back(s.key);
  EXPECT_EQ(keys, want);
  EXPECT_EQ(j.at("tie").at("threshold").get<double>(), 0.125);  // FP4 indexer inputs: 2^-3
  const auto same = test::run_cli("diff " + a + " " + a);
  EXPECT_NE(same.out.find("profile sites: the same precision map"), std::string::npos) << same.out;
}

// ---- bisect -------------------------------------------------------------------------------------

// The bisect of train against deepseek-inference on tiny: every differing site is ranked once; the
// identity site explains nothing; the "all" run equals a forward of B; the ranking is sorted; the
// halving covers the set; singles and groups are each a forward of A with those sites from B.
TEST(Bisect, RanksTheSitesAndItsRunsAreTheProfilesItNames) {
  const Weights& w = test::tiny();
  const auto toks = tokens(w.config(), 160, 9);
  BisectOptions o;
  o.a = profile_train();
  o.b = profile_by_name("deepseek-inference");
  const BisectReport rep = bisect_profiles(w, {toks}, o);
  ASSERT_EQ(rep.sites.size(), 6u);
  EXPECT_EQ(rep.single.size(), rep.sites.size());
  std::set<std::string> ranked;
  for (size_t i = 0; i < rep.single.size(); ++i) {
    ASSERT_EQ(rep.single[i].sites.size(), 1u);
    ranked.insert(rep.single[i].sites[0]);
    if (i > 0) {
      EXPECT_GE(rep.single[i - 1].explained, rep.single[i].explained);
    }
    if (rep.single[i].sites[0] == "kv.quant") {
      EXPECT_EQ(rep.single[i].m.mean_abs_dlogp, 0.0);
      EXPECT_EQ(rep.single[i].m.indexer_flips + rep.single[i].m.routing_flips, 0);
    }
  }
  EXPECT_EQ(ranked.size(), 6u);
  EXPECT_EQ(rep.all.explained, 1.0);
  EXPECT_EQ(rep.tokens, int64_t(toks.size()) - 1);
  EXPECT_GE(rep.groups.size(), 2u);
  // The "all" run is B: its log-prob differences against A are a forward of B against one of A.
  const auto a = run(w, toks, o.a), b = run(w, toks, o.b);
  double sum = 0, mx = 0;
  for (size_t t = 0; t < a->r.seqs[0].logprobs.size(); ++t) {
    const double dl = std::fabs(double(b->r.seqs[0].logprobs[t]) - a->r.seqs[0].logprobs[t]);
    sum += dl;
    mx = std::max(mx, dl);
  }
  EXPECT_EQ(rep.all.m.max_abs_dlogp, mx);
  EXPECT_DOUBLE_EQ(rep.all.m.mean_abs_dlogp, sum / double(rep.tokens));
  EXPECT_GT(rep.all.m.indexer_flips, 0);
  // Identical maps: nothing to bisect.
  o.b = profile_train();
  EXPECT_NE(error_of([&] { bisect_profiles(w, {toks}, o); }).find("same precision map"), std::string::npos);
}

TEST(Bisect, CliWritesJsonAndTakesTwoTraces) {
  test::TempDir d;
  const std::string a = d / "a.h5", b = d / "b.h5", out = d / "bisect.json";
  ASSERT_EQ(test::run_cli("record --preset tiny --seed 7 --random 90 --profile train --out " + a).code, 0);
  ASSERT_EQ(test::run_cli("record --preset tiny --seed 7 --random 90 --profile rollout --out " + b).code, 0);
  auto r = test::run_cli("bisect " + a + " " + b + " --out " + out);
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("bisect train -> rollout: 9 sites differ"), std::string::npos) << r.out;
  const auto j = nlohmann::json::parse(std::ifstream(out));
  EXPECT_EQ(j.at("format"), "dsv4-bisect");
  EXPECT_EQ(j.at("ranking").size(), 9u);
  EXPECT_EQ(j.at("tokens"), 89);
  r = test::run_cli("bisect --profile-a train --profile-b train --preset tiny --random 20");
  EXPECT_EQ(r.code, 2);
  EXPECT_NE(r.out.find("same precision map"), std::string::npos) << r.out;
  r = test::run_cli("bisect " + a + " --preset tiny");
  EXPECT_EQ(r.code, 2) << r.out;
}

TEST(ProfileCli, ListShowDiff) {
  auto r = test::run_cli("profile list");
  ASSERT_EQ(r.code, 0) << r.out;
  for (const auto& n : profile_names()) EXPECT_NE(r.out.find(n), std::string::npos);
  r = test::run_cli("profile show deepseek-inference --canonical");
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_EQ(r.out, profile_text(profile_by_name("deepseek-inference")));
  r = test::run_cli("profile diff deepseek-inference deepseek-inference-v2 --json");
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_EQ(nlohmann::json::parse(r.out).at("sites").size(), 2u);
  test::TempDir d;
  const std::string f =
      write_file(d, "bad.profile", "dsv4-profile = 1\nname = b\nbase = train\nmoe.shared_clamp = maybe\n");
  r = test::run_cli("profile show " + f);
  EXPECT_EQ(r.code, 2);
  EXPECT_NE(r.out.find(f + ":4: site 'moe.shared_clamp'"), std::string::npos) << r.out;
  r = test::run_cli("forward --preset tiny --random 10 --profile " + f);
  EXPECT_EQ(r.code, 2);
  EXPECT_NE(r.out.find(f + ":4:"), std::string::npos) << r.out;
}

}  // namespace
}  // namespace dsv4
