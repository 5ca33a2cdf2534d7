// ModelConfig: config.json parsing and writing, validation, presets and shape math (MODEL.md §1).
#include "model/config.h"

#include <fmt/format.h>

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstring>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "kernels/compressor.h"
#include "model/error.h"

namespace dsv4 {

namespace {

using json = nlohmann::json;
using ojson = nlohmann::ordered_json;

// The JSON kind of a value as a message word ("integer" and "float" rather than nlohmann's "number").
const char* kind_of(const json& v) {
  switch (v.type()) {
    case json::value_t::null:
      return "null";
    case json::value_t::boolean:
      return "boolean";
    case json::value_t::number_integer:
    case json::value_t::number_unsigned:
      return "integer";
    case json::value_t::number_float:
      return "float";
    case json::value_t::string:
      return "string";
    case json::value_t::array:
      return "array";
    case json::value_t::object:
      return "object";
    default:
      return "binary";
  }
}

// Reads typed fields out of one JSON object. `prefix` qualifies nested field names in messages
// ("rope_scaling.").
class FieldReader {
 public:
  FieldReader(const json& obj, const std::string& origin, std::string prefix)
      : obj_(obj), origin_(origin), prefix_(std::move(prefix)) {}

  [[noreturn]] void fail(const std::string& field, const std::string& what) const {
    throw ConfigError(fmt::format("{}: field '{}{}' {}", origin_, prefix_, field, what));
  }

  // nullptr when absent; a JSON null counts as absent for optional fields only.
  const json* find(const std::string& field) const {
    auto it = obj_.find(field);
    return it == obj_.end() ? nullptr : &*it;
  }

  int64_t to_int64(const std::string& field, const json& v) const {
    if (v.is_number_unsigned()) {
      uint64_t u = v.get<uint64_t>();
      if (u > uint64_t(INT64_MAX)) fail(field, fmt::format("({}) is out of range", u));
      return int64_t(u);
    }
    if (v.is_number_integer()) return v.get<int64_t>();
    fail(field, fmt::format("must be an integer, found {}", kind_of(v)));
  }

  int to_int(const std::string& field, const json& v) const {
    int64_t x = to_int64(field, v);
    if (x < INT_MIN || x > INT_MAX) fail(field, fmt::format("({}) is out of range for a 32-bit integer", x));
    return int(x);
  }

  int req_int(const std::string& field) const {
    const json* v = find(field);
    if (!v) fail(field, "is missing");
    return to_int(field, *v);
  }

  void opt_int(const std::string& field, int& out) const {
    const json* v = find(field);
    if (v && !v->is_null()) out = to_int(field, *v);
  }

  void opt_int64(const std::string& field, int64_t& out) const {
    const json* v = find(field);
    if (v && !v->is_null()) out = to_int64(field, *v);
  }

  void opt_float(const std::string& field, float& out) const {
    const json* v = find(field);
    if (!v || v->is_null()) return;
    if (!v->is_number()) fail(field, fmt::format("must be a number, found {}", kind_of(*v)));
    double d = v->get<double>();
    float f = float(d);
    if (!std::isfinite(f)) fail(field, fmt::format("({}) is not a finite fp32 value", d));
    out = f;
  }

  void opt_bool(const std::string& field, bool& out) const {
    const json* v = find(field);
    if (!v || v->is_null()) return;
    if (!v->is_boolean()) fail(field, fmt::format("must be a boolean, found {}", kind_of(*v)));
    out = v->get<bool>();
  }

  void opt_string(const std::string& field, std::string& out) const {
    const json* v = find(field);
    if (!v || v->is_null()) return;
    if (!v->is_string()) fail(field, fmt::format("must be a string, found {}", kind_of(*v)));
    out = v->get<std::string>();
  }

 private:
  const json& obj_;
  const std::string& origin_;
  std::string prefix_;
};

// A float as the shortest decimal that reads back to the same fp32 value, stored as a double so the
// JSON text shows "1e-06" rather than the double expansion of the fp32 value.
double float_for_json(float f) {
  return std::stod(fmt::format("{}", f));
}

bool is_pow2(int64_t x) {
  return x > 0 && (x & (x - 1)) == 0;
}

std::string join(const std::vector<std::string>& v) {
  std::string s;
  for (size_t i = 0; i < v.size(); ++i) s += (i ? ", " : "") + v[i];
  return s;
}

}  // namespace

// ---- derived helpers ----------------------------------------------------------------------------

int ModelConfig::c4_ordinal(int layer) const {
  if (ratio(layer) != 4) return -1;
  int n = 0;
  for (int l = 0; l < layer; ++l) n += compress_ratios[l] == 4;
  return n;
}

int ModelConfig::indexer_width(int64_t T) const {
  return int(std::min<int64_t>(index_topk, compressor_groups(T, 4)));
}

int ModelConfig::num_c4_layers() const {
  int n = 0;
  for (int r : compress_ratios) n += r == 4;
  return n;
}

// ---- parsing ------------------------------------------------------------------------------------

ModelConfig config_from_json(const std::string& text, const std::string& origin) {
  json j;
  try {
    j = json::parse(text);
  } catch (const json::parse_error& e) {
    throw ConfigError(fmt::format("{}: not valid JSON (at byte {}): {}", origin, e.byte, e.what()));
  } catch (const json::exception& e) {  // a number that overflows, ...
    throw ConfigError(fmt::format("{}: not usable JSON: {}", origin, e.what()));
  }
  if (!j.is_object())
    throw ConfigError(
        fmt::format("{}: expected a JSON object at the top level, found {}", origin, kind_of(j)));

  FieldReader r(j, origin, "");
  ModelConfig c;
  c.vocab_size = r.req_int("vocab_size");
  c.hidden_size = r.req_int("hidden_size");
  c.num_hidden_layers = r.req_int("num_hidden_layers");
  c.num_attention_heads = r.req_int("num_attention_heads");
  c.head_dim = r.req_int("head_dim");
  c.qk_rope_head_dim = r.req_int("qk_rope_head_dim");
  c.q_lora_rank = r.req_int("q_lora_rank");
  c.o_groups = r.req_int("o_groups");
  c.o_lora_rank = r.req_int("o_lora_rank");
  c.sliding_window = r.req_int("sliding_window");
  c.index_n_heads = r.req_int("index_n_heads");
  c.index_head_dim = r.req_int("index_head_dim");
  c.index_topk = r.req_int("index_topk");
  c.n_routed_experts = r.req_int("n_routed_experts");
  c.num_experts_per_tok = r.req_int("num_experts_per_tok");
  c.moe_intermediate_size = r.req_int("moe_intermediate_size");
  c.num_hash_layers = r.req_int("num_hash_layers");
  r.opt_int("n_shared_experts", c.n_shared_experts);
  r.opt_int64("max_position_embeddings", c.max_position_embeddings);
  r.opt_int("eos_token_id", c.eos_token_id);

  // compress_ratios: one entry per layer, optionally followed by the MTP block's entry (dropped).
  const json* cr = r.find("compress_ratios");
  if (!cr) r.fail("compress_ratios", "is missing");
  if (!cr->is_array()) r.fail("compress_ratios", fmt::format("must be an array, found {}", kind_of(*cr)));
  for (size_t i = 0; i < cr->size(); ++i)
    c.compress_ratios.push_back(r.to_int(fmt::format("compress_ratios[{}]", i), (*cr)[i]));
  // (A non-positive num_hidden_layers is left for validate() to report under its own name.)
  if (c.num_hidden_layers >= 1) {
    const size_t L = size_t(c.num_hidden_layers);
    if (c.compress_ratios.size() == L + 1) {
      c.compress_ratios.pop_back();
    } else if (c.compress_ratios.size() != L) {
      r.fail(
          "compress_ratios",
          fmt::format("has {} entries, expected num_hidden_layers ({}) or one more (the MTP block's entry)",
                      c.compress_ratios.size(), c.num_hidden_layers));
    }
  }

  r.opt_float("compress_rope_theta", c.compress_rope_theta);
  r.opt_float("rope_theta", c.rope_theta);

  // rope_scaling: absent or null means no scaling; HF spells the kind "type" or "rope_type".
  const json* rs = r.find("rope_scaling");
  if (!rs || rs->is_null()) {
    c.rope_scaling.type = "none";
  } else {
    if (!rs->is_object())
      r.fail("rope_scaling", fmt::format("must be an object or null, found {}", kind_of(*rs)));
    FieldReader s(*rs, origin, "rope_scaling.");
    std::string type, rope_type;
    s.opt_string("type", type);
    s.opt_string("rope_type", rope_type);
    if (!type.empty() && !rope_type.empty() && type != rope_type)
      s.fail("type", fmt::format("('{}') disagrees with rope_scaling.rope_type ('{}')", type, rope_type));
    if (type.empty()) type = rope_type;
    if (type.empty()) s.fail("type", "is missing (neither 'type' nor 'rope_type' is given)");
    c.rope_scaling.type = type;
    s.opt_float("factor", c.rope_scaling.factor);
    s.opt_int64("original_max_position_embeddings", c.rope_scaling.original_max_position_embeddings);
    s.opt_float("beta_fast", c.rope_scaling.beta_fast);
    s.opt_float("beta_slow", c.rope_scaling.beta_slow);
  }

  r.opt_string("scoring_func", c.scoring_func);
  r.opt_bool("norm_topk_prob", c.norm_topk_prob);
  r.opt_float("routed_scaling_factor", c.routed_scaling_factor);
  r.opt_float("swiglu_limit", c.swiglu_limit);
  r.opt_int("hc_mult", c.hc_mult);
  r.opt_int("hc_sinkhorn_iters", c.hc_sinkhorn_iters);
  r.opt_float("hc_eps", c.hc_eps);
  r.opt_float("rms_norm_eps", c.rms_norm_eps);

  validate(c, origin);
  return c;
}

ModelConfig config_from_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw ConfigError(fmt::format("{}: cannot open: {}", path, std::strerror(errno)));
  std::ostringstream ss;
  ss << in.rdbuf();
  if (in.bad()) throw ConfigError(fmt::format("{}: read error", path));
  return config_from_json(ss.str(), path);
}

// ---- writing ------------------------------------------------------------------------------------

std::string config_to_json(const ModelConfig& c) {
  ojson j;
  j["architectures"] = {"DeepseekV4ForCausalLM"};
  j["model_type"] = "deepseek_v4";
  j["vocab_size"] = c.vocab_size;
  j["hidden_size"] = c.hidden_size;
  j["num_hidden_layers"] = c.num_hidden_layers;
  j["num_attention_heads"] = c.num_attention_heads;
  j["head_dim"] = c.head_dim;
  j["qk_rope_head_dim"] = c.qk_rope_head_dim;
  j["q_lora_rank"] = c.q_lora_rank;
  j["o_groups"] = c.o_groups;
  j["o_lora_rank"] = c.o_lora_rank;
  j["sliding_window"] = c.sliding_window;
  j["max_position_embeddings"] = c.max_position_embeddings;
  if (c.eos_token_id >= 0) j["eos_token_id"] = c.eos_token_id;
  j["compress_ratios"] = c.compress_ratios;
  j["compress_rope_theta"] = float_for_json(c.compress_rope_theta);
  j["rope_theta"] = float_for_json(c.rope_theta);
  ojson rs;
  rs["type"] = c.rope_scaling.type;
  rs["factor"] = float_for_json(c.rope_scaling.factor);
  rs["original_max_position_embeddings"] = c.rope_scaling.original_max_position_embeddings;
  rs["beta_fast"] = float_for_json(c.rope_scaling.beta_fast);
  rs["beta_slow"] = float_for_json(c.rope_scaling.beta_slow);
  j["rope_scaling"] = rs;
  j["index_n_heads"] = c.index_n_heads;
  j["index_head_dim"] = c.index_head_dim;
  j["index_topk"] = c.index_topk;
  j["n_routed_experts"] = c.n_routed_experts;
  j["num_experts_per_tok"] = c.num_experts_per_tok;
  j["n_shared_experts"] = c.n_shared_experts;
  j["moe_intermediate_size"] = c.moe_intermediate_size;
  j["num_hash_layers"] = c.num_hash_layers;
  j["scoring_func"] = c.scoring_func;
  j["norm_topk_prob"] = c.norm_topk_prob;
  j["routed_scaling_factor"] = float_for_json(c.routed_scaling_factor);
  j["swiglu_limit"] = float_for_json(c.swiglu_limit);
  j["hc_mult"] = c.hc_mult;
  j["hc_sinkhorn_iters"] = c.hc_sinkhorn_iters;
  j["hc_eps"] = float_for_json(c.hc_eps);
  j["rms_norm_eps"] = float_for_json(c.rms_norm_eps);
  return j.dump(2) + "\n";
}

// ---- validation ---------------------------------------------------------------------------------

void validate(const ModelConfig& c, const std::string& origin) {
  auto fail = [&](const std::string& field, const std::string& what) {
    throw ConfigError(fmt::format("{}: field '{}' {}", origin, field, what));
  };
  auto positive = [&](const char* field, int64_t v) {
    if (v < 1) fail(field, fmt::format("({}) must be >= 1", v));
  };
  auto nonneg = [&](const char* field, int64_t v) {
    if (v < 0) fail(field, fmt::format("({}) must be >= 0", v));
  };
  auto positive_f = [&](const char* field, float v) {
    if (!(v > 0.0f) || !std::isfinite(v)) fail(field, fmt::format("({}) must be a finite value > 0", v));
  };

  positive("vocab_size", c.vocab_size);
  positive("hidden_size", c.hidden_size);
  positive("num_hidden_layers", c.num_hidden_layers);
  positive("num_attention_heads", c.num_attention_heads);
  positive("head_dim", c.head_dim);
  positive("qk_rope_head_dim", c.qk_rope_head_dim);
  positive("q_lora_rank", c.q_lora_rank);
  positive("o_groups", c.o_groups);
  positive("o_lora_rank", c.o_lora_rank);
  positive("sliding_window", c.sliding_window);
  if (c.eos_token_id < -1 || c.eos_token_id >= c.vocab_size)
    throw ConfigError(fmt::format("{}: field 'eos_token_id' ({}) must be -1 (none) or a token id below vocab_size = {}",
                                  origin, c.eos_token_id, c.vocab_size));
  if (c.max_position_embeddings < 1)
    throw ConfigError(fmt::format("{}: field 'max_position_embeddings' must be positive, got {}", origin,
                                  c.max_position_embeddings));
  positive("index_n_heads", c.index_n_heads);
  positive("index_head_dim", c.index_head_dim);
  positive("index_topk", c.index_topk);
  positive("n_routed_experts", c.n_routed_experts);
  positive("num_experts_per_tok", c.num_experts_per_tok);
  positive("moe_intermediate_size", c.moe_intermediate_size);
  nonneg("n_shared_experts", c.n_shared_experts);
  nonneg("num_hash_layers", c.num_hash_layers);
  positive("hc_mult", c.hc_mult);
  positive("hc_sinkhorn_iters", c.hc_sinkhorn_iters);

  // RoPE acts on the last qk_rope_head_dim dims and rotates pairs; at least one nope dim remains.
  if (c.qk_rope_head_dim >= c.head_dim)
    fail("qk_rope_head_dim",
         fmt::format("({}) must be smaller than head_dim ({})", c.qk_rope_head_dim, c.head_dim));
  if (c.qk_rope_head_dim % 2 != 0)
    fail("qk_rope_head_dim", fmt::format("({}) must be even (RoPE rotates pairs)", c.qk_rope_head_dim));
  if (c.num_attention_heads % c.o_groups != 0)
    fail("o_groups",
         fmt::format("({}) must divide num_attention_heads ({})", c.o_groups, c.num_attention_heads));
  // The indexer applies a Hadamard transform over index_head_dim and RoPE on its last rope dims.
  if (!is_pow2(c.index_head_dim))
    fail("index_head_dim",
         fmt::format("({}) must be a power of two (the indexer's Hadamard transform)", c.index_head_dim));
  if (c.index_head_dim < c.qk_rope_head_dim)
    fail("index_head_dim",
         fmt::format("({}) must be >= qk_rope_head_dim ({})", c.index_head_dim, c.qk_rope_head_dim));
  if (c.num_experts_per_tok > c.n_routed_experts)
    fail("num_experts_per_tok",
         fmt::format("({}) must be <= n_routed_experts ({})", c.num_experts_per_tok, c.n_routed_experts));
  if (c.num_hash_layers > c.num_hidden_layers)
    fail("num_hash_layers",
         fmt::format("({}) must be <= num_hidden_layers ({})", c.num_hash_layers, c.num_hidden_layers));

  if (c.compress_ratios.size() != size_t(c.num_hidden_layers))
    fail("compress_ratios", fmt::format("has {} entries, expected num_hidden_layers ({})",
                                        c.compress_ratios.size(), c.num_hidden_layers));
  // 0 = no compression (C1); 4 = overlapping C4 with the lightning indexer; any other power of two
  // (128 in the released models) = non-overlapping compression attended in full.
  for (size_t i = 0; i < c.compress_ratios.size(); ++i) {
    int r = c.compress_ratios[i];
    if (r != 0 && !(r >= 2 && is_pow2(r)))
      fail(fmt::format("compress_ratios[{}]", i),
           fmt::format("({}) must be 0 (no compression) or a power of two >= 2 (4 = C4, 128 = C128)", r));
  }

  if (c.scoring_func != "sqrtsoftplus")
    fail("scoring_func",
         fmt::format("('{}') is not supported: only 'sqrtsoftplus' is implemented", c.scoring_func));

  positive_f("rope_theta", c.rope_theta);
  positive_f("compress_rope_theta", c.compress_rope_theta);
  const auto& rs = c.rope_scaling;
  if (rs.type != "yarn" && rs.type != "none")
    fail("rope_scaling.type", fmt::format("('{}') must be 'yarn' or 'none'", rs.type));
  if (rs.type == "yarn") {
    positive_f("rope_scaling.factor", rs.factor);
    positive("rope_scaling.original_max_position_embeddings", rs.original_max_position_embeddings);
    if (!std::isfinite(rs.beta_fast)) fail("rope_scaling.beta_fast", "must be finite");
    if (!std::isfinite(rs.beta_slow)) fail("rope_scaling.beta_slow", "must be finite");
  }
  positive_f("routed_scaling_factor", c.routed_scaling_factor);
  // 0 disables the SwiGLU clamp (as in the reference code).
  if (!(c.swiglu_limit >= 0.0f) || !std::isfinite(c.swiglu_limit))
    fail("swiglu_limit", fmt::format("({}) must be a finite value >= 0", c.swiglu_limit));
  positive_f("hc_eps", c.hc_eps);
  positive_f("rms_norm_eps", c.rms_norm_eps);
  check_limits(c, origin);
}

// Hard upper bounds: a config.json is input, and a value past these would make a command run for hours
// or exhaust memory (a Sinkhorn loop of 2^31 iterations, 70,000 experts per layer, sizes whose product
// overflows). Each is far above every released DSV4 model (ModelConfig presets flash and pro).
void check_limits(const ModelConfig& c, const std::string& origin) {
  auto limit = [&](const char* field, int64_t v, int64_t max) {
    if (v > max)
      throw ConfigError(fmt::format("{}: field '{}' ({}) exceeds the limit of {}", origin, field, v, max));
  };
  limit("vocab_size", c.vocab_size, int64_t(1) << 22);
  limit("hidden_size", c.hidden_size, 65536);
  limit("num_hidden_layers", c.num_hidden_layers, 1000);  // layer_LLL names
  limit("num_attention_heads", c.num_attention_heads, 1024);
  limit("head_dim", c.head_dim, 4096);
  limit("q_lora_rank", c.q_lora_rank, 65536);
  limit("o_groups", c.o_groups, 1024);
  limit("o_lora_rank", c.o_lora_rank, 65536);
  limit("sliding_window", c.sliding_window, int64_t(1) << 24);
  limit("max_position_embeddings", c.max_position_embeddings, int64_t(1) << 32);
  limit("index_n_heads", c.index_n_heads, 1024);
  limit("index_head_dim", c.index_head_dim, 4096);
  limit("index_topk", c.index_topk, int64_t(1) << 20);
  limit("n_routed_experts", c.n_routed_experts, 4096);
  limit("num_experts_per_tok", c.num_experts_per_tok, 4096);
  limit("moe_intermediate_size", c.moe_intermediate_size, 65536);
  limit("n_shared_experts", c.n_shared_experts, 64);
  limit("hc_mult", c.hc_mult, 64);
  limit("hc_sinkhorn_iters", c.hc_sinkhorn_iters, 1000);
  for (size_t i = 0; i < c.compress_ratios.size(); ++i)
    limit(fmt::format("compress_ratios[{}]", i).c_str(), c.compress_ratios[i], 1 << 16);
  // Products, in double (each factor is bounded above, the product may not fit in 64 bits): the
  // largest weight groups must stay addressable and far below any machine's memory (2^44 elements).
  const double kMaxElements = double(int64_t(1) << 44);
  const double experts = double(c.n_routed_experts + c.n_shared_experts) * 3.0 * c.hidden_size *
                         c.moe_intermediate_size * c.num_hidden_layers;
  if (experts > kMaxElements)
    throw ConfigError(fmt::format(
        "{}: field 'n_routed_experts' ({}): the expert weights ((n_routed_experts + n_shared_experts) x 3 x "
        "hidden_size x moe_intermediate_size x num_hidden_layers = {:.3g} elements) exceed the limit of 2^44",
        origin, c.n_routed_experts, experts));
  const double embed = 2.0 * c.vocab_size * c.hidden_size;
  if (embed > kMaxElements)
    throw ConfigError(fmt::format("{}: field 'vocab_size' ({}): the embedding and head ({:.3g} elements) exceed "
                                  "the limit of 2^44",
                                  origin, c.vocab_size, embed));
}

// ---- presets ------------------------------------------------------------------------------------

namespace {

// MODEL.md §9.1 TINY-DSV4.
ModelConfig tiny() {
  ModelConfig c;
  c.vocab_size = 512;
  c.hidden_size = 256;
  c.num_hidden_layers = 6;
  c.compress_ratios = {0, 4, 128, 4, 128, 0};
  c.num_hash_layers = 2;
  c.num_attention_heads = 6;
  c.head_dim = 256;
  c.qk_rope_head_dim = 64;
  c.q_lora_rank = 128;
  c.o_groups = 2;
  c.o_lora_rank = 64;
  c.sliding_window = 16;
  c.index_n_heads = 3;
  c.index_head_dim = 128;
  c.index_topk = 8;
  c.n_routed_experts = 8;
  c.num_experts_per_tok = 2;
  c.n_shared_experts = 1;
  c.moe_intermediate_size = 128;
  c.scoring_func = "sqrtsoftplus";
  c.norm_topk_prob = true;
  c.routed_scaling_factor = 1.5f;
  c.swiglu_limit = 10.0f;
  c.hc_mult = 4;
  c.hc_sinkhorn_iters = 20;
  c.hc_eps = 1e-6f;
  c.rms_norm_eps = 1e-6f;
  c.rope_theta = 10000.0f;
  c.compress_rope_theta = 160000.0f;
  c.rope_scaling = RopeScalingConfig{"yarn", 16.0f, 65536, 32.0f, 1.0f};
  return c;
}

// MODEL.md §9.1 TINY-B: non-power-of-two heads, one head per group, Dh 192.
ModelConfig tiny_b() {
  ModelConfig c = tiny();
  c.num_attention_heads = 5;
  c.o_groups = 5;
  c.index_n_heads = 5;
  c.index_head_dim = 128;
  c.head_dim = 192;
  c.qk_rope_head_dim = 64;
  c.sliding_window = 8;
  c.index_topk = 4;
  c.num_experts_per_tok = 3;
  c.n_routed_experts = 6;
  return c;
}

// A benchmark size between tiny and the released models.
ModelConfig mid() {
  ModelConfig c = tiny();
  c.vocab_size = 4096;
  c.hidden_size = 1024;
  c.num_hidden_layers = 8;
  c.compress_ratios = {0, 4, 128, 4, 128, 4, 128, 0};
  c.num_hash_layers = 2;
  c.num_attention_heads = 8;
  c.head_dim = 256;
  c.qk_rope_head_dim = 64;
  c.q_lora_rank = 256;
  c.o_groups = 2;
  c.o_lora_rank = 128;
  c.sliding_window = 128;
  c.index_n_heads = 4;
  c.index_head_dim = 128;
  c.index_topk = 64;
  c.n_routed_experts = 16;
  c.num_experts_per_tok = 2;
  c.n_shared_experts = 1;
  c.moe_intermediate_size = 512;
  return c;
}

// Fields shared by the released models (MODEL.md §1.1).
ModelConfig released_common() {
  ModelConfig c = tiny();
  c.vocab_size = 129280;
  c.head_dim = 512;
  c.qk_rope_head_dim = 64;
  c.o_lora_rank = 1024;
  c.sliding_window = 128;
  c.index_n_heads = 64;
  c.index_head_dim = 128;
  c.num_experts_per_tok = 6;
  c.n_shared_experts = 1;
  c.num_hash_layers = 3;
  return c;
}

// Layers 0 and 1 get `first_two`; then 4 on even and 128 on odd layers (the MTP entry is not kept).
std::vector<int> released_ratios(int layers, int first_two) {
  std::vector<int> r(static_cast<size_t>(layers));
  for (int l = 0; l < layers; ++l) r[size_t(l)] = l < 2 ? first_two : (l % 2 == 0 ? 4 : 128);
  return r;
}

ModelConfig flash() {
  ModelConfig c = released_common();
  c.num_hidden_layers = 43;
  c.compress_ratios = released_ratios(43, 0);
  c.hidden_size = 4096;
  c.num_attention_heads = 64;
  c.q_lora_rank = 1024;
  c.o_groups = 8;
  c.index_topk = 512;
  c.n_routed_experts = 256;
  c.moe_intermediate_size = 2048;
  c.routed_scaling_factor = 1.5f;
  return c;
}

ModelConfig pro() {
  ModelConfig c = released_common();
  c.num_hidden_layers = 61;
  c.compress_ratios = released_ratios(61, 128);
  c.hidden_size = 7168;
  c.num_attention_heads = 128;
  c.q_lora_rank = 1536;
  c.o_groups = 16;
  c.index_topk = 1024;
  c.n_routed_experts = 384;
  c.moe_intermediate_size = 3072;
  c.routed_scaling_factor = 2.5f;
  return c;
}

}  // namespace

std::vector<std::string> preset_names() {
  return {"tiny", "tiny-b", "mid", "flash", "pro"};
}

ModelConfig preset(const std::string& name) {
  ModelConfig c;
  if (name == "tiny")
    c = tiny();
  else if (name == "tiny-b")
    c = tiny_b();
  else if (name == "mid")
    c = mid();
  else if (name == "flash")
    c = flash();
  else if (name == "pro")
    c = pro();
  else
    throw ConfigError(fmt::format("unknown preset '{}' (known presets: {})", name, join(preset_names())));
  validate(c, "preset " + name);
  return c;
}

// ---- shape math ---------------------------------------------------------------------------------

std::vector<ParamCount> param_counts(const ModelConfig& c) {
  const int64_t V = c.vocab_size, D = c.hidden_size, H = c.num_attention_heads, Dh = c.head_dim;
  const int64_t Q = c.q_lora_rank, G = c.o_groups, R = c.o_lora_rank, hc = c.hc_mult;
  const int64_t Hi = c.index_n_heads, Di = c.index_head_dim, E = c.n_routed_experts;
  const int64_t ke = c.num_experts_per_tok, I = c.moe_intermediate_size;

  // A compressor of head dim d and ratio r (MODEL.md §3.5): ape [r, coff*d], wkv and wgate
  // [coff*d, D], norm [d]; coff = 2 for the overlapping ratio 4.
  auto compressor = [&](int64_t d, int64_t r) {
    const int64_t coff = r == 4 ? 2 : 1;
    return r * coff * d + 2 * coff * d * D + d;
  };

  int64_t attention = 0, comp = 0, indexer = 0, mhc = 0, router = 0, tid2eid = 0, experts = 0, shared = 0,
          ffn_norm = 0;
  for (int l = 0; l < c.num_hidden_layers; ++l) {
    const int64_t r = c.ratio(l);
    attention += Q * D + Q               // wq_a, q_norm
                 + H * Dh * Q            // wq_b
                 + Dh * D + Dh           // wkv, kv_norm
                 + G * R * (H * Dh / G)  // wo_a
                 + D * G * R             // wo_b
                 + H                     // attn_sink
                 + D;                    // attn_norm
    if (r != 0) comp += compressor(Dh, r);
    if (r == 4) indexer += Hi * Di * Q + Hi * D + compressor(Di, 4);
    // hc_{attn,ffn}_fn [(2+hc)*hc, hc*D], _base [(2+hc)*hc], _scale [3].
    mhc += 2 * ((2 + hc) * hc * hc * D + (2 + hc) * hc + 3);
    router += E * D;  // gate.weight (hash layers use it for the weights of the table's experts)
    if (c.is_hash_layer(l))
      tid2eid += V * ke;
    else
      router += E;  // gate.bias (e_score_correction_bias), selection only
    experts += E * 3 * I * D;
    shared += int64_t(c.n_shared_experts) * 3 * I * D;
    ffn_norm += D;
  }
  return {
      {"embedding", V * D},
      {"lm_head", V * D},
      {"final_norm+hc_head", D + hc * hc * D + hc + 1},
      {"attention", attention},
      {"compressor", comp},
      {"indexer", indexer},
      {"mhc", mhc},
      {"moe.router", router},
      {"moe.tid2eid", tid2eid},
      {"moe.experts", experts},
      {"moe.shared", shared},
      {"ffn_norm", ffn_norm},
  };
}

int64_t total_params(const ModelConfig& c) {
  int64_t t = 0;
  for (const auto& p : param_counts(c)) t += p.params;
  return t;
}

DecisionBytes decision_bytes_per_token(const ModelConfig& c) {
  const int64_t L = c.num_hidden_layers, c4 = c.num_c4_layers(), hc = c.hc_mult;
  DecisionBytes b;
  b.indexer_raw = c4 * c.index_topk * 4;
  b.routing_raw = L * c.num_experts_per_tok * (4 + 4);
  b.margins = (c4 + L) * 4;
  b.mhc = L * 2 * (hc + hc + hc * hc) * 4;
  return b;
}

}  // namespace dsv4
