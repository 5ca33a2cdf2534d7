// Training step against forward time (docs/TRAINING.md): one sample of T tokens (half prompt, half
// response), the whole step (training forward with its tape, policy loss, backward, AdamW) timed
// against a plain forward of the same tokens in the same run, and the overhead of recording the
// activation gradients' row digests. Run: build/bench/bench_train [--benchmark_filter=...]
// Ratios: step / forward of the same preset, T and threads; digests / step; indexer KL / step.
#include <benchmark/benchmark.h>

#include "model/device.h"
#include "model/forward.h"
#include "model/tokens.h"
#include "model/weights.h"
#include "train/record.h"
#include "train/step.h"

namespace {

const dsv4::Weights& model(const std::string& name) {
  static const dsv4::Weights tiny = dsv4::Weights::init(dsv4::preset("tiny"), 7);
  if (name == "tiny") return tiny;
  static const dsv4::Weights mid = dsv4::Weights::init(dsv4::preset("mid"), 7);
  return mid;
}

dsv4::train::TrainSample sample(int64_t T, int vocab) {
  const auto tokens = dsv4::random_tokens(T, vocab, 1);
  dsv4::train::TrainSample s;
  s.id = "bench";
  s.prompt.assign(tokens.begin(), tokens.begin() + T / 2);
  s.response.assign(tokens.begin() + T / 2, tokens.end());
  s.advantage = 1.0;
  return s;
}

void forward_case(benchmark::State& state, const std::string& preset, dsv4::Device dev = dsv4::Device::cpu) {
  if (dev == dsv4::Device::cuda && !dsv4::cuda_device_available()) {
    state.SkipWithError("no CUDA device");
    return;
  }
  const int64_t T = state.range(0);
  const dsv4::Weights& w = model(preset);
  const auto s = sample(T, w.config().vocab_size);
  dsv4::RunOptions opt;
  opt.threads = int(state.range(1));
  opt.device = dev;
  for (auto _ : state) {
    auto r = dsv4::forward(w, {s.tokens()}, opt);
    benchmark::DoNotOptimize(r.seqs[0].logprobs.data());
  }
  state.counters["tokens/s"] = benchmark::Counter(double(T) * state.iterations(), benchmark::Counter::kIsRate);
}

void step_case(benchmark::State& state, const std::string& preset, bool digests,
               dsv4::Device dev = dsv4::Device::cpu, bool indexer_kl = false) {
  if (dev == dsv4::Device::cuda && !dsv4::cuda_device_available()) {
    state.SkipWithError("no CUDA device");
    return;
  }
  const int64_t T = state.range(0);
  const dsv4::Weights& w = model(preset);
  const auto s = sample(T, w.config().vocab_size);
  dsv4::train::TrainStepOptions o;
  o.threads = int(state.range(1));
  o.device = dev;
  if (indexer_kl) {  // the indexer's KL objective on, the indexer trained by it
    o.indexer_kl_coeff = 1.0;
    o.groups.trained.insert(dsv4::train::ParamGroup::indexer);
  }
  int64_t tape = 0;
  for (auto _ : state) {
    dsv4::train::OptimizerState st = dsv4::train::fresh_optimizer_state(w, o.groups);
    dsv4::train::TrainStepHooks h;
    dsv4::train::ActGradCollector collect;
    if (digests) h.on_grad = [&](const dsv4::GradRecord& g) { collect(g); };
    dsv4::Weights after = w;
    auto r = dsv4::train::train_step(w, {s}, st, o, h, &after);
    tape = r.tape_bytes_max;
    benchmark::DoNotOptimize(r.grads.size());
  }
  state.counters["tokens/s"] = benchmark::Counter(double(T) * state.iterations(), benchmark::Counter::kIsRate);
  state.counters["tape_MiB"] = double(tape) / double(1 << 20);
}

void BM_TinyForward(benchmark::State& s) { forward_case(s, "tiny"); }
void BM_TinyStep(benchmark::State& s) { step_case(s, "tiny", false); }
void BM_TinyStepDigests(benchmark::State& s) { step_case(s, "tiny", true); }
void BM_TinyStepIndexerKl(benchmark::State& s) { step_case(s, "tiny", false, dsv4::Device::cpu, true); }
void BM_MidForward(benchmark::State& s) { forward_case(s, "mid"); }
void BM_MidStep(benchmark::State& s) { step_case(s, "mid", false); }
void BM_MidStepDigests(benchmark::State& s) { step_case(s, "mid", true); }

#define DSV4_TRAIN_BENCH(fn, sizes) \
  BENCHMARK(fn)->ArgsProduct({sizes, {2}})->Unit(benchmark::kMillisecond)->UseRealTime()->Iterations(1)

// The H200 (scripts/gpu-train-check.sh): the same cases on the CUDA backend, mid at T = 4096.
void BM_TinyForwardCuda(benchmark::State& s) { forward_case(s, "tiny", dsv4::Device::cuda); }
void BM_TinyStepCuda(benchmark::State& s) { step_case(s, "tiny", false, dsv4::Device::cuda); }
void BM_TinyStepDigestsCuda(benchmark::State& s) { step_case(s, "tiny", true, dsv4::Device::cuda); }
void BM_MidForwardCuda(benchmark::State& s) { forward_case(s, "mid", dsv4::Device::cuda); }
void BM_MidStepCuda(benchmark::State& s) { step_case(s, "mid", false, dsv4::Device::cuda); }
void BM_MidStepDigestsCuda(benchmark::State& s) { step_case(s, "mid", true, dsv4::Device::cuda); }
void BM_TinyStepIndexerKlCuda(benchmark::State& s) { step_case(s, "tiny", false, dsv4::Device::cuda, true); }
void BM_MidStepIndexerKlCuda(benchmark::State& s) { step_case(s, "mid", false, dsv4::Device::cuda, true); }

DSV4_TRAIN_BENCH(BM_TinyForwardCuda, {4096});
DSV4_TRAIN_BENCH(BM_TinyStepCuda, {4096});
DSV4_TRAIN_BENCH(BM_TinyStepDigestsCuda, {4096});
DSV4_TRAIN_BENCH(BM_MidForwardCuda, {4096});
DSV4_TRAIN_BENCH(BM_MidStepCuda, {4096});
DSV4_TRAIN_BENCH(BM_MidStepDigestsCuda, {4096});
DSV4_TRAIN_BENCH(BM_TinyStepIndexerKlCuda, {4096});
DSV4_TRAIN_BENCH(BM_MidStepIndexerKlCuda, {4096});

DSV4_TRAIN_BENCH(BM_TinyForward, {4096});
DSV4_TRAIN_BENCH(BM_TinyStep, {4096});
DSV4_TRAIN_BENCH(BM_TinyStepDigests, {4096});
DSV4_TRAIN_BENCH(BM_TinyStepIndexerKl, {4096});
DSV4_TRAIN_BENCH(BM_MidForward, {1024});
DSV4_TRAIN_BENCH(BM_MidStep, {1024});
DSV4_TRAIN_BENCH(BM_MidStepDigests, {1024});

}  // namespace

BENCHMARK_MAIN();
