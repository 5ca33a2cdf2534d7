// The prompts JSONL reader of `dsv4 generate` (rollout/prompts.h): valid files, and every kind of
// bad input with a message naming the file, the line and the field.
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "model/config.h"
#include "model/error.h"
#include "rollout/prompts.h"

namespace dsv4 {
namespace {

namespace fs = std::filesystem;
using rollout::GenerateDefaults;
using rollout::PromptRequest;
using rollout::read_prompts;

class Prompts : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::path(::testing::TempDir()) / ("dsv4_prompts_" + std::to_string(::getpid()));
    fs::create_directories(dir_);
    config_ = preset("tiny");  // vocab_size 512
  }
  void TearDown() override { fs::remove_all(dir_); }

  std::string write(const std::string& text) {
    const std::string path = (dir_ / ("p" + std::to_string(n_++) + ".jsonl")).string();
    std::ofstream(path) << text;
    return path;
  }

  std::vector<PromptRequest> read(const std::string& text) { return read_prompts(write(text), config_, d_); }

  // Reading `text` throws InputError whose message names the file and contains every part.
  void expect_error(const std::string& text, const std::vector<std::string>& parts) {
    const std::string path = write(text);
    try {
      read_prompts(path, config_, d_);
      ADD_FAILURE() << "no InputError for: " << text;
    } catch (const InputError& e) {
      const std::string msg = e.what();
      EXPECT_NE(msg.find(path), std::string::npos) << msg;
      for (const auto& s : parts)
        EXPECT_NE(msg.find(s), std::string::npos) << "'" << s << "' not in: " << msg;
    }
  }

  fs::path dir_;
  int n_ = 0;
  ModelConfig config_;
  GenerateDefaults d_;
};

TEST_F(Prompts, DefaultsAppliedAndOverriddenPerLine) {
  d_.max_new_tokens = 16;
  d_.sampling.temperature = 0.6f;
  d_.sampling.top_k = 40;
  d_.sampling.seed = 99;
  d_.stop_ids = {2, 3};
  const auto q = read(
      "{\"prompt\": [1, 2, 3]}\n"
      "\n"
      "   \n"
      "{\"id\": \"q-b\", \"prompt\": [511], \"max_new_tokens\": 5, \"temperature\": 0, \"top_p\": 0.5,"
      " \"top_k\": 0, \"seed\": 18446744073709551615, \"stop\": []}\n"
      "{\"id\": 17, \"prompt\": [0], \"temperature\": 1.25, \"stop\": [7]}\r\n"
      "{\"prompt\": [4, 5]}");
  ASSERT_EQ(q.size(), 4u);

  EXPECT_EQ(q[0].id, "0");
  EXPECT_EQ(q[0].line, 1);
  EXPECT_EQ(q[0].prompt, (std::vector<int32_t>{1, 2, 3}));
  EXPECT_EQ(q[0].max_new_tokens, 16);
  EXPECT_EQ(q[0].sampling.temperature, 0.6f);
  EXPECT_EQ(q[0].sampling.top_k, 40);
  EXPECT_EQ(q[0].sampling.top_p, 1.0f);
  EXPECT_EQ(q[0].sampling.seed, 99u);
  EXPECT_EQ(q[0].stop_ids, (std::vector<int32_t>{2, 3}));

  EXPECT_EQ(q[1].id, "q-b");
  EXPECT_EQ(q[1].line, 4);
  EXPECT_EQ(q[1].prompt, (std::vector<int32_t>{511}));
  EXPECT_EQ(q[1].max_new_tokens, 5);
  EXPECT_EQ(q[1].sampling.temperature, 0.0f);
  EXPECT_EQ(q[1].sampling.top_p, 0.5f);
  EXPECT_EQ(q[1].sampling.top_k, 0);
  EXPECT_EQ(q[1].sampling.seed, 18446744073709551615ull);
  EXPECT_TRUE(q[1].stop_ids.empty());

  EXPECT_EQ(q[2].id, "17");
  EXPECT_EQ(q[2].line, 5);
  EXPECT_EQ(q[2].sampling.temperature, 1.25f);
  EXPECT_EQ(q[2].sampling.top_k, 40);
  EXPECT_EQ(q[2].stop_ids, (std::vector<int32_t>{7}));

  // The default id is the request's index (blank lines do not count), not its line.
  EXPECT_EQ(q[3].id, "3");
  EXPECT_EQ(q[3].line, 6);
}

TEST_F(Prompts, PromptLengthUpToTheLimitIsAccepted) {
  config_.max_position_embeddings = 8;
  const auto q = read("{\"prompt\": [1, 2, 3], \"max_new_tokens\": 5}\n");
  ASSERT_EQ(q.size(), 1u);
  EXPECT_EQ(q[0].max_new_tokens, 5);
}

TEST_F(Prompts, NotJsonOrNotAnObject) {
  expect_error("{\"prompt\": [1]}\n{\"prompt\": [1,}\n", {"line 2", "not valid JSON"});
  expect_error("[1, 2, 3]\n", {"line 1", "JSON object", "array"});
  expect_error("\n\n\"text\"\n", {"line 3", "JSON object"});
}

TEST_F(Prompts, MissingOrEmptyPrompt) {
  expect_error("{\"id\": \"a\"}\n", {"line 1", "'prompt'", "missing"});
  expect_error("{\"prompt\": [1]}\n{\"prompt\": []}\n", {"line 2", "'prompt'", "empty"});
  expect_error("{\"prompt\": \"1 2 3\"}\n", {"line 1", "'prompt'", "array", "string"});
  expect_error("{\"prompt\": null}\n", {"line 1", "'prompt'", "null"});
}

TEST_F(Prompts, BadTokenIdsNameTheIndex) {
  expect_error("{\"prompt\": [1, 2.5, 3]}\n", {"line 1", "'prompt', index 1", "integer"});
  expect_error("{\"prompt\": [1, 2, \"3\"]}\n", {"line 1", "'prompt', index 2", "string"});
  expect_error("{\"prompt\": [true]}\n", {"'prompt', index 0", "boolean"});
  expect_error("{\"prompt\": [0, 512]}\n", {"line 1", "'prompt', index 1", "512", "vocabulary [0, 512)"});
  expect_error("{\"prompt\": [-1]}\n", {"'prompt', index 0", "-1", "vocabulary"});
  expect_error("{\"prompt\": [18446744073709551615]}\n", {"'prompt', index 0", "vocabulary"});
  expect_error("{\"prompt\": [1], \"stop\": [1, 600]}\n", {"line 1", "'stop', index 1", "600"});
  expect_error("{\"prompt\": [1], \"stop\": 2}\n", {"line 1", "'stop'", "array"});
}

TEST_F(Prompts, WrongTypesAndRanges) {
  expect_error("{\"prompt\": [1], \"max_new_tokens\": 0}\n", {"line 1", "'max_new_tokens'", "[1,"});
  expect_error("{\"prompt\": [1], \"max_new_tokens\": -3}\n", {"'max_new_tokens'", "-3"});
  expect_error("{\"prompt\": [1], \"max_new_tokens\": 2.0}\n", {"'max_new_tokens'", "integer"});
  expect_error("{\"prompt\": [1], \"max_new_tokens\": 99999999999}\n", {"'max_new_tokens'", "99999999999"});
  expect_error("{\"prompt\": [1], \"temperature\": \"hot\"}\n", {"line 1", "'temperature'", "number"});
  expect_error("{\"prompt\": [1], \"temperature\": 1e300}\n", {"'temperature'", "fp32"});
  expect_error("{\"prompt\": [1], \"top_k\": 1.5}\n", {"'top_k'", "integer"});
  expect_error("{\"prompt\": [1], \"seed\": -1}\n", {"line 1", "'seed'", "-1"});
  expect_error("{\"prompt\": [1], \"seed\": \"7\"}\n", {"'seed'", "string"});
  expect_error("{\"prompt\": [1], \"id\": [1]}\n", {"line 1", "'id'", "string or an integer"});
  expect_error("{\"prompt\": [1], \"id\": \"\"}\n", {"'id'", "empty"});
  expect_error("{\"prompt\": [1], \"temprature\": 0.5}\n", {"line 1", "unknown field 'temprature'"});
}

TEST_F(Prompts, BadSamplingValuesNameTheLineAndField) {
  expect_error("{\"prompt\": [1]}\n{\"prompt\": [1], \"temperature\": -1}\n", {"line 2", "temperature"});
  expect_error("{\"prompt\": [1], \"top_p\": 0}\n", {"line 1", "top_p"});
  expect_error("{\"prompt\": [1], \"top_p\": 1.01}\n", {"line 1", "top_p"});
  expect_error("{\"prompt\": [1], \"top_k\": -2}\n", {"line 1", "top_k"});
}

TEST_F(Prompts, TooLongForMaxPositions) {
  config_.max_position_embeddings = 8;
  expect_error("{\"prompt\": [1, 2, 3], \"max_new_tokens\": 6}\n",
               {"line 1", "prompt length 3", "max_new_tokens 6", "9", "max_position_embeddings = 8"});
  // The default max_new_tokens counts too.
  d_.max_new_tokens = 64;
  expect_error("{\"prompt\": [1]}\n", {"line 1", "prompt length 1", "max_new_tokens 64"});
}

TEST_F(Prompts, DuplicateIds) {
  expect_error("{\"id\": \"a\", \"prompt\": [1]}\n\n{\"id\": \"a\", \"prompt\": [2]}\n",
               {"line 3", "'a'", "line 1"});
  // An explicit integer id may collide with a default one.
  expect_error("{\"prompt\": [1]}\n{\"id\": 0, \"prompt\": [2]}\n", {"line 2", "'0'", "line 1"});
}

TEST_F(Prompts, EmptyFileAndMissingFile) {
  expect_error("", {"no requests"});
  expect_error("\n  \n\n", {"no requests"});
  try {
    read_prompts((dir_ / "absent.jsonl").string(), config_, d_);
    ADD_FAILURE() << "no error for a missing file";
  } catch (const InputError& e) {
    EXPECT_NE(std::string(e.what()).find("absent.jsonl"), std::string::npos) << e.what();
  }
}

TEST_F(Prompts, BadDefaultsAreRejected) {
  d_.sampling.top_p = 2.0f;
  try {
    read("{\"prompt\": [1]}\n");
    ADD_FAILURE() << "no error for top_p = 2 in the defaults";
  } catch (const InputError& e) {
    EXPECT_NE(std::string(e.what()).find("generate defaults: top_p"), std::string::npos) << e.what();
  }
  d_.sampling.top_p = 1.0f;
  d_.max_new_tokens = 0;
  EXPECT_THROW(read("{\"prompt\": [1]}\n"), InputError);
  d_.max_new_tokens = 1;
  d_.stop_ids = {512};
  EXPECT_THROW(read("{\"prompt\": [1]}\n"), InputError);
}

}  // namespace
}  // namespace dsv4
