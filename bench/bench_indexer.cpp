// CPU lightning-indexer top-k: dsv4::indexer_topk (the q.k dot products of a chunk of query rows as
// one GEMM, then the head chain and the selection) against the row-by-row form it replaced (one
// dot() per query, head and key, measured here as the baseline in the same run). Both give the same
// bits; the setup checks that before timing.
// Run: build/bench/bench_indexer
#include <benchmark/benchmark.h>

#include <algorithm>
#include <limits>
#include <random>
#include <vector>

#include "kernels/detail/indexer.h"
#include "kernels/indexer.h"
#include "kernels/numerics/numerics.h"

namespace {

struct Problem {
  std::vector<float> qi, ki, wt, margin;
  std::vector<int32_t> ids;
  dsv4::IndexerParams p;
  Problem(int64_t T, int Hi, int64_t Di, int k, int block) {
    std::mt19937 g(7);
    std::normal_distribution<float> d(0.0f, 1.0f);
    p.T = T, p.Hi = Hi, p.Di = Di, p.ratio = 4, p.G = T / 4, p.k = k, p.order.block = block;
    qi.resize(size_t(T * Hi * Di)), ki.resize(size_t(p.G * Di)), wt.resize(size_t(T * Hi));
    for (auto& v : qi) v = dsv4::num::bf16_round(d(g));
    for (auto& v : ki) v = dsv4::num::bf16_round(d(g));
    for (auto& v : wt) v = d(g) * 0.01f;
    ids.resize(size_t(T * k)), margin.resize(size_t(T));
    p.qi = qi.data(), p.ki = ki.data(), p.wt = wt.data(), p.ids = ids.data(), p.margin = margin.data();
  }
};

// The previous CPU form: every score as Hi dot() calls, row by row.
void indexer_rowwise(const dsv4::IndexerParams& p) {
#pragma omp parallel
  {
    std::vector<float> row(static_cast<size_t>(p.G));
    std::vector<int32_t> scratch(static_cast<size_t>(p.G));
#pragma omp for schedule(static)
    for (int64_t t = 0; t < p.T; ++t) {
      const int64_t n = dsv4::common::visible_groups(p.G, t, p.ratio);
      for (int64_t g = 0; g < n; ++g) {
        float s = 0.0f;
        for (int h = 0; h < p.Hi; ++h)
          s = dsv4::common::index_score_step(
              s, p.wt[t * p.Hi + h], dsv4::dot(p.qi + (t * p.Hi + h) * p.Di, p.ki + g * p.Di, p.Di, p.order),
              p.bf16_scores);
        row[size_t(g)] = dsv4::common::index_score_final(s, p.bf16_scores);
      }
      const int kk = int(std::min<int64_t>(p.k, n));
      int32_t* ids = p.ids + t * p.k;
      p.margin[t] = dsv4::topk_row(row.data(), n, kk, ids, scratch.data());
      for (int j = kk; j < p.k; ++j) ids[j] = -1;
    }
  }
}

void run(benchmark::State& state, bool rowwise) {
  Problem pr(state.range(0), int(state.range(1)), state.range(2), 64, int(state.range(3)));
  // Same bits first: the baseline must compute what it stands in for.
  Problem check = pr;
  check.p.ids = check.ids.data(), check.p.margin = check.margin.data();
  indexer_rowwise(check.p);
  dsv4::indexer_topk(pr.p);
  if (check.ids != pr.ids || check.margin != pr.margin) {
    state.SkipWithError("indexer_topk and the row-wise baseline differ");
    return;
  }
  for (auto _ : state) {
    if (rowwise)
      indexer_rowwise(pr.p);
    else
      dsv4::indexer_topk(pr.p);
    benchmark::DoNotOptimize(pr.ids.data());
  }
  const double T = double(pr.p.T), G = double(pr.p.G);
  // Causal: row t scores about t / 4 keys.
  state.counters["GFLOP/s"] = benchmark::Counter(T * G / 2 * pr.p.Hi * pr.p.Di * 2 * state.iterations(),
                                                 benchmark::Counter::kIsRate, benchmark::Counter::kIs1000);
}

void BM_IndexerTopk(benchmark::State& s) {
  run(s, false);
}
void BM_IndexerRowwise(benchmark::State& s) {
  run(s, true);
}

// T, Hi, Di, block: the mid preset's indexer (4 heads of 128) in both orders and a Flash-like one (64 heads
// of 128).
#define DSV4_INDEXER_ARGS             \
  ->Args({4096, 4, 128, 0})           \
      ->Args({4096, 4, 128, 64})      \
      ->Args({2048, 64, 128, 0})      \
      ->Unit(benchmark::kMillisecond) \
      ->UseRealTime()
BENCHMARK(BM_IndexerTopk) DSV4_INDEXER_ARGS;
BENCHMARK(BM_IndexerRowwise) DSV4_INDEXER_ARGS;

}  // namespace

BENCHMARK_MAIN();
