#include "capture/chunk_codec.h"

#include <cstring>
#include <stdexcept>
#include <string>

#if defined(DSV4_HAVE_ISAL)
#include <isa-l/igzip_lib.h>
#endif
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

std::vector<uint8_t> decode_chunk(const EncodedChunk& c, size_t n, size_t elem, bool compress) {
  if (c.bytes.size() < 4) throw std::runtime_error("decode_chunk: no checksum");
  const size_t m = c.bytes.size() - 4;
  uint32_t stored = 0;
  for (int b = 0; b < 4; ++b) stored |= uint32_t(c.bytes[m + size_t(b)]) << (8 * b);
  if (fletcher32(c.bytes.data(), m) != stored) throw std::runtime_error("decode_chunk: checksum mismatch");
  std::vector<uint8_t> out(n);
  if (!compress) {
    if (m != n) throw std::runtime_error("decode_chunk: wrong size");
    std::memcpy(out.data(), c.bytes.data(), n);
    return out;
  }
  std::vector<uint8_t> shuffled(n);
  if (c.filter_mask & (1u << 1)) {
    if (m != n) throw std::runtime_error("decode_chunk: wrong size");
    std::memcpy(shuffled.data(), c.bytes.data(), n);
  } else {
#if defined(DSV4_HAVE_ZLIB)
    uLongf got = uLongf(n);
    if (uncompress(shuffled.data(), &got, c.bytes.data(), uLong(m)) != Z_OK || got != n)
      throw std::runtime_error("decode_chunk: inflate failed");
#else
    throw std::logic_error("decode_chunk: built without zlib");
#endif
  }
  // Unshuffle: byte j of element i came from j * count + i.
  const size_t count = elem > 1 ? n / elem : 0;
  if (count == 0) return shuffled;
  for (size_t j = 0; j < elem; ++j)
    for (size_t i = 0; i < count; ++i) out[i * elem + j] = shuffled[j * count + i];
  std::memcpy(out.data() + count * elem, shuffled.data() + count * elem, n - count * elem);
  return out;
}

bool chunk_codec_available() {
#if defined(DSV4_HAVE_ZLIB)
  return true;
#else
  return false;
#endif
}

const char* chunk_deflate_name() {
#if defined(DSV4_HAVE_ISAL)
  return "isa-l igzip level 1";
#elif defined(DSV4_HAVE_ZLIB)
  return "zlib level 4";
#else
  return "none";
#endif
}

namespace {

#if defined(DSV4_HAVE_ZLIB)
// A zlib stream (RFC 1950: header, deflate, Adler-32) of `in` into `out` (at least n bytes); its length,
// or 0 when it would not be shorter than the input (the chunk is then stored as it is, the deflate
// filter skipped).
size_t zlib_stream(const uint8_t* in, size_t n, uint8_t* out) {
#if defined(DSV4_HAVE_ISAL)
  // ISA-L's level 1 writes the same stream format about 7 times faster than zlib's level 4 on the
  // trace's shuffled integer chunks, at the same ratio (docs/ADAPTERS.md). Its level buffer is per
  // thread: the encoder threads each hold one.
  thread_local std::vector<uint8_t> level_buf(ISAL_DEF_LVL1_DEFAULT);
  isal_zstream z;
  isal_deflate_stateless_init(&z);
  z.level = 1;
  z.level_buf = level_buf.data();
  z.level_buf_size = uint32_t(level_buf.size());
  z.gzip_flag = IGZIP_ZLIB;
  z.end_of_stream = 1;
  z.flush = NO_FLUSH;
  z.next_in = const_cast<uint8_t*>(in);
  z.avail_in = uint32_t(n);
  z.next_out = out;
  z.avail_out = uint32_t(n);
  const int rc = isal_deflate_stateless(&z);
  if (rc == STATELESS_OVERFLOW) return 0;
  if (rc != COMP_OK) throw std::runtime_error("isa-l deflate failed with code " + std::to_string(rc));
  return z.total_out < n ? size_t(z.total_out) : 0;
#else
  thread_local std::vector<uint8_t> bound;
  uLongf out_n = compressBound(uLong(n));
  if (bound.size() < out_n) bound.resize(out_n);
  const int rc = compress2(bound.data(), &out_n, in, uLong(n), 4);
  if (rc != Z_OK) throw std::runtime_error("zlib compress2 failed with code " + std::to_string(rc));
  if (out_n >= n) return 0;
  std::memcpy(out, bound.data(), out_n);
  return size_t(out_n);
#endif
}
#endif

// The stored bytes: the payload and its Fletcher-32, little endian, in a buffer of exactly that size
// (a stream of chunks holds thousands of them).
void seal(EncodedChunk& c, const uint8_t* payload, size_t m) {
  c.bytes.resize(m + 4);
  std::memcpy(c.bytes.data(), payload, m);
  const uint32_t sum = fletcher32(payload, m);
  for (int b = 0; b < 4; ++b) c.bytes[m + size_t(b)] = uint8_t(sum >> (8 * b));
}

}  // namespace

EncodedChunk encode_shuffled_chunk(const uint8_t* shuffled, size_t n) {
  EncodedChunk c;
#if defined(DSV4_HAVE_ZLIB)
  thread_local std::vector<uint8_t> deflated;  // scratch reused by each encoder thread
  if (deflated.size() < n) deflated.resize(n);
  if (const size_t m = zlib_stream(shuffled, n, deflated.data())) {
    seal(c, deflated.data(), m);
  } else {  // deflate would not shrink it: skipped, as HDF5's optional filter is
    seal(c, shuffled, n);
    c.filter_mask |= 1u << 1;
  }
#else
  (void)shuffled;
  (void)n;
  throw std::logic_error("encode_chunk: built without zlib");
#endif
  return c;
}

EncodedChunk encode_chunk(const uint8_t* data, size_t n, size_t elem, bool compress) {
  if (!compress) {
    EncodedChunk c;
    seal(c, data, n);
    return c;
  }
  thread_local std::vector<uint8_t> shuffled;  // scratch reused by each encoder thread
  if (shuffled.size() < n) shuffled.resize(n);
  shuffle_bytes(data, n, elem, shuffled.data());
  return encode_shuffled_chunk(shuffled.data(), n);
}

}  // namespace dsv4::h5
