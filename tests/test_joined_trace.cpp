// Joined traces (traces/FORMAT.md "Joined traces"; capture/joined.h), written here in one process as the
// ranks of `record --ep N --dp` write them (each rank's sequences into its own trace, then the joined
// trace linking them), so the format is tested where MPI is missing too: the joined trace reads as the
// one-process recording of the whole batch, every sequence and every dataset; validate lists the
// parts; salvage makes a self-contained copy; and a missing part, a part whose bytes changed, a part
// named outside the folder and an append with other parts are refused, naming the file.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>

#include "capture/errors.h"
#include "capture/joined.h"
#include "capture/record.h"
#include "capture/salvage.h"
#include "capture/trace_reader.h"
#include "capture/validate.h"
#include "model/checkpoint.h"
#include "model/error.h"
#include "model/tokens.h"
#include "test_util.h"
#include "tiny_model.h"

namespace dsv4 {
namespace {

namespace fs = std::filesystem;
using test::TempDir;

std::vector<std::vector<int32_t>> batch() {
  return {random_tokens(23, 512, 1), random_tokens(5, 512, 2), random_tokens(40, 512, 3), random_tokens(9, 512, 4)};
}

// What the ranks of `record --dp` write, in one process: `ranks` parts, then the joined step.
void record_joined(const std::string& out, int ranks, bool append = false,
                   std::vector<std::string> parts_named = {}) {
  const Weights& w = test::tiny();
  const auto b = batch();
  RecordOptions o;
  o.append = append;
  o.seed = 0;
  TraceHeader h = make_trace_header(w);
  std::vector<StepLayout::PartSeq> where;
  int index = -1;
  for (int r = 0; r < ranks; ++r) {
    const BlockRange mine = sequence_range(int(b.size()), r, ranks);
    RecordOptions po = o;
    const std::vector<std::vector<int32_t>> own(b.begin() + mine.first, b.begin() + mine.last);
    if (own.empty()) continue;  // (a real rank records a step of none: test_expert_parallel)
    index = record_step(w, own, part_trace_path(out, r), po).step;
    h.parts.push_back(part_trace_name(out, r));
    for (int i = 0; i < mine.size(); ++i) where.push_back({int(h.parts.size()) - 1, i});
  }
  if (!parts_named.empty()) h.parts = parts_named;
  StepSpec s;
  s.set_profile(load_profile("train"));
  s.seqs = b;
  write_joined_step(out, w.config(), h, index, s, CapturePolicy::parse("decisions"), where, append);
}

void expect_same_trace(const TraceReader& a, const TraceReader& b, int step) {
  const auto sa = a.steps(), sb = b.steps();
  ASSERT_EQ(sa[size_t(step)].seq_lengths, sb[size_t(step)].seq_lengths);
  for (int s = 0; s < int(sa[size_t(step)].seq_lengths.size()); ++s) {
    const std::string what = "sequence " + std::to_string(s);
    EXPECT_EQ(a.tokens(step, s), b.tokens(step, s)) << what;
    EXPECT_TRUE(test::bitwise_equal(a.logprobs(step, s), b.logprobs(step, s))) << what;
    EXPECT_EQ(a.digests(step, s).values, b.digests(step, s).values) << what;
    for (int L : a.decision_layers(step, s)) {
      const auto ra = a.routing(step, s, L), rb = b.routing(step, s, L);
      ASSERT_TRUE(ra && rb) << what << " layer " << L;
      EXPECT_EQ(ra->ids, rb->ids) << what << " layer " << L;
      const auto ia = a.indexer(step, s, L), ib = b.indexer(step, s, L);
      ASSERT_EQ(ia.has_value(), ib.has_value()) << what << " layer " << L;
      if (ia) {
        EXPECT_EQ(ia->ids, ib->ids) << what << " layer " << L;
      }
    }
  }
}

TEST(JoinedTrace, ReadsAsTheOneProcessRecording) {
  TempDir d;
  const auto b = batch();
  record_step(test::tiny(), b, d / "one.h5", RecordOptions{});
  for (int ranks : {2, 3}) {
    const std::string j = d / fmt::format("j{}.h5", ranks);
    record_joined(j, ranks);
    const TraceReader one = TraceReader::open(d / "one.h5"), joined = TraceReader::open(j);
    ASSERT_EQ(int(joined.parts().size()), ranks);
    EXPECT_EQ(joined.parts()[1].name, fmt::format("j{}.rank1.h5", ranks));
    EXPECT_EQ(joined.parts()[1].seal.state, SealCheck::State::verified);
    EXPECT_EQ(joined.model().model_digest, one.model().model_digest);
    expect_same_trace(one, joined, 0);
    EXPECT_FALSE(joined.kernels(0).available);
    EXPECT_NE(joined.kernels(0).reason.find("recorded by each rank"), std::string::npos);
    const ValidateReport v = validate_trace(j);
    EXPECT_TRUE(v.ok()) << (v.problems.empty() ? "" : v.problems[0].what);
    EXPECT_EQ(int(v.parts.size()), ranks);
  }
  // Appending: every part and the joined trace get step 1.
  record_joined(d / "j2.h5", 2, true);
  {
    const TraceReader joined = TraceReader::open(d / "j2.h5");
    ASSERT_EQ(joined.steps().size(), 2u);
    expect_same_trace(joined, joined, 1);
    expect_same_trace(TraceReader::open(d / "one.h5"), joined, 0);
  }
  // Salvage holds the sequences itself: it reads the same with the parts gone.
  salvage_trace(d / "j2.h5", d / "s.h5");
  for (const char* f : {"j2.rank0.h5", "j2.rank1.h5"}) fs::remove(d / f);
  const TraceReader s = TraceReader::open(d / "s.h5");
  EXPECT_TRUE(s.parts().empty());
  ASSERT_EQ(s.steps().size(), 2u);
  expect_same_trace(TraceReader::open(d / "one.h5"), s, 0);
  EXPECT_TRUE(validate_trace(d / "s.h5").ok());
}

TEST(JoinedTrace, BadPartsAreNamed) {
  TempDir d;
  record_joined(d / "j.h5", 2);
  // An append whose parts differ from the recorded ones.
  try {
    record_joined(d / "j.h5", 2, true, {"j.rank0.h5", "other.h5"});
    ADD_FAILURE() << "an append with other parts was taken";
  } catch (const InputError& e) {
    EXPECT_NE(std::string(e.what()).find("its parts are [j.rank0.h5, j.rank1.h5], this run's would be [j.rank0.h5, "
                                         "other.h5]"),
              std::string::npos)
        << e.what();
  }
  // A part whose bytes changed after it was sealed.
  fs::copy_file(d / "j.rank1.h5", d / "keep.h5");
  {
    std::fstream f(d / "j.rank1.h5", std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(3000);
    const char c = char(f.peek() ^ 0x40);
    f.put(c);
  }
  try {
    TraceReader::open(d / "j.h5");
    ADD_FAILURE() << "a changed part was read";
  } catch (const TraceCorrupt& e) {
    EXPECT_NE(std::string(e.what()).find(d / "j.rank1.h5"), std::string::npos) << e.what();
  }
  const ValidateReport v = validate_trace(d / "j.h5");
  EXPECT_FALSE(v.ok());
  ASSERT_FALSE(v.problems.empty());
  EXPECT_EQ(v.problems[0].where, "seal");
  EXPECT_NE(v.problems[0].what.find("part " + (d / "j.rank1.h5")), std::string::npos) << v.problems[0].what;
  // A missing part.
  fs::remove(d / "j.rank1.h5");
  try {
    TraceReader::open(d / "j.h5");
    ADD_FAILURE() << "a joined trace without its part was read";
  } catch (const TraceError& e) {
    EXPECT_NE(std::string(e.what()).find("part 1 (" + (d / "j.rank1.h5") + ") is missing"), std::string::npos)
        << e.what();
  }
  // A part named outside the joined trace's folder.
  fs::rename(d / "keep.h5", d / "j.rank1.h5");
  record_joined(d / "k.h5", 2, false, {"k.rank0.h5", "../k.rank1.h5"});
  try {
    TraceReader::open(d / "k.h5");
    ADD_FAILURE() << "a part outside the folder was followed";
  } catch (const TraceError& e) {
    EXPECT_NE(std::string(e.what()).find("part 1 is named '../k.rank1.h5', not a file name beside the joined trace"),
              std::string::npos)
        << e.what();
  }
}

}  // namespace
}  // namespace dsv4
