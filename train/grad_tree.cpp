// The binary-counter summation tree of per-sample gradients (train/grad_tree.h).
#include "train/grad_tree.h"

#include <fmt/format.h>

#include <utility>

#include "model/error.h"

namespace dsv4::train {

namespace {

constexpr int64_t kParallelMin = int64_t(1) << 15;

// older[i] = older[i] + newer[i] for every tensor (same names and sizes, checked on add).
// Elementwise, so the result does not depend on the thread count.
void add_into(TensorSet& older, const TensorSet& newer) {
  for (auto& [name, a] : older) {
    float* x = a.data();
    const float* y = newer.at(name).data();
    const int64_t n = int64_t(a.size());
#pragma omp parallel for schedule(static) if (n >= kParallelMin)
    for (int64_t i = 0; i < n; ++i) x[i] = x[i] + y[i];
  }
}

// newer[i] = older[i] + newer[i] (finish(): the accumulator is the right operand).
void add_from_left(const TensorSet& older, TensorSet& newer) {
  for (auto& [name, a] : newer) {
    float* x = a.data();
    const float* y = older.at(name).data();
    const int64_t n = int64_t(a.size());
#pragma omp parallel for schedule(static) if (n >= kParallelMin)
    for (int64_t i = 0; i < n; ++i) x[i] = y[i] + x[i];
  }
}

}  // namespace

void GradTree::add(TensorSet sample_grads) {
  if (!stack_.empty()) {
    // Every partial sum has the names and sizes of sample 0.
    const TensorSet& ref = stack_.front().sum;
    for (const auto& [name, g] : sample_grads) {
      const auto it = ref.find(name);
      if (it == ref.end())
        throw Error(fmt::format("gradient tree: sample {}: tensor '{}' is not in sample 0", n_, name));
      if (it->second.size() != g.size())
        throw Error(fmt::format("gradient tree: sample {}: tensor '{}' has {} values, sample 0 had {}", n_,
                                name, g.size(), it->second.size()));
    }
    for (const auto& [name, g] : ref)
      if (!sample_grads.count(name))
        throw Error(
            fmt::format("gradient tree: sample {}: tensor '{}' is missing (sample 0 has it)", n_, name));
  }
  stack_.push_back({0, std::move(sample_grads)});
  ++n_;
  // Carry: two partial sums of the same level become one of the next level (older + newer).
  while (stack_.size() >= 2 && stack_[stack_.size() - 2].level == stack_.back().level) {
    Partial newer = std::move(stack_.back());
    stack_.pop_back();
    Partial& older = stack_.back();
    add_into(older.sum, newer.sum);
    ++older.level;
  }
}

TensorSet GradTree::finish() {
  if (stack_.empty()) {
    n_ = 0;
    return {};
  }
  TensorSet acc = std::move(stack_.back().sum);
  for (size_t k = stack_.size() - 1; k-- > 0;) add_from_left(stack_[k].sum, acc);
  stack_.clear();
  n_ = 0;
  return acc;
}

}  // namespace dsv4::train
