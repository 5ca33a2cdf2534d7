// gemm() vs gemm_reference() (one canonical dot per element) at typical layer shapes, 1 and 2
// threads. The GFLOP/s counter counts 2·m·n·k flops per call.
#include <benchmark/benchmark.h>
#include <omp.h>

#include <random>
#include <vector>

#include "kernels/linear.h"

namespace {

using dsv4::GemmParams;

struct Problem {
  std::vector<float> x, w, y;
  GemmParams p;
  Problem(int64_t m, int64_t n, int64_t k) : x(size_t(m * k)), w(size_t(n * k)), y(size_t(m * n)) {
    std::mt19937 g(42);
    std::normal_distribution<float> d(0.0f, 1.0f);
    for (auto& v : x) v = d(g);
    for (auto& v : w) v = d(g);
    p.m = m;
    p.n = n;
    p.k = k;
    p.x = x.data();
    p.ldx = k;
    p.w = w.data();
    p.ldw = k;
    p.y = y.data();
    p.ldy = n;
    p.round = dsv4::OutRound::bf16;
  }
};

template <void (*Fn)(const GemmParams&)>
void BM_Gemm(benchmark::State& state) {
  const int64_t m = state.range(0), n = state.range(1), k = state.range(2);
  const int threads = int(state.range(3));
  const int saved = omp_get_max_threads();
  omp_set_num_threads(threads);
  Problem pr(m, n, k);
  for (auto _ : state) {
    Fn(pr.p);
    benchmark::DoNotOptimize(pr.y.data());
    benchmark::ClobberMemory();
  }
  state.counters["GFLOP/s"] = benchmark::Counter(2.0 * double(m) * double(n) * double(k) * 1e-9,
                                                 benchmark::Counter::kIsIterationInvariantRate);
  omp_set_num_threads(saved);
}

void Shapes(benchmark::internal::Benchmark* b) {
  b->ArgNames({"m", "n", "k", "threads"});
  for (int threads : {1, 2}) {
    b->Args({512, 1024, 1024, threads});
    b->Args({4096, 256, 256, threads});
  }
  b->UseRealTime()->Unit(benchmark::kMillisecond);
}

void RefShapes(benchmark::internal::Benchmark* b) {
  b->ArgNames({"m", "n", "k", "threads"});
  b->Args({512, 1024, 1024, 1});
  b->Args({4096, 256, 256, 1});
  b->UseRealTime()->Unit(benchmark::kMillisecond);
}

BENCHMARK(BM_Gemm<dsv4::gemm>)->Name("gemm")->Apply(Shapes);
// The reference is single-threaded by definition.
BENCHMARK(BM_Gemm<dsv4::gemm_reference>)->Name("gemm_reference")->Apply(RefShapes);

}  // namespace

BENCHMARK_MAIN();
