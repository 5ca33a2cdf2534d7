// Shared by the libFuzzer harnesses: the input as a file (the readers under test take paths), and the
// rule of every harness: a reader may refuse an input only with the project's error vocabulary
// (dsv4::Error and its subclasses); any other exception, a crash, a leak, undefined behaviour or a
// stall is a finding.
#pragma once

#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <string>

namespace dsv4::fuzz {

// Writes the input to a file of this process (same path every call) and returns its path: in
// /dev/shm (memory) where it is writable, else /tmp.
inline const std::string& input_file(const uint8_t* data, size_t size, const char* suffix) {
  static const std::string path = std::string(access("/dev/shm", W_OK) == 0 ? "/dev/shm" : "/tmp") +
                                  "/dsv4-fuzz-" + std::to_string(getpid()) + suffix;
  std::FILE* f = std::fopen(path.c_str(), "wb");
  if (!f) __builtin_trap();
  if (size && std::fwrite(data, 1, size, f) != size) __builtin_trap();
  std::fclose(f);
  return path;
}

}  // namespace dsv4::fuzz
