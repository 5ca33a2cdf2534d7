// The host-side error vocabulary: the root Error (kernels/error.h) and the input errors. Messages
// name the thing (file, tensor, field, layer, token) and say what was expected and what was found.
// Library code throws; only cli/ decides exit codes.
#pragma once

#include <string>

#include "kernels/error.h"

namespace dsv4 {

// Bad user input (files, configs, arguments, forced decisions): the CLI exits with 2.
struct InputError : Error {
  using Error::Error;
};
struct ConfigError : InputError {
  using InputError::InputError;
};
struct WeightsError : InputError {
  using InputError::InputError;
};
struct OverrideError : InputError {
  using InputError::InputError;
};

}  // namespace dsv4
