// Salvaging the intact steps of a damaged trace, or of one whose recorder died.
#pragma once

#include <string>
#include <vector>

namespace dsv4 {

struct SalvageResult {
  std::vector<int> copied;  // source step indices, in order (renumbered 0, 1, ... in the copy)
  struct Skipped {
    int step = 0;
    std::string reason;  // the first problem validate found in it ("incomplete (status 0)", a damaged dataset)
  };
  std::vector<Skipped> skipped;
  // The source did not match its seal (capture/trace_seal.h): the copied steps passed every check of
  // validate, but damage those checks cannot see (a value still within its range) may remain in them;
  // `dsv4 replay` of the copy re-executes and compares them.
  std::string seal_problem;
};

// Copies /meta and every step that validate_trace (capture/validate.h) finds complete and without a
// problem from `in` into a new trace `out` (steps renumbered from 0); the other steps are skipped and
// named. The copy is checked with validate_trace before it gets its name, so salvage never produces a
// file validate rejects. Throws NotATrace / UnsupportedTraceVersion as the reader does, TraceError
// when the file or its /meta cannot be used or no step is intact, InputError when `out` exists.
SalvageResult salvage_trace(const std::string& in, const std::string& out);

}  // namespace dsv4
