// The DSV4 weights: the list of tensors a config needs (HF-converted names of MODEL.md §1.3), seeded
// initialisation, loading from safetensors with full checking, and saving.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "model/config.h"
#include "model/observer.h"
#include "model/safetensors.h"

namespace dsv4 {

// How a tensor is initialised by `dsv4 model init` (MODEL.md §9.1).
enum class InitKind { normal, ones_jitter, ones, zeros, tid2eid };

struct WeightSpec {
  std::string name;
  std::vector<int64_t> shape;
  StDType dtype;  // storage dtype in the checkpoint: BF16, F32 (keep-fp32 tensors) or I32 (tid2eid)
  InitKind init = InitKind::normal;
  float std = 0.02f;
  int64_t numel() const;
};

// Every tensor the forward reads, in a fixed order (model-level first, then layer by layer).
std::vector<WeightSpec> weight_specs(const ModelConfig& c);

struct WeightTensor {
  std::vector<int64_t> shape;
  StDType dtype = StDType::BF16;  // as stored in the checkpoint
  std::vector<float> f;           // values (exact widening of the stored dtype) for float tensors
  std::vector<int32_t> i;         // values for integer tensors
};

// XXH3-64 of a tensor's values in its storage dtype (BF16: the bf16 patterns; integer tensors: the int32
// values; others: the fp32 values): the per-tensor digests of a model (capture/digest.h model_digest).
uint64_t tensor_digest(const WeightTensor& t);

// A tensor this process did not load (Weights::load's `keep`): its shape, dtype and digest, so the
// model's digest stays that of the whole checkpoint.
struct AbsentTensor {
  std::vector<int64_t> shape;
  StDType dtype = StDType::BF16;
  uint64_t digest = 0;
};

// Which tensors a process loads (true: keep); the others are checked, digested and dropped.
using WeightFilter = std::function<bool(const std::string& name)>;
// The routed experts of every layer outside [first, last) left out; everything else kept. The weights
// of one rank of expert parallelism (model/communicator.h expert_range).
WeightFilter only_experts(int first, int last);
// only_experts of rank `rank` of `ranks` (model/communicator.h expert_range over n_routed_experts): the
// weights an expert-parallel process loads, in the CLI and in replay alike.
WeightFilter rank_experts(int n_routed_experts, int rank, int ranks);

class Weights {
 public:
  // Seeded initialisation (deterministic on every machine; kernels/numerics/rng.h).
  static Weights init(const ModelConfig& c, uint64_t seed);
  // Loads a checkpoint (file or directory). Every spec'd tensor must be present with the expected
  // shape and a compatible dtype (float tensors: BF16/F16/F32/F8_E4M3 — keep-fp32 tensors must be
  // F32 — integer tensors I32/I64); unexpected tensors are an error too. Messages name the tensor,
  // what was expected and what was found.
  // With `keep`, the tensors it refuses are checked the same way, digested (tensor_digest) one at a time
  // and dropped: absent() lists them, and get() of one throws WeightsError saying it was not loaded.
  static Weights load(const ModelConfig& c, const std::string& path, const WeightFilter& keep = {});
  // Drops the tensors `keep` refuses, keeping their digests (as load with `keep`).
  void keep_only(const WeightFilter& keep);
  // A copy with the float tensors named in `values` replaced (same element counts, else WeightsError
  // naming the tensor), each value rounded as save() stores it: to bf16 (round to nearest even) for
  // tensors stored BF16 or F8_E4M3, unchanged for F32 / F16. The optimizer's master weights become the
  // next step's compute weights this way. `source` names the new weights (e.g. "train-step:1").
  Weights with_values(const std::map<std::string, std::vector<float>>& values, const std::string& source) const;
  // Writes dir/config.json and dir/model.safetensors (or shards when max_shard_bytes > 0).
  void save(const std::string& dir, int64_t max_shard_bytes = 0) const;

  const ModelConfig& config() const { return cfg_; }
  const WeightTensor& get(const std::string& name) const;  // throws WeightsError if unknown
  const float* f(const std::string& name) const { return get(name).f.data(); }
  const int32_t* i(const std::string& name) const { return get(name).i.data(); }
  const float* layer_f(int layer, const std::string& suffix) const;
  const int32_t* layer_i(int layer, const std::string& suffix) const;
  bool has(const std::string& name) const { return tensors_.count(name) != 0; }
  const std::map<std::string, WeightTensor>& tensors() const { return tensors_; }  // loaded ones
  const std::map<std::string, AbsentTensor>& absent() const { return absent_; }   // left out by `keep`
  int64_t loaded_bytes() const;  // the loaded tensors' values in memory
  std::string source() const { return source_; }  // path it was loaded from, or "init:seed=N"

 private:
  ModelConfig cfg_;
  std::map<std::string, WeightTensor> tensors_;
  std::map<std::string, AbsentTensor> absent_;
  std::string source_;
};

std::string layer_prefix(int layer);  // "model.layers.{i}."

// The mHC mixers' weights are prefix + "fn", prefix + "base" and prefix + "scale": a sublayer's under
// mhc_prefix ("model.layers.{layer}.hc_attn_" / "...hc_ffn_"), the head's under kHeadMhcPrefix.
std::string mhc_prefix(int layer, Sublayer sub);
inline constexpr const char* kHeadMhcPrefix = "model.hc_head_";

// Where a weight sits: its layer (−1 for model-level weights: embedding, head, final norm, the head's
// mHC), its routed expert (−1 otherwise) and its kind, the name without the "model.layers.N." prefix
// and with the expert index folded: "model.layers.3.mlp.experts.5.down_proj.weight" is layer 3,
// expert 5, kind "mlp.experts.*.down_proj.weight"; a model-level weight's kind is its name.
struct ParamSite {
  int layer = -1;
  int expert = -1;
  std::string kind;
};
ParamSite param_site(const std::string& name);


}  // namespace dsv4
