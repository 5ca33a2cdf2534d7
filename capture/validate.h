// Checking a trace against traces/FORMAT.md and the recorded model config (salvaging the whole steps
// of a trace whose recorder died: capture/salvage.h).
#pragma once

#include <string>
#include <vector>

#include "capture/trace_open.h"
#include "capture/trace_seal.h"

namespace dsv4 {

struct TraceProblem {
  std::string where;  // "/steps/000001/seq_000/decisions/layer_003/experts" or "file"
  std::string what;   // "expert id 9 at token 17 is >= n_routed_experts (8)"
  int step = -1;      // the step it belongs to (-1: the file, /meta or the step list)
};

struct StepState {
  int index = 0;
  bool complete = false;
  int problems = 0;
};

struct ValidateReport {
  std::string path;
  bool readable = false;         // false: the file could not be opened as a trace at all
  bool incomplete_file = false;  // NAME.h5.incomplete (a recorder did not close it)
  bool writer_flag = false;      // the superblock says "open for writing" (reported as a problem of "file")
  SealCheck seal;                // the file's seal (capture/trace_seal.h); not ok() is a problem of "seal"
  std::vector<TracePart> parts;  // a joined trace's parts (capture/joined.h); a part's bad seal: "seal" too
  std::vector<StepState> steps;
  std::vector<TraceProblem> problems;
  bool ok() const { return readable && problems.empty(); }
};

// Structure, dtypes, shapes and value ranges: expert ids < n_routed_experts, ascending distinct ids,
// indexer ids visible to their position and within the width, digests present for every tensor of
// the manifest and nothing else, log-probs finite and <= 0, margins >= 0 (except in training steps,
// whose decisions may have been forced), status flags; then every complete step without a problem is
// read through TraceReader as the commands read it (kernel records, generation and training records
// included), so a file validate accepts is readable by every command. Never throws for a bad trace:
// every finding is a problem in the report.
ValidateReport validate_trace(const std::string& path);

}  // namespace dsv4
