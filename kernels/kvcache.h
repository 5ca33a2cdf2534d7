// Cached KV rows in the storage format of an inference engine (MODEL.md §7.1, §7.4): encoding rows
// into a byte pool and decoding them back, addressed by pool slot.
#pragma once

#include <cstdint>

#include "kernels/numerics/hd.h"

namespace dsv4 {

// One cached row of `dim` values: the first `fp8_dims` as e4m3 codes with one power-of-two (ue8m0)
// scale per block of `block` values, stored as its exponent byte, then the remaining dims as bf16.
// fp8_dims = 0 stores the whole row as bf16 (exact for bf16 values).
//   layout: [fp8_dims e4m3 bytes][fp8_dims / block exponent bytes][(dim - fp8_dims) bf16, little endian]
// The window and compressed KV of the rollout profile use dim = Dh, fp8_dims = Dh - rd, block 64 (the
// 448 nope dims of DSV4 in FP8, the 64 rope dims in bf16, as SGLang's FlashMLA cache holds them; the
// exact byte order there is not known); the indexer keys dim = fp8_dims = Di, block 128.
struct KvRowFormat {
  int64_t dim = 0;
  int64_t fp8_dims = 0;
  int block = 64;
  DSV4_HD int64_t scales() const { return fp8_dims > 0 ? fp8_dims / block : 0; }
  DSV4_HD int64_t bytes() const { return fp8_dims + scales() + 2 * (dim - fp8_dims); }
  friend bool operator==(const KvRowFormat&, const KvRowFormat&) = default;
};
const char* kv_row_format_check(const KvRowFormat& f);

// Encodes rows src [n, ld] into pool slots: row i goes to bytes [slot[i] * f.bytes(), ...) of pool.
// The FP8 part is act_quant with ue8m0 scales (kernels/quant.h), so decoding gives exactly
// fp8_sim(src) (and src itself for the bf16 part when src holds bf16 values).
struct KvStoreParams {
  KvRowFormat f;
  int64_t n = 0;
  const float* src = nullptr;
  int64_t ld = 0;
  const int64_t* slot_ids = nullptr;  // [n]
  uint8_t* pool = nullptr;
};
// Decodes pool slots into rows dst [n, ld]: fp8 dims bf16(fp32(e4m3) * s), bf16 dims as stored.
struct KvLoadParams {
  KvRowFormat f;
  int64_t n = 0;
  const int64_t* slot_ids = nullptr;  // [n]
  const uint8_t* pool = nullptr;
  float* dst = nullptr;
  int64_t ld = 0;
};
const char* kv_store_check(const KvStoreParams& p);
const char* kv_load_check(const KvLoadParams& p);
void kv_store(const KvStoreParams& p);
void kv_load(const KvLoadParams& p);

}  // namespace dsv4
