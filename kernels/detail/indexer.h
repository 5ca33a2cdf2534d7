// Shared CPU/CUDA arithmetic of the lightning indexer, its top-k ranking and the attention index rows
// (kernels/indexer.h); conventions in kernels/detail/shared.h.
#pragma once

#include <cstdint>

#include "kernels/detail/shared.h"
#include "kernels/indexer.h"

namespace dsv4::common {

// relu(x) = (x < 0 ? 0 : x): NaN propagates.
DSV4_HD float relu(float x) {
  return x < 0.0f ? 0.0f : x;
}

// One step of the score's fma chain over heads: fma(w_h, relu(dot_h), s). The score of a candidate
// is s = 0 followed by this step for h = 0, 1, ..., Hi - 1 (dot_h = dot(qi[t, h], ki[g], order)).
DSV4_HD float index_score_step(float s, float w, float dot_h) {
  return std::fma(w, relu(dot_h), s);
}

// The candidates of query row t: the groups g < min(G, floor((t + 1) / ratio)) (complete groups).
DSV4_HD int64_t visible_groups(int64_t G, int64_t t, int ratio) {
  const int64_t vis = (t + 1) / ratio;
  return vis < G ? vis : G;
}

// topk_row's ranking as a strict total order: candidate a (score sa) ranks before b (score sb) when
// it is a number and b is NaN, else when sa > sb, else (equal scores or both NaN) when a < b.
DSV4_HD bool ranks_before(float sa, int32_t a, float sb, int32_t b) {
  const bool na = sa != sa, nb = sb != sb;
  if (na != nb) return nb;
  if (!na && sa != sb) return sa > sb;
  return a < b;
}

// Entry m of attention index row t (kernels/indexer.h build_index), kw = min(T, W) the window width:
// m < kw: window slot start + m (start = max(0, t - W + 1)) if <= t, else -1; then the compressed
// part: c128 entry g = g + T if g < floor((t + 1) / ratio) else -1; c4 entry j = sel[t][j] + T if
// sel >= 0 else -1.
DSV4_HD int32_t index_entry(const IndexBuildParams& p, int64_t kw, int64_t t, int64_t m) {
  if (m < kw) {
    const int64_t start = t - p.W + 1 > 0 ? t - p.W + 1 : 0;
    return (start + m <= t) ? int32_t(start + m) : -1;
  }
  if (p.kind == CompressedKind::c128) {
    const int64_t g = m - kw, vis = (t + 1) / p.ratio;
    return g < vis ? int32_t(g + p.T) : -1;
  }
  if (p.kind == CompressedKind::c4) {
    const int32_t s = p.sel[t * p.k + (m - kw)];
    return s >= 0 ? int32_t(s + p.T) : -1;
  }
  return -1;
}

}  // namespace dsv4::common
