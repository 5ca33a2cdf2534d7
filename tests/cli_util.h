// Running the dsv4 binary from tests.
#pragma once

#include <sys/wait.h>
#include <unistd.h>

#include <array>
#include <cstdio>
#include <string>

#include "paths.h"

namespace dsv4::test {

struct CliResult {
  int code = -1;    // exit code; 128 + signal when killed
  std::string out;  // stdout and stderr together
};

inline CliResult run_cli(const std::string& args, const std::string& env = "") {
  const std::string cmd = env + (env.empty() ? "" : " ") + std::string(DSV4_CLI_PATH) + " " + args + " 2>&1";
  CliResult r;
  FILE* p = popen(cmd.c_str(), "r");
  if (!p) return r;
  std::array<char, 4096> buf;
  size_t n;
  while ((n = fread(buf.data(), 1, buf.size(), p)) > 0) r.out.append(buf.data(), n);
  const int status = pclose(p);
  if (WIFEXITED(status)) {
    r.code = WEXITSTATUS(status);
    // sh reports a child killed by signal s as exit code 128 + s.
  } else if (WIFSIGNALED(status)) {
    r.code = 128 + WTERMSIG(status);
  }
  return r;
}

}  // namespace dsv4::test

namespace dsv4::test {

// A shell command line, output captured.
inline CliResult run_shell(const std::string& cmd) {
  CliResult r;
  FILE* p = popen((cmd + " 2>&1").c_str(), "r");
  if (!p) return r;
  std::array<char, 4096> buf;
  size_t n;
  while ((n = fread(buf.data(), 1, buf.size(), p)) > 0) r.out.append(buf.data(), n);
  const int status = pclose(p);
  r.code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  return r;
}

// A script that takes the dsv4 binary as its first argument.
inline CliResult run_cli_script(const std::string& script, const std::string& args) {
  return run_shell(script + " " + std::string(DSV4_CLI_PATH) + " " + args);
}

}  // namespace dsv4::test
