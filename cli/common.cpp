#include <fmt/core.h>

#include <functional>
#include <stdexcept>

#include "cli/commands.h"

#ifndef DSV4_VERSION
#define DSV4_VERSION "0.1.0"
#endif

namespace dsv4::cli {

namespace {
std::function<int()>& action() {
  static std::function<int()> a;
  return a;
}
}  // namespace

std::string version_string() { return fmt::format("dsv4 {}", DSV4_VERSION); }

void set_action(std::function<int()> a) { action() = std::move(a); }

int run_selected() {
  if (!action()) throw std::logic_error("no command selected");
  return action()();
}

}  // namespace dsv4::cli
