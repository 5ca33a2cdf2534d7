// Philox4x32-10, the counter-based generator of Salmon et al. (SC'11, the Random123 library): a
// keyed bijection of a 128-bit counter. Output i of a stream is a pure function of (key, counter),
// so a draw needs no state, does not depend on how many draws came before it, and can be computed
// by any thread on any device.
//
// Integer-only: 32x32 -> 64-bit products, xor and wrapping adds, so the CPU and CUDA give the same
// bits. The products are written as a uint64_t multiply (portable C++, and what nvcc lowers to
// mul.lo/mul.hi) rather than with compiler intrinsics. Checked against the published known-answer
// vectors in tests/test_sampler.cpp.
#pragma once

#include <cstdint>

#include "kernels/numerics/hd.h"

namespace dsv4::num {

// The four output words of one Philox4x32-10 block.
struct PhiloxWords {
  uint32_t w[4];
};

namespace detail {

constexpr uint32_t kPhiloxM0 = 0xD2511F53u;  // round multipliers
constexpr uint32_t kPhiloxM1 = 0xCD9E8D57u;
constexpr uint32_t kPhiloxW0 = 0x9E3779B9u;  // key schedule increments (golden ratio, sqrt(3) - 1)
constexpr uint32_t kPhiloxW1 = 0xBB67AE85u;

// hi:lo = a * b, the full 64-bit product.
DSV4_HD void philox_mulhilo(uint32_t a, uint32_t b, uint32_t& hi, uint32_t& lo) {
  const uint64_t p = uint64_t(a) * uint64_t(b);
  hi = uint32_t(p >> 32);
  lo = uint32_t(p);
}

// One round: two products, then the Feistel-like xor and word permutation of Random123.
DSV4_HD void philox_round(uint32_t x[4], uint32_t k0, uint32_t k1) {
  uint32_t hi0, lo0, hi1, lo1;
  philox_mulhilo(kPhiloxM0, x[0], hi0, lo0);
  philox_mulhilo(kPhiloxM1, x[2], hi1, lo1);
  const uint32_t y0 = hi1 ^ x[1] ^ k0;
  const uint32_t y2 = hi0 ^ x[3] ^ k1;
  x[0] = y0;
  x[1] = lo1;
  x[2] = y2;
  x[3] = lo0;
}

}  // namespace detail

// Philox4x32 with 10 rounds: round 1 uses the key as given, each later round first adds
// (W0, W1) to the key (mod 2^32).
DSV4_HD PhiloxWords philox4x32_10(const uint32_t key[2], const uint32_t counter[4]) {
  uint32_t x[4] = {counter[0], counter[1], counter[2], counter[3]};
  uint32_t k0 = key[0], k1 = key[1];
  for (int r = 0; r < 10; ++r) {
    if (r > 0) {
      k0 += detail::kPhiloxW0;
      k1 += detail::kPhiloxW1;
    }
    detail::philox_round(x, k0, k1);
  }
  return PhiloxWords{{x[0], x[1], x[2], x[3]}};
}

// A uniform float in the open interval (0, 1) from a 32-bit word, exactly representable in fp32:
//   u = (2 * (w >> 9) + 1) * 2^-24 = ((w >> 9) + 0.5) * 2^-23
// i.e. the midpoints of 2^23 equal bins, from 2^-24 to 1 - 2^-24. Only the top 23 bits are used
// because 2k + 1 must fit in fp32's 24-bit significand for every k: with 24 bits,
// ((w >> 8) + 0.5) * 2^-24 needs 25 significant bits for the largest k and would round (to 1.0 at
// the top). The integer-to-float conversion and the power-of-two scaling are exact, so the result
// is the same bits everywhere. Never 0 and never 1.
DSV4_HD float uniform_open01(uint32_t w) {
  return float(2u * (w >> 9) + 1u) * 0x1p-24f;
}

}  // namespace dsv4::num
