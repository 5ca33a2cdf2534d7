// Recording one step: the forward of a batch with its trace writer, the GPU kernel recorder and the
// step's bookkeeping (kind from the profile, kernel records or the reason there are none). The
// `dsv4 record` command, the Python package and later commands all record through record_step.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "capture/trace_writer.h"
#include "model/communicator.h"
#include "model/device.h"
#include "model/observer.h"
#include "model/weights.h"

namespace dsv4 {

struct RecordOptions {
  std::string profile = "train";  // numerics profile name
  Numerics numerics = Numerics::exact;  // the profile in these numerics (model/profile.h with_numerics)
  std::string kind;  // "train" | "rollout"; empty: "rollout" for the rollout profile, else "train"
  std::string capture = "decisions";  // capture policy (capture/policy.h)
  uint64_t seed = 0;                  // the model seed the step records
  int threads = 0;
  Device device = Device::cpu;
  bool append = false;                           // add the step to an existing complete trace
  Observer* also = nullptr;                      // sees the step too (e.g. progress), after the writer
  std::function<void(const std::string&)> note;  // remarks worth telling the user (no kernel records)
  // Fault injection for crash tests: "kill-mid-step" kills the process with SIGKILL halfway through
  // the layers of the step; "kill-after-step" right after the step was flushed, before the clean
  // close. Empty: none.
  std::string fault;
  // Expert parallelism (model/expert_parallel.h): the communicator the forward shares the experts
  // over. Only the rank that records calls record_step (every rank holds the same result); the others
  // run the same forward without a trace. The layout goes into the trace's env as "parallel".
  Communicator* experts = nullptr;
  // With `experts`: the ranks split the sequences (RunOptions::split_sequences). Set by
  // record_split_step for each rank's own trace; the env then says so and names the rank.
  bool split_sequences = false;
};

struct RecordResult {
  int step = 0;  // index of the step written
  int64_t tokens = 0;
  double seconds = 0;
  std::string path;     // the trace, renamed to its final name
  std::string capture;  // the policy as text
  WriterStats stats;
};

// Records `batch` as one step into the trace `out` (created, or appended to with opt.append).
// Throws InputError for a bad profile, device or capture policy; the writer's errors otherwise.
RecordResult record_step(const Weights& w, const std::vector<std::vector<int32_t>>& batch,
                         const std::string& out, const RecordOptions& opt);

// Records `batch` as one step with the sequences split among the ranks of opt.experts (every rank calls
// it with the whole batch): rank r runs and records its sequences (model/communicator.h
// sequence_range) into its own trace, part_trace_path(out, r) (capture/joined.h); once every rank's step
// is complete, rank 0 adds the step to the joined trace `out`, whose sequences link to the ranks'. A
// rank that holds no sequence records a step of none. With opt.append every rank appends to its trace
// and rank 0 to the joined one. Returns this rank's result; rank 0's `path` is the joined trace.
RecordResult record_split_step(const Weights& w, const std::vector<std::vector<int32_t>>& batch,
                               const std::string& out, const RecordOptions& opt);

}  // namespace dsv4
