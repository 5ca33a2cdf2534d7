// The fixed summation tree of per-sample gradients (docs/TRAINING.md "Determinism"): gradients are
// computed per sample and combined in a tree that depends only on the sample index, so the result is
// the same for any micro-batch size, thread count or packing.
//
// The tree is the binary counter: sample i enters as a leaf of level 0; whenever two partial sums of
// the same level exist, the older (lower indices) and the newer are added elementwise as
// older + newer into one sum of the next level. finish() adds the remaining partial sums from the
// newest (highest indices, lowest level) to the oldest: acc = newer; acc = older + acc. For n a power
// of two this is the perfect pairwise tree. Memory: at most log2(n) + 1 partial sums.
#pragma once

#include <cstdint>
#include <vector>

#include "train/optimizer.h"

namespace dsv4::train {

class GradTree {
 public:
  // Samples must be added in index order 0, 1, 2, ...; every set must have the same names and sizes
  // (a mismatch throws Error naming the tensor).
  void add(TensorSet sample_grads);
  int64_t count() const { return n_; }
  // The sum of all added sets (empty when none); the tree is empty afterwards.
  TensorSet finish();

 private:
  struct Partial {
    int level;
    TensorSet sum;
  };
  std::vector<Partial> stack_;
  int64_t n_ = 0;
};

}  // namespace dsv4::train
