// dsv4: the command-line front end. Argument parsing and printing only; the work is in the libraries.
#include <fmt/core.h>
#include <CLI/CLI.hpp>

#include <cstdio>
#include <exception>
#include <string>

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
  // In a parallel run an error ends every rank (the others may be waiting in a collective).
  auto fail = [](const char* what, int code) {
    if (dsv4::Communicator* c = dsv4::cli::active_communicator(); c && c->size() > 1)
      c->abort(std::string("error: ") + what, code);
    fmt::print(stderr, "dsv4: error: {}\n", what);
    return code;
  };
  try {
    return dsv4::cli::run_selected();
  } catch (const dsv4::InputError& e) {
    return fail(e.what(), 2);
  } catch (const std::exception& e) {
    return fail(e.what(), 1);
  }
}
