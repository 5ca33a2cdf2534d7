// Typed errors of the trace side. All are InputError (the CLI exits with 2) and name the file.
#pragma once

#include "model/error.h"

namespace dsv4 {

struct TraceError : InputError {  // a trace that cannot be read as one (corrupt, truncated, bad layout)
  using InputError::InputError;
};
struct TraceCorrupt : TraceError {  // a trace's group or dataset missing, mistyped or mis-sized
  using TraceError::TraceError;
};
struct NotATrace : TraceError {  // an HDF5 file (or other file) that is not a dsv4 trace
  using TraceError::TraceError;
};
struct UnsupportedTraceVersion : TraceError {  // format_version newer than this reader
  using TraceError::TraceError;
};
struct TraceIncomplete : TraceError {  // a step (or the file) that was not finished
  using TraceError::TraceError;
};

}  // namespace dsv4
