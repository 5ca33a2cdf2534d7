// The seal of a trace (capture/trace_seal.h): its bytes against an independent reading of the layout,
// its states through a recording, an append and a kill, and every damaged copy refused by the readers
// before HDF5 sees it, with the file named and the next step given.
#include <gtest/gtest.h>
#include <hdf5.h>
#include <xxhash.h>

#include <fcntl.h>

#include <algorithm>
#include <array>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <utility>

#include <unistd.h>

#include "capture/errors.h"
#include "capture/h5_tracked.h"
#include "capture/salvage.h"
#include "capture/trace_open.h"
#include "capture/trace_reader.h"
#include "capture/trace_seal.h"
#include "capture/trace_writer.h"
#include "capture/validate.h"
#include "cli_util.h"
#include "model/forward.h"
#include "test_util.h"
#include "tiny_model.h"

namespace dsv4 {
namespace {

namespace fs = std::filesystem;
using test::tiny;

std::vector<char> slurp(const std::string& p) {
  std::ifstream in(p, std::ios::binary);
  return std::vector<char>((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}
void spit(const std::string& p, const std::vector<char>& d) {
  std::ofstream(p, std::ios::binary | std::ios::trunc).write(d.data(), std::streamsize(d.size()));
}
uint64_t le(const char* p, int n) {
  uint64_t v = 0;
  for (int i = n - 1; i >= 0; --i) v = (v << 8) | uint8_t(p[i]);
  return v;
}

void run_step(TraceWriter& w, int T, uint64_t seed) {
  StepSpec s;
  s.seed = seed;
  s.threads = 1;
  auto g = test::rng_for("seal" + std::to_string(seed));
  std::uniform_int_distribution<int32_t> d(0, tiny().config().vocab_size - 1);
  std::vector<int32_t> toks(static_cast<size_t>(T));
  for (auto& x : toks) x = d(g);
  s.seqs = {toks};
  Observer& obs = w.begin_step(s);
  RunOptions opt;
  opt.observer = &obs;
  opt.threads = 1;
  w.end_step(forward(tiny(), s.seqs, opt));
}

TraceWriter::Options decisions() {
  TraceWriter::Options o;
  o.policy = CapturePolicy::parse("decisions");
  return o;
}

class TraceSeal : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() /
           ("dsv4_seal_" + std::string(::testing::UnitTest::GetInstance()->current_test_info()->name()) + "_" +
            std::to_string(::getpid()));
    fs::remove_all(dir_);
    fs::create_directories(dir_);
    set_seal_checks(true);
  }
  void TearDown() override {
    set_seal_checks(true);
    fs::remove_all(dir_);
  }
  std::string p(const std::string& name) const { return (dir_ / name).string(); }

  std::string record(const std::string& name, int steps = 2) {
    const std::string out = p(name);
    auto w = TraceWriter::create(out, tiny().config(), make_trace_header(tiny()), decisions());
    for (int i = 0; i < steps; ++i) run_step(*w, 9 + 4 * i, uint64_t(i + 1));
    w->close();
    return out;
  }

  fs::path dir_;
};

// The header read with the layout written in capture/trace_seal.h, the digest recomputed with
// libxxhash's one-shot function over the bytes after the header.
TEST_F(TraceSeal, HeaderMatchesTheDocumentedLayout) {
  const std::string t = record("a.h5");
  const std::vector<char> b = slurp(t);
  ASSERT_GT(b.size(), 1024u);
  EXPECT_EQ(std::memcmp(b.data(), "DSV4SEAL", 8), 0);
  EXPECT_EQ(le(&b[8], 4), 1u);                    // layout version
  EXPECT_EQ(le(&b[12], 4), 2u);                   // sealed
  EXPECT_EQ(le(&b[16], 8), 512u);                 // user block
  EXPECT_EQ(le(&b[24], 8), uint64_t(b.size()));   // file size
  const XXH128_hash_t h = XXH3_128bits(b.data() + 56, b.size() - 56);
  XXH128_canonical_t c;
  XXH128_canonicalFromHash(&c, h);
  EXPECT_EQ(std::memcmp(&b[32], c.digest, 16), 0);
  EXPECT_EQ(le(&b[48], 8), XXH3_64bits(b.data(), 48));
  for (size_t i = 56; i < 512; ++i) ASSERT_EQ(b[i], 0) << "byte " << i;
  EXPECT_EQ(std::memcmp(&b[512], "\x89HDF\r\n\x1a\n", 8), 0);  // HDF5's superblock after the block

  EXPECT_EQ(check_seal(t).state, SealCheck::State::verified);
  const TraceReader r = TraceReader::open(t);
  EXPECT_EQ(r.seal().state, SealCheck::State::verified);
  EXPECT_EQ(r.steps().size(), 2u);
  EXPECT_TRUE(validate_trace(t).ok());
}

// The seal's file hash on 1 to 3 threads (its parallel path: at least 32 MiB a thread) against
// libxxhash's one-shot XXH3-128 over the same bytes in memory: sizes at the switch, at block and window
// ends, ranges that start mid-file at odd offsets, and a file shorter than the range asked for.
TEST_F(TraceSeal, FileHashEqualsLibxxhashForEveryThreadCount) {
  constexpr uint64_t kPart = uint64_t(16) << 20;
  const std::string f = p("bytes.bin");
  std::vector<char> b(size_t(2 * 3 * kPart + kPart + 1123));
  std::mt19937_64 g(7);
  for (size_t i = 0; i + 8 <= b.size(); i += 8) {
    const uint64_t v = g();
    std::memcpy(&b[i], &v, 8);
  }
  spit(f, b);
  const int fd = ::open(f.c_str(), O_RDONLY);
  ASSERT_GE(fd, 0);
  auto expected = [&](uint64_t begin, uint64_t end) {
    XXH128_canonical_t c;
    XXH128_canonicalFromHash(&c, XXH3_128bits(b.data() + begin, size_t(end - begin)));
    return std::vector<unsigned char>(c.digest, c.digest + 16);
  };
  auto got = [&](uint64_t begin, uint64_t end, int threads) {
    const std::array<unsigned char, 16> d = hash_file_range(fd, f, begin, end, threads);
    return std::vector<unsigned char>(d.begin(), d.end());
  };
  const uint64_t n = b.size();
  for (int threads = 1; threads <= 3; ++threads) {
    const uint64_t window = uint64_t(threads) * kPart;
    const std::pair<uint64_t, uint64_t> ranges[] = {// begin, size
                                                    {56, 0},
                                                    {56, 100},
                                                    {56, 2 * window},
                                                    {3, 2 * window + 1},
                                                    {56, 2 * window + 64},
                                                    {56, 2 * window + 1000},
                                                    {56, 3 * window - 1},
                                                    {56, 3 * window},
                                                    {3, n - 3}};
    for (const auto& [begin, size] : ranges) {
      if (begin + size > n) continue;
      EXPECT_EQ(got(begin, begin + size, threads), expected(begin, begin + size))
          << threads << " threads, bytes " << begin << ".." << begin + size;
    }
    // Asked past the end: the hash of what is there.
    EXPECT_EQ(got(56, n + 5 * kPart + 7, threads), expected(56, n)) << threads << " threads, past the end";
  }
  EXPECT_EQ(got(56, n, 0), expected(56, n)) << "the default thread count";
  ::close(fd);
}

// A sealed file above the parallel hash's threshold (64 MiB): the header's digest is
// libxxhash's over the bytes after the header, and the seal checks.
TEST_F(TraceSeal, LargeFileSealsWithLibxxhashsDigest) {
  const std::string f = p("large.h5");
  std::vector<char> b(size_t(70) << 20);
  std::memcpy(&b[512], "\x89HDF\r\n\x1a\n", 8);  // an empty user block before a (fake) superblock
  std::mt19937_64 g(11);
  for (size_t i = 1024; i + 8 <= b.size(); i += 8) {
    const uint64_t v = g();
    std::memcpy(&b[i], &v, 8);
  }
  spit(f, b);
  seal_trace(f);
  const std::vector<char> sealed = slurp(f);
  ASSERT_EQ(sealed.size(), b.size());
  EXPECT_EQ(le(&sealed[12], 4), 2u);
  XXH128_canonical_t c;
  XXH128_canonicalFromHash(&c, XXH3_128bits(sealed.data() + 56, sealed.size() - 56));
  EXPECT_EQ(std::memcmp(&sealed[32], c.digest, 16), 0);
  EXPECT_EQ(check_seal(f).state, SealCheck::State::verified);
  {  // A recorder's seal of a file this long: its hasher's chain of 71,680 blocks runs on two threads.
    SealHasher told;
    told.wrote(0, b.data(), b.size());
    const int fd = ::open(f.c_str(), O_RDONLY);
    ASSERT_GE(fd, 0);
    const std::array<unsigned char, 16> d = told.digest(fd, f, sealed.size());
    ::close(fd);
    EXPECT_EQ(std::memcmp(d.data(), c.digest, 16), 0);
    EXPECT_LT(told.bytes_read(), 4096u);
  }
  std::vector<char> damaged = sealed;
  damaged[damaged.size() - (size_t(13) << 20)] ^= 1;  // in a middle piece of the parallel read
  spit(f, damaged);
  EXPECT_EQ(check_seal(f).state, SealCheck::State::mismatch);
}

// The hasher told of every write (what the recorder's file driver tells it): its digest is libxxhash's
// over the file's bytes after the header whatever the writes were (appends of odd sizes, rewrites of
// parts of blocks and of whole blocks, a write across the header's end, a hole past the end, a cut and
// a regrowth, bytes written without telling it in the header's block), and it reads back only what no
// write covered whole. A second digest after more writes is right again.
TEST_F(TraceSeal, HasherToldOfTheWritesGivesLibxxhashsDigest) {
  for (uint64_t seed = 1; seed <= 3; ++seed) {
    const std::string f = p("told_" + std::to_string(seed) + ".bin");
    const int fd = ::open(f.c_str(), O_RDWR | O_CREAT | O_TRUNC, 0644);
    ASSERT_GE(fd, 0);
    std::mt19937_64 g(seed);
    SealHasher h;
    uint64_t size = 0;
    auto put = [&](uint64_t at, size_t n, bool tell = true) {
      std::vector<unsigned char> buf(n);
      for (auto& c : buf) c = static_cast<unsigned char>(g());
      ASSERT_EQ(::pwrite(fd, buf.data(), n, off_t(at)), ssize_t(n));
      if (tell) h.wrote(at, buf.data(), n);
      size = std::max(size, at + n);
    };
    auto cut = [&](uint64_t to) {
      ASSERT_EQ(::ftruncate(fd, off_t(to)), 0);
      h.resized(to);
      size = to;
    };
    auto expected = [&] {
      const std::vector<char> b = slurp(f);
      EXPECT_EQ(b.size(), size);
      XXH128_canonical_t c;
      XXH128_canonicalFromHash(&c, XXH3_128bits(b.data() + 56, b.size() - 56));
      return std::vector<unsigned char>(c.digest, c.digest + 16);
    };
    auto got = [&] {
      const std::array<unsigned char, 16> d = h.digest(fd, f, size);
      return std::vector<unsigned char>(d.begin(), d.end());
    };
    put(0, 512, false);  // the header's block, written behind the hasher's back
    for (uint64_t at = 512; at < (uint64_t(3) << 20);) {
      const size_t n = size_t(1 + g() % 200000);
      put(at, n);
      at += n;
    }
    for (int i = 0; i < 40; ++i) put(g() % size, size_t(1 + g() % 5000));  // parts of blocks
    put(56 + 1024 * 100, 1024 * 7);                                        // whole blocks again
    put(40, 3000);                                                         // across the header's end
    EXPECT_EQ(got(), expected()) << "seed " << seed;
    EXPECT_LT(h.bytes_read(), size / 10) << "seed " << seed;
    put(size + 5000, 777);  // a hole before it
    cut(size - 70000);
    put(size, 100000);
    cut(size + 3000);  // zeros past the last write
    put(g() % size, 1500);
    EXPECT_EQ(got(), expected()) << "seed " << seed << ", after the cuts";
    ::close(fd);
  }
}

// Past the hasher's limit the blocks are read back at the digest; a hasher told nothing reads (and
// hashes) the whole file.
TEST_F(TraceSeal, HasherPastItsLimitReadsTheRestBack) {
  const std::string f = p("limit.bin");
  const int fd = ::open(f.c_str(), O_RDWR | O_CREAT | O_TRUNC, 0644);
  ASSERT_GE(fd, 0);
  std::vector<unsigned char> b(size_t(2) << 20);
  std::mt19937_64 g(3);
  for (auto& c : b) c = static_cast<unsigned char>(g());
  ASSERT_EQ(::pwrite(fd, b.data(), b.size(), 0), ssize_t(b.size()));
  XXH128_canonical_t c;
  XXH128_canonicalFromHash(&c, XXH3_128bits(b.data() + 56, b.size() - 56));
  const std::vector<unsigned char> want(c.digest, c.digest + 16);
  SealHasher small(64 << 10);
  small.wrote(0, b.data(), b.size());
  std::array<unsigned char, 16> d = small.digest(fd, f, b.size());
  EXPECT_EQ(std::vector<unsigned char>(d.begin(), d.end()), want);
  EXPECT_GT(small.bytes_read(), b.size() - (uint64_t(80) << 10));
  SealHasher none;
  d = none.digest(fd, f, b.size());
  EXPECT_EQ(std::vector<unsigned char>(d.begin(), d.end()), want);
  EXPECT_EQ(none.bytes_read(), b.size() - 56);
  EXPECT_THROW(none.digest(fd, f, b.size() + 4096), TraceError);  // the file ends before the size given
  ::close(fd);
}

// The recorder's file driver passes HDF5's calls to sec2: the same objects written through it and
// through sec2 give the same bytes. And the recorder's seal reads back a small part of its trace.
TEST_F(TraceSeal, TrackedDriverWritesSec2sBytes) {
  auto write = [&](const std::string& f, bool tracked, SealHasher* h) {
    const hid_t fapl = H5Pcreate(H5P_FILE_ACCESS);
    H5Pset_libver_bounds(fapl, H5F_LIBVER_LATEST, H5F_LIBVER_LATEST);
    H5Pset_file_locking(fapl, false, true);
    if (tracked) {
      EXPECT_TRUE(h5::track_writes(fapl, h));
    }
    const hid_t fcpl = H5Pcreate(H5P_FILE_CREATE);
    H5Pset_userblock(fcpl, 512);
    H5Pset_obj_track_times(fcpl, false);  // the root group's times would differ across a second
    const hid_t file = H5Fcreate(f.c_str(), H5F_ACC_TRUNC, fcpl, fapl);
    ASSERT_GE(file, 0);
    const hid_t gcpl = H5Pcreate(H5P_GROUP_CREATE);
    H5Pset_obj_track_times(gcpl, false);
    const hid_t grp = H5Gcreate2(file, "g", H5P_DEFAULT, gcpl, H5P_DEFAULT);
    const hsize_t dims[1] = {0}, maxd[1] = {H5S_UNLIMITED}, chunk[1] = {4096};
    const hid_t space = H5Screate_simple(1, dims, maxd);
    const hid_t dcpl = H5Pcreate(H5P_DATASET_CREATE);
    H5Pset_obj_track_times(dcpl, false);
    H5Pset_chunk(dcpl, 1, chunk);
    H5Pset_deflate(dcpl, 4);
    const hid_t ds = H5Dcreate2(grp, "d", H5T_NATIVE_FLOAT, space, H5P_DEFAULT, dcpl, H5P_DEFAULT);
    ASSERT_GE(ds, 0);
    std::vector<float> v(100000);
    for (size_t i = 0; i < v.size(); ++i) v[i] = float(i % 977) * 0.5f;
    const hsize_t n[1] = {v.size()};
    H5Dset_extent(ds, n);
    H5Dwrite(ds, H5T_NATIVE_FLOAT, H5S_ALL, H5S_ALL, H5P_DEFAULT, v.data());
    H5Dclose(ds);
    H5Pclose(dcpl);
    H5Sclose(space);
    H5Gclose(grp);
    H5Pclose(gcpl);
    EXPECT_GE(H5Fstart_swmr_write(file), 0);  // the recorder's mode while a step is written
    EXPECT_EQ(h5::posix_descriptor(file) >= 0, true);
    EXPECT_GE(H5Fclose(file), 0);
    H5Pclose(fcpl);
    H5Pclose(fapl);
  };
  SealHasher h;
  write(p("plain.h5"), false, nullptr);
  // In another second: no object may carry a time (a run under emulation straddled one and differed).
  std::this_thread::sleep_for(std::chrono::milliseconds(1100));
  write(p("tracked.h5"), true, &h);
  const std::vector<char> plain = slurp(p("plain.h5")), tracked = slurp(p("tracked.h5"));
  EXPECT_GT(plain.size(), 10000u);
  EXPECT_TRUE(plain == tracked) << plain.size() << " against " << tracked.size() << " bytes";
  const int fd = ::open(p("tracked.h5").c_str(), O_RDONLY);
  const std::array<unsigned char, 16> d = h.digest(fd, p("tracked.h5"), tracked.size());
  ::close(fd);
  XXH128_canonical_t c;
  XXH128_canonicalFromHash(&c, XXH3_128bits(tracked.data() + 56, tracked.size() - 56));
  EXPECT_EQ(std::memcmp(d.data(), c.digest, 16), 0);

  // A recording: verified, and its seal read back a part of the file (the tiny model's trace is mostly
  // small objects' metadata, about a quarter of it; a mid decisions trace reads back under 1%:
  // bench_capture BM_WriterSteps, seal_read_MB).
  const std::string t = p("rec.h5");
  auto w = TraceWriter::create(t, tiny().config(), make_trace_header(tiny()), decisions());
  for (int i = 0; i < 3; ++i) run_step(*w, 40 + i, uint64_t(i + 1));
  w->close();
  const uint64_t bytes = fs::file_size(t);
  EXPECT_GT(w->stats().seal_bytes_read, 0);
  EXPECT_LT(uint64_t(w->stats().seal_bytes_read), bytes / 2) << "of " << bytes << " bytes";
  EXPECT_EQ(check_seal(t).state, SealCheck::State::verified);
}

// Open while recording and while appending; sealed again at each close, with every step.
TEST_F(TraceSeal, StatesThroughRecordingAndAppend) {
  const std::string t = p("b.h5");
  {
    auto w = TraceWriter::create(t, tiny().config(), make_trace_header(tiny()), decisions());
    EXPECT_EQ(check_seal(w->writing_path()).state, SealCheck::State::open);
    run_step(*w, 9, 1);
    EXPECT_EQ(check_seal(w->writing_path()).state, SealCheck::State::open);
    w->close();
  }
  EXPECT_EQ(check_seal(t).state, SealCheck::State::verified);
  const std::vector<char> before = slurp(t);
  {
    auto w = TraceWriter::append(t, tiny().config(), make_trace_header(tiny()), decisions());
    EXPECT_EQ(check_seal(t).state, SealCheck::State::open);
    run_step(*w, 13, 2);
    w->close();
  }
  EXPECT_EQ(check_seal(t).state, SealCheck::State::verified);
  EXPECT_NE(slurp(t), before);
  EXPECT_EQ(TraceReader::open(t).steps().size(), 2u);

  // A recorder that dies while appending leaves the mark: the file reads without verification, and
  // validate and the reader agree on what is in it.
  {
    auto w = TraceWriter::append(t, tiny().config(), make_trace_header(tiny()), decisions());
    run_step(*w, 11, 3);
    // no close(): what a kill after the step leaves
  }
  EXPECT_EQ(check_seal(t).state, SealCheck::State::open);
  const ValidateReport v = validate_trace(t);
  EXPECT_TRUE(v.ok());
  EXPECT_EQ(v.seal.state, SealCheck::State::open);
  EXPECT_EQ(TraceReader::open(t).steps().size(), 3u);
}

// Every flipped byte, truncation and extension is refused by the reader with one sentence naming the
// file and salvage, and reported by validate as a problem of the seal.
TEST_F(TraceSeal, EveryDamagedCopyIsRefusedBeforeHdf5ReadsIt) {
  const std::string t = record("c.h5");
  const std::vector<char> b = slurp(t);
  std::vector<std::pair<std::string, std::vector<char>>> mutants;
  std::mt19937 rng(11);
  std::vector<size_t> at = {0, 7, 8, 12, 24, 32, 47, 48, 55, 56, 300, 511, 512, 513, 520, b.size() - 1};
  for (int i = 0; i < 40; ++i) at.push_back(512 + rng() % (b.size() - 512));
  for (size_t a : at) {
    std::vector<char> d = b;
    d[a] = char(d[a] ^ (1 << (rng() % 8)));
    mutants.push_back({"flip_" + std::to_string(a), d});
  }
  mutants.push_back({"cut", std::vector<char>(b.begin(), b.end() - 100)});
  std::vector<char> longer = b;
  longer.insert(longer.end(), 64, '\0');
  mutants.push_back({"grown", longer});
  for (const auto& [name, data] : mutants) {
    const std::string m = p(name + ".h5");
    spit(m, data);
    const SealCheck c = check_seal(m);
    EXPECT_FALSE(c.ok()) << name << ": " << seal_state_name(c.state);
    try {
      TraceReader::open(m);
      ADD_FAILURE() << name << ": opened";
    } catch (const TraceCorrupt& e) {
      const std::string w = e.what();
      EXPECT_EQ(w.rfind(m + ": damaged", 0), 0u) << w;
      EXPECT_NE(w.find("dsv4 trace salvage"), std::string::npos) << w;
      EXPECT_EQ(w.find('\n'), std::string::npos) << w;
    }
    const ValidateReport v = validate_trace(m);
    ASSERT_FALSE(v.ok()) << name;
    if (v.readable) {
      bool seal = false;
      for (const auto& q : v.problems) seal = seal || q.where == "seal";
      EXPECT_TRUE(seal) << name;
    }
  }
}

// Damage the structural checks cannot see (a digit of the `created` attribute, a string in HDF5's
// global heap): the seal alone catches it, and salvage says that its copy may still hold it.
TEST_F(TraceSeal, SalvageOfAFileThatMissesItsSealWarns) {
  const std::string t = record("d.h5", 1);
  std::vector<char> b = slurp(t);
  const std::string created = TraceReader::open(t).created();  // 2026-12-01T19:13:33Z
  ASSERT_GE(created.size(), 19u);
  const auto at = std::search(b.begin(), b.end(), created.begin(), created.end());
  ASSERT_NE(at, b.end());
  char& second = *(at + 18);
  second = second == '0' ? '1' : '0';
  const std::string m = p("d_damaged.h5");
  spit(m, b);
  EXPECT_EQ(check_seal(m).state, SealCheck::State::mismatch);
  const ValidateReport v = validate_trace(m);
  ASSERT_EQ(v.problems.size(), 1u);
  EXPECT_EQ(v.problems[0].where, "seal");
  const SalvageResult s = salvage_trace(m, p("d_salvaged.h5"));
  EXPECT_EQ(s.copied.size(), 1u);
  EXPECT_NE(s.seal_problem.find("damaged"), std::string::npos);
  EXPECT_EQ(check_seal(p("d_salvaged.h5")).state, SealCheck::State::verified);
}

// A trace written before seals (the samples) reads as before; --no-seal-check skips the hash.
TEST_F(TraceSeal, UnsealedTracesAndSkippedChecks) {
  const std::string sample = std::string(DSV4_SOURCE_DIR) + "/traces/samples/tiny-train.h5";
  EXPECT_EQ(check_seal(sample).state, SealCheck::State::none);
  EXPECT_TRUE(validate_trace(sample).ok());
  EXPECT_EQ(TraceReader::open(sample).seal().state, SealCheck::State::none);
  // Appending to it keeps it unsealed (it has no room for a seal) and readable.
  const std::string copy = p("old.h5");
  fs::copy_file(sample, copy);
  const size_t steps = TraceReader::open(copy).steps().size();
  {
    auto w = TraceWriter::append(copy, tiny().config(), make_trace_header(tiny()), decisions());
    run_step(*w, 9, 1);
    w->close();
  }
  EXPECT_EQ(check_seal(copy).state, SealCheck::State::none);
  EXPECT_EQ(TraceReader::open(copy).steps().size(), steps + 1);
  EXPECT_TRUE(validate_trace(copy).ok());

  const std::string t = record("e.h5", 1);
  std::vector<char> b = slurp(t);
  b[b.size() / 2] ^= 1;
  const std::string m = p("e_damaged.h5");
  spit(m, b);
  set_seal_checks(false);
  EXPECT_EQ(check_seal(m).state, SealCheck::State::unchecked);
  set_seal_checks(true);
  EXPECT_EQ(check_seal(m).state, SealCheck::State::mismatch);
}

// The commands: one error line, exit 2, for a damaged sealed trace; `trace info` shows the seal.
TEST_F(TraceSeal, CommandsNameTheSeal) {
  const std::string t = record("f.h5", 1);
  test::CliResult r = test::run_cli("trace info " + t);
  EXPECT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("seal: verified"), std::string::npos) << r.out;
  std::vector<char> b = slurp(t);
  b[b.size() - 10] ^= 4;
  const std::string m = p("f_damaged.h5");
  spit(m, b);
  for (const std::string cmd : {"trace info ", "replay ", "trace dump --what tokens "}) {
    r = test::run_cli(cmd + m);
    EXPECT_EQ(r.code, 2) << cmd << r.out;
    EXPECT_NE(r.out.find("damaged: the file no longer matches the seal"), std::string::npos) << cmd << r.out;
  }
  // Without the check the damage is met later, by HDF5's own checksums here.
  r = test::run_cli("--no-seal-check trace info " + m);
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_EQ(r.out.find("seal:"), std::string::npos) << r.out;
  r = test::run_cli("--no-seal-check trace info " + t);
  EXPECT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("seal: sealed, not checked"), std::string::npos) << r.out;
}

}  // namespace
}  // namespace dsv4
