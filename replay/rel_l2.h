// The rel-L2 of every value comparison (dsv4 diff, the training diff, replay --tolerance), written once.
#pragma once

#include <cmath>
#include <limits>

namespace dsv4 {

// ||b − a|| / ||a|| from the sums over the compared elements of (b − a)^2 and a^2: 0 when they are
// equal, +inf when ||a|| = 0 < ||b − a||.
inline double rel_l2_of(double sum_sq_diff, double sum_sq_a) {
  if (sum_sq_diff == 0) return 0;
  return sum_sq_a == 0 ? std::numeric_limits<double>::infinity() : std::sqrt(sum_sq_diff) / std::sqrt(sum_sq_a);
}

}  // namespace dsv4
