// dsv4: the command-line front end. Argument parsing and printing only; the work is in the libraries.
#include <fmt/core.h>
#include <CLI/CLI.hpp>

#include <unistd.h>

#include <chrono>
#include <csignal>
#include <cstdio>
#include <exception>
#include <new>
#include <string>
#include <thread>

#include "capture/errors.h"
#include "capture/h5.h"
#include "capture/trace_seal.h"
#include "cli/commands.h"
#include "model/error.h"

namespace {

// A damaged file can make the HDF5 library crash or loop where it trusts metadata without a checksum
// (capture/h5.h ReadScope). Inside a read scope a crash or a stall becomes one error line naming the
// file and the object, and exit code 2; anywhere else a crash stays a crash.
constexpr int kStallSeconds = 20;  // metadata reads take milliseconds

void write_err(const char* s) {
  size_t n = 0;
  while (s[n]) ++n;
  while (n > 0) {
    const ssize_t w = ::write(2, s, n);
    if (w <= 0) return;
    s += w;
    n -= size_t(w);
  }
}

extern "C" void on_crash(int sig) {
  if (const char* scope = dsv4::h5::active_read_scope()) {
    write_err("dsv4: error: ");
    write_err(scope);
    write_err(sig == SIGABRT ? ": the HDF5 library aborted" : ": the HDF5 library crashed");
    write_err(" on damaged data in this file; `dsv4 trace validate` tells more, `dsv4 trace salvage` copies the "
              "intact steps\n");
    _exit(2);
  }
  std::signal(sig, SIG_DFL);  // not ours to explain: crash as usual
  std::raise(sig);
}

void start_watchdog() {
  std::thread([] {
    while (true) {
      std::this_thread::sleep_for(std::chrono::milliseconds(250));
      int64_t since = 0;
      const char* scope = dsv4::h5::active_read_scope(&since);
      if (!scope) continue;
      const int64_t now = std::chrono::duration_cast<std::chrono::nanoseconds>(
                              std::chrono::steady_clock::now().time_since_epoch())
                              .count();
      if (now - since > int64_t(kStallSeconds) * 1000000000) {
        fmt::print(stderr,
                   "dsv4: error: {}: no progress in {} s (damaged data makes the HDF5 library loop); `dsv4 trace "
                   "validate` tells more, `dsv4 trace salvage` copies the intact steps\n",
                   scope, kStallSeconds);
        std::fflush(stderr);
        _exit(2);
      }
    }
  }).detach();
}

}  // namespace

int main(int argc, char** argv) {
  for (int sig : {SIGSEGV, SIGBUS, SIGFPE, SIGILL, SIGABRT}) std::signal(sig, on_crash);
  start_watchdog();
  CLI::App app{"dsv4 — deterministic record/replay and debugging for DeepSeek-V4 models", "dsv4"};
  app.require_subcommand(1);
  app.set_version_flag("--version", dsv4::cli::version_string());
  // One clean line per error; --verbose adds HDF5's whole error stack to trace errors.
  bool verbose = false;
  app.add_flag("--verbose", verbose, "Errors carry the whole HDF5 error stack")->envname("DSV4_VERBOSE");
  // A sealed trace is hashed once when a command opens it (traces/FORMAT.md "Seal"); a user who
  // trusts a very large file may skip that.
  bool no_seal_check = false;
  app.add_flag("--no-seal-check", no_seal_check,
               "Read sealed traces without verifying their whole-file digest first")
      ->envname("DSV4_NO_SEAL_CHECK");
  app.fallthrough();
  dsv4::cli::register_model_commands(app);
  dsv4::cli::register_forward_commands(app);
  dsv4::cli::register_generate_command(app);
  dsv4::cli::register_train_command(app);
  dsv4::cli::register_trace_commands(app);
  dsv4::cli::register_replay_commands(app);
  dsv4::cli::register_profile_commands(app);
  dsv4::cli::register_bisect_command(app);
#ifdef DSV4_HAVE_ADAPTERS
  dsv4::cli::register_adapter_commands(app);
#else
  // Built without OpenSSL or libzip (DSV4_ADAPTERS): the commands say so instead of being unknown.
  for (const char* name : {"import", "export"}) {
    CLI::App* cmd = app.add_subcommand(name, std::string(name) + " SGLang / miles R3 data (not in this build)");
    cmd->fallthrough(false)->prefix_command();  // whatever follows is left to the message below
    cmd->callback([name] {
      dsv4::cli::set_action([name]() -> int {
        throw dsv4::InputError(fmt::format("dsv4 {}: this dsv4 was built without the engine adapters (they need "
                                           "libssl-dev and libzip-dev; configure with DSV4_ADAPTERS=ON)",
                                           name));
      });
    });
  }
#endif
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    const int rc = app.exit(e);
    return rc == 0 ? 0 : 2;
  }
  dsv4::h5::set_verbose_errors(verbose);
  dsv4::set_seal_checks(!no_seal_check);
  // In a parallel run an error ends every rank (the others may be waiting in a collective).
  auto fail = [](const char* what, int code) {
    if (dsv4::Communicator* c = dsv4::cli::active_communicator(); c && c->size() > 1)
      c->abort(std::string("error: ") + what, code);
    fmt::print(stderr, "dsv4: error: {}\n", what);
    return code;
  };
  try {
    return dsv4::cli::run_selected();
  } catch (const dsv4::NotATrace& e) {
    return fail(e.what(), 2);
  } catch (const dsv4::UnsupportedTraceVersion& e) {
    return fail(e.what(), 2);
  } catch (const dsv4::TraceError& e) {
    // A damaged trace: the next step, unless the message already names one.
    const std::string msg = e.what();
    const bool damaged = dynamic_cast<const dsv4::TraceCorrupt*>(&e) || msg.find("(HDF5:") != std::string::npos;
    const std::string line =
        msg + (damaged && msg.find("dsv4 trace") == std::string::npos
                   ? "; `dsv4 trace validate` lists what is damaged, `dsv4 trace salvage` copies the intact steps"
                   : "");
    return fail(line.c_str(), 2);
  } catch (const dsv4::InputError& e) {
    return fail(e.what(), 2);
  } catch (const std::bad_alloc&) {
    return fail("not enough memory for what the inputs ask (a model, sequence, batch or file too large for this "
                "machine)",
                2);
  } catch (const std::exception& e) {
    return fail(e.what(), 1);
  }
}
