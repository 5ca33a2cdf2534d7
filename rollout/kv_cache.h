// Paged storage of the decode state (MODEL.md §7.1): one page pool per stream (window KV, compressed
// KV, indexer keys), shared by all layers and requests; a block table per request, layer and stream;
// pages reference counted so that requests forked from a common prompt share them, and copied before
// a shared page is written (copy on write).
//
// Where a row lives never changes a value: rows are encoded and decoded one at a time
// (kernels/kvcache.h), so results do not depend on the page size, on which pages a request gets or
// on sharing.
#pragma once

#include <array>
#include <cstdint>
#include <memory>
#include <vector>

#include "model/config.h"
#include "model/device.h"
#include "model/profile.h"
#include "model/sequence_cache.h"

namespace dsv4::rollout {

// The row format of each stream under a profile: FP8 (nope dims in blocks of 64; indexer keys in
// blocks of min(Di, 128)) where the profile simulates FP8 at that site with real e4m3 rounding,
// else bf16 (exact: the graph's rows are bf16 values).
struct CacheFormats {
  KvRowFormat window, compressed, indexer_keys;
  const KvRowFormat& of(CacheStream s) const;
};
CacheFormats cache_formats(const ModelConfig& c, const NumericsProfile& p);

// Pages of `page_rows` encoded rows of one format, in one backend allocation that grows (by copying)
// when every page is taken. Page ids are stable; addresses are not (slots are recomputed per call).
class PagePool {
 public:
  PagePool(backend::Backend& be, KvRowFormat f, int page_rows);
  int32_t allocate();  // refcount 1
  void ref(int32_t page) { ++refs_.at(size_t(page)); }
  void unref(int32_t page);
  int refs(int32_t page) const { return refs_.at(size_t(page)); }
  // A private copy of `page` (refcount 1), its rows copied; drops one reference of `page`.
  int32_t copy_on_write(int32_t page);
  int64_t pages_in_use() const { return in_use_; }
  int64_t capacity() const { return int64_t(refs_.size()); }
  int64_t page_bytes() const { return int64_t(page_rows_) * f_.bytes(); }
  int page_rows() const { return page_rows_; }
  const KvRowFormat& format() const { return f_; }
  uint8_t* data() const { return mem_.data(); }

 private:
  void grow();
  backend::Backend& be_;
  KvRowFormat f_;
  int page_rows_;
  backend::Buffer<uint8_t> mem_;
  std::vector<int> refs_;
  std::vector<int32_t> free_;
  int64_t in_use_ = 0;
};

// The pools of one engine.
class CacheStore {
 public:
  CacheStore(backend::Backend& be, const ModelConfig& c, const NumericsProfile& p, int page_rows);
  PagePool& pool(CacheStream s) { return *pools_[size_t(s)]; }
  backend::Backend& backend() { return be_; }
  const ModelConfig& config() const { return c_; }
  int page_rows() const { return page_rows_; }
  // Bytes held by pages in use, over all pools.
  int64_t bytes_in_use() const;

 private:
  backend::Backend& be_;
  const ModelConfig& c_;
  int page_rows_;
  std::array<std::unique_ptr<PagePool>, 3> pools_;
};

// One request's decode state in a CacheStore.
class RequestCache final : public SequenceCache {
 public:
  explicit RequestCache(CacheStore& store);
  ~RequestCache() override;
  RequestCache(const RequestCache&) = delete;
  RequestCache& operator=(const RequestCache&) = delete;

  int64_t length() const override { return length_; }
  void load(int layer, CacheStream stream, int64_t first, int64_t n, float* dst) override;
  void store(int layer, CacheStream stream, int64_t first, int64_t n, const float* src) override;
  CompressorState& compressor_state(int layer, CacheStream stream) override;
  void advance(int64_t n) override { length_ += n; }

  // A new cache holding the same state: pages shared (reference counted, copied on their first
  // write), compressor states copied.
  std::unique_ptr<RequestCache> fork() const;
  // Bytes of the pages this request references (shared pages counted in full) and of its
  // compressor states.
  int64_t bytes() const;

 private:
  std::vector<int32_t>& table(int layer, CacheStream s) { return tables_[size_t(layer) * 3 + size_t(s)]; }
  // Pool slots of rows [first, first + n) of a stream; with `for_write`, pages are allocated and
  // shared pages copied first.
  std::vector<int64_t> pool_slots(int layer, CacheStream s, int64_t first, int64_t n, bool for_write);
  // The same, uploaded to the backend for kv_load / kv_store.
  backend::Buffer<int64_t> device_slots(int layer, CacheStream s, int64_t first, int64_t n, bool for_write);

  CacheStore& store_;
  int64_t length_ = 0;
  std::vector<std::vector<int32_t>> tables_;  // [layer * 3 + stream] page ids
  std::vector<CompressorState> states_;       // [layer * 2 + (stream == indexer_keys)]
};

}  // namespace dsv4::rollout
