// Lightning indexer scores + top-k (MODEL.md §3.7) and the attention index rows (§3.6) on the CPU.
// The operation order is the contract of kernels/indexer.h.
#include "kernels/indexer.h"

#include <algorithm>
#include <limits>
#include <string>
#include <vector>

#include "kernels/detail/indexer.h"
#include "kernels/error.h"
#include "kernels/linear.h"

namespace dsv4 {

namespace {
// Below this much work (multiply-adds or elements) a parallel region costs more than it saves. The
// thread count never changes the result, so the threshold is free to tune.
constexpr int64_t kParallelWork = int64_t(1) << 15;

// The ranking of topk_row as a strict total order on candidate indices: a number before NaN, a
// larger score first, then the smaller index. Being total, it defines the chosen set uniquely,
// whatever selection algorithm is used.
struct RanksBefore {
  const float* s;
  bool operator()(int32_t a, int32_t b) const { return common::ranks_before(s[a], a, s[b], b); }
};

// The score of group g for row t: the chain over heads of kernels/detail/indexer.h.
inline float index_score(const IndexerParams& p, int64_t t, int64_t g) {
  const float* q = p.qi + t * p.Hi * p.Di;
  const float* w = p.wt + t * p.Hi;
  const float* k = p.ki + g * p.Di;
  float s = 0.0f;
  for (int h = 0; h < p.Hi; ++h)
    s = common::index_score_step(s, w[h], dot(q + h * p.Di, k, p.Di, p.order), p.bf16_scores);
  return common::index_score_final(s, p.bf16_scores);
}

}  // namespace

float topk_row(const float* score, int64_t n, int k, int32_t* ids, int32_t* scratch) {
  const float inf = std::numeric_limits<float>::infinity();
  if (k <= 0) return inf;
  for (int64_t i = 0; i < n; ++i) scratch[i] = int32_t(i);
  const RanksBefore before{score};
  float margin = inf;
  if (n > k) {
    // scratch[k] becomes the best unchosen candidate; scratch[0..k) the chosen set.
    std::nth_element(scratch, scratch + k, scratch + n, before);
    int32_t worst = scratch[0];
    for (int j = 1; j < k; ++j)
      if (before(worst, scratch[j])) worst = scratch[j];
    margin = score[worst] - score[scratch[k]];
  }
  std::copy(scratch, scratch + k, ids);
  std::sort(ids, ids + k);
  return margin;
}

const char* indexer_check(const IndexerParams& p) {
  if (p.T < 0) return "T";
  if (p.Hi < 1) return "Hi";
  if (p.Di < 1) return "Di";
  if (p.G < 0) return "G";
  if (p.k < 0 || p.k > p.G) return "k";
  if (p.ratio < 1) return "ratio";
  if (p.pos0 < 0) return "pos0";
  if (p.T == 0) return nullptr;
  if (p.qi == nullptr) return "qi";
  if (p.G > 0 && p.ki == nullptr) return "ki";
  if (p.wt == nullptr) return "wt";
  if (p.k > 0 && p.ids == nullptr) return "ids";
  return nullptr;
}

// Query rows in chunks: the chunk's q rows [rows * Hi, Di] times the visible keys [n, Di] is one GEMM
// (dsv4::gemm computes every element as dot(q[t, h], k[g], Di, order), the same value index_score
// uses, in a cache-blocked, multithreaded kernel), then each row runs the fma chain over heads in
// increasing h and its top-k. The chunking only decides which rows share a GEMM, never a value.
// Memory: one D buffer of at most kDotFloats floats plus a score row and scratch per thread.
void indexer_topk(const IndexerParams& p) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  if (const char* why = cpu_order_check(p.order)) throw Error(std::string("indexer_topk: ") + why);
  if (p.T <= 0) return;
  constexpr int64_t kDotFloats = int64_t(4) << 20;  // 16 MiB of dot products per chunk
  const int64_t nmax = common::row_candidates(p, p.T - 1);
  const int64_t tc = std::clamp<int64_t>(kDotFloats / (int64_t(p.Hi) * std::max<int64_t>(nmax, 1)), 1, 256);
  std::vector<float> dots;
  for (int64_t t0 = 0; t0 < p.T; t0 += tc) {
    const int64_t t1 = std::min(p.T, t0 + tc), rows = t1 - t0;
    const int64_t n = common::row_candidates(p, t1 - 1);  // the most keys a row of the chunk sees
    if (n > 0) {
      dots.resize(size_t(rows * p.Hi * n));
      // x row (t - t0) * Hi + h is qi[t, h, :]; w row g is ki[g, :].
      gemm(linear_params(rows * p.Hi, n, p.Di, p.qi + t0 * p.Hi * p.Di, p.ki, dots.data(), OutRound::f32,
                         p.order));
    }
#pragma omp parallel if (rows * n * p.Hi >= kParallelWork)
    {
      std::vector<float> row(static_cast<size_t>(n));
      std::vector<int32_t> scratch(static_cast<size_t>(n));
#pragma omp for schedule(static)
      for (int64_t t = t0; t < t1; ++t) {
        const int64_t nt = common::row_candidates(p, t);
        const float* d = dots.data() + (t - t0) * p.Hi * n;  // d[h * n + g] = dot(q[t, h], k[g])
        const float* w = p.wt + t * p.Hi;
        for (int64_t g = 0; g < nt; ++g) {
          float sc = 0.0f;
          for (int h = 0; h < p.Hi; ++h) sc = common::index_score_step(sc, w[h], d[h * n + g], p.bf16_scores);
          row[size_t(g)] = common::index_score_final(sc, p.bf16_scores);
        }
        const int kk = int(std::min<int64_t>(p.k, nt));
        int32_t* ids = p.ids + t * p.k;
        const float m = topk_row(row.data(), nt, kk, ids, scratch.data());
        for (int j = kk; j < p.k; ++j) ids[j] = -1;
        if (p.margin) p.margin[t] = m;
        if (p.score) {
          float* s = p.score + t * p.k;
          for (int j = 0; j < p.k; ++j) s[j] = ids[j] >= 0 ? row[size_t(ids[j])] : nan;
        }
      }
    }
  }
}

void indexer_score_ids(const IndexerParams& p, const int32_t* ids, float* score) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  if (const char* why = cpu_order_check(p.order)) throw Error(std::string("indexer_score_ids: ") + why);
#pragma omp parallel for schedule(static) if (p.T * p.k * p.Hi * p.Di >= kParallelWork)
  for (int64_t t = 0; t < p.T; ++t) {
    for (int j = 0; j < p.k; ++j) {
      const int32_t g = ids[t * p.k + j];
      score[t * p.k + j] = (g >= 0 && g < p.G) ? index_score(p, t, g) : nan;
    }
  }
}

int64_t index_window_width(const IndexBuildParams& p) {
  return std::min<int64_t>(p.pos0 + p.T, p.W);
}

int64_t index_width(const IndexBuildParams& p) {
  int64_t w = index_window_width(p);
  switch (p.kind) {
    case CompressedKind::none:
      break;
    case CompressedKind::c128:
      w += (p.pos0 + p.T) / p.ratio;
      break;
    case CompressedKind::c4:
      w += p.k;
      break;
  }
  return w;
}

void build_index(const IndexBuildParams& p) {
  const int64_t kw = index_window_width(p);
  const int64_t width = index_width(p);
#pragma omp parallel for schedule(static) if (p.T * width >= kParallelWork)
  for (int64_t t = 0; t < p.T; ++t) {
    int32_t* row = p.idx + t * width;
    for (int64_t m = 0; m < width; ++m) row[m] = common::index_entry(p, kw, t, m);
  }
}

}  // namespace dsv4
