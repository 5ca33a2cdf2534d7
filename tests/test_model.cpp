// Whole-model properties of the CPU forward: determinism (run to run, thread count, batch
// composition), causality, Overrides, activation scale, checkpoint round trips and bad weights.
#include <gtest/gtest.h>
#include <omp.h>

#include <cmath>
#include <filesystem>
#include <set>

#include "model/collect.h"
#include "model/error.h"
#include "model/forward.h"
#include "model/tokens.h"
#include "model/weights.h"
#include "test_util.h"
#include "tiny_model.h"

namespace dsv4 {
namespace {

namespace fs = std::filesystem;

using test::tiny;
using test::tiny_b;

struct Run {
  SequenceResult result;
  DecisionLog log{true};
};

std::unique_ptr<Run> run(const Weights& w, const std::vector<int32_t>& tokens, const NumericsProfile& p,
                         int threads = 0, const Overrides* ov = nullptr) {
  auto r = std::make_unique<Run>();
  RunOptions o;
  o.profile = p;
  o.threads = threads;
  o.observer = &r->log;
  o.overrides = ov;
  r->result = forward(w, {tokens}, o).seqs[0];
  return r;
}

// Every tensor and decision of two runs, bitwise.
void expect_same_run(const Run& a, const Run& b) {
  ASSERT_EQ(a.log.tensor_order, b.log.tensor_order);
  for (const auto& key : a.log.tensor_order) {
    const TensorCopy& ta = a.log.tensors.at(key);
    const TensorCopy& tb = b.log.tensors.at(key);
    EXPECT_TRUE(test::bitwise_equal(ta.f, tb.f)) << key.second << " layer " << key.first.second;
    EXPECT_TRUE(test::bitwise_equal(ta.i, tb.i)) << key.second << " layer " << key.first.second;
  }
  for (const auto& [key, r] : a.log.indexer)
    EXPECT_EQ(r.ids, b.log.indexer.at(key).ids) << "layer " << key.second;
  for (const auto& [key, r] : a.log.routing)
    EXPECT_EQ(r.ids, b.log.routing.at(key).ids) << "layer " << key.second;
  EXPECT_TRUE(test::bitwise_equal(a.result.logprobs, b.result.logprobs));
}

TEST(Model, RunToRunBitwise) {
  const auto toks = random_tokens(96, 512, 3);
  for (const auto& p : {profile_train(), profile_rollout()}) {
    auto a = run(tiny(), toks, p), b = run(tiny(), toks, p);
    expect_same_run(*a, *b);
  }
}

TEST(Model, ThreadCountInvariance) {
  const auto toks = random_tokens(77, 512, 4);
  for (const auto& p : {profile_train(), profile_rollout()}) {
    auto one = run(tiny(), toks, p, 1);
    for (int th : {2, 3}) {
      auto other = run(tiny(), toks, p, th);
      expect_same_run(*one, *other);
    }
  }
}

TEST(Model, BatchInvariance) {
  const auto a = random_tokens(41, 512, 5), b = random_tokens(130, 512, 6), c = random_tokens(7, 512, 8);
  RunOptions o;
  DecisionLog alone_log(true), batch_log(true);
  o.observer = &alone_log;
  const auto alone = forward(tiny(), {a}, o);
  o.observer = &batch_log;
  const auto batch = forward(tiny(), {b, a, c}, o);
  EXPECT_TRUE(test::bitwise_equal(alone.seqs[0].logprobs, batch.seqs[1].logprobs));
  int compared = 0;
  for (const auto& key : alone_log.tensor_order) {
    auto bkey = key;
    bkey.first.first = 1;  // sequence index in the batch
    EXPECT_TRUE(test::bitwise_equal(alone_log.tensors.at(key).f, batch_log.tensors.at(bkey).f)) << key.second;
    ++compared;
  }
  EXPECT_GT(compared, 50);
}

TEST(Model, Causality) {
  // Changing token j (or appending tokens) changes nothing at positions < j, bitwise.
  for (int64_t T : {40, 133}) {
    auto toks = random_tokens(T, 512, 9);
    auto base = run(tiny(), toks, profile_train());
    for (int64_t j : {int64_t(1), T / 2, T - 1}) {
      auto changed = toks;
      changed[j] = (changed[j] + 1) % 512;
      auto other = run(tiny(), changed, profile_train());
      const auto& la = base->log.tensors.at({{0, -1}, "logits"}).f;
      const auto& lb = other->log.tensors.at({{0, -1}, "logits"}).f;
      const size_t row = 512;
      EXPECT_TRUE(test::bitwise_equal(std::vector<float>(la.begin(), la.begin() + j * row),
                                      std::vector<float>(lb.begin(), lb.begin() + j * row)))
          << "T=" << T << " j=" << j;
      EXPECT_FALSE(test::bitwise_equal(std::vector<float>(la.begin() + j * row, la.end()),
                                       std::vector<float>(lb.begin() + j * row, lb.end())))
          << "changing token " << j << " changed nothing";
    }
    // Appending tokens (e.g. padding to a multiple of 128) leaves the real tokens' logits as they were.
    auto padded = toks;
    while (padded.size() % 128) padded.push_back(0);
    if (padded.size() == toks.size()) padded.resize(toks.size() + 128, 0);
    auto pad = run(tiny(), padded, profile_train());
    const auto& la = base->log.tensors.at({{0, -1}, "logits"}).f;
    const auto& lp = pad->log.tensors.at({{0, -1}, "logits"}).f;
    EXPECT_TRUE(test::bitwise_equal(la, std::vector<float>(lp.begin(), lp.begin() + la.size())));
  }
}

TEST(Model, ActivationScaleStaysSane) {
  auto r = run(tiny(), random_tokens(128, 512, 10), profile_train());
  auto rms = [](const std::vector<float>& v) {
    double s = 0;
    for (float x : v) s += double(x) * x;
    return std::sqrt(s / v.size());
  };
  const double embed = rms(r->log.tensors.at({{0, -1}, "embed"}).f);
  double prev = embed;
  for (int L = 0; L < 6; ++L) {
    for (const char* name : {"attn.hc_post", "ffn.hc_post"}) {
      const double v = rms(r->log.tensors.at({{0, L}, name}).f);
      EXPECT_GT(v, 0.25 * embed) << name << " layer " << L;
      EXPECT_LT(v, 20.0 * embed) << name << " layer " << L;
      // One sublayer may add a few times the stream's scale (post = 2 sigmoid), never orders of magnitude.
      EXPECT_GT(v / prev, 0.25) << name << " layer " << L;
      EXPECT_LT(v / prev, 4.0) << name << " layer " << L;
      prev = v;
    }
    // Sublayer outputs are alive, neither vanishing nor exploding.
    const double a = rms(r->log.tensors.at({{0, L}, "attn.out"}).f),
                 m = rms(r->log.tensors.at({{0, L}, "moe.out"}).f);
    EXPECT_GT(a, 1e-3) << L;
    EXPECT_LT(a, 10) << L;
    EXPECT_GT(m, 1e-3) << L;
    EXPECT_LT(m, 10) << L;
  }
  for (float lp : r->result.logprobs) {
    EXPECT_TRUE(std::isfinite(lp));
    EXPECT_LE(lp, 0.0f);
  }
}

TEST(Model, ManyLengthsAndTinyB) {
  for (const Weights* w : {&tiny(), &tiny_b()}) {
    for (int64_t T : {1, 2, 3, 4, 5, 7, 8, 15, 16, 17, 31, 127, 128, 129, 257}) {
      for (const auto& p : {profile_train(), profile_rollout()}) {
        RunOptions o;
        o.profile = p;
        const auto r = forward(*w, {random_tokens(T, w->config().vocab_size, uint64_t(T))}, o);
        ASSERT_EQ(int64_t(r.seqs[0].logprobs.size()), T - 1);
        for (float lp : r.seqs[0].logprobs) {
          ASSERT_TRUE(std::isfinite(lp)) << "T=" << T;
          ASSERT_LE(lp, 0.0f);
        }
      }
    }
  }
}

TEST(Model, IndexerSelectionIsActiveAndCausal) {
  const int64_t T = 200;  // T/4 = 50 groups > index_topk = 8
  auto r = run(tiny(), random_tokens(T, 512, 12), profile_train());
  ASSERT_EQ(r->log.indexer.size(), 2u);  // layers 1 and 3 are C4
  for (const auto& [key, rec] : r->log.indexer) {
    EXPECT_EQ(rec.k, 8);
    for (int64_t p = 0; p < T; ++p) {
      int valid = 0;
      for (int j = 0; j < rec.k; ++j) {
        const int32_t g = rec.ids[p * rec.k + j];
        if (g == -1) continue;
        ++valid;
        EXPECT_LT(g, (p + 1) / 4) << "layer " << key.second << " token " << p;
        if (j > 0 && rec.ids[p * rec.k + j - 1] != -1) {
          EXPECT_LT(rec.ids[p * rec.k + j - 1], g);
        }
      }
      EXPECT_EQ(valid, std::min<int64_t>(8, (p + 1) / 4));
    }
  }
}

TEST(Model, HashLayersFollowTheTable) {
  const auto toks = random_tokens(50, 512, 13);
  auto r = run(tiny(), toks, profile_train());
  for (int L = 0; L < 2; ++L) {
    const RoutingRecord& rec = r->log.routing.at({0, L});
    EXPECT_TRUE(rec.hashed);
    const int32_t* table = tiny().layer_i(L, "mlp.topk.tid2eid");
    for (size_t t = 0; t < toks.size(); ++t) {
      std::set<int32_t> want(table + toks[t] * 2, table + toks[t] * 2 + 2);
      std::set<int32_t> got(rec.ids.begin() + t * 2, rec.ids.begin() + t * 2 + 2);
      EXPECT_EQ(want, got) << "layer " << L << " token " << t;
    }
  }
  EXPECT_FALSE(r->log.routing.at({0, 2}).hashed);
}

TEST(Model, ForcingRecordedDecisionsReproducesBitwise) {
  const auto toks = random_tokens(150, 512, 14);
  for (const auto& p : {profile_train(), profile_rollout()}) {
    auto free_run = run(tiny(), toks, p);
    const Overrides ov = free_run->log.to_overrides();
    EXPECT_EQ(ov.all_indexer().size(), 2u);
    EXPECT_EQ(ov.all_experts().size(), 4u);
    auto forced = run(tiny(), toks, p, 0, &ov);
    expect_same_run(*free_run, *forced);
  }
}

TEST(Model, ForcingOtherDecisionsTakesEffect) {
  // Force the rollout profile's decisions into the train profile: the train run then uses them.
  const auto toks = random_tokens(150, 512, 15);
  auto roll = run(tiny(), toks, profile_rollout());
  const Overrides ov = roll->log.to_overrides();
  auto forced = run(tiny(), toks, profile_train(), 0, &ov);
  for (const auto& [key, rec] : roll->log.indexer) EXPECT_EQ(forced->log.indexer.at(key).ids, rec.ids);
  for (const auto& [key, rec] : roll->log.routing) EXPECT_EQ(forced->log.routing.at(key).ids, rec.ids);
}

std::string override_error(const Overrides& ov, int64_t T = 60) {
  try {
    RunOptions o;
    o.overrides = &ov;
    forward(tiny(), {random_tokens(T, 512, 16)}, o);
  } catch (const OverrideError& e) {
    return e.what();
  }
  return "";
}

TEST(Model, InvalidForcedDecisionsAreRejected) {
  const int64_t T = 60;  // 15 groups, width min(8, 15) = 8
  auto valid_indexer = [&] {
    ForcedSelection s{T, 8, std::vector<int32_t>(T * 8, -1)};
    return s;
  };
  {
    Overrides ov;
    ov.force_indexer(0, 1, ForcedSelection{T, 7, std::vector<int32_t>(T * 7, -1)});
    const std::string e = override_error(ov);
    EXPECT_NE(e.find("layer 1"), std::string::npos) << e;
    EXPECT_NE(e.find("width 7"), std::string::npos) << e;
  }
  {
    Overrides ov;
    auto s = valid_indexer();
    s.ids[20 * 8 + 3] = 9;  // token 20 sees groups < 5
    ov.force_indexer(0, 3, s);
    const std::string e = override_error(ov);
    EXPECT_NE(e.find("layer 3 token 20"), std::string::npos) << e;
    EXPECT_NE(e.find("not yet visible"), std::string::npos) << e;
  }
  {
    Overrides ov;
    auto s = valid_indexer();
    s.ids[59 * 8] = 15;
    ov.force_indexer(0, 1, s);
    const std::string e = override_error(ov);
    EXPECT_NE(e.find("token 59"), std::string::npos) << e;
    EXPECT_NE(e.find("out of range"), std::string::npos) << e;
  }
  {
    Overrides ov;
    auto s = valid_indexer();
    s.ids[40 * 8] = 2;
    s.ids[40 * 8 + 5] = 2;
    ov.force_indexer(0, 1, s);
    EXPECT_NE(override_error(ov).find("appears twice"), std::string::npos);
  }
  {
    Overrides ov;
    ov.force_indexer(0, 2, valid_indexer());  // layer 2 is C128
    EXPECT_NE(override_error(ov).find("no indexer"), std::string::npos);
  }
  {
    Overrides ov;
    ov.force_experts(0, 0, ForcedSelection{T, 2, std::vector<int32_t>(T * 2, 0)});  // hash layer
    EXPECT_NE(override_error(ov).find("hash-routed"), std::string::npos);
  }
  {
    Overrides ov;
    std::vector<int32_t> ids(T * 2);
    for (int64_t t = 0; t < T; ++t) ids[t * 2] = 0, ids[t * 2 + 1] = 1;
    ids[33 * 2 + 1] = 8;  // E = 8
    ov.force_experts(0, 4, ForcedSelection{T, 2, ids});
    const std::string e = override_error(ov);
    EXPECT_NE(e.find("layer 4 token 33"), std::string::npos) << e;
    EXPECT_NE(e.find("expert id 8"), std::string::npos) << e;
  }
  {
    Overrides ov;
    ov.force_experts(0, 4, ForcedSelection{T, 3, std::vector<int32_t>(T * 3, 0)});
    EXPECT_NE(override_error(ov).find("width 3"), std::string::npos);
  }
  {
    Overrides ov;
    ov.force_experts(0, 4, ForcedSelection{T - 1, 2, std::vector<int32_t>((T - 1) * 2, 0)});
    EXPECT_NE(override_error(ov).find("59 rows"), std::string::npos);
  }
  {
    Overrides ov;
    ov.force_experts(3, 4, ForcedSelection{T, 2, std::vector<int32_t>(T * 2, 0)});
    EXPECT_NE(override_error(ov).find("sequence 3"), std::string::npos);
  }
}

TEST(Model, BadTokensAreRejected) {
  RunOptions o;
  EXPECT_THROW(forward(tiny(), {{1, 2, 512}}, o), InputError);
  EXPECT_THROW(forward(tiny(), {{1, -3}}, o), InputError);
  EXPECT_THROW(forward(tiny(), {{}}, o), InputError);
  try {
    forward(tiny(), {{1, 2}, {3, 4, 999}}, o);
    FAIL();
  } catch (const InputError& e) {
    EXPECT_NE(std::string(e.what()).find("sequence 1 position 2"), std::string::npos) << e.what();
  }
}

TEST(Model, ProfilesDifferButStayClose) {
  const auto toks = random_tokens(200, 512, 17);
  auto a = run(tiny(), toks, profile_train()), b = run(tiny(), toks, profile_rollout());
  EXPECT_FALSE(test::bitwise_equal(a->result.logprobs, b->result.logprobs));
  double max_diff = 0;
  for (size_t t = 0; t < a->result.logprobs.size(); ++t)
    max_diff = std::max(max_diff, std::fabs(double(a->result.logprobs[t]) - b->result.logprobs[t]));
  EXPECT_LT(max_diff, 0.5);
  // Hash layers decide by token id: identical in both profiles.
  for (int L = 0; L < 2; ++L) EXPECT_EQ(a->log.routing.at({0, L}).ids, b->log.routing.at({0, L}).ids);
}

class CheckpointTest : public ::testing::Test {
 protected:
  std::string dir(const std::string& name) {
    const std::string d = tmp_ / name;
    fs::remove_all(d);
    return d;
  }
  const test::TempDir tmp_;
};

TEST_F(CheckpointTest, SaveLoadReproducesBitwise) {
  const auto toks = random_tokens(70, 512, 18);
  auto mem = run(tiny(), toks, profile_train());
  for (int64_t shard : {int64_t(0), int64_t(2) << 20}) {
    const std::string d = dir(shard ? "sharded" : "single");
    tiny().save(d, shard);
    if (shard) {
      EXPECT_TRUE(fs::exists(d + "/model.safetensors.index.json"));
    }
    const Weights loaded = Weights::load(config_from_file(d + "/config.json"), d);
    auto disk = run(loaded, toks, profile_train());
    expect_same_run(*mem, *disk);
  }
}

TEST_F(CheckpointTest, BadWeightsNameTheTensor) {
  const ModelConfig c = preset("tiny");
  const std::string d = dir("bad");
  fs::create_directories(d);
  auto write_without = [&](const std::string& skip, const std::string& reshape, const std::string& narrow,
                           bool extra) {
    SafetensorsWriter w;
    for (const auto& [name, t] : tiny().tensors()) {
      if (name == skip) continue;
      std::vector<int64_t> shape = t.shape;
      if (name == reshape) shape[0] -= 1;
      const int64_t n = [&] {
        int64_t v = 1;
        for (auto s : shape) v *= s;
        return v;
      }();
      if (t.dtype == StDType::I32)
        w.add_i32(name, shape, std::vector<int32_t>(t.i.begin(), t.i.begin() + n));
      else if (t.dtype == StDType::F32 && name != narrow)
        w.add_f32(name, shape, std::vector<float>(t.f.begin(), t.f.begin() + n));
      else
        w.add_bf16(name, shape, std::vector<float>(t.f.begin(), t.f.begin() + n));
    }
    if (extra) w.add_f32("model.layers.9.self_attn.wq_a.weight", {2}, {1, 2});
    w.write(d + "/model.safetensors");
  };
  auto load_error = [&] {
    try {
      Weights::load(c, d);
    } catch (const WeightsError& e) {
      return std::string(e.what());
    }
    return std::string();
  };
  write_without("model.layers.3.self_attn.wq_b.weight", "", "", false);
  EXPECT_NE(load_error().find("'model.layers.3.self_attn.wq_b.weight' is missing"), std::string::npos)
      << load_error();
  write_without("", "model.layers.2.mlp.experts.5.down_proj.weight", "", false);
  EXPECT_NE(load_error().find("model.layers.2.mlp.experts.5.down_proj.weight"), std::string::npos);
  EXPECT_NE(load_error().find("expected shape [256, 128], found [255, 128]"), std::string::npos)
      << load_error();
  write_without("", "", "model.layers.1.self_attn.attn_sink", false);
  EXPECT_NE(load_error().find("keep-fp32"), std::string::npos) << load_error();
  write_without("", "", "", true);
  EXPECT_NE(load_error().find("unexpected tensor 'model.layers.9.self_attn.wq_a.weight'"), std::string::npos);
}

}  // namespace
}  // namespace dsv4

#include "model/manifest.h"

namespace dsv4 {
namespace {

TEST(Manifest, MatchesWhatTheForwardReports) {
  for (const Weights* w : {&tiny(), &tiny_b()}) {
    for (int64_t T : {1, 4, 9, 70}) {
      auto r = run(*w, random_tokens(T, w->config().vocab_size, 19), profile_train());
      const auto m = tensor_manifest(w->config(), T);
      ASSERT_EQ(m.size(), r->log.tensor_order.size()) << "T=" << T;
      for (size_t i = 0; i < m.size(); ++i) {
        const auto& key = r->log.tensor_order[i];
        EXPECT_EQ(m[i].layer, key.first.second) << i;
        EXPECT_EQ(m[i].name, key.second) << i;
        const TensorCopy& t = r->log.tensors.at(key);
        EXPECT_EQ(m[i].shape, t.shape) << m[i].name << " layer " << m[i].layer;
        EXPECT_EQ(m[i].dtype, t.dtype) << m[i].name;
      }
    }
  }
}

}  // namespace
}  // namespace dsv4
