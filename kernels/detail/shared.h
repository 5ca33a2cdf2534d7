// kernels/detail/<op>.h hold the arithmetic that the CPU reference (kernels/cpu/<op>.cpp) and the
// CUDA exact-mode kernels (kernels/cuda/<op>.cu) share, so that every operation order the op header
// documents is written once and both backends run the same source:
//   - DSV4_HD functions (kernels/numerics/hd.h) in namespace dsv4::common: per-element and per-row
//     arithmetic on raw pointers and sizes, with no allocation, exceptions or OpenMP, so they compile
//     for the device too. Explicit fma is std::fma (the device build maps it to fmaf); with
//     -ffp-contract=off on the host and --fmad=false on the device the two builds round identically.
//     Functions that one thread or a group of threads runs over part of a row take (begin, step).
//   - plain `inline` host functions in the same namespace: parameter checks and set-up shared by the
//     two backends' host code.
// This header holds what several ops use.
#pragma once

#include <cmath>
#include <cstdint>

#include "kernels/numerics/hd.h"
#include "kernels/numerics/numerics.h"

namespace dsv4::common {

// v clamped to [lo, hi] as v < lo ? lo : (v > hi ? hi : v) (NaN stays NaN).
DSV4_HD float clampf(float v, float lo, float hi) {
  return v < lo ? lo : (v > hi ? hi : v);
}

// The canonical quiet NaN, 0x7fc00000 (what both backends write for "no value").
DSV4_HD float quiet_nan() {
  return num::f32_from_bits(0x7fc00000u);
}

}  // namespace dsv4::common
