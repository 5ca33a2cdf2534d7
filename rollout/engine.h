// The rollout engine: requests decoded token by token from paged caches (rollout/kv_cache.h), many
// at once, with a continuous-batching scheduler and the counter-based sampler (rollout/sampler.h).
//
// Determinism: every request's chunk runs the same graph (model/forward.h forward_chunk) on its own
// rows, one request after another, and a draw depends only on (seed, request id, position, logits),
// so a request's tokens, log-probs, decisions and tensors do not depend on what else is in the batch,
// on the batch size, the token budget, the prefill chunk size, the page size, the pages it gets or
// prefix sharing — only the order of the Observer's reports between requests does.
#pragma once

#include <array>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "model/device.h"
#include "model/observer.h"
#include "model/profile.h"
#include "model/weights.h"
#include "rollout/sampler.h"

namespace dsv4::rollout {

struct EngineOptions {
  NumericsProfile profile = profile_rollout();
  Device device = Device::cpu;
  int threads = 0;             // 0: OpenMP default
  int max_batch = 64;          // running requests at most
  int page_size = 64;          // rows per cache page
  int prefill_chunk = 0;       // prompt tokens per chunk at most (0: the whole prompt at once)
  int64_t token_budget = 0;    // tokens per step over all requests (0: no limit); decodes go first
  bool prefix_sharing = true;  // requests whose prompt starts with an earlier request's whole prompt
                               // fork its cache instead of prefilling that part again
  // Run the last generated token through the model too (its rows are reported; nothing is sampled
  // from them): the recorded generation then covers every position of prompt + response, as the
  // trainer's prefill of the sample does (routing replay needs the decisions of every position).
  bool feed_last_token = false;
  Observer* observer = nullptr;  // TensorRecord::seq etc. = the request's index in submission order
};

// The sampler's request id: XXH3-64 of the request's id string, so a request draws the same tokens
// whatever its place in the input.
uint64_t request_key(const std::string& id);

struct Request {
  std::string id;
  std::vector<int32_t> prompt;
  int max_new_tokens = 64;
  std::vector<int32_t> stop_ids;  // generation ends after emitting one of these
  SamplingParams sampling;
};

enum class FinishReason { length, stop };
const char* to_string(FinishReason r);

struct Generation {
  std::string id;
  int index = 0;  // submission order; the Observer's seq
  std::vector<int32_t> prompt;
  std::vector<int32_t> tokens;                    // generated
  std::vector<float> logprobs;                    // per generated token (rollout/sampler.h says which)
  std::vector<std::array<uint32_t, 4>> counters;  // Philox counter of each draw
  FinishReason finish = FinishReason::length;
  // Prefix sharing: positions [0, shared_prefix) were computed by request `prefix_source`
  // (-1: none) and reported under its index.
  int prefix_source = -1;
  int64_t shared_prefix = 0;
  int64_t peak_cache_bytes = 0;  // the request's cache pages and compressor state, at their largest
};

// One scheduler step, for progress reports and for the trace: which request ran which positions.
struct StepChunk {
  int request = 0;
  int64_t pos0 = 0, n = 0;  // positions [pos0, pos0 + n)
  bool sampled = false;     // a token was drawn from the chunk's last row
};
struct StepInfo {
  int64_t step = 0;
  std::vector<StepChunk> chunks;
  int finished = 0, total = 0;  // requests done so far / submitted
  int64_t generated = 0;        // tokens generated so far
  double seconds = 0;           // since run() started
};

class Engine {
 public:
  Engine(const Weights& w, EngineOptions opt);
  ~Engine();
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  // Validates and queues a request (InputError naming the request and field: empty prompt, ids
  // outside the vocabulary, prompt + max_new_tokens beyond max_position_embeddings, bad sampling).
  int submit(Request r);
  // Runs until every submitted request has finished; `progress` is called after every step.
  std::vector<Generation> run(const std::function<void(const StepInfo&)>& progress = {});
  // Bytes of cache pages in use right now (all pools).
  int64_t cache_bytes() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace dsv4::rollout
