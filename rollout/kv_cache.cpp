#include "rollout/kv_cache.h"

#include <fmt/format.h>

#include <algorithm>

#include "model/error.h"

namespace dsv4 {

namespace rollout {

const KvRowFormat& CacheFormats::of(CacheStream s) const {
  switch (s) {
    case CacheStream::window:
      return window;
    case CacheStream::compressed:
      return compressed;
    case CacheStream::indexer_keys:
      break;
  }
  return indexer_keys;
}

CacheFormats cache_formats(const ModelConfig& c, const NumericsProfile& p) {
  // FP8 rows where the site's cache keeps them (NumericsProfile::QuantSite::cached_fp8), else bf16.
  const int64_t Dh = c.head_dim, nd = c.nope_dim(), Di = c.index_head_dim;
  const NumericsProfile::QuantSite kv = p.kv_site(), ix = p.indexer_site(Di);
  CacheFormats f;
  f.window = KvRowFormat{.dim = Dh, .fp8_dims = kv.cached_fp8 ? nd : 0, .block = kv.block};
  f.compressed = f.window;
  f.indexer_keys = KvRowFormat{.dim = Di, .fp8_dims = ix.cached_fp8 ? Di : 0, .block = ix.block};
  return f;
}

// ---- PagePool ------------------------------------------------------------------------------------

PagePool::PagePool(backend::Backend& be, KvRowFormat f, int page_rows)
    : be_(be), f_(f), page_rows_(page_rows) {
  if (page_rows < 1) throw InputError(fmt::format("page size must be at least 1 row, got {}", page_rows));
  if (const char* why = kv_row_format_check(f)) throw Error(fmt::format("cache row format: bad {}", why));
}

void PagePool::grow() {
  const int64_t old_pages = capacity();
  const int64_t pages = std::max<int64_t>(16, old_pages * 2);
  backend::Buffer<uint8_t> mem = be_.bytes(pages * page_bytes());
  if (old_pages > 0) be_.copy(mem.data(), mem_.data(), size_t(old_pages * page_bytes()));
  mem_ = std::move(mem);
  refs_.resize(size_t(pages), 0);
  // Lower ids are handed out first (free_ is used as a stack).
  for (int64_t p = pages - 1; p >= old_pages; --p) free_.push_back(int32_t(p));
}

int32_t PagePool::allocate() {
  if (free_.empty()) grow();
  const int32_t p = free_.back();
  free_.pop_back();
  refs_[size_t(p)] = 1;
  ++in_use_;
  return p;
}

void PagePool::unref(int32_t page) {
  int& r = refs_.at(size_t(page));
  if (r <= 0) throw Error(fmt::format("cache page {} released more often than referenced", page));
  if (--r == 0) {
    free_.push_back(page);
    --in_use_;
  }
}

int32_t PagePool::copy_on_write(int32_t page) {
  const int32_t fresh = allocate();
  be_.copy(mem_.data() + fresh * page_bytes(), mem_.data() + page * page_bytes(), size_t(page_bytes()));
  unref(page);
  return fresh;
}

// ---- CacheStore ----------------------------------------------------------------------------------

CacheStore::CacheStore(backend::Backend& be, const ModelConfig& c, const NumericsProfile& p, int page_rows)
    : be_(be), c_(c), page_rows_(page_rows) {
  const CacheFormats f = cache_formats(c, p);
  for (CacheStream s : {CacheStream::window, CacheStream::compressed, CacheStream::indexer_keys})
    pools_[size_t(s)] = std::make_unique<PagePool>(be, f.of(s), page_rows);
}

int64_t CacheStore::bytes_in_use() const {
  int64_t b = 0;
  for (const auto& p : pools_) b += p->pages_in_use() * p->page_bytes();
  return b;
}

// ---- RequestCache --------------------------------------------------------------------------------

RequestCache::RequestCache(CacheStore& store)
    : store_(store),
      tables_(size_t(store.config().num_hidden_layers) * 3),
      states_(size_t(store.config().num_hidden_layers) * 2) {}

RequestCache::~RequestCache() {
  for (size_t i = 0; i < tables_.size(); ++i)
    for (int32_t page : tables_[i]) store_.pool(CacheStream(i % 3)).unref(page);
}

std::vector<int64_t> RequestCache::pool_slots(int layer, CacheStream s, int64_t first, int64_t n,
                                              bool for_write) {
  const ModelConfig& c = store_.config();
  if (layer < 0 || layer >= c.num_hidden_layers) throw Error(fmt::format("cache: no layer {}", layer));
  PagePool& pool = store_.pool(s);
  const int ps = pool.page_rows();
  std::vector<int32_t>& t = table(layer, s);
  const int64_t W = c.sliding_window;
  if (s == CacheStream::window) {
    const int64_t known = std::max(length_, first + (for_write ? n : 0));
    if (first < 0 || n > W || first + n > known || (!for_write && first < length_ - W))
      throw Error(
          fmt::format("cache: layer {} window rows [{}, {}) are not among the last {} positions of {}", layer,
                      first, first + n, W, length_));
  } else if (first < 0 || (!for_write && first + n > int64_t(t.size()) * ps)) {
    throw Error(fmt::format("cache: layer {} {} rows [{}, {}) were never stored", layer, to_string(s), first,
                            first + n));
  }
  std::vector<int64_t> out(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) {
    const int64_t row = s == CacheStream::window ? (first + i) % W : first + i;  // ring slot or group
    const size_t page = size_t(row / ps);
    if (for_write) {
      while (t.size() <= page) t.push_back(pool.allocate());
      if (pool.refs(t[page]) > 1) t[page] = pool.copy_on_write(t[page]);
    }
    out[size_t(i)] = int64_t(t[page]) * ps + row % ps;
  }
  return out;
}

backend::Buffer<int64_t> RequestCache::device_slots(int layer, CacheStream s, int64_t first, int64_t n,
                                                    bool for_write) {
  const std::vector<int64_t> host = pool_slots(layer, s, first, n, for_write);
  backend::Buffer<int64_t> dev = store_.backend().longs(n);
  store_.backend().upload(dev.data(), host);
  return dev;
}

void RequestCache::load(int layer, CacheStream stream, int64_t first, int64_t n, float* dst) {
  if (n <= 0) return;
  const backend::Buffer<int64_t> dev = device_slots(layer, stream, first, n, false);
  PagePool& pool = store_.pool(stream);
  KvLoadParams p{.f = pool.format(),
                 .n = n,
                 .slot_ids = dev.data(),
                 .pool = pool.data(),
                 .dst = dst,
                 .ld = pool.format().dim};
  store_.backend().kv_load(p);
}

void RequestCache::store(int layer, CacheStream stream, int64_t first, int64_t n, const float* src) {
  if (n <= 0) return;
  const backend::Buffer<int64_t> dev = device_slots(layer, stream, first, n, true);
  PagePool& pool = store_.pool(stream);
  KvStoreParams p{.f = pool.format(),
                  .n = n,
                  .src = src,
                  .ld = pool.format().dim,
                  .slot_ids = dev.data(),
                  .pool = pool.data()};
  store_.backend().kv_store(p);
}

CompressorState& RequestCache::compressor_state(int layer, CacheStream stream) {
  if (layer < 0 || layer >= store_.config().num_hidden_layers || stream == CacheStream::window)
    throw Error(fmt::format("cache: no compressor state for layer {} stream {}", layer, to_string(stream)));
  return states_[size_t(layer) * 2 + (stream == CacheStream::indexer_keys ? 1 : 0)];
}

std::unique_ptr<RequestCache> RequestCache::fork() const {
  auto f = std::make_unique<RequestCache>(store_);
  f->length_ = length_;
  f->tables_ = tables_;
  for (size_t i = 0; i < tables_.size(); ++i)
    for (int32_t page : tables_[i]) store_.pool(CacheStream(i % 3)).ref(page);
  backend::Backend& be = store_.backend();
  for (size_t i = 0; i < states_.size(); ++i) {
    const CompressorState& a = states_[i];
    CompressorState& b = f->states_[i];
    b.row0 = a.row0;
    b.rows = a.rows;
    b.kvp = be.floats(a.kvp.size());
    b.sc = be.floats(a.sc.size());
    be.copy(b.kvp.data(), a.kvp.data(), a.kvp.bytes());
    be.copy(b.sc.data(), a.sc.data(), a.sc.bytes());
  }
  return f;
}

int64_t RequestCache::bytes() const {
  int64_t b = 0;
  for (size_t i = 0; i < tables_.size(); ++i)
    b += int64_t(tables_[i].size()) * store_.pool(CacheStream(i % 3)).page_bytes();
  for (const CompressorState& s : states_) b += int64_t(s.kvp.bytes() + s.sc.bytes());
  return b;
}

}  // namespace rollout
}  // namespace dsv4
