// The cost of a trace's seal (capture/trace_seal.h) against reading the same file: check_seal (what
// every command does once per file it opens) and seal_trace (what a recorder does at its close), over
// a 256 MiB file in the page cache. The baseline reads the file in the same 1 MiB
// blocks without hashing; the ratio is the seal's price over the read a reader of the whole file pays.
//   build/bench/bench_seal [--benchmark_filter=...]
#include <benchmark/benchmark.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <random>
#include <string>
#include <vector>

#include "capture/h5.h"
#include "capture/trace_seal.h"

namespace {

constexpr size_t kMiB = size_t(1) << 20;

// A file shaped like a trace: a blank 512-byte user block, HDF5's signature, then random bytes.
const std::string& big_file() {
  static const std::string path = [] {
    const std::string p = (std::filesystem::temp_directory_path() / ("dsv4_bench_seal_" + std::to_string(getpid()) + ".h5")).string();
    std::vector<unsigned char> block(kMiB);
    std::mt19937_64 rng(5);
    FILE* f = std::fopen(p.c_str(), "wb");
    if (!f) std::abort();
    for (size_t i = 0; i < 256; ++i) {
      for (size_t j = 0; j < block.size(); j += 8) {
        const uint64_t v = rng();
        std::memcpy(&block[j], &v, 8);
      }
      if (i == 0) {
        std::memset(block.data(), 0, dsv4::kSealBlockBytes);
        std::memcpy(block.data() + dsv4::kSealBlockBytes, dsv4::h5::kSignature, 8);
      }
      std::fwrite(block.data(), 1, block.size(), f);
    }
    std::fclose(f);
    dsv4::seal_trace(p);
    std::atexit([] { std::filesystem::remove(path); });
    return p;
  }();
  return path;
}

void BM_ReadFile(benchmark::State& state) {
  const std::string& p = big_file();
  std::vector<unsigned char> buf(kMiB);
  for (auto _ : state) {
    const int fd = ::open(p.c_str(), O_RDONLY);
    size_t total = 0;
    for (;;) {
      const ssize_t n = ::read(fd, buf.data(), buf.size());
      if (n <= 0) break;
      total += size_t(n);
    }
    ::close(fd);
    benchmark::DoNotOptimize(total);
  }
  state.SetBytesProcessed(int64_t(state.iterations()) * int64_t(std::filesystem::file_size(p)));
}
BENCHMARK(BM_ReadFile)->Unit(benchmark::kMillisecond);

// The seal's hash alone (hash_file_range) on 1 to 8 threads; Arg 0: the sequential path (libxxhash's
// streaming XXH3 over 256 KiB reads, ranges of 16 MiB, under the parallel path's threshold), the baseline.
void BM_HashFile(benchmark::State& state) {
  const std::string& p = big_file();
  const int fd = ::open(p.c_str(), O_RDONLY);
  const uint64_t size = std::filesystem::file_size(p);
  const int threads = int(state.range(0));
  for (auto _ : state) {
    if (threads == 0) {
      const uint64_t part = 16 * kMiB;
      for (uint64_t at = 0; at < size; at += part)
        benchmark::DoNotOptimize(dsv4::hash_file_range(fd, p, at, std::min(size, at + part), 1));
    } else {
      benchmark::DoNotOptimize(dsv4::hash_file_range(fd, p, 0, size, threads));
    }
  }
  ::close(fd);
  state.SetBytesProcessed(int64_t(state.iterations()) * int64_t(size));
}
BENCHMARK(BM_HashFile)->Arg(0)->Arg(1)->Arg(2)->Arg(4)->Arg(8)->Unit(benchmark::kMillisecond)->UseRealTime();

void BM_CheckSeal(benchmark::State& state) {
  const std::string& p = big_file();
  for (auto _ : state) {
    state.PauseTiming();
    ::utimensat(AT_FDCWD, p.c_str(), nullptr, 0);  // new times: not the remembered result
    state.ResumeTiming();
    const dsv4::SealCheck c = dsv4::check_seal(p);
    if (c.state != dsv4::SealCheck::State::verified) state.SkipWithError("the seal does not verify");
  }
  state.SetBytesProcessed(int64_t(state.iterations()) * int64_t(std::filesystem::file_size(p)));
}
BENCHMARK(BM_CheckSeal)->Unit(benchmark::kMillisecond);

void BM_SealTrace(benchmark::State& state) {
  const std::string& p = big_file();
  for (auto _ : state) dsv4::seal_trace(p);
  state.SetBytesProcessed(int64_t(state.iterations()) * int64_t(std::filesystem::file_size(p)));
}
BENCHMARK(BM_SealTrace)->Unit(benchmark::kMillisecond);

// The seal at a recorder's close (seal_trace with the writer's SealHasher): the hasher was told of
// every write of the file, so the digest reads back only the header's block and the tail and chains
// the blocks' sums it formed from the writes (262,143 blocks here). Against BM_SealTrace, which reads
// and hashes the whole file.
void BM_SealTraceTold(benchmark::State& state) {
  const std::string& p = big_file();
  dsv4::SealHasher told;
  {
    const int fd = ::open(p.c_str(), O_RDONLY);
    std::vector<unsigned char> buf(kMiB);
    for (uint64_t at = 0;; at += buf.size()) {
      const ssize_t n = ::pread(fd, buf.data(), buf.size(), off_t(at));
      if (n <= 0) break;
      told.wrote(at, buf.data(), size_t(n));
    }
    ::close(fd);
  }
  for (auto _ : state) {
    const dsv4::SealTimes t = dsv4::seal_trace(p, &told);
    state.counters["hash_ms"] = t.hash_seconds * 1e3;
    state.counters["read_KB"] = double(t.bytes_read) * 1e-3;
  }
  state.SetBytesProcessed(int64_t(state.iterations()) * int64_t(std::filesystem::file_size(p)));
}
BENCHMARK(BM_SealTraceTold)->Unit(benchmark::kMillisecond);

}  // namespace

BENCHMARK_MAIN();
