// An Observer that keeps every decision of a run (and optionally chosen tensors) in memory: used by
// the CLI's forward output, by tests, and to turn one run's decisions into Overrides for another.
#pragma once

#include <map>
#include <string>
#include <utility>
#include <vector>

#include "model/observer.h"
#include "model/overrides.h"

namespace dsv4 {

struct IndexerRecord {
  int64_t T = 0;
  int k = 0;
  std::vector<int32_t> ids;
  std::vector<float> margin;
};
struct RoutingRecord {
  int64_t T = 0;
  int k = 0;
  bool hashed = false;
  std::vector<int32_t> ids;
  std::vector<float> weights, margin;
};
struct MhcRecord {
  int64_t T = 0;
  int hc = 0;
  std::vector<float> pre, post, comb;
};
struct TensorCopy {
  DType dtype;
  std::vector<int64_t> shape;
  std::vector<float> f;
  std::vector<int32_t> i;
};

class DecisionLog : public Observer {
 public:
  // keep_tensors: also copy every tensor (large; for tests on tiny models).
  explicit DecisionLog(bool keep_tensors = false) : keep_tensors_(keep_tensors) {}

  void on_tensor(const TensorRecord& t) override;
  void on_indexer(const IndexerDecision& d) override;
  void on_routing(const RoutingDecision& d) override;
  void on_mhc(const MhcDecision& d) override;
  bool wants_tensors() const override { return keep_tensors_; }

  using Key = std::pair<int, int>;  // (seq, layer)
  std::map<Key, IndexerRecord> indexer;
  std::map<Key, RoutingRecord> routing;
  std::map<std::pair<Key, Sublayer>, MhcRecord> mhc;
  std::map<std::pair<Key, std::string>, TensorCopy> tensors;  // ((seq, layer), name)
  std::vector<std::pair<Key, std::string>> tensor_order;      // execution order

  // Overrides that force these decisions: indexer for every recorded C4 layer, experts for every
  // learned (not hash) layer.
  Overrides to_overrides() const;

 private:
  bool keep_tensors_;
};

}  // namespace dsv4
