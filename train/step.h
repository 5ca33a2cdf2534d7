// One training step on a batch of samples (docs/TRAINING.md): per sample the forward (with the
// forced decisions of routing/indexer replay when given), the policy loss's gradient of its response
// log-probs, the backward; the per-sample gradients summed in the fixed tree of train/grad_tree.h;
// global-norm clipping and AdamW on the fp32 master weights; the updated compute weights.
//
// Bit-reproducibility: every sample is computed alone with the same code path, the per-sample
// gradients meet only in the sample-index tree, and the loss gradient of a token depends only on that
// token and the batch's token count; so the result is the same for any micro-batch size, thread count
// or order in which the work is scheduled, and the same on the CPU and CUDA backends.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "model/backward.h"
#include "model/forward.h"
#include "model/observer.h"
#include "model/overrides.h"
#include "model/weights.h"
#include "train/loss.h"
#include "train/optimizer.h"
#include "train/params.h"
#include "train/samples.h"

namespace dsv4::train {

struct TrainStepOptions {
  // Numerics profile of the forward and backward. The settings JSON stores its name; a replay takes
  // the profile itself from the step's recorded text (capture/trace_reader.h recorded_profile).
  NumericsProfile profile = profile_train();
  Device device = Device::cpu;
  int threads = 0;
  float temperature = 1.0f;  // log-probs of logits / temperature (MODEL.md §3.10)
  PolicyLossConfig loss;
  AdamWConfig adamw;
  TrainGroups groups = TrainGroups::miles_default();
  bool train_mixer = true;  // mHC backward: full (true) or the legacy constant mixer
  bool group_scale_by_std = true;  // group-relative advantages divided by the group's std
  int micro_batch = 1;             // samples per micro-batch (results do not depend on it)
  std::string decisions_source;    // the rollout trace R3 decisions come from ("" = none)
  std::string decisions_kinds;     // which were forced: "indexer", "routing" or "indexer,routing"
  std::string decisions_model_digest;
  // The indexer's KL objective (MODEL.md §5.5, docs/TRAINING.md "Indexer KL"): off at 0. The loss is
  // coefficient * (sum over C4 layers and query rows of KL(target ‖ predict)) / (the batch's token
  // rows); it trains the indexer group only, and is reported as the metric indexer_kl (without the
  // coefficient) even when the indexer is frozen.
  double indexer_kl_coeff = 0;
  std::string indexer_kl_target = "l1";  // "l1": renormalised over the selected groups; "heads_sum"
  // Expert parallelism (docs/PARALLEL.md): the routed experts' forward and backward shared out among
  // the communicator's ranks, every rank running every sample; every rank ends with the single-device
  // gradients and update. Not part of to_json: the result does not depend on it.
  Communicator* experts = nullptr;

  // The settings as a JSON document (the trace's record of them) and back; from_json throws
  // InputError naming the field.
  std::string to_json() const;
  static TrainStepOptions from_json(const std::string& json);
};

// What the step may report while it runs.
struct TrainStepHooks {
  const Overrides* decisions = nullptr;  // forced decisions keyed by (sample index, layer)
  Observer* observer = nullptr;          // the forward's reports (a trace writer)
  std::function<void(const GradRecord&)> on_grad;      // activation gradients, per sample in order
  std::function<void(int64_t done, int64_t total)> progress;  // samples done
};

struct TrainStepResult {
  LossMetrics metrics;
  StepStats stats;
  std::vector<double> advantages;               // per sample
  std::vector<std::vector<float>> logprobs;     // per sample, its response tokens
  std::vector<std::vector<float>> seq_logprobs; // per sample, all T-1 log-probs (the forward's)
  TensorSet grads;                              // summed over samples, before clipping
  double indexer_kl = 0;                        // the indexer's KL objective without its coefficient
  double seconds_forward = 0, seconds_backward = 0, seconds_optimizer = 0;
  int64_t tape_bytes_max = 0;                   // the largest sample's kept activations
};

// Checks the indexer KL settings of `o` (coefficient, target, and that the indexer group is trained
// only with the objective on); throws InputError naming the option.
void check_indexer_kl(const TrainStepOptions& o);

// A fresh optimizer state for `w`: master = the weights' values, zero moments, step 0, for the
// weights of the trained groups.
OptimizerState fresh_optimizer_state(const Weights& w, const TrainGroups& g);

// Checks that `state` holds exactly the trained weights of `w` with matching sizes and that
// bf16/fp32 rounding of its master weights gives `w`'s values (a state from another checkpoint is
// refused); throws InputError naming the tensor.
void check_optimizer_state(const OptimizerState& state, const Weights& w, const TrainGroups& g,
                           const std::string& what);

// The step. `state` is updated in place; the returned weights are the updated compute weights.
// Throws InputError for bad samples or options (naming them), OverrideError for bad forced decisions.
TrainStepResult train_step(const Weights& w, const std::vector<TrainSample>& samples, OptimizerState& state,
                           const TrainStepOptions& o, const TrainStepHooks& hooks, Weights* updated);

}  // namespace dsv4::train
