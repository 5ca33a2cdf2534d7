// dsv4: the command-line front end. Argument parsing and printing only; the work is in the libraries.
#include <fmt/core.h>
#include <CLI/CLI.hpp>

#include <cstdio>
#include <exception>

#include "cli/commands.h"
#include "model/error.h"

int main(int argc, char** argv) {
  CLI::App app{"dsv4 — deterministic record/replay and debugging for DeepSeek-V4 models", "dsv4"};
  app.require_subcommand(1);
  app.set_version_flag("--version", dsv4::cli::version_string());
  dsv4::cli::register_model_commands(app);
  dsv4::cli::register_forward_commands(app);
  dsv4::cli::register_generate_command(app);
  dsv4::cli::register_train_command(app);
  dsv4::cli::register_trace_commands(app);
  dsv4::cli::register_replay_commands(app);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    const int rc = app.exit(e);
    return rc == 0 ? 0 : 2;
  }
  try {
    return dsv4::cli::run_selected();
  } catch (const dsv4::InputError& e) {
    fmt::print(stderr, "dsv4: error: {}\n", e.what());
    return 2;
  } catch (const std::exception& e) {
    fmt::print(stderr, "dsv4: error: {}\n", e.what());
    return 1;
  }
}
