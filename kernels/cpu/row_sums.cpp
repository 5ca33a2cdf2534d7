#include "kernels/row_sums.h"

#include <array>

#include "kernels/numerics/numerics.h"

namespace dsv4 {

void bf16_row_sums(const float* x, int64_t rows, int64_t n, int64_t ld, uint64_t* sums) {
  const int64_t nb = n / xxh3::kSumRowValues;
#pragma omp parallel for schedule(static) if (rows * n >= (int64_t(1) << 16))
  for (int64_t r = 0; r < rows; ++r) {
    std::array<uint8_t, xxh3::kBlockLen> block;
    for (int64_t b = 0; b < nb; ++b) {
      const float* v = x + r * ld + b * xxh3::kSumRowValues;
      for (int64_t i = 0; i < xxh3::kSumRowValues; ++i) {
        const uint16_t bits = num::bf16_bits(v[i]);
        block[size_t(2 * i)] = uint8_t(bits), block[size_t(2 * i + 1)] = uint8_t(bits >> 8);
      }
      xxh3::block_sums(block.data(), b == nb - 1, xxh3::kSecret, sums + (r * nb + b) * 8);
    }
  }
}

}  // namespace dsv4
