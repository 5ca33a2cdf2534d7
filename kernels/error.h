// The root of the host-side error vocabulary, below every library so that kernels/ can throw it
// too. Messages name the thing (file, tensor, field, layer, token) and say what was expected and
// what was found. Library code throws; only cli/ decides exit codes. model/error.h adds the input
// errors.
#pragma once

#include <stdexcept>

namespace dsv4 {

struct Error : std::runtime_error {
  using std::runtime_error::runtime_error;
};

}  // namespace dsv4
