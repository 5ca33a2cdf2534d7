// Shared helpers of the GUI tests: the trace pair they read (recorded once per build tree with the
// dsv4 binary), bad files, and waiting on the event loop.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "gui/models/dataset.h"

namespace dsv4::test {

// A comparison dataset made up in the test, for TraceDocument::adopt: the tiny preset (with `layers`
// layers of compress ratio 4 when layers > 0), complete steps, one sequence of `tokens` tokens with
// flat log-probs; no chunks (the caller adds them).
gui::Dataset synthetic_pair(int64_t tokens, int layers = 0);

// A train-profile trace (A) and a rollout-profile trace (B) of the tiny preset over the same tokens
// (one sequence), capturing attn.o at layer 1, moe.out at layer 3 and the logits in full: the
// repository's sample pair (traces/samples, scripts/make-samples.sh) when present, else a pair
// recorded once into the build tree.
struct TracePair {
  std::string a, b;
  int64_t tokens = 0;
};
const TracePair& gui_traces();

// Two training steps (dsv4 train-step --record) of the tiny preset over the same two samples (one of
// 80 tokens, so that the indexer selects), every parameter's gradient in full (--capture-params '*'):
// A as is, B with the decisions of a rollout-profile recording of the samples forced (R3); `rollout`
// is that recording (a non-training step of the same tokens). Recorded once per build tree.
struct TrainingPair {
  std::string a, b, rollout;
};
const TrainingPair& gui_training_traces();

// A fresh directory for one test (removed by the caller when it wants).
std::string temp_dir(const std::string& name);
std::string write_not_a_trace(const std::string& dir);                        // a text file named x.h5
std::string write_truncated(const std::string& src, const std::string& dir);  // the first half
std::string write_with_version(const std::string& src, const std::string& dir, int version);

// Processes events until pred() holds or timeout_ms passes; returns pred().
bool wait_until(const std::function<bool()>& pred, int timeout_ms = 60000);

}  // namespace dsv4::test
