// libFuzzer harness: a .safetensors file through SafetensorsReader (header, offsets, every tensor
// converted). Seeds: the tiny preset's model.safetensors and small files written by scripts/fuzz.sh.
#include <cstdint>
#include <string>

#include "fuzz_input.h"
#include "kernels/error.h"
#include "model/safetensors.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string& path = dsv4::fuzz::input_file(data, size, ".safetensors");
  try {
    const dsv4::SafetensorsReader r = dsv4::SafetensorsReader::open(path);
    r.metadata();
    for (const std::string& name : r.names()) {
      const dsv4::StTensorInfo& t = r.info(name);
      if (t.dtype == dsv4::StDType::I32 || t.dtype == dsv4::StDType::I64)
        r.read_i32(name);
      else
        r.read_f32(name);
    }
  } catch (const dsv4::Error&) {
  }
  return 0;
}
