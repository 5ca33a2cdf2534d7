// libFuzzer harness: the training-data readers of `dsv4 train-step` (train/samples.h). An input that
// starts with the HDF5 signature is a trace, read by read_samples_trace with fixed rewards files;
// any other input is a JSONL file, read by read_samples_jsonl (samples) and, unless it names a
// "response" (which only samples have), by read_samples_trace as the rewards file of a fixed trace
// (fuzz/fuzz_traces.h, written once per process): the prefill trace when it names "prompt_length"
// (which only prefill steps take), else the generation trace. Reading a trace costs far more than
// the JSONL, hence the choice of one. Seeds: fuzz_seeds writes samples, rewards and both traces.
#include <hdf5.h>

#include <cstdint>
#include <cstring>
#include <string_view>
#include <fstream>
#include <string>
#include <unistd.h>

#include "capture/trace_seal.h"
#include "fuzz_input.h"
#include "fuzz_traces.h"
#include "kernels/error.h"
#include "train/samples.h"

namespace {

struct Fixed {
  std::string gen, prefill, gen_rewards, prefill_rewards;
};

const Fixed& fixed() {
  static const Fixed f = [] {
    const std::string base = "/tmp/dsv4-fuzz-" + std::to_string(getpid()) + "-samples-";
    Fixed x{base + "gen.h5", base + "prefill.h5", base + "gen-rewards.jsonl", base + "prefill-rewards.jsonl"};
    std::remove(x.gen.c_str());
    std::remove(x.prefill.c_str());
    dsv4::fuzz::write_generation_trace(x.gen);
    dsv4::fuzz::write_prefill_trace(x.prefill);
    std::ofstream(x.gen_rewards) << "{\"id\": \"a\", \"reward\": 1}\n{\"seq\": 1, \"reward\": 0, \"group\": \"g\"}\n";
    std::ofstream(x.prefill_rewards) << "{\"seq\": 0, \"advantage\": 0.5, \"prompt_length\": 2}\n";
    return x;
  }();
  return f;
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  H5set_free_list_limits(-1, -1, -1, -1, -1, -1);  // as in fuzz_trace.cpp
  // Mutations of the sealed seed traces reach the readers behind the seal (fuzz_trace fuzzes the seal).
  dsv4::set_seal_checks(false);
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const dsv4::ModelConfig tiny = dsv4::preset("tiny");
  const Fixed& f = fixed();
  static const char kHdf5[8] = {'\x89', 'H', 'D', 'F', '\r', '\n', '\x1a', '\n'};
  if (size >= 8 && std::memcmp(data, kHdf5, 8) == 0) {
    const std::string& path = dsv4::fuzz::input_file(data, size, ".h5");
    for (const std::string* rewards : {&f.gen_rewards, &f.prefill_rewards}) {
      try {
        dsv4::train::read_samples_trace(path, 0, *rewards, tiny);
      } catch (const dsv4::Error&) {
      }
    }
    return 0;
  }
  const std::string& path = dsv4::fuzz::input_file(data, size, ".jsonl");
  try {
    dsv4::train::read_samples_jsonl(path, tiny);
  } catch (const dsv4::Error&) {
  }
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  if (text.find("\"response\"") != std::string_view::npos) return 0;
  const bool prefill = text.find("\"prompt_length\"") != std::string_view::npos;
  try {
    dsv4::train::read_samples_trace(prefill ? f.prefill : f.gen, 0, path, tiny);
  } catch (const dsv4::Error&) {
  }
  return 0;
}
