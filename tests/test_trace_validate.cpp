// validate_trace and salvage_trace on traces recorded from the tiny model: a valid trace is clean;
// problems planted with the HDF5 C API are each reported at their dataset and token; a trace whose
// recorder stopped mid-step keeps its complete steps through salvage, bit for bit; files that are not
// traces are reported unreadable without throwing.
#include <hdf5.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>

#include <unistd.h>

#include "capture/errors.h"
#include "capture/salvage.h"
#include "capture/trace_seal.h"
#include "capture/trace_writer.h"
#include "capture/validate.h"
#include "model/config.h"
#include "model/forward.h"
#include "model/weights.h"
#include "test_util.h"
#include "tiny_model.h"

namespace dsv4 {
namespace {

namespace fs = std::filesystem;

using test::tiny;

std::vector<int32_t> tokens(const std::string& name, int T) {
  auto g = test::rng_for(name);
  std::uniform_int_distribution<int32_t> d(0, tiny().config().vocab_size - 1);
  std::vector<int32_t> v(static_cast<size_t>(T));
  for (auto& x : v) x = d(g);
  return v;
}

StepSpec spec(std::vector<std::vector<int32_t>> seqs, uint64_t seed = 1) {
  StepSpec s;
  s.seed = seed;
  s.threads = 1;  // results do not depend on it; one thread keeps the suite quick on a busy machine
  s.seqs = std::move(seqs);
  return s;
}

void run_step(TraceWriter& w, const StepSpec& s) {
  Observer& obs = w.begin_step(s);
  RunOptions opt;
  opt.observer = &obs;
  opt.threads = s.threads;
  const ForwardResult r = forward(tiny(), s.seqs, opt);
  w.end_step(r);
}

std::unique_ptr<TraceWriter> new_writer(const std::string& path, const std::string& policy) {
  TraceWriter::Options opt;
  opt.policy = CapturePolicy::parse(policy);
  return TraceWriter::create(path, tiny().config(), make_trace_header(tiny()), opt);
}

// A temporary directory per test, removed at the end.
class TraceValidate : public ::testing::Test {
 protected:
  void SetUp() override {
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    dir_ = fs::temp_directory_path() / fmt_name(std::string("dsv4_validate_") + info->name());
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }
  static std::string fmt_name(const std::string& s) { return s + "_" + std::to_string(::getpid()); }
  std::string path(const std::string& name) const { return (dir_ / name).string(); }

  // One step, one sequence of 17 tokens (C4 layers see 4 groups), decisions only.
  std::string record_one(const std::string& name) {
    const std::string p = path(name);
    auto w = new_writer(p, "decisions");
    run_step(*w, spec({tokens("one", 17)}));
    w->close();
    return p;
  }

  fs::path dir_;
};

// ---- a small HDF5 C API toolkit, independent of the code under test -----------------------------

// Opened read-write, the file is sealed again at the close (capture/trace_seal.h), as a writer with the
// planted bug would have sealed it: the checks behind the seal are what these tests exercise.
struct File {
  hid_t id = -1;
  std::string path;
  bool reseal = false;
  explicit File(const std::string& p, unsigned flags = H5F_ACC_RDWR) : path(p), reseal(flags == H5F_ACC_RDWR) {
    H5Eset_auto2(H5E_DEFAULT, nullptr, nullptr);
    id = H5Fopen(p.c_str(), flags, H5P_DEFAULT);
    EXPECT_GE(id, 0) << p;
  }
  ~File() {
    if (id >= 0) H5Fclose(id);
    if (id >= 0 && reseal) seal_trace(path);
  }
};

template <typename T>
std::vector<T> read_ds(hid_t f, const std::string& path, hid_t mem) {
  const hid_t ds = H5Dopen2(f, path.c_str(), H5P_DEFAULT);
  EXPECT_GE(ds, 0) << path;
  const hid_t space = H5Dget_space(ds);
  std::vector<T> v(size_t(H5Sget_simple_extent_npoints(space)));
  if (!v.empty()) {
    EXPECT_GE(H5Dread(ds, mem, H5S_ALL, H5S_ALL, H5P_DEFAULT, v.data()), 0) << path;
  }
  H5Sclose(space);
  H5Dclose(ds);
  return v;
}

template <typename T>
void write_ds(hid_t f, const std::string& path, hid_t mem, const std::vector<T>& v) {
  const hid_t ds = H5Dopen2(f, path.c_str(), H5P_DEFAULT);
  ASSERT_GE(ds, 0) << path;
  EXPECT_GE(H5Dwrite(ds, mem, H5S_ALL, H5S_ALL, H5P_DEFAULT, v.data()), 0) << path;
  H5Dclose(ds);
}

void set_root_int_attr(const std::string& file, const char* name, int32_t value) {
  File f(file);
  const hid_t a = H5Aopen(f.id, name, H5P_DEFAULT);
  ASSERT_GE(a, 0);
  EXPECT_GE(H5Awrite(a, H5T_NATIVE_INT32, &value), 0);
  H5Aclose(a);
}

// The raw bytes of every dataset and attribute below `group` (name -> bytes), for bitwise comparison.
struct Collected {
  std::map<std::string, std::vector<uint8_t>> items;
};

herr_t collect_attr(hid_t loc, const char* name, const H5A_info_t*, void* data) {
  auto& out = *static_cast<std::pair<Collected*, std::string>*>(data);
  const hid_t a = H5Aopen(loc, name, H5P_DEFAULT);
  const hid_t type = H5Aget_type(a);
  std::vector<uint8_t> bytes;
  if (H5Tis_variable_str(type) > 0) {
    char* s = nullptr;
    H5Aread(a, type, &s);
    bytes.assign(s, s + std::strlen(s));
    H5free_memory(s);
  } else {
    bytes.resize(H5Tget_size(type));
    H5Aread(a, type, bytes.data());
  }
  out.first->items[out.second + "@" + name] = bytes;
  H5Tclose(type);
  H5Aclose(a);
  return 0;
}

herr_t collect_object(hid_t root, const char* name, const H5O_info_t* info, void* data) {
  auto* c = static_cast<Collected*>(data);
  const hid_t o = H5Oopen(root, name, H5P_DEFAULT);
  std::pair<Collected*, std::string> ctx{c, name};
  hsize_t idx = 0;
  H5Aiterate2(o, H5_INDEX_NAME, H5_ITER_INC, &idx, collect_attr, &ctx);
  if (info->type == H5O_TYPE_DATASET) {
    const hid_t type = H5Dget_type(o), space = H5Dget_space(o);
    const size_t n = size_t(H5Sget_simple_extent_npoints(space));
    std::vector<uint8_t> bytes;
    if (H5Tis_variable_str(type) > 0) {  // the strings, each followed by a 0
      std::vector<char*> p(n, nullptr);
      if (n) H5Dread(o, type, H5S_ALL, H5S_ALL, H5P_DEFAULT, p.data());
      for (char* s : p) {
        bytes.insert(bytes.end(), s, s + std::strlen(s));
        bytes.push_back(0);
      }
      H5Dvlen_reclaim(type, space, H5P_DEFAULT, p.data());
    } else {
      bytes.resize(n * H5Tget_size(type));
      if (n) H5Dread(o, type, H5S_ALL, H5S_ALL, H5P_DEFAULT, bytes.data());
    }
    c->items[name] = bytes;
    H5Sclose(space);
    H5Tclose(type);
  }
  H5Oclose(o);
  return 0;
}

Collected collect(const std::string& file, const std::string& group) {
  File f(file, H5F_ACC_RDONLY);
  Collected c;
  const hid_t g = H5Oopen(f.id, group.c_str(), H5P_DEFAULT);
  EXPECT_GE(g, 0) << group;
  H5Ovisit2(g, H5_INDEX_NAME, H5_ITER_INC, collect_object, &c, H5O_INFO_BASIC);
  H5Oclose(g);
  return c;
}

// The problems whose `where` ends with `suffix`, as "where: what" lines.
std::vector<std::string> problems_at(const ValidateReport& r, const std::string& suffix) {
  std::vector<std::string> out;
  for (const auto& p : r.problems)
    if (p.where.size() >= suffix.size() &&
        p.where.compare(p.where.size() - suffix.size(), suffix.size(), suffix) == 0)
      out.push_back(p.where + ": " + p.what);
  return out;
}

std::string all_problems(const ValidateReport& r) {
  std::string s;
  for (const auto& p : r.problems) s += "\n  " + p.where + ": " + p.what;
  return s;
}

bool any_contains(const std::vector<std::string>& v, const std::string& needle) {
  return std::any_of(v.begin(), v.end(),
                     [&](const std::string& s) { return s.find(needle) != std::string::npos; });
}

// ---- valid traces -------------------------------------------------------------------------------

TEST_F(TraceValidate, ValidTraceIsClean) {
  const std::string p = path("valid.h5");
  {
    auto w = new_writer(p, "attn.q@1-2,logits,indexer.*");
    run_step(*w, spec({tokens("a", 17)}));
    run_step(*w, spec({tokens("b", 9), tokens("c", 23)}, 2));
    w->close();
  }
  const ValidateReport r = validate_trace(p);
  EXPECT_TRUE(r.readable);
  EXPECT_FALSE(r.incomplete_file);
  EXPECT_TRUE(r.ok()) << all_problems(r);
  ASSERT_EQ(r.steps.size(), 2u);
  for (int i = 0; i < 2; ++i) {
    EXPECT_EQ(r.steps[size_t(i)].index, i);
    EXPECT_TRUE(r.steps[size_t(i)].complete);
    EXPECT_EQ(r.steps[size_t(i)].problems, 0);
  }
}

TEST_F(TraceValidate, FullCaptureIsCleanAndItsTensorsMatchTheDigests) {
  const std::string p = path("full.h5");
  {
    auto w = new_writer(p, "full");
    run_step(*w, spec({tokens("full", 13)}));
    w->close();
  }
  EXPECT_TRUE(validate_trace(p).ok()) << all_problems(validate_trace(p));
  // One changed bf16 value of a kept tensor no longer hashes to its recorded digest.
  {
    File f(p);
    const std::string ds = "/steps/000000/seq_000/tensors/attn.q/layer_002";
    auto v = read_ds<uint16_t>(f.id, ds, H5T_NATIVE_UINT16);
    v[v.size() / 2 + 3] ^= 1;
    write_ds(f.id, ds, H5T_NATIVE_UINT16, v);
  }
  const ValidateReport r = validate_trace(p);
  const auto at = problems_at(r, "tensors/attn.q/layer_002");
  ASSERT_EQ(at.size(), 1u) << all_problems(r);
  EXPECT_NE(at[0].find("recorded digest"), std::string::npos) << at[0];
}

// ---- planted problems ---------------------------------------------------------------------------

TEST_F(TraceValidate, PlantedProblemsAreNamedByDatasetAndToken) {
  const std::string clean = record_one("clean.h5");
  ASSERT_TRUE(validate_trace(clean).ok()) << all_problems(validate_trace(clean));
  const std::string seq = "/steps/000000/seq_000/";
  const ModelConfig& c = tiny().config();
  const int k = c.num_experts_per_tok;
  auto copy = [&](const std::string& name) {
    const std::string p = path(name);
    fs::copy_file(clean, p);
    return p;
  };

  {  // An expert id out of range (the tiny model has 8 experts) at token 5 of layer 3.
    const std::string p = copy("expert.h5");
    {
      File f(p);
      const std::string ds = seq + "decisions/layer_003/experts";
      auto v = read_ds<int32_t>(f.id, ds, H5T_NATIVE_INT32);
      v[size_t(5 * k + k - 1)] = 9;
      write_ds(f.id, ds, H5T_NATIVE_INT32, v);
    }
    const ValidateReport r = validate_trace(p);
    EXPECT_TRUE(r.readable);
    const auto at = problems_at(r, "decisions/layer_003/experts");
    EXPECT_TRUE(any_contains(at, "expert id 9 at token 5")) << all_problems(r);
    EXPECT_EQ(r.problems.size(), at.size()) << all_problems(r);
    ASSERT_EQ(r.steps.size(), 1u);
    EXPECT_EQ(r.steps[0].problems, int(r.problems.size()));
  }
  {  // A first gap that moves an indexer id past what its token can see.
    const std::string p = copy("gap.h5");
    int64_t token = -1;
    {
      File f(p);
      const std::string d = seq + "decisions/layer_001/";
      const auto count = read_ds<int32_t>(f.id, d + "indexer_count", H5T_NATIVE_INT32);
      auto gaps = read_ds<int32_t>(f.id, d + "indexer_gaps", H5T_NATIVE_INT32);
      // The last token with a selection: its first gap becomes larger than any visible id.
      size_t pos = 0;
      size_t at_pos = 0;
      for (size_t t = 0; t < count.size(); ++t) {
        if (count[t] > 0) {
          token = int64_t(t);
          at_pos = pos;
        }
        pos += size_t(count[t]);
      }
      ASSERT_GE(token, 0);
      ASSERT_EQ(pos, gaps.size());
      gaps[at_pos] = 100;
      write_ds(f.id, d + "indexer_gaps", H5T_NATIVE_INT32, gaps);
    }
    const ValidateReport r = validate_trace(p);
    const auto at = problems_at(r, "decisions/layer_001/indexer_gaps");
    EXPECT_TRUE(any_contains(at, "indexer id 100 at token " + std::to_string(token))) << all_problems(r);
    EXPECT_TRUE(any_contains(at, "not visible")) << all_problems(r);
    EXPECT_EQ(r.problems.size(), at.size()) << all_problems(r);
  }
  {  // A digest record with one row too many.
    const std::string p = copy("rows.h5");
    {
      File f(p);
      auto rows = read_ds<int64_t>(f.id, seq + "digests/rows", H5T_NATIVE_INT64);
      rows[10] += 1;
      write_ds(f.id, seq + "digests/rows", H5T_NATIVE_INT64, rows);
    }
    const ValidateReport r = validate_trace(p);
    EXPECT_TRUE(any_contains(problems_at(r, "digests/rows"), "record 10 ")) << all_problems(r);
    EXPECT_TRUE(any_contains(problems_at(r, "digests/value"), "rows add up to")) << all_problems(r);
  }
  {  // A positive log-prob at token 3.
    const std::string p = copy("logprob.h5");
    {
      File f(p);
      auto lp = read_ds<float>(f.id, seq + "logprobs", H5T_NATIVE_FLOAT);
      lp[3] = 1.0f;
      write_ds(f.id, seq + "logprobs", H5T_NATIVE_FLOAT, lp);
    }
    const ValidateReport r = validate_trace(p);
    const auto at = problems_at(r, "seq_000/logprobs");
    ASSERT_EQ(at.size(), 1u) << all_problems(r);
    EXPECT_NE(at[0].find("at token 3 is positive"), std::string::npos) << at[0];
    EXPECT_EQ(r.problems.size(), 1u) << all_problems(r);
  }
  {  // A deleted dataset.
    const std::string p = copy("deleted.h5");
    {
      File f(p);
      EXPECT_GE(H5Ldelete(f.id, (seq + "decisions/layer_002/expert_weights").c_str(), H5P_DEFAULT), 0);
    }
    const ValidateReport r = validate_trace(p);
    const auto at = problems_at(r, "decisions/layer_002/expert_weights");
    ASSERT_EQ(at.size(), 1u) << all_problems(r);
    EXPECT_NE(at[0].find("missing"), std::string::npos) << at[0];
    EXPECT_EQ(r.problems.size(), 1u) << all_problems(r);
  }
  {  // A token id outside the vocabulary, and the hash flag of a learned layer set.
    const std::string p = copy("token.h5");
    {
      File f(p);
      auto t = read_ds<int32_t>(f.id, seq + "tokens", H5T_NATIVE_INT32);
      t[7] = c.vocab_size;
      write_ds(f.id, seq + "tokens", H5T_NATIVE_INT32, t);
      const hid_t g = H5Gopen2(f.id, (seq + "decisions/layer_004").c_str(), H5P_DEFAULT);
      const hid_t a = H5Aopen(g, "hashed", H5P_DEFAULT);
      const uint8_t one = 1;
      EXPECT_GE(H5Awrite(a, H5T_NATIVE_UINT8, &one), 0);
      H5Aclose(a);
      H5Gclose(g);
    }
    const ValidateReport r = validate_trace(p);
    EXPECT_TRUE(any_contains(problems_at(r, "seq_000/tokens"), "token id 512 at token 7")) << all_problems(r);
    EXPECT_TRUE(any_contains(problems_at(r, "decisions/layer_004"), "hashed = 1, expected 0"))
        << all_problems(r);
  }
}

TEST_F(TraceValidate, FlippedByteInAChunkIsAProblemNotACrash) {
  const std::string p = record_one("flip.h5");
  haddr_t addr = HADDR_UNDEF;
  {
    File f(p, H5F_ACC_RDONLY);
    const hid_t ds = H5Dopen2(f.id, "/steps/000000/seq_000/decisions/layer_000/expert_weights", H5P_DEFAULT);
    const hid_t space = H5Dget_space(ds);
    hsize_t offset[2], size = 0;
    unsigned mask = 0;
    ASSERT_GE(H5Dget_chunk_info(ds, space, 0, offset, &mask, &addr, &size), 0);
    H5Sclose(space);
    H5Dclose(ds);
    // A chunk's address counts from the HDF5 file's base, after the user block that holds the seal.
    const hid_t fcpl = H5Fget_create_plist(f.id);
    hsize_t user_block = 0;
    ASSERT_GE(H5Pget_userblock(fcpl, &user_block), 0);
    H5Pclose(fcpl);
    addr += user_block;
  }
  {
    std::fstream f(p, std::ios::in | std::ios::out | std::ios::binary);
    f.seekg(std::streamoff(addr + 3));
    char b = 0;
    f.read(&b, 1);
    b = char(b ^ 0x10);
    f.seekp(std::streamoff(addr + 3));
    f.write(&b, 1);
  }
  // The seal says the file changed; the chunk's checksum says where.
  const ValidateReport r = validate_trace(p);
  EXPECT_TRUE(r.readable);
  const auto at = problems_at(r, "decisions/layer_000/expert_weights");
  ASSERT_EQ(at.size(), 1u) << all_problems(r);
  ASSERT_EQ(r.problems.size(), 2u) << all_problems(r);
  EXPECT_EQ(r.problems[0].where, "seal");
}

// ---- a recorder that stopped --------------------------------------------------------------------

TEST_F(TraceValidate, UnclosedTraceKeepsItsCompleteStepThroughSalvage) {
  const std::string p = path("crash.h5");
  std::string writing;
  {
    auto w = new_writer(p, "attn.out@0");
    run_step(*w, spec({tokens("s0", 17), tokens("s0b", 6)}));
    // The second step is laid out and computed but never ended; the writer goes away without close().
    const StepSpec s1 = spec({tokens("s1", 21)}, 2);
    Observer& obs = w->begin_step(s1);
    RunOptions opt;
    opt.observer = &obs;
    opt.threads = s1.threads;
    forward(tiny(), s1.seqs, opt);
    writing = w->writing_path();
  }
  ASSERT_FALSE(fs::exists(p));
  ASSERT_TRUE(fs::exists(writing));

  const ValidateReport r = validate_trace(writing);
  EXPECT_TRUE(r.readable);
  EXPECT_TRUE(r.incomplete_file);
  ASSERT_EQ(r.steps.size(), 2u);
  EXPECT_TRUE(r.steps[0].complete);
  EXPECT_EQ(r.steps[0].problems, 0);
  EXPECT_FALSE(r.steps[1].complete);
  ASSERT_EQ(r.problems.size(), 1u) << all_problems(r);
  EXPECT_EQ(r.problems[0].where, "/steps/000001/status");
  EXPECT_NE(r.problems[0].what.find("incomplete"), std::string::npos);

  const std::string out = path("salvaged.h5");
  EXPECT_EQ(salvage_trace(writing, out).copied.size(), 1u);
  EXPECT_FALSE(fs::exists(out + ".incomplete"));
  const ValidateReport s = validate_trace(out);
  EXPECT_TRUE(s.ok()) << all_problems(s);
  ASSERT_EQ(s.steps.size(), 1u);
  EXPECT_TRUE(s.steps[0].complete);

  // The salvaged step and /meta are the originals, bit for bit (datasets and attributes).
  for (const char* g : {"/steps/000000", "/meta"}) {
    const Collected a = collect(writing, g), b = collect(out, g);
    EXPECT_GE(a.items.size(), 20u) << g;
    ASSERT_EQ(a.items.size(), b.items.size()) << g;
    for (const auto& [name, bytes] : a.items) {
      ASSERT_TRUE(b.items.count(name)) << g << "/" << name;
      EXPECT_TRUE(test::bitwise_equal(bytes, b.items.at(name))) << g << "/" << name;
    }
  }

  // Salvage writes a new file only.
  EXPECT_THROW(salvage_trace(writing, out), InputError);
}

TEST_F(TraceValidate, WriterFlagLeftInTheSuperblock) {
  // A writer that dies while it holds the file outside SWMR mode leaves the superblock's "open for
  // writing" flag set. A copy taken while this process holds the file read-write has the same bytes
  // (a writer marks the seal open before it opens the file).
  const std::string clean = record_one("held.h5");
  const std::string p = path("flagged.h5");
  mark_trace_open(clean);
  {
    const hid_t fapl = H5Pcreate(H5P_FILE_ACCESS);
    H5Pset_libver_bounds(fapl, H5F_LIBVER_LATEST, H5F_LIBVER_LATEST);
    const hid_t f = H5Fopen(clean.c_str(), H5F_ACC_RDWR, fapl);
    ASSERT_GE(f, 0);
    fs::copy_file(clean, p);
    H5Fclose(f);
    H5Pclose(fapl);
  }
  {
    H5Eset_auto2(H5E_DEFAULT, nullptr, nullptr);
    const hid_t f = H5Fopen(p.c_str(), H5F_ACC_RDONLY, H5P_DEFAULT);
    if (f >= 0) {
      H5Fclose(f);
      GTEST_SKIP() << "this HDF5 does not leave the write flag on disk while the file is open";
    }
  }
  const ValidateReport r = validate_trace(p);
  EXPECT_TRUE(r.readable);
  ASSERT_EQ(r.problems.size(), 1u) << all_problems(r);
  EXPECT_EQ(r.problems[0].where, "file");
  EXPECT_NE(r.problems[0].what.find("open for writing"), std::string::npos);
  ASSERT_EQ(r.steps.size(), 1u);
  EXPECT_TRUE(r.steps[0].complete);
  const std::string out = path("from_flagged.h5");
  EXPECT_EQ(salvage_trace(p, out).copied.size(), 1u);
  EXPECT_TRUE(validate_trace(out).ok()) << all_problems(validate_trace(out));
}

TEST_F(TraceValidate, SalvageNeedsACompleteStep) {
  const std::string p = path("none.h5");
  std::string writing;
  {
    auto w = new_writer(p, "decisions");
    const StepSpec s = spec({tokens("none", 9)});
    w->begin_step(s);
    writing = w->writing_path();
  }
  const ValidateReport r = validate_trace(writing);
  EXPECT_TRUE(r.readable);
  ASSERT_EQ(r.steps.size(), 1u);
  EXPECT_FALSE(r.steps[0].complete);
  EXPECT_THROW(salvage_trace(writing, path("out.h5")), TraceIncomplete);
  EXPECT_FALSE(fs::exists(path("out.h5")));
  EXPECT_FALSE(fs::exists(path("out.h5.incomplete")));
}

// ---- files that are not traces ------------------------------------------------------------------

TEST_F(TraceValidate, UnreadableFilesAreReportedNotThrown) {
  const std::string clean = record_one("base.h5");

  const std::string text = path("text.h5");
  std::ofstream(text) << "not an HDF5 file\n";
  const std::string plain = path("plain.h5");
  {
    const hid_t f = H5Fcreate(plain.c_str(), H5F_ACC_TRUNC, H5P_DEFAULT, H5P_DEFAULT);
    H5Gclose(H5Gcreate2(f, "steps", H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT));
    H5Fclose(f);
  }
  const std::string truncated = path("truncated.h5");
  fs::copy_file(clean, truncated);
  fs::resize_file(truncated, fs::file_size(truncated) / 2);
  const std::string newer = path("newer.h5");
  fs::copy_file(clean, newer);
  set_root_int_attr(newer, "format_version", 999);
  const std::string empty = path("empty.h5");
  std::ofstream(empty).flush();

  struct Case {
    std::string file, needle;
  };
  for (const Case& c : {Case{text, ""}, Case{plain, "not a dsv4 trace"}, Case{truncated, ""},
                        Case{newer, "999"}, Case{empty, ""}, Case{path("missing.h5"), ""}}) {
    ValidateReport r;
    ASSERT_NO_THROW(r = validate_trace(c.file)) << c.file;
    EXPECT_FALSE(r.readable) << c.file << all_problems(r);
    EXPECT_FALSE(r.ok());
    // A truncated sealed file: the seal says so first, then HDF5's refusal.
    const bool cut = c.file == truncated;
    ASSERT_EQ(r.problems.size(), cut ? 2u : 1u) << c.file << all_problems(r);
    if (cut) {
      EXPECT_EQ(r.problems[0].where, "seal");
      EXPECT_NE(r.problems[0].what.find("cut short"), std::string::npos) << r.problems[0].what;
    }
    EXPECT_EQ(r.problems.back().where, "file");
    EXPECT_FALSE(r.problems.back().what.empty());
    EXPECT_NE(r.problems.back().what.find(c.needle), std::string::npos) << r.problems.back().what;
    EXPECT_THROW(salvage_trace(c.file, path("never.h5")), TraceError) << c.file;
    EXPECT_FALSE(fs::exists(path("never.h5")));
  }
  EXPECT_NE(validate_trace(newer).problems[0].what.find("upgrade"), std::string::npos);
  EXPECT_THROW(salvage_trace(plain, path("never.h5")), NotATrace);
  EXPECT_THROW(salvage_trace(newer, path("never.h5")), UnsupportedTraceVersion);
}

}  // namespace
}  // namespace dsv4
