// libFuzzer harness: numerics profile text through parse_profile (docs/PROFILES.md: the format, every
// site's values, the errors), then the canonical round trip, which must give the same text.
// Seeds: the built-in profiles as shipped.
#include <cstdint>
#include <cstdlib>
#include <string>

#include "model/error.h"
#include "model/profile.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  try {
    const dsv4::NumericsProfile p = dsv4::parse_profile(text, "fuzz");
    const std::string canonical = dsv4::profile_text(p);
    if (dsv4::profile_text(dsv4::parse_profile(canonical, "fuzz round trip")) != canonical) std::abort();
    dsv4::profile_diff(p, dsv4::profile_train());
  } catch (const dsv4::InputError&) {
  }
  return 0;
}
