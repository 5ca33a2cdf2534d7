// Replay of a training step (traces/FORMAT.md "Training steps"): the step re-runs from the recorded
// samples, settings and starting optimizer state; the forward's digests go to the prefill verifier,
// and every activation gradient (in backward execution order), every parameter gradient, updated
// weight, master weight and AdamW moment, and the loss metrics are compared with the training record.
#pragma once

#include <string>

#include "capture/trace_reader.h"
#include "capture/training.h"
#include "model/observer.h"
#include "model/overrides.h"
#include "model/weights.h"
#include "replay/replay.h"
#include "train/step.h"

namespace dsv4 {

struct TrainingReplayPlan {
  int step = 0;
  TrainingRecord record;
  train::TrainStepOptions settings;
  bool force_indexer = false, force_routing = false;  // the step ran with forced decisions (R3)
};

// Reads what the step needs; throws InputError / TraceError naming the trace and step.
TrainingReplayPlan plan_training_replay(const TraceReader& r, int step);

// Runs the step on `opt.device` with the recorded decisions forced as the plan says (`decisions`),
// reports the forward to `forward_verifier`, and compares the rest; the first difference in execution
// order becomes sr.first when the forward has not diverged before it. `optimizer_state` overrides the
// recorded state path ("" = as recorded).
void replay_training_step(const TraceReader& r, const TrainingReplayPlan& plan, const Weights& w,
                          const ReplayOptions& opt, const Overrides& decisions, Observer& forward_verifier,
                          StepReplay& sr);

// The backward op that produces an activation gradient of model/backward.cpp (for divergence reports).
const char* backward_op_of(const std::string& grad_name);

}  // namespace dsv4
