// The .npy format (numpy's NEP 1, versions 1.0 / 2.0 / 3.0): a magic string, a header dict literal
// {'descr': '<i4', 'fortran_order': False, 'shape': (a, b, c), } and the raw C-order data. Only what
// the R3 arrays need: little-endian int32 / int64 / float32, C order. Anything else is refused with a
// message naming the array (its file, and its member in an .npz).
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

namespace dsv4 {

struct NpyArray {
  std::string descr;           // "<i4", "<i8" or "<f4"
  std::vector<int64_t> shape;  // () for a scalar
  std::vector<uint8_t> data;   // the values, C order, little-endian
  int64_t count() const;       // product of shape (1 for a scalar)
};

// Parses a whole .npy file. `what` names it in errors ("sample.npz: tokens.npy").
NpyArray npy_parse(std::span<const uint8_t> file, const std::string& what);

// Values as int32: "<i4" as is; "<i8" when `widen_i8` and every value fits (token ids saved by numpy's
// default integer type). InputError for another dtype.
std::vector<int32_t> npy_int32(const NpyArray& a, const std::string& what, bool widen_i8 = false);
std::vector<float> npy_float32(const NpyArray& a, const std::string& what);
int64_t npy_scalar_int(const NpyArray& a, const std::string& what);

// A whole .npy file (version 1.0, or 2.0 when the header needs it) for C-order little-endian values.
std::vector<uint8_t> npy_encode_int32(std::span<const int32_t> values, const std::vector<int64_t>& shape);
std::vector<uint8_t> npy_encode_int64(std::span<const int64_t> values, const std::vector<int64_t>& shape);

}  // namespace dsv4
