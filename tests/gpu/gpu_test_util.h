// Helpers of the GPU tests: the skip-without-device check, guarded device buffers (canary bytes
// before and after every buffer, checked after the kernel), and the CPU-vs-GPU comparison (NaN and
// Inf positions first, then every other value bitwise).
#pragma once

#include <cuda_runtime_api.h>
#include <gtest/gtest.h>
#include <link.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "kernels/cuda/check.h"
#include "model/device.h"

namespace dsv4::test {

// Skips the current test unless a CUDA device is usable. Any error of cudaGetDeviceCount (no driver:
// 35, no device: 100, ...) means "no device".
#define DSV4_REQUIRE_CUDA_DEVICE()                                     \
  do {                                                                 \
    int dsv4_n_ = 0;                                                   \
    if (cudaGetDeviceCount(&dsv4_n_) != cudaSuccess || dsv4_n_ == 0) { \
      cudaGetLastError();                                              \
      GTEST_SKIP() << "no CUDA device";                                \
    }                                                                  \
  } while (0)

// Whether the process runs under compute-sanitizer (its injected library is loaded). The sanitizer
// uses CUPTI itself, and CUPTI serves one tool at a time (CUPTI_ERROR_MULTIPLE_SUBSCRIBERS_NOT_SUPPORTED),
// so KernelRecorder's records cannot be relied on; and it serializes kernels, so the timing between
// them says nothing. Tests that assert on either skip those assertions under it and keep the rest
// (the memory checking is what it is run for).
inline bool under_compute_sanitizer() {
  static const bool found = dl_iterate_phdr(
                                [](dl_phdr_info* info, size_t, void*) -> int {
                                  const char* name = info->dlpi_name;
                                  return name && (std::strstr(name, "compute-sanitizer") ||
                                                  std::strstr(name, "libsanitizer-collection"));
                                },
                                nullptr) != 0;
  return found;
}
#define DSV4_SKIP_UNDER_COMPUTE_SANITIZER(what)                                                       \
  do {                                                                                                \
    if (::dsv4::test::under_compute_sanitizer()) GTEST_SKIP() << "under compute-sanitizer: " << what; \
  } while (0)

// Device buffers of one test case. Each buffer is allocated with kGuard canary bytes on both sides;
// outputs are pre-filled with a fill pattern (the CPU side starts from the same pattern, so an op
// that leaves an element unchanged compares equal, and one that forgets to write it does not).
class DeviceBuffers {
 public:
  static constexpr size_t kGuard = 4096;
  static constexpr unsigned char kCanary = 0xA5;

  DeviceBuffers() = default;
  DeviceBuffers(const DeviceBuffers&) = delete;
  DeviceBuffers& operator=(const DeviceBuffers&) = delete;
  ~DeviceBuffers() {
    for (const Entry& e : entries_) cudaFree(e.base);
  }

  // A guarded device copy of `host`.
  template <typename T>
  T* upload(const std::vector<T>& host, const std::string& name) {
    T* p = static_cast<T*>(alloc(host.size() * sizeof(T), name));
    if (!host.empty())
      CUDA_CHECK(cudaMemcpy(p, host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice));
    return p;
  }
  template <typename T>
  std::vector<T> download(const T* dev, size_t n) const {
    std::vector<T> h(n);
    if (n) CUDA_CHECK(cudaMemcpy(h.data(), dev, n * sizeof(T), cudaMemcpyDeviceToHost));
    return h;
  }
  // Every canary byte of every buffer must be intact.
  ::testing::AssertionResult guards_intact() const {
    CUDA_CHECK(cudaDeviceSynchronize());
    for (const Entry& e : entries_) {
      std::vector<unsigned char> g(kGuard);
      for (int side = 0; side < 2; ++side) {
        const unsigned char* src = e.base + (side == 0 ? 0 : kGuard + e.bytes);
        CUDA_CHECK(cudaMemcpy(g.data(), src, kGuard, cudaMemcpyDeviceToHost));
        for (size_t i = 0; i < kGuard; ++i)
          if (g[i] != kCanary)
            return ::testing::AssertionFailure()
                   << "guard region " << (side == 0 ? "before" : "after") << " buffer '" << e.name
                   << "' was written at byte " << (side == 0 ? -int64_t(kGuard - i) : int64_t(i));
      }
    }
    return ::testing::AssertionSuccess();
  }

 private:
  struct Entry {
    unsigned char* base;
    size_t bytes;
    std::string name;
  };
  void* alloc(size_t bytes, const std::string& name) {
    unsigned char* base = nullptr;
    CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&base), bytes + 2 * kGuard));
    CUDA_CHECK(cudaMemset(base, kCanary, bytes + 2 * kGuard));
    entries_.push_back({base, bytes, name});
    return base + kGuard;
  }
  std::vector<Entry> entries_;
};

// A fill pattern for outputs: a quiet NaN with a recognisable payload.
inline float fill_value() {
  uint32_t u = 0x7fa5a5a5u;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// CPU vs GPU: the same NaN positions, the same +-Inf positions, every other value bitwise (NaN payloads
// may differ: the GPU produces the canonical NaN).
inline ::testing::AssertionResult same_floats(const std::vector<float>& cpu, const std::vector<float>& gpu,
                                              const std::string& what) {
  if (cpu.size() != gpu.size())
    return ::testing::AssertionFailure() << what << ": sizes differ " << cpu.size() << " vs " << gpu.size();
  for (size_t i = 0; i < cpu.size(); ++i)
    if (std::isnan(cpu[i]) != std::isnan(gpu[i]))
      return ::testing::AssertionFailure()
             << what << ": NaN position differs at " << i << " (cpu " << cpu[i] << ", gpu " << gpu[i] << ")";
  for (size_t i = 0; i < cpu.size(); ++i)
    if (std::isinf(cpu[i]) != std::isinf(gpu[i]))
      return ::testing::AssertionFailure()
             << what << ": Inf position differs at " << i << " (cpu " << cpu[i] << ", gpu " << gpu[i] << ")";
  for (size_t i = 0; i < cpu.size(); ++i) {
    if (std::isnan(cpu[i])) continue;
    if (std::memcmp(&cpu[i], &gpu[i], 4) != 0) {
      uint32_t a, b;
      std::memcpy(&a, &cpu[i], 4);
      std::memcpy(&b, &gpu[i], 4);
      return ::testing::AssertionFailure()
             << what << ": first difference at " << i << ": cpu " << cpu[i] << " (0x" << std::hex << a
             << ") vs gpu " << gpu[i] << " (0x" << b << std::dec << ")";
    }
  }
  return ::testing::AssertionSuccess();
}

template <typename T>
::testing::AssertionResult same_ints(const std::vector<T>& cpu, const std::vector<T>& gpu,
                                     const std::string& what) {
  if (cpu.size() != gpu.size())
    return ::testing::AssertionFailure() << what << ": sizes differ " << cpu.size() << " vs " << gpu.size();
  for (size_t i = 0; i < cpu.size(); ++i)
    if (cpu[i] != gpu[i])
      return ::testing::AssertionFailure()
             << what << ": first difference at " << i << ": cpu " << +cpu[i] << " vs gpu " << +gpu[i];
  return ::testing::AssertionSuccess();
}

// Holds each late report's digests back `microseconds` on the digest stream while in scope
// (backend::set_digest_delay_for_tests), and resets the delay however the scope is left.
class DigestDelay {
 public:
  explicit DigestDelay(int microseconds) { backend::set_digest_delay_for_tests(microseconds); }
  ~DigestDelay() { backend::set_digest_delay_for_tests(0); }
  DigestDelay(const DigestDelay&) = delete;
  DigestDelay& operator=(const DigestDelay&) = delete;
};

}  // namespace dsv4::test
