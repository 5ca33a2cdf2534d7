// Generations in traces (traces/FORMAT.md, "Generation steps"): a rollout engine's run recorded as one
// step of kind "generate" whose sequences are the requests' samples, prompt + response (the recorder
// has the engine feed the last generated token too, so every position has its rows), laid out exactly
// like a prefill of those tokens, plus per request the sampling record and per step the engine's
// settings and schedule.
//
// GenerationCollector is the Observer of the engine's run: it files every reported row under its
// request and absolute position and later emits each request's reports as one whole sequence, the
// way a prefill of the same tokens reports them (the indexer rows widened to that prefill's width
// with empty slots, the rows a request took from the prompt it forked taken from that request, the
// `logprobs` of the computed tokens assembled from the logits rows of the prompt and the sampled
// tokens' log-probs). By the decode ≡ prefill property every digest equals that of a prefill.
#pragma once

#include <array>
#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <string_view>
#include <tuple>
#include <vector>

#include "capture/policy.h"
#include "model/config.h"
#include "model/observer.h"

namespace dsv4 {

// One request of a recorded generation.
struct GenerationRequestRecord {
  std::string id;
  uint64_t request_key = 0;  // the sampler's request id (XXH3-64 of `id`)
  int64_t prompt_length = 0;
  int max_new_tokens = 0;
  std::vector<int32_t> stop_ids;
  float temperature = 1.0f;
  int top_k = 0;
  float top_p = 1.0f;
  uint64_t sampling_seed = 0;
  std::vector<int32_t> tokens;                    // generated
  std::vector<float> logprobs;                    // per generated token
  std::vector<std::array<uint32_t, 4>> counters;  // Philox counter per draw
  std::string finish_reason;                      // "length" | "stop"
  int prefix_source = -1;                         // request whose prompt cache this one forked, or -1
  int64_t shared_prefix = 0;
};

// One chunk the engine ran: request `request` at positions [pos0, pos0 + length) in scheduler step
// `step`; `sampled` when a token was drawn from its last row (length 0: drawn from a forked prompt's
// logits without running anything).
struct GenerationChunk {
  int32_t step = 0, request = 0;
  int64_t pos0 = 0, length = 0;
  uint8_t sampled = 0;
};

struct GenerationRecord {
  int max_batch = 0, page_size = 0, prefill_chunk = 0;
  int64_t token_budget = 0;
  bool prefix_sharing = true;
  std::string decode_attention = "exact";
  std::vector<GenerationRequestRecord> requests;  // in submission order: request i is seq i
  std::vector<GenerationChunk> schedule;          // in execution order
};

class GenerationCollector final : public Observer {
 public:
  // `keep_values(name, layer)`: tensors whose values must be kept for emission (the capture policy's
  // stored tensors; everything for a replay, which shows a divergent row's values).
  GenerationCollector(const ModelConfig& c, std::function<bool(std::string_view, int)> keep_values);

  // Before the run: request i's prompt and the temperature its log-probs are taken at.
  void add_request(std::vector<int32_t> prompt, float temperature);
  // After the run: request i forked the prompt cache of `source` (positions [0, shared)).
  void set_prefix(int request, int source, int64_t shared);

  void on_tensor(const TensorRecord& t) override;
  void on_indexer(const IndexerDecision& d) override;
  void on_routing(const RoutingDecision& d) override;
  void on_mhc(const MhcDecision& d) override;
  // Its reports may come late (Observer::deferrable): with a device backend each chunk of the engine then
  // waits once for its reports' copies instead of once per report. The values it reads come down with
  // them (wants_values): the kept tensors, the indexer scores (widened at emission) and the model's
  // logits (the prompt's log-probs); of every other tensor only the row digests.
  bool deferrable() const override { return true; }
  bool wants_values(std::string_view name, int layer) const override;

  // Reports request `request` as sequence `seq` of T computed tokens to `out`, as a prefill of them
  // would: every named tensor (rows [0, T) or the groups of T), the `logprobs` [T-1] (the prompt's
  // from its logits rows, then `sampled_logprobs`), and every decision. Throws Error when a row is
  // missing (a bug: the engine must have computed every position once).
  void report_request(int request, int64_t T, int seq, const std::vector<float>& sampled_logprobs,
                      Observer& out) const;
  // The `logprobs` [T-1] of request `request` as T computed tokens: the prompt's (rows 0 .. P-2),
  // then the sampled tokens' from row P-1 on.
  std::vector<float> sequence_logprobs(int request, int64_t T,
                                       const std::vector<float>& sampled_logprobs) const;
  // log_softmax(logits[p] / temperature)[prompt[p + 1]] for p < prompt length - 1 (the request's
  // temperature), from the logits rows the request or the request whose prompt it forked reported.
  std::vector<float> prompt_logprobs(int request) const;

 private:
  struct Rows {  // one tensor of one request: digests and (optionally) values per absolute row
    DType dtype = DType::f32;
    int64_t elems = 0;
    std::vector<uint64_t> digests;
    std::vector<uint8_t> have;
    std::vector<float> values;  // [rows, elems] when kept (int32 bit patterns for i32)
  };
  struct DecisionRows {
    int k = 0;
    bool hashed = false;
    std::vector<std::vector<int32_t>> ids;  // per row: valid ids
    std::vector<std::vector<float>> weights, extra;
    std::vector<float> margin;
    std::vector<uint8_t> have;
  };
  struct Request {
    std::vector<int32_t> prompt;
    float temperature = 1.0f;
    int source = -1;
    int64_t shared = 0;
    std::vector<std::pair<int, std::string>> order;  // tensors in the order first reported
    std::map<std::pair<int, std::string>, Rows> tensors;
    std::map<std::pair<int, std::string>, DecisionRows> decisions;  // "indexer", "routing", "mhc.attn", ...
    std::vector<float> prompt_lp;                                   // [P-1] at this request's temperature
    std::vector<uint8_t> prompt_lp_have;
    std::vector<int> borrowers;  // later requests whose prompt starts with this one's
  };
  Request& req(int seq);
  // The request holding row `row` of `key` for request `r` (itself or the one it forked), or -1.
  int holder(int r, const std::pair<int, std::string>& key, int64_t row, bool decision) const;

  const ModelConfig& c_;
  std::function<bool(std::string_view, int)> keep_;
  std::vector<Request> reqs_;
};

// The generation datasets of a step (written by TraceWriter::end_step when set; read by the reader).
namespace h5 {
struct Object;
}
void write_generation(const h5::Object& step_group, const std::vector<std::string>& seq_groups,
                      const GenerationRecord& g);
// Reads them back; throws TraceError naming the dataset when they are missing or malformed.
GenerationRecord read_generation(const h5::Object& step_group, const std::vector<std::string>& seq_groups,
                                 const std::string& where);

}  // namespace dsv4
