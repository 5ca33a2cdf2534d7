// Decoding throughput of the rollout path (model/forward.h forward_chunk over rollout/kv_cache.h):
// B requests, each with a context of C tokens already in its cache, decode one token each per step.
// Reported per case: decode tokens/s, the cost of a decode token against a prefill token measured in
// the same case (the prefill of the contexts, timed once), and the cache bytes per request (window
// ring + compressed rows + compressor state: linear in C). CPU always; CUDA when a device is usable.
// Run: build/bench/bench_decode [--benchmark_filter=...]
#include <benchmark/benchmark.h>

#include <chrono>
#include <cstdio>
#include <memory>

#include "model/forward.h"
#include "model/tokens.h"
#include "model/weights.h"
#include "rollout/engine.h"
#include "rollout/kv_cache.h"

namespace {

using namespace dsv4;

const Weights& model(const std::string& name) {
  static const Weights tiny = Weights::init(preset("tiny"), 7);
  if (name == "tiny") return tiny;
  static const Weights mid = Weights::init(preset("mid"), 7);
  return mid;
}

void run(benchmark::State& state, const std::string& name, Device device) {
  const int64_t B = state.range(0), C = state.range(1);
  const Weights& w = model(name);
  std::unique_ptr<backend::Backend> be;
  try {
    be = backend::make_backend(device, w);
  } catch (const std::exception& e) {
    state.SkipWithError(e.what());
    return;
  }
  const NumericsProfile profile = profile_rollout();
  rollout::CacheStore store(*be, w.config(), profile, 64);
  std::vector<std::unique_ptr<rollout::RequestCache>> caches;
  std::vector<int32_t> next(static_cast<size_t>(B));
  RunOptions opt;
  opt.profile = profile;
  const auto t0 = std::chrono::steady_clock::now();
  for (int64_t b = 0; b < B; ++b) {
    caches.push_back(std::make_unique<rollout::RequestCache>(store));
    const auto prompt = random_tokens(C, w.config().vocab_size, uint64_t(b + 1));
    const SequenceResult r = forward_chunk(*be, w, int(b), prompt, *caches.back(), opt);
    next[size_t(b)] = int32_t(b % w.config().vocab_size);
    benchmark::DoNotOptimize(r.last_logits.data());
  }
  be->synchronize();
  const double prefill_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  const double prefill_per_token = prefill_s / double(B * C);

  for (auto _ : state) {
    for (int64_t b = 0; b < B; ++b) {
      const SequenceResult r = forward_chunk(*be, w, int(b), {next[size_t(b)]}, *caches[size_t(b)], opt);
      benchmark::DoNotOptimize(r.last_logits.data());
    }
    be->synchronize();
  }
  state.counters["decode tok/s"] =
      benchmark::Counter(double(B) * state.iterations(), benchmark::Counter::kIsRate);
  state.counters["prefill tok/s"] = 1.0 / prefill_per_token;
  // Seconds per decode token over seconds per prefill token (both in this case).
  state.counters["decode/prefill cost"] =
      benchmark::Counter(double(B) * state.iterations() * prefill_per_token,
                         benchmark::Counter::kIsRate | benchmark::Counter::kInvert);
  state.counters["cache KiB/request"] = double(caches[0]->bytes()) / 1024.0;
}

void BM_DecodeTinyCpu(benchmark::State& s) {
  run(s, "tiny", Device::cpu);
}
void BM_DecodeMidCpu(benchmark::State& s) {
  run(s, "mid", Device::cpu);
}
void BM_DecodeTinyCuda(benchmark::State& s) {
  run(s, "tiny", Device::cuda);
}
void BM_DecodeMidCuda(benchmark::State& s) {
  run(s, "mid", Device::cuda);
}

BENCHMARK(BM_DecodeTinyCpu)
    ->ArgsProduct({{1, 8, 64}, {512, 4096}})
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime()
    ->Iterations(8);
BENCHMARK(BM_DecodeMidCpu)
    ->ArgsProduct({{1, 8}, {512}})
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime()
    ->Iterations(4);
BENCHMARK(BM_DecodeTinyCuda)
    ->ArgsProduct({{1, 8, 64}, {512, 4096}})
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime()
    ->Iterations(16);
BENCHMARK(BM_DecodeMidCuda)
    ->ArgsProduct({{1, 8, 64}, {512, 4096}})
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime()
    ->Iterations(16);

}  // namespace

BENCHMARK_MAIN();
