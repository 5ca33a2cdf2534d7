// IndexerSetEncoder (capture/indexer_sets.h), the one place that decides what an indexer row may hold
// and encodes it: random rows in any slot order against a reference written the plain way (a sorted,
// de-duplicated copy), and every kind of fault at the slot where it stands.
#include <gtest/gtest.h>

#include <algorithm>
#include <random>
#include <set>
#include <vector>

#include "capture/indexer_sets.h"

namespace dsv4 {
namespace {

TEST(IndexerSets, RowsInAnyOrderBecomeTheirSets) {
  std::mt19937_64 rng(3);
  for (int64_t T : {9, 1030, 70000}) {  // uint8, uint16 and uint32 gaps
    const int width = int(std::min<int64_t>(64, T / 4));
    const int slots = width + 5;
    IndexerSetEncoder enc(T, width, false);
    std::vector<std::vector<int32_t>> want;
    const int64_t rows = std::min<int64_t>(T, 3000);
    for (int64_t t = 0; t < rows; ++t) {
      const int64_t visible = (t + 1) / 4;
      std::set<int32_t> pick;
      const int64_t n = std::min<int64_t>(visible, int64_t(rng() % uint64_t(width + 1)));
      while (int64_t(pick.size()) < n) pick.insert(int32_t(int64_t(rng() % uint64_t(visible))));
      std::vector<int32_t> row(pick.begin(), pick.end());
      row.resize(size_t(slots), -1);
      if (rng() % 4) std::shuffle(row.begin(), row.end(), rng);  // most rows unsorted, −1 anywhere
      ASSERT_FALSE(enc.add_row(row.data(), slots)) << "T " << T << " row " << t;
      std::vector<int32_t> set(pick.begin(), pick.end());
      set.resize(size_t(width), -1);
      want.push_back(set);
    }
    const std::vector<int32_t> got = enc.sets();
    ASSERT_EQ(got.size(), size_t(rows * width));
    for (int64_t t = 0; t < rows; ++t)
      ASSERT_TRUE(std::equal(want[size_t(t)].begin(), want[size_t(t)].end(), got.begin() + t * width))
          << "T " << T << " row " << t;
  }
}

TEST(IndexerSets, FaultsAreNamedAtTheirSlot) {
  const int64_t T = 400;  // row 99 sees groups [0, 25)
  auto fault = [&](std::vector<int32_t> row, bool strict, int width = 8) {
    IndexerSetEncoder enc(T, width, strict);
    for (int t = 0; t < 99; ++t) {
      const int32_t empty[1] = {-1};
      EXPECT_FALSE(enc.add_row(empty, 1));
    }
    const IndexerRowFault f = enc.add_row(row.data(), int(row.size()));
    EXPECT_EQ(enc.rows(), f ? 99 : 100) << "a faulty row is not appended";
    return f;
  };
  IndexerRowFault f = fault({3, 1, -2, 3}, false);
  EXPECT_EQ(f.kind, IndexerRowFault::negative);
  EXPECT_EQ(f.slot, 2);
  f = fault({3, 1, 3, 99}, false);  // unsorted before the duplicate: found at its slot, before the future id
  EXPECT_EQ(f.kind, IndexerRowFault::duplicate);
  EXPECT_EQ(f.slot, 2);
  EXPECT_EQ(f.id, 3);
  f = fault({1, 2, 2}, false);  // ascending until the duplicate
  EXPECT_EQ(f.kind, IndexerRowFault::duplicate);
  EXPECT_EQ(f.slot, 2);
  f = fault({1, 25}, false);
  EXPECT_EQ(f.kind, IndexerRowFault::future);
  EXPECT_EQ(f.id, 25);
  f = fault({-1, -1, 0, 1, 2}, false, 3);  // valid ids past the width: fine unless strict
  EXPECT_FALSE(f);
  f = fault({-1, -1, 0, 1, 2}, true, 3);
  EXPECT_EQ(f.kind, IndexerRowFault::beyond_width);
  EXPECT_EQ(f.slot, 3);
  f = fault({0, 1, 2, 3}, false, 3);
  EXPECT_EQ(f.kind, IndexerRowFault::too_many);
  EXPECT_EQ(f.slot, 3);
  f = fault({5, 0, 3, 2}, false, 3);  // too many, unsorted
  EXPECT_EQ(f.kind, IndexerRowFault::too_many);
  // After a fault in an unsorted row, the next rows start clean (the row's bitmap is cleared).
  IndexerSetEncoder enc(T, 8, false);
  for (int t = 0; t < 99; ++t) {
    const int32_t empty[1] = {-1};
    ASSERT_FALSE(enc.add_row(empty, 1));
  }
  const int32_t bad[3] = {4, 2, 4}, good[3] = {4, 2, 7};
  EXPECT_EQ(enc.add_row(bad, 3).kind, IndexerRowFault::duplicate);
  EXPECT_FALSE(enc.add_row(good, 3));
  const std::vector<int32_t> sets = enc.sets();
  EXPECT_EQ(std::vector<int32_t>(sets.end() - 8, sets.end()),
            (std::vector<int32_t>{2, 4, 7, -1, -1, -1, -1, -1}));
}

}  // namespace
}  // namespace dsv4
