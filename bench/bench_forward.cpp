// Whole-model CPU forward throughput (tokens/s) for the tiny and mid presets, the train, rollout and
// deepseek-inference profiles (docs/PROFILES.md), 1 and 2 threads. Run: build/bench/bench_forward [--benchmark_filter=...]
// The thread-scaling ratio is read from the same run (1 vs 2 threads of one case).
#include <benchmark/benchmark.h>

#include "model/forward.h"
#include "model/tokens.h"
#include "model/weights.h"

namespace {

const dsv4::Weights& model(const std::string& name) {
  static const dsv4::Weights tiny = dsv4::Weights::init(dsv4::preset("tiny"), 7);
  if (name == "tiny") return tiny;
  static const dsv4::Weights mid = dsv4::Weights::init(dsv4::preset("mid"), 7);
  return mid;
}

void run(benchmark::State& state, const std::string& preset, const dsv4::NumericsProfile& profile) {
  const int64_t T = state.range(0);
  const int threads = int(state.range(1));
  const dsv4::Weights& w = model(preset);
  const auto tokens = dsv4::random_tokens(T, w.config().vocab_size, 1);
  dsv4::RunOptions opt;
  opt.profile = profile;
  opt.threads = threads;
  for (auto _ : state) {
    auto r = dsv4::forward(w, {tokens}, opt);
    benchmark::DoNotOptimize(r.seqs[0].logprobs.data());
  }
  state.counters["tokens/s"] =
      benchmark::Counter(double(T) * state.iterations(), benchmark::Counter::kIsRate);
  state.counters["threads"] = threads;
}

void BM_TinyTrain(benchmark::State& s) {
  run(s, "tiny", dsv4::profile_train());
}
void BM_TinyRollout(benchmark::State& s) {
  run(s, "tiny", dsv4::profile_rollout());
}
void BM_TinyDeepseekInference(benchmark::State& s) {
  run(s, "tiny", dsv4::profile_by_name("deepseek-inference"));
}
void BM_MidTrain(benchmark::State& s) {
  run(s, "mid", dsv4::profile_train());
}

BENCHMARK(BM_TinyTrain)->ArgsProduct({{512, 4096}, {1, 2}})->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(BM_TinyRollout)->ArgsProduct({{512}, {1, 2}})->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(BM_TinyDeepseekInference)->ArgsProduct({{512}, {1, 2}})->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(BM_MidTrain)
    ->ArgsProduct({{1024}, {1, 2}})
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime()
    ->Iterations(1);

}  // namespace

BENCHMARK_MAIN();
