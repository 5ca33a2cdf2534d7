// Recording a rollout engine's generation as a trace step (kind "generate", traces/FORMAT.md) and the
// pieces its replay shares: running the engine with a GenerationCollector and turning its run into a
// GenerationRecord.
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "capture/generation.h"
#include "capture/trace_writer.h"
#include "rollout/engine.h"

namespace dsv4 {

// The engine's run with every report collected.
struct CollectedGeneration {
  std::vector<rollout::Generation> gens;
  std::unique_ptr<GenerationCollector> collector;
  GenerationRecord record;
  std::vector<std::vector<int32_t>> computed;  // per request: prompt + response (every token fed)
  std::vector<std::vector<float>>
      logprobs;  // per request: [computed - 1], as a prefill of `computed` reports them
  double seconds = 0;
};

// Runs `requests` through a new engine with `opt` (opt.observer is replaced by the collector), keeping
// the values of the tensors `keep_values` names. `progress` sees every scheduler step.
CollectedGeneration run_collected(const Weights& w, const std::vector<rollout::Request>& requests,
                                  rollout::EngineOptions opt,
                                  std::function<bool(std::string_view, int)> keep_values,
                                  const std::function<void(const rollout::StepInfo&)>& progress = {});

struct GenerateRecordOptions {
  std::string capture = "decisions";  // capture policy (capture/policy.h)
  uint64_t seed = 0;                  // the model seed the step records (preset weights)
  bool append = false;
};

// Runs the generation and records it into the trace `out` as one step. Returns the run.
CollectedGeneration record_generation(const Weights& w, const std::vector<rollout::Request>& requests,
                                      const rollout::EngineOptions& opt, const std::string& out,
                                      const GenerateRecordOptions& ro,
                                      const std::function<void(const rollout::StepInfo&)>& progress = {});

// The requests of a recorded generation step (prompts from the recorded tokens) and its engine options.
std::vector<rollout::Request> recorded_requests(const GenerationRecord& g,
                                                const std::vector<std::vector<int32_t>>& seq_tokens);
rollout::EngineOptions recorded_engine_options(const GenerationRecord& g, const NumericsProfile& profile);

// Where position `pos` of request `request` was computed: "prefill chunk [a, b) of scheduler step s" or
// "decode step k (scheduler step s)"; empty when the schedule does not hold it.
std::string schedule_context(const GenerationRecord& g, int request, int64_t pos);

}  // namespace dsv4
