// Test helpers for the decoding path: an Observer that files every reported row under its absolute
// position, so that a whole-sequence forward and any split of it into chunks can be compared row by
// row, bit for bit.
#pragma once

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <map>
#include <string>
#include <tuple>
#include <vector>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "capture/digest.h"
#include "model/observer.h"

namespace dsv4::test {

// Bytes of one reported row, keyed by (sequence, layer, name, absolute row). Indexer rows (ids and
// scores) are cut after their valid entries: a chunk's row width is the prefill width of the
// positions seen so far (min(index_topk, floor(T/4))), wider rows only add empty slots.
class RowCollector : public Observer {
 public:
  using Key = std::tuple<int, int, std::string, int64_t>;
  std::map<Key, std::vector<unsigned char>> rows;

  void on_tensor(const TensorRecord& r) override {
    const auto* p = static_cast<const unsigned char*>(r.data());
    const int64_t n = r.row_elems() * 4;
    for (int64_t i = 0; i < r.rows(); ++i) {
      std::vector<unsigned char> b(p + i * n, p + (i + 1) * n);
      if (r.name == "indexer.score") b = trim_nan(b);
      put({r.seq, r.layer, std::string(r.name), r.pos0 + i}, std::move(b));
    }
  }
  void on_indexer(const IndexerDecision& d) override {
    for (int64_t t = 0; t < d.T; ++t) {
      std::vector<unsigned char> b;
      for (int j = 0; j < d.k; ++j)
        if (d.ids[t * d.k + j] >= 0) append(b, &d.ids[t * d.k + j], 4);
      append(b, &d.margin[t], 4);
      put({d.seq, d.layer, "decision.indexer", d.pos0 + t}, std::move(b));
    }
  }
  void on_routing(const RoutingDecision& d) override {
    for (int64_t t = 0; t < d.T; ++t) {
      std::vector<unsigned char> b;
      append(b, d.ids + t * d.k, 4 * d.k);
      append(b, d.weights + t * d.k, 4 * d.k);
      append(b, &d.margin[t], 4);
      put({d.seq, d.layer, "decision.routing", d.pos0 + t}, std::move(b));
    }
  }
  void on_mhc(const MhcDecision& d) override {
    for (int64_t t = 0; t < d.T; ++t) {
      std::vector<unsigned char> b;
      append(b, d.pre + t * d.hc, 4 * d.hc);
      append(b, d.post + t * d.hc, 4 * d.hc);
      append(b, d.comb + t * d.hc * d.hc, 4 * d.hc * d.hc);
      put({d.seq, d.layer, std::string("decision.mhc.") + to_string(d.sublayer), d.pos0 + t}, std::move(b));
    }
  }

  int duplicates = 0;  // a row reported twice

 private:
  static void append(std::vector<unsigned char>& b, const void* p, size_t n) {
    const auto* c = static_cast<const unsigned char*>(p);
    b.insert(b.end(), c, c + n);
  }
  static std::vector<unsigned char> trim_nan(std::vector<unsigned char> b) {
    while (b.size() >= 4) {
      float f;
      std::memcpy(&f, b.data() + b.size() - 4, 4);
      if (!std::isnan(f)) break;
      b.resize(b.size() - 4);
    }
    return b;
  }
  void put(Key k, std::vector<unsigned char> b) {
    if (!rows.emplace(std::move(k), std::move(b)).second) ++duplicates;
  }
};

// Everything an observer is told, as text to compare: each tensor's sequence, layer, name, shape and row
// digests (capture/digest.h, from the values or from the backend's digests), each decision's arrays.
class ReportTranscript final : public Observer {
 public:
  void on_tensor(const TensorRecord& t) override {
    text += fmt::format("T {} {} {} {}:", t.seq, t.layer, t.name, fmt::join(t.shape, "x"));
    for (uint64_t d : digest_rows(t)) text += fmt::format(" {:016x}", d);
    text += "\n";
  }
  void on_indexer(const IndexerDecision& d) override {
    text += fmt::format("I {} {} {}{}\n", d.seq, d.layer, words(d.ids, d.T * d.k), words(d.margin, d.T));
  }
  void on_routing(const RoutingDecision& d) override {
    text += fmt::format("R {} {} {}{}{}\n", d.seq, d.layer, words(d.ids, d.T * d.k),
                        words(d.weights, d.T * d.k), words(d.margin, d.T));
  }
  void on_mhc(const MhcDecision& d) override {
    text += fmt::format("M {} {} {}{}{}\n", d.seq, d.layer, words(d.pre, d.T * d.hc),
                        words(d.post, d.T * d.hc), words(d.comb, d.T * d.hc * d.hc));
  }
  // 4-byte values (int32 or float) as hex words.
  template <typename T>
  static std::string words(const T* p, int64_t n) {
    static_assert(sizeof(T) == 4);
    std::string out;
    for (int64_t i = 0; i < n; ++i) {
      uint32_t u;
      std::memcpy(&u, p + i, 4);
      out += fmt::format("{:08x}", u);
    }
    return out;
  }
  std::string text;
};

// Every row of `want` is in `got` with the same bytes (names: `skip` are left out); reports the first
// missing or differing row.
inline ::testing::AssertionResult rows_equal(const RowCollector& want, const RowCollector& got,
                                             const std::vector<std::string>& skip = {}, int got_seq = -1) {
  int64_t compared = 0;
  for (const auto& [k, v] : want.rows) {
    const auto& [seq, layer, name, row] = k;
    bool skipped = false;
    for (const auto& s : skip) skipped |= (name == s);
    if (skipped) continue;
    auto it = got.rows.find({got_seq >= 0 ? got_seq : seq, layer, name, row});
    if (it == got.rows.end())
      return ::testing::AssertionFailure()
             << "missing: seq " << seq << " layer " << layer << " " << name << " row " << row;
    if (it->second != v)
      return ::testing::AssertionFailure()
             << "differs: seq " << seq << " layer " << layer << " " << name << " row " << row << " ("
             << v.size() << " vs " << it->second.size() << " bytes)";
    ++compared;
  }
  if (compared == 0) return ::testing::AssertionFailure() << "no row compared";
  return ::testing::AssertionSuccess() << compared << " rows";
}

}  // namespace dsv4::test
