// ModelConfig: config.json parsing, validation messages, presets (MODEL.md §1.1, §9.1) and shape math.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>
#include <string>

#include "model/config.h"
#include "model/error.h"

namespace dsv4 {
namespace {

using json = nlohmann::json;

// Runs `f`, expecting a ConfigError whose message contains every substring in `parts`.
void expect_config_error(const std::function<void()>& f, const std::vector<std::string>& parts) {
  try {
    f();
    ADD_FAILURE() << "expected ConfigError containing '" << parts.front() << "'";
  } catch (const ConfigError& e) {
    const std::string msg = e.what();
    for (const auto& p : parts) EXPECT_NE(msg.find(p), std::string::npos) << "'" << p << "' not in: " << msg;
  }
}

// Parses the tiny preset's JSON after `edit`, expecting a ConfigError naming `parts`.
void expect_json_error(const std::function<void(json&)>& edit, const std::vector<std::string>& parts) {
  json j = json::parse(config_to_json(preset("tiny")));
  edit(j);
  std::vector<std::string> all = {"config.json: "};
  all.insert(all.end(), parts.begin(), parts.end());
  expect_config_error([&] { config_from_json(j.dump(), "config.json"); }, all);
}

void expect_same(const ModelConfig& a, const ModelConfig& b) {
  EXPECT_EQ(a.vocab_size, b.vocab_size);
  EXPECT_EQ(a.hidden_size, b.hidden_size);
  EXPECT_EQ(a.num_hidden_layers, b.num_hidden_layers);
  EXPECT_EQ(a.num_attention_heads, b.num_attention_heads);
  EXPECT_EQ(a.head_dim, b.head_dim);
  EXPECT_EQ(a.qk_rope_head_dim, b.qk_rope_head_dim);
  EXPECT_EQ(a.q_lora_rank, b.q_lora_rank);
  EXPECT_EQ(a.o_groups, b.o_groups);
  EXPECT_EQ(a.o_lora_rank, b.o_lora_rank);
  EXPECT_EQ(a.sliding_window, b.sliding_window);
  EXPECT_EQ(a.compress_ratios, b.compress_ratios);
  EXPECT_EQ(a.compress_rope_theta, b.compress_rope_theta);
  EXPECT_EQ(a.rope_theta, b.rope_theta);
  EXPECT_EQ(a.rope_scaling.type, b.rope_scaling.type);
  EXPECT_EQ(a.rope_scaling.factor, b.rope_scaling.factor);
  EXPECT_EQ(a.rope_scaling.original_max_position_embeddings, b.rope_scaling.original_max_position_embeddings);
  EXPECT_EQ(a.rope_scaling.beta_fast, b.rope_scaling.beta_fast);
  EXPECT_EQ(a.rope_scaling.beta_slow, b.rope_scaling.beta_slow);
  EXPECT_EQ(a.index_n_heads, b.index_n_heads);
  EXPECT_EQ(a.index_head_dim, b.index_head_dim);
  EXPECT_EQ(a.index_topk, b.index_topk);
  EXPECT_EQ(a.n_routed_experts, b.n_routed_experts);
  EXPECT_EQ(a.num_experts_per_tok, b.num_experts_per_tok);
  EXPECT_EQ(a.n_shared_experts, b.n_shared_experts);
  EXPECT_EQ(a.moe_intermediate_size, b.moe_intermediate_size);
  EXPECT_EQ(a.num_hash_layers, b.num_hash_layers);
  EXPECT_EQ(a.scoring_func, b.scoring_func);
  EXPECT_EQ(a.norm_topk_prob, b.norm_topk_prob);
  EXPECT_EQ(a.routed_scaling_factor, b.routed_scaling_factor);
  EXPECT_EQ(a.swiglu_limit, b.swiglu_limit);
  EXPECT_EQ(a.hc_mult, b.hc_mult);
  EXPECT_EQ(a.hc_sinkhorn_iters, b.hc_sinkhorn_iters);
  EXPECT_EQ(a.hc_eps, b.hc_eps);
  EXPECT_EQ(a.rms_norm_eps, b.rms_norm_eps);
}

int64_t component(const ModelConfig& c, const std::string& name) {
  for (const auto& p : param_counts(c))
    if (p.component == name) return p.params;
  ADD_FAILURE() << "no component " << name;
  return -1;
}

// ---- presets and round trips --------------------------------------------------------------------

TEST(Config, EveryPresetRoundTrips) {
  for (const auto& name : preset_names()) {
    SCOPED_TRACE(name);
    ModelConfig c = preset(name);
    const std::string text = config_to_json(c);
    ModelConfig back = config_from_json(text, name + ".json");
    expect_same(c, back);
    EXPECT_EQ(config_to_json(back), text);
    json j = json::parse(text);
    EXPECT_EQ(j["architectures"], json::array({"DeepseekV4ForCausalLM"}));
    EXPECT_EQ(j["model_type"], "deepseek_v4");
    EXPECT_EQ(j["rope_scaling"]["type"], c.rope_scaling.type);
  }
}

TEST(Config, FileRoundTrip) {
  const std::string path = ::testing::TempDir() + "/test_config_roundtrip.json";
  {
    std::ofstream out(path);
    out << config_to_json(preset("tiny-b"));
  }
  expect_same(config_from_file(path), preset("tiny-b"));
  std::filesystem::remove(path);
  expect_config_error([&] { config_from_file(path); }, {path, "cannot open"});
}

TEST(Config, TinyMatchesModelMd) {
  ModelConfig c = preset("tiny");
  EXPECT_EQ(c.vocab_size, 512);
  EXPECT_EQ(c.hidden_size, 256);
  EXPECT_EQ(c.num_hidden_layers, 6);
  EXPECT_EQ(c.compress_ratios, (std::vector<int>{0, 4, 128, 4, 128, 0}));
  EXPECT_EQ(c.num_hash_layers, 2);
  EXPECT_EQ(c.num_attention_heads, 6);
  EXPECT_EQ(c.head_dim, 256);
  EXPECT_EQ(c.qk_rope_head_dim, 64);
  EXPECT_EQ(c.nope_dim(), 192);
  EXPECT_EQ(c.q_lora_rank, 128);
  EXPECT_EQ(c.o_groups, 2);
  EXPECT_EQ(c.o_lora_rank, 64);
  EXPECT_EQ(c.heads_per_group(), 3);
  EXPECT_EQ(c.sliding_window, 16);
  EXPECT_EQ(c.index_n_heads, 3);
  EXPECT_EQ(c.index_head_dim, 128);
  EXPECT_EQ(c.index_topk, 8);
  EXPECT_EQ(c.n_routed_experts, 8);
  EXPECT_EQ(c.num_experts_per_tok, 2);
  EXPECT_EQ(c.n_shared_experts, 1);
  EXPECT_EQ(c.moe_intermediate_size, 128);
  EXPECT_EQ(c.routed_scaling_factor, 1.5f);
  EXPECT_EQ(c.swiglu_limit, 10.0f);
  EXPECT_EQ(c.hc_mult, 4);
  EXPECT_EQ(c.hc_sinkhorn_iters, 20);
  EXPECT_EQ(c.hc_eps, 1e-6f);
  EXPECT_EQ(c.rms_norm_eps, 1e-6f);
  EXPECT_EQ(c.rope_theta, 10000.0f);
  EXPECT_EQ(c.compress_rope_theta, 160000.0f);
  EXPECT_EQ(c.rope_scaling.type, "yarn");
  EXPECT_EQ(c.rope_scaling.factor, 16.0f);
  EXPECT_EQ(c.rope_scaling.original_max_position_embeddings, 65536);
  EXPECT_EQ(c.rope_scaling.beta_fast, 32.0f);
  EXPECT_EQ(c.rope_scaling.beta_slow, 1.0f);
  EXPECT_TRUE(c.is_hash_layer(1));
  EXPECT_FALSE(c.is_hash_layer(2));
}

TEST(Config, TinyBMatchesModelMd) {
  ModelConfig c = preset("tiny-b");
  EXPECT_EQ(c.num_attention_heads, 5);
  EXPECT_EQ(c.o_groups, 5);
  EXPECT_EQ(c.heads_per_group(), 1);
  EXPECT_EQ(c.index_n_heads, 5);
  EXPECT_EQ(c.index_head_dim, 128);
  EXPECT_EQ(c.head_dim, 192);
  EXPECT_EQ(c.nope_dim(), 128);
  EXPECT_EQ(c.sliding_window, 8);
  EXPECT_EQ(c.index_topk, 4);
  EXPECT_EQ(c.num_experts_per_tok, 3);
  EXPECT_EQ(c.n_routed_experts, 6);
  EXPECT_EQ(c.hidden_size, 256);
  EXPECT_EQ(c.compress_ratios, preset("tiny").compress_ratios);
}

TEST(Config, UnknownPresetListsKnownNames) {
  expect_config_error([] { preset("huge"); }, {"huge", "tiny", "tiny-b", "mid", "flash", "pro"});
}

struct LayerTypes {
  int c1 = 0, c4 = 0, c128 = 0;
};
LayerTypes count_types(const ModelConfig& c) {
  LayerTypes t;
  for (int r : c.compress_ratios) {
    if (r == 0) ++t.c1;
    if (r == 4) ++t.c4;
    if (r == 128) ++t.c128;
  }
  return t;
}

TEST(Config, FlashLayerTypesMatchModelMd) {
  ModelConfig c = preset("flash");
  ASSERT_EQ(c.num_hidden_layers, 43);
  ASSERT_EQ(c.compress_ratios.size(), 43u);
  LayerTypes t = count_types(c);
  EXPECT_EQ(t.c1, 2);
  EXPECT_EQ(t.c4, 21);
  EXPECT_EQ(t.c128, 20);
  EXPECT_EQ(c.ratio(0), 0);
  EXPECT_EQ(c.ratio(1), 0);
  EXPECT_EQ(c.ratio(2), 4);
  EXPECT_EQ(c.ratio(3), 128);
  EXPECT_EQ(c.ratio(41), 128);
  EXPECT_EQ(c.ratio(42), 4);
  EXPECT_EQ(c.num_c4_layers(), 21);
  EXPECT_EQ(c.c4_ordinal(42), 20);
}

TEST(Config, ProLayerTypesMatchModelMd) {
  ModelConfig c = preset("pro");
  ASSERT_EQ(c.num_hidden_layers, 61);
  ASSERT_EQ(c.compress_ratios.size(), 61u);
  LayerTypes t = count_types(c);
  EXPECT_EQ(t.c1, 0);
  EXPECT_EQ(t.c4, 30);
  EXPECT_EQ(t.c128, 31);
  EXPECT_EQ(c.ratio(0), 128);
  EXPECT_EQ(c.ratio(1), 128);
  EXPECT_EQ(c.ratio(60), 4);
  EXPECT_EQ(c.hidden_size, 7168);
  EXPECT_EQ(c.routed_scaling_factor, 2.5f);
}

TEST(Config, C4Ordinal) {
  ModelConfig c = preset("tiny");
  EXPECT_EQ(c.num_c4_layers(), 2);
  EXPECT_EQ(c.c4_ordinal(0), -1);
  EXPECT_EQ(c.c4_ordinal(1), 0);
  EXPECT_EQ(c.c4_ordinal(2), -1);
  EXPECT_EQ(c.c4_ordinal(3), 1);
  EXPECT_EQ(c.c4_ordinal(5), -1);
}

// ---- parsing ------------------------------------------------------------------------------------

TEST(ConfigParse, MtpEntryIsDropped) {
  json j = json::parse(config_to_json(preset("tiny")));
  j["compress_ratios"] = {0, 4, 128, 4, 128, 0, 0};
  ModelConfig c = config_from_json(j.dump(), "config.json");
  EXPECT_EQ(c.compress_ratios, (std::vector<int>{0, 4, 128, 4, 128, 0}));
}

TEST(ConfigParse, CompressRatiosCountMismatch) {
  expect_json_error([](json& j) { j["compress_ratios"] = {0, 4, 128, 4, 128, 0, 0, 0}; },
                    {"'compress_ratios'", "8 entries", "num_hidden_layers (6)"});
  expect_json_error([](json& j) { j["compress_ratios"] = {0, 4}; }, {"'compress_ratios'", "2 entries"});
  expect_json_error([](json& j) { j["compress_ratios"] = {0, 4, "x", 4, 128, 0}; },
                    {"'compress_ratios[2]'", "must be an integer, found string"});
}

TEST(ConfigParse, RopeTypeSpelling) {
  json j = json::parse(config_to_json(preset("tiny")));
  j["rope_scaling"].erase("type");
  j["rope_scaling"]["rope_type"] = "yarn";
  j["rope_scaling"]["factor"] = 8;
  ModelConfig c = config_from_json(j.dump(), "config.json");
  EXPECT_EQ(c.rope_scaling.type, "yarn");
  EXPECT_EQ(c.rope_scaling.factor, 8.0f);

  j["rope_scaling"]["type"] = "none";  // disagrees with rope_type
  expect_config_error([&] { config_from_json(j.dump(), "config.json"); }, {"config.json: ", "rope_scaling"});
}

TEST(ConfigParse, RopeScalingNullOrAbsentMeansNone) {
  json j = json::parse(config_to_json(preset("tiny")));
  j["rope_scaling"] = nullptr;
  EXPECT_EQ(config_from_json(j.dump(), "c").rope_scaling.type, "none");
  j.erase("rope_scaling");
  ModelConfig c = config_from_json(j.dump(), "c");
  EXPECT_EQ(c.rope_scaling.type, "none");
  // A "none" config round-trips.
  expect_same(config_from_json(config_to_json(c), "c"), c);
}

TEST(ConfigParse, UnknownFieldsAreIgnoredAndDefaultsApply) {
  json j = json::parse(config_to_json(preset("tiny")));
  j["torch_dtype"] = "bfloat16";
  j["num_nextn_predict_layers"] = 1;
  j["quantization_config"] = {{"fmt", "e4m3"}};
  for (const char* k : {"n_shared_experts", "scoring_func", "norm_topk_prob", "routed_scaling_factor",
                        "swiglu_limit", "hc_mult", "hc_sinkhorn_iters", "hc_eps", "rms_norm_eps"})
    j.erase(k);
  ModelConfig c = config_from_json(j.dump(), "config.json");
  ModelConfig d;
  EXPECT_EQ(c.n_shared_experts, d.n_shared_experts);
  EXPECT_EQ(c.scoring_func, d.scoring_func);
  EXPECT_EQ(c.routed_scaling_factor, d.routed_scaling_factor);
  EXPECT_EQ(c.hc_mult, d.hc_mult);
  EXPECT_EQ(c.rms_norm_eps, d.rms_norm_eps);
}

TEST(ConfigParse, BadJsonNamesOriginAndPosition) {
  expect_config_error([] { config_from_json("{\"vocab_size\": 512,, }", "cfg/config.json"); },
                      {"cfg/config.json: ", "not valid JSON", "byte"});
  expect_config_error([] { config_from_json("", "empty.json"); }, {"empty.json: ", "not valid JSON"});
  expect_config_error([] { config_from_json("[1, 2]", "arr.json"); }, {"arr.json: ", "object"});
}

TEST(ConfigParse, MissingFieldIsNamed) {
  for (const char* f :
       {"vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "head_dim",
        "qk_rope_head_dim", "q_lora_rank", "o_groups", "o_lora_rank", "sliding_window", "index_n_heads",
        "index_head_dim", "index_topk", "n_routed_experts", "num_experts_per_tok", "moe_intermediate_size",
        "num_hash_layers", "compress_ratios"}) {
    SCOPED_TRACE(f);
    expect_json_error([&](json& j) { j.erase(f); }, {std::string("field '") + f + "' is missing"});
  }
}

TEST(ConfigParse, WrongTypeIsNamed) {
  expect_json_error([](json& j) { j["head_dim"] = "256"; },
                    {"field 'head_dim' must be an integer, found string"});
  expect_json_error([](json& j) { j["hidden_size"] = 256.5; },
                    {"'hidden_size' must be an integer, found float"});
  expect_json_error([](json& j) { j["rms_norm_eps"] = "1e-6"; }, {"'rms_norm_eps' must be a number"});
  expect_json_error([](json& j) { j["norm_topk_prob"] = 1; }, {"'norm_topk_prob' must be a boolean"});
  expect_json_error([](json& j) { j["scoring_func"] = 3; }, {"'scoring_func' must be a string"});
  expect_json_error([](json& j) { j["compress_ratios"] = 4; }, {"'compress_ratios' must be an array"});
  expect_json_error([](json& j) { j["rope_scaling"] = 16; }, {"'rope_scaling' must be an object"});
  expect_json_error([](json& j) { j["rope_scaling"]["factor"] = "16"; }, {"'rope_scaling.factor'"});
  expect_json_error([](json& j) { j["vocab_size"] = 1LL << 40; }, {"'vocab_size'", "out of range"});
  expect_json_error([](json& j) { j["rope_theta"] = 1e300; }, {"'rope_theta'", "fp32"});
}

// ---- validation rules ---------------------------------------------------------------------------

TEST(ConfigValidate, EachRuleNamesTheField) {
  auto E = [](const std::function<void(json&)>& edit, std::vector<std::string> parts) {
    expect_json_error(edit, parts);
  };
  E([](json& j) { j["o_groups"] = 4; }, {"field 'o_groups' (4) must divide num_attention_heads (6)"});
  E([](json& j) { j["hidden_size"] = 0; }, {"'hidden_size' (0) must be >= 1"});
  E([](json& j) { j["num_hidden_layers"] = 0; }, {"'num_hidden_layers' (0) must be >= 1"});
  E([](json& j) { j["vocab_size"] = -3; }, {"'vocab_size' (-3)"});
  E([](json& j) { j["sliding_window"] = 0; }, {"'sliding_window'"});
  E([](json& j) { j["index_topk"] = 0; }, {"'index_topk'"});
  E([](json& j) { j["hc_mult"] = 0; }, {"'hc_mult'"});
  E([](json& j) { j["hc_sinkhorn_iters"] = 0; }, {"'hc_sinkhorn_iters'"});
  E([](json& j) { j["n_shared_experts"] = -1; }, {"'n_shared_experts' (-1) must be >= 0"});
  E([](json& j) { j["num_hash_layers"] = -1; }, {"'num_hash_layers'"});
  E([](json& j) { j["qk_rope_head_dim"] = 256; }, {"'qk_rope_head_dim' (256)", "head_dim (256)"});
  E([](json& j) { j["qk_rope_head_dim"] = 63; }, {"'qk_rope_head_dim' (63) must be even"});
  E([](json& j) { j["index_head_dim"] = 96; }, {"'index_head_dim' (96) must be a power of two"});
  E([](json& j) { j["index_head_dim"] = 32; }, {"'index_head_dim' (32) must be >= qk_rope_head_dim (64)"});
  E([](json& j) { j["num_experts_per_tok"] = 9; },
    {"'num_experts_per_tok' (9) must be <= n_routed_experts (8)"});
  E([](json& j) { j["num_hash_layers"] = 7; }, {"'num_hash_layers' (7) must be <= num_hidden_layers (6)"});
  E([](json& j) { j["compress_ratios"] = {0, 4, 3, 4, 128, 0}; }, {"'compress_ratios[2]' (3)"});
  E([](json& j) { j["compress_ratios"] = {0, 4, 1, 4, 128, 0}; }, {"'compress_ratios[2]' (1)"});
  E([](json& j) { j["compress_ratios"] = {0, 4, -4, 4, 128, 0}; }, {"'compress_ratios[2]' (-4)"});
  E([](json& j) { j["scoring_func"] = "softmax"; }, {"'scoring_func' ('softmax')", "only 'sqrtsoftplus'"});
  E([](json& j) { j["hc_eps"] = 0; }, {"'hc_eps' (0)"});
  E([](json& j) { j["rms_norm_eps"] = -1e-6; }, {"'rms_norm_eps'"});
  E([](json& j) { j["rope_scaling"]["type"] = "linear"; },
    {"'rope_scaling.type' ('linear')", "'yarn' or 'none'"});
  E([](json& j) { j["rope_scaling"]["factor"] = 0; }, {"'rope_scaling.factor'"});
  E([](json& j) { j["rope_theta"] = 0; }, {"'rope_theta'"});
  E([](json& j) { j["swiglu_limit"] = -1; }, {"'swiglu_limit'"});
}

TEST(ConfigValidate, OtherPowerOfTwoRatiosAreAccepted) {
  json j = json::parse(config_to_json(preset("tiny")));
  j["compress_ratios"] = {0, 4, 16, 4, 2, 0};
  EXPECT_EQ(config_from_json(j.dump(), "c").compress_ratios, (std::vector<int>{0, 4, 16, 4, 2, 0}));
}

TEST(ConfigValidate, DirectCallUsesOrigin) {
  ModelConfig c = preset("tiny");
  c.compress_ratios.pop_back();
  expect_config_error([&] { validate(c, "my origin"); }, {"my origin: ", "'compress_ratios'", "5 entries"});
}

// ---- shape math ---------------------------------------------------------------------------------

TEST(ParamCounts, TinyByHand) {
  ModelConfig c = preset("tiny");
  // Per layer: wq_a 128x256, q_norm 128, wq_b (6*256)x128, wkv 256x256, kv_norm 256,
  // wo_a (2*64)x(6*256/2), wo_b 256x(2*64), attn_sink 6, attn_norm 256.
  const int64_t attn_layer = 128 * 256 + 128 + 1536 * 128 + 256 * 256 + 256 + 128 * 768 + 256 * 128 + 6 + 256;
  EXPECT_EQ(attn_layer, 426630);
  EXPECT_EQ(component(c, "attention"), 6 * attn_layer);
  // C4 main compressor: ape 4x512, wkv/wgate 512x256, norm 256. C128: ape 128x256, wkv/wgate 256x256.
  const int64_t c4 = 4 * 512 + 2 * 512 * 256 + 256;
  const int64_t c128 = 128 * 256 + 2 * 256 * 256 + 256;
  EXPECT_EQ(component(c, "compressor"), 2 * c4 + 2 * c128);
  // Indexer (2 C4 layers): wq_b 384x128, weights_proj 3x256, compressor d=128: ape 4x256,
  // wkv/wgate 256x256, norm 128.
  const int64_t idx = 384 * 128 + 3 * 256 + 4 * 256 + 2 * 256 * 256 + 128;
  EXPECT_EQ(component(c, "indexer"), 2 * idx);
  // mHC: two sublayers of fn 24x1024, base 24, scale 3.
  EXPECT_EQ(component(c, "mhc"), 6 * 2 * (24 * 1024 + 24 + 3));
  // Router: gate.weight 8x256 on all layers, bias 8 on the 4 learned layers; tid2eid 512x2 on 2 hash layers.
  EXPECT_EQ(component(c, "moe.router"), 6 * 8 * 256 + 4 * 8);
  EXPECT_EQ(component(c, "moe.tid2eid"), 2 * 512 * 2);
  EXPECT_EQ(component(c, "moe.experts"), 6 * 8 * 3 * 128 * 256);
  EXPECT_EQ(component(c, "moe.shared"), 6 * 3 * 128 * 256);
  EXPECT_EQ(component(c, "ffn_norm"), 6 * 256);
  EXPECT_EQ(component(c, "embedding"), 512 * 256);
  EXPECT_EQ(component(c, "lm_head"), 512 * 256);
  EXPECT_EQ(component(c, "final_norm+hc_head"), 256 + 4 * 1024 + 4 + 1);
  int64_t sum = 0;
  for (const auto& p : param_counts(c)) sum += p.params;
  EXPECT_EQ(total_params(c), sum);
}

TEST(ParamCounts, FlashTotalNearPublicFigure) {
  const double total = double(total_params(preset("flash")));
  EXPECT_NEAR(total / 284e9, 1.0, 0.03) << "flash total " << total;
  // Spot check one §1.2 shape: wo_a [8192, 4096] and wo_b [4096, 8192] per layer.
  ModelConfig c = preset("flash");
  const int64_t per_layer =
      1024LL * 4096 + 1024 + 32768LL * 1024 + 512LL * 4096 + 512 + 8192LL * 4096 + 4096LL * 8192 + 64 + 4096;
  EXPECT_EQ(component(c, "attention"), 43 * per_layer);
}

TEST(ParamCounts, ProIsLargerThanFlash) {
  EXPECT_GT(total_params(preset("pro")), 3 * total_params(preset("flash")));
}

TEST(DecisionBytes, Tiny) {
  ModelConfig c = preset("tiny");
  DecisionBytes b = decision_bytes_per_token(c);
  EXPECT_EQ(b.indexer_raw, 2 * 8 * 4);
  EXPECT_EQ(b.routing_raw, 6 * 2 * 8);
  EXPECT_EQ(b.margins, (2 + 6) * 4);
  EXPECT_EQ(b.mhc, 6 * 2 * (4 + 4 + 16) * 4);
  EXPECT_EQ(b.total_raw(), b.indexer_raw + b.routing_raw + b.margins + b.mhc);
}

}  // namespace
}  // namespace dsv4
