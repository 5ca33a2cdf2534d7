// Recording a training step into a trace (traces/FORMAT.md "Training steps"): the step's forward
// through the trace writer's observer, the activation gradients' row digests, and the training record
// (capture/training.h) built from the step's result. `dsv4 train-step --record` and the tests record
// through record_train_step; replay (replay/training.cpp) rebuilds the same record and compares.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "capture/training.h"
#include "train/step.h"

namespace dsv4::train {

// Row digests of a named fp32 tensor of `w`'s shape (capture/training.h ParamDigests layout).
std::vector<uint64_t> tensor_row_digests(const std::vector<float>& v, int64_t rows);
int64_t tensor_rows(const WeightTensor& t);

// What a step produced, as the trace records it: every weight's digests (gradient, updated compute
// weights, master and moments for the trained ones), the metrics, and the full tensors whose names
// match one of the comma-separated glob patterns of `capture_params` ("" = none).
TrainingRecord make_training_record(const Weights& before, const Weights& after, const OptimizerState& state,
                                    const TrainStepResult& res, const std::vector<TrainSample>& samples,
                                    const TrainStepOptions& o, const std::string& capture_params);

// Collects the activation gradients' row digests, sample by sample in execution order.
class ActGradCollector {
 public:
  void operator()(const GradRecord& g);
  std::vector<ActGradDigests> take() { return std::move(out_); }

 private:
  std::vector<ActGradDigests> out_;
};

struct RecordTrainOptions {
  std::string capture = "decisions";  // the forward's capture policy (capture/policy.h)
  std::string capture_params;         // glob patterns of parameter names stored in full
  uint64_t seed = 0;                  // the model seed the step records (preset weights)
  bool append = false;
  std::string optimizer_state_path;   // the state the step started from ("" = fresh)
};

// Runs the step with a trace writer attached and writes trace `out`. Returns the step's result.
TrainStepResult record_train_step(const Weights& w, const std::vector<TrainSample>& samples, OptimizerState& state,
                                  const TrainStepOptions& o, const TrainStepHooks& hooks, Weights* updated,
                                  const std::string& out, const RecordTrainOptions& ro);

// Digest of an optimizer state (0 for a fresh one: step 0 with all moments zero is not written).
uint64_t optimizer_state_digest(const OptimizerState& s);

}  // namespace dsv4::train
