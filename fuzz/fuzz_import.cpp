// libFuzzer harness: another engine's R3 data through `dsv4 import`'s readers, against the tiny preset —
// an input starting like a zip archive as a miles .npz sample, anything else as an SGLang JSON/JSONL
// dump; the bytes also go to the .npy parser directly. Every sequence that passes the checks is handed
// to an ExternalTraceWriter's checks too (its own validation of ids, rows and widths). Seeds: an SGLang
// export and a miles export of a small trace, written by fuzz_seeds.
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <span>
#include <string>

#include "adapters/convert.h"
#include "adapters/npy.h"
#include "capture/external.h"
#include "fuzz_input.h"
#include "kernels/error.h"
#include "model/config.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const dsv4::ModelConfig tiny = dsv4::preset("tiny");
  const bool zip = size >= 4 && std::memcmp(data, "PK\x03\x04", 4) == 0;
  const std::string& path = dsv4::fuzz::input_file(data, size, zip ? ".npz" : ".jsonl");
  std::vector<dsv4::ExternalSequence> accepted;
  const dsv4::SequenceSink keep = [&](dsv4::ExternalSequence&& s) {
    if (accepted.size() < 4) accepted.push_back(std::move(s));
  };
  try {
    if (zip)
      dsv4::import_miles({path}, tiny, nullptr, keep);
    else
      dsv4::import_sglang({path}, tiny, nullptr, keep);
  } catch (const dsv4::Error&) {
  }
  try {
    dsv4::npy_parse(std::span<const uint8_t>(data, size), "fuzz input");
  } catch (const dsv4::Error&) {
  }
  if (!accepted.empty()) {
    // What the importer accepted, the writer accepts too (one rule for both); a refusal is a finding.
    const std::string out = path + ".h5";
    std::remove(out.c_str());
    std::remove((out + ".incomplete").c_str());
    dsv4::ExternalModel m;
    m.config_json = dsv4::config_to_json(tiny);
    auto w = dsv4::ExternalTraceWriter::create(out, m);
    dsv4::ExternalStepSpec spec;
    spec.engine = "fuzz";
    w->begin_step(spec);
    for (const auto& s : accepted) w->add_sequence(s);
    w->end_step();
    w->close();
    std::remove(out.c_str());
  }
  return 0;
}
