// Which weights a training step trains (docs/TRAINING.md "What is trained"): every tensor belongs to
// one parameter group; the default trained set follows the miles RL recipe of MODEL.md §5.4.
#pragma once

#include <set>
#include <string>
#include <vector>

#include "model/config.h"

namespace dsv4::train {

enum class ParamGroup {
  embed,           // model.embed_tokens.weight
  attention,       // wq_a, q_norm, wq_b, wkv, kv_norm, wo_a, wo_b, attn_sink
  compressor,      // the main KV compressor: wkv, wgate, ape, norm
  indexer,         // the lightning indexer: wq_b, weights_proj, its compressor (only by its KL objective)
  norms,           // input_layernorm, post_attention_layernorm, model.norm
  mixer,           // mHC: hc_attn_*, hc_ffn_*, model.hc_head_*
  router,          // mlp.gate.weight (frozen by default: --moe-router-freeze-gate)
  expert_bias,     // mlp.gate.e_score_correction_bias (never trained)
  experts,         // routed experts
  shared_experts,  // shared experts
  head,            // lm_head.weight
  hash_table,      // mlp.topk.tid2eid (integer; never trained)
};

const char* to_string(ParamGroup g);
std::vector<ParamGroup> all_groups();
// The group of a weight name; throws InputError for a name no group knows.
ParamGroup param_group(const std::string& name);
// Groups that can never be trained (expert_bias, hash_table), with the reason. The indexer receives
// gradient only from its KL objective (train/step.h TrainStepOptions::indexer_kl_coeff).
const char* untrainable_reason(ParamGroup g);  // nullptr when trainable

struct TrainGroups {
  std::set<ParamGroup> trained;
  // MODEL.md §5.4: everything but the router gate, the expert bias, the indexer and the hash table.
  static TrainGroups miles_default();
  bool trains(const std::string& weight_name) const { return trained.count(param_group(weight_name)) != 0; }
  // Applies a comma-separated list of group names to train ("+") or freeze; unknown names and
  // untrainable groups throw InputError listing the accepted names.
  void train(const std::string& list);
  void freeze(const std::string& list);
  std::string describe() const;  // "attention,compressor,..." in enum order
};

}  // namespace dsv4::train
