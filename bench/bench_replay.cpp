// Replay and diff cost on the tiny preset at T = 4096: recording a step, replaying it (same run, so
// the ratio replay / record is read directly), and diffing a train trace against a rollout trace
// (time per 1000 tokens). Run: build/bench/bench_replay
#include <benchmark/benchmark.h>
#include <unistd.h>

#include <filesystem>

#include "capture/trace_writer.h"
#include "model/forward.h"
#include "model/tokens.h"
#include "model/weights.h"
#include "replay/diff.h"
#include "replay/replay.h"

namespace {

namespace fs = std::filesystem;
constexpr int64_t kT = 4096;

const dsv4::Weights& tiny() {
  static const dsv4::Weights w = dsv4::Weights::init(dsv4::preset("tiny"), 7);
  return w;
}

std::string trace_path(const std::string& profile) {
  return (fs::temp_directory_path() / ("dsv4_bench_replay_" + std::to_string(getpid()) + "_" + profile + ".h5"))
      .string();
}

void record(const std::string& profile, const std::string& path) {
  fs::remove(path);
  dsv4::TraceWriter::Options opt;
  auto w = dsv4::TraceWriter::create(path, tiny().config(), dsv4::make_trace_header(tiny()), opt);
  dsv4::StepSpec step;
  step.profile = profile;
  step.kind = profile;
  step.seqs = {dsv4::random_tokens(kT, 512, 1)};
  dsv4::RunOptions ro;
  ro.profile = dsv4::profile_by_name(profile);
  ro.observer = &w->begin_step(step);
  w->end_step(dsv4::forward(tiny(), step.seqs, ro));
  w->close();
}

void BM_Record(benchmark::State& state) {
  for (auto _ : state) record("train", trace_path("train"));
  state.counters["tokens/s"] = benchmark::Counter(double(kT) * state.iterations(), benchmark::Counter::kIsRate);
}

void BM_Replay(benchmark::State& state) {
  const std::string path = trace_path("train");
  if (!fs::exists(path)) record("train", path);
  for (auto _ : state) {
    const auto report = dsv4::replay_trace(path, dsv4::ReplayOptions{});
    if (!report.identical()) state.SkipWithError("replay diverged");
  }
  state.counters["tokens/s"] = benchmark::Counter(double(kT) * state.iterations(), benchmark::Counter::kIsRate);
}

void BM_Diff(benchmark::State& state) {
  const std::string a = trace_path("train"), b = trace_path("rollout");
  if (!fs::exists(a)) record("train", a);
  if (!fs::exists(b)) record("rollout", b);
  for (auto _ : state) benchmark::DoNotOptimize(dsv4::diff_traces(a, b, dsv4::DiffOptions{}).tokens.size());
  state.counters["ms_per_1000_tokens"] =
      benchmark::Counter(double(kT) * double(state.iterations()) / 1e6,
                         benchmark::Counter::kIsRate | benchmark::Counter::kInvert);  // = ms per 1000 tokens
}

BENCHMARK(BM_Record)->Unit(benchmark::kMillisecond)->UseRealTime()->Iterations(2);
BENCHMARK(BM_Replay)->Unit(benchmark::kMillisecond)->UseRealTime()->Iterations(2);
BENCHMARK(BM_Diff)->Unit(benchmark::kMillisecond)->UseRealTime()->Iterations(3);

}  // namespace

BENCHMARK_MAIN();
