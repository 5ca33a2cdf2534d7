// The R3 adapters (adapters/): SGLang's and miles' layouts read into ExternalSequences with every
// pitfall of MODEL.md §6.6 refused by name, and a trace's decisions written back in those layouts.
#include <gtest/gtest.h>

#include <fmt/format.h>
#include <omp.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <random>
#include <set>

#include "adapters/base64.h"
#include "adapters/convert.h"
#include "adapters/miles.h"
#include "adapters/npy.h"
#include "adapters/r3.h"
#include "adapters/sglang.h"
#include "capture/external.h"
#include "capture/h5.h"
#include "capture/indexer_sets.h"
#include "capture/layout.h"
#include "capture/record.h"
#include "capture/trace_reader.h"
#include "capture/validate.h"
#include "cli_util.h"
#include "model/error.h"
#include "test_util.h"
#include "tiny_model.h"

namespace dsv4 {
namespace {

using json = nlohmann::json;
using test::TempDir;

// tiny: 6 layers, compress_ratios {0, 4, 128, 4, 128, 0} (C4 layers 1 and 3 = ordinals 0 and 1), hash
// layers 0 and 1, 8 experts, k = 2, index_topk = 8.
const ModelConfig& cfg() {
  static const ModelConfig c = preset("tiny");
  return c;
}

// The engine's indexer row for a row that sees `n` groups and fits: 0, 1, ..., n−1, then −1 (MODEL.md §6.2).
std::vector<int32_t> engine_row(int n, int width) {
  std::vector<int32_t> r(size_t(width), -1);
  for (int i = 0; i < std::min(n, width); ++i) r[size_t(i)] = i;
  return r;
}

// A request of T tokens with well-formed buffers at the engine's width (index_topk columns): routing
// row t of layer l is {(t + l) % E, (t + l + 1) % E} (hash layers too unless `tid2eid` is given), the
// indexer as the engine writes short rows. `rows` = T − 1, or T for the stop-edge row.
R3Request well_formed(const ModelConfig& c, int64_t T, int64_t rows, const Weights* tid2eid = nullptr) {
  R3Request q;
  q.origin = R3Origin{"dump.jsonl:1", "req-7", 0};
  for (int64_t t = 0; t < T; ++t) q.tokens.push_back(int32_t((t * 37 + 5) % c.vocab_size));
  const int L = c.num_hidden_layers, k = c.num_experts_per_tok, E = c.n_routed_experts;
  q.routed_experts.present = true;
  for (int64_t t = 0; t < rows; ++t)
    for (int l = 0; l < L; ++l)
      for (int j = 0; j < k; ++j) {
        int32_t v = int32_t((t + l + j) % E);
        if (tid2eid && c.is_hash_layer(l) && t < T)
          v = tid2eid->layer_i(l, "mlp.topk.tid2eid")[q.tokens[size_t(t)] * k + j];
        q.routed_experts.words.push_back(v);
      }
  q.indexer_topk.present = true;
  q.indexer_num_layers = c.num_c4_layers();
  for (int64_t t = 0; t < rows; ++t)
    for (int o = 0; o < c.num_c4_layers(); ++o) {
      const auto r = engine_row(int((t + 1) / 4), c.index_topk);
      q.indexer_topk.words.insert(q.indexer_topk.words.end(), r.begin(), r.end());
    }
  return q;
}

int32_t& routed_at(R3Request& q, const ModelConfig& c, int64_t t, int l, int j) {
  return q.routed_experts.words[size_t((t * c.num_hidden_layers + l) * c.num_experts_per_tok + j)];
}
int32_t& indexer_at(R3Request& q, const ModelConfig& c, int64_t t, int ordinal, int col, int width = -1) {
  if (width < 0) width = c.index_topk;
  return q.indexer_topk.words[size_t((t * c.num_c4_layers() + ordinal) * width + col)];
}

// An imported indexer layer's rows, [rows, width]: the importer hands them over encoded as sets
// (ascending, −1 after the valid ids), decoded back here.
std::vector<int32_t> ids_of(const ExternalIndexer& x) {
  return x.encoded ? x.encoded->sets() : x.ids;
}

std::string import_error(const ModelConfig& c, R3Request q, const Weights* w = nullptr) {
  std::vector<std::string> notes;
  try {
    r3_import(c, std::move(q), w, notes);
  } catch (const InputError& e) {
    return e.what();
  }
  return "(accepted)";
}

// ---- golden buffers ----------------------------------------------------------------------------------

TEST(Adapters, GoldenRoutingBufferOfThreeTokens) {
  // T = 3 → 2 rows × 6 layers × 2 ids, written out by hand in the engine's order (row, layer, slot).
  R3Request q;
  q.origin = R3Origin{"golden.json", "", 0};
  q.tokens = {10, 20, 30};
  q.routed_experts.present = true;
  q.routed_experts.words = {
      // row 0: layers 0..5 (0 and 1 are hash layers: their table ids, recorded like any other)
      1, 2, /**/ 3, 4, /**/ 5, 6, /**/ 7, 0, /**/ 2, 1, /**/ 6, 5,
      // row 1
      0, 7, /**/ 1, 6, /**/ 2, 5, /**/ 3, 4, /**/ 4, 3, /**/ 5, 2};
  std::vector<std::string> notes;
  const ExternalSequence s = r3_import(cfg(), q, nullptr, notes);
  ASSERT_EQ(s.routing.size(), 6u);
  EXPECT_TRUE(s.indexer.empty());
  EXPECT_TRUE(notes.empty());
  EXPECT_EQ(s.tokens, (std::vector<int32_t>{10, 20, 30}));
  for (const auto& r : s.routing) {
    EXPECT_EQ(r.rows, 2);
    EXPECT_EQ(r.k, 2);
  }
  EXPECT_EQ(s.routing[0].layer, 0);
  EXPECT_EQ(s.routing[0].ids, (std::vector<int32_t>{1, 2, 0, 7}));
  EXPECT_EQ(s.routing[3].ids, (std::vector<int32_t>{7, 0, 3, 4}));
  EXPECT_EQ(s.routing[5].ids, (std::vector<int32_t>{6, 5, 5, 2}));
}

TEST(Adapters, GoldenIndexerMapsC4OrdinalsToLayers) {
  // T = 9 → 8 rows × 2 C4 layers × 8 columns. Row t sees ⌊(t+1)/4⌋ groups: rows 0-2 none, 3-6 one,
  // row 7 two. Ordinal 0 is layer 1, ordinal 1 layer 3; ordinal 1 row 7 lists its groups out of order.
  const ModelConfig& c = cfg();
  R3Request q = well_formed(c, 9, 8);
  q.routed_experts = {};
  indexer_at(q, c, 7, 1, 0) = 1;
  indexer_at(q, c, 7, 1, 1) = 0;
  std::vector<std::string> notes;
  const ExternalSequence s = r3_import(c, q, nullptr, notes);
  ASSERT_EQ(s.indexer.size(), 2u);
  EXPECT_EQ(s.indexer[0].layer, 1);
  EXPECT_EQ(s.indexer[1].layer, 3);
  for (const auto& x : s.indexer) {
    EXPECT_EQ(x.rows, 8);
    // Stored at the runtime width min(index_topk, ⌊9/4⌋) = 2: columns 2..7 were −1 and are dropped.
    ASSERT_EQ(x.width, 2);
    const std::vector<int32_t> ids = ids_of(x);
    ASSERT_EQ(ids.size(), 16u);
    EXPECT_EQ(std::vector<int32_t>(ids.begin(), ids.begin() + 6),
              (std::vector<int32_t>{-1, -1, -1, -1, -1, -1}));
    EXPECT_EQ(std::vector<int32_t>(ids.begin() + 6, ids.begin() + 8), (std::vector<int32_t>{0, -1}));
  }
  // Rows become sets: ordinal 1's row 7, listed {1, 0}, is {0, 1}.
  const std::vector<int32_t> a = ids_of(s.indexer[0]), b = ids_of(s.indexer[1]);
  EXPECT_EQ(std::vector<int32_t>(a.end() - 2, a.end()), (std::vector<int32_t>{0, 1}));
  EXPECT_EQ(std::vector<int32_t>(b.end() - 2, b.end()), (std::vector<int32_t>{0, 1}));
}

TEST(Adapters, C4OrdinalsOfAnotherLayout) {
  // C4 layers 0, 2, 3 (ordinals 0, 1, 2): only layer 0 keeps its number. Each ordinal gets a marker
  // in row 7 so the mapping cannot be confused.
  ModelConfig c = cfg();
  c.compress_ratios = {4, 0, 4, 4, 128, 0};
  validate(c, "test");
  ASSERT_EQ(c.num_c4_layers(), 3);
  R3Request q = well_formed(c, 9, 8);
  indexer_at(q, c, 7, 0, 0) = 0, indexer_at(q, c, 7, 0, 1) = -1;  // ordinal 0: {0}
  indexer_at(q, c, 7, 1, 0) = 1, indexer_at(q, c, 7, 1, 1) = -1;  // ordinal 1: {1}
  indexer_at(q, c, 7, 2, 0) = 1, indexer_at(q, c, 7, 2, 1) = 0;   // ordinal 2: {1, 0}
  std::vector<std::string> notes;
  const ExternalSequence s = r3_import(c, q, nullptr, notes);
  ASSERT_EQ(s.indexer.size(), 3u);
  EXPECT_EQ(s.indexer[0].layer, 0);
  EXPECT_EQ(s.indexer[1].layer, 2);
  EXPECT_EQ(s.indexer[2].layer, 3);
  auto last = [](const ExternalIndexer& x) {
    const std::vector<int32_t> ids = ids_of(x);
    return std::vector<int32_t>(ids.end() - 2, ids.end());
  };
  EXPECT_EQ(last(s.indexer[0]), (std::vector<int32_t>{0, -1}));
  EXPECT_EQ(last(s.indexer[1]), (std::vector<int32_t>{1, -1}));
  EXPECT_EQ(last(s.indexer[2]), (std::vector<int32_t>{0, 1}));  // {1, 0} as a set
}

TEST(Adapters, StopEdgeRowIsDroppedWithANote) {
  const ModelConfig& c = cfg();
  R3Request q = well_formed(c, 9, 9);  // len(tokens) rows: one too many
  // The extra row is not the routing of any fed token: even an invalid one does not matter.
  routed_at(q, c, 8, 2, 0) = 99;
  std::vector<std::string> notes;
  const ExternalSequence s = r3_import(c, q, nullptr, notes);
  EXPECT_EQ(s.routing[2].rows, 8);
  EXPECT_EQ(s.routing[2].ids.size(), 16u);
  EXPECT_EQ(s.indexer[0].rows, 8);
  ASSERT_EQ(notes.size(), 2u);
  EXPECT_NE(notes[0].find("routed_experts: dropped the stop-edge row 8"), std::string::npos) << notes[0];
  EXPECT_NE(notes[1].find("indexer_topk: dropped the stop-edge row 8"), std::string::npos) << notes[1];
}

TEST(Adapters, RuntimeWidthBufferIsAccepted) {
  // A buffer at the runtime width min(index_topk, ⌊T/4⌋) (what a trainer's record holds) instead of
  // index_topk.
  const ModelConfig& c = cfg();
  R3Request q = well_formed(c, 9, 8);
  q.indexer_topk.words.clear();
  for (int t = 0; t < 8; ++t)
    for (int o = 0; o < 2; ++o) {
      const auto r = engine_row((t + 1) / 4, 2);
      q.indexer_topk.words.insert(q.indexer_topk.words.end(), r.begin(), r.end());
    }
  std::vector<std::string> notes;
  const ExternalSequence s = r3_import(c, q, nullptr, notes);
  EXPECT_EQ(s.indexer[1].width, 2);
  EXPECT_EQ(ids_of(s.indexer[1]).back(), 1);
}

TEST(Adapters, MultiTurnPrefixExtendsTheFirstTurn) {
  // Turn 2 re-sends turn 1's tokens and returns the whole prefix: its first rows are turn 1's rows.
  const ModelConfig& c = cfg();
  const R3Request turn1 = well_formed(c, 9, 8);
  R3Request turn2 = well_formed(c, 14, 13);
  ASSERT_TRUE(std::equal(turn1.tokens.begin(), turn1.tokens.end(), turn2.tokens.begin()));
  std::vector<std::string> notes;
  const ExternalSequence a = r3_import(c, turn1, nullptr, notes);
  const ExternalSequence b = r3_import(c, turn2, nullptr, notes);
  for (int l = 0; l < c.num_hidden_layers; ++l)
    EXPECT_TRUE(std::equal(a.routing[size_t(l)].ids.begin(), a.routing[size_t(l)].ids.end(),
                           b.routing[size_t(l)].ids.begin()))
        << "layer " << l;
  // Widths differ (2 for 9 tokens, 3 for 14); rows compare as sets.
  for (size_t o = 0; o < 2; ++o) {
    ASSERT_EQ(b.indexer[o].width, 3);
    const std::vector<int32_t> ia = ids_of(a.indexer[o]), ib = ids_of(b.indexer[o]);
    for (int64_t t = 0; t < 8; ++t) {
      std::set<int32_t> x, y;
      for (int j = 0; j < 2; ++j) x.insert(ia[size_t(t * 2 + j)]);
      for (int j = 0; j < 3; ++j) y.insert(ib[size_t(t * 3 + j)]);
      x.erase(-1), y.erase(-1);
      EXPECT_EQ(x, y) << "ordinal " << o << " row " << t;
    }
  }
}

// Incremental routing (SGLang's routed_experts_start_len = s): the buffer holds rows [s, T − 1) and
// rows [0, s) are an earlier turn's. Turn 1: 9 tokens, 8 rows. Turn 2: turn 1's 9 tokens + 5 more, sent
// with routed_experts_start_len = 8 (the rows turn 1 holds), so its buffer holds rows 8..12 only.
R3Request incremental_turn(const R3Request& whole, int64_t start) {
  R3Request q = whole;
  const int64_t Lk = cfg().num_hidden_layers * cfg().num_experts_per_tok;
  q.routed_experts.words.erase(q.routed_experts.words.begin(), q.routed_experts.words.begin() + start * Lk);
  q.routed_experts_start = start;
  return q;
}

TEST(Adapters, IncrementalRoutingTakesItsFirstRowsFromTheEarlierTurn) {
  const ModelConfig& c = cfg();
  R3Request turn1 = well_formed(c, 9, 8);
  turn1.origin = R3Origin{"dump.jsonl:1", "turn-1", 0};
  R3Request other = well_formed(c, 12, 11);  // another conversation in between, other tokens
  other.origin = R3Origin{"dump.jsonl:2", "other", 1};
  for (auto& t : other.tokens) t = (t + 1) % c.vocab_size;
  for (auto& w : other.routed_experts.words) w = (w + 3) % c.n_routed_experts;
  const R3Request whole2 = well_formed(c, 14, 13);
  R3Request turn2 = incremental_turn(whole2, 8);
  turn2.origin = R3Origin{"dump.jsonl:3", "turn-2", 2};
  ASSERT_EQ(turn2.routed_experts.words.size(), size_t(5 * c.num_hidden_layers * c.num_experts_per_tok));

  R3RoutingPrefixes prefixes;
  std::vector<std::string> notes;
  for (R3Request* q : {&turn1, &other}) {
    prefixes.complete(c, *q, notes);
    const std::string who = q->origin.describe();
    prefixes.keep(c, r3_import(c, *q, nullptr, notes), who);
  }
  EXPECT_TRUE(notes.empty());
  prefixes.complete(c, turn2, notes);
  EXPECT_EQ(turn2.routed_experts_start, 0);
  ASSERT_EQ(notes.size(), 1u);
  EXPECT_EQ(notes[0],
            "dump.jsonl:3: request 'turn-2' (#2): routed_experts rows [0, 8) (routed_experts_start_len) from "
            "dump.jsonl:1: request 'turn-1' (#0)");
  // The completed buffer is the whole turn's, word for word, and imports as the whole turn does.
  EXPECT_EQ(turn2.routed_experts.words, whole2.routed_experts.words);
  const ExternalSequence a = r3_import(c, turn2, nullptr, notes), b = r3_import(c, whole2, nullptr, notes);
  for (int l = 0; l < c.num_hidden_layers; ++l) EXPECT_EQ(a.routing[size_t(l)].ids, b.routing[size_t(l)].ids);

  // The stop-edge row may follow an incremental buffer too; it is dropped as usual.
  R3Request edge = incremental_turn(well_formed(c, 14, 14), 8);
  prefixes.complete(c, edge, notes);
  EXPECT_NO_THROW(r3_import(c, edge, nullptr, notes));
}

TEST(Adapters, IncrementalRoutingWithoutItsEarlierTurnIsRefusedByName) {
  const ModelConfig& c = cfg();
  const R3Request turn1 = well_formed(c, 9, 8);
  auto error_of = [&](R3Request q, const R3RoutingPrefixes& p) {
    std::vector<std::string> notes;
    try {
      p.complete(c, q, notes);
      r3_import(c, std::move(q), nullptr, notes);
    } catch (const InputError& e) {
      return std::string(e.what());
    }
    return std::string("(accepted)");
  };
  R3RoutingPrefixes none, with_turn1, budget0(0);
  std::vector<std::string> notes;
  with_turn1.keep(c, r3_import(c, turn1, nullptr, notes), "dump.jsonl:1: request #0");
  budget0.keep(c, r3_import(c, turn1, nullptr, notes), "dump.jsonl:1: request #0");
  EXPECT_EQ(with_turn1.bytes(), (8 * 6 * 2 + 9) * 4);
  EXPECT_EQ(budget0.bytes(), 0);
  EXPECT_EQ(budget0.dropped(), 1);

  const R3Request turn2 = incremental_turn(well_formed(c, 14, 13), 8);
  EXPECT_EQ(error_of(turn2, none),
            "dump.jsonl:1: request 'req-7' (#0): routed_experts starts at row 8 (routed_experts_start_len), "
            "and no request imported before it holds rows [0, 8) for the same first 8 tokens: import the "
            "conversation's earlier turns in the same command, before this one");
  EXPECT_NE(error_of(turn2, budget0).find("(1 earlier requests were not kept: past the 0 MiB kept for this; "
                                          "raise --prefix-memory)"),
            std::string::npos);
  // More rows than the earlier turn holds, or other tokens: not the same prefix.
  EXPECT_NE(error_of(incremental_turn(well_formed(c, 14, 13), 9), with_turn1).find("no request imported"),
            std::string::npos);
  R3Request changed = turn2;
  changed.tokens[3] = (changed.tokens[3] + 1) % c.vocab_size;
  EXPECT_NE(error_of(changed, with_turn1).find("no request imported"), std::string::npos);
  // A buffer that does not hold rows [start, T − 1).
  R3Request short_buffer = turn2;
  short_buffer.routed_experts.words.resize(short_buffer.routed_experts.words.size() - 12);
  EXPECT_EQ(error_of(short_buffer, with_turn1),
            "dump.jsonl:1: request 'req-7' (#0): routed_experts: 4 rows from routed_experts_start_len 8 for 14 "
            "tokens; the buffer covers rows [8, len(tokens) − 1) = 5 rows (or 6 with the stop-edge row)");
  // r3_import alone never takes an incremental buffer for a whole one.
  std::vector<std::string> n2;
  try {
    r3_import(c, turn2, nullptr, n2);
    ADD_FAILURE() << "an incremental buffer was imported as a whole one";
  } catch (const InputError& e) {
    EXPECT_NE(std::string(e.what()).find("an incremental buffer, whose rows [0, 8) are an earlier turn's"),
              std::string::npos)
        << e.what();
  }
}

TEST(Adapters, IncrementalStartOfAnExport) {
  const std::vector<int32_t> a = {1, 2, 3, 4, 5}, b = {1, 2, 3, 9, 9, 9, 9}, x = {7, 7};
  EXPECT_EQ(r3_incremental_start({}, b, -1), 0);
  EXPECT_EQ(r3_incremental_start({x}, b, -1), 0);
  EXPECT_EQ(r3_incremental_start({a}, b, -1), 3);      // the shared tokens
  EXPECT_EQ(r3_incremental_start({a}, b, 2), 2);       // at most the prompt (SGLang's range)
  EXPECT_EQ(r3_incremental_start({a}, a, -1), 4);      // at most the rows the earlier one holds, T − 1
  EXPECT_EQ(r3_incremental_start({x, a, x}, b, 6), 3); // the best of the earlier sequences
  EXPECT_EQ(r3_incremental_start({b}, {1, 2}, -1), 1); // a shorter sequence: its own T − 1
}

TEST(Adapters, HashLayersAgreeWithTid2eid) {
  const ModelConfig& c = test::tiny().config();
  R3Request q = well_formed(c, 9, 8, &test::tiny());
  std::vector<std::string> notes;
  EXPECT_NO_THROW(r3_import(c, q, &test::tiny(), notes));
  // Without weights there is nothing to compare with; with them a table disagreement is named.
  std::swap(routed_at(q, c, 4, 1, 0), routed_at(q, c, 4, 1, 1));  // same set: still fine
  EXPECT_NO_THROW(r3_import(c, q, &test::tiny(), notes));
  const int32_t* table = test::tiny().layer_i(1, "mlp.topk.tid2eid");
  const int32_t tok = q.tokens[4];
  int32_t other = 0;
  while (other == table[tok * 2] || other == table[tok * 2 + 1]) ++other;
  routed_at(q, c, 4, 1, 0) = other;
  EXPECT_NO_THROW(r3_import(c, q, nullptr, notes));
  const std::string e = import_error(c, q, &test::tiny());
  EXPECT_NE(e.find("request 'req-7'"), std::string::npos) << e;
  EXPECT_NE(e.find("layer 1 (C4 ordinal 0) (hash layer) row 4"), std::string::npos) << e;
  EXPECT_NE(e.find("tid2eid"), std::string::npos) << e;
}

// ---- pitfalls ------------------------------------------------------------------------------------

struct Pitfall {
  const char* name;
  std::function<void(R3Request&)> spoil;
  std::vector<std::string> expect;  // substrings of the message
};

TEST(Adapters, EveryPitfallIsRefusedByName) {
  const ModelConfig& c = cfg();
  const std::vector<Pitfall> cases = {
      {"routing all zero",
       [&](R3Request& q) { std::fill(q.routed_experts.words.begin(), q.routed_experts.words.end(), 0); },
       {"dump.jsonl:1: request 'req-7' (#0): routed_experts", "every layer, every row",
        "capturer was bound before it existed"}},
      {"routing all -1",
       [&](R3Request& q) { std::fill(q.routed_experts.words.begin(), q.routed_experts.words.end(), -1); },
       {"routed_experts", "capturer was bound before it existed"}},
      {"indexer all -1",
       [&](R3Request& q) { std::fill(q.indexer_topk.words.begin(), q.indexer_topk.words.end(), -1); },
       {"request 'req-7'", "indexer_topk", "rows 3.. see compressed groups", "capturer was bound"}},
      {"one indexer layer all zero",
       [&](R3Request& q) {
         for (int t = 0; t < 8; ++t)
           for (int j = 0; j < 8; ++j) indexer_at(q, c, t, 1, j) = 0;
       },
       {"indexer_topk layer 3 (C4 ordinal 1)", "all zero", "capturer was bound"}},
      {"one indexer layer all -1",
       [&](R3Request& q) {
         for (int t = 0; t < 8; ++t)
           for (int j = 0; j < 8; ++j) indexer_at(q, c, t, 0, j) = -1;
       },
       {"indexer_topk layer 1 (C4 ordinal 0) (hash layer) row 3", "capturer was bound"}},
      {"expert id out of range",
       [&](R3Request& q) { routed_at(q, c, 5, 4, 1) = 8; },
       {"routed_experts layer 4 row 5", "expert id 8 (slot 1) is outside [0, 8)"}},
      {"negative expert id",
       [&](R3Request& q) { routed_at(q, c, 2, 3, 0) = -1; },
       {"routed_experts layer 3 (C4 ordinal 1) row 2", "expert id -1"}},
      {"routing row not a set",
       [&](R3Request& q) { routed_at(q, c, 1, 2, 1) = routed_at(q, c, 1, 2, 0); },
       {"routed_experts layer 2 row 1", "appears twice"}},
      {"indexer row not a set",
       [&](R3Request& q) {
         indexer_at(q, c, 7, 1, 0) = 1;
         indexer_at(q, c, 7, 1, 1) = 1;
       },
       {"indexer_topk layer 3 (C4 ordinal 1) row 7", "group 1 appears twice"}},
      {"future position",
       [&](R3Request& q) { indexer_at(q, c, 3, 0, 1) = 1; },
       {"indexer_topk layer 1 (C4 ordinal 0) (hash layer) row 3", "position 1 is in the future",
        "sees compressed groups [0, 1)"}},
      {"future position on a row that sees none",
       [&](R3Request& q) { indexer_at(q, c, 2, 1, 0) = 0; },
       {"layer 3 (C4 ordinal 1) row 2", "position 0 is in the future"}},
      {"valid id beyond the runtime width",
       [&](R3Request& q) {
         indexer_at(q, c, 7, 1, 1) = -1;
         indexer_at(q, c, 7, 1, 5) = 1;
       },
       {"layer 3 (C4 ordinal 1) row 7", "column 5 holds 1", "runtime width min(index_topk, ⌊T/4⌋) = 2"}},
      {"indexer id below -1",
       [&](R3Request& q) { indexer_at(q, c, 4, 0, 3) = -2; },
       {"layer 1 (C4 ordinal 0) (hash layer) row 4", "column 3 holds -2"}},
      {"routing layer count",
       [&](R3Request& q) {  // 7 layers' worth of rows
         q.routed_experts.words.resize(size_t(8 * 7 * 2), 1);
       },
       {"routed_experts", "8 rows (len(tokens) − 1) × 7 layers", "the config has 6 layers"}},
      {"indexer layer count by global id",
       [&](R3Request& q) { q.indexer_num_layers = 6; },
       {"indexer_topk_num_layers is 6", "2 C4 layers", "indexed by global layer id"}},
      {"indexer width",
       [&](R3Request& q) {  // 5 columns
         q.indexer_topk.words.assign(size_t(8 * 2 * 5), -1);
       },
       {"indexer_topk", "width 5 is neither index_topk (8", "runtime width min(index_topk, ⌊T/4⌋) = 2"}},
      {"routing byte length",
       [&](R3Request& q) { q.routed_experts.words.pop_back(); },
       {"routed_experts", "not a whole number of rows of 6 layers × 2 ids"}},
      {"indexer byte length",
       [&](R3Request& q) { q.indexer_topk.words.pop_back(); },
       {"indexer_topk", "not a whole number of rows of 2 C4 layers"}},
      {"row count",
       [&](R3Request& q) { q.routed_experts.words.resize(size_t(5 * 6 * 2)); },
       {"routed_experts: 5 rows for 9 tokens", "len(tokens) − 1 = 8"}},
      {"token outside the vocabulary",
       [&](R3Request& q) { q.tokens[3] = 512; },
       {"request 'req-7'", "token 512 at position 3"}},
      {"npy shape of the routing",
       [&](R3Request& q) {
         q.routed_experts.shape = {8, 6, 3};
       },
       {"routed_experts: shape [8, 6, 3] holds 3 ids per row", "num_experts_per_tok"}},
  };
  for (const Pitfall& p : cases) {
    R3Request q = well_formed(c, 9, 8);
    {
      std::vector<std::string> notes;
      ASSERT_NO_THROW(r3_import(c, q, nullptr, notes)) << p.name << ": the unspoiled request must pass";
    }
    p.spoil(q);
    const std::string e = import_error(c, q);
    for (const std::string& s : p.expect) EXPECT_NE(e.find(s), std::string::npos) << p.name << ": " << e;
  }
}

TEST(Adapters, WordsRefuseAPartialInt32) {
  const std::vector<uint8_t> seven(7, 0);
  try {
    r3_words(seven, R3Origin{"f.json", "abc", 2}, "routed_experts");
    FAIL() << "accepted 7 bytes";
  } catch (const InputError& e) {
    EXPECT_NE(std::string(e.what()).find("f.json: request 'abc' (#2): routed_experts holds 7 bytes"),
              std::string::npos)
        << e.what();
  }
}

// ---- SGLang responses --------------------------------------------------------------------------------

TEST(Adapters, Base64MatchesTheStandardAlphabet) {
  // int32 [1, 2] little-endian, and 5 bytes (one '=' of padding), as Python's base64 writes them.
  std::string err;
  EXPECT_EQ(base64_decode("AQAAAAIAAAA=", err), (std::vector<uint8_t>{1, 0, 0, 0, 2, 0, 0, 0}));
  EXPECT_TRUE(err.empty());
  EXPECT_EQ(base64_encode(std::vector<uint8_t>{1, 0, 0, 0, 2, 0, 0, 0}), "AQAAAAIAAAA=");
  EXPECT_EQ(base64_encode(std::vector<uint8_t>{0xff, 0xfe, 0x7f, 0x00, 0x41}), "//5/AEE=");
  EXPECT_EQ(base64_decode("//5/AEE=", err), (std::vector<uint8_t>{0xff, 0xfe, 0x7f, 0x00, 0x41}));
  base64_decode("AQA*AAIA", err);
  EXPECT_NE(err.find("offset 3"), std::string::npos) << err;
  base64_decode("AQAAA", err);
  EXPECT_NE(err.find("not a multiple of 4"), std::string::npos) << err;
}

// The decoders (vector blocks of 32 characters, the table decoder for the rest and for any block holding
// '=' or a stranger) against a decoder written the long way: each character's index in the alphabet,
// 6 bits at a time into an accumulator.
std::vector<uint8_t> decode_long_way(const std::string& text) {
  const std::string alphabet = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
  std::vector<uint8_t> out;
  uint32_t acc = 0;
  int bits = 0;
  for (char ch : text) {
    if (ch == '=') break;
    acc = (acc << 6) | uint32_t(alphabet.find(ch));
    bits += 6;
    if (bits >= 8) {
      bits -= 8;
      out.push_back(uint8_t(acc >> bits));
    }
  }
  return out;
}

TEST(Adapters, Base64DecodersAgreeWithTheLongWay) {
  std::mt19937 rng(11);
  for (size_t n : {0, 1, 2, 3, 23, 24, 25, 47, 48, 49, 71, 72, 95, 96, 97, 300, 1000, 4099}) {
    std::vector<uint8_t> bytes(n);
    for (auto& b : bytes) b = uint8_t(rng());
    const std::string text = base64_encode(bytes);
    ASSERT_EQ(decode_long_way(text), bytes) << n;
    std::string err;
    EXPECT_EQ(base64_decode(text, err), bytes) << n << " " << err;
    // Every piece [from, from + len) decoded on its own.
    for (size_t from = 0; from < std::min<size_t>(n, 80); ++from)
      for (size_t len = 0; from + len <= n && len < 80; len += 7) {
        std::vector<uint8_t> piece(len + 1, 0xcd);
        ASSERT_TRUE(base64_decode_range(text, from, len, piece.data())) << n << " " << from << " " << len;
        EXPECT_TRUE(std::equal(piece.begin(), piece.begin() + int64_t(len), bytes.begin() + int64_t(from)));
        EXPECT_EQ(piece[len], 0xcd) << "wrote past the piece";
      }
  }
  // Every byte value at every position of a 64-character text (two vector blocks): accepted exactly
  // when it is in the alphabet or '='.
  const std::string alphabet = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
  std::vector<uint8_t> bytes(48);
  for (auto& b : bytes) b = uint8_t(rng());
  const std::string good = base64_encode(bytes);
  ASSERT_EQ(good.size(), 64u);
  for (size_t at : {0, 5, 31, 32, 63})
    for (int v = 0; v < 256; ++v) {
      std::string t = good;
      t[at] = char(v);
      std::vector<uint8_t> out(48);
      const bool want = alphabet.find(char(v)) != std::string::npos || v == '=';
      EXPECT_EQ(base64_decode_range(t, 0, 48, out.data()), want) << "byte " << v << " at " << at;
      if (want && v != '=') {
        EXPECT_EQ(out, decode_long_way(t)) << "byte " << v << " at " << at;
      }
    }
}

std::string b64(const std::vector<int32_t>& w) {
  return base64_encode(std::span<const uint8_t>(reinterpret_cast<const uint8_t*>(w.data()), w.size() * 4));
}

// An SGLang response of a well-formed request: prompt of `P` tokens.
json response_of(const R3Request& q, size_t P, const std::string& id) {
  json r;
  r["text"] = "...";
  r["input_ids"] = std::vector<int32_t>(q.tokens.begin(), q.tokens.begin() + int64_t(P));
  r["output_ids"] = std::vector<int32_t>(q.tokens.begin() + int64_t(P), q.tokens.end());
  r["meta_info"] = {{"id", id},
                    {"finish_reason", {{"type", "length"}}},
                    {"prompt_tokens", P},
                    {"completion_tokens", q.tokens.size() - P},
                    {"routed_experts", b64(q.routed_experts.words)},
                    {"indexer_topk", b64(q.indexer_topk.words)},
                    {"indexer_topk_num_layers", q.indexer_num_layers}};
  return r;
}

std::vector<ExternalSequence> read_all(const std::string& path, std::vector<std::string>& notes) {
  std::vector<ExternalSequence> out;
  sglang_read(
      path, [&](R3Request&& q) { out.push_back(r3_import(cfg(), std::move(q), nullptr, notes)); }, notes);
  return out;
}

// Indexer rows the way engines write them: a random set of the visible groups (up to index_topk of
// them), in random order, −1 after it; so rows go through the encoder's unsorted path.
void randomize_indexer(R3Request& q, const ModelConfig& c, uint64_t seed) {
  std::mt19937_64 rng(seed);
  const int64_t rows = int64_t(q.indexer_topk.words.size()) / (c.num_c4_layers() * c.index_topk);
  for (int64_t t = 0; t < rows; ++t)
    for (int o = 0; o < c.num_c4_layers(); ++o) {
      const int64_t visible = (t + 1) / 4, picks = std::min<int64_t>(visible, c.index_topk);
      std::vector<int32_t> all(static_cast<size_t>(visible));
      for (int64_t g = 0; g < visible; ++g) all[size_t(g)] = int32_t(g);
      std::shuffle(all.begin(), all.end(), rng);
      for (int j = 0; j < c.index_topk; ++j) indexer_at(q, c, t, o, j) = j < picks ? all[size_t(j)] : -1;
    }
}

// `dsv4 import` streams the indexer rows into the trace as they are checked (ChunkFile, on every
// thread); the trace must hold what the held import (every row encoded in memory, written by
// add_sequence) holds, and its bytes must not depend on the thread count. Requests of 9 tokens (uint8
// gaps, one chunk), 301 and 5000 (uint16 gaps; the last fills two 32768-value chunks per layer).
TEST(Adapters, StreamedImportIsTheHeldImportAtAnyThreadCount) {
  TempDir d;
  {
    std::ofstream f(d / "r.jsonl");
    int i = 0;
    for (int64_t T : {9, 301, 5000}) {
      R3Request q = well_formed(cfg(), T, T - 1);
      randomize_indexer(q, cfg(), uint64_t(T));
      f << response_of(q, size_t(T / 3), "r" + std::to_string(i++)).dump() << "\n";
    }
  }
  ExternalModel m;
  m.config_json = config_to_json(cfg());
  auto import_to = [&](const std::string& out, bool streamed, int threads) {
    const int before = omp_get_max_threads();
    omp_set_num_threads(threads);
    auto w = ExternalTraceWriter::create(out, m);
    ExternalStepSpec spec;
    spec.engine = "sglang";
    w->begin_step(spec);
    IndexerEncoders enc;
    if (streamed) enc = [&](int64_t T, int n) { return w->stream_indexer_layers(T, n, true); };
    import_sglang(
        {d / "r.jsonl"}, cfg(), nullptr, [&](ExternalSequence&& x) { w->add_sequence(x); }, nullptr, enc);
    w->end_step();
    w->close();
    omp_set_num_threads(before);
  };
  const std::string held = d / "held.h5", one = d / "one.h5", two = d / "two.h5";
  import_to(held, false, 2);
  import_to(one, true, 1);
  import_to(two, true, 2);
  const TraceReader rh = TraceReader::open(held), r1 = TraceReader::open(one), r2 = TraceReader::open(two);
  int64_t valid = 0;
  for (int s = 0; s < 3; ++s)
    for (int l = 0; l < cfg().num_hidden_layers; ++l) {
      if (cfg().c4_ordinal(l) < 0) continue;
      const IndexerRecord h = *rh.indexer(0, s, l), a = *r1.indexer(0, s, l), b = *r2.indexer(0, s, l);
      ASSERT_EQ(a.ids, h.ids) << "seq " << s << " layer " << l;
      ASSERT_EQ(b.ids, h.ids) << "seq " << s << " layer " << l;
      valid += std::count_if(h.ids.begin(), h.ids.end(), [](int32_t g) { return g >= 0; });
    }
  EXPECT_GT(valid, 2 * 32768);
  EXPECT_TRUE(validate_trace(one).ok());
  // One thread or two: the same chunks written in the same order. The files differ only where the
  // environment records the thread count, so compare every dataset's stored bytes.
  h5::Id fapl1 = h5::file_access(true, false), fapl2 = h5::file_access(true, false);
  h5::Object f1 = h5::open_file(one, H5F_ACC_RDONLY, fapl1.get()),
             f2 = h5::open_file(two, H5F_ACC_RDONLY, fapl2.get());
  using namespace trace_layout;
  for (int s = 0; s < 3; ++s)
    for (int layer : {1, 3}) {
      const std::string g =
          step_path(0).substr(1) + "/" + seq_name(s) + "/" + decisions_path(layer) + "/" + kIndexerGaps;
      EXPECT_EQ(h5::storage_bytes(h5::open(f1, g)), h5::storage_bytes(h5::open(f2, g))) << g;
    }
  EXPECT_EQ(std::filesystem::file_size(one), std::filesystem::file_size(two));
}

TEST(Adapters, SglangJsonJsonlAndArraysReadTheSame) {
  TempDir d;
  const R3Request a = well_formed(cfg(), 9, 8), b = well_formed(cfg(), 14, 14);  // b with the stop-edge row
  const json ra = response_of(a, 5, "A"), rb = response_of(b, 6, "B");
  {
    std::ofstream(d / "one.json") << ra.dump(2);
    std::ofstream(d / "two.jsonl") << ra.dump() << "\n\n" << rb.dump() << "\n";
    std::ofstream(d / "array.json") << json::array({ra, rb}).dump(1);
  }
  std::vector<std::string> notes;
  const auto one = read_all(d / "one.json", notes);
  const auto two = read_all(d / "two.jsonl", notes);
  const auto arr = read_all(d / "array.json", notes);
  ASSERT_EQ(one.size(), 1u);
  ASSERT_EQ(two.size(), 2u);
  ASSERT_EQ(arr.size(), 2u);
  EXPECT_EQ(one[0].id, "A");
  EXPECT_EQ(one[0].tokens, a.tokens);
  EXPECT_EQ(one[0].prompt_length, 5);
  EXPECT_EQ(two[1].id, "B");
  EXPECT_EQ(two[1].prompt_length, 6);
  EXPECT_EQ(two[1].routing[4].rows, 13);
  for (size_t i = 0; i < 2; ++i) {
    EXPECT_EQ(two[i].tokens, arr[i].tokens);
    for (size_t l = 0; l < 6; ++l) EXPECT_EQ(two[i].routing[l].ids, arr[i].routing[l].ids);
    for (size_t o = 0; o < 2; ++o) EXPECT_EQ(ids_of(two[i].indexer[o]), ids_of(arr[i].indexer[o]));
  }
  // The JSONL line and the request are named in the stop-edge note.
  bool noted = false;
  for (const auto& n : notes)
    noted |=
        n.find("two.jsonl:3: request 'B' (#1): routed_experts: dropped the stop-edge") != std::string::npos;
  EXPECT_TRUE(noted);
}

// The base64 fields are decoded where they stand in the text unless something is unusual (an escape in
// the string, a repeated key, text that is not JSON...), when the text is parsed whole: both read the same.
TEST(Adapters, SglangLiftedAndWholeParsesAgree) {
  TempDir d;
  const R3Request a = well_formed(cfg(), 9, 8), b = well_formed(cfg(), 14, 13);
  const json ra = response_of(a, 5, "A"), rb = response_of(b, 6, "B");
  std::string plain = ra.dump();
  // The string's first character written as a \u escape: the whole text goes through nlohmann.
  std::string escaped = plain;
  const size_t at = escaped.find("\"routed_experts\":\"") + 18;
  char u[8];
  std::snprintf(u, sizeof u, "\\u%04x", unsigned(uint8_t(escaped[at])));
  escaped.replace(at, 1, u);
  // Sixteen characters of the indexer's text escaped (80 more characters, 60 more bytes): its length
  // still reads as whole int32 values, so the escapes are met by the decoder, which refuses the
  // backslash; the text is then read through its escapes.
  std::string escaped4 = plain;
  const size_t at4 = escaped4.find("\"indexer_topk\":\"") + 16;
  for (int i = 15; i >= 0; --i) {
    std::snprintf(u, sizeof u, "\\u%04x", unsigned(uint8_t(escaped4[at4 + size_t(i) * 3])));
    escaped4.replace(at4 + size_t(i) * 3, 1, u);
  }
  {
    std::ofstream(d / "escaped4.jsonl") << escaped4 << "\n" << rb.dump() << "\n";
    std::ofstream(d / "plain.jsonl") << plain << "\n" << rb.dump() << "\n";
    std::ofstream(d / "escaped.jsonl") << escaped << "\n" << rb.dump() << "\n";
    // A repeated key: nlohmann keeps the last value.
    json rdup = ra;
    std::string dup = rdup.dump();
    dup.insert(dup.find("\"routed_experts\""), "\"routed_experts\":\"AAAA\",");
    std::ofstream(d / "dup.jsonl") << dup << "\n";
    std::ofstream(d / "array.json") << "[" << plain << " ,\n" << rb.dump() << "]\n";
    std::ofstream(d / "bad_array.json") << "[" << plain << ",\n" << rb.dump() << " x]\n";
    std::ofstream(d / "bad_line.jsonl") << plain << "\n" << rb.dump().substr(1) << "\n";
  }
  std::vector<std::string> notes;
  const auto p = read_all(d / "plain.jsonl", notes);
  for (const char* f : {"escaped.jsonl", "escaped4.jsonl", "dup.jsonl", "array.json"}) {
    const auto e = read_all(d / f, notes);
    ASSERT_GE(e.size(), 1u) << f;
    for (size_t i = 0; i < e.size(); ++i) {
      EXPECT_EQ(e[i].tokens, p[i].tokens) << f;
      for (size_t l = 0; l < 6; ++l) EXPECT_EQ(e[i].routing[l].ids, p[i].routing[l].ids) << f;
      for (size_t o = 0; o < 2; ++o) EXPECT_EQ(ids_of(e[i].indexer[o]), ids_of(p[i].indexer[o])) << f;
    }
  }
  // A malformed array: the elements before the error are handled once, then nlohmann's message.
  int handled = 0;
  try {
    sglang_read(
        d / "bad_array.json", [&](R3Request&&) { ++handled; }, notes);
    ADD_FAILURE() << "bad_array.json read";
  } catch (const InputError& e) {
    EXPECT_NE(std::string(e.what()).find("not JSON"), std::string::npos) << e.what();
  }
  EXPECT_EQ(handled, 2);
  handled = 0;
  try {
    sglang_read(
        d / "bad_line.jsonl", [&](R3Request&&) { ++handled; }, notes);
    ADD_FAILURE() << "bad_line.jsonl read";
  } catch (const InputError& e) {
    EXPECT_NE(std::string(e.what()).find("bad_line.jsonl:2: not JSON"), std::string::npos) << e.what();
  }
  EXPECT_EQ(handled, 1);
  // sglang_parse names the origin of text that is not JSON.
  try {
    sglang_parse(plain.substr(0, plain.size() - 1), R3Origin{"x.jsonl:7", "", 0}, notes);
    ADD_FAILURE() << "truncated text parsed";
  } catch (const InputError& e) {
    EXPECT_NE(std::string(e.what()).find("x.jsonl:7: request #0: not JSON"), std::string::npos) << e.what();
  }
}

TEST(Adapters, SglangTokensFromOutputTokenLogprobsAndCompleteLogprobs) {
  TempDir d;
  const R3Request a = well_formed(cfg(), 9, 8);
  json r = response_of(a, 5, "A");
  r.erase("output_ids");
  json out_lp = json::array(), in_lp = json::array();
  for (size_t p = 5; p < 9; ++p) out_lp.push_back({-0.5 * double(p), a.tokens[p], nullptr});
  in_lp.push_back({nullptr, a.tokens[0], nullptr});
  for (size_t p = 1; p < 5; ++p) in_lp.push_back({-0.25 * double(p), a.tokens[p], nullptr});
  r["meta_info"]["output_token_logprobs"] = out_lp;
  std::ofstream(d / "a.json") << r.dump();
  std::vector<std::string> notes;
  auto s = read_all(d / "a.json", notes);
  ASSERT_EQ(s.size(), 1u);
  EXPECT_EQ(s[0].tokens, a.tokens);
  EXPECT_TRUE(s[0].logprobs.empty());  // response only: not stored
  ASSERT_FALSE(notes.empty());
  EXPECT_NE(notes[0].find("log-probs of the response only"), std::string::npos) << notes[0];

  r["meta_info"]["input_token_logprobs"] = in_lp;
  std::ofstream(d / "b.json") << r.dump();
  notes.clear();
  s = read_all(d / "b.json", notes);
  EXPECT_TRUE(notes.empty());
  ASSERT_EQ(s[0].logprobs.size(), 8u);  // logprobs[t] = log p(tokens[t + 1])
  EXPECT_FLOAT_EQ(s[0].logprobs[0], -0.25f);
  EXPECT_FLOAT_EQ(s[0].logprobs[3], -1.0f);
  EXPECT_FLOAT_EQ(s[0].logprobs[4], -2.5f);
  EXPECT_FLOAT_EQ(s[0].logprobs[7], -4.0f);
}

TEST(Adapters, SglangResponsesThatCannotBeReadAreNamed) {
  TempDir d;
  const R3Request a = well_formed(cfg(), 9, 8);
  auto expect_error = [&](const json& r, const std::string& want) {
    std::ofstream(d / "bad.jsonl") << response_of(a, 5, "ok").dump() << "\n" << r.dump() << "\n";
    std::vector<std::string> notes;
    try {
      read_all(d / "bad.jsonl", notes);
      ADD_FAILURE() << "accepted: " << want;
    } catch (const InputError& e) {
      EXPECT_NE(std::string(e.what()).find(want), std::string::npos) << e.what();
    }
  };
  json r = response_of(a, 5, "x");
  r.erase("input_ids");
  expect_error(r, "bad.jsonl:2: request 'x' (#1): no input_ids");
  r = response_of(a, 5, "x");
  r["meta_info"]["prompt_tokens"] = 6;
  expect_error(r, "request 'x' (#1): meta_info.prompt_tokens is 6 but input_ids holds 5 tokens");
  r = response_of(a, 5, "x");
  r["meta_info"]["routed_experts"] = "AAAA*AAA";
  expect_error(r, "request 'x' (#1): meta_info.routed_experts: not base64");
  r = response_of(a, 5, "x");
  r["meta_info"]["routed_experts"] = "AAAAAAA=";  // 5 bytes
  expect_error(r, "request 'x' (#1): routed_experts holds 5 bytes");
  r = response_of(a, 5, "x");
  r["meta_info"].erase("routed_experts");
  r["meta_info"].erase("indexer_topk");
  expect_error(r, "neither routed_experts nor indexer_topk");
  r = response_of(a, 5, "x");
  r["routed_experts_start_len"] = 6;
  expect_error(r, "request 'x' (#1): routed_experts_start_len is 6; SGLang accepts [0, prompt_tokens] = [0, 5]");
  r = response_of(a, 5, "x");
  r["meta_info"]["routed_experts_start_len"] = "2";
  expect_error(r, "request 'x' (#1): meta_info.routed_experts_start_len is \"2\", not an integer");
  r = response_of(a, 5, "x");
  r["routed_experts_start_len"] = 2;
  r["meta_info"]["routed_experts_start_len"] = 3;
  expect_error(r, "routed_experts_start_len is 2 but meta_info.routed_experts_start_len 3");
  std::ofstream(d / "broken.jsonl") << "{\"meta_info\": {}}\n{\"meta_info\": \n";
  std::vector<std::string> notes;
  try {
    read_all(d / "broken.jsonl", notes);
    ADD_FAILURE() << "accepted broken JSON";
  } catch (const InputError& e) {
    EXPECT_NE(std::string(e.what()).find("broken.jsonl:1"), std::string::npos) << e.what();
  }
}

// ---- .npy / .npz -------------------------------------------------------------------------------------

// A python3 with numpy, or "" (the tests that need numpy's own files skip then).
std::string numpy_python() {
  for (const char* p : {"python3", "/usr/bin/python3"}) {
    const std::string cmd = std::string(p) + " -c 'import numpy' >/dev/null 2>&1";
    if (std::system(cmd.c_str()) == 0) return p;
  }
  return "";
}

int run_python(const std::string& py, const std::string& script) {
  TempDir d;
  std::ofstream(d / "s.py") << script;
  return std::system((py + " " + (d / "s.py")).c_str());
}

std::vector<uint8_t> file_bytes(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  return std::vector<uint8_t>((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
}

TEST(Adapters, NpyReadsWhatNumpyWroteAndRefusesTheRest) {
  const std::string py = numpy_python();
  if (py.empty()) GTEST_SKIP() << "no python3 with numpy: cannot produce numpy's own .npy files";
  TempDir d;
  ASSERT_EQ(
      run_python(
          py,
          "import numpy as np\n"
          "d = '" +
              d.dir.string() +
              "'\n"
              "np.save(d + '/i4.npy', np.arange(24, dtype='<i4').reshape(2, 3, 4) - 5)\n"
              "np.save(d + '/i8.npy', np.array([7, 8, 9], dtype=np.int64))\n"
              "np.save(d + '/f4.npy', np.array([0.5, -1.25], dtype=np.float32))\n"
              "np.save(d + '/scalar.npy', np.int64(42))\n"
              "np.save(d + '/fortran.npy', np.asfortranarray(np.zeros((2, 3), dtype='<i4')))\n"
              "np.save(d + '/big.npy', np.zeros(3, dtype='>i4'))\n"
              "np.save(d + '/f8.npy', np.zeros(3, dtype=np.float64))\n"
              "np.lib.format.write_array(open(d + '/v2.npy', 'wb'), np.ones((3,), '<i4'), version=(2, 0))\n"),
      0);
  const NpyArray i4 = npy_parse(file_bytes(d / "i4.npy"), "i4.npy");
  EXPECT_EQ(i4.shape, (std::vector<int64_t>{2, 3, 4}));
  const auto v = npy_int32(i4, "i4.npy");
  ASSERT_EQ(v.size(), 24u);
  EXPECT_EQ(v[0], -5);
  EXPECT_EQ(v[23], 18);
  EXPECT_EQ(npy_int32(npy_parse(file_bytes(d / "i8.npy"), "i8"), "i8", true),
            (std::vector<int32_t>{7, 8, 9}));
  EXPECT_THROW(npy_int32(npy_parse(file_bytes(d / "i8.npy"), "i8"), "i8"), InputError);
  EXPECT_EQ(npy_float32(npy_parse(file_bytes(d / "f4.npy"), "f4"), "f4"), (std::vector<float>{0.5f, -1.25f}));
  const NpyArray sc = npy_parse(file_bytes(d / "scalar.npy"), "scalar");
  EXPECT_TRUE(sc.shape.empty());
  EXPECT_EQ(npy_scalar_int(sc, "scalar"), 42);
  EXPECT_EQ(npy_int32(npy_parse(file_bytes(d / "v2.npy"), "v2"), "v2"), (std::vector<int32_t>{1, 1, 1}));
  auto refused = [&](const char* name, const std::string& want) {
    try {
      npy_parse(file_bytes(d / name), std::string("s.npz: ") + name);
      ADD_FAILURE() << name << " accepted";
    } catch (const InputError& e) {
      EXPECT_NE(std::string(e.what()).find(std::string("s.npz: ") + name + ": " + want), std::string::npos)
          << e.what();
    }
  };
  refused("fortran.npy", "Fortran-order");
  refused("big.npy", "dtype '>i4' is big-endian");
  refused("f8.npy", "dtype '<f8' is not supported");
  // A truncated file: the data does not match the shape.
  auto cut = file_bytes(d / "i4.npy");
  cut.resize(cut.size() - 4);
  EXPECT_THROW(npy_parse(cut, "cut"), InputError);
}

TEST(Adapters, NpyWriterRoundTripsThroughNumpy) {
  const std::vector<int32_t> v = {3, -1, 7, 0, 5, 6};
  const auto bytes = npy_encode_int32(v, {1, 2, 3});
  EXPECT_EQ(bytes.size() % 64, 24u);  // header padded to 64 bytes; 24 data bytes
  const NpyArray a = npy_parse(bytes, "mine");
  EXPECT_EQ(a.shape, (std::vector<int64_t>{1, 2, 3}));
  EXPECT_EQ(npy_int32(a, "mine"), v);
  const std::string py = numpy_python();
  if (py.empty()) GTEST_SKIP() << "no python3 with numpy: checked our own reader only";
  TempDir d;
  std::ofstream(d / "m.npy", std::ios::binary)
      .write(reinterpret_cast<const char*>(bytes.data()), int64_t(bytes.size()));
  EXPECT_EQ(run_python(py, "import numpy as np\na = np.load('" + (d / "m.npy") +
                               "')\nassert a.dtype == np.int32 and a.shape == (1, 2, 3), (a.dtype, a.shape)\n"
                               "assert a.ravel().tolist() == [3, -1, 7, 0, 5, 6]\n"),
            0);
}

TEST(Adapters, MilesSampleFromNumpysNpzAndNpyDirectory) {
  const std::string py = numpy_python();
  if (py.empty()) GTEST_SKIP() << "no python3 with numpy: cannot produce numpy's own .npz files";
  TempDir d;
  const R3Request q = well_formed(cfg(), 9, 8);
  // The buffers go to Python as lists; numpy writes them as miles would.
  json j;
  j["tokens"] = q.tokens;
  j["re"] = q.routed_experts.words;
  j["ix"] = q.indexer_topk.words;
  std::ofstream(d / "q.json") << j.dump();
  ASSERT_EQ(
      run_python(py,
                 "import json, os, numpy as np\nd = '" + d.dir.string() +
                     "'\nj = json.load(open(d + '/q.json'))\n"
                     "t = np.array(j['tokens'])\n"  // numpy's default int64
                     "re = np.array(j['re'], dtype=np.int32).reshape(8, 6, 2)\n"
                     "ix = np.array(j['ix'], dtype=np.int32).reshape(8, 2, 8)\n"
                     "np.savez(d + '/s0.npz', tokens=t, rollout_routed_experts=re, rollout_indexer_topk=ix, "
                     "response_length=np.int64(4))\n"
                     "np.savez_compressed(d + '/s1.npz', tokens=t, rollout_routed_experts=re)\n"
                     "os.mkdir(d + '/s2')\n"
                     "np.save(d + '/s2/tokens.npy', t.astype(np.int32))\n"
                     "np.save(d + '/s2/rollout_indexer_topk.npy', ix)\n"
                     "np.savez(d + '/bad.npz', tokens=t, rollout_routed_experts=re.astype(np.int64))\n"),
      0);
  std::vector<std::string> notes;
  std::vector<ExternalSequence> got;
  const auto paths = miles_sample_paths({d / "s0.npz", d / "s1.npz", d / "s2"});
  for (size_t i = 0; i < paths.size(); ++i)
    got.push_back(r3_import(cfg(), miles_sample(paths[i], int64_t(i), notes), nullptr, notes));
  ASSERT_EQ(got.size(), 3u);
  std::vector<std::string> n2;
  const ExternalSequence want = r3_import(cfg(), q, nullptr, n2);
  EXPECT_EQ(got[0].prompt_length, 5);
  EXPECT_EQ(got[1].prompt_length, -1);
  for (const auto& s : got) EXPECT_EQ(s.tokens, q.tokens);
  for (size_t l = 0; l < 6; ++l) {
    EXPECT_EQ(got[0].routing[l].ids, want.routing[l].ids);
    EXPECT_EQ(got[1].routing[l].ids, want.routing[l].ids);
  }
  EXPECT_TRUE(got[1].indexer.empty());
  EXPECT_TRUE(got[2].routing.empty());
  for (size_t o = 0; o < 2; ++o) {
    EXPECT_EQ(ids_of(got[0].indexer[o]), ids_of(want.indexer[o]));
    EXPECT_EQ(ids_of(got[2].indexer[o]), ids_of(want.indexer[o]));
  }
  try {
    miles_sample(d / "bad.npz", 3, notes);
    FAIL() << "int64 routing accepted";
  } catch (const InputError& e) {
    EXPECT_NE(std::string(e.what()).find("bad.npz: rollout_routed_experts.npy: dtype '<i8', expected int32"),
              std::string::npos)
        << e.what();
  }
}

// ---- export → import --------------------------------------------------------------------------------

// A trace of two tiny sequences recorded by our runtime (decisions only).
std::string recorded_trace(const TempDir& d) {
  const std::string path = d / "run.h5";
  RecordOptions o;
  o.threads = 1;
  std::vector<std::vector<int32_t>> batch = {{}, {}};
  for (int t = 0; t < 23; ++t) batch[0].push_back((t * 53 + 11) % 512);
  for (int t = 0; t < 10; ++t) batch[1].push_back((t * 29 + 3) % 512);
  record_step(test::tiny(), batch, path, o);
  return path;
}

std::set<int32_t> row_set(const std::vector<int32_t>& ids, int64_t row, int width) {
  std::set<int32_t> s(ids.begin() + row * width, ids.begin() + (row + 1) * width);
  s.erase(-1);
  return s;
}

// Every decision of every sequence of `imported` equals the trace's, as sets, and the tokens are equal.
void expect_same_decisions(const TraceReader& r, const std::vector<ExternalSequence>& imported) {
  const ModelConfig c = r.config();
  ASSERT_EQ(imported.size(), r.steps()[0].seq_lengths.size());
  for (int s = 0; s < int(imported.size()); ++s) {
    const ExternalSequence& x = imported[size_t(s)];
    EXPECT_EQ(x.tokens, r.tokens(0, s));
    const int64_t T = int64_t(x.tokens.size());
    ASSERT_EQ(x.routing.size(), size_t(c.num_hidden_layers));
    for (int l = 0; l < c.num_hidden_layers; ++l) {
      const RoutingRecord rec = *r.routing(0, s, l);
      ASSERT_EQ(x.routing[size_t(l)].rows, T - 1);
      for (int64_t t = 0; t < T - 1; ++t)
        ASSERT_EQ(row_set(x.routing[size_t(l)].ids, t, rec.k), row_set(rec.ids, t, rec.k))
            << "seq " << s << " layer " << l << " row " << t;
    }
    ASSERT_EQ(x.indexer.size(), size_t(c.num_c4_layers()));
    int64_t valid = 0;
    for (const ExternalIndexer& xi : x.indexer) {
      const IndexerRecord rec = *r.indexer(0, s, xi.layer);
      EXPECT_EQ(xi.width, rec.k);
      const std::vector<int32_t> ids = ids_of(xi);
      for (int64_t t = 0; t < T - 1; ++t) {
        const auto got = row_set(ids, t, xi.width);
        ASSERT_EQ(got, row_set(rec.ids, t, rec.k)) << "seq " << s << " layer " << xi.layer << " row " << t;
        valid += int64_t(got.size());
      }
    }
    EXPECT_GT(valid, 0);  // the comparison saw real picks
  }
}

TEST(Adapters, ExportSglangImportsBackBitwise) {
  TempDir d;
  const std::string trace = recorded_trace(d);
  const TraceReader r = TraceReader::open(trace);
  const int step = export_step(r, -1);
  EXPECT_EQ(export_sglang(r, step, d / "out.jsonl"), 2);
  EXPECT_THROW(export_sglang(r, step, d / "out.jsonl"), InputError);  // never overwrites

  // The bytes are the documented layout: row t, layer l, ids ascending; indexer −1 padded to index_topk.
  std::ifstream f(d / "out.jsonl");
  std::string line;
  std::getline(f, line);
  const json first = json::parse(line);
  const ModelConfig c = r.config();
  std::string err;
  const auto re = base64_decode(first["meta_info"]["routed_experts"].get<std::string>(), err);
  const auto ix = base64_decode(first["meta_info"]["indexer_topk"].get<std::string>(), err);
  ASSERT_EQ(re.size(), size_t(22 * c.num_hidden_layers * c.num_experts_per_tok * 4));
  ASSERT_EQ(ix.size(), size_t(22 * c.num_c4_layers() * c.index_topk * 4));
  EXPECT_EQ(first["meta_info"]["indexer_topk_num_layers"], c.num_c4_layers());
  EXPECT_EQ(first["input_ids"].size() + first["output_ids"].size(), 23u);
  std::vector<int32_t> rw(re.size() / 4), iw(ix.size() / 4);
  std::memcpy(rw.data(), re.data(), re.size());
  std::memcpy(iw.data(), ix.data(), ix.size());
  const RoutingRecord l4 = *r.routing(0, 0, 4);
  for (int64_t t = 0; t < 22; ++t) {
    std::vector<int32_t> want(l4.ids.begin() + t * l4.k, l4.ids.begin() + (t + 1) * l4.k);
    std::sort(want.begin(), want.end());
    const int32_t* got = &rw[size_t((t * c.num_hidden_layers + 4) * c.num_experts_per_tok)];
    ASSERT_EQ(std::vector<int32_t>(got, got + c.num_experts_per_tok), want) << "row " << t;
  }
  const IndexerRecord l3 = *r.indexer(0, 0, 3);  // C4 ordinal 1
  for (int64_t t = 0; t < 22; ++t) {
    std::vector<int32_t> want;
    for (int j = 0; j < l3.k; ++j)
      if (l3.ids[size_t(t * l3.k + j)] >= 0) want.push_back(l3.ids[size_t(t * l3.k + j)]);
    std::sort(want.begin(), want.end());
    want.resize(size_t(c.index_topk), -1);
    const int32_t* got = &iw[size_t((t * c.num_c4_layers() + 1) * c.index_topk)];
    ASSERT_EQ(std::vector<int32_t>(got, got + c.index_topk), want) << "row " << t;
  }

  std::vector<ExternalSequence> imported;
  const ImportSummary s = import_sglang({d / "out.jsonl"}, c, &test::tiny(),
                                        [&](ExternalSequence&& x) { imported.push_back(std::move(x)); });
  EXPECT_EQ(s.requests, 2);
  EXPECT_EQ(s.tokens, 33);
  expect_same_decisions(r, imported);

  // Exporting what was imported gives the same bytes (the layout is one rule both ways).
  for (size_t i = 0; i < imported.size(); ++i) {
    const ExternalSequence& x = imported[i];
    const R3EngineBuffers b = r3_export(
        c, int64_t(x.tokens.size()),
        [&](int l) {
          RoutingRecord rr;
          rr.T = x.routing[size_t(l)].rows;
          rr.k = x.routing[size_t(l)].k;
          rr.ids = x.routing[size_t(l)].ids;
          return std::optional<RoutingRecord>(rr);
        },
        [&](int l) {
          for (const auto& xi : x.indexer)
            if (xi.layer == l) {
              IndexerRecord ir;
              ir.T = xi.rows;
              ir.k = xi.width;
              ir.ids = ids_of(xi);
              return std::optional<IndexerRecord>(ir);
            }
          return std::optional<IndexerRecord>();
        },
        "reimport");
    if (i == 0) {
      EXPECT_TRUE(test::bitwise_equal(b.routed_experts, rw));
      EXPECT_TRUE(test::bitwise_equal(b.indexer_topk, iw));
    }
  }
}

TEST(Adapters, ExportMilesImportsBack) {
  TempDir d;
  const std::string trace = recorded_trace(d);
  const TraceReader r = TraceReader::open(trace);
  EXPECT_EQ(export_miles(r, 0, d / "samples"), 2);
  std::vector<ExternalSequence> imported;
  const ImportSummary s = import_miles({d / "samples"}, r.config(), &test::tiny(),
                                       [&](ExternalSequence&& x) { imported.push_back(std::move(x)); });
  EXPECT_EQ(s.requests, 2);
  expect_same_decisions(r, imported);
  const std::string py = numpy_python();
  if (py.empty()) GTEST_SKIP() << "no python3 with numpy: numpy.load of the .npz not checked";
  EXPECT_EQ(
      run_python(
          py,
          "import numpy as np\nz = np.load('" + (d / "samples/sample_000000.npz") +
              "')\nassert z['tokens'].dtype == np.int32 and z['tokens'].shape == (23,)\n"
              "assert z['rollout_routed_experts'].shape == (22, 6, 2), z['rollout_routed_experts'].shape\n"
              "assert z['rollout_indexer_topk'].shape == (22, 2, 8)\n"
              "assert (np.diff(z['rollout_routed_experts'], axis=2) > 0).all()\n"
              "assert (z['rollout_indexer_topk'][:3] == -1).all()\n"),
      0);
}

TEST(Adapters, ExportNeedsAStepWhenThereAreSeveral) {
  TempDir d;
  const std::string trace = recorded_trace(d);
  RecordOptions o;
  o.threads = 1;
  o.append = true;
  record_step(test::tiny(), {{1, 2, 3, 4, 5}}, trace, o);
  const TraceReader r = TraceReader::open(trace);
  try {
    export_step(r, -1);
    FAIL() << "picked one of two steps";
  } catch (const InputError& e) {
    EXPECT_NE(std::string(e.what()).find("choose one with --step N"), std::string::npos) << e.what();
  }
  EXPECT_EQ(export_step(r, 1), 1);
  EXPECT_THROW(export_step(r, 2), InputError);
}

std::string text_of(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  return std::string((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
}

TEST(Adapters, ImportThroughTheWriterAndExportAgainGivesTheSameBytes) {
  TempDir d;
  const std::string trace = recorded_trace(d);
  const TraceReader ours = TraceReader::open(trace);
  ASSERT_EQ(export_sglang(ours, 0, d / "first.jsonl"), 2);

  ExternalModel m;
  m.config_json = config_to_json(ours.config());
  auto w = ExternalTraceWriter::create(d / "imported.h5", m);
  ExternalStepSpec spec;
  spec.engine = "sglang";
  spec.source = d / "first.jsonl";
  w->begin_step(spec);
  const ImportSummary s = import_sglang({d / "first.jsonl"}, ours.config(), nullptr,
                                        [&](ExternalSequence&& x) { w->add_sequence(x); });
  w->end_step();
  w->close();
  EXPECT_EQ(s.requests, 2);

  const TraceReader theirs = TraceReader::open(d / "imported.h5");
  ASSERT_EQ(theirs.steps().size(), 1u);
  EXPECT_EQ(theirs.steps()[0].engine, "sglang");
  EXPECT_EQ(theirs.sequence_id(0, 1), "step0-seq1");
  for (int q = 0; q < 2; ++q) EXPECT_EQ(theirs.tokens(0, q), ours.tokens(0, q));
  ASSERT_EQ(export_sglang(theirs, 0, d / "second.jsonl"), 2);
  const std::string a = text_of(d / "first.jsonl"), b = text_of(d / "second.jsonl");
  EXPECT_GT(a.size(), 1000u);
  EXPECT_TRUE(a == b) << "the export of the import differs from the first export";
}

// A recorded conversation: turn 2 extends turn 1, turn 3 shares only turn 1's first 10 tokens, and an
// unrelated request sits in between. Exported incrementally, turns 2 and 3 carry routed_experts_start_len
// and only their new rows; imported, every sequence has the recorded decisions (our runtime is causal:
// turn 1's rows are turn 2's first rows), in the JSON dump's two places for the field.
TEST(Adapters, IncrementalExportImportsBackToTheRecordedDecisions) {
  TempDir d;
  std::vector<std::vector<int32_t>> batch(4);
  for (int t = 0; t < 15; ++t) batch[0].push_back((t * 53 + 11) % 512);
  batch[1] = batch[0];
  for (int t = 0; t < 12; ++t) batch[1].push_back((t * 7 + 300) % 512);
  for (int t = 0; t < 10; ++t) batch[2].push_back((t * 29 + 3) % 512);
  batch[3].assign(batch[0].begin(), batch[0].begin() + 10);
  for (int t = 0; t < 9; ++t) batch[3].push_back((t * 31 + 100) % 512);
  std::swap(batch[2], batch[3]);  // turn 1, turn 2, turn 3, the unrelated one
  RecordOptions o;
  o.threads = 1;
  record_step(test::tiny(), batch, d / "conv.h5", o);
  const TraceReader r = TraceReader::open(d / "conv.h5");
  const ModelConfig c = r.config();
  ASSERT_EQ(export_sglang(r, 0, d / "inc.jsonl", true), 4);
  ASSERT_EQ(export_sglang(r, 0, d / "whole.jsonl", false), 4);

  std::ifstream f(d / "inc.jsonl");
  std::vector<json> lines;
  for (std::string line; std::getline(f, line);) lines.push_back(json::parse(line));
  ASSERT_EQ(lines.size(), 4u);
  const std::vector<int64_t> starts = {0, 14, 10, 0};
  const int64_t Lk4 = c.num_hidden_layers * c.num_experts_per_tok * 4;
  for (size_t i = 0; i < 4; ++i) {
    EXPECT_EQ(lines[i].value("routed_experts_start_len", int64_t(0)), starts[i]) << "sequence " << i;
    std::string err;
    const auto re = base64_decode(lines[i]["meta_info"]["routed_experts"].get<std::string>(), err);
    EXPECT_EQ(int64_t(re.size()), (int64_t(batch[i].size()) - 1 - starts[i]) * Lk4) << "sequence " << i;
  }
  // The same import from the field in meta_info.
  {
    std::ofstream g(d / "inc-meta.jsonl");
    for (json x : lines) {
      if (x.contains("routed_experts_start_len")) {
        x["meta_info"]["routed_experts_start_len"] = x["routed_experts_start_len"];
        x.erase("routed_experts_start_len");
      }
      g << x.dump() << "\n";
    }
  }
  for (const char* file : {"inc.jsonl", "inc-meta.jsonl"}) {
    std::vector<ExternalSequence> imported;
    const ImportSummary s = import_sglang({d / file}, c, &test::tiny(),
                                          [&](ExternalSequence&& x) { imported.push_back(std::move(x)); });
    EXPECT_EQ(s.requests, 4);
    expect_same_decisions(r, imported);
    ASSERT_EQ(s.notes.size(), 2u) << file;
    EXPECT_NE(s.notes[0].find("request 'step0-seq1' (#1): routed_experts rows [0, 14) (routed_experts_start_len) "
                              "from "),
              std::string::npos)
        << s.notes[0];
    EXPECT_NE(s.notes[1].find("rows [0, 10)"), std::string::npos) << s.notes[1];
  }
  // Through the command line too; the incremental dump is the smaller one.
  auto cli = test::run_cli("import sglang " + (d / "inc.jsonl") + " --preset tiny --out " + (d / "inc.h5"));
  ASSERT_EQ(cli.code, 0) << cli.out;
  EXPECT_NE(cli.out.find("note: " + (d / "inc.jsonl") + ":2: request 'step0-seq1' (#1): routed_experts rows [0, 14)"),
            std::string::npos)
      << cli.out;
  EXPECT_LT(text_of(d / "inc.jsonl").size(), text_of(d / "whole.jsonl").size());
  cli = test::run_cli("import sglang " + (d / "inc.jsonl") + " --preset tiny --prefix-memory 0 --out " +
                      (d / "inc0.h5"));
  EXPECT_EQ(cli.code, 2) << cli.out;
  EXPECT_NE(cli.out.find("raise --prefix-memory"), std::string::npos) << cli.out;
  EXPECT_FALSE(std::filesystem::exists(d / "inc0.h5"));
}

TEST(Adapters, CommandLineImportExportAndErrors) {
  TempDir d;
  const std::string trace = recorded_trace(d);
  auto r = test::run_cli("export sglang " + trace + " --out " + (d / "a.jsonl"));
  ASSERT_EQ(r.code, 0) << r.out;
  r = test::run_cli("import sglang " + (d / "a.jsonl") + " --preset tiny --out " + (d / "a.h5"));
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("import sglang: 2 requests, 33 tokens"), std::string::npos) << r.out;
  r = test::run_cli("export miles " + (d / "a.h5") + " --out " + (d / "npz"));
  ASSERT_EQ(r.code, 0) << r.out;
  r = test::run_cli("import miles " + (d / "npz") + " --preset tiny --kind train --out " + (d / "b.h5"));
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("import miles: 2 requests"), std::string::npos) << r.out;

  // A capturer bound too early: an all-zero routing buffer. Exit 2, the request named, nothing left behind.
  std::ifstream f(d / "a.jsonl");
  std::string line;
  std::getline(f, line);
  json resp = json::parse(line);
  std::string err;
  std::vector<uint8_t> bytes = base64_decode(resp["meta_info"]["routed_experts"].get<std::string>(), err);
  std::fill(bytes.begin(), bytes.end(), 0);
  resp["meta_info"]["routed_experts"] = base64_encode(bytes);
  std::ofstream(d / "zero.jsonl") << resp.dump() << "\n";
  r = test::run_cli("import sglang " + (d / "zero.jsonl") + " --preset tiny --out " + (d / "z.h5"));
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_NE(
      r.out.find(
          "zero.jsonl:1: request 'step0-seq0' (#0): routed_experts: every layer, every row is expert 0"),
      std::string::npos)
      << r.out;
  EXPECT_FALSE(std::filesystem::exists(d / "z.h5"));
  // A wrong config: the layer count does not match.
  r = test::run_cli("import sglang " + (d / "a.jsonl") + " --preset tiny-b --out " + (d / "c.h5"));
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_NE(r.out.find("request 'step0-seq0' (#0): routed_experts"), std::string::npos) << r.out;
  // --model: the weights' tid2eid tables check the hash layers (0 and 1 on tiny).
  test::tiny().save(d / "model");
  r = test::run_cli("import sglang " + (d / "a.jsonl") + " --model " + (d / "model") + " --out " +
                    (d / "m.h5"));
  EXPECT_EQ(r.code, 0) << r.out;
  resp = json::parse(line);
  bytes = base64_decode(resp["meta_info"]["routed_experts"].get<std::string>(), err);
  const ModelConfig& c = test::tiny().config();
  const int32_t tok = resp["input_ids"][5].get<int32_t>();
  const int32_t* table = test::tiny().layer_i(0, "mlp.topk.tid2eid");
  int32_t other = 0;
  while (other == table[tok * c.num_experts_per_tok] || other == table[tok * c.num_experts_per_tok + 1])
    ++other;
  int32_t* ids = reinterpret_cast<int32_t*>(bytes.data());
  // `other` is in neither slot of the token's table row: the row stays a set, only the table check fails.
  ids[(5 * c.num_hidden_layers + 0) * c.num_experts_per_tok + 0] = other;  // row 5, layer 0, slot 0
  resp["meta_info"]["routed_experts"] = base64_encode(bytes);
  std::ofstream(d / "hash.jsonl") << resp.dump() << "\n";
  r = test::run_cli("import sglang " + (d / "hash.jsonl") + " --model " + (d / "model") + " --out " +
                    (d / "h.h5"));
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_NE(r.out.find("routed_experts layer 0 (hash layer) row 5"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("tid2eid"), std::string::npos) << r.out;
  // Without the weights the same file imports (nothing to compare the hash layers with).
  r = test::run_cli("import sglang " + (d / "hash.jsonl") + " --preset tiny --out " + (d / "h2.h5"));
  EXPECT_EQ(r.code, 0) << r.out;

  r = test::run_cli("import sglang --help");
  EXPECT_EQ(r.code, 0);
  EXPECT_NE(r.out.find("Example:"), std::string::npos) << r.out;
}

}  // namespace
}  // namespace dsv4

namespace dsv4 {
namespace {

// r3_export takes its decisions from callbacks (a trace reader, or an importer's own sequences): a
// record whose ids do not fill its stated rows is refused by name, not read past its end.
TEST(Adapters, ExportRefusesRecordsShorterThanTheirShape) {
  const ModelConfig& c = cfg();
  auto no_routing = [](int) { return std::optional<RoutingRecord>(); };
  auto short_indexer = [](int) {
    IndexerRecord x;
    x.T = 8;
    x.k = 2;
    x.ids = {0, -1, 1};  // 3 ids for 8 rows × 2
    return std::optional<IndexerRecord>(x);
  };
  try {
    r3_export(c, 9, no_routing, short_indexer, "seq 0");
    ADD_FAILURE() << "accepted";
  } catch (const InputError& e) {
    EXPECT_NE(std::string(e.what()).find(
                  "seq 0: layer 1 (C4 ordinal 0) (hash layer): indexer of 3 ids as 8 rows × 2"),
              std::string::npos)
        << e.what();
  }
  auto short_routing = [&](int) {
    RoutingRecord r;
    r.T = 8;
    r.k = c.num_experts_per_tok;
    r.ids = {1, 2};
    return std::optional<RoutingRecord>(r);
  };
  auto no_indexer = [](int) { return std::optional<IndexerRecord>(); };
  EXPECT_THROW(r3_export(c, 9, short_routing, no_indexer, "seq 0"), InputError);
}

}  // namespace
}  // namespace dsv4
