// Numerics profiles (DESIGN.md §4): `train` is the training engine's prefill numerics (bf16 storage,
// fp32 accumulation, MODEL.md §3.11, no FP8); `rollout` is an inference engine's numerics (FP8-
// simulated window and compressed KV and FP8-simulated indexer inputs as SGLang stores them,
// MODEL.md §4.4, and a different but fixed blocking of the long reductions). Both are deterministic;
// their difference is the realistic train-inference mismatch.
#pragma once

#include <string>
#include <vector>

#include "kernels/quant.h"
#include "kernels/reduce.h"

namespace dsv4 {

// How the FP8 KV sites are simulated ([U] MODEL.md §4.2): `real` quantises to e4m3 and back (what
// SGLang's FP8 cache and miles' QAT do, the default); `inplace_bf16_cast` reproduces the official
// inference code's in-place act_quant, an identity under ue8m0 scales.
enum class Fp8KvMode { real, inplace_bf16_cast };

struct NumericsProfile {
  std::string name;
  ReduceOrder order;    // every long reduction (GEMMs, norms, attention/indexer dots, mHC)
  bool fp8_kv = false;  // window KV + main compressed KV: nope dims, block 64, ue8m0
  Fp8KvMode fp8_kv_mode = Fp8KvMode::real;
  bool fp8_indexer = false;          // indexer q (per head row) and k: block 128, ue8m0
  bool clamp_shared_expert = false;  // [U] MODEL.md §3.9.3: default no clamp on the shared expert
  // Attention of a decode step (a one-token chunk with a cache): 0 keeps the exact row order, so a
  // decode equals the prefill bit for bit; N >= 1 uses the split-KV ("flash-decoding") order of an
  // inference engine's decode kernel with N parts (kernels/attention.h SparseAttnParams::splits), so
  // decode and prefill differ in rounding the way they do in such an engine. Prefill chunks always
  // use the exact order.
  int decode_attention_splits = 0;
};

NumericsProfile profile_train();
NumericsProfile profile_rollout();
std::vector<std::string> profile_names();
NumericsProfile profile_by_name(const std::string& name);  // throws InputError listing the names

// decode_attention_splits as the option spells it: "exact" (0) or "split:N".
std::string decode_attention_name(const NumericsProfile& p);
// "exact" -> 0, "split:N" (decimal N in [1, 65536]) -> N; anything else throws InputError naming the
// accepted forms.
int parse_decode_attention(const std::string& s);

}  // namespace dsv4
