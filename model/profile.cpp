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

}  // namespace dsv4
