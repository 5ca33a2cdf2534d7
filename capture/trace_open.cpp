#include "capture/trace_open.h"

#include <hdf5.h>

#include <algorithm>

#include "capture/errors.h"
#include "capture/layout.h"
#include "capture/trace_reader.h"

namespace dsv4 {

using namespace trace_layout;  // the format's names

OpenedTrace open_for_reading(const std::string& path) {
  h5::quiet();
  std::string first_error;
  for (int attempt = 0; attempt < 3; ++attempt) {
    h5::Id fapl = h5::file_access(false, false);
    if (attempt == 2) {
      hbool_t yes = true;
      if (H5Pset(fapl.get(), "clear_status_flags", &yes) < 0) break;  // a library without the property
    }
    const unsigned flags = H5F_ACC_RDONLY | (attempt == 0 ? H5F_ACC_SWMR_READ : 0u);
    try {
      return OpenedTrace{h5::open_file(path, flags, fapl.get()), attempt == 2};
    } catch (const TraceError& e) {
      if (first_error.empty()) first_error = e.what();
    }
  }
  throw TraceError(first_error);
}

void classify_with_reader(const std::string& path) {
  try {
    TraceReader::open(path);
  } catch (const NotATrace&) {
    throw;
  } catch (const UnsupportedTraceVersion&) {
    throw;
  } catch (const std::exception&) {
  }
}

std::optional<int> step_status(const h5::Object& step) {
  try {
    if (!h5::exists(step, kStatus)) return std::nullopt;
    const auto v = h5::read<uint8_t>(h5::open(step, kStatus));
    if (v.size() != 1) return std::nullopt;
    return int(v[0]);
  } catch (const std::exception&) {
    return std::nullopt;
  }
}

bool is_step_name(const std::string& name) {
  return name.size() == 6 &&
         std::all_of(name.begin(), name.end(), [](char c) { return c >= '0' && c <= '9'; });
}

}  // namespace dsv4
