// Capture cost: the tiny preset's forward at T = 4096 without capture, with `--capture decisions`
// and with `--capture full`, in one run (compare the times directly), a generation with and without
// its recording, and the write throughput of `full` against a plain sequential write of the same
// number of bytes to the same disk.
//
// With a CUDA device (a DSV4_CUDA build) the same three cases also run on the GPU with the mid preset
// (hidden 1024, 8 layers), at T = 4096 (`full` at T = 512, like on the CPU): row digests are computed
// on the device, so `decisions` moves 8 bytes per tensor row to the host while `full` downloads and
// writes every tensor.
// Run: build/bench/bench_capture [--dsv4_gaps] [Google Benchmark flags]; --dsv4_gaps lists, for each
// GPU forward case, the compute stream's longest waits and the kernels by time (compute_stream_idle),
// and for a case with reports also the report kernels by time and the model's kernels that ran
// longest beside them against the forward without reports (run BM_ForwardCuda/none in the same call).
#include <benchmark/benchmark.h>
#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <map>
#include <string>
#include <tuple>
#include <vector>

#include "capture/cupti.h"
#include "capture/digest.h"
#include "capture/trace_writer.h"
#include "model/device.h"
#include "model/forward.h"
#include "model/tokens.h"
#include "model/weights.h"
#include "replay/generation.h"
#include "rollout/engine.h"

namespace {

namespace fs = std::filesystem;

const dsv4::Weights& tiny() {
  static const dsv4::Weights w = dsv4::Weights::init(dsv4::preset("tiny"), 7);
  return w;
}
const dsv4::Weights& mid() {
  static const dsv4::Weights w = dsv4::Weights::init(dsv4::preset("mid"), 7);
  return w;
}

std::string scratch(const std::string& name) {
  return (fs::temp_directory_path() / ("dsv4_bench_" + std::to_string(getpid()) + "_" + name)).string();
}

void run_forward(benchmark::State& state, const dsv4::Weights& model, dsv4::Device device,
                 const char* policy) {
  const int64_t T = state.range(0);
  const auto tokens = dsv4::random_tokens(T, model.config().vocab_size, 1);
  dsv4::RunOptions ro;
  ro.device = device;
  const dsv4::TraceHeader header = dsv4::make_trace_header(model);
  if (device != dsv4::Device::cpu) dsv4::forward(model, {tokens}, ro);  // uploads the weights, warms up
  int64_t bytes = 0;
  for (auto _ : state) {
    if (!policy) {
      auto r = dsv4::forward(model, {tokens}, ro);
      benchmark::DoNotOptimize(r.seqs[0].logprobs.data());
      continue;
    }
    const std::string path = scratch("trace.h5");
    fs::remove(path);
    dsv4::TraceWriter::Options opt;
    opt.policy = dsv4::CapturePolicy::parse(policy);
    auto w = dsv4::TraceWriter::create(path, model.config(), header, opt);
    dsv4::StepSpec step;
    step.seqs = {tokens};
    ro.observer = &w->begin_step(step);
    auto r = dsv4::forward(model, step.seqs, ro);
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

// The observation points alone: an observer that takes every call and keeps nothing, so the time
// over the uncaptured forward is what reporting costs the compute stream (the digests computed and
// every decision and digest downloaded where it is reported), without any trace writing.
// With `late`, the observer takes its reports late (Observer::deferrable): the digests and decisions
// come down on the copy stream and nothing waits for them until the forward's end.
class NullObserver final : public dsv4::Observer {
 public:
  explicit NullObserver(bool late) : late_(late) {}
  bool deferrable() const override { return late_; }
  bool wants_values(std::string_view, int) const override { return false; }

 private:
  bool late_;
};

bool g_print_gaps = false;  // --dsv4_gaps: list the compute stream's longest waits and the kernels' times

// When the compute stream (the stream of most model kernels) sits idle between two of its kernels
// in one more forward, and why, from CUPTI's kernel records and their launch calls' host times:
// idle_ms sums the gaps; idle_host_ms is their part before the next kernel's launch call began (the
// GPU waiting for the host); idle_wait_ms the part after it, in gaps whose part exceeds 10 us (the
// stream waiting for an event, such as a free waiting for the digests still reading the buffer); the
// rest is launch latency between dependent kernels. The runtime records cost every call host time, so
// the host part is an upper bound. Copies on the stream (not recorded) count as idle.
void compute_stream_idle(benchmark::State& state, const std::vector<int32_t>& tokens,
                         const dsv4::RunOptions& ro, const char* what) {
  dsv4::KernelRecorder rec;
  if (!rec.start(dsv4::KernelRecorder::LaunchTimes::on)) return;
  dsv4::forward(mid(), {tokens}, ro);
  const dsv4::KernelRecords k = rec.stop();
  if (!k.available || k.kernels.empty()) return;
  std::map<int64_t, int> per_stream;
  for (const dsv4::KernelRecord& r : k.kernels)
    if (!dsv4::is_report_kernel(r)) ++per_stream[r.stream];
  const int64_t stream = std::max_element(per_stream.begin(), per_stream.end(), [](auto& a, auto& b) {
                           return a.second < b.second;
                         })->first;
  std::vector<const dsv4::KernelRecord*> s;
  for (const dsv4::KernelRecord& r : k.kernels)
    if (r.stream == stream) s.push_back(&r);
  std::sort(s.begin(), s.end(), [](auto* a, auto* b) { return a->start_ns < b->start_ns; });
  constexpr int64_t kWaitNs = 10'000;
  int64_t idle = 0, host = 0, wait = 0;
  std::vector<std::tuple<int64_t, const dsv4::KernelRecord*, const dsv4::KernelRecord*>> waits;
  for (size_t i = 1; i < s.size(); ++i) {
    const int64_t gap = s[i]->start_ns - s[i - 1]->end_ns;
    if (gap <= 0) continue;
    const int64_t h =
        s[i]->launch_start_ns ? std::clamp(s[i]->launch_start_ns - s[i - 1]->end_ns, int64_t(0), gap) : 0;
    idle += gap, host += h;
    if (gap - h > kWaitNs) wait += gap - h, waits.push_back({gap - h, s[i - 1], s[i]});
  }
  state.counters["idle_ms"] = double(idle) * 1e-6;
  state.counters["idle_host_ms"] = double(host) * 1e-6;
  state.counters["idle_wait_ms"] = double(wait) * 1e-6;
  if (!g_print_gaps) return;
  std::sort(waits.begin(), waits.end(), [](auto& a, auto& b) { return std::get<0>(a) > std::get<0>(b); });
  std::fprintf(stderr, "%s, T = %zu: %zu waits over 10 us on the compute stream, %.3f ms; the longest:\n",
               what, tokens.size(), waits.size(), double(wait) * 1e-6);
  for (size_t i = 0; i < std::min<size_t>(waits.size(), 12); ++i) {
    const auto& [ns, before, after] = waits[i];
    std::fprintf(stderr, "  %8.1f us  after %.60s\n              before %.60s\n", double(ns) * 1e-3,
                 before->name.c_str(), after->name.c_str());
  }
  // Every stream's kernels by name (without namespaces and parameters): ns, launches. A report
  // kernel's name carries its grid and block, which tell the report's rows apart.
  std::map<std::string, std::pair<int64_t, int>> by_name;
  for (const dsv4::KernelRecord& r : k.kernels) {
    std::string name = r.name;
    for (size_t at; (at = name.find("(anonymous namespace)::")) != std::string::npos;) name.erase(at, 23);
    name = name.substr(0, name.find('('));
    if (const size_t at = name.rfind("::", name.find('<')); at != std::string::npos) name.erase(0, at + 2);
    if (dsv4::is_report_kernel(r))
      name = fmt::format("[report] {} <<<{}, {}>>>", name, r.grid[0], r.block[0]);
    auto& [ns, n] = by_name[name];
    ns += r.end_ns - r.start_ns, ++n;
  }
  using Row = std::pair<std::string, std::pair<int64_t, int>>;
  const auto print_top = [](const char* title, std::vector<Row> rows, size_t n) {
    std::sort(rows.begin(), rows.end(), [](auto& a, auto& b) { return a.second.first > b.second.first; });
    std::fprintf(stderr, "  %s:\n", title);
    for (size_t i = 0; i < std::min(rows.size(), n); ++i)
      std::fprintf(stderr, "  %8.3f ms %5d x  %.100s\n", double(rows[i].second.first) * 1e-6,
                   rows[i].second.second, rows[i].first.c_str());
  };
  print_top("kernels by time", {by_name.begin(), by_name.end()}, 16);
  std::vector<Row> reports;
  std::copy_if(by_name.begin(), by_name.end(), std::back_inserter(reports),
               [](const Row& r) { return r.first.starts_with("[report]"); });
  if (!reports.empty()) print_top("report kernels by time", reports, 24);
  // The model's kernels of the forward without reports, kept to show which ones the reports slow down.
  static std::map<std::string, std::pair<int64_t, int>> alone;
  if (reports.empty() && alone.empty()) alone = by_name;
  if (reports.empty() || alone.empty()) return;
  std::vector<Row> slower;  // name, (ns more than alone, launches)
  for (const auto& [name, v] : by_name)
    if (const auto it = alone.find(name); it != alone.end() && !name.starts_with("[report]"))
      slower.push_back({name, {v.first - it->second.first, v.second}});
  int64_t total = 0;
  for (const Row& r : slower) total += r.second.first;
  std::fprintf(stderr, "  the model's kernels took %.3f ms more than in the forward without reports\n",
               double(total) * 1e-6);
  print_top("model kernels slowed most beside the reports (ms more)", slower, 16);
}

// Where a forward's GPU time goes, from CUPTI's kernel records of one more forward: the kernels' summed
// time, the report kernels' share (capture/cupti.h is_report_kernel) and the time from the first
// kernel's start to the last one's end. Wall time above that span is host time before the first
// kernel and after the last (lead_ms, after_last_ms); the span above the summed kernel time is the GPU
// waiting between kernels.
// The report kernels may run beside the model's (the digests have a stream of their own):
// model_busy_ms is the time some model kernel runs, report_alone_ms the time only report kernels run,
// report_tail_ms the part of it after the model's last kernel.
void kernel_counters(benchmark::State& state, const std::vector<int32_t>& tokens, const dsv4::RunOptions& ro,
                     const char* what) {
  dsv4::KernelRecorder rec;
  if (!rec.start()) return;
  const int64_t called = dsv4::KernelRecorder::now_ns();
  dsv4::forward(mid(), {tokens}, ro);
  const int64_t returned = dsv4::KernelRecorder::now_ns();
  const dsv4::KernelRecords k = rec.stop();
  if (!k.available || k.kernels.empty()) return;
  double all = 0, report = 0;
  int64_t first = k.kernels.front().start_ns, last = k.kernels.front().end_ns, reports = 0;
  int64_t last_model = 0;                      // the last model kernel's end
  std::vector<std::pair<int64_t, int>> edges;  // (time, +1/-1 model, +2/-2 report)
  for (const dsv4::KernelRecord& r : k.kernels) {
    const double ms = double(r.end_ns - r.start_ns) * 1e-6;
    all += ms;
    const bool rep = dsv4::is_report_kernel(r);
    if (rep) report += ms, ++reports;
    if (!rep) last_model = std::max(last_model, r.end_ns);
    first = std::min(first, r.start_ns), last = std::max(last, r.end_ns);
    edges.push_back({r.start_ns, rep ? 2 : 1});
    edges.push_back({r.end_ns, rep ? -2 : -1});
  }
  std::sort(edges.begin(), edges.end());
  int64_t model_busy = 0, report_alone = 0, prev = edges.front().first;
  int models = 0, reps = 0;
  for (const auto& [t, e] : edges) {
    if (models > 0) model_busy += t - prev;
    if (models == 0 && reps > 0) report_alone += t - prev;
    prev = t;
    if (e == 1 || e == -1)
      models += e;
    else
      reps += e / 2;
  }
  state.counters["kernels_ms"] = all;
  state.counters["model_busy_ms"] = double(model_busy) * 1e-6;
  state.counters["report_alone_ms"] = double(report_alone) * 1e-6;
  state.counters["report_kernels_ms"] = report;
  state.counters["span_ms"] = double(last - first) * 1e-6;
  // The report kernels after the model's last.
  state.counters["report_tail_ms"] = double(last - last_model) * 1e-6;
  // The host's part of the wall time: from the call to the first kernel's start (the forward's set-up
  // and its first launches), and from the last kernel's end to the return (the last downloads and the
  // reports handed on; after the model's last kernel: this plus report_tail_ms).
  if (called > 0 && returned > 0) {
    state.counters["lead_ms"] = double(first - called) * 1e-6;
    state.counters["after_last_ms"] = double(returned - last) * 1e-6;
  }
  state.counters["launches"] = double(k.kernels.size());
  state.counters["report_launches"] = double(reports);
  compute_stream_idle(state, tokens, ro, what);
}

void BM_ForwardCudaObserved(benchmark::State& state, bool late) {
  const int64_t T = state.range(0);
  const auto tokens = dsv4::random_tokens(T, mid().config().vocab_size, 1);
  dsv4::RunOptions ro;
  ro.device = dsv4::Device::cuda;
  dsv4::forward(mid(), {tokens}, ro);
  NullObserver null(late);
  ro.observer = &null;
  for (auto _ : state) {
    auto r = dsv4::forward(mid(), {tokens}, ro);
    benchmark::DoNotOptimize(r.seqs[0].logprobs.data());
  }
  state.counters["tokens/s"] =
      benchmark::Counter(double(T) * state.iterations(), benchmark::Counter::kIsRate);
  kernel_counters(state, tokens, ro, late ? "forward, late reports" : "forward, reports at once");
}

// Where a trace's close went (the last iteration's): the writer thread's end and HDF5's close, the seal's
// digest and what it read back of the file, the header and fsync, the rename and directory sync.
void close_parts(benchmark::State& state, const dsv4::WriterStats& s, uint64_t file_bytes) {
  state.counters["close_file_ms"] = s.seconds_close_file * 1e3;
  state.counters["seal_hash_ms"] = s.seconds_seal_hash * 1e3;
  state.counters["seal_sync_ms"] = s.seconds_seal_sync * 1e3;
  state.counters["rename_ms"] = s.seconds_rename * 1e3;
  state.counters["seal_read_MB"] = double(s.seal_bytes_read) * 1e-6;
  state.counters["file_MB"] = double(file_bytes) * 1e-6;
}

// Steady state: `steps` steps recorded into one open trace, as a rollout or training loop records
// them (the writer thread encodes a step while the next one computes); the time per step includes
// the final close divided among the steps. Without a policy: the same forwards, no trace.
void BM_RecordStepsCuda(benchmark::State& state, const char* policy) {
  const int64_t T = state.range(0), steps = state.range(1);
  const auto tokens = dsv4::random_tokens(T, mid().config().vocab_size, 1);
  dsv4::RunOptions ro;
  ro.device = dsv4::Device::cuda;
  const dsv4::TraceHeader header = dsv4::make_trace_header(mid());
  dsv4::forward(mid(), {tokens}, ro);
  using Clock = std::chrono::steady_clock;
  auto seconds_since = [](Clock::time_point t0) {
    return std::chrono::duration<double>(Clock::now() - t0).count();
  };
  double forward_s = 0, writing_s = 0, blocked_s = 0, close_s = 0, steps_s = 0, staging_s = 0, encoding_s = 0,
         storing_s = 0, create_s = 0, handoff_s = 0, teardown_s = 0, remove_s = 0;
  int64_t records = 0, batches = 0;
  for (auto _ : state) {
    if (!policy) {  // the baseline: the same steps without a trace
      for (int64_t i = 0; i < steps; ++i)
        benchmark::DoNotOptimize(dsv4::forward(mid(), {tokens}, ro).seqs[0].logprobs.data());
      continue;
    }
    const std::string path = scratch("steps.h5");
    fs::remove(path);
    dsv4::TraceWriter::Options opt;
    opt.policy = dsv4::CapturePolicy::parse(policy);
    const auto created = Clock::now();
    auto w = dsv4::TraceWriter::create(path, mid().config(), header, opt);
    create_s += seconds_since(created);
    for (int64_t i = 0; i < steps; ++i) {
      dsv4::StepSpec step;
      step.seqs = {tokens};
      const auto begun = Clock::now();
      ro.observer = &w->begin_step(step);
      handoff_s += seconds_since(begun);
      const auto t0 = Clock::now();
      auto r = dsv4::forward(mid(), step.seqs, ro);
      forward_s += seconds_since(t0);
      const auto ended = Clock::now();
      w->end_step(r);
      handoff_s += seconds_since(ended);
    }
    const auto t0 = Clock::now();
    w->close();
    close_s += seconds_since(t0);
    close_parts(state, w->stats(), fs::file_size(path));
    writing_s += w->stats().seconds_writing;
    blocked_s += w->stats().seconds_blocked;
    steps_s += w->stats().seconds_steps;
    staging_s += w->stats().seconds_staging;
    encoding_s += w->stats().seconds_encoding;
    storing_s += w->stats().seconds_storing;
    records += w->stats().records;
    batches += w->stats().batches;
    ro.observer = nullptr;
    // Not a recording's cost: the writer's teardown after its close, and the removal of the trace
    // (which a user keeps). Timed apart and left out of ms_per_step.
    state.PauseTiming();
    const auto torn = Clock::now();
    w.reset();
    teardown_s += seconds_since(torn);
    const auto removed = Clock::now();
    fs::remove(path);
    remove_s += seconds_since(removed);
    state.ResumeTiming();
  }
  const double n = double(state.iterations()) * double(steps);
  state.counters["ms_per_step"] = benchmark::Counter(
      n, benchmark::Counter::kIsRate | benchmark::Counter::kInvert, benchmark::Counter::kIs1000);
  // Where a step's time goes.
  if (policy) {
    state.counters["forward_ms"] = forward_s * 1e3 / n;  // the forward with its reports handed on
    state.counters["writer_ms"] = writing_s * 1e3 / n;   // the writer thread's HDF5 work per step
    state.counters["blocked_ms"] = blocked_s * 1e3 / n;  // the model waiting on a full writer queue
    state.counters["w_steps_ms"] = steps_s * 1e3 / n;    // of writer_ms: laying out and finishing steps
    state.counters["w_stage_ms"] = staging_s * 1e3 / n;  // checking and planning records
    state.counters["w_encode_ms"] = encoding_s * 1e3 / n;
    state.counters["w_store_ms"] = storing_s * 1e3 / n;
    state.counters["records_per_batch"] = batches ? double(records) / double(batches) : 0;
    state.counters["close_ms"] = close_s * 1e3 / double(state.iterations());
    state.counters["create_ms"] = create_s * 1e3 / double(state.iterations());  // once per trace
    state.counters["handoff_ms"] = handoff_s * 1e3 / n;  // begin_step + end_step on the caller's thread
    state.counters["teardown_ms"] = teardown_s * 1e3 / double(state.iterations());  // untimed, once per trace
    state.counters["remove_ms"] = remove_s * 1e3 / double(state.iterations());      // untimed, once per trace
  }
}

void BM_Forward(benchmark::State& state, const char* policy) {
  run_forward(state, tiny(), dsv4::Device::cpu, policy);
}
void BM_ForwardCuda(benchmark::State& state, const char* policy) {
  run_forward(state, mid(), dsv4::Device::cuda, policy);
  if (!policy) {
    dsv4::RunOptions ro;
    ro.device = dsv4::Device::cuda;
    kernel_counters(state, dsv4::random_tokens(state.range(0), mid().config().vocab_size, 1), ro,
                    "forward, no reports");
  }
}

// A whole generation (8 requests, prompts of 256 tokens, 64 new tokens each): the engine alone
// (state.range(0) = 0), with the recorder's collector filing every row's digest and every decision (1:
// what `generate --record --capture decisions` adds while it decodes; on a device the collector takes
// its reports late, one wait per chunk), and recorded into a trace file (2: the collector, the layout
// of the step and the writer). Tiny on the CPU (2 threads), mid on a GPU. Compare the three times
// directly; scripts/gpu-capture-check.sh prints their ratios.
void run_generate(benchmark::State& state, const dsv4::Weights& w, dsv4::Device device) {
  std::vector<dsv4::rollout::Request> reqs;
  for (int i = 0; i < 8; ++i) {
    dsv4::rollout::Request q;
    q.id = "b";
    q.id += std::to_string(i);
    q.prompt = dsv4::random_tokens(256, w.config().vocab_size, uint64_t(i + 1));
    q.max_new_tokens = 64;
    reqs.push_back(q);
  }
  dsv4::rollout::EngineOptions o;
  o.device = device;
  o.threads = device == dsv4::Device::cpu ? 2 : 0;
  const std::string path = scratch("generate.h5");
  const auto once = [&](int64_t mode) {
    if (mode == 0) {
      dsv4::rollout::Engine e(w, o);
      for (const auto& q : reqs) e.submit(q);
      benchmark::DoNotOptimize(e.run());
    } else if (mode == 1) {
      benchmark::DoNotOptimize(
          dsv4::run_collected(w, reqs, o, [](std::string_view, int) { return false; }).gens);
    } else {
      std::remove(path.c_str());
      benchmark::DoNotOptimize(dsv4::record_generation(w, reqs, o, path, dsv4::GenerateRecordOptions{}).gens);
    }
  };
  if (device != dsv4::Device::cpu) once(0);  // uploads the weights, warms up
  for (auto _ : state) once(state.range(0));
  std::remove(path.c_str());
  state.counters["generated tok/s"] =
      benchmark::Counter(8.0 * 64 * double(state.iterations()), benchmark::Counter::kIsRate);
}
void BM_GenerateTinyCpu(benchmark::State& state) {
  run_generate(state, tiny(), dsv4::Device::cpu);
}
void BM_GenerateMidCuda(benchmark::State& state) {
  run_generate(state, mid(), dsv4::Device::cuda);
}

// The writer alone: one step's Observer calls (tiny preset, T = 4096, computed once) replayed into a
// new trace with `--capture decisions`, with the row digests precomputed as a device backend supplies
// them. This is the per-step cost that a fast (GPU) forward leaves exposed.
class CallLog : public dsv4::Observer {
 public:
  struct Tensor {
    int seq, layer;
    std::string name;
    dsv4::DType dtype;
    std::vector<int64_t> shape;
    std::vector<uint64_t> digests;
  };
  void on_tensor(const dsv4::TensorRecord& t) override {
    tensors.push_back({t.seq, t.layer, std::string(t.name), t.dtype, t.shape, dsv4::digest_rows(t)});
    order.push_back(0);
  }
  void on_indexer(const dsv4::IndexerDecision& d) override {
    indexer.push_back(
        {d, std::vector<int32_t>(d.ids, d.ids + d.T * d.k), std::vector<float>(d.margin, d.margin + d.T)});
    order.push_back(1);
  }
  void on_routing(const dsv4::RoutingDecision& d) override {
    routing.push_back({d, std::vector<int32_t>(d.ids, d.ids + d.T * d.k),
                       std::vector<float>(d.weights, d.weights + d.T * d.k),
                       std::vector<float>(d.margin, d.margin + d.T)});
    order.push_back(2);
  }
  void on_mhc(const dsv4::MhcDecision& d) override {
    const int64_t n = d.T * d.hc;
    mhc.push_back({d, std::vector<float>(d.pre, d.pre + n), std::vector<float>(d.post, d.post + n),
                   std::vector<float>(d.comb, d.comb + n * d.hc)});
    order.push_back(3);
  }
  // Replays the calls, in their order, into `o`.
  void replay(dsv4::Observer& o) {
    size_t ti = 0, ii = 0, ri = 0, mi = 0;
    for (int kind : order) {
      if (kind == 0) {
        const Tensor& t = tensors[ti++];
        dsv4::TensorRecord r;
        r.seq = t.seq, r.layer = t.layer, r.name = t.name, r.dtype = t.dtype, r.shape = t.shape;
        r.row_digests = t.digests.data();
        o.on_tensor(r);
      } else if (kind == 1) {
        auto& [d, ids, margin] = indexer[ii++];
        d.ids = ids.data(), d.margin = margin.data();
        o.on_indexer(d);
      } else if (kind == 2) {
        auto& [d, ids, weights, margin] = routing[ri++];
        d.ids = ids.data(), d.weights = weights.data(), d.margin = margin.data();
        o.on_routing(d);
      } else {
        auto& [d, pre, post, comb] = mhc[mi++];
        d.pre = pre.data(), d.post = post.data(), d.comb = comb.data();
        o.on_mhc(d);
      }
    }
  }

 private:
  std::vector<int> order;
  std::vector<Tensor> tensors;
  std::vector<std::tuple<dsv4::IndexerDecision, std::vector<int32_t>, std::vector<float>>> indexer;
  std::vector<std::tuple<dsv4::RoutingDecision, std::vector<int32_t>, std::vector<float>, std::vector<float>>>
      routing;
  std::vector<std::tuple<dsv4::MhcDecision, std::vector<float>, std::vector<float>, std::vector<float>>> mhc;
};

// The writer alone over `steps` steps of the mid preset into one trace (T = 4096, the calls of one
// CPU forward replayed each step): the steady-state per-step cost of the writer thread, which bounds
// a GPU recording's step time from below, and the close (seal, fsync) shared among the steps.
void BM_WriterSteps(benchmark::State& state) {
  const int64_t T = state.range(0), steps = state.range(1);
  dsv4::StepSpec step;
  step.seqs = {dsv4::random_tokens(T, mid().config().vocab_size, 1)};
  CallLog calls;
  dsv4::RunOptions ro;
  ro.observer = &calls;
  const dsv4::ForwardResult r = dsv4::forward(mid(), step.seqs, ro);
  const dsv4::TraceHeader header = dsv4::make_trace_header(mid());
  double writing = 0, closing = 0, ending = 0, laying_out = 0, staging = 0, encoding = 0, storing = 0;
  for (auto _ : state) {
    const std::string path = scratch("writer_steps.h5");
    fs::remove(path);
    dsv4::TraceWriter::Options opt;
    opt.policy = dsv4::CapturePolicy::parse("decisions");
    auto w = dsv4::TraceWriter::create(path, mid().config(), header, opt);
    for (int64_t i = 0; i < steps; ++i) {
      calls.replay(w->begin_step(step));
      if (i + 1 == steps) {  // the last step's end alone, as a recording's close waits for it
        w->flush();
        const auto t0 = std::chrono::steady_clock::now();
        w->end_step(r);
        w->flush();
        ending += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      } else {
        w->end_step(r);
      }
    }
    const auto t0 = std::chrono::steady_clock::now();
    w->close();
    closing += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    const dsv4::WriterStats& ws = w->stats();
    writing += ws.seconds_writing;
    laying_out += ws.seconds_steps, staging += ws.seconds_staging;
    encoding += ws.seconds_encoding, storing += ws.seconds_storing;
    close_parts(state, ws, fs::file_size(path));
    fs::remove(path);
  }
  const double n = double(state.iterations());
  state.counters["writer_ms_per_step"] = writing * 1e3 / n / double(steps);
  state.counters["w_steps_ms"] = laying_out * 1e3 / n / double(steps);  // of writer_ms_per_step, as in
  state.counters["w_stage_ms"] = staging * 1e3 / n / double(steps);     // BM_RecordStepsCuda
  state.counters["w_encode_ms"] = encoding * 1e3 / n / double(steps);
  state.counters["w_store_ms"] = storing * 1e3 / n / double(steps);
  state.counters["close_ms"] = closing * 1e3 / n;
  // The last step's end_step until it is written, its records written before: what a recording's
  // close waits for beyond the records still queued (the step's layout finished, its digests stored).
  state.counters["last_end_ms"] = ending * 1e3 / n;
  state.counters["ms_per_step"] =
      benchmark::Counter(double(steps) * n, benchmark::Counter::kIsRate | benchmark::Counter::kInvert,
                         benchmark::Counter::kIs1000);
}

void BM_WriterOnly(benchmark::State& state) {
  const int64_t T = state.range(0);
  dsv4::StepSpec step;
  step.seqs = {dsv4::random_tokens(T, 512, 1)};
  CallLog calls;
  dsv4::RunOptions ro;
  ro.observer = &calls;
  const dsv4::ForwardResult r = dsv4::forward(tiny(), step.seqs, ro);
  const dsv4::TraceHeader header = dsv4::make_trace_header(tiny());
  double writing = 0;
  for (auto _ : state) {
    const std::string path = scratch("writer.h5");
    fs::remove(path);
    dsv4::TraceWriter::Options opt;
    opt.policy = dsv4::CapturePolicy::parse("decisions");
    auto w = dsv4::TraceWriter::create(path, tiny().config(), header, opt);
    calls.replay(w->begin_step(step));
    w->end_step(r);
    w->close();
    writing += w->stats().seconds_writing;
    fs::remove(path);
  }
  state.counters["writer_thread_ms"] = writing * 1e3 / double(state.iterations());
  state.counters["tokens/s"] =
      benchmark::Counter(double(T) * state.iterations(), benchmark::Counter::kIsRate);
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
BENCHMARK(BM_GenerateTinyCpu)->DenseRange(0, 2)->Unit(benchmark::kMillisecond)->UseRealTime()->Iterations(2);
BENCHMARK(BM_WriterOnly)->Arg(4096)->Unit(benchmark::kMillisecond)->UseRealTime()->Iterations(5);
BENCHMARK(BM_WriterSteps)
    ->Args({4096, 8})
    ->Args({4096, 32})
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime()
    ->Iterations(2);
BENCHMARK(BM_PlainWrite)->Arg(256)->Unit(benchmark::kMillisecond)->UseRealTime()->Iterations(2);

}  // namespace

int main(int argc, char** argv) {
  if (dsv4::cuda_device_available()) {
    for (const char* policy : {static_cast<const char*>(nullptr), "decisions", "full"}) {
      const std::string name = std::string("BM_ForwardCuda/") + (policy ? policy : "none");
      benchmark::RegisterBenchmark(name.c_str(), BM_ForwardCuda, policy)
          ->Arg(policy && std::string(policy) == "full" ? 512 : 4096)
          ->Unit(benchmark::kMillisecond)
          ->UseRealTime()
          ->Iterations(3);
    }
  }
  if (dsv4::cuda_device_available()) {
    for (const bool late : {false, true})
      benchmark::RegisterBenchmark(late ? "BM_ForwardCuda/observed_late" : "BM_ForwardCuda/observed",
                                   BM_ForwardCudaObserved, late)
          ->Arg(4096)
          ->Unit(benchmark::kMillisecond)
          ->UseRealTime()
          ->Iterations(3);
    benchmark::RegisterBenchmark("BM_GenerateMidCuda", BM_GenerateMidCuda)
        ->DenseRange(0, 2)
        ->Unit(benchmark::kMillisecond)
        ->UseRealTime()
        ->Iterations(2);
    // Each policy against the same steps without a trace, at T = 4096 (full: T = 512), measured
    // one after the other in this run.
    for (const char* policy : {static_cast<const char*>(nullptr), "decisions", "full"})
      for (const int64_t T : {4096, 512}) {
        if ((T == 512) != (policy && std::string(policy) == "full") && policy) continue;
        // 8 steps, and 32 (decisions only): the close, once per trace, shared among more steps.
        const bool decisions = policy && std::string(policy) == "decisions";
        for (const int64_t steps : {int64_t(8), int64_t(32)}) {
          if (steps == 32 && !decisions && policy) continue;
          benchmark::RegisterBenchmark(
              (std::string("BM_RecordStepsCuda/") + (policy ? policy : "none")).c_str(), BM_RecordStepsCuda,
              policy)
              ->Args({T, steps})
              ->Unit(benchmark::kMillisecond)
              ->UseRealTime()
              ->Iterations(2);
        }
      }
  }
  for (int i = 1; i < argc; ++i)  // our own flag, taken out before the benchmark library sees argv
    if (std::string(argv[i]) == "--dsv4_gaps") {
      g_print_gaps = true;
      std::copy(argv + i + 1, argv + argc + 1, argv + i);
      --argc;
      break;
    }
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
