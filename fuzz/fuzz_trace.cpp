// libFuzzer harness: a trace file through validate_trace (which also reads every complete step with
// TraceReader, as the commands do) and, for a file validate rejects, through TraceReader directly
// (the commands that read a trace without validating it first). Seeds: fuzz_seeds' small traces.
#include <hdf5.h>

#include <cstdint>
#include <string>

#include "capture/h5.h"
#include "capture/trace_reader.h"
#include "capture/trace_seal.h"
#include "capture/validate.h"
#include "fuzz_input.h"
#include "kernels/error.h"

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  // HDF5 frees its large per-file structures (the metadata cache of every open file) when a free
  // list grows past its limit; each open then maps fresh pages, which dominates an execution under
  // ASan. Without limits they are reused. Only HDF5's internal blocks are affected.
  H5set_free_list_limits(-1, -1, -1, -1, -1, -1);
  // The seeds are sealed: with the check on, every mutation would stop at the seal. The seal's own
  // parser is fuzzed on each input below; the readers behind it run as for an unsealed file.
  dsv4::set_seal_checks(false);
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string& path = dsv4::fuzz::input_file(data, size, ".h5");
  dsv4::set_seal_checks(true);
  try {
    (void)dsv4::check_seal(path);
  } catch (const dsv4::Error&) {
  }
  dsv4::set_seal_checks(false);
  const dsv4::ValidateReport rep = dsv4::validate_trace(path);  // never throws
  // A trace validate accepts has been read through every accessor of TraceReader already.
  if (rep.ok()) return 0;
  try {
    const dsv4::TraceReader r = dsv4::TraceReader::open(path);
    for (const auto& s : r.steps()) {
      if (!s.complete) continue;
      for (int q = 0; q < int(s.seq_lengths.size()); ++q) {
        r.tokens(s.index, q);
        r.digests(s.index, q);
      }
      r.kernels(s.index);
    }
  } catch (const dsv4::Error&) {
  }
  return 0;
}
