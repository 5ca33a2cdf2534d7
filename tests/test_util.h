// Shared test helpers: seeded inputs, bitwise comparison with a readable report, ulp distance.
#pragma once

#include <gtest/gtest.h>

#include <unistd.h>

#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <random>
#include <string>
#include <vector>

#include "kernels/numerics/numerics.h"

namespace dsv4::test {

// A fresh directory per test, removed afterwards.
struct TempDir {
  std::filesystem::path dir;
  TempDir() {
    static std::atomic<int> n{0};
    dir = std::filesystem::temp_directory_path() /
          ("dsv4_test_" + std::to_string(getpid()) + "_" + std::to_string(n++));
    std::filesystem::remove_all(dir);
    std::filesystem::create_directories(dir);
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(dir, ec);
  }
  std::string operator/(const std::string& name) const { return (dir / name).string(); }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
};

// Deterministic generator seeded from a string (the case name), so a failing case reruns the same.
inline std::mt19937_64 rng_for(const std::string& name) {
  uint64_t h = 1469598103934665603ull;
  for (unsigned char c : name) h = (h ^ c) * 1099511628211ull;
  return std::mt19937_64(h);
}

// bf16-exact random values ~ N(0, std).
inline std::vector<float> randn_bf16(std::mt19937_64& g, size_t n, float std = 1.0f) {
  std::normal_distribution<float> d(0.0f, std);
  std::vector<float> v(n);
  for (auto& x : v) x = num::bf16_round(d(g));
  return v;
}

// bf16 rounding (to nearest, ties to even) written without the runtime's bit trick: the 8 significant
// bits of the frexp mantissa rounded with nearbyint (the default mode rounds ties to even). For finite
// normal values; zero stays zero.
inline float bf16_ref(float x) {
  if (x == 0.0f) return x;
  int e = 0;
  const double m = std::frexp(double(x), &e);  // |m| in [0.5, 1)
  return float(std::ldexp(std::nearbyint(std::ldexp(m, 8)), e - 8));
}

// Small dyadic values (k / 8 for |k| <= 8): sums of products are exact in fp32 in any order.
inline std::vector<float> dyadic(std::mt19937_64& g, size_t n) {
  std::uniform_int_distribution<int> d(-8, 8);
  std::vector<float> v(n);
  for (auto& x : v) x = d(g) / 8.0f;
  return v;
}

// Distance in units in the last place between two finite floats (monotonic integer mapping).
inline int64_t ulp_distance(float a, float b) {
  auto key = [](float x) {
    int32_t i;
    std::memcpy(&i, &x, 4);
    return i < 0 ? int64_t(INT32_MIN) - i : int64_t(i);
  };
  int64_t d = key(a) - key(b);
  return d < 0 ? -d : d;
}

// Bitwise equality of two buffers; on failure reports the first differing index and both values.
template <typename T>
::testing::AssertionResult bitwise_equal(const std::vector<T>& a, const std::vector<T>& b) {
  if (a.size() != b.size())
    return ::testing::AssertionFailure() << "sizes differ: " << a.size() << " vs " << b.size();
  for (size_t i = 0; i < a.size(); ++i) {
    if (std::memcmp(&a[i], &b[i], sizeof(T)) != 0)
      return ::testing::AssertionFailure()
             << "first difference at index " << i << ": " << +a[i] << " vs " << +b[i];
  }
  return ::testing::AssertionSuccess();
}

inline bool all_zero(const std::vector<float>& v) {
  for (float x : v)
    if (x != 0.0f) return false;
  return true;
}

}  // namespace dsv4::test
