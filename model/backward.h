// The backward of one sequence (MODEL.md §5): from the forward's Tape (model/tape.h) and the
// gradient of the loss with respect to the sequence's log-probabilities, the gradients of the
// trainable weights. Written once against backend::Backend like the forward; the op order, the order
// of every accumulation and what is kept or recomputed are in docs/TRAINING.md.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "model/device.h"
#include "model/forward.h"
#include "model/tape.h"
#include "model/weights.h"

namespace dsv4 {

// A gradient of an activation, reported in backward execution order (the first divergent one in a
// replay names the backward op that produced it), [rows, cols] fp32. On the CPU `data` points at the
// values; on a device backend the row digests are computed where the tensor lives (`row_digests`,
// XXH3-64 of each row's fp32 bytes) and the values cross to the host only when values() is called.
struct GradRecord {
  int seq = 0;
  int layer = -1;    // -1: model level
  std::string name;  // e.g. "grad.ffn.hc_post" (traces/FORMAT.md "Training steps")
  int64_t rows = 0, cols = 0;
  const float* data = nullptr;             // host values, or nullptr (see values())
  const uint64_t* row_digests = nullptr;   // [rows], or nullptr: hash the values
  std::function<const float*()> fetch;     // downloads the values (device backends)
  const float* values() const { return data ? data : (fetch ? fetch() : nullptr); }
};

// The lightning indexer's KL objective (MODEL.md §5.5; docs/TRAINING.md "Indexer KL"): per C4 layer
// and query row, KL(target ‖ predict) over the row's selected groups, predict the softmax of their
// index scores, target the main attention's probability mass on them. Its gradient reaches only the
// indexer's weights (the indexer's inputs and the target are detached); the policy loss's gradients
// are unchanged by it. Needs a tape made with Tape::keep_indexer.
struct IndexerKlOptions {
  bool enabled = false;
  bool l1_target = true;   // target renormalised over the selected groups (else the heads-summed mass)
  float row_weight = 0.0f;  // the weight of each row's KL in the loss: coefficient / divisor
};

struct BackwardOptions {
  // Whether the weight `name` receives a gradient. Activation gradients flow through frozen weights
  // regardless (e.g. into the MoE input through a frozen router gate).
  std::function<bool(const std::string& name)> trainable;
  bool train_mixer = true;  // mHC: full backward (true) or the legacy constant mixer (MODEL.md §5.2 (b))
  // Called for every activation gradient in execution order (may be empty).
  std::function<void(const GradRecord&)> on_grad;
  IndexerKlOptions indexer_kl;
  // Called per C4 layer with the sum of its rows' KL (fp64, in row order; without row_weight).
  std::function<void(int layer, double kl_sum)> on_indexer_kl;
};

// name -> fp32 gradient (same element count as the weight), for the trainable weights only.
using GradSet = std::map<std::string, std::vector<float>>;

// dlogprobs: [T-1], d loss / d logprobs[t] where logprobs[t] = log_softmax(logits[t] / temperature)
// [tokens[t+1]] (zeros for positions outside the loss). `be` must be the backend the tape was made
// on; opt gives the profile (its reduction order) and the temperature used by the forward.
GradSet backward(backend::Backend& be, const Weights& w, const Tape& tape, int seq,
                 const std::vector<float>& dlogprobs, const RunOptions& opt, const BackwardOptions& bo);

}  // namespace dsv4
