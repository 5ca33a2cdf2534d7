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

// One step of the score's chain over heads. The score of a candidate is s = 0 followed by this step
// for h = 0, 1, ..., Hi - 1 (dot_h = dot(qi[t, h], ki[g], order)), then index_score_final.
//   fp32 scores: fma(w_h, relu(dot_h), s)
//   bf16 scores (IndexerParams::bf16_scores): s + bf16(w_h * relu(bf16(dot_h))) — a bf16 einsum
//   output, its ReLU, the bf16 product with the head weight, summed over heads in fp32
DSV4_HD float index_score_step(float s, float w, float dot_h, bool bf16) {
  if (bf16) return s + num::bf16_round(w * relu(num::bf16_round(dot_h)));
  return std::fma(w, relu(dot_h), s);
}

// The score from its chain over heads: bf16 scores round the fp32 head sum to bf16 (the sum's bf16
// output); fp32 scores are the sum.
DSV4_HD float index_score_final(float s, bool bf16) {
  return bf16 ? num::bf16_round(s) : s;
}

// The candidates of query row t: the groups g < min(G, floor((t + 1) / ratio)) (complete groups).
DSV4_HD int64_t visible_groups(int64_t G, int64_t t, int ratio) {
  const int64_t vis = (t + 1) / ratio;
  return vis < G ? vis : G;
}

// The candidates of query row t of p (at position pos0 + t).
DSV4_HD int64_t row_candidates(const IndexerParams& p, int64_t t) {
  return visible_groups(p.G, p.pos0 + t, p.ratio);
}

// topk_row's ranking as a strict total order: candidate a (score sa) ranks before b (score sb) when
// it is a number and b is NaN, else when sa > sb, else (equal scores or both NaN) when a < b.
DSV4_HD bool ranks_before(float sa, int32_t a, float sb, int32_t b) {
  const bool na = sa != sa, nb = sb != sb;
  if (na != nb) return nb;
  if (!na && sa != sb) return sa > sb;
  return a < b;
}

// Entry m of attention index row t (kernels/indexer.h build_index) at position q = pos0 + t, with
// kw = min(pos0 + T, W) the window width and base = pos0 - hist the position of KV row 0:
// m < kw: the window position start + m (start = max(0, q - W + 1)) as KV row (start + m - base) if
// it is <= q, else -1; then the compressed part, whose rows follow the hist + T window rows:
// c128 entry g = g + hist + T if g < floor((q + 1) / ratio) else -1; c4 entry j = sel[t][j] + hist + T
// if sel >= 0 else -1.
DSV4_HD int32_t index_entry(const IndexBuildParams& p, int64_t kw, int64_t t, int64_t m) {
  const int64_t q = p.pos0 + t, nwin = p.hist + p.T;
  if (m < kw) {
    const int64_t start = q - p.W + 1 > 0 ? q - p.W + 1 : 0;
    return (start + m <= q) ? int32_t(start + m - (p.pos0 - p.hist)) : -1;
  }
  if (p.kind == CompressedKind::c128) {
    const int64_t g = m - kw, vis = (q + 1) / p.ratio;
    return g < vis ? int32_t(g + nwin) : -1;
  }
  if (p.kind == CompressedKind::c4) {
    const int32_t s = p.sel[t * p.k + (m - kw)];
    return s >= 0 ? int32_t(s + nwin) : -1;
  }
  return -1;
}

}  // namespace dsv4::common
