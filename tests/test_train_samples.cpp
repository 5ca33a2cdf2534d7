// The training data JSONL of `dsv4 train-step` (train/samples.h): valid files, the writer's round
// trip, and every kind of bad input with a message naming the file, the line and the field.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <fstream>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "model/config.h"
#include "model/error.h"
#include "test_util.h"
#include "train/samples.h"

namespace dsv4 {
namespace {

using train::read_samples_jsonl;
using train::sample_to_json;
using train::TrainSample;

class TrainSamples : public ::testing::Test {
 protected:
  void SetUp() override { config_ = preset("tiny"); }  // vocab_size 512

  std::string write(const std::string& text) {
    const std::string path = dir_ / ("d" + std::to_string(n_++) + ".jsonl");
    std::ofstream(path, std::ios::binary) << text;
    return path;
  }
  std::vector<TrainSample> read(const std::string& text) { return read_samples_jsonl(write(text), config_); }

  // Reading `text` throws InputError whose message names the file and contains every part.
  void expect_error(const std::string& text, const std::vector<std::string>& parts) {
    const std::string path = write(text);
    try {
      read_samples_jsonl(path, config_);
      ADD_FAILURE() << "no InputError for: " << text;
    } catch (const InputError& e) {
      const std::string msg = e.what();
      EXPECT_NE(msg.find(path), std::string::npos) << msg;
      for (const auto& s : parts)
        EXPECT_NE(msg.find(s), std::string::npos) << "'" << s << "' not in: " << msg;
    }
  }

  test::TempDir dir_;
  int n_ = 0;
  ModelConfig config_;
};

TEST_F(TrainSamples, ValidFileWithEveryField) {
  const auto s = read(
      "{\"id\": \"s0\", \"prompt\": [1, 2, 3], \"response\": [4, 5], \"rollout_logprobs\": [-1.25, -0.5],"
      " \"old_logprobs\": [-1, -0.25], \"ref_logprobs\": [-2, 0], \"reward\": 1.0, \"group\": \"q0\"}\n"
      "\n"
      "  \t\n"
      "{\"prompt\": [511], \"response\": [0], \"reward\": -2}\r\n"
      "{\"id\": 17, \"prompt\": [7], \"response\": [8, 9, 10], \"reward\": 0.5, \"group\": \"q0\"}");
  ASSERT_EQ(s.size(), 3u);
  EXPECT_EQ(s[0].id, "s0");
  EXPECT_EQ(s[0].line, 1);
  EXPECT_EQ(s[0].prompt, (std::vector<int32_t>{1, 2, 3}));
  EXPECT_EQ(s[0].response, (std::vector<int32_t>{4, 5}));
  EXPECT_EQ(s[0].tokens(), (std::vector<int32_t>{1, 2, 3, 4, 5}));
  EXPECT_EQ(s[0].rollout_logprobs, (std::vector<float>{-1.25f, -0.5f}));
  EXPECT_EQ(s[0].old_logprobs, (std::vector<float>{-1.0f, -0.25f}));
  EXPECT_EQ(s[0].ref_logprobs, (std::vector<float>{-2.0f, 0.0f}));
  EXPECT_EQ(s[0].reward, 1.0);
  EXPECT_FALSE(s[0].advantage.has_value());
  EXPECT_EQ(s[0].group, "q0");

  // Defaults: the sample index as id (blank lines do not count), no log-probs, one group.
  EXPECT_EQ(s[1].id, "1");
  EXPECT_EQ(s[1].line, 4);
  EXPECT_TRUE(s[1].rollout_logprobs.empty());
  EXPECT_TRUE(s[1].old_logprobs.empty());
  EXPECT_TRUE(s[1].ref_logprobs.empty());
  EXPECT_EQ(s[1].reward, -2.0);
  EXPECT_EQ(s[1].group, "");

  EXPECT_EQ(s[2].id, "17");
  EXPECT_EQ(s[2].line, 5);
  EXPECT_EQ(s[2].response.size(), 3u);
}

TEST_F(TrainSamples, AdvantagesAndLengthLimit) {
  config_.max_position_embeddings = 5;
  const auto s = read(
      "{\"prompt\": [1, 2], \"response\": [3, 4, 5], \"advantage\": -0.75}\n"
      "{\"prompt\": [1], \"response\": [3], \"advantage\": 2}\n");
  ASSERT_EQ(s.size(), 2u);
  EXPECT_EQ(s[0].advantage, -0.75);
  EXPECT_FALSE(s[0].reward.has_value());
  EXPECT_EQ(s[1].advantage, 2.0);
  // One more token is too many.
  expect_error(
      "{\"prompt\": [1, 2], \"response\": [3, 4, 5, 6], \"advantage\": 0}\n",
      {"line 1", "'response'", "prompt length 2", "response length 4", "6", "max_position_embeddings = 5"});
}

TEST_F(TrainSamples, NotJsonOrNotAnObjectOrUnknownField) {
  expect_error("{\"prompt\": [1], \"response\": [2], \"advantage\": 0}\n{\"prompt\": [1,}\n",
               {"line 2", "not valid JSON"});
  expect_error("[1, 2]\n", {"line 1", "JSON object", "array"});
  expect_error("{\"prompt\": [1], \"response\": [2], \"advantage\": 0, \"rewrd\": 1}\n",
               {"line 1", "unknown field 'rewrd'"});
}

TEST_F(TrainSamples, MissingEmptyOrBadTokenArrays) {
  expect_error("{\"response\": [2], \"advantage\": 0}\n", {"line 1", "'prompt'", "missing"});
  expect_error("{\"prompt\": [1], \"advantage\": 0}\n", {"line 1", "'response'", "missing"});
  expect_error("{\"prompt\": [], \"response\": [2], \"advantage\": 0}\n", {"'prompt'", "empty"});
  expect_error("\n{\"prompt\": [1], \"response\": [], \"advantage\": 0}\n",
               {"line 2", "'response'", "empty"});
  expect_error("{\"prompt\": \"1 2\", \"response\": [2], \"advantage\": 0}\n",
               {"'prompt'", "array", "string"});
  expect_error("{\"prompt\": [1], \"response\": [2, 2.5], \"advantage\": 0}\n",
               {"line 1", "'response', index 1", "integer"});
  expect_error("{\"prompt\": [1], \"response\": [2, 512], \"advantage\": 0}\n",
               {"'response', index 1", "512", "vocabulary [0, 512)"});
  expect_error("{\"prompt\": [-1], \"response\": [2], \"advantage\": 0}\n", {"'prompt', index 0", "-1"});
}

TEST_F(TrainSamples, BadLogprobArrays) {
  const std::string head = "{\"prompt\": [1], \"response\": [2, 3], \"advantage\": 0, ";
  expect_error(head + "\"rollout_logprobs\": [-1]}\n",
               {"line 1", "'rollout_logprobs'", "1 values", "expected 2"});
  expect_error(head + "\"old_logprobs\": [-1, -2, -3]}\n", {"'old_logprobs'", "3 values"});
  expect_error(head + "\"ref_logprobs\": -1}\n", {"'ref_logprobs'", "array", "integer"});
  expect_error(head + "\"ref_logprobs\": [-1, \"x\"]}\n", {"'ref_logprobs', index 1", "string"});
  expect_error(head + "\"rollout_logprobs\": [-1, null]}\n", {"'rollout_logprobs', index 1", "null"});
  expect_error(head + "\"old_logprobs\": [-1e300, -1]}\n", {"'old_logprobs', index 0", "fp32"});
  expect_error(head + "\"old_logprobs\": [-1, -3.5e38]}\n", {"'old_logprobs', index 1", "fp32"});
  // The largest float's shortest text is slightly above it and still rounds to it.
  const auto s = read(head + "\"old_logprobs\": [-3.4028235e38, -1]}\n");
  EXPECT_EQ(s[0].old_logprobs[0], -std::numeric_limits<float>::max());
}

TEST_F(TrainSamples, AdvantageRewardAndGroup) {
  expect_error("{\"prompt\": [1], \"response\": [2]}\n", {"line 1", "'advantage' or 'reward'"});
  expect_error("{\"prompt\": [1], \"response\": [2], \"advantage\": 1, \"reward\": 1}\n",
               {"line 1", "'advantage'", "'reward'", "both"});
  expect_error("{\"prompt\": [1], \"response\": [2], \"advantage\": \"1\"}\n",
               {"'advantage'", "number", "string"});
  expect_error("{\"prompt\": [1], \"response\": [2], \"reward\": true}\n", {"'reward'", "boolean"});
  expect_error("{\"prompt\": [1], \"response\": [2], \"reward\": 1e999}\n", {"line 1", "too large"});
  expect_error("{\"prompt\": [1], \"response\": [2], \"advantage\": 1, \"group\": \"g\"}\n",
               {"line 1", "'group'", "'reward'"});
  expect_error("{\"prompt\": [1], \"response\": [2], \"reward\": 1, \"group\": 3}\n", {"'group'", "string"});
  expect_error("{\"prompt\": [1], \"response\": [2], \"reward\": 1, \"group\": \"\"}\n",
               {"'group'", "empty"});
  // A file uses one or the other.
  expect_error(
      "{\"prompt\": [1], \"response\": [2], \"advantage\": 1}\n\n"
      "{\"prompt\": [1], \"response\": [2], \"reward\": 1}\n",
      {"line 3", "'reward'", "line 1", "'advantage'"});
  expect_error(
      "{\"prompt\": [1], \"response\": [2], \"reward\": 1}\n"
      "{\"prompt\": [1], \"response\": [2], \"reward\": 0}\n"
      "{\"prompt\": [1], \"response\": [2], \"advantage\": 1}\n",
      {"line 3", "'advantage'", "line 1"});
}

TEST_F(TrainSamples, Ids) {
  expect_error(
      "{\"id\": \"a\", \"prompt\": [1], \"response\": [2], \"advantage\": 0}\n\n"
      "{\"id\": \"a\", \"prompt\": [1], \"response\": [2], \"advantage\": 0}\n",
      {"line 3", "'id'", "'a'", "line 1"});
  // An explicit integer id may collide with a default one.
  expect_error(
      "{\"prompt\": [1], \"response\": [2], \"advantage\": 0}\n"
      "{\"id\": 0, \"prompt\": [1], \"response\": [2], \"advantage\": 0}\n",
      {"line 2", "'0'", "line 1"});
  expect_error("{\"id\": [1], \"prompt\": [1], \"response\": [2], \"advantage\": 0}\n",
               {"'id'", "string or an integer"});
  expect_error("{\"id\": \"\", \"prompt\": [1], \"response\": [2], \"advantage\": 0}\n", {"'id'", "empty"});
}

TEST_F(TrainSamples, EmptyOrMissingFile) {
  expect_error("", {"no samples"});
  expect_error("\n \n", {"no samples"});
  try {
    read_samples_jsonl(dir_ / "absent.jsonl", config_);
    ADD_FAILURE() << "no error for a missing file";
  } catch (const InputError& e) {
    EXPECT_NE(std::string(e.what()).find("absent.jsonl"), std::string::npos) << e.what();
  }
}

void expect_same(const TrainSample& a, const TrainSample& b) {
  EXPECT_EQ(a.id, b.id);
  EXPECT_EQ(a.prompt, b.prompt);
  EXPECT_EQ(a.response, b.response);
  EXPECT_TRUE(test::bitwise_equal(a.rollout_logprobs, b.rollout_logprobs));
  EXPECT_TRUE(test::bitwise_equal(a.old_logprobs, b.old_logprobs));
  EXPECT_TRUE(test::bitwise_equal(a.ref_logprobs, b.ref_logprobs));
  EXPECT_EQ(a.advantage, b.advantage);
  EXPECT_EQ(a.reward, b.reward);
  EXPECT_EQ(a.group, b.group);
}

TEST_F(TrainSamples, WriterRoundTripIsExact) {
  auto g = test::rng_for("TrainSamples.RoundTrip");
  std::uniform_int_distribution<int32_t> tok(0, 511);
  std::uniform_int_distribution<uint32_t> bits;
  // Any finite fp32 value, from random bit patterns (subnormals, extremes and -0 included).
  auto any_float = [&] {
    for (;;) {
      const uint32_t u = bits(g);
      float f;
      std::memcpy(&f, &u, 4);
      if (std::isfinite(f)) return f;
    }
  };
  std::vector<TrainSample> rs, as;
  for (int i = 0; i < 40; ++i) {
    TrainSample s;
    s.id = i % 3 == 0 ? "sample \"" + std::to_string(i) + "\"\t\u00e9" : std::to_string(1000 + i);
    for (int k = 0; k < 1 + i % 4; ++k) s.prompt.push_back(tok(g));
    for (int k = 0; k < 1 + i % 5; ++k) s.response.push_back(tok(g));
    const size_t n = s.response.size();
    if (i % 2 == 0)
      for (size_t k = 0; k < n; ++k) s.rollout_logprobs.push_back(any_float());
    if (i % 3 != 2)
      for (size_t k = 0; k < n; ++k) s.old_logprobs.push_back(-std::ldexp(float(bits(g) % 1000) / 7.0f, -3));
    if (i % 4 == 1)
      for (size_t k = 0; k < n; ++k) s.ref_logprobs.push_back(any_float());
    TrainSample a = s, r = s;
    a.advantage = std::ldexp(double(bits(g)) - 2147483648.0, -29);
    r.reward = i % 5 == 0 ? 1.0 / 3.0 : double(i % 2);
    if (i % 2) r.group = "q" + std::to_string(i / 4);
    as.push_back(a);
    rs.push_back(r);
  }
  for (const auto* set : {&as, &rs}) {
    std::string text;
    for (const auto& s : *set) text += sample_to_json(s) + "\n";
    const auto back = read(text);
    ASSERT_EQ(back.size(), set->size());
    for (size_t i = 0; i < back.size(); ++i) {
      SCOPED_TRACE(i);
      expect_same((*set)[i], back[i]);
      EXPECT_EQ(back[i].line, int(i) + 1);
    }
  }
}

TEST(TrainSampleJson, ShortestDigitsAndFieldOrder) {
  TrainSample s;
  s.id = "s0";
  s.prompt = {1, 2, 3};
  s.response = {4, 5};
  s.rollout_logprobs = {-1.2f, -0.3f};
  s.reward = 1.0;
  s.group = "q0";
  EXPECT_EQ(sample_to_json(s),
            "{\"id\":\"s0\",\"prompt\":[1,2,3],\"response\":[4,5],\"rollout_logprobs\":[-1.2,-0.3],"
            "\"reward\":1.0,\"group\":\"q0\"}");
}

TEST(TrainSampleJson, RefusesWhatCannotBeReadBack) {
  TrainSample s;
  s.id = "x";
  s.prompt = {1};
  s.response = {2, 3};
  s.advantage = 0.5;
  EXPECT_NO_THROW(sample_to_json(s));
  TrainSample t = s;
  t.reward = 1.0;  // both
  EXPECT_THROW(sample_to_json(t), Error);
  t = s;
  t.advantage.reset();  // neither
  EXPECT_THROW(sample_to_json(t), Error);
  t = s;
  t.advantage = INFINITY;
  EXPECT_THROW(sample_to_json(t), Error);
  t = s;
  t.old_logprobs = {-1.0f};  // wrong length
  EXPECT_THROW(sample_to_json(t), Error);
  t = s;
  t.ref_logprobs = {-1.0f, NAN};
  EXPECT_THROW(sample_to_json(t), Error);
  t = s;
  t.group = "g";  // group goes with reward
  EXPECT_THROW(sample_to_json(t), Error);
  t = s;
  t.id = "";
  EXPECT_THROW(sample_to_json(t), Error);
}

}  // namespace
}  // namespace dsv4
