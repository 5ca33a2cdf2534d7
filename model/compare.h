// Comparing the decisions of two runs of the same tokens (e.g. the train and rollout profiles):
// how many positions chose a different indexer set or a different expert set, per layer.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "model/collect.h"

namespace dsv4 {

struct LayerDecisionDiff {
  int layer = 0;
  std::string kind;            // "indexer" or "routing"
  bool hashed = false;         // routing of a hash layer (must never differ)
  int64_t rows = 0;            // positions compared
  int64_t rows_differing = 0;  // positions whose set differs
  int64_t ids_differing = 0;   // ids in A's sets that are not in B's (summed over positions)
};

// Compares sequence `seq` of two logs. Both must hold the same layers with the same shapes; a
// mismatch throws InputError naming the layer.
std::vector<LayerDecisionDiff> compare_decisions(const DecisionLog& a, const DecisionLog& b, int seq);

}  // namespace dsv4
