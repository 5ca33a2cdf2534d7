// Capture cost: the tiny preset's forward at T = 4096 without capture, with `--capture decisions`
// and with `--capture full`, in one run (compare the times directly), and the write throughput of
// `full` against a plain sequential write of the same number of bytes to the same disk.
// Run: build/bench/bench_capture
#include <benchmark/benchmark.h>
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <vector>

#include "capture/trace_writer.h"
#include "model/forward.h"
#include "model/tokens.h"
#include "model/weights.h"

namespace {

namespace fs = std::filesystem;

const dsv4::Weights& tiny() {
  static const dsv4::Weights w = dsv4::Weights::init(dsv4::preset("tiny"), 7);
  return w;
}

std::string scratch(const std::string& name) {
  return (fs::temp_directory_path() / ("dsv4_bench_" + std::to_string(getpid()) + "_" + name)).string();
}

void BM_Forward(benchmark::State& state, const char* policy) {
  const int64_t T = state.range(0);
  const auto tokens = dsv4::random_tokens(T, 512, 1);
  dsv4::RunOptions ro;
  const dsv4::TraceHeader header = dsv4::make_trace_header(tiny());
  int64_t bytes = 0;
  for (auto _ : state) {
    if (!policy) {
      auto r = dsv4::forward(tiny(), {tokens}, ro);
      benchmark::DoNotOptimize(r.seqs[0].logprobs.data());
      continue;
    }
    const std::string path = scratch("trace.h5");
    fs::remove(path);
    dsv4::TraceWriter::Options opt;
    opt.policy = dsv4::CapturePolicy::parse(policy);
    auto w = dsv4::TraceWriter::create(path, tiny().config(), header, opt);
    dsv4::StepSpec step;
    step.seqs = {tokens};
    ro.observer = &w->begin_step(step);
    auto r = dsv4::forward(tiny(), step.seqs, ro);
    w->end_step(r);
    w->close();
    ro.observer = nullptr;
    bytes = w->stats().bytes_queued;
    state.counters["trace_MB"] = double(fs::file_size(path)) / 1e6;
    state.counters["trace_B_per_token"] = double(fs::file_size(path)) / double(T);
    fs::remove(path);
  }
  state.counters["tokens/s"] =
      benchmark::Counter(double(T) * state.iterations(), benchmark::Counter::kIsRate);
  if (bytes)
    state.counters["payload_MB/s"] = benchmark::Counter(
        double(bytes) * state.iterations(), benchmark::Counter::kIsRate, benchmark::Counter::kIs1000);
}

// A plain sequential write (fwrite + fsync) of `bytes`, the ceiling for a trace writer on this disk.
void BM_PlainWrite(benchmark::State& state) {
  const int64_t bytes = state.range(0) << 20;
  std::vector<char> buf(1 << 20, 'x');
  for (auto _ : state) {
    const std::string path = scratch("plain.bin");
    FILE* f = std::fopen(path.c_str(), "wb");
    for (int64_t done = 0; done < bytes; done += int64_t(buf.size()))
      std::fwrite(buf.data(), 1, buf.size(), f);
    std::fflush(f);
    fsync(fileno(f));
    std::fclose(f);
    fs::remove(path);
  }
  state.counters["MB/s"] = benchmark::Counter(double(bytes) * state.iterations(), benchmark::Counter::kIsRate,
                                              benchmark::Counter::kIs1000);
}

BENCHMARK_CAPTURE(BM_Forward, none, nullptr)
    ->Arg(4096)
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime()
    ->Iterations(2);
BENCHMARK_CAPTURE(BM_Forward, decisions, "decisions")
    ->Arg(4096)
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime()
    ->Iterations(2);
BENCHMARK_CAPTURE(BM_Forward, full, "full")
    ->Arg(512)
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime()
    ->Iterations(2);
BENCHMARK(BM_PlainWrite)->Arg(256)->Unit(benchmark::kMillisecond)->UseRealTime()->Iterations(2);

}  // namespace

BENCHMARK_MAIN();
