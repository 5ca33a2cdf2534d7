// The dsv4 command end to end: help, model init/info, forward output, and bad input through the
// binary (clear message, non-zero exit, no crash).
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>

#include "cli_util.h"

namespace {

namespace fs = std::filesystem;

using Result = dsv4::test::CliResult;
Result dsv4(const std::string& args) {
  return dsv4::test::run_cli(args);
}

class Cli : public ::testing::Test {
 protected:
  // Per process: ctest runs the tests of this suite as parallel processes.
  static std::string root() { return ::testing::TempDir() + "dsv4_cli_" + std::to_string(getpid()); }
  static std::string tmp(const std::string& name) { return root() + "/" + name; }
  static void TearDownTestSuite() { fs::remove_all(root()); }
  static void SetUpTestSuite() {
    fs::create_directories(root());
    const Result r = dsv4("model init --preset tiny --seed 7 --out " + model_dir());
    ASSERT_EQ(r.code, 0) << r.out;
  }
  static std::string model_dir() { return tmp("model"); }
  // A copy of the checkpoint in which `edit` changes one file.
  static std::string broken_copy(const std::string& name) {
    const std::string d = tmp(name);
    fs::remove_all(d);
    fs::create_directories(d);
    fs::copy(model_dir(), d, fs::copy_options::recursive | fs::copy_options::overwrite_existing);
    return d;
  }
};

TEST_F(Cli, HelpAndVersion) {
  for (const char* args : {"--help", "model --help", "model init --help", "model info --help",
                           "forward --help", "demo --help"}) {
    const Result r = dsv4(args);
    EXPECT_EQ(r.code, 0) << args << "\n" << r.out;
    EXPECT_NE(r.out.find("Usage"), std::string::npos) << args;
  }
  EXPECT_EQ(dsv4("--version").code, 0);
  const Result none = dsv4("");
  EXPECT_NE(none.code, 0);
  EXPECT_EQ(dsv4("no-such-command").code, 2);
}

TEST_F(Cli, ModelInfo) {
  Result r = dsv4("model info --preset flash");
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("C4 21"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("trace bytes per token"), std::string::npos);
  r = dsv4("model info --model " + model_dir() + " --json");
  ASSERT_EQ(r.code, 0) << r.out;
  const auto j = nlohmann::json::parse(r.out);
  EXPECT_GT(j["params_total"].get<int64_t>(), 0);
  EXPECT_EQ(j["layers"]["c4"], 2);
}

TEST_F(Cli, ForwardBothModelForms) {
  const std::string out1 = tmp("fwd1.json"), out2 = tmp("fwd2.json");
  Result r = dsv4("forward --model " + model_dir() +
                  " --tokens 1,2,3,4,5,6,7,8,9,10,11,12 --profile train --out " + out1);
  ASSERT_EQ(r.code, 0) << r.out;
  r = dsv4(
      "forward --preset tiny --seed 7 --tokens 1,2,3,4,5,6,7,8,9,10,11,12 --profile train --threads 1 "
      "--out " +
      out2);
  ASSERT_EQ(r.code, 0) << r.out;
  std::ifstream f1(out1), f2(out2);
  const auto j1 = nlohmann::json::parse(f1), j2 = nlohmann::json::parse(f2);
  EXPECT_EQ(j1["tokens"].size(), 12u);
  EXPECT_EQ(j1["logprobs"].size(), 11u);
  EXPECT_EQ(j1["logprobs"], j2["logprobs"]);  // checkpoint on disk == the same preset and seed in memory
  EXPECT_EQ(j1["indexer_topk"].size(), 2u);
  EXPECT_EQ(j1["experts"].size(), 6u);
  EXPECT_EQ(j1["experts"][0]["ids"][0].size(), 2u);
}

TEST_F(Cli, BadInputFailsClearly) {
  struct Case {
    std::string args, expect;
  };
  const std::string m = model_dir();
  std::vector<Case> cases = {
      {"forward --model " + m + " --tokens 1,2,x --profile train", "('x') is not a token id"},
      {"forward --model " + m + " --tokens 1,2,600 --profile train", "outside the vocabulary"},
      {"forward --model " + m + " --tokens @/no/such/file --profile train", "/no/such/file"},
      {"forward --model /no/such/dir --tokens 1,2", "/no/such/dir"},
      {"forward --preset huge --tokens 1,2", "unknown preset"},
      {"forward --model " + m + " --tokens 1,2 --profile fast", "profile"},
  };
  {
    const std::string d = broken_copy("badjson");
    std::ofstream(d + "/config.json") << "{\"hidden_size\": 256,,}";
    cases.push_back({"forward --model " + d + " --tokens 1,2", "config.json"});
  }
  {
    const std::string d = broken_copy("badcfg");
    std::ifstream in(m + "/config.json");
    auto j = nlohmann::json::parse(in);
    j["o_groups"] = 4;
    std::ofstream(d + "/config.json") << j.dump();
    cases.push_back({"forward --model " + d + " --tokens 1,2", "o_groups"});
  }
  {
    const std::string d = broken_copy("trunc");
    fs::resize_file(d + "/model.safetensors", fs::file_size(d + "/model.safetensors") / 2);
    cases.push_back({"forward --model " + d + " --tokens 1,2", "model.safetensors"});
  }
  {
    const std::string d = broken_copy("cfgmismatch");
    std::ifstream in(m + "/config.json");
    auto j = nlohmann::json::parse(in);
    j["moe_intermediate_size"] = 96;
    std::ofstream(d + "/config.json") << j.dump();
    cases.push_back({"forward --model " + d + " --tokens 1,2", "gate_proj.weight"});
  }
  for (const auto& c : cases) {
    const Result r = dsv4(c.args);
    EXPECT_EQ(r.code, 2) << c.args << "\n" << r.out;
    EXPECT_NE(r.out.find(c.expect), std::string::npos) << c.args << "\n" << r.out;
    EXPECT_EQ(r.out.find("terminate called"), std::string::npos) << r.out;
  }
}

TEST_F(Cli, Demo) {
  const Result r = dsv4("demo --length 24 --dir " + tmp("demo"));
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("decisions differ between the profiles"), std::string::npos) << r.out;
}

}  // namespace
