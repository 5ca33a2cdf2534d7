// Importing one Flash-sized SGLang response (43 layers × 6 routing ids and 21 C4 layers × 512 indexer
// ids per token; the flash preset): a synthetic JSONL line of T tokens goes through the import's
// phases, each timed on its own and reported as a counter (seconds per phase, MB/s of the JSON text):
//
//   parse_s    sglang_parse less decode_s: the JSON around the base64 fields (nlohmann) and the request
//   decode_s   the base64 fields found in the text (their closing quotes)
//   checks_s   r3_import: the routing buffer decoded and checked; the indexer buffer decoded a row at
//              a time, every pitfall checked, C4 ordinals → layers, the rows encoded and streamed
//              into the open trace (as `dsv4 import` does)
//   write_s    ExternalTraceWriter: the rest of the sequence written, the step ended, the file sealed
//
// raw_MB is the size of the two int32 buffers, trace_MB the trace file, trace_over_raw their ratio. T
// defaults to 32768 (the size: about 1.9 GB of JSON and 1.4 GB of buffers; the process needs about 6
// GB); DSV4_BENCH_IMPORT_TOKENS=N picks another. Run: build/bench/bench_import   (quick:
// DSV4_BENCH_IMPORT_TOKENS=4096 build/bench/bench_import)
#include <benchmark/benchmark.h>
#include <nlohmann/json.hpp>

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "adapters/base64.h"
#include "adapters/r3.h"
#include "adapters/sglang.h"
#include "capture/external.h"
#include "capture/h5.h"
#include "model/config.h"

namespace {

using dsv4::ModelConfig;
using Clock = std::chrono::steady_clock;

int64_t tokens_from_env() {
  const char* s = std::getenv("DSV4_BENCH_IMPORT_TOKENS");
  return s ? std::max<int64_t>(8, std::atoll(s)) : 32768;
}

double seconds(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

struct Response {
  std::string line;
  int64_t raw_bytes = 0;
};

// A 64-bit mixer (splitmix64): the synthetic contents are seeded, so every run sees the same response.
struct Rng {
  uint64_t s;
  uint64_t next() {
    uint64_t z = (s += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  }
  int64_t below(int64_t n) { return int64_t(next() % uint64_t(n)); }
};

// A response in SGLang's layout with engine-like contents: 6 distinct random experts per row, and
// indexer rows that pick min(visible groups, index_topk) distinct visible groups (ascending, −1
// padded), each row keeping about 80% of the previous row's set the way attention top-k drifts, the
// rest drawn at random among the visible groups.
Response synthesize(const ModelConfig& c, int64_t T) {
  const int L = c.num_hidden_layers, k = c.num_experts_per_tok, E = c.n_routed_experts;
  const int n = c.num_c4_layers(), K = c.index_topk;
  const int64_t rows = T - 1;
  Rng rng{0x5eed};
  std::vector<int32_t> routed(size_t(rows * L * k));
  for (int64_t t = 0; t < rows; ++t)
    for (int l = 0; l < L; ++l) {
      int32_t* row = &routed[size_t((t * L + l) * k)];
      for (int j = 0; j < k; ++j) {
        int32_t e;
        do e = int32_t(rng.below(E));
        while (std::find(row, row + j, e) != row + j);
        row[j] = e;
      }
    }
  std::vector<int32_t> indexer(size_t(rows * n * K), -1);
  std::vector<int64_t> stamp(size_t(T / 4 + 1), -1);
  for (int o = 0; o < n; ++o) {
    std::vector<int32_t> prev, cur;
    for (int64_t t = 0; t < rows; ++t) {
      const int64_t visible = (t + 1) / 4, picks = std::min<int64_t>(visible, K);
      cur.clear();
      if (picks == visible) {
        for (int64_t g = 0; g < visible; ++g) cur.push_back(int32_t(g));
      } else {
        const int64_t mark = t * n + o;  // this row's stamp
        for (int32_t g : prev)
          if (int64_t(cur.size()) < picks && rng.below(10) < 8) {
            cur.push_back(g);
            stamp[size_t(g)] = mark;
          }
        while (int64_t(cur.size()) < picks) {
          const int64_t g = rng.below(visible);
          if (stamp[size_t(g)] == mark) continue;
          stamp[size_t(g)] = mark;
          cur.push_back(int32_t(g));
        }
        std::sort(cur.begin(), cur.end());
      }
      std::copy(cur.begin(), cur.end(), &indexer[size_t((t * n + o) * K)]);
      std::swap(prev, cur);
    }
  }
  auto b64 = [](const std::vector<int32_t>& w) {
    return dsv4::base64_encode(
        std::span<const uint8_t>(reinterpret_cast<const uint8_t*>(w.data()), w.size() * 4));
  };
  Response r;
  r.raw_bytes = int64_t(routed.size() + indexer.size()) * 4;
  nlohmann::json j;
  std::vector<int32_t> ids(static_cast<size_t>(T));
  for (int64_t t = 0; t < T; ++t) ids[size_t(t)] = int32_t((t * 7919) % c.vocab_size);
  const int64_t P = T / 4;
  j["input_ids"] = std::vector<int32_t>(ids.begin(), ids.begin() + P);
  j["output_ids"] = std::vector<int32_t>(ids.begin() + P, ids.end());
  j["meta_info"] = {{"id", "bench"}, {"prompt_tokens", P}, {"completion_tokens", T - P}};
  j["meta_info"]["routed_experts"] = b64(routed);
  routed = {};
  j["meta_info"]["indexer_topk"] = b64(indexer);
  indexer = {};
  j["meta_info"]["indexer_topk_num_layers"] = n;
  r.line = j.dump();
  return r;
}

void BM_ImportSglangFlash(benchmark::State& state) {
  const ModelConfig c = dsv4::preset("flash");
  const int64_t T = tokens_from_env();
  const Response resp = synthesize(c, T);
  if (const char* save =
          std::getenv("DSV4_BENCH_IMPORT_SAVE")) {  // the response as a JSONL file, for `dsv4 import`
    std::ofstream(save, std::ios::binary) << resp.line << '\n';
    state.SkipWithError("saved the response; nothing timed");
    for (auto _ : state) {
    }
    return;
  }
  const std::string trace =
      (std::filesystem::temp_directory_path() / ("dsv4_bench_import_" + std::to_string(getpid()) + ".h5"))
          .string();
  dsv4::h5::encode_on_all_cores(true);  // as dsv4 import does
  dsv4::ExternalModel model;
  model.config_json = dsv4::config_to_json(c);
  double parse = 0, decode = 0, checks = 0, write = 0;
  int64_t trace_bytes = 0;
  for (auto _ : state) {
    // As `dsv4 import` runs: the writer's step is open while the request is checked, so the indexer
    // rows stream into it (checks_s includes their encoding and writing); write_s is the rest.
    std::filesystem::remove(trace);
    auto w = dsv4::ExternalTraceWriter::create(trace, model);
    dsv4::ExternalStepSpec spec;
    spec.engine = "sglang";
    spec.source = "bench.jsonl";
    w->begin_step(spec);
    auto t0 = Clock::now();
    std::vector<std::string> notes;
    dsv4::SglangTimes times;
    dsv4::R3Request q = dsv4::sglang_parse(resp.line, dsv4::R3Origin{"bench.jsonl:1", "", 0}, notes, &times);
    // The base64 fields are found in the text (decode_s: they are decoded a row at a time by the
    // checks); the JSON around them is parsed (parse_s, with the request's own checks).
    decode += times.decode_s;
    parse += seconds(t0) - times.decode_s;
    t0 = Clock::now();
    dsv4::ExternalSequence s = dsv4::r3_import(c, std::move(q), nullptr, notes, [&](int64_t T, int n) {
      return w->stream_indexer_layers(T, n, true);
    });
    checks += seconds(t0);
    t0 = Clock::now();
    w->add_sequence(s);
    s = {};
    w->end_step();
    w->close();
    write += seconds(t0);
    trace_bytes = int64_t(std::filesystem::file_size(trace));
  }
  std::filesystem::remove(trace);
  const double it = double(state.iterations());
  state.counters["tokens"] = double(T);
  state.counters["json_MB"] = resp.line.size() / 1e6;
  state.counters["raw_MB"] = resp.raw_bytes / 1e6;
  state.counters["parse_s"] = parse / it;
  state.counters["decode_s"] = decode / it;
  state.counters["checks_s"] = checks / it;
  state.counters["write_s"] = write / it;
  state.counters["total_s"] = (parse + decode + checks + write) / it;
  state.counters["json_MB_per_s"] = resp.line.size() / 1e6 / ((parse + decode + checks + write) / it);
  state.counters["trace_MB"] = trace_bytes / 1e6;
  state.counters["trace_over_raw"] = double(trace_bytes) / double(resp.raw_bytes);
}
BENCHMARK(BM_ImportSglangFlash)->Unit(benchmark::kMillisecond)->Iterations(1)->UseRealTime();

}  // namespace

BENCHMARK_MAIN();
