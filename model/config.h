// DSV4 model configuration: the HF config.json fields of MODEL.md §1.1, validation, presets and
// shape math (parameter counts, trace bytes per token).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace dsv4 {

struct RopeScalingConfig {
  std::string type = "yarn";  // "yarn" or "none" (HF: rope_scaling.type or rope_scaling.rope_type)
  float factor = 16.0f;
  int64_t original_max_position_embeddings = 65536;
  float beta_fast = 32.0f;
  float beta_slow = 1.0f;
};

struct ModelConfig {
  int vocab_size = 0;
  int hidden_size = 0;
  int num_hidden_layers = 0;
  int num_attention_heads = 0;
  int head_dim = 0;
  int qk_rope_head_dim = 0;
  int q_lora_rank = 0;
  int o_groups = 0;
  int o_lora_rank = 0;
  int sliding_window = 0;
  int64_t max_position_embeddings = 1048576;  // positions a sequence may reach (prompt + generated)
  int eos_token_id = -1;                      // generation stops after it (-1: none)
  std::vector<int> compress_ratios;  // exactly num_hidden_layers entries after parsing (MTP entry dropped)
  float compress_rope_theta = 160000.0f;
  float rope_theta = 10000.0f;
  RopeScalingConfig rope_scaling;
  int index_n_heads = 0;
  int index_head_dim = 0;
  int index_topk = 0;
  int n_routed_experts = 0;
  int num_experts_per_tok = 0;
  int n_shared_experts = 1;
  int moe_intermediate_size = 0;
  int num_hash_layers = 0;
  std::string scoring_func = "sqrtsoftplus";
  bool norm_topk_prob = true;
  float routed_scaling_factor = 1.0f;
  float swiglu_limit = 10.0f;
  int hc_mult = 4;
  int hc_sinkhorn_iters = 20;
  float hc_eps = 1e-6f;
  float rms_norm_eps = 1e-6f;

  // derived helpers
  int nope_dim() const { return head_dim - qk_rope_head_dim; }
  int heads_per_group() const { return num_attention_heads / o_groups; }
  bool is_hash_layer(int layer) const { return layer < num_hash_layers; }
  int ratio(int layer) const { return compress_ratios.at(layer); }
  // Ordinal of `layer` among the C4 layers (the indexer's stream index), -1 if not a C4 layer.
  int c4_ordinal(int layer) const;
  int num_c4_layers() const;
  // Width of the indexer's selection for a sequence of T tokens: min(index_topk, floor(T/4)), the
  // number of compressed C4 groups bounding it (MODEL.md §3.6). The forward pass, the tensor manifest,
  // the trace writer and the validator all size the selection with this one rule.
  int indexer_width(int64_t T) const;
};

// Parse config.json text. `origin` (usually the path) prefixes every error message.
// Throws ConfigError naming the field for missing/ill-typed fields and invalid values.
ModelConfig config_from_json(const std::string& text, const std::string& origin);
ModelConfig config_from_file(const std::string& path);
// The config as HF-style config.json text (round-trips through config_from_json).
std::string config_to_json(const ModelConfig& c);
// Throws ConfigError naming the field: o_groups must divide num_attention_heads, index_head_dim a
// power of two, num_experts_per_tok <= n_routed_experts, compress ratios 0 or a power of two >= 2 (4 is
// the overlapping, indexed ratio), ...
void validate(const ModelConfig& c, const std::string& origin);
// The hard upper bounds validate() applies (hc_sinkhorn_iters <= 1000, n_routed_experts <= 4096, the
// expert weights and the embedding <= 2^44 elements, ...): ConfigError naming the field, the value and
// the limit.
void check_limits(const ModelConfig& c, const std::string& origin);

// Built-in presets: "tiny", "tiny-b", "mid" (hidden 1024, 8 layers, for benchmarks), "flash", "pro".
std::vector<std::string> preset_names();
ModelConfig preset(const std::string& name);  // throws ConfigError listing the known names

// Shape math.
struct ParamCount {
  std::string component;  // "embedding", "attention", "compressor", "indexer", "mhc", "moe.router", ...
  int64_t params = 0;
};
std::vector<ParamCount> param_counts(const ModelConfig& c);
int64_t total_params(const ModelConfig& c);
struct DecisionBytes {
  int64_t indexer_raw = 0;  // per token: C4 layers x index_topk x 4 bytes (int32)
  int64_t routing_raw = 0;  // per token: layers x k_e x 4 bytes (ids) + weights
  int64_t margins = 0;      // per token: fp32 margins (indexer per C4 layer + router per layer)
  int64_t mhc = 0;          // per token: fp32 pre/post/comb for both sublayers of every layer
  int64_t total_raw() const { return indexer_raw + routing_raw + margins + mhc; }
};
DecisionBytes decision_bytes_per_token(const ModelConfig& c);

}  // namespace dsv4
