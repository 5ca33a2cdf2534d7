// The decode state of one sequence (MODEL.md §7.1-7.2) as the graph sees it: what a chunk of a
// sequence reads from the tokens before it and leaves for the tokens after it. The rollout engine
// implements it over paged storage (rollout/kv_cache.h); the graph only calls this interface.
//
// Streams per layer: the window KV (positions; only the last W are kept), the compressed KV rows
// (C4 and C128 layers; one row per complete group) and the indexer keys (C4 layers). Rows are stored
// as the graph computed them before any FP8 simulation; the cache encodes them in its row format
// (kernels/kvcache.h) and load() decodes, so a profile that stores FP8 sees the quantised history,
// exactly the values its fp8_sim gives a prefill.
#pragma once

#include <cstdint>

#include "model/device.h"

namespace dsv4 {

enum class CacheStream { window, compressed, indexer_keys };
const char* to_string(CacheStream s);

// The compressor's projections (x · wkv^T and x · wgate^T, fp32 [rows, coff*d]) of the tokens
// [row0, row0 + rows): the tokens of the incomplete group and, for the overlapping ratio 4, of the
// group before it — REF's kv_state / score_state, without the ape term (added when pooling).
struct CompressorState {
  backend::Buffer<float> kvp, sc;
  int64_t row0 = 0, rows = 0;
};

class SequenceCache {
 public:
  virtual ~SequenceCache() = default;
  // Tokens already processed: the next chunk starts at this position.
  virtual int64_t length() const = 0;
  // Decodes rows [first, first + n) of `stream` of `layer` into dst [n, dim] (backend memory).
  // Window rows are positions and must be among the last W before length(); the other streams are
  // group indices below the number stored.
  virtual void load(int layer, CacheStream stream, int64_t first, int64_t n, float* dst) = 0;
  // Stores rows [first, first + n) from src [n, dim] (backend memory), encoding them.
  virtual void store(int layer, CacheStream stream, int64_t first, int64_t n, const float* src) = 0;
  // The projection state of the main (CacheStream::compressed) or the indexer's
  // (CacheStream::indexer_keys) compressor of `layer`.
  virtual CompressorState& compressor_state(int layer, CacheStream stream) = 0;
  // Called once the graph has run a chunk of n tokens.
  virtual void advance(int64_t n) = 0;
};

}  // namespace dsv4
