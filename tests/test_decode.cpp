// The decoding path (model/forward.h forward_chunk over rollout/kv_cache.h): a whole-sequence prefill,
// a chunked prefill and token-by-token decoding give the same bits for every reported tensor row,
// every decision and the logits, at every split point, in the built-in profiles (the deepseek-inference
// ones: FP4 indexer keys cached after their simulation, online softmax), on tiny and tiny-b, across
// the window and the compressor group edges; the cache rows decode to exactly the profile's FP8
// simulation.
#include <gtest/gtest.h>

#include <random>

#include "kernels/kvcache.h"
#include "kernels/quant.h"
#include "model/config.h"
#include "model/forward.h"
#include "rollout/kv_cache.h"
#include "rollout_test_util.h"
#include "test_util.h"
#include "tiny_model.h"

namespace dsv4 {
namespace {

using test::tiny;

std::vector<int32_t> tokens_for(const ModelConfig& c, int64_t T, uint64_t seed) {
  std::mt19937_64 g(seed);
  std::uniform_int_distribution<int32_t> d(0, c.vocab_size - 1);
  std::vector<int32_t> t(static_cast<size_t>(T));
  for (auto& x : t) x = d(g);
  return t;
}

struct Whole {
  test::RowCollector rows;
};

Whole run_whole(const Weights& w, const std::vector<int32_t>& toks, const NumericsProfile& p) {
  Whole r;
  RunOptions o;
  o.profile = p;
  o.observer = &r.rows;
  forward(w, {toks}, o);
  return r;
}

// Runs `toks` as consecutive chunks of the given sizes through one cache; returns the rows and the
// last logits of every chunk (keyed by the chunk's last position).
struct Chunked {
  test::RowCollector rows;
  std::map<int64_t, std::vector<float>> last_logits;
};
Chunked run_chunks(const Weights& w, const std::vector<int32_t>& toks, const NumericsProfile& p,
                   const std::vector<int64_t>& sizes, int page_rows = 16) {
  Chunked r;
  auto be = backend::make_backend(Device::cpu, w);
  rollout::CacheStore store(*be, w.config(), p, page_rows);
  rollout::RequestCache cache(store);
  RunOptions o;
  o.profile = p;
  o.observer = &r.rows;
  int64_t pos = 0;
  for (int64_t n : sizes) {
    std::vector<int32_t> chunk(toks.begin() + pos, toks.begin() + pos + n);
    SequenceResult s = forward_chunk(*be, w, 0, chunk, cache, o);
    pos += n;
    r.last_logits[pos - 1] = std::move(s.last_logits);
  }
  EXPECT_EQ(pos, int64_t(toks.size()));
  EXPECT_EQ(cache.length(), pos);
  return r;
}

std::vector<int64_t> split_at(int64_t T, std::vector<int64_t> cuts) {
  std::vector<int64_t> sizes;
  int64_t prev = 0;
  for (int64_t c : cuts) {
    if (c <= prev || c >= T) continue;
    sizes.push_back(c - prev);
    prev = c;
  }
  sizes.push_back(T - prev);
  return sizes;
}

// The logits row of position t from the whole-sequence rows.
std::vector<unsigned char> logits_row(const test::RowCollector& rows, int64_t t) {
  return rows.rows.at({0, -1, "logits", t});
}

void expect_equivalent(const Whole& whole, const Chunked& ch, const std::string& what) {
  EXPECT_EQ(ch.rows.duplicates, 0) << what;
  // logprobs are reported by whole-sequence forwards only (a chunk leaves the next token open).
  EXPECT_TRUE(test::rows_equal(whole.rows, ch.rows, {"logprobs"})) << what;
  EXPECT_TRUE(test::rows_equal(ch.rows, whole.rows)) << what << " (rows only the chunks report)";
  for (const auto& [t, logits] : ch.last_logits) {
    std::vector<unsigned char> b(logits.size() * 4);
    std::memcpy(b.data(), logits.data(), b.size());
    EXPECT_EQ(b, logits_row(whole.rows, t)) << what << ": last logits of the chunk ending at " << t;
  }
}

struct Case {
  const char* preset;
  const char* profile;
};

class DecodeEquivalence : public ::testing::TestWithParam<Case> {
 protected:
  const Weights& weights() const { return test::tiny_by_name(GetParam().preset); }
  NumericsProfile profile() const {
    if (std::string(GetParam().profile) != "fp8-fp32-scales") return profile_by_name(GetParam().profile);
    // FP8 the caches cannot store (fp32 scales, KV blocks of 96): simulated before the rows are cached.
    NumericsProfile p = profile_rollout();
    p.name = "fp8-fp32-scales";
    p.kv_quant_block = 96;
    p.kv_quant_scale = ScaleFmt::none;
    p.indexer_quant_scale = ScaleFmt::none;
    EXPECT_FALSE(p.fp8_kv_cache() || p.fp8_indexer_cache());
    return p;
  }
};

// Every split point of a sequence that crosses the window and several C4 groups (and, for tiny-b,
// K_i = 4 < T/4 so the indexer selects): prefill(k) then one token at a time.
TEST_P(DecodeEquivalence, PrefillThenDecodeAtEverySplit) {
  const Weights& w = weights();
  const int64_t T = 40;
  const auto toks = tokens_for(w.config(), T, 3);
  const Whole whole = run_whole(w, toks, profile());
  for (int64_t k = 1; k < T; ++k) {
    std::vector<int64_t> sizes{k};
    for (int64_t t = k; t < T; ++t) sizes.push_back(1);
    expect_equivalent(whole, run_chunks(w, toks, profile(), sizes), "prefill " + std::to_string(k));
    if (HasFailure()) return;
  }
}

// A longer sequence across the C128 group edges: whole ≡ chunks of several sizes ≡ token by token,
// and prefills split right at, before and after the window and group boundaries.
TEST_P(DecodeEquivalence, ChunkedAndDecodedAcrossGroupEdges) {
  const Weights& w = weights();
  const ModelConfig& c = w.config();
  const int64_t T = 300;
  const auto toks = tokens_for(c, T, 5);
  const Whole whole = run_whole(w, toks, profile());
  std::vector<int64_t> ones(static_cast<size_t>(T), 1);
  expect_equivalent(whole, run_chunks(w, toks, profile(), ones), "token by token");
  for (int64_t chunk : {3, 37, 128, 299}) {
    std::vector<int64_t> sizes;
    for (int64_t left = T; left > 0; left -= chunk) sizes.push_back(std::min(left, chunk));
    expect_equivalent(whole, run_chunks(w, toks, profile(), sizes, 64), "chunks of " + std::to_string(chunk));
  }
  const int64_t W = c.sliding_window;
  for (int64_t cut :
       {W - 1, W, W + 1, int64_t(127), int64_t(128), int64_t(129), int64_t(255), int64_t(256)}) {
    std::vector<int64_t> sizes = split_at(T, {cut, cut + 5});
    expect_equivalent(whole, run_chunks(w, toks, profile(), sizes, 1), "split at " + std::to_string(cut));
  }
}

INSTANTIATE_TEST_SUITE_P(Presets, DecodeEquivalence,
                         ::testing::Values(Case{"tiny", "train"}, Case{"tiny", "rollout"},
                                           Case{"tiny-b", "train"}, Case{"tiny-b", "rollout"},
                                           Case{"tiny", "deepseek-inference-v2"},
                                           Case{"tiny-b", "deepseek-inference"}, Case{"tiny", "fp8-fp32-scales"}),
                         [](const auto& info) {
                           std::string n = std::string(info.param.preset) + "_" + info.param.profile;
                           for (char& ch : n)
                             if (ch == '-') ch = '_';
                           return n;
                         });

// The cache's FP8 rows decode to exactly fp8_sim of what was stored (the property that lets a
// decoding engine read its history from FP8 storage and still match a prefill bit for bit).
TEST(KvRowCodec, DecodeOfEncodeIsFp8Sim) {
  std::mt19937_64 g(11);
  for (int block : {64, 128}) {
    const int64_t dim = 256, fp8 = block == 64 ? 192 : 256;
    const KvRowFormat f{.dim = dim, .fp8_dims = fp8, .block = block};
    std::vector<float> x = test::randn_bf16(g, size_t(dim * 50), 3.0f);
    for (int64_t i = 0; i < dim; ++i) x[size_t(i)] = 0.0f;  // an all-zero row
    x[size_t(dim + 3)] = 1e-30f;                            // a tiny value next to normal ones
    std::vector<uint8_t> pool(size_t(f.bytes() * 60));
    std::vector<int64_t> slots(50);
    for (int i = 0; i < 50; ++i) slots[size_t(i)] = 59 - i;  // rows land anywhere
    kv_store(KvStoreParams{
        .f = f, .n = 50, .src = x.data(), .ld = dim, .slot_ids = slots.data(), .pool = pool.data()});
    std::vector<float> y(x.size());
    kv_load(KvLoadParams{
        .f = f, .n = 50, .slot_ids = slots.data(), .pool = pool.data(), .dst = y.data(), .ld = dim});
    std::vector<float> want = x;
    fp8_sim(Fp8SimParams{
        .rows = 50, .cols = fp8, .ld = dim, .block = block, .fmt = ScaleFmt::ue8m0, .x = want.data()});
    EXPECT_TRUE(test::bitwise_equal(y, want)) << "block " << block;
    EXPECT_FALSE(test::bitwise_equal(y, x)) << "FP8 changed nothing: the test would not see a bf16 cache";
    EXPECT_EQ(f.bytes(), fp8 + fp8 / block + 2 * (dim - fp8));
  }
}

TEST(KvRowCodec, BadFormatsAreNamed) {
  EXPECT_STREQ(kv_row_format_check(KvRowFormat{.dim = 0}), "dim");
  EXPECT_STREQ(kv_row_format_check(KvRowFormat{.dim = 64, .fp8_dims = 100}), "fp8_dims");
  EXPECT_STREQ(kv_row_format_check(KvRowFormat{.dim = 64, .fp8_dims = 48, .block = 32}), "block");
  EXPECT_EQ(kv_row_format_check(KvRowFormat{.dim = 64, .fp8_dims = 64, .block = 32}), nullptr);
}

// The rollout profile's cache holds FP8 rows (smaller than bf16), the train profile's bf16.
TEST(CacheFormats, FollowTheProfile) {
  const ModelConfig& c = tiny().config();
  const auto r = rollout::cache_formats(c, profile_rollout());
  const auto t = rollout::cache_formats(c, profile_train());
  EXPECT_EQ(r.window.fp8_dims, c.nope_dim());
  EXPECT_EQ(t.window.fp8_dims, 0);
  EXPECT_LT(r.window.bytes(), t.window.bytes());
  EXPECT_EQ(r.indexer_keys.fp8_dims, c.index_head_dim);
}

}  // namespace
}  // namespace dsv4
