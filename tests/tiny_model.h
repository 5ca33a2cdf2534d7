// The shared test fixtures: the tiny preset's weights from seed 7 and the tiny-b preset's from seed
// 11, each built once per test binary.
#pragma once

#include <string>

#include "model/config.h"
#include "model/weights.h"

namespace dsv4::test {

inline const Weights& tiny() {
  static const Weights w = Weights::init(preset("tiny"), 7);
  return w;
}

inline const Weights& tiny_b() {
  static const Weights w = Weights::init(preset("tiny-b"), 11);
  return w;
}

// tiny() for "tiny", tiny_b() for "tiny-b".
inline const Weights& tiny_by_name(const std::string& preset_name) {
  return preset_name == "tiny" ? tiny() : tiny_b();
}

}  // namespace dsv4::test
