// The trace's HDF5 filter pipeline (traces/FORMAT.md: shuffle, deflate, fletcher32) applied
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
// The pipeline [shuffle, deflate, fletcher32] (`compress`) or [fletcher32] over one whole chunk of
// `n` bytes of `elem`-byte little-endian values. Like HDF5's optional deflate filter, a chunk that
// deflate would not shrink is stored uncompressed with the deflate bit (1 << 1) set in the mask.
// Deflate is ISA-L's level 1 when the build has ISA-L, else zlib's level 4 (what HDF5's own filter
// writes); any inflate reads either, so only the file's bytes depend on the choice, never its contents.
EncodedChunk encode_chunk(const uint8_t* data, size_t n, size_t elem, bool compress);
// The same pipeline for a chunk already shuffled by the caller (a stream that writes each value's bytes
// straight into their planes).
EncodedChunk encode_shuffled_chunk(const uint8_t* shuffled, size_t n);

// The inverse of encode_chunk (for reading back what a ChunkStream holds): the `n` bytes of values, the
// checksum verified. Throws std::runtime_error for a chunk that does not decode.
std::vector<uint8_t> decode_chunk(const EncodedChunk& c, size_t n, size_t elem, bool compress);

// Whether this build can encode chunks itself (zlib present); else datasets go through H5Dwrite.
bool chunk_codec_available();
// The deflate encoder of encode_chunk: "isa-l igzip level 1", "zlib level 4" or "none" (the
// environment fingerprint records it).
const char* chunk_deflate_name();

}  // namespace dsv4::h5
