#include "model/profile.h"

#include <fmt/format.h>

#include "model/error.h"

namespace dsv4 {

NumericsProfile profile_train() {
  NumericsProfile p;
  p.name = "train";
  p.order = ReduceOrder{0};
  return p;
}

NumericsProfile profile_rollout() {
  NumericsProfile p;
  p.name = "rollout";
  // Split-K in blocks of 64, like a tensor-core kernel's k-tiles: same math, other rounding.
  p.order = ReduceOrder{64};
  p.fp8_kv = true;
  p.fp8_indexer = true;
  return p;
}

std::vector<std::string> profile_names() {
  return {"train", "rollout"};
}

NumericsProfile profile_by_name(const std::string& name) {
  if (name == "train") return profile_train();
  if (name == "rollout") return profile_rollout();
  throw InputError(fmt::format("unknown numerics profile '{}' (known: train, rollout)", name));
}

std::string decode_attention_name(const NumericsProfile& p) {
  return p.decode_attention_splits <= 0 ? "exact" : fmt::format("split:{}", p.decode_attention_splits);
}

int parse_decode_attention(const std::string& s) {
  constexpr int kMaxSplits = 65536;
  if (s == "exact") return 0;
  const std::string prefix = "split:";
  if (s.compare(0, prefix.size(), prefix) == 0 && s.size() > prefix.size() && s.size() <= prefix.size() + 5) {
    int n = 0;
    bool digits = true;
    for (size_t i = prefix.size(); i < s.size(); ++i) {
      if (s[i] < '0' || s[i] > '9')
        digits = false;
      else
        n = n * 10 + (s[i] - '0');
    }
    if (digits && n >= 1 && n <= kMaxSplits) return n;
  }
  throw InputError(
      fmt::format("unknown decode attention '{}' (accepted: exact, split:N with N in 1..{})", s, kMaxSplits));
}

}  // namespace dsv4
