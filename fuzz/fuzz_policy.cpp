// libFuzzer harness: capture-policy text through CapturePolicy::parse, then against the tiny preset
// (check_matches, wants_tensor on every tensor of its manifest). Seeds: policies in scripts/fuzz.sh.
#include <cstdint>
#include <string>

#include "capture/policy.h"
#include "kernels/error.h"
#include "model/config.h"
#include "model/manifest.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const dsv4::ModelConfig tiny = dsv4::preset("tiny");
  static const std::vector<dsv4::TensorSpecT> manifest = dsv4::tensor_manifest(tiny, 16);
  const std::string text(reinterpret_cast<const char*>(data), size);
  try {
    const dsv4::CapturePolicy p = dsv4::CapturePolicy::parse(text);
    for (const auto& m : manifest) p.wants_tensor(m.name, m.layer);
    p.check_matches(tiny);
  } catch (const dsv4::Error&) {
  }
  return 0;
}
