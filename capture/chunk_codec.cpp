#include "capture/chunk_codec.h"

#include <cstring>
#include <stdexcept>

#if defined(DSV4_HAVE_ZLIB)
#include <zlib.h>
#endif

namespace dsv4::h5 {

void shuffle_bytes(const uint8_t* in, size_t n, size_t elem, uint8_t* out) {
  if (elem <= 1 || n < elem) {
    std::memcpy(out, in, n);
    return;
  }
  const size_t count = n / elem;
  for (size_t j = 0; j < elem; ++j)
    for (size_t i = 0; i < count; ++i) out[j * count + i] = in[i * elem + j];
  // Bytes past the last whole element stay where they are (HDF5 does the same).
  std::memcpy(out + count * elem, in + count * elem, n - count * elem);
}

uint32_t fletcher32(const uint8_t* data, size_t n) {
  uint32_t sum1 = 0, sum2 = 0;
  size_t words = n / 2;
  while (words) {
    size_t batch = words > 360 ? 360 : words;  // keeps the 32-bit sums from overflowing
    words -= batch;
    for (; batch; --batch, data += 2) {
      sum1 += (uint32_t(data[0]) << 8) | uint32_t(data[1]);
      sum2 += sum1;
    }
    sum1 = (sum1 & 0xffff) + (sum1 >> 16);
    sum2 = (sum2 & 0xffff) + (sum2 >> 16);
  }
  if (n % 2) {
    sum1 += uint32_t(*data) << 8;
    sum2 += sum1;
    sum1 = (sum1 & 0xffff) + (sum1 >> 16);
    sum2 = (sum2 & 0xffff) + (sum2 >> 16);
  }
  sum1 = (sum1 & 0xffff) + (sum1 >> 16);
  sum2 = (sum2 & 0xffff) + (sum2 >> 16);
  return (sum2 << 16) | sum1;
}

bool chunk_codec_available() {
#if defined(DSV4_HAVE_ZLIB)
  return true;
#else
  return false;
#endif
}

EncodedChunk encode_chunk(const uint8_t* data, size_t n, size_t elem, bool compress, int level) {
  EncodedChunk c;
  std::vector<uint8_t> payload;
  if (compress) {
#if defined(DSV4_HAVE_ZLIB)
    std::vector<uint8_t> shuffled(n);
    shuffle_bytes(data, n, elem, shuffled.data());
    uLongf out_n = compressBound(uLong(n));
    payload.resize(out_n);
    const int rc = compress2(payload.data(), &out_n, shuffled.data(), uLong(n), level);
    if (rc != Z_OK) throw std::runtime_error("zlib compress2 failed with code " + std::to_string(rc));
    if (out_n < n) {
      payload.resize(out_n);
    } else {  // deflate would not shrink it: skipped, as HDF5's optional filter is
      payload = std::move(shuffled);
      c.filter_mask |= 1u << 1;
    }
#else
    (void)level;
    throw std::logic_error("encode_chunk: built without zlib");
#endif
  } else {
    payload.assign(data, data + n);
  }
  const uint32_t sum = fletcher32(payload.data(), payload.size());
  c.bytes = std::move(payload);
  for (int b = 0; b < 4; ++b) c.bytes.push_back(uint8_t(sum >> (8 * b)));  // stored little endian
  return c;
}

}  // namespace dsv4::h5
