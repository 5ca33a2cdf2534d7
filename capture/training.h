// Training steps in traces (traces/FORMAT.md, "Training steps"): a step of kind "train-step" whose
// sequences are the samples (prompt + response) with the forward laid out exactly like a prefill of
// those tokens (digests, decisions, log-probs), plus the training record below under
// /steps/NNNNNN/training: what the step was given (its settings, the samples' loss inputs, the
// optimizer state it started from) and what it produced (loss and metrics, a digest per row of every
// parameter gradient, of every updated weight and of the optimizer state, the global gradient norm,
// the activation gradients' row digests in backward execution order, and full gradients / weights
// selected by capture patterns).
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "capture/h5.h"

namespace dsv4 {

// Row digests of one named fp32 tensor viewed as [rows, row_elems]: a tensor of shape [a, b, ...] has
// a rows, a 1-D tensor is a single row. XXH3-64 of each row's fp32 bytes (capture/digest.h).
struct ParamDigests {
  std::string name;
  int64_t rows = 0, row_elems = 0;
  std::vector<uint64_t> grad;    // [rows] the summed gradient, before clipping (empty: not trained)
  std::vector<uint64_t> weight;  // [rows] the updated compute weights (as the next step reads them)
  std::vector<uint64_t> master;  // [rows] fp32 master weights after the step
  std::vector<uint64_t> m, v;    // [rows] AdamW moments after the step
};

// One activation gradient of one sample, in backward execution order.
struct ActGradDigests {
  int seq = 0;
  int layer = -1;
  std::string name;  // "grad.attn.o", ... (model/backward.h GradRecord)
  int64_t rows = 0, cols = 0;
  std::vector<uint64_t> digests;  // [rows]
};

// Per sample: the inputs of the loss for its response tokens (all [response length]; empty when absent).
struct SampleLossInputs {
  std::string id;
  int64_t prompt_length = 0;
  double advantage = 0;
  double reward = 0;
  bool has_reward = false;
  std::string group;
  std::vector<float> rollout_logprobs, old_logprobs, ref_logprobs;
};

struct TrainingRecord {
  // The step's settings as one JSON document (train/step.h TrainStepOptions::to_json: loss, AdamW,
  // trained groups, mHC mode, micro-batch, temperature, the decisions source and its model digest).
  // Replay parses it back; the trace format does not interpret it.
  std::string settings_json;
  int64_t optimizer_step_before = 0;      // AdamW steps taken before this one
  std::string optimizer_state_path;       // the state file the step started from ("" = fresh)
  uint64_t optimizer_state_digest = 0;    // digest of that state (0 = fresh)
  std::vector<SampleLossInputs> samples;  // [n_seqs]
  std::map<std::string, double> metrics;  // "loss", "pg_loss", "kl", "clip_fraction", "grad_norm", ...
  std::vector<ParamDigests> params;       // every weight of the model, in name order
  std::vector<ActGradDigests> act_grads;  // every sample's, sample by sample, each in execution order
  std::map<std::string, std::vector<float>> full_grads;    // selected by the capture policy
  std::map<std::string, std::vector<float>> full_weights;  // updated compute weights, selected likewise
};

// Why `t` cannot be the training record of a step whose sequences have `seq_lengths` tokens, naming
// the dataset it would be stored in ("training/samples/old_logprobs: sample 1 has 7 values, its response
// 9 tokens (empty when absent)"); "" when it can. A sample per sequence with 0 <= prompt_length <= its
// length, each loss input empty or as long as the response; parameter names unique, usable as HDF5
// names (not empty, not ".", no '/'), each digest list empty or [rows]; activation gradients of
// sequences of the step, layer >= -1, [rows] digests; full tensors of listed parameters, rows *
// row_elems values. write_training refuses such a record (Error), read_training reports it
// (TraceCorrupt).
std::string training_record_problem(const TrainingRecord& t, const std::vector<int64_t>& seq_lengths);

// /steps/NNNNNN/training of an open step group. `where` names the file and step in messages. read_training
// throws TraceCorrupt (capture/errors.h) naming the dataset for anything missing or mis-sized.
void write_training(const h5::Object& step_group, const TrainingRecord& t);
TrainingRecord read_training(const h5::Object& step_group, const std::string& where);
bool has_training(const h5::Object& step_group);

}  // namespace dsv4
