// libFuzzer harness: a trace file through validate_trace (which also reads every complete step with
// TraceReader, as the commands do) and through TraceReader directly. Seeds: traces/samples/*.h5.
#include <cstdint>
#include <string>

#include "capture/h5.h"
#include "capture/trace_reader.h"
#include "capture/validate.h"
#include "fuzz_input.h"
#include "kernels/error.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string& path = dsv4::fuzz::input_file(data, size, ".h5");
  const dsv4::ValidateReport rep = dsv4::validate_trace(path);  // never throws
  if (rep.ok() && rep.steps.empty() && rep.readable) return 0;
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
