#include "train/params.h"

#include <fmt/format.h>

#include "model/error.h"

namespace dsv4::train {

namespace {

bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}
bool contains(const std::string& s, const std::string& part) {
  return s.find(part) != std::string::npos;
}

std::vector<std::string> split_list(const std::string& list) {
  std::vector<std::string> out;
  size_t i = 0;
  while (i <= list.size()) {
    size_t j = list.find(',', i);
    if (j == std::string::npos) j = list.size();
    if (j > i) out.push_back(list.substr(i, j - i));
    i = j + 1;
  }
  return out;
}

ParamGroup group_by_name(const std::string& n) {
  for (ParamGroup g : all_groups())
    if (n == to_string(g)) return g;
  std::string names;
  for (ParamGroup g : all_groups()) names += (names.empty() ? "" : ", ") + std::string(to_string(g));
  throw InputError(fmt::format("unknown parameter group '{}' (groups: {})", n, names));
}

}  // namespace

const char* to_string(ParamGroup g) {
  switch (g) {
    case ParamGroup::embed: return "embed";
    case ParamGroup::attention: return "attention";
    case ParamGroup::compressor: return "compressor";
    case ParamGroup::indexer: return "indexer";
    case ParamGroup::norms: return "norms";
    case ParamGroup::mixer: return "mixer";
    case ParamGroup::router: return "router";
    case ParamGroup::expert_bias: return "expert_bias";
    case ParamGroup::experts: return "experts";
    case ParamGroup::shared_experts: return "shared_experts";
    case ParamGroup::head: return "head";
    case ParamGroup::hash_table: return "hash_table";
  }
  return "?";
}

std::vector<ParamGroup> all_groups() {
  return {ParamGroup::embed,  ParamGroup::attention,   ParamGroup::compressor, ParamGroup::indexer,
          ParamGroup::norms,  ParamGroup::mixer,       ParamGroup::router,     ParamGroup::expert_bias,
          ParamGroup::experts, ParamGroup::shared_experts, ParamGroup::head,   ParamGroup::hash_table};
}

ParamGroup param_group(const std::string& n) {
  if (n == "model.embed_tokens.weight") return ParamGroup::embed;
  if (n == "lm_head.weight") return ParamGroup::head;
  if (n == "model.norm.weight") return ParamGroup::norms;
  if (n.rfind("model.hc_head_", 0) == 0) return ParamGroup::mixer;
  if (n.rfind("model.layers.", 0) == 0) {
    if (contains(n, ".self_attn.indexer.")) return ParamGroup::indexer;
    if (contains(n, ".self_attn.compressor.")) return ParamGroup::compressor;
    if (contains(n, ".self_attn.")) return ParamGroup::attention;
    if (contains(n, ".hc_attn_") || contains(n, ".hc_ffn_")) return ParamGroup::mixer;
    if (ends_with(n, ".input_layernorm.weight") || ends_with(n, ".post_attention_layernorm.weight"))
      return ParamGroup::norms;
    if (ends_with(n, ".mlp.gate.weight")) return ParamGroup::router;
    if (ends_with(n, ".mlp.gate.e_score_correction_bias")) return ParamGroup::expert_bias;
    if (ends_with(n, ".mlp.topk.tid2eid")) return ParamGroup::hash_table;
    if (contains(n, ".mlp.shared_experts.")) return ParamGroup::shared_experts;
    if (contains(n, ".mlp.experts.")) return ParamGroup::experts;
  }
  throw InputError(fmt::format("weight '{}' belongs to no parameter group", n));
}

const char* untrainable_reason(ParamGroup g) {
  switch (g) {
    case ParamGroup::expert_bias: return "the expert bias only selects experts and receives no gradient";
    case ParamGroup::hash_table: return "the hash routing table is an integer table";
    default: return nullptr;
  }
}

TrainGroups TrainGroups::miles_default() {
  TrainGroups t;
  for (ParamGroup g : all_groups())
    if (g != ParamGroup::router && g != ParamGroup::indexer && !untrainable_reason(g)) t.trained.insert(g);
  return t;
}

void TrainGroups::train(const std::string& list) {
  for (const std::string& n : split_list(list)) {
    const ParamGroup g = group_by_name(n);
    if (const char* why = untrainable_reason(g))
      throw InputError(fmt::format("parameter group '{}' cannot be trained: {}", n, why));
    trained.insert(g);
  }
}

void TrainGroups::freeze(const std::string& list) {
  for (const std::string& n : split_list(list)) trained.erase(group_by_name(n));
}

std::string TrainGroups::describe() const {
  std::string s;
  for (ParamGroup g : all_groups()) {
    if (!trained.count(g)) continue;
    if (!s.empty()) s += ',';
    s += to_string(g);
  }
  return s.empty() ? "(none)" : s;
}

}  // namespace dsv4::train
