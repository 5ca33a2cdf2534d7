// Small traces of the tiny preset (seed 7) written for the fuzz harnesses and their seeds: a prefill
// step of `dsv4 record` (one sequence of n tokens, with a capture policy) and a generation step of
// `dsv4 generate --record` (two requests of one prompt, 3 new tokens each). Small on purpose: an
// execution reads the whole file, and mutations of a small file reach its structure more often.
#pragma once

#include <string>
#include <vector>

#include "capture/trace_writer.h"
#include "model/checkpoint.h"
#include "model/config.h"
#include "model/forward.h"
#include "replay/generation.h"
#include "rollout/engine.h"

namespace dsv4::fuzz {

inline const Weights& tiny_weights() {
  static const Weights w = open_preset("tiny", 7);
  return w;
}

inline void write_prefill_trace(const std::string& path, const std::string& policy = "decisions",
                                int n_tokens = 6) {
  const Weights& w = tiny_weights();
  TraceWriter::Options opt;
  opt.policy = CapturePolicy::parse(policy);
  auto wr = TraceWriter::create(path, w.config(), make_trace_header(w), opt);
  StepSpec spec;
  spec.seqs = {{5, 17, 2, 99, 4, 31}};
  for (int i = 6; i < n_tokens; ++i) spec.seqs[0].push_back(int32_t((i * 37) % 100));
  RunOptions ro;
  ro.observer = &wr->begin_step(spec);
  wr->end_step(forward(w, spec.seqs, ro));
  wr->close();
}

inline void write_generation_trace(const std::string& path) {
  std::vector<rollout::Request> requests(2);
  for (int i = 0; i < 2; ++i) {
    requests[size_t(i)].id = i == 0 ? "a" : "b";
    requests[size_t(i)].prompt = {1, 2, 3, 4};
    requests[size_t(i)].max_new_tokens = 3;
    requests[size_t(i)].sampling.seed = uint64_t(i + 1);
  }
  GenerateRecordOptions ro;
  ro.seed = 7;
  record_generation(tiny_weights(), requests, rollout::EngineOptions{}, path, ro);
}

}  // namespace dsv4::fuzz
