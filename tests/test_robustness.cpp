// No input makes a command hang, crash or report success it did not earn: replay and validate on
// traces with a damaged middle step or an incomplete last step, salvage of a partly damaged trace,
// capture policies that select nothing, bounded config fields and CLI values, and mutated copies of a
// sample trace (flipped bytes at fixed seeds, zeroed ranges, truncations) under a time limit.
#include <gtest/gtest.h>
#include <hdf5.h>

#include <algorithm>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "capture/errors.h"
#include "capture/salvage.h"
#include "capture/validate.h"
#include "cli_util.h"
#include "h5_edit.h"
#include "paths.h"

namespace {

namespace fs = std::filesystem;
using dsv4::test::CliResult;
using dsv4::test::run_cli;
using dsv4::test::run_shell;

class Robustness : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = ::testing::TempDir() + "dsv4_robust_" + std::to_string(getpid()) + "_" +
           ::testing::UnitTest::GetInstance()->current_test_info()->name();
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }
  std::string p(const std::string& name) const { return dir_ + "/" + name; }

  // A trace of `n` prefill steps of the tiny preset (16 random tokens each, seeds 1..n).
  std::string three_steps(const std::string& name, int n = 3) const {
    const std::string t = p(name);
    for (int i = 0; i < n; ++i) {
      const CliResult r = run_cli(fmt("record --preset tiny --seed 7 --random 16 --token-seed ", i + 1,
                                      " --profile train --threads 1 --out ", t, i ? " --append" : ""));
      EXPECT_EQ(r.code, 0) << r.out;
    }
    return t;
  }
  template <typename... A>
  static std::string fmt(const A&... a) {
    std::ostringstream o;
    (o << ... << a);
    return o.str();
  }
  std::string dir_;
};

bool has(const std::string& s, const std::string& needle) {
  return s.find(needle) != std::string::npos;
}

// ---- replay tells the whole truth ---------------------------------------------------------------

TEST_F(Robustness, ReplayNamesADamagedMiddleStep) {
  struct Damage {
    const char* name;
    void (*apply)(dsv4::test::H5Edit&);
  };
  const std::vector<Damage> damages{
      {"status 2", [](dsv4::test::H5Edit& e) { e.write<uint8_t>("/steps/000001/status", H5T_NATIVE_UINT8, {2}); }},
      {"status of two values",
       [](dsv4::test::H5Edit& e) {
         e.replace<uint8_t>("/steps/000001/status", H5T_STD_U8LE, H5T_NATIVE_UINT8, {1, 1});
       }},
      {"step group replaced by a dataset",
       [](dsv4::test::H5Edit& e) { e.replace<uint8_t>("/steps/000001", H5T_STD_U8LE, H5T_NATIVE_UINT8, {1}); }},
      {"digests cut short",
       [](dsv4::test::H5Edit& e) {
         e.replace<uint64_t>("/steps/000001/seq_000/digests/value", H5T_STD_U64LE, H5T_NATIVE_UINT64, {1, 2, 3});
       }},
  };
  const std::string base = three_steps("base.h5");
  for (const Damage& d : damages) {
    const std::string t = p(std::string("damaged_") + std::to_string(&d - damages.data()) + ".h5");
    fs::copy_file(base, t);
    {
      dsv4::test::H5Edit e(t);
      d.apply(e);
    }
    fs::remove(p("r.json"));
    CliResult r = run_cli("replay --threads 1 " + t + " --json " + p("r.json"));
    EXPECT_EQ(r.code, 2) << d.name << "\n" << r.out;
    EXPECT_TRUE(has(r.out, "step 0: bit-identical")) << d.name << "\n" << r.out;
    EXPECT_TRUE(has(r.out, "step 2: bit-identical")) << d.name << "\n" << r.out;
    EXPECT_TRUE(has(r.out, "step 1: NOT VERIFIED")) << d.name << "\n" << r.out;
    EXPECT_TRUE(has(r.out, "1 of 3 steps not verified")) << d.name << "\n" << r.out;
    // The JSON report says the same.
    std::ifstream jf(p("r.json"));
    const std::string json((std::istreambuf_iterator<char>(jf)), std::istreambuf_iterator<char>());
    EXPECT_TRUE(has(json, "\"verified_all\": false")) << json;
    // A subset the user asked for is answered for itself.
    EXPECT_EQ(run_cli("replay --threads 1 --step 2 " + t).code, 0) << d.name;
    r = run_cli("replay --threads 1 --step 1 " + t);
    EXPECT_EQ(r.code, 2) << d.name << "\n" << r.out;
    // Validate rejects what replay cannot verify, and salvage keeps the two intact steps.
    EXPECT_EQ(run_cli("trace validate " + t).code, 1) << d.name;
    const std::string out = p("salvaged.h5");
    fs::remove(out);
    r = run_cli("trace salvage " + t + " --out " + out);
    ASSERT_EQ(r.code, 0) << d.name << "\n" << r.out;
    EXPECT_TRUE(has(r.out, "step 1: skipped")) << r.out;
    EXPECT_TRUE(has(r.out, "salvaged 2 intact steps (of 3)")) << r.out;
    r = run_cli("trace validate " + out);
    EXPECT_EQ(r.code, 0) << d.name << "\n" << r.out;
    r = run_cli("replay --threads 1 " + out);
    EXPECT_EQ(r.code, 0) << d.name << "\n" << r.out;
    EXPECT_TRUE(has(r.out, "step 1: bit-identical")) << r.out;  // the old step 2
  }
  EXPECT_EQ(run_cli("replay --threads 1 " + base).code, 0);
}

TEST_F(Robustness, ReplayNamesAnIncompleteLastStep) {
  const std::string t = three_steps("killed.h5", 2);
  // A recorder killed in the middle of a third step (appending in place).
  const CliResult k = run_shell("DSV4_FAULT=kill-mid-step " + std::string(DSV4_CLI_PATH) +
                                " record --preset tiny --seed 7 --random 16 --token-seed 9 --profile train --threads 1 "
                                "--append --out " +
                                t);
  ASSERT_NE(k.code, 0) << k.out;
  CliResult r = run_cli("replay --threads 1 " + t);
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_TRUE(has(r.out, "step 0: bit-identical")) << r.out;
  EXPECT_TRUE(has(r.out, "step 1: bit-identical")) << r.out;
  EXPECT_TRUE(has(r.out, "step 2: NOT VERIFIED: incomplete (status 0)")) << r.out;
  EXPECT_EQ(run_cli("replay --threads 1 --step 1 " + t).code, 0);
  const std::string out = p("salvaged.h5");
  r = run_cli("trace salvage " + t + " --out " + out);
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_TRUE(has(r.out, "salvaged 2 intact steps (of 3)")) << r.out;
  EXPECT_EQ(run_cli("replay --threads 1 " + out).code, 0);
}

// ---- validate checks what the readers rely on ----------------------------------------------------

TEST_F(Robustness, ValidateRejectsWhatReadersReject) {
  const std::string base = three_steps("base.h5", 1);
  struct Case {
    const char* name;
    void (*apply)(dsv4::test::H5Edit&);
    const char* needle;
  };
  const std::vector<Case> cases{
      {"negative router margin",
       [](dsv4::test::H5Edit& e) {
         const std::string ds = "/steps/000000/seq_000/decisions/layer_003/router_margin";
         auto v = e.read<float>(ds, H5T_NATIVE_FLOAT);
         v[5] = -0.25f;
         e.write(ds, H5T_NATIVE_FLOAT, v);
       },
       "negative"},
      {"kernel records of different lengths",
       [](dsv4::test::H5Edit& e) {
         e.replace<int64_t>("/steps/000000/kernels/stream", H5T_STD_I64LE, H5T_NATIVE_INT64, {1, 2, 3});
       },
       "kernels"},
      {"a step's sequence length negative",
       [](dsv4::test::H5Edit& e) {
         e.write<int64_t>("/steps/000000/seq_lengths", H5T_NATIVE_INT64, {-16});
       },
       "length"},
  };
  for (const Case& c : cases) {
    const std::string t = p("case.h5");
    fs::remove(t);
    fs::copy_file(base, t);
    {
      dsv4::test::H5Edit e(t);
      c.apply(e);
    }
    const dsv4::ValidateReport rep = dsv4::validate_trace(t);
    std::string all;
    for (const auto& pr : rep.problems) all += pr.where + ": " + pr.what + "\n";
    EXPECT_FALSE(rep.ok()) << c.name;
    EXPECT_TRUE(has(all, c.needle)) << c.name << "\n" << all;
    // What validate rejects, salvage does not copy.
    EXPECT_THROW(dsv4::salvage_trace(t, p("never.h5")), dsv4::TraceError) << c.name;
    EXPECT_FALSE(fs::exists(p("never.h5")));
  }
}

TEST_F(Robustness, CapturePolicyThatSelectsNothingIsRefused) {
  CliResult r = run_cli("record --preset tiny --seed 7 --random 8 --capture 'attn.*@99' --out " + p("x.h5"));
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_TRUE(has(r.out, "attn.*@99")) << r.out;
  EXPECT_TRUE(has(r.out, "selects no tensor")) << r.out;
  EXPECT_FALSE(fs::exists(p("x.h5")));
  EXPECT_FALSE(fs::exists(p("x.h5.incomplete")));
  // A range that reaches some layers is fine.
  r = run_cli("record --preset tiny --seed 7 --random 8 --capture 'attn.q@5-99' --out " + p("y.h5"));
  EXPECT_EQ(r.code, 0) << r.out;
}

// ---- every input bounded ------------------------------------------------------------------------

TEST_F(Robustness, ConfigFieldsHaveUpperBounds) {
  const std::string dir = p("m");
  ASSERT_EQ(run_cli("model init --preset tiny --seed 1 --out " + dir).code, 0);
  std::ifstream f(dir + "/config.json");
  const std::string cfg((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  struct Case {
    const char* field;
    const char* value;
  };
  for (const Case& c : {Case{"hc_sinkhorn_iters", "2147483647"}, Case{"n_routed_experts", "70000"},
                        Case{"vocab_size", "2000000000"}, Case{"num_hidden_layers", "5000"}}) {
    const size_t at = cfg.find(std::string("\"") + c.field + "\"");
    ASSERT_NE(at, std::string::npos) << c.field;
    const size_t colon = cfg.find(':', at), end = cfg.find_first_of(",}", colon);
    const std::string edited = cfg.substr(0, colon + 1) + " " + c.value + cfg.substr(end);
    const std::string cf = p(std::string(c.field) + ".json");
    std::ofstream(cf) << edited;
    const CliResult r = run_shell("timeout 20 " + std::string(DSV4_CLI_PATH) + " model init --config " + cf +
                                  " --seed 1 --out " + p(std::string("o_") + c.field));
    EXPECT_EQ(r.code, 2) << c.field << "\n" << r.out;
    EXPECT_TRUE(has(r.out, c.field)) << r.out;
    EXPECT_TRUE(has(r.out, c.value) || has(r.out, "limit")) << r.out;
  }
  // A number JSON cannot hold (found by fuzz_config): bad input naming the file, not an internal error.
  const std::string big = p("big.json");
  std::ofstream(big) << "{\"vocab_size\": 10e48575}";
  const CliResult r = run_cli("model init --config " + big + " --seed 1 --out " + p("o_big"));
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_TRUE(has(r.out, big)) << r.out;
}

TEST_F(Robustness, NumericOptionsAreChecked) {
  const std::string t = three_steps("t.h5", 1);
  struct Case {
    std::string args, needle;
  };
  const std::vector<Case> cases{
      {"forward --preset tiny --random 8 --threads 10000", "--threads"},
      {"forward --preset tiny --random 8 --threads -1", "--threads"},
      {"forward --preset tiny --seed -1 --random 8", "--seed"},
      {"forward --preset tiny --random 2147483648", "--random"},
      {"forward --preset tiny --random -5", "--random"},
      {"forward --preset tiny --tokens @/dev/zero", "/dev/zero"},
      {"model init --preset tiny --out " + p("m") + " --shard-mb -1", "--shard-mb"},
      {"replay " + t + " --step -1", "--step"},
      {"replay " + t + " --threads 100000", "--threads"},
      {"diff " + t + " " + t + " --tie-threshold -1", "--tie-threshold"},
      {"diff " + t + " " + t + " --tie-threshold nan", "--tie-threshold"},
      {"trace dump " + t + " --step -3 --what digests", "--step"},
  };
  for (const Case& c : cases) {
    const CliResult r = run_shell("timeout 30 " + std::string(DSV4_CLI_PATH) + " " + c.args);
    EXPECT_EQ(r.code, 2) << c.args << "\n" << r.out;
    EXPECT_TRUE(has(r.out, c.needle)) << c.args << "\n" << r.out;
  }
}

// ---- bounded time and no crash on any file --------------------------------------------------------

struct Mutant {
  std::string name;
  std::vector<char> data;
};

std::vector<char> slurp(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::vector<char>((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

// Mutated copies of a trace's bytes, at fixed seeds so that a failure reproduces: bytes flipped inside
// the first HDF5 structure of each kind (object headers, heaps, B-trees, chunk indexes: where the
// library's trust in metadata is tested), in the superblock and first objects, anywhere; zeroed
// ranges; truncations.
std::vector<Mutant> mutants_of(const std::vector<char>& bytes) {
  std::vector<Mutant> mutants;
  uint32_t seed = 1;
  for (const char* sig : {"OHDR", "GCOL", "FRHP", "FHDB", "BTHD", "BTLF", "EAHD", "FAHD"}) {
    const auto at = std::search(bytes.begin(), bytes.end(), sig, sig + 4);
    if (at == bytes.end()) continue;
    const size_t base = size_t(at - bytes.begin());
    for (int rep = 0; rep < 2; ++rep) {
      std::mt19937 rng(seed++);
      std::vector<char> d = bytes;
      for (int k = 0; k < 3; ++k) d[std::min(d.size() - 1, base + 4 + rng() % 60)] ^= char(1 + rng() % 255);
      mutants.push_back({std::string(sig) + "_" + std::to_string(rep), d});
    }
  }
  for (uint32_t s = 1; s <= 3; ++s) {  // a few flipped bytes in the superblock and first objects
    std::mt19937 rng(100 + s);
    std::vector<char> d = bytes;
    for (int k = 0; k < 4; ++k) d[rng() % 4096] ^= char(1 + rng() % 255);
    mutants.push_back({"head_flip_" + std::to_string(s), d});
  }
  for (uint32_t s = 1; s <= 3; ++s) {  // anywhere in the file
    std::mt19937 rng(200 + s);
    std::vector<char> d = bytes;
    for (int k = 0; k < 8; ++k) d[rng() % d.size()] ^= char(1 + rng() % 255);
    mutants.push_back({"flip_" + std::to_string(s), d});
  }
  for (uint32_t s = 1; s <= 2; ++s) {  // a zeroed range
    std::mt19937 rng(300 + s);
    std::vector<char> d = bytes;
    const size_t at = rng() % d.size(), n = std::min<size_t>(d.size() - at, 64 + rng() % 2048);
    std::fill(d.begin() + long(at), d.begin() + long(at + n), 0);
    mutants.push_back({"zero_" + std::to_string(s), d});
  }
  for (size_t keep : {size_t(100), bytes.size() / 3}) {  // truncations
    mutants.push_back({"cut_" + std::to_string(keep), std::vector<char>(bytes.begin(), bytes.begin() + long(keep))});
  }
  return mutants;
}

// Mutated copies of the sample trace (written before traces were sealed, so every layer behind the
// seal is exercised): every command ends within the time limit, with exit 0, 1 or 2, and says
// something when it fails.
TEST_F(Robustness, MutatedTracesNeverHangOrCrash) {
  const std::vector<char> bytes = slurp(std::string(DSV4_SOURCE_DIR) + "/traces/samples/tiny-train.h5");
  ASSERT_GT(bytes.size(), 8192u);
  const std::vector<Mutant> mutants = mutants_of(bytes);
  int failures_seen = 0;
  for (const Mutant& m : mutants) {
    const std::string t = p(m.name + ".h5");
    std::ofstream(t, std::ios::binary).write(m.data.data(), std::streamsize(m.data.size()));
    for (const std::string cmd : {"trace validate", "trace info", "replay --threads 1"}) {
      const CliResult r = run_shell("timeout -s KILL 30 " + std::string(DSV4_CLI_PATH) + " " + cmd + " " + t);
      EXPECT_TRUE(r.code == 0 || r.code == 1 || r.code == 2)
          << m.name << ": dsv4 " << cmd << " ended with " << r.code
          << (r.code == 137 ? " (killed after 30 s)" : "") << "\n" << r.out;
      if (r.code != 0) {
        ++failures_seen;
        // An error line, validate's problems, or replay's report of what differs.
        EXPECT_TRUE(has(r.out, "error") || has(r.out, "problem") || has(r.out, "DIFFER") || has(r.out, "DIVERGES") ||
                    has(r.out, "NOT VERIFIED"))
            << m.name << ": dsv4 " << cmd << "\n" << r.out;
      }
    }
  }
  EXPECT_GT(failures_seen, 0);  // the mutations are real
}

// The same mutations of a sealed trace: every command refuses each copy at once, naming the damage,
// before HDF5 reads the file (validate reports it as a problem of the seal).
TEST_F(Robustness, MutatedSealedTracesAreRefusedAtOnce) {
  const std::string t = p("sealed.h5");
  const CliResult rec = run_cli("record --preset tiny --seed 7 --random 96 --token-seed 3 --profile train "
                                "--capture 'attn.kv@1,moe.out@3' --threads 1 --out " + t);
  ASSERT_EQ(rec.code, 0) << rec.out;
  const std::vector<char> bytes = slurp(t);
  for (const Mutant& m : mutants_of(bytes)) {
    const std::string f = p(m.name + ".h5");
    std::ofstream(f, std::ios::binary).write(m.data.data(), std::streamsize(m.data.size()));
    const bool short_file = m.data.size() < 520;  // no room for a seal and a superblock: not HDF5
    for (const std::string cmd : {"trace info", "replay --threads 1"}) {
      const CliResult r = run_shell("timeout -s KILL 30 " + std::string(DSV4_CLI_PATH) + " " + cmd + " " + f);
      EXPECT_EQ(r.code, 2) << m.name << ": dsv4 " << cmd << "\n" << r.out;
      EXPECT_TRUE(has(r.out, short_file ? "not an HDF5 file" : ": damaged: ")) << m.name << ": " << cmd << "\n"
                                                                             << r.out;
    }
    const CliResult v = run_shell("timeout -s KILL 30 " + std::string(DSV4_CLI_PATH) + " trace validate " + f);
    EXPECT_TRUE(v.code == 1 || v.code == 2) << m.name << "\n" << v.out;
    if (!short_file) {
      EXPECT_TRUE(has(v.out, "problem: seal: damaged") || has(v.out, "error:")) << m.name << "\n" << v.out;
    }
  }
}

}  // namespace
