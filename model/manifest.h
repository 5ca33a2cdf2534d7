// The named tensors the forward reports for one sequence, in execution order, with their shapes.
// The list is a function of the config and the sequence length only; capture uses it to lay out a
// step's datasets before the step runs, validate uses it to find missing records, and a test checks
// that the forward reports exactly this list.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "model/config.h"
#include "model/observer.h"

namespace dsv4 {

struct TensorSpecT {
  int layer = -1;
  std::string name;
  DType dtype = DType::bf16;
  std::vector<int64_t> shape;
  int64_t rows() const { return shape.empty() ? 1 : shape[0]; }
  int64_t row_elems() const;
};

std::vector<TensorSpecT> tensor_manifest(const ModelConfig& c, int64_t T);
// All names that can occur, in first-appearance order (the trace's /meta/tensor_names).
std::vector<std::string> tensor_names(const ModelConfig& c);

}  // namespace dsv4
