#include "model/compare.h"

#include <fmt/format.h>

#include <algorithm>

#include "model/error.h"

namespace dsv4 {

namespace {

// Rows are canonical (ascending, -1 last), so set difference is a merge.
int64_t missing_from(const int32_t* a, const int32_t* b, int k) {
  int64_t n = 0;
  int j = 0;
  for (int i = 0; i < k && a[i] != -1; ++i) {
    while (j < k && b[j] != -1 && b[j] < a[i]) ++j;
    if (j >= k || b[j] == -1 || b[j] != a[i]) ++n;
  }
  return n;
}

template <typename Rec>
LayerDecisionDiff diff_rows(int layer, const char* kind, const Rec& a, const Rec& b) {
  if (a.T != b.T || a.k != b.k)
    throw InputError(fmt::format("{} decisions of layer {} have different shapes: [{}, {}] vs [{}, {}]", kind,
                                 layer, a.T, a.k, b.T, b.k));
  LayerDecisionDiff d;
  d.layer = layer;
  d.kind = kind;
  d.rows = a.T;
  for (int64_t t = 0; t < a.T; ++t) {
    const int32_t* ra = a.ids.data() + t * a.k;
    const int32_t* rb = b.ids.data() + t * b.k;
    if (!std::equal(ra, ra + a.k, rb)) {
      ++d.rows_differing;
      d.ids_differing += missing_from(ra, rb, a.k);
    }
  }
  return d;
}

}  // namespace

std::vector<LayerDecisionDiff> compare_decisions(const DecisionLog& a, const DecisionLog& b, int seq) {
  std::vector<LayerDecisionDiff> out;
  for (const auto& [key, ra] : a.indexer) {
    if (key.first != seq) continue;
    auto it = b.indexer.find(key);
    if (it == b.indexer.end())
      throw InputError(fmt::format("layer {}: indexer decisions only in the first run", key.second));
    out.push_back(diff_rows(key.second, "indexer", ra, it->second));
  }
  for (const auto& [key, ra] : a.routing) {
    if (key.first != seq) continue;
    auto it = b.routing.find(key);
    if (it == b.routing.end())
      throw InputError(fmt::format("layer {}: routing decisions only in the first run", key.second));
    LayerDecisionDiff d = diff_rows(key.second, "routing", ra, it->second);
    d.hashed = ra.hashed;
    out.push_back(d);
  }
  std::stable_sort(out.begin(), out.end(), [](const auto& x, const auto& y) { return x.layer < y.layer; });
  return out;
}

}  // namespace dsv4
