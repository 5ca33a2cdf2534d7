// The ends of a logarithmic colour scale, from the values a view shows (the overview's metrics that
// span decades, the gradient map). One rule for every view:
//  - the worst end is the worst value (the largest; for margins, the smallest positive one), so the
//    worst cell is always the darkest;
//  - the ideal end is the 5th percentile of the positive values counted from the ideal side, so a
//    few exceptionally small differences (large margins) do not press every other cell towards the
//    dark end; cells beyond it take the palest colour that still marks a difference;
//  - the ends are at least a decade apart.
// Values are counted in bins of a float's exponent and its top 4 mantissa bits (16 to an octave), so the
// percentile is exact to 6.25 % at worst, and the counts of rows loaded one by one are kept and merged.
#pragma once

#include <cstdint>
#include <vector>

namespace dsv4::gui {

constexpr double kIdealEndQuantile = 0.05;

class LogScaleCounts {
 public:
  void add(float v);  // non-positive and non-finite values are not counted
  void add(const LogScaleCounts& other);
  uint64_t count() const { return n_; }

  struct Range {
    double lo = 1e-6, hi = 1;  // the scale's ends (lo < hi)
    bool clipped = false;      // some values lie beyond the ideal end
  };
  // With no values counted: {1e-6, 1}.
  Range range(bool lower_is_worse) const;

 private:
  std::vector<uint32_t> bins_;  // empty until the first value
  float min_ = 0, max_ = 0;
  uint64_t n_ = 0;
};

}  // namespace dsv4::gui
