#include "capture/env.h"

#include <hdf5.h>
#include <omp.h>
#include <sys/utsname.h>
#include <unistd.h>

#include <fstream>

namespace dsv4 {
namespace {

// The value of the first "key : value" line of /proc/cpuinfo whose key is `key`, or "none".
std::string cpuinfo_field(const std::string& key) {
  std::ifstream f("/proc/cpuinfo");
  std::string line;
  while (std::getline(f, line)) {
    const size_t colon = line.find(':');
    if (colon == std::string::npos) continue;
    std::string k = line.substr(0, colon);
    while (!k.empty() && (k.back() == ' ' || k.back() == '\t')) k.pop_back();
    if (k != key) continue;
    size_t b = colon + 1;
    while (b < line.size() && line[b] == ' ') ++b;
    return b < line.size() ? line.substr(b) : "none";
  }
  return "none";
}

}  // namespace

EnvFingerprint environment_fingerprint() {
  EnvFingerprint e;
  char host[256] = {};
  e["host"] = gethostname(host, sizeof(host) - 1) == 0 ? std::string(host) : "none";
  struct utsname u;
  e["os"] = uname(&u) == 0 ? std::string(u.sysname) + " " + u.release : "none";
  e["cpu_model"] = cpuinfo_field("model name");
  // x86 lists "flags"; arm64 lists "Features".
  std::string flags = cpuinfo_field("flags");
  e["cpu_flags"] = flags != "none" ? flags : cpuinfo_field("Features");
  e["compiler"] = DSV4_COMPILER;
  e["compile_flags"] = DSV4_COMPILE_FLAGS;
  e["build_id"] = DSV4_BUILD_ID;
  unsigned maj = 0, min = 0, rel = 0;
  H5get_libversion(&maj, &min, &rel);
  e["hdf5"] = std::to_string(maj) + "." + std::to_string(min) + "." + std::to_string(rel);
  // This build runs on the CPU; a GPU backend overwrites these with its device and library versions.
  for (const char* k : {"gpu", "gpu_driver", "cuda", "cupti", "nccl"}) e[k] = "none";
  e["threads"] = std::to_string(omp_get_max_threads());
  return e;
}

}  // namespace dsv4
