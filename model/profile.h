// Numerics profiles (DESIGN.md §4, docs/PROFILES.md): a named precision map with one entry per site
// where the runtime chooses precision. Profiles are data: a small text format (docs/PROFILES.md),
// with built-ins shipped as files in profiles/ and compiled into the tool.
//
// Built-ins:
// - `train`: the training engine's prefill numerics (bf16 storage, fp32 accumulation, MODEL.md §3.11,
//   no FP8);
// - `rollout`: an inference engine's numerics (FP8-simulated window and compressed KV and FP8-
//   simulated indexer inputs as SGLang stores them, MODEL.md §4.4, and a different but fixed blocking
//   of the long reductions);
// - `deepseek-inference`, `deepseek-inference-v2`: DeepSeek's official inference code, its initial
//   release and its later revision (MODEL.md §12.1).
// All are deterministic; their differences are the realistic train-inference mismatch.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "kernels/quant.h"
#include "kernels/reduce.h"

namespace dsv4 {

// A block quantisation simulated at a site (kernels/quant.h). `fp8_inplace_bf16_cast` is the official
// inference code's in-place act_quant ([U] MODEL.md §4.2: an identity under ue8m0 scales).
enum class QuantSim { none, fp8, fp8_inplace_bf16_cast, fp4 };
// The arithmetic of a site: fp32, or bf16 (every intermediate rounded to bf16, as a PyTorch op on a
// bf16 tensor does).
enum class Arith { fp32, bf16 };

// The blocking of the long fp32 reductions (kernels/reduce.h), one site per op family: an engine's
// GEMM k-tiles and its attention or norm kernels are chosen apart. The backward of an op uses its
// family's order; the backward's weight and input GEMMs use `gemm`.
struct ReduceSites {
  ReduceOrder gemm;        // dense linears (the compressor projections, the router gate, the head)
  ReduceOrder norm;        // RMSNorms (attn/ffn/final norms, q_norm, kv_norm, the per-head q norm)
  ReduceOrder compressor;  // the compressor's pooled-row norm
  ReduceOrder mhc;         // hc_pre / hc_head (fn · x, the row norms)
  ReduceOrder indexer;     // the indexer's q·k dots
  ReduceOrder attention;   // the sparse attention's q·kv dots
  ReduceOrder moe;         // the experts' GEMMs
};

struct NumericsProfile {
  std::string name;
  std::string description;
  // reduce.*: the blocking of the long reductions, per op family (above).
  ReduceSites reduce;
  // attention.q_norm: the per-head q RMSNorm (no weight), kernels/norm.h RmsNormParams::bf16_arith.
  Arith q_norm = Arith::fp32;
  // attention.softmax: 0 = the two-pass softmax of kernels/attention.h; B >= 1 = an online softmax in
  // blocks of B slots with unnormalised bf16 probabilities (SparseAttnParams::online_block).
  int attention_online_block = 0;
  // attention.decode: the attention of a decode step (a one-token chunk with a cache): 0 keeps the
  // prefill order, so a decode equals the prefill bit for bit; N >= 1 uses the split-KV
  // ("flash-decoding") order of an inference engine's decode kernel with N parts
  // (SparseAttnParams::splits). Prefill chunks never use it.
  int decode_attention_splits = 0;
  // kv.quant: window KV and main compressed KV, nope dims, block 64, ue8m0 (none, fp8,
  // fp8_inplace_bf16_cast).
  QuantSim kv_quant = QuantSim::none;
  // kv.quant_block, kv.quant_scale: its block (it must divide the nope dims) and scale rule (ue8m0:
  // power-of-two scales; fp32: s = amax / 448 as computed).
  int kv_quant_block = 64;
  ScaleFmt kv_quant_scale = ScaleFmt::ue8m0;
  // indexer.quant: indexer q (per head row) and k after RoPE and Hadamard (none; fp8: block
  // min(Di, 128), ue8m0; fp4: e2m1, block 32, power-of-two scales).
  QuantSim indexer_quant = QuantSim::none;
  // indexer.quant_block, indexer.quant_scale: 0 = the format's block (fp8: min(Di, 128), one scale per
  // head row; fp4: 32); the scale rule (ue8m0, or fp32 for fp8; FP4 scales are powers of two).
  int indexer_quant_block_size = 0;
  ScaleFmt indexer_quant_scale = ScaleFmt::ue8m0;
  // indexer.score: the q.k dots, ReLU times weight and head sum (IndexerParams::bf16_scores).
  Arith indexer_score = Arith::fp32;
  // moe.expert_output: false = the experts' fp32 outputs summed then rounded once; true = each routed
  // and shared expert's w2 output rounded to bf16 before the fp32 sum (MoeParams::round_each).
  bool expert_output_bf16 = false;
  // moe.shared_clamp ([U] MODEL.md §3.9.3): the SwiGLU clamp on the shared expert too.
  bool clamp_shared_expert = false;

  // Whether a decoding engine's cache stores the window/compressed KV, or the indexer keys, as FP8
  // rows (rollout/kv_cache.cpp): when the site simulates real FP8 with power-of-two scales (the cache
  // keeps one e8m0 byte per block). The cache then quantises on store; every other simulation is
  // applied before the rows are stored (its values are bf16).
  bool fp8_kv_cache() const { return kv_quant == QuantSim::fp8 && kv_quant_scale == ScaleFmt::ue8m0; }
  bool fp8_indexer_cache() const {
    return indexer_quant == QuantSim::fp8 && indexer_quant_scale == ScaleFmt::ue8m0;
  }
  // The block of the indexer q/k simulation for head dim Di: indexer.quant_block, or the format's.
  int indexer_quant_block(int64_t Di) const {
    if (indexer_quant_block_size > 0) return indexer_quant_block_size;
    return indexer_quant == QuantSim::fp4 ? 32 : int(Di < 128 ? Di : 128);
  }

  // A quantisation site as the forward and the caches apply it.
  struct QuantSite {
    QuantSim kind;
    int block;
    ScaleFmt scale;
    bool cached_fp8;        // a decoding engine's cache stores these rows as FP8 (above)
    const char* block_key;  // the site that sets the block, for errors
  };
  QuantSite kv_site() const { return {kv_quant, kv_quant_block, kv_quant_scale, fp8_kv_cache(), "kv.quant_block"}; }
  QuantSite indexer_site(int64_t Di) const {
    return {indexer_quant, indexer_quant_block(Di), indexer_quant_scale, fp8_indexer_cache(), "indexer.quant_block"};
  }
};

// ---- the sites ----------------------------------------------------------------------------------
// One entry per site: its key in the text format, what it chooses, and its values. The one place a
// site is named: parsing, printing, `dsv4 profile diff`, trace diffs and bisect all go through it.
struct ProfileSite {
  const char* key;     // "indexer.score"
  const char* choice;  // one line: what the site chooses
  const char* values;  // the accepted values, as the help spells them
  std::string (*get)(const NumericsProfile&);
  // Sets the site from its text; returns nullptr, or the reason the value is refused.
  const char* (*set)(NumericsProfile&, const std::string& value);
};
const std::vector<ProfileSite>& profile_sites();
const ProfileSite* find_profile_site(const std::string& key);  // nullptr when there is no such site

// ---- the text format ----------------------------------------------------------------------------
inline constexpr int kProfileFormatVersion = 1;

// Parses a profile. `source` names the text in errors ("profiles/x.profile", "built-in 'train'",
// "trace t.h5 step 0"). Throws InputError naming the source, the line and the site for: an unknown
// key, an impossible value, a missing or newer format version, a missing name, a site given twice,
// sites left unset without `base`, sites that contradict each other (an fp32 scale rule for FP4).
NumericsProfile parse_profile(const std::string& text, const std::string& source);
// The canonical text of a profile: the header, then every site in profile_sites() order. Parsing it
// gives the same profile; two profiles with the same sites and name give the same text.
std::string profile_text(const NumericsProfile& p);
// XXH3-64 of a profile's text, as 16 lower-case hex digits (stored in traces beside the text).
std::string profile_text_digest(const std::string& text);
std::string profile_digest(const NumericsProfile& p);  // profile_text_digest(profile_text(p))

// ---- lookup -------------------------------------------------------------------------------------
std::vector<std::string> profile_names();  // the built-ins, in a fixed order
bool is_builtin_profile(const std::string& name);
// The built-in's file text as shipped (comments included).
const std::string& builtin_profile_source(const std::string& name);
// A built-in by name; throws InputError listing the names.
NumericsProfile profile_by_name(const std::string& name);
// What `--profile NAME|FILE` takes: a built-in's name, else a path to a profile file. Throws
// InputError naming the argument when it is neither (or the file's errors), and for a file that takes
// a built-in's name with other sites.
NumericsProfile load_profile(const std::string& name_or_file);

NumericsProfile profile_train();
NumericsProfile profile_rollout();

// ---- numerics modes (docs/NUMERICS.md "Fast numerics") -----------------------------------------
// exact: every site in a canonical order of kernels/reduce.h, the CPU's bits on every device.
// fast: the GEMM, expert, indexer and attention sites (reduce.gemm, reduce.moe, reduce.indexer,
// reduce.attention) in the tensor_core order: bf16 tensor-core GEMMs, indexer and sparse attention,
// bitwise reproducible on one GPU architecture (run to run, any batch composition), CUDA only,
// forward passes only. A profile is fast when any site is in the tensor_core order.
enum class Numerics { exact, fast };
const char* to_string(Numerics n);
// "exact" or "fast"; anything else throws InputError naming the accepted values.
Numerics parse_numerics(const std::string& s);
// The sites of `p` in the tensor_core order, in site order; empty for exact numerics.
std::vector<std::string> tensor_core_sites(const NumericsProfile& p);
inline Numerics numerics_of(const NumericsProfile& p) {
  return tensor_core_sites(p).empty() ? Numerics::exact : Numerics::fast;
}
// `p` in numerics `n`: for fast, the GEMM, expert, indexer and attention sites in the tensor_core order and the name
// "NAME.fast" (a profile of its own: a built-in's name always means the built-in's sites); exact
// returns `p` as it is. A profile that is fast already stays as it is.
NumericsProfile with_numerics(const NumericsProfile& p, Numerics n);
// The name of the profile `p` was made from by with_numerics ("rollout" for "rollout.fast").
std::string numerics_base_name(const NumericsProfile& p);
// load_profile, then with_numerics.
NumericsProfile load_profile(const std::string& name_or_file, Numerics n);

// One site where two profiles differ.
struct ProfileSiteDiff {
  std::string key, a, b;
};
std::vector<ProfileSiteDiff> profile_diff(const NumericsProfile& a, const NumericsProfile& b);
// `p` with site `key` taken from `from` (bisect). Throws Error for an unknown key.
void copy_profile_site(NumericsProfile& p, const NumericsProfile& from, const std::string& key);

// decode_attention_splits as the site spells it: "exact" (0) or "split:N".
std::string decode_attention_name(const NumericsProfile& p);
// "exact" -> 0, "split:N" (decimal N in [1, 65536]) -> N; anything else throws InputError naming the
// accepted forms.
int parse_decode_attention(const std::string& s);

}  // namespace dsv4
