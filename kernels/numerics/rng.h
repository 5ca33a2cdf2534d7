// Counter-based random numbers that give the same values on every machine and compiler (the
// standard library's distributions are implementation-defined): splitmix64 for bits, the top 24
// bits for uniforms, Box-Muller with our own log/cos/sin for normals.
#pragma once

#include <cmath>
#include <cstdint>

#include "kernels/numerics/numerics.h"

namespace dsv4::num {

DSV4_HD uint64_t splitmix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

// A stream of values keyed by (seed, stream); value i depends only on (seed, stream, i).
struct Rng {
  uint64_t key = 0;
  uint64_t counter = 0;
  DSV4_HD Rng(uint64_t seed, uint64_t stream)
      : key(splitmix64(seed ^ splitmix64(stream + 0x51ED270B27ull))) {}
  DSV4_HD uint64_t next_u64() { return splitmix64(key + 0x2545F4914F6CDD1Dull * ++counter); }
  // Uniform in (0, 1): (k + 0.5) / 2^24 for a 24-bit k, exact in fp32.
  DSV4_HD float uniform() { return (float(next_u64() >> 40) + 0.5f) * (1.0f / 16777216.0f); }
  // Standard normal (Box-Muller, one value per two uniforms).
  DSV4_HD float normal() {
    const float u1 = uniform(), u2 = uniform();
    const float r = std::sqrt(-2.0f * log_f(u1));
    return r * cos_f(6.28318530717958647692f * u2);
  }
  // Uniform integer in [0, n).
  DSV4_HD uint32_t below(uint32_t n) { return uint32_t((next_u64() >> 32) * n >> 32); }
};

}  // namespace dsv4::num
