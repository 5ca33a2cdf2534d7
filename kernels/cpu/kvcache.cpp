// The cached-row codec on the CPU (kernels/kvcache.h).
#include "kernels/kvcache.h"

#include "kernels/detail/kvcache.h"

namespace dsv4 {

namespace {
constexpr int64_t kParallelRows = 64;
}  // namespace

const char* kv_row_format_check(const KvRowFormat& f) {
  if (f.dim <= 0) return "dim";
  if (f.fp8_dims < 0 || f.fp8_dims > f.dim) return "fp8_dims";
  if (f.fp8_dims > 0 && (f.block <= 0 || f.fp8_dims % f.block != 0)) return "block";
  return nullptr;
}

const char* kv_store_check(const KvStoreParams& p) {
  if (const char* why = kv_row_format_check(p.f)) return why;
  if (p.n < 0) return "n";
  if (p.n == 0) return nullptr;
  if (p.ld < p.f.dim) return "ld";
  if (!p.src) return "src";
  if (!p.slot_ids) return "slot_ids";
  if (!p.pool) return "pool";
  return nullptr;
}

const char* kv_load_check(const KvLoadParams& p) {
  if (const char* why = kv_row_format_check(p.f)) return why;
  if (p.n < 0) return "n";
  if (p.n == 0) return nullptr;
  if (p.ld < p.f.dim) return "ld";
  if (!p.dst) return "dst";
  if (!p.slot_ids) return "slot_ids";
  if (!p.pool) return "pool";
  return nullptr;
}

void kv_store(const KvStoreParams& p) {
  const int64_t bytes = p.f.bytes();
#pragma omp parallel for schedule(static) if (p.n >= kParallelRows)
  for (int64_t i = 0; i < p.n; ++i)
    common::kv_encode_row(p.f, p.src + i * p.ld, p.pool + p.slot_ids[i] * bytes);
}

void kv_load(const KvLoadParams& p) {
  const int64_t bytes = p.f.bytes();
#pragma omp parallel for schedule(static) if (p.n >= kParallelRows)
  for (int64_t i = 0; i < p.n; ++i)
    common::kv_decode_row(p.f, p.pool + p.slot_ids[i] * bytes, p.dst + i * p.ld);
}

}  // namespace dsv4
