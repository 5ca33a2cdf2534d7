// Traces through the dsv4 binary: record, append, info, validate, dump, salvage; crash safety with a
// recorder killed by SIGKILL between steps and mid-step; bad files.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "capture/trace_reader.h"
#include "cli_util.h"
#include "trace_test_util.h"

namespace {

namespace fs = std::filesystem;
using dsv4::test::run_cli;

class TraceCli : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = ::testing::TempDir() + "dsv4_trace_cli_" + std::to_string(getpid()) + "_" +
           ::testing::UnitTest::GetInstance()->current_test_info()->name();
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }
  std::string p(const std::string& name) const { return dir_ + "/" + name; }
  std::string dir_;
};

TEST_F(TraceCli, RecordAppendInfoValidateDump) {
  const std::string t = p("a.h5");
  auto r = run_cli("record --preset tiny --seed 7 --random 40 --profile train --out " + t);
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_TRUE(fs::exists(t));
  EXPECT_FALSE(fs::exists(t + ".incomplete"));
  { std::ofstream(p("batch.jsonl")) << "[1,2,3,4,5,6,7,8,9]\n\n{\"tokens\": [9,8,7]}\n"; }
  r = run_cli("record --preset tiny --seed 7 --batch " + p("batch.jsonl") +
              " --profile rollout --capture "
              "'attn.*@1-2,logits' --append --out " +
              t);
  ASSERT_EQ(r.code, 0) << r.out;
  // A different model cannot be appended.
  r = run_cli("record --preset tiny --seed 8 --random 10 --append --out " + t);
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_NE(r.out.find("digest"), std::string::npos) << r.out;
  // Existing files are not overwritten.
  r = run_cli("record --preset tiny --seed 7 --random 10 --out " + t);
  EXPECT_EQ(r.code, 2) << r.out;

  r = run_cli("trace info --json " + t);
  ASSERT_EQ(r.code, 0) << r.out;
  const auto j = nlohmann::json::parse(r.out);
  ASSERT_EQ(j["steps"].size(), 2u);
  EXPECT_EQ(j["steps"][1]["profile"], "rollout");
  EXPECT_EQ(j["steps"][1]["seq_lengths"], nlohmann::json::array({9, 3}));
  EXPECT_TRUE(j["steps"][0]["complete"].get<bool>());
  r = run_cli("trace info " + t);
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("environment"), std::string::npos);

  r = run_cli("trace validate " + t);
  EXPECT_EQ(r.code, 0) << r.out;

  r = run_cli("trace dump " + t + " --step 0 --layer 1 --what indexer");
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("token     39"), std::string::npos) << r.out;
  r = run_cli("trace dump " + t + " --step 0 --layer 3 --what experts --json");
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_EQ(nlohmann::json::parse(r.out)["rows"].size(), 40u);
  r = run_cli("trace dump " + t + " --step 0 --what digests");
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("moe.out"), std::string::npos);
  r = run_cli("trace dump " + t + " --step 0 --layer 0 --what mhc");
  ASSERT_EQ(r.code, 0) << r.out;
  r = run_cli("trace dump " + t + " --step 1 --seq 1 --layer 2 --what tensor --tensor attn.q");
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("attn.q layer 2 bf16 [3, 1536]"), std::string::npos) << r.out.substr(0, 300);
  r = run_cli("trace dump " + t + " --step 1 --layer 4 --what tensor --tensor attn.q");
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_NE(r.out.find("not stored"), std::string::npos) << r.out;
  r = run_cli("trace dump " + t + " --step 5 --what digests");
  EXPECT_EQ(r.code, 2) << r.out;
}

// GPU kernel records as a CUDA recording stores them (written here through the library with made-up
// launches, so no GPU is needed): they read back field for field, `trace dump --what kernels` lists
// them and sums the time per kernel name, and `trace info` counts them per step.
TEST_F(TraceCli, KernelRecordsDumpAndInfo) {
  using namespace dsv4;
  const std::string t = p("k.h5");
  const Weights w = Weights::init(preset("tiny"), 7);
  const std::string gemm = "void dsv4::cuda::detail::gemm_lanes_kernel<true>(GemmShape, long)";
  const KernelRecords rec = test::kernel_records({{gemm, {64, 2, 1}, 51200, 237, 1000, 3000},
                                                  {"indexer_chain_kernel", {8, 2, 1}, 0, 32, 5000, 500},
                                                  {gemm, {32, 2, 1}, 51200, 237, 6000, 1500}});
  test::write_trace_with_kernels(t, w, random_tokens(9, 512, 3), {rec, std::nullopt});
  const KernelRecords back = TraceReader::open(t).kernels(0);
  ASSERT_TRUE(back.available);
  ASSERT_EQ(back.kernels.size(), rec.kernels.size());
  for (size_t i = 0; i < rec.kernels.size(); ++i) {
    const KernelRecord &a = rec.kernels[i], &b = back.kernels[i];
    EXPECT_EQ(a.name, b.name);
    EXPECT_EQ(a.grid, b.grid);
    EXPECT_EQ(a.block, b.block);
    EXPECT_EQ(a.shared_bytes, b.shared_bytes);
    EXPECT_EQ(a.registers, b.registers);
    EXPECT_EQ(a.stream, b.stream);
    EXPECT_EQ(a.start_ns, b.start_ns);
    EXPECT_EQ(a.end_ns, b.end_ns);
    EXPECT_EQ(a.correlation, b.correlation);
  }
  EXPECT_FALSE(TraceReader::open(t).kernels(1).available);

  auto r = run_cli("trace dump --what kernels --json " + t);
  ASSERT_EQ(r.code, 0) << r.out;
  auto j = nlohmann::json::parse(r.out);
  ASSERT_EQ(j["kernels"].size(), 3u);
  EXPECT_EQ(j["kernels"][1]["name"], "indexer_chain_kernel");
  EXPECT_EQ(j["kernels"][0]["grid"], nlohmann::json::array({64, 2, 1}));
  EXPECT_EQ(j["total_ns"], 5000);
  ASSERT_EQ(j["by_name"].size(), 2u);  // largest total first
  EXPECT_EQ(j["by_name"][0]["launches"], 2);
  EXPECT_EQ(j["by_name"][0]["ns"], 4500);
  EXPECT_DOUBLE_EQ(j["by_name"][0]["share"].get<double>() + j["by_name"][1]["share"].get<double>(), 100.0);
  r = run_cli("trace dump --what kernels " + t);
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("3 launches, 0.005 ms of kernel time"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("indexer_chain_kernel"), std::string::npos) << r.out;
  r = run_cli("trace dump --what kernels --step 1 " + t);
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("step 1: no kernel records (not recorded)"), std::string::npos) << r.out;
  r = run_cli("trace dump --what kernels --step 2 " + t);
  EXPECT_EQ(r.code, 2) << r.out;

  r = run_cli("trace info --json " + t);
  ASSERT_EQ(r.code, 0) << r.out;
  j = nlohmann::json::parse(r.out);
  EXPECT_EQ(j["steps"][0]["kernels"]["launches"], 3);
  EXPECT_FALSE(j["steps"][1]["kernels"]["available"].get<bool>());
  r = run_cli("trace info " + t);
  EXPECT_NE(r.out.find("GPU kernels 3"), std::string::npos) << r.out;
}

TEST_F(TraceCli, KilledBetweenStepsIsSalvaged) {
  const std::string t = p("k.h5");
  const auto r =
      run_cli("record --preset tiny --seed 7 --random 30 --out " + t, "DSV4_FAULT=kill-after-step");
  EXPECT_EQ(r.code, 128 + 9) << r.out;
  ASSERT_FALSE(fs::exists(t));
  ASSERT_TRUE(fs::exists(t + ".incomplete"));
  auto v = run_cli("trace validate --json " + t + ".incomplete");
  const auto j = nlohmann::json::parse(v.out);
  ASSERT_EQ(j["steps"].size(), 1u) << v.out;
  EXPECT_TRUE(j["steps"][0]["complete"].get<bool>());
  EXPECT_TRUE(j["incomplete_file"].get<bool>());
  auto s = run_cli("trace salvage " + t + ".incomplete --out " + p("saved.h5"));
  ASSERT_EQ(s.code, 0) << s.out;
  EXPECT_NE(s.out.find("salvaged 1 intact step"), std::string::npos) << s.out;
  EXPECT_EQ(run_cli("trace validate " + p("saved.h5")).code, 0);
  EXPECT_EQ(run_cli("replay " + p("saved.h5")).code, 0);
}

TEST_F(TraceCli, KilledMidStepLosesOnlyThatStep) {
  const std::string t = p("m.h5");
  ASSERT_EQ(run_cli("record --preset tiny --seed 7 --random 30 --out " + t).code, 0);
  const auto r =
      run_cli("record --preset tiny --seed 7 --random 50 --append --out " + t, "DSV4_FAULT=kill-mid-step");
  EXPECT_EQ(r.code, 128 + 9) << r.out;
  auto v = run_cli("trace validate --json " + t);
  EXPECT_NE(v.code, 0);
  const auto j = nlohmann::json::parse(v.out);
  ASSERT_EQ(j["steps"].size(), 2u) << v.out;
  EXPECT_TRUE(j["steps"][0]["complete"].get<bool>());
  EXPECT_FALSE(j["steps"][1]["complete"].get<bool>());
  auto s = run_cli("trace salvage " + t + " --out " + p("saved.h5"));
  ASSERT_EQ(s.code, 0) << s.out;
  EXPECT_NE(s.out.find("salvaged 1 intact step"), std::string::npos) << s.out;
  EXPECT_EQ(run_cli("trace validate " + p("saved.h5")).code, 0);
}

TEST_F(TraceCli, BadFilesFailClearly) {
  const std::string good = p("g.h5");
  ASSERT_EQ(run_cli("record --preset tiny --seed 7 --random 20 --out " + good).code, 0);
  std::ofstream(p("text.h5")) << "this is not HDF5\n";
  {
    // Truncated copy.
    fs::copy_file(good, p("trunc.h5"));
    fs::resize_file(p("trunc.h5"), fs::file_size(good) / 2);
  }
  for (const auto& [file, expect] : std::vector<std::pair<std::string, std::string>>{
           {p("text.h5"), "not an HDF5 file"}, {p("trunc.h5"), "trunc.h5"}, {p("none.h5"), "none.h5"}}) {
    for (const std::string cmd : {"trace info ", "trace validate ", "replay ", "trace dump "}) {
      const auto r = run_cli(cmd + file);
      EXPECT_NE(r.code, 0) << cmd << file << "\n" << r.out;
      EXPECT_NE(r.out.find(expect), std::string::npos) << cmd << file << "\n" << r.out;
      EXPECT_EQ(r.out.find("terminate called"), std::string::npos) << r.out;
      EXPECT_EQ(r.out.find("HDF5-DIAG"), std::string::npos) << "HDF5 printed its stack itself:\n" << r.out;
    }
  }
}

}  // namespace
