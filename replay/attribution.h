// Where the rollout-vs-training mismatch comes from (`dsv4 diff --attribute`). For a generation step
// (the rollout: decoded from caches, profile P) and a prefill step of the same samples (the trainer,
// profile Q), the difference is split into a chain of stages, each a change of one thing, by running
// the model on the same tokens in between:
//   1. decode vs prefill  — the generation against a prefill of its samples in P (the engine's decode
//      path and its cache reads; zero bits in exact mode, the split-KV reduction shows here);
//   2. FP8 cache          — the prefill in P against the prefill in P with the FP8 sites of the KV and
//      indexer caches off (fp8_kv, fp8_indexer);
//   3. the rest of the profile — that prefill against the training step (Q: reduction blocking, ...).
// Log-prob differences telescope: the per-token signed mean of the stages adds up to the total.
// Decisions are compared as sets per position (model/decision_sets.h).
#pragma once

#include <string>
#include <vector>

namespace dsv4 {

struct AttributionStage {
  std::string name;      // "decode vs prefill", "FP8 cache", "rest of the profile", "total"
  std::string from, to;  // what is compared: "generation (rollout)", "prefill (rollout)", ...
  int64_t tokens = 0;
  double logprob_mean = 0;      // mean of logprob_to - logprob_from (signed: stages add up)
  double logprob_abs_mean = 0;  // mean |.|
  double logprob_abs_max = 0;
  int64_t indexer_rows = 0, indexer_rows_differing = 0;  // (position, C4 layer) rows, sets compared
  int64_t routing_rows = 0, routing_rows_differing = 0;  // (position, learned layer) rows
};

struct Attribution {
  std::vector<AttributionStage> stages;  // the three stages, then the total
};

// `rollout` must hold a generation step, `train` a prefill step of the same tokens (the diff's rule);
// weights come from the rollout trace (or `model_dir`). Throws InputError otherwise.
Attribution attribute_mismatch(const std::string& rollout, int rollout_step, const std::string& train,
                               int train_step, const std::string& model_dir = "");
std::string attribution_to_table(const Attribution& a);

}  // namespace dsv4
