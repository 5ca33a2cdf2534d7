// libFuzzer harness: config.json text through config_from_json (parsing, validation and the hard
// limits), then what commands compute from an accepted config. Seeds: the presets' config.json.
#include <cstdint>
#include <string>

#include "kernels/error.h"
#include "model/config.h"
#include "model/manifest.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  try {
    const dsv4::ModelConfig c = dsv4::config_from_json(text, "fuzz");
    dsv4::total_params(c);
    dsv4::decision_bytes_per_token(c);
    dsv4::tensor_names(c);
    dsv4::config_from_json(dsv4::config_to_json(c), "fuzz round trip");
  } catch (const dsv4::Error&) {
  }
  return 0;
}
