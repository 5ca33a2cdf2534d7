// The Overrides seam: forced discrete decisions per (sequence, layer) — indexer replay and routing
// replay. Hash-routed layers are never overridden: asking for it is an error, as is a forced
// decision with the wrong width, an id out of range, a duplicate id in a row, or a compressed group
// that is not yet visible to that position. Errors name the sequence, layer and token.
#pragma once

#include <cstdint>
#include <map>
#include <utility>
#include <vector>

namespace dsv4 {

struct ForcedSelection {
  int64_t T = 0;             // rows (tokens of the sequence)
  int k = 0;                 // width
  std::vector<int32_t> ids;  // [T, k]; order inside a row does not matter; -1 = empty (indexer only)
};

class Overrides {
 public:
  // Indexer (C4 layers): ids are compressed-group positions in [0, floor((p+1)/4)) or -1; width must
  // be min(index_topk, floor(T/4)).
  void force_indexer(int seq, int layer, ForcedSelection s) { indexer_[{seq, layer}] = std::move(s); }
  // Routing (learned layers): k = num_experts_per_tok distinct expert ids in [0, n_routed_experts).
  void force_experts(int seq, int layer, ForcedSelection s) { experts_[{seq, layer}] = std::move(s); }

  const ForcedSelection* indexer(int seq, int layer) const { return find(indexer_, seq, layer); }
  const ForcedSelection* experts(int seq, int layer) const { return find(experts_, seq, layer); }
  bool empty() const { return indexer_.empty() && experts_.empty(); }
  const std::map<std::pair<int, int>, ForcedSelection>& all_indexer() const { return indexer_; }
  const std::map<std::pair<int, int>, ForcedSelection>& all_experts() const { return experts_; }

 private:
  static const ForcedSelection* find(const std::map<std::pair<int, int>, ForcedSelection>& m, int seq,
                                     int layer) {
    auto it = m.find({seq, layer});
    return it == m.end() ? nullptr : &it->second;
  }
  std::map<std::pair<int, int>, ForcedSelection> indexer_, experts_;
};

}  // namespace dsv4
