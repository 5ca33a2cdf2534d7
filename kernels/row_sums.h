// Row digests formed by the ops that write the rows. An op that writes bf16 rows of n values, n a
// multiple of 512 (xxh3::bf16_row_has_sums), can be asked for their XXH3 block sums
// (kernels/xxh3.h "Block sums"): HcPreParams::y_sums, HcPostParams::out_sums,
// RmsNormParams::y_sums. The sums of a row give its XXH3-64 (xxh3::hash_from_sums), the row digest of
// capture/digest.h, so a device backend hashes a reported row without reading it again. Layout of a
// sums array: [rows, n / 512, 8] uint64.
#pragma once

#include <cstdint>

#include "kernels/xxh3.h"

namespace dsv4 {

// The sums of the bf16 patterns of `rows` rows of n values (row r at x + r * ld) into
// sums[rows, n / 512, 8]: the CPU ops' way. n must satisfy xxh3::bf16_row_has_sums.
void bf16_row_sums(const float* x, int64_t rows, int64_t n, int64_t ld, uint64_t* sums);

// A check message when `sums` is set but rows of n values have none, else nullptr.
inline const char* row_sums_check(const uint64_t* sums, int64_t n, const char* what) {
  return sums && !xxh3::bf16_row_has_sums(n) ? what : nullptr;
}

}  // namespace dsv4
