#include "capture/env.h"

#include <ctime>

#include <hdf5.h>
#include <omp.h>
#include <sys/utsname.h>
#include <unistd.h>

#include <fstream>

#include "capture/chunk_codec.h"
#include "capture/cupti.h"
#include "kernels/reduce.h"

#if defined(DSV4_HAVE_CUPTI)
#include <cuda_runtime_api.h>
#endif
#if defined(DSV4_HAVE_NCCL)
#include <nccl.h>
#endif

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

// "MAJOR.MINOR" of a CUDA version number (1000 * major + 10 * minor).
[[maybe_unused]] std::string cuda_version(int v) {
  return std::to_string(v / 1000) + "." + std::to_string((v % 1000) / 10);
}

// The GPU stack of device 0 when this build has CUDA and a device is usable; otherwise the fields
// stay "none".
void gpu_fields([[maybe_unused]] EnvFingerprint& e) {
#if defined(DSV4_HAVE_CUPTI)
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess || n == 0) {
    cudaGetLastError();
    return;
  }
  cudaDeviceProp p{};
  if (cudaGetDeviceProperties(&p, 0) == cudaSuccess)
    e["gpu"] = std::string(p.name) + " (sm_" + std::to_string(p.major) + std::to_string(p.minor) + ", " +
               std::to_string(n) + " device" + (n == 1 ? "" : "s") + ")";
  int v = 0;
  if (cudaDriverGetVersion(&v) == cudaSuccess) e["gpu_driver"] = cuda_version(v);
  if (cudaRuntimeGetVersion(&v) == cudaSuccess) e["cuda"] = cuda_version(v);
  cudaGetLastError();
  e["cupti"] = cupti_version_string();
#if defined(DSV4_HAVE_NCCL)
  int nv = 0;
  e["nccl"] = ncclGetVersion(&nv) == ncclSuccess ? std::to_string(nv) : "none";
#else
  e["nccl"] = "not linked";
#endif
#endif
}

}  // namespace

std::string gpu_arch() {
#if defined(DSV4_HAVE_CUPTI)
  int n = 0, dev = 0;
  cudaDeviceProp p{};
  const bool ok = cudaGetDeviceCount(&n) == cudaSuccess && n > 0 && cudaGetDevice(&dev) == cudaSuccess &&
                  cudaGetDeviceProperties(&p, dev) == cudaSuccess;
  cudaGetLastError();
  if (ok) return "sm_" + std::to_string(p.major) + std::to_string(p.minor);
#endif
  return "none";
}

EnvFingerprint environment_fingerprint() {
  EnvFingerprint e;
  char host[256] = {};
  e["host"] = gethostname(host, sizeof(host) - 1) == 0 ? std::string(host) : "none";
  struct utsname u;
  e["os"] = uname(&u) == 0 ? std::string(u.sysname) + " " + u.release : "none";
  e["machine"] = uname(&u) == 0 ? std::string(u.machine) : "none";
  e["isa"] = build_isa();
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
  e["deflate"] = h5::chunk_deflate_name();
  // "none" unless this build has CUDA and a device is usable (then the device and library versions).
  for (const char* k : {"gpu", "gpu_driver", "cuda", "cupti", "nccl"}) e[k] = "none";
  gpu_fields(e);
  e[kEnvGpuArch] = gpu_arch();
  e[kEnvTensorCoreRevision] = std::to_string(kTensorCoreRevision);
  e["threads"] = std::to_string(omp_get_max_threads());
  return e;
}

std::string build_isa() {
#if defined(__x86_64__)
#if defined(__AVX2__) && defined(__FMA__) && defined(__BMI2__)
  return "x86-64-v3";
#else
  return "x86-64";
#endif
#elif defined(__aarch64__)
  return "aarch64";
#else
  return "other";
#endif
}

std::string machine_summary(const EnvFingerprint& env) {
  auto get = [&](const char* k) {
    const auto it = env.find(k);
    return it == env.end() || it->second == "none" ? std::string() : it->second;
  };
  std::string s;
  const std::string isa = get("isa"), machine = get("machine"), cpu = get("cpu_model"), gpu = get("gpu");
  if (!isa.empty()) s = isa + " build";
  if (!machine.empty()) s += (s.empty() ? "" : " on ") + machine;
  if (!cpu.empty()) s += (s.empty() ? "" : ", ") + cpu;
  if (!gpu.empty()) s += (s.empty() ? "GPU " : "; GPU ") + gpu;
  return s.empty() ? "an unrecorded machine" : s;
}

std::string utc_now_iso8601() {
  const std::time_t t = std::time(nullptr);
  std::tm tm{};
  gmtime_r(&t, &tm);
  char buf[32];
  std::strftime(buf, sizeof(buf), "%Y-%m-%dT%H:%M:%SZ", &tm);
  return buf;
}

}  // namespace dsv4
