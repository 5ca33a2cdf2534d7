// The host-side error vocabulary. Messages name the thing (file, tensor, field, layer, token) and say
// what was expected and what was found. Library code throws; only cli/ decides exit codes.
#pragma once

#include <stdexcept>
#include <string>

namespace dsv4 {

struct Error : std::runtime_error {
  using std::runtime_error::runtime_error;
};
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
