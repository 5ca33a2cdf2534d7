// The decoding path on the GPU: the rollout engine (paged FP8/bf16 caches, chunked prefill, decode,
// prefix sharing, sampling) on CUDA gives the CPU engine's bits — tokens, log-probs, every reported
// tensor row and decision.
#include <gtest/gtest.h>

#include <random>
#include <string>

#include "capture/policy.h"
#include "gpu_test_util.h"
#include "model/config.h"
#include "replay/generation.h"
#include "rollout/engine.h"
#include "rollout_test_util.h"
#include "test_util.h"

namespace dsv4 {
namespace {

struct Result {
  std::vector<rollout::Generation> gens;
  test::RowCollector rows;
};

std::vector<rollout::Request> requests(const Weights& w) {
  std::vector<rollout::Request> reqs;
  std::uniform_int_distribution<int32_t> tok(0, w.config().vocab_size - 1);
  for (int i = 0; i < 6; ++i) {
    rollout::Request q;
    q.id = "gpu-" + std::to_string(i % 4);  // two prompts shared
    if (i >= 4) q.id += "-again";
    std::mt19937_64 pg(100 + i % 4);
    for (int t = 0; t < 20 + 47 * (i % 4); ++t) q.prompt.push_back(tok(pg));
    q.max_new_tokens = 24;
    q.sampling.temperature = i % 2 ? 0.7f : 0.0f;
    q.sampling.top_p = 0.95f;
    q.sampling.seed = 5;
    reqs.push_back(q);
  }
  return reqs;
}

std::unique_ptr<Result> generate(const Weights& w, Device d, const char* profile, int chunk, int page) {
  const std::vector<rollout::Request> reqs = requests(w);
  auto r = std::make_unique<Result>();
  rollout::EngineOptions o;
  o.profile = profile_by_name(profile);
  o.device = d;
  o.prefill_chunk = chunk;
  o.page_size = page;
  o.max_batch = 4;
  o.observer = &r->rows;
  rollout::Engine e(w, o);
  for (const auto& q : reqs) e.submit(q);
  r->gens = e.run();
  return r;
}

TEST(GpuDecode, EngineMatchesTheCpu) {
  DSV4_REQUIRE_CUDA_DEVICE();
  for (const char* name : {"tiny", "tiny-b"}) {
    const Weights w = Weights::init(preset(name), 7);
    for (const char* profile : {"train", "rollout", "deepseek-inference-v2"}) {
      const auto cpu = generate(w, Device::cpu, profile, 16, 16);
      const auto gpu = generate(w, Device::cuda, profile, 16, 16);
      ASSERT_EQ(cpu->gens.size(), gpu->gens.size());
      for (size_t i = 0; i < cpu->gens.size(); ++i) {
        EXPECT_EQ(cpu->gens[i].tokens, gpu->gens[i].tokens) << name << " " << profile << " request " << i;
        EXPECT_TRUE(test::bitwise_equal(cpu->gens[i].logprobs, gpu->gens[i].logprobs))
            << name << " " << profile << " request " << i;
      }
      EXPECT_TRUE(test::rows_equal(cpu->rows, gpu->rows)) << name << " " << profile;
      EXPECT_TRUE(test::rows_equal(gpu->rows, cpu->rows)) << name << " " << profile;
      // The GPU run to run, with other chunking and pages.
      const auto gpu2 = generate(w, Device::cuda, profile, 0, 1);
      for (size_t i = 0; i < cpu->gens.size(); ++i)
        EXPECT_TRUE(test::bitwise_equal(gpu->gens[i].logprobs, gpu2->gens[i].logprobs))
            << name << " " << profile;
    }
  }
}

// A recorded generation (replay/generation.h run_collected) on the GPU, where its collector takes the
// reports late, emits the CPU's sequences: every row digest, kept value's digest, decision and log-prob,
// with only decisions kept and with the logits and a tensor kept too.
TEST(GpuDecode, CollectedGenerationMatchesTheCpu) {
  DSV4_REQUIRE_CUDA_DEVICE();
  const Weights w = Weights::init(preset("tiny"), 7);
  const std::vector<rollout::Request> reqs = requests(w);
  for (const std::string capture : {"decisions", "decisions,logits,attn.q"}) {
    SCOPED_TRACE(capture);
    const CapturePolicy policy = CapturePolicy::parse(capture);
    const auto transcript = [&](Device d) {
      rollout::EngineOptions o;
      o.profile = profile_rollout();
      o.device = d;
      o.prefill_chunk = 16;
      o.page_size = 16;
      o.max_batch = 4;
      const CollectedGeneration c = run_collected(
          w, reqs, o, [&](std::string_view name, int layer) { return policy.wants_tensor(name, layer); });
      EXPECT_TRUE(c.collector->deferrable());
      test::ReportTranscript t;
      for (size_t i = 0; i < c.gens.size(); ++i) {
        c.collector->report_request(int(i), int64_t(c.computed[i].size()), int(i), c.gens[i].logprobs, t);
        t.text += "logprobs " +
                  test::ReportTranscript::words(c.logprobs[i].data(), int64_t(c.logprobs[i].size())) + "\n";
      }
      return t.text;
    };
    const std::string cpu = transcript(Device::cpu), gpu = transcript(Device::cuda);
    EXPECT_FALSE(cpu.empty());
    EXPECT_TRUE(cpu == gpu) << "the GPU's recorded generation differs from the CPU's";
    if (capture == "decisions") {  // each chunk's digests held back on their stream, as in GpuRecord
      const std::string late = [&] {
        const test::DigestDelay delay(500);
        return transcript(Device::cuda);
      }();
      EXPECT_TRUE(cpu == late)
          << "the GPU's recorded generation, digests 0.5 ms late, differs from the CPU's";
    }
  }
}

}  // namespace
}  // namespace dsv4
