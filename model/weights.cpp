#include "model/weights.h"

#include <xxhash.h>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <set>

#include "kernels/numerics/numerics.h"
#include "kernels/numerics/rng.h"
#include "model/communicator.h"
#include "model/error.h"

namespace dsv4 {

int64_t WeightSpec::numel() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

std::string layer_prefix(int layer) {
  return fmt::format("model.layers.{}.", layer);
}

std::string mhc_prefix(int layer, Sublayer sub) {
  return layer_prefix(layer) + (sub == Sublayer::attn ? "hc_attn_" : "hc_ffn_");
}

namespace {

void add(std::vector<WeightSpec>& out, std::string name, std::vector<int64_t> shape, StDType dtype,
         InitKind init, float std = 0.02f) {
  out.push_back(WeightSpec{std::move(name), std::move(shape), dtype, init, std});
}

// A compressor of head dim d and ratio r (MODEL.md §3.5): coff = 2 for the overlapping ratio 4.
void add_compressor(std::vector<WeightSpec>& out, const std::string& prefix, int64_t D, int64_t d, int r) {
  const int64_t coff = r == 4 ? 2 : 1;
  add(out, prefix + "ape", {r, coff * d}, StDType::F32, InitKind::normal, 0.1f);
  add(out, prefix + "wkv.weight", {coff * d, D}, StDType::BF16, InitKind::normal);
  add(out, prefix + "wgate.weight", {coff * d, D}, StDType::BF16, InitKind::normal);
  add(out, prefix + "norm.weight", {d}, StDType::BF16, InitKind::ones_jitter);
}

void add_expert(std::vector<WeightSpec>& out, const std::string& prefix, int64_t D, int64_t I) {
  add(out, prefix + "gate_proj.weight", {I, D}, StDType::BF16, InitKind::normal);
  add(out, prefix + "up_proj.weight", {I, D}, StDType::BF16, InitKind::normal);
  add(out, prefix + "down_proj.weight", {D, I}, StDType::BF16, InitKind::normal);
}

bool is_float(StDType t) {
  return t == StDType::BF16 || t == StDType::F32 || t == StDType::F16;
}

}  // namespace

std::vector<WeightSpec> weight_specs(const ModelConfig& c) {
  std::vector<WeightSpec> s;
  const int64_t V = c.vocab_size, D = c.hidden_size, hc = c.hc_mult, H = c.num_attention_heads,
                Dh = c.head_dim, G = c.o_groups, R = c.o_lora_rank, ql = c.q_lora_rank,
                E = c.n_routed_experts, I = c.moe_intermediate_size, Hi = c.index_n_heads,
                Di = c.index_head_dim;
  const int64_t mix = (2 + hc) * hc;
  add(s, "model.embed_tokens.weight", {V, D}, StDType::BF16, InitKind::normal);
  add(s, "model.norm.weight", {D}, StDType::BF16, InitKind::ones_jitter);
  add(s, "lm_head.weight", {V, D}, StDType::BF16, InitKind::normal);
  const std::string head = kHeadMhcPrefix;
  add(s, head + "fn", {hc, hc * D}, StDType::F32, InitKind::normal, 0.01f);
  add(s, head + "base", {hc}, StDType::F32, InitKind::normal, 1.0f);
  add(s, head + "scale", {1}, StDType::F32, InitKind::ones);
  for (int L = 0; L < c.num_hidden_layers; ++L) {
    const std::string p = layer_prefix(L);
    add(s, p + "input_layernorm.weight", {D}, StDType::BF16, InitKind::ones_jitter);
    add(s, p + "post_attention_layernorm.weight", {D}, StDType::BF16, InitKind::ones_jitter);
    for (const Sublayer sub : {Sublayer::attn, Sublayer::ffn}) {
      const std::string m = mhc_prefix(L, sub);
      add(s, m + "fn", {mix, hc * D}, StDType::F32, InitKind::normal, 0.01f);
      add(s, m + "base", {mix}, StDType::F32, InitKind::normal, 1.0f);
      add(s, m + "scale", {3}, StDType::F32, InitKind::ones);
    }
    const std::string a = p + "self_attn.";
    add(s, a + "wq_a.weight", {ql, D}, StDType::BF16, InitKind::normal);
    add(s, a + "q_norm.weight", {ql}, StDType::BF16, InitKind::ones_jitter);
    add(s, a + "wq_b.weight", {H * Dh, ql}, StDType::BF16, InitKind::normal);
    add(s, a + "wkv.weight", {Dh, D}, StDType::BF16, InitKind::normal);
    add(s, a + "kv_norm.weight", {Dh}, StDType::BF16, InitKind::ones_jitter);
    add(s, a + "wo_a.weight", {G * R, H * Dh / G}, StDType::BF16, InitKind::normal);
    add(s, a + "wo_b.weight", {D, G * R}, StDType::BF16, InitKind::normal);
    add(s, a + "attn_sink", {H}, StDType::F32, InitKind::normal, 1.0f);
    const int r = c.ratio(L);
    if (r > 0) add_compressor(s, a + "compressor.", D, Dh, r);
    if (r == 4) {
      add(s, a + "indexer.wq_b.weight", {Hi * Di, ql}, StDType::BF16, InitKind::normal);
      add(s, a + "indexer.weights_proj.weight", {Hi, D}, StDType::BF16, InitKind::normal);
      add_compressor(s, a + "indexer.compressor.", D, Di, 4);
    }
    const std::string m = p + "mlp.";
    add(s, m + "gate.weight", {E, D}, StDType::BF16, InitKind::normal);
    if (c.is_hash_layer(L))
      add(s, m + "topk.tid2eid", {V, c.num_experts_per_tok}, StDType::I32, InitKind::tid2eid);
    else
      add(s, m + "gate.e_score_correction_bias", {E}, StDType::F32, InitKind::normal, 0.05f);
    for (int e = 0; e < E; ++e) add_expert(s, m + fmt::format("experts.{}.", e), D, I);
    if (c.n_shared_experts > 0) add_expert(s, m + "shared_experts.", D, I * c.n_shared_experts);
  }
  return s;
}

Weights Weights::init(const ModelConfig& c, uint64_t seed) {
  validate(c, "config");
  Weights w;
  w.cfg_ = c;
  w.source_ = fmt::format("init:seed={}", seed);
  const auto specs = weight_specs(c);
  for (size_t si = 0; si < specs.size(); ++si) {
    const WeightSpec& spec = specs[si];
    // One independent stream per tensor name position: adding a layer does not reshuffle the others.
    num::Rng rng(seed, si);
    WeightTensor t;
    t.shape = spec.shape;
    t.dtype = spec.dtype;
    const int64_t n = spec.numel();
    auto store = [&](float v) { return spec.dtype == StDType::BF16 ? num::bf16_round(v) : v; };
    switch (spec.init) {
      case InitKind::normal:
        t.f.resize(n);
        for (auto& v : t.f) v = store(spec.std * rng.normal());
        break;
      case InitKind::ones_jitter:  // 1 ± 0.1
        t.f.resize(n);
        for (auto& v : t.f) v = store(1.0f + 0.2f * (rng.uniform() - 0.5f));
        break;
      case InitKind::ones:
        t.f.assign(n, 1.0f);
        break;
      case InitKind::zeros:
        t.f.assign(n, 0.0f);
        break;
      case InitKind::tid2eid: {  // k distinct experts per row (partial Fisher-Yates)
        const int E = c.n_routed_experts, k = c.num_experts_per_tok;
        t.i.resize(n);
        std::vector<int32_t> perm(E);
        for (int64_t row = 0; row < spec.shape[0]; ++row) {
          for (int e = 0; e < E; ++e) perm[e] = e;
          for (int j = 0; j < k; ++j) std::swap(perm[j], perm[j + rng.below(uint32_t(E - j))]);
          std::copy(perm.begin(), perm.begin() + k, t.i.begin() + row * k);
        }
        break;
      }
    }
    w.tensors_.emplace(spec.name, std::move(t));
  }
  return w;
}

Weights Weights::load(const ModelConfig& c, const std::string& path, const WeightFilter& keep) {
  validate(c, path);
  SafetensorsReader reader = SafetensorsReader::open(path);
  Weights w;
  w.cfg_ = c;
  w.source_ = path;
  const auto specs = weight_specs(c);
  std::set<std::string> expected;
  for (const WeightSpec& spec : specs) {
    expected.insert(spec.name);
    if (!reader.contains(spec.name))
      throw WeightsError(fmt::format("{}: tensor '{}' is missing (expected [{}] {})", path, spec.name,
                                     fmt::join(spec.shape, ", "), to_string(spec.dtype)));
    const StTensorInfo& info = reader.info(spec.name);
    if (info.shape != spec.shape)
      throw WeightsError(fmt::format("{}: tensor '{}': expected shape [{}], found [{}]", info.file, spec.name,
                                     fmt::join(spec.shape, ", "), fmt::join(info.shape, ", ")));
    WeightTensor t;
    t.shape = spec.shape;
    t.dtype = info.dtype;
    if (spec.dtype == StDType::I32) {
      if (info.dtype != StDType::I32 && info.dtype != StDType::I64)
        throw WeightsError(fmt::format("{}: tensor '{}': expected an integer dtype (I32 or I64), found {}",
                                       info.file, spec.name, to_string(info.dtype)));
      t.i = reader.read_i32(spec.name);
      for (size_t k = 0; k < t.i.size(); ++k)
        if (t.i[k] < 0 || t.i[k] >= c.n_routed_experts)
          throw WeightsError(fmt::format("{}: tensor '{}': entry {} (token {}) is expert {}, outside [0, {})",
                                         info.file, spec.name, k, k / c.num_experts_per_tok, t.i[k],
                                         c.n_routed_experts));
    } else if (spec.dtype == StDType::F32 && info.dtype != StDType::F32) {
      throw WeightsError(fmt::format(
          "{}: tensor '{}': expected F32 (a keep-fp32 tensor: narrowing it corrupts the model), found {}",
          info.file, spec.name, to_string(info.dtype)));
    } else if (!is_float(info.dtype)) {
      throw WeightsError(
          fmt::format("{}: tensor '{}': expected BF16, F16 or F32, found {}{}", info.file, spec.name,
                      to_string(info.dtype),
                      info.dtype == StDType::F8_E4M3
                          ? " (block-quantised FP8 checkpoints are not supported; dequantise to BF16)"
                          : ""));
    } else {
      t.f = reader.read_f32(spec.name);
    }
    if (keep && !keep(spec.name)) {
      w.absent_.emplace(spec.name, AbsentTensor{t.shape, t.dtype, tensor_digest(t)});
      continue;  // its values freed here: one dropped tensor in memory at a time
    }
    w.tensors_.emplace(spec.name, std::move(t));
  }
  for (const std::string& name : reader.names()) {
    if (expected.count(name)) continue;
    // The MTP block is out of scope (MODEL.md §11): its tensors are allowed and not loaded.
    if (name.rfind("mtp.", 0) == 0 || name.rfind("model.mtp.", 0) == 0) continue;
    throw WeightsError(
        fmt::format("{}: unexpected tensor '{}' (this config does not use it: check the config's "
                    "num_hidden_layers, compress_ratios, num_hash_layers and n_routed_experts)",
                    path, name));
  }
  return w;
}

Weights Weights::with_values(const std::map<std::string, std::vector<float>>& values,
                             const std::string& source) const {
  Weights out = *this;
  out.source_ = source;
  for (const auto& [name, v] : values) {
    auto it = out.tensors_.find(name);
    if (it == out.tensors_.end()) throw WeightsError(fmt::format("weight update: no tensor '{}'", name));
    WeightTensor& t = it->second;
    if (t.dtype == StDType::I32 || t.dtype == StDType::I64)
      throw WeightsError(fmt::format("weight update: '{}' is an integer tensor", name));
    if (v.size() != t.f.size())
      throw WeightsError(
          fmt::format("weight update: '{}' has {} elements, the update {}", name, t.f.size(), v.size()));
    const bool keep_f32 = t.dtype == StDType::F32 || t.dtype == StDType::F16;
    for (size_t i = 0; i < v.size(); ++i) t.f[i] = keep_f32 ? v[i] : num::bf16_round(v[i]);
  }
  return out;
}

void Weights::save(const std::string& dir, int64_t max_shard_bytes) const {
  namespace fs = std::filesystem;
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) throw Error(fmt::format("{}: cannot create directory: {}", dir, ec.message()));
  {
    const std::string cfg_path = (fs::path(dir) / "config.json").string();
    std::ofstream f(cfg_path);
    f << config_to_json(cfg_) << "\n";
    if (!f) throw Error(fmt::format("{}: write failed", cfg_path));
  }
  SafetensorsWriter writer;
  writer.set_metadata("format", "pt");
  writer.set_metadata("producer", "dsv4-replay");
  for (const auto& [name, t] : tensors_) {
    switch (t.dtype) {
      case StDType::I32:
      case StDType::I64:
        writer.add_i32(name, t.shape, t.i);
        break;
      case StDType::F32:
      case StDType::F16:  // widened losslessly
        writer.add_f32(name, t.shape, t.f);
        break;
      default:
        writer.add_bf16(name, t.shape, t.f);
        break;
    }
  }
  if (max_shard_bytes > 0)
    writer.write_sharded(dir, max_shard_bytes);
  else
    writer.write((fs::path(dir) / "model.safetensors").string());
}

const WeightTensor& Weights::get(const std::string& name) const {
  auto it = tensors_.find(name);
  if (it != tensors_.end()) return it->second;
  if (absent_.count(name))
    throw WeightsError(fmt::format("weights: tensor '{}' was not loaded by this process (it holds only its own "
                                   "experts)",
                                   name));
  throw WeightsError(fmt::format("weights: no tensor '{}'", name));
}

void Weights::keep_only(const WeightFilter& keep) {
  for (auto it = tensors_.begin(); it != tensors_.end();) {
    if (keep(it->first)) {
      ++it;
      continue;
    }
    absent_.emplace(it->first, AbsentTensor{it->second.shape, it->second.dtype, tensor_digest(it->second)});
    it = tensors_.erase(it);
  }
}

int64_t Weights::loaded_bytes() const {
  int64_t n = 0;
  for (const auto& [name, t] : tensors_)
    n += int64_t(t.f.size() * sizeof(float) + t.i.size() * sizeof(int32_t));
  return n;
}

WeightFilter only_experts(int first, int last) {
  return [first, last](const std::string& name) {
    const ParamSite s = param_site(name);
    return s.expert < 0 || (s.expert >= first && s.expert < last);
  };
}

WeightFilter rank_experts(int n_routed_experts, int rank, int ranks) {
  const ExpertRange r = expert_range(n_routed_experts, rank, ranks);
  return only_experts(r.first, r.last);
}

uint64_t tensor_digest(const WeightTensor& w) {
  switch (w.dtype) {
    case StDType::I32:
    case StDType::I64:
      return XXH3_64bits(w.i.data(), w.i.size() * sizeof(int32_t));
    case StDType::BF16: {
      XXH3_state_t* st = XXH3_createState();
      XXH3_64bits_reset(st);
      constexpr size_t kChunk = size_t(1) << 16;
      std::vector<uint16_t> buf(std::min(kChunk, w.f.size()));
      for (size_t i = 0; i < w.f.size(); i += kChunk) {
        const size_t n = std::min(kChunk, w.f.size() - i);
        for (size_t k = 0; k < n; ++k) buf[k] = num::bf16_bits(w.f[i + k]);
        XXH3_64bits_update(st, buf.data(), n * 2);
      }
      const uint64_t h = XXH3_64bits_digest(st);
      XXH3_freeState(st);
      return h;
    }
    default:
      return XXH3_64bits(w.f.data(), w.f.size() * sizeof(float));
  }
}

const float* Weights::layer_f(int layer, const std::string& suffix) const {
  return f(layer_prefix(layer) + suffix);
}
const int32_t* Weights::layer_i(int layer, const std::string& suffix) const {
  return i(layer_prefix(layer) + suffix);
}

namespace {

// The decimal number at the start of `s` (no sign, no leading zero unless it is "0"), and its length.
std::pair<int, size_t> leading_index(const std::string& s, size_t at) {
  size_t n = 0;
  int64_t v = 0;
  while (at + n < s.size() && s[at + n] >= '0' && s[at + n] <= '9' && n < 9) {
    v = v * 10 + (s[at + n] - '0');
    ++n;
  }
  if (n == 0 || (n > 1 && s[at] == '0')) return {-1, 0};
  return {int(v), n};
}

}  // namespace

ParamSite param_site(const std::string& name) {
  ParamSite s;
  s.kind = name;
  static const std::string kLayers = "model.layers.";
  if (name.rfind(kLayers, 0) != 0) return s;
  const int layer = leading_index(name, kLayers.size()).first;
  // The prefix must be exactly the one the model writes (model/weights.h layer_prefix).
  if (layer < 0 || name.compare(0, layer_prefix(layer).size(), layer_prefix(layer)) != 0) return s;
  s.layer = layer;
  s.kind = name.substr(layer_prefix(layer).size());
  static const std::string kExperts = "mlp.experts.";
  if (s.kind.rfind(kExperts, 0) == 0) {
    const auto [e, n] = leading_index(s.kind, kExperts.size());
    if (e >= 0 && kExperts.size() + n < s.kind.size() && s.kind[kExperts.size() + n] == '.') {
      s.expert = e;
      s.kind = kExperts + "*" + s.kind.substr(kExperts.size() + n);
    }
  }
  return s;
}

}  // namespace dsv4
