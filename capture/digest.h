// Digests: XXH3-64 (seed 0, libxxhash) of tensor rows in their storage dtype (traces/FORMAT.md) and
// of the weights.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "model/observer.h"
#include "model/weights.h"

namespace dsv4 {

uint64_t xxh3_64(const void* data, size_t bytes);

// One digest per row of a reported tensor: bf16 rows are hashed as their 2-byte patterns, f32 and
// i32 rows as 4-byte values. The backend's digests (TensorRecord::row_digests) are taken as they are.
std::vector<uint64_t> digest_rows(const TensorRecord& t);
// The bytes of a tensor in its storage dtype (uint16 bf16 patterns, float32, int32), little endian.
std::vector<uint8_t> storage_bytes(const TensorRecord& t);

struct ModelDigest {
  std::vector<std::string> names;  // sorted
  std::vector<uint64_t> digests;   // XXH3-64 of each weight's values in its storage dtype
  uint64_t whole = 0;              // XXH3-64 over (name bytes, 0, digest) of every tensor in name order
};
ModelDigest model_digest(const Weights& w);
std::string hex16(uint64_t v);

// XXH3-64 (seed 0) of a whole file's bytes, read in 1 MiB blocks (bundle manifests). Throws
// InputError when the file cannot be read.
uint64_t file_digest(const std::string& path);

}  // namespace dsv4
