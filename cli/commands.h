#pragma once

#include <CLI/CLI.hpp>

#include <functional>
#include <string>

namespace dsv4::cli {

std::string version_string();
void register_model_commands(CLI::App& app);
void register_forward_commands(CLI::App& app);

// The parsed subcommand's action (set by the callback of whichever subcommand ran); returns the
// process exit code.
void set_action(std::function<int()> action);
int run_selected();

}  // namespace dsv4::cli
