// The trace's HDF5 filter pipeline (traces/FORMAT.md: shuffle, deflate level 4, fletcher32) applied
// to one chunk outside HDF5, so that the chunks of a large dataset can be encoded on several threads
// and handed to H5Dwrite_chunk. HDF5 decodes them with its own filters on read: every chunk written
// this way is checked by HDF5's fletcher32 and inflate on the way back (tests/test_chunk_codec.cpp).
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace dsv4::h5 {

// HDF5's shuffle filter: byte j of element i goes to j * (n / elem) + i (no-op for elem == 1).
void shuffle_bytes(const uint8_t* in, size_t n, size_t elem, uint8_t* out);
// HDF5's Fletcher-32 checksum (H5Zfletcher32): 16-bit big-endian words, sums folded every 360
// words, a trailing odd byte as the high byte of a last word.
uint32_t fletcher32(const uint8_t* data, size_t n);

struct EncodedChunk {
  std::vector<uint8_t> bytes;  // what H5Dwrite_chunk stores
  uint32_t filter_mask = 0;    // bit i set: filter i of the pipeline was skipped
};
// The pipeline [shuffle, deflate(level), fletcher32] (`compress`) or [fletcher32] over one whole
// chunk of `n` bytes of `elem`-byte little-endian values. Like HDF5's optional deflate filter, a chunk
// that deflate would not shrink is stored uncompressed with the deflate bit (1 << 1) set in the mask.
EncodedChunk encode_chunk(const uint8_t* data, size_t n, size_t elem, bool compress, int level);

// Whether this build can encode chunks itself (zlib present); else datasets go through H5Dwrite.
bool chunk_codec_available();

}  // namespace dsv4::h5
