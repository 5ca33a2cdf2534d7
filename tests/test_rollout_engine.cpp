// The rollout engine (rollout/engine.h): a request's tokens, log-probs, decisions and tensors are the
// same bits whatever else runs with it, however the scheduler cuts its prompt, whatever page size and
// pages it gets and whether its prompt's cache is shared; its log-probs are those a prefill of the
// same tokens computes (decode ≡ prefill in one profile); stop ids, limits and bad input.
#include <gtest/gtest.h>

#include <random>

#include "model/config.h"
#include "model/error.h"
#include "model/forward.h"
#include "rollout/engine.h"
#include "rollout_test_util.h"
#include "test_util.h"
#include "tiny_model.h"

namespace dsv4 {
namespace {

using rollout::Engine;
using rollout::EngineOptions;
using rollout::Generation;
using rollout::Request;

using test::tiny;

std::vector<int32_t> random_prompt(int64_t n, uint64_t seed) {
  std::mt19937_64 g(seed);
  std::uniform_int_distribution<int32_t> d(0, tiny().config().vocab_size - 1);
  std::vector<int32_t> t(static_cast<size_t>(n));
  for (auto& x : t) x = d(g);
  return t;
}

std::vector<Request> requests(int n, int max_new = 10, uint64_t seed = 100) {
  std::vector<Request> r;
  for (int i = 0; i < n; ++i) {
    Request q;
    q.id = "req-" + std::to_string(i);
    q.prompt = random_prompt(3 + 11 * i, seed + i);
    q.max_new_tokens = max_new;
    q.sampling.temperature = i % 3 == 0 ? 0.0f : 0.8f;
    q.sampling.top_p = 0.9f;
    q.sampling.top_k = i % 2 ? 20 : 0;
    q.sampling.seed = 42;
    r.push_back(q);
  }
  return r;
}

struct Result {
  std::vector<Generation> gens;
  test::RowCollector rows;
};

std::unique_ptr<Result> generate(const std::vector<Request>& reqs, EngineOptions o) {
  auto r = std::make_unique<Result>();
  o.observer = &r->rows;
  Engine e(tiny(), o);
  for (const auto& q : reqs) e.submit(q);
  r->gens = e.run();
  EXPECT_EQ(r->rows.duplicates, 0);
  return r;
}

void expect_same_generation(const Generation& a, const Generation& b, const std::string& what) {
  EXPECT_EQ(a.id, b.id) << what;
  EXPECT_EQ(a.tokens, b.tokens) << what << " " << a.id;
  EXPECT_TRUE(test::bitwise_equal(a.logprobs, b.logprobs)) << what << " " << a.id;
  EXPECT_EQ(a.counters, b.counters) << what << " " << a.id;
  EXPECT_EQ(a.finish, b.finish) << what << " " << a.id;
}

// The rows request `index` of `a` reported equal those request `index_b` of `b` reported.
::testing::AssertionResult same_rows(const Result& a, int index, const Result& b, int index_b) {
  test::RowCollector ra;
  for (const auto& [k, v] : a.rows.rows)
    if (std::get<0>(k) == index) ra.rows.emplace(k, v);
  return test::rows_equal(ra, b.rows, {}, index_b);
}

TEST(RolloutEngine, BatchAndScheduleInvariance) {
  const auto reqs = requests(8);
  EngineOptions base;
  base.max_batch = 8;
  const auto batched = generate(reqs, base);
  ASSERT_EQ(batched->gens.size(), reqs.size());

  EngineOptions tight = base;  // requests join mid-flight, prompts cut by the budget and the chunk size
  tight.max_batch = 3;
  tight.token_budget = 7;
  tight.prefill_chunk = 5;
  tight.page_size = 1;
  const auto scheduled = generate(reqs, tight);
  for (size_t i = 0; i < reqs.size(); ++i) {
    expect_same_generation(batched->gens[i], scheduled->gens[i], "max batch 3, budget 7, chunk 5, page 1");
    EXPECT_TRUE(same_rows(*batched, int(i), *scheduled, int(i)));
  }

  // Alone, and with other neighbours (the request in the middle of a different batch).
  for (size_t i : {size_t(0), size_t(5), size_t(7)}) {
    const auto alone = generate({reqs[i]}, base);
    expect_same_generation(batched->gens[i], alone->gens[0], "alone");
    EXPECT_TRUE(same_rows(*batched, int(i), *alone, 0));
    std::vector<Request> other = requests(3, 4, 900);  // other prompts: nothing to share
    for (auto& q : other) q.id += "-other";
    other.insert(other.begin() + 1, reqs[i]);
    const auto mixed = generate(other, tight);
    expect_same_generation(batched->gens[i], mixed->gens[1], "other neighbours");
    EXPECT_TRUE(same_rows(*batched, int(i), *mixed, 1));
  }
}

// 64 requests running at once (max batch 64), against the same requests in batches of 8 and alone.
TEST(RolloutEngine, BatchOf64) {
  std::vector<Request> reqs;
  for (int i = 0; i < 64; ++i) {
    Request q;
    q.id = "b64-" + std::to_string(i);
    q.prompt = random_prompt(2 + i % 9, 500 + i);
    q.max_new_tokens = 3 + i % 4;
    q.sampling.temperature = i % 2 ? 0.8f : 0.0f;
    q.sampling.seed = 11;
    reqs.push_back(q);
  }
  EngineOptions big;
  big.max_batch = 64;
  const auto all = generate(reqs, big);
  EngineOptions eight;
  eight.max_batch = 8;
  const auto by8 = generate(reqs, eight);
  for (size_t i = 0; i < reqs.size(); ++i) {
    expect_same_generation(all->gens[i], by8->gens[i], "batch 64 vs 8");
    EXPECT_TRUE(same_rows(*all, int(i), *by8, int(i)));
  }
  for (size_t i : {size_t(0), size_t(33), size_t(63)}) {
    const auto alone = generate({reqs[i]}, big);
    expect_same_generation(all->gens[i], alone->gens[0], "batch 64 vs alone");
    EXPECT_TRUE(same_rows(*all, int(i), *alone, 0));
  }
}

TEST(RolloutEngine, PageSizeAndPrefixSharingInvariance) {
  std::vector<Request> reqs;
  const auto prompt = random_prompt(45, 9);
  for (int i = 0; i < 4; ++i) {  // a GRPO group: one prompt, several samples
    Request q;
    q.id = "g" + std::to_string(i);
    q.prompt = prompt;
    q.max_new_tokens = 8;
    q.sampling.seed = 3;
    reqs.push_back(q);
  }
  Request longer = reqs[0];  // a prompt that extends the group's prompt
  longer.id = "longer";
  longer.prompt.insert(longer.prompt.end(), {5, 6, 7, 8, 9});
  reqs.push_back(longer);

  EngineOptions shared;
  shared.page_size = 16;
  const auto a = generate(reqs, shared);
  EXPECT_EQ(a->gens[0].prefix_source, -1);
  for (int i = 1; i < 5; ++i) {
    EXPECT_EQ(a->gens[size_t(i)].prefix_source, 0) << i;
    EXPECT_EQ(a->gens[size_t(i)].shared_prefix, 45) << i;
  }
  // Different samples of one prompt differ (the request id keys the draw).
  EXPECT_NE(a->gens[1].tokens, a->gens[2].tokens);

  for (int page : {1, 7, 64}) {
    EngineOptions o;
    o.page_size = page;
    o.prefix_sharing = page != 7;
    const auto b = generate(reqs, o);
    for (size_t i = 0; i < reqs.size(); ++i) {
      expect_same_generation(a->gens[i], b->gens[i], "page " + std::to_string(page));
      EXPECT_TRUE(same_rows(*a, int(i), *b, int(i))) << "page " << page;
    }
  }
}

// What the trainer recomputes: a prefill of prompt + generated tokens in the same profile gives the
// rollout's log-probs bit for bit (temperature applied to both).
TEST(RolloutEngine, LogprobsEqualThePrefillOfTheSameTokens) {
  for (const char* profile : {"train", "rollout"}) {
    auto reqs = requests(3, 12);
    reqs[1].sampling.temperature = 1.0f;
    EngineOptions o;
    o.profile = profile_by_name(profile);
    const auto r = generate(reqs, o);
    for (size_t i = 0; i < reqs.size(); ++i) {
      const Generation& g = r->gens[i];
      std::vector<int32_t> all = g.prompt;
      all.insert(all.end(), g.tokens.begin(), g.tokens.end());
      RunOptions fo;
      fo.profile = o.profile;
      fo.temperature = reqs[i].sampling.temperature > 0 ? reqs[i].sampling.temperature : 1.0f;
      const SequenceResult s = forward(tiny(), {all}, fo).seqs[0];
      const std::vector<float> tail(s.logprobs.end() - int64_t(g.tokens.size()), s.logprobs.end());
      EXPECT_TRUE(test::bitwise_equal(g.logprobs, tail)) << profile << " request " << i;
    }
  }
}

TEST(RolloutEngine, StopIdsEndGeneration) {
  auto reqs = requests(1, 10);
  reqs[0].sampling.temperature = 0.0f;
  const auto free_run = generate(reqs, {});
  ASSERT_EQ(free_run->gens[0].tokens.size(), 10u);
  EXPECT_EQ(free_run->gens[0].finish, rollout::FinishReason::length);
  reqs[0].stop_ids = {free_run->gens[0].tokens[3]};
  const auto stopped = generate(reqs, {});
  const auto& g = stopped->gens[0];
  // Generation ends at the first occurrence of the stop id, which is emitted.
  size_t first = 0;
  while (free_run->gens[0].tokens[first] != reqs[0].stop_ids[0]) ++first;
  EXPECT_EQ(g.tokens.size(), first + 1);
  EXPECT_EQ(g.finish, rollout::FinishReason::stop);
}

// A request's cache grows linearly with its context: a fixed window ring plus compressed rows.
TEST(RolloutEngine, CacheMemoryIsLinearInContext) {
  std::vector<int64_t> peak;
  for (int64_t T : {256, 512, 768}) {
    Request q;
    q.id = "m";
    q.prompt = random_prompt(T, 1);
    q.max_new_tokens = 1;
    EngineOptions o;
    o.page_size = 1;
    peak.push_back(generate({q}, o)->gens[0].peak_cache_bytes);
  }
  EXPECT_GT(peak[0], 0);
  EXPECT_GT(peak[1], peak[0]);
  EXPECT_EQ(peak[2] - peak[1], peak[1] - peak[0]);
}

TEST(RolloutEngine, BadRequestsAreNamed) {
  Engine e(tiny(), {});
  Request q;
  q.id = "bad";
  auto expect_msg = [&](Request r, const char* what) {
    try {
      e.submit(r);
      ADD_FAILURE() << "accepted: " << what;
    } catch (const InputError& err) {
      EXPECT_NE(std::string(err.what()).find("request 'bad'"), std::string::npos) << err.what();
      EXPECT_NE(std::string(err.what()).find(what), std::string::npos) << err.what();
    }
  };
  expect_msg(q, "prompt is empty");
  q.prompt = {1, 2, 100000};
  expect_msg(q, "prompt[2] = 100000");
  q.prompt = {1, 2};
  q.max_new_tokens = int(tiny().config().max_position_embeddings);
  expect_msg(q, "exceeds max_position_embeddings");
  q.max_new_tokens = 0;
  expect_msg(q, "max_new_tokens");
  q.max_new_tokens = 4;
  q.sampling.top_p = 0.0f;
  expect_msg(q, "top_p");
  EngineOptions o;
  o.page_size = 0;
  EXPECT_THROW(Engine(tiny(), o), InputError);
  o = {};
  o.max_batch = 0;
  EXPECT_THROW(Engine(tiny(), o), InputError);
}

}  // namespace
}  // namespace dsv4
