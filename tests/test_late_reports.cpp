// Late reports (model/late_reports.h) over a stand-in for a device's asynchronous downloads, whose
// copies land only when the test says so: the observer gets every report in the order it was made,
// none before its copy has landed, all of them by finish(), with back-pressure past max_bytes; a late
// tensor carries its values only when the observer asked for them. And h5::StagedWrites: writes
// staged together (encoded at once, stored in order, some extending their dataset) leave the same
// datasets as one write() at a time.
#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <memory>
#include <numeric>
#include <stdexcept>
#include <string>
#include <vector>

#include "capture/h5.h"
#include "model/late_reports.h"

namespace dsv4 {
namespace {

namespace fs = std::filesystem;
using Part = backend::Backend::AsyncPart;

// A download that takes its snapshot when it is made (as the device's does, in stream order) and lands
// at wait() or at the n-th ready() poll; part() before that is refused.
class FakeDownload final : public backend::Backend::AsyncDownload {
 public:
  FakeDownload(const std::vector<Part>& parts, int polls_to_land, std::vector<std::string>& log)
      : polls_(polls_to_land), log_(log) {
    for (const Part& p : parts) {
      bytes_ += p.host_bytes();
      std::vector<uint8_t> c(p.host_bytes());
      if (p.digests) {  // a stand-in digest per row: the bits of the row's first value
        for (int64_t r = 0; r < p.rows; ++r) {
          uint64_t d = 0;
          if (p.row_elems > 0) std::memcpy(&d, static_cast<const uint8_t*>(p.src) + r * p.row_elems * 4, 4);
          std::memcpy(c.data() + r * 8, &d, 8);
        }
      } else if (!c.empty()) {
        std::memcpy(c.data(), p.src, c.size());
      }
      copies_.push_back(std::move(c));
    }
  }
  bool ready() override {
    if (!landed_ && --polls_ <= 0) land("ready");
    return landed_;
  }
  void wait() override {
    if (!landed_) land("wait");
  }
  const void* part(size_t i) const override {
    if (!landed_) throw std::logic_error("part() before the copy landed");
    return copies_.at(i).empty() ? nullptr : copies_[i].data();
  }
  size_t bytes() const override { return bytes_; }

 private:
  void land(const char* how) {
    log_.push_back(how);
    landed_ = true;
  }
  int polls_;
  std::vector<std::string>& log_;
  std::vector<std::vector<uint8_t>> copies_;
  size_t bytes_ = 0;
  bool landed_ = false;
};

// Notes every report as "kind:layer", the values it could read and the digests it got.
class Notes : public Observer {
 public:
  void on_tensor(const TensorRecord& t) override {
    seen.push_back("tensor:" + std::string(t.name) + "@" + std::to_string(t.layer));
    digests.push_back(std::vector<uint64_t>(t.row_digests, t.row_digests + t.rows()));
    if (wants_values(t.name, t.layer)) {
      const float* v = static_cast<const float*>(t.data());
      values.push_back(std::vector<float>(v, v + t.rows() * t.row_elems()));
    } else {
      EXPECT_THROW(t.data(), std::logic_error) << t.name;
    }
  }
  void on_indexer(const IndexerDecision& d) override {
    seen.push_back("indexer@" + std::to_string(d.layer));
    ids.push_back(std::vector<int32_t>(d.ids, d.ids + d.T * d.k));
  }
  void on_routing(const RoutingDecision& d) override {
    seen.push_back("routing@" + std::to_string(d.layer));
    weights.push_back(std::vector<float>(d.weights, d.weights + d.T * d.k));
  }
  void on_mhc(const MhcDecision& d) override {
    seen.push_back("mhc@" + std::to_string(d.layer));
    comb.push_back(std::vector<float>(d.comb, d.comb + d.T * d.hc * d.hc));
  }
  bool deferrable() const override { return true; }
  bool wants_values(std::string_view name, int) const override { return name == "attn.q"; }

  std::vector<std::string> seen;
  std::vector<std::vector<uint64_t>> digests;
  std::vector<std::vector<float>> values, weights, comb;
  std::vector<std::vector<int32_t>> ids;
};

struct Harness {
  std::vector<std::string> landings;
  int polls_to_land = 1000;  // never by polling unless lowered
  LateReports::Download download() {
    return [this](const std::vector<Part>& parts) {
      return std::make_unique<FakeDownload>(parts, polls_to_land, landings);
    };
  }
};

TensorRecord tensor(const char* name, int layer, int64_t rows, int64_t cols) {
  TensorRecord r;
  r.name = name;
  r.layer = layer;
  r.dtype = DType::bf16;
  r.shape = {rows, cols};
  return r;
}

TEST(LateReports, ArriveInOrderOnceLandedAndAllByFinish) {
  Harness h;
  Notes notes;
  LateReports late(h.download(), notes, size_t(1) << 30);
  std::vector<float> q(6 * 4), o(6 * 2);
  std::iota(q.begin(), q.end(), 1.0f);
  std::iota(o.begin(), o.end(), 100.0f);
  std::vector<int32_t> ids = {0, -1, 1, 0};
  std::vector<float> margin = {0.5f, 0.25f}, weights = {0.75f, 0.125f, 1, 2};
  std::vector<float> pre(2 * 4, 1), post(2 * 4, 2), comb(2 * 16);
  std::iota(comb.begin(), comb.end(), 7.0f);

  late.tensor(tensor("attn.q", 0, 6, 4), q.data());
  q.assign(q.size(), -1);  // the buffer is the model's again: the report kept its own copy
  late.tensor(tensor("attn.o", 0, 6, 2), o.data());
  IndexerDecision id;
  id.layer = 2, id.T = 2, id.k = 2, id.ids = ids.data(), id.margin = margin.data();
  late.indexer(id);
  RoutingDecision rd;
  rd.layer = 3, rd.T = 2, rd.k = 2, rd.ids = ids.data(), rd.weights = weights.data(), rd.margin = margin.data();
  late.routing(rd);
  MhcDecision md;
  md.layer = 4, md.T = 2, md.hc = 4, md.pre = pre.data(), md.post = post.data(), md.comb = comb.data();
  late.mhc(md);
  EXPECT_TRUE(notes.seen.empty()) << "nothing has landed yet";
  EXPECT_TRUE(h.landings.empty());

  late.finish();
  EXPECT_EQ(notes.seen, (std::vector<std::string>{"tensor:attn.q@0", "tensor:attn.o@0", "indexer@2", "routing@3",
                                                  "mhc@4"}));
  ASSERT_EQ(notes.values.size(), 1u);  // attn.q only, as it was when reported
  std::vector<float> q0(6 * 4);
  std::iota(q0.begin(), q0.end(), 1.0f);
  EXPECT_EQ(notes.values[0], q0);
  ASSERT_EQ(notes.digests.size(), 2u);
  ASSERT_EQ(notes.digests[1].size(), 6u);
  for (int r = 0; r < 6; ++r) {  // the stand-in digests of attn.o's rows, as reported
    uint32_t bits;
    const float first = 100.0f + float(r * 2);
    std::memcpy(&bits, &first, 4);
    EXPECT_EQ(notes.digests[1][size_t(r)], bits) << "row " << r;
  }
  EXPECT_EQ(notes.ids[0], ids);
  EXPECT_EQ(notes.weights[0], weights);
  EXPECT_EQ(notes.comb[0], comb);
}

TEST(LateReports, LandedReportsAreHandedOnAtTheNextReportStillInOrder) {
  Harness h;
  h.polls_to_land = 1;  // lands at its first poll
  Notes notes;
  LateReports late(h.download(), notes, size_t(1) << 30);
  std::vector<float> x(4 * 4, 1.0f);
  late.tensor(tensor("attn.o", 0, 4, 4), x.data());  // polled right away: lands and is handed on
  EXPECT_EQ(notes.seen.size(), 1u);
  h.polls_to_land = 2;  // the next ones land at their second poll
  late.tensor(tensor("attn.o", 1, 4, 4), x.data());  // polled once
  EXPECT_EQ(notes.seen.size(), 1u);
  late.tensor(tensor("attn.o", 2, 4, 4), x.data());  // the second lands at its second poll, the third not
  EXPECT_EQ(notes.seen.size(), 2u);
  late.finish();
  EXPECT_EQ(notes.seen, (std::vector<std::string>{"tensor:attn.o@0", "tensor:attn.o@1", "tensor:attn.o@2"}));
}

TEST(LateReports, PastTheirBytesTheOldestIsWaitedFor) {
  Harness h;
  Notes notes;
  std::vector<float> x(8 * 4, 1.0f);
  // Each report holds 8 digests (64 bytes); at most 100 bytes in flight: the second report makes the
  // first be waited for, and so on.
  LateReports late(h.download(), notes, 100);
  for (int l = 0; l < 4; ++l) late.tensor(tensor("attn.o", l, 8, 4), x.data());
  EXPECT_EQ(notes.seen.size(), 3u);
  EXPECT_EQ(h.landings, (std::vector<std::string>{"wait", "wait", "wait"}));
  late.finish();
  EXPECT_EQ(notes.seen.size(), 4u);
}

// ---- staged writes ---------------------------------------------------------------------------------

struct TempFile {
  std::string path = (fs::temp_directory_path() / ("dsv4_staged_" + std::to_string(::getpid()) + ".h5")).string();
  ~TempFile() { fs::remove(path); }
};

TEST(StagedWrites, LeaveWhatOneWriteAtATimeLeaves) {
  const TempFile a, b;
  std::vector<float> big(70000);
  for (size_t i = 0; i < big.size(); ++i) big[i] = float(i % 977) * 0.25f;
  std::vector<uint16_t> gaps(5000);
  for (size_t i = 0; i < gaps.size(); ++i) gaps[i] = uint16_t(i * 7 % 300);
  const std::vector<int32_t> small = {1, -2, 3};
  for (const std::string& path : {a.path, b.path}) {
    h5::Object f = h5::create_file(path, H5P_DEFAULT);
    h5::Object g = h5::create_group(f, "g");
    h5::Object d1 = h5::create_dataset(g, "big", h5::Type::f32, {7000, 10});
    h5::Object d2 = h5::create_dataset(g, "gaps", h5::Type::u16, {0}, true, gaps.size());
    h5::Object d3 = h5::create_dataset(g, "small", h5::Type::i32, {3});
    if (path == a.path) {
      h5::write(d1, big);
      h5::set_extent(d2, {gaps.size()});
      h5::write(d2, gaps);
      h5::write(d3, small);
    } else {
      h5::StagedWrites w;
      w.add(d1, h5::Type::f32, big.data(), big.size());
      w.add(d2, gaps, hsize_t(gaps.size()));
      w.add(w.hold(h5::open(g, "small")), std::vector<int32_t>(small));
      EXPECT_EQ(w.size(), 3u);
      w.encode();
      w.store();
      EXPECT_EQ(w.size(), 0u);
    }
    h5::close_file(f);
  }
  for (const std::string& path : {a.path, b.path}) {
    h5::Object f = h5::open_file(path, H5F_ACC_RDONLY, H5P_DEFAULT);
    EXPECT_EQ(h5::read<float>(h5::open(f, "g/big")), big) << path;
    EXPECT_EQ(h5::read<uint16_t>(h5::open(f, "g/gaps")), gaps) << path;
    EXPECT_EQ(h5::read<int32_t>(h5::open(f, "g/small")), small) << path;
    h5::close_file(f);
  }
  // The same chunks stored: the compressed sizes agree too.
  h5::Object fa = h5::open_file(a.path, H5F_ACC_RDONLY, H5P_DEFAULT), fb = h5::open_file(b.path, H5F_ACC_RDONLY, H5P_DEFAULT);
  for (const char* name : {"g/big", "g/gaps", "g/small"})
    EXPECT_EQ(h5::storage_bytes(h5::open(fa, name)), h5::storage_bytes(h5::open(fb, name))) << name;
}

TEST(StagedWrites, AWrongCountIsRefusedAtAddNamingTheDataset) {
  const TempFile a;
  h5::Object f = h5::create_file(a.path, H5P_DEFAULT);
  h5::Object d = h5::create_dataset(f, "d", h5::Type::f32, {4});
  h5::StagedWrites w;
  const std::vector<float> v(5, 1.0f);
  try {
    w.add(d, h5::Type::f32, v.data(), v.size());
    FAIL() << "accepted 5 values for 4";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("writing 5 values into a dataset of 4"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("/d"), std::string::npos) << e.what();
  }
  h5::close_file(f);
}

}  // namespace
}  // namespace dsv4
