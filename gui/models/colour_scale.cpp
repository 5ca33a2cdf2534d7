#include "gui/models/colour_scale.h"

#include <algorithm>
#include <bit>
#include <cmath>

namespace dsv4::gui {

namespace {

constexpr int kShift = 19;                            // keeps the exponent and 4 mantissa bits
constexpr size_t kBins = size_t(1) << (31 - kShift);  // positive floats only: the sign bit is 0

uint32_t bin_of(float v) {
  return std::bit_cast<uint32_t>(v) >> kShift;
}
double lower_edge(uint32_t bin) {
  return double(std::bit_cast<float>(bin << kShift));
}
double upper_edge(uint32_t bin) {
  return double(std::bit_cast<float>((bin + 1) << kShift));
}

}  // namespace

void LogScaleCounts::add(float v) {
  if (!(v > 0) || !std::isfinite(v)) return;
  if (bins_.empty()) bins_.assign(kBins, 0);
  ++bins_[bin_of(v)];
  min_ = n_ == 0 ? v : std::min(min_, v);
  max_ = n_ == 0 ? v : std::max(max_, v);
  ++n_;
}

void LogScaleCounts::add(const LogScaleCounts& o) {
  if (o.n_ == 0) return;
  if (bins_.empty()) bins_.assign(kBins, 0);
  for (size_t i = 0; i < kBins; ++i) bins_[i] += o.bins_[i];
  min_ = n_ == 0 ? o.min_ : std::min(min_, o.min_);
  max_ = n_ == 0 ? o.max_ : std::max(max_, o.max_);
  n_ += o.n_;
}

LogScaleCounts::Range LogScaleCounts::range(bool lower_is_worse) const {
  Range r;
  if (n_ == 0) return r;
  // The bin holding the value of rank ceil(q n) from the ideal side.
  const uint64_t rank = std::max<uint64_t>(1, uint64_t(std::ceil(kIdealEndQuantile * double(n_))));
  uint64_t seen = 0;
  if (!lower_is_worse) {
    r.hi = max_;
    for (uint32_t b = 0; b < kBins; ++b)
      if ((seen += bins_[b]) >= rank) {
        r.lo = std::max(lower_edge(b), double(min_));
        break;
      }
    r.lo = std::min(r.lo, r.hi / 10);
    r.clipped = r.lo > min_;
  } else {
    r.lo = min_;
    for (uint32_t b = kBins; b-- > 0;)
      if ((seen += bins_[b]) >= rank) {
        r.hi = std::min(upper_edge(b), double(max_));
        break;
      }
    r.hi = std::max(r.hi, r.lo * 10);
    r.clipped = r.hi < max_;
  }
  return r;
}

}  // namespace dsv4::gui
