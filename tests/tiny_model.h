// The shared test fixture: the tiny preset's weights from seed 7, built once per test binary.
#pragma once

#include "model/config.h"
#include "model/weights.h"

namespace dsv4::test {

inline const Weights& tiny() {
  static const Weights w = Weights::init(preset("tiny"), 7);
  return w;
}

}  // namespace dsv4::test
