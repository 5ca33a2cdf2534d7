// libFuzzer harness: a JSONL file through the batch file reader of `record --batch` and the prompts
// reader of `generate`, against the tiny preset. Seeds: small files written by fuzz_seeds. (The
// samples readers of `train-step` have their own harness, fuzz_samples.)
#include <cstdint>
#include <string>

#include "fuzz_input.h"
#include "kernels/error.h"
#include "model/config.h"
#include "model/tokens.h"
#include "rollout/prompts.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const dsv4::ModelConfig tiny = dsv4::preset("tiny");
  const std::string& path = dsv4::fuzz::input_file(data, size, ".jsonl");
  try {
    dsv4::parse_batch_jsonl(path);
  } catch (const dsv4::Error&) {
  }
  try {
    dsv4::rollout::read_prompts(path, tiny, dsv4::rollout::GenerateDefaults{});
  } catch (const dsv4::Error&) {
  }
  return 0;
}
