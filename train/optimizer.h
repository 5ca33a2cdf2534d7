// AdamW with fp32 master weights and moments, global-norm gradient clipping, and the optimizer state
// file that lets steps chain (docs/TRAINING.md "Optimizer").
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace dsv4::train {

// A set of named fp32 tensors (gradients, master weights, moments). std::map: iteration in name
// order is the one documented order of every sum over tensors.
using TensorSet = std::map<std::string, std::vector<float>>;

struct AdamWConfig {
  double lr = 1e-5;
  double beta1 = 0.9, beta2 = 0.98, eps = 1e-8;
  double weight_decay = 0.1;  // decoupled; applied to tensors of 2 or more dims only
  double clip_grad = 1.0;     // global-norm clipping threshold; 0 disables it
};
// Throws InputError naming the field (lr < 0, betas outside [0, 1), eps <= 0, weight_decay < 0,
// clip_grad < 0, non-finite values).
void check(const AdamWConfig& c);

// sqrt(sum over tensors in name order of sum over elements in index order of g^2), accumulated in fp64
// (each square formed in fp64 from the fp32 value) and returned as fp64.
double global_norm(const TensorSet& grads);

struct OptimizerState {
  int64_t step = 0;  // steps taken so far
  TensorSet master, m, v;
  // The number of dims of each tensor (weight decay only for >= 2), recorded with the state.
  std::map<std::string, int> ndim;

  // safetensors file: "master.<name>", "m.<name>", "v.<name>" F32 tensors, metadata {"format":
  // "dsv4-optimizer", "version": "1", "step": N}. load() throws InputError naming the file and the
  // tensor for a missing, extra or mis-shaped tensor, a wrong format or a newer version.
  void save(const std::string& path) const;
  static OptimizerState load(const std::string& path);
};

struct StepStats {
  double grad_norm = 0;    // before clipping
  double clip_coef = 1;    // min(1, clip_grad / (grad_norm + 1e-6)) as applied
  double update_norm = 0;  // global norm of (new master - old master), fp64
};

// One AdamW step over the tensors of `grads` (every one must exist in `state` with the same size; a
// missing one throws). In fp32 per element, in this order:
//   g = grad * clip_coef                     (clip_coef rounded to fp32 once)
//   m = beta1 * m + (1 - beta1) * g
//   v = beta2 * v + (1 - beta2) * g * g
//   mhat = m / (1 - beta1^step); vhat = v / (1 - beta2^step)   (bias corrections in fp64, then fp32)
//   p = p - lr * wd * p        (decoupled decay, tensors with ndim >= 2)
//   p = p - lr * mhat / (sqrt(vhat) + eps)
// with explicit operations (no contraction); step is incremented first. Elementwise, so the result
// does not depend on the thread count.
StepStats adamw_step(const AdamWConfig& c, const TensorSet& grads, OptimizerState& state);

}  // namespace dsv4::train
