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
// One sample as a JSON line (the writer of the format above; used by tests and `dsv4 generate`).
std::string sample_to_json(const TrainSample& s);

}  // namespace dsv4::train
