// The training data of `dsv4 train-step --data FILE` (docs/TRAINING.md "Data"): JSONL, one sample per
// line.
//
//   {"id": "s0", "prompt": [1, 2, 3], "response": [4, 5], "rollout_logprobs": [-1.2, -0.3],
//    "reward": 1.0, "group": "q0"}
//
// Fields:
//   prompt, response    required, non-empty arrays of token ids in [0, vocab_size)
//   id                  string or integer; default the 0-based sample index as text; unique
//   rollout_logprobs    optional, [len(response)] finite numbers: the engine's log-probs of the
//                       response tokens (TIS and the mismatch metrics need them)
//   old_logprobs        optional, [len(response)]: behaviour log-probs; default: the trainer's own
//                       forward (detached), so the ratio of a single step is exactly 1
//   ref_logprobs        optional, [len(response)]: reference-model log-probs (the KL penalty needs them)
//   advantage           number; or
//   reward (+ group)    number, group string (default: all samples one group): advantages are then
//                       group-relative (train/loss.h group_advantages). A file uses one or the other.
// The output of `dsv4 generate --out` reads as it is (with a reward or advantage added): its "logprobs"
// are taken as rollout_logprobs and its fields index, finish_reason, sampling and prefix are ignored.
// Blank lines are skipped; unknown fields, ill-typed values, wrong lengths, non-finite numbers, token
// ids outside the vocabulary, a prompt + response longer than max_position_embeddings and mixing
// advantage and reward all throw InputError naming the file, the line and the field.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "model/config.h"

namespace dsv4::train {

struct TrainSample {
  std::string id;
  std::vector<int32_t> prompt, response;
  std::vector<float> rollout_logprobs, old_logprobs, ref_logprobs;  // empty when absent
  std::optional<double> advantage, reward;
  std::string group;
  int line = 0;  // 1-based line in the file (0: not from a file)

  // prompt + response
  std::vector<int32_t> tokens() const;
};

std::vector<TrainSample> read_samples_jsonl(const std::string& path, const ModelConfig& c);

// The samples of a recorded rollout: step `step` of the trace at `trace_path`, with the rewards (or
// advantages) of the JSONL file at `rewards_path`, one line per sample of the step:
//
//   {"id": "r0", "reward": 1.0, "group": "q0"}     or     {"seq": 0, "advantage": -0.5}
//
//   id | seq         which sample: a generation's request id, or the 0-based sequence index
//   reward (+ group) | advantage    as in the JSONL data above (one or the other for the whole file)
//   prompt_length    steps of `dsv4 record` only (a prefill does not know where the response
//                    starts): the prompt's length, 1 <= prompt_length < the sequence's length
// A step of `dsv4 generate --record` gives each request's prompt, generated tokens and their sampled
// log-probs (as rollout_logprobs); the default group of a reward is the set of requests with the
// same prompt (GRPO's group). A step of `dsv4 record` gives each sequence's tokens split at
// prompt_length, and its recorded log-probs of the response tokens as rollout_logprobs. Samples come
// in sequence order. Every sample needs exactly one line; unknown ids or sequences, duplicates,
// missing samples, an incomplete step and tokens outside the model's vocabulary throw InputError
// naming the file, the line or the sample.
std::vector<TrainSample> read_samples_trace(const std::string& trace_path, int step, const std::string& rewards_path,
                                            const ModelConfig& c);

// Whether the file at `path` is an HDF5 file (a trace) rather than text: its signature, at 0 or after
// a user block.
bool is_hdf5_file(const std::string& path);
// One sample as a JSON line (the writer of the format above; used by tests and `dsv4 generate`).
std::string sample_to_json(const TrainSample& s);

}  // namespace dsv4::train
