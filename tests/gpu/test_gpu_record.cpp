// Record on the GPU, replay on the CPU, through the dsv4 binary: `dsv4 record --device cuda` writes a
// trace whose step holds CUPTI kernel records (available = 1, at least one kernel, sane launch
// shapes), and `dsv4 replay --device cpu` finds it bit-identical (exit 0). Replaying on the GPU also
// compares the kernel sequence. The row digests the CUDA backend computes on the device equal
// libxxhash's over the downloaded values and the CPU run's digests, and values are only downloaded
// when an observer asks. Skipped without a CUDA device.
#include <gtest/gtest.h>

#include <fmt/format.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <set>
#include <string>

#include "capture/cupti.h"
#include "capture/digest.h"
#include "capture/trace_reader.h"
#include "capture/trace_writer.h"
#include "cli_util.h"
#include "gpu_test_util.h"
#include "h5_edit.h"
#include "kernels/reduce.h"
#include "model/collect.h"
#include "model/forward.h"
#include "model/tokens.h"
#include "model/weights.h"
#include "replay/tolerance.h"
#include "test_util.h"

namespace dsv4 {
namespace {

namespace fs = std::filesystem;

std::string temp_trace(const std::string& name) {
  static const test::TempDir dir;  // removed at the process's exit
  const fs::path p = dir.dir / name;
  fs::remove(p);
  return p.string();
}

TEST(GpuRecord, RecordOnGpuReplayOnCpu) {
  DSV4_REQUIRE_CUDA_DEVICE();
  const std::string t = temp_trace("gpu.h5");
  auto r = test::run_cli("record --preset tiny --seed 7 --random 40 --device cuda --out " + t);
  ASSERT_EQ(r.code, 0) << r.out;

  const TraceReader tr = TraceReader::open(t);
  const KernelRecords k = tr.kernels(0);
  ASSERT_TRUE(k.available) << "reason: " << k.reason;
  ASSERT_GT(k.kernels.size(), 0u);
  for (const KernelRecord& kr : k.kernels) {
    EXPECT_FALSE(kr.name.empty());
    EXPECT_GT(int64_t(kr.grid[0]) * kr.grid[1] * kr.grid[2], 0) << kr.name;
    EXPECT_GT(int64_t(kr.block[0]) * kr.block[1] * kr.block[2], 0) << kr.name;
    EXPECT_LE(kr.start_ns, kr.end_ns) << kr.name;
  }
  for (size_t i = 1; i < k.kernels.size(); ++i)
    EXPECT_LT(k.kernels[i - 1].correlation, k.kernels[i].correlation);
  EXPECT_NE(tr.env().at("gpu"), "none");

  r = test::run_cli("replay " + t + " --device cpu");
  EXPECT_EQ(r.code, 0) << r.out;
  r = test::run_cli("trace validate " + t);
  EXPECT_EQ(r.code, 0) << r.out;
}

TEST(GpuRecord, ReplayOnGpuComparesKernels) {
  DSV4_REQUIRE_CUDA_DEVICE();
  const std::string t = temp_trace("gpu2.h5");
  auto r = test::run_cli("record --preset tiny --seed 7 --random 33 --device cuda --out " + t);
  ASSERT_EQ(r.code, 0) << r.out;
  r = test::run_cli("replay " + t + " --device cuda --json " + t + ".json");
  EXPECT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("GPU kernels: the same"), std::string::npos) << r.out;
}

// Fast numerics through the CLI: a step recorded with --numerics fast on the GPU (the profile stored
// as train.fast, the GPU architecture in the env) replays bit for bit on the GPU, kernels included,
// and the CPU refuses its replay before running, naming the architecture. A rollout-profile generation
// in fast numerics replays on the GPU too.
TEST(GpuRecord, FastNumericsReplayOnTheSameArchitectureOnly) {
  DSV4_REQUIRE_CUDA_DEVICE();
  const std::string t = temp_trace("fast.h5");
  auto r = test::run_cli("record --preset tiny --seed 7 --random 200 --device cuda --numerics fast --out " + t);
  ASSERT_EQ(r.code, 0) << r.out;
  const TraceReader tr = TraceReader::open(t);
  EXPECT_EQ(tr.steps().at(0).profile, "train.fast");
  EXPECT_EQ(tr.steps().at(0).kind, "train");
  EXPECT_EQ(tr.env().at("gpu_arch").rfind("sm_", 0), 0u) << tr.env().at("gpu_arch");
  r = test::run_cli("replay " + t + " --device cuda");
  EXPECT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("GPU kernels: the same"), std::string::npos) << r.out;
  r = test::run_cli("replay " + t + " --device cpu");
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_NE(r.out.find("recorded in fast numerics (profile 'train.fast': reduce.gemm, reduce.indexer, "
                       "reduce.attention, reduce.moe = tensor_core) on a GPU of architecture sm_"),
            std::string::npos)
      << r.out;
  EXPECT_NE(r.out.find("this replay would run on the cpu"), std::string::npos) << r.out;
  // Recorded by tensor-core kernels of another revision: the GPU of the architecture refuses it too,
  // naming both revisions, and --tolerance compares it within tolerance instead.
  const std::string other = temp_trace("fast_other_revision.h5");
  fs::copy_file(t, other, fs::copy_options::overwrite_existing);
  test::H5Edit(other).set_attr("/meta/env", "tensor_core_revision", std::to_string(kTensorCoreRevision + 1));
  r = test::run_cli("replay " + other + " --device cuda");
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_NE(r.out.find(fmt::format("by tensor-core kernels of revision {}; its bits are reproducible only by "
                                   "tensor-core kernels of that revision",
                                   kTensorCoreRevision + 1)),
            std::string::npos)
      << r.out;
  EXPECT_NE(
      r.out.find(fmt::format("with this build's tensor-core kernels, revision {}", kTensorCoreRevision)),
      std::string::npos)
      << r.out;
  r = test::run_cli("replay " + other + " --device cuda --tolerance");
  EXPECT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("step 0: WITHIN TOLERANCE, not bitwise: recorded in fast numerics"), std::string::npos)
      << r.out;
  const std::string g = temp_trace("fast_gen.h5");
  const std::string prompts = temp_trace("prompts.jsonl");
  {
    std::ofstream f(prompts);
    f << "{\"id\": \"a\", \"prompt\": [1, 2, 3, 4, 5], \"max_new_tokens\": 6}\n"
      << "{\"id\": \"b\", \"prompt\": [9, 8, 7], \"max_new_tokens\": 4}\n";
  }
  r = test::run_cli("generate --preset tiny --seed 7 --prompts " + prompts + " --device cuda --numerics fast --record " +
                    g + " --out " + g + ".jsonl");
  ASSERT_EQ(r.code, 0) << r.out;
  r = test::run_cli("replay " + g + " --device cuda");
  EXPECT_EQ(r.code, 0) << r.out;
}

// Fast numerics elsewhere (`replay --tolerance`, replay/tolerance.h): a step recorded on the GPU in fast
// numerics with every tensor captured is re-executed on the CPU in exact numerics with its recorded
// decisions forced; every tensor and the log-probs are within the documented bounds, some tensor differs
// (the tensor-core order really ran), and the report says it was compared within tolerance, not bitwise.
// On the GPU of its architecture the same step replays bit for bit even with --tolerance (a note says
// so). A fast generation (rollout profile, FP8 caches) replays within tolerance on the CPU too. The
// measured values are printed for docs/GPU_RESULTS.md.
TEST(GpuRecord, FastNumericsReplayWithinToleranceOnTheCpu) {
  DSV4_REQUIRE_CUDA_DEVICE();
  const auto tolerance_of = [](const std::string& json_path) {
    std::ifstream f(json_path);
    const nlohmann::json j = nlohmann::json::parse(f);
    EXPECT_FALSE(j.at("identical").get<bool>());
    EXPECT_TRUE(j.at("passed").get<bool>());
    const nlohmann::json& s = j.at("steps").at(0);
    EXPECT_EQ(s.at("numerics"), "fast");
    const nlohmann::json& tol = s.at("tolerance");
    EXPECT_EQ(tol.at("compared"), "within tolerance, not bitwise");
    EXPECT_TRUE(tol.at("within").get<bool>()) << tol.dump(2);
    EXPECT_EQ(tol.at("digest_only").at("records").get<int64_t>(), 0);  // --capture full
    EXPECT_EQ(tol.at("tensors").at("compared"), s.at("records_compared"));
    EXPECT_EQ(tol.at("tensors").at("over_bound").get<int64_t>(), 0) << tol.at("tensors").dump(2);
    const nlohmann::json& worst = tol.at("tensors").at("worst");
    EXPECT_GT(worst.at("rel_l2").get<double>(), 0.0) << "fast numerics gave the exact bits everywhere";
    EXPECT_LE(worst.at("rel_l2").get<double>(), kDefaultTensorRelL2);
    EXPECT_LE(tol.at("logprobs").at("rel_l2").get<double>(), kDefaultLogprobRelL2);
    EXPECT_LT(tol.at("records_bitwise_equal").get<int64_t>(), s.at("records_compared").get<int64_t>());
    const nlohmann::json& fd = tol.at("free_decisions");
    std::printf("[fast replayed on the cpu within tolerance] %s: worst tensor %s layer %d rel-L2 %.3e; log-probs rel-L2 "
                "%.3e, max abs %.3e; free decisions: indexer rows equal %ld/%ld, routing rows equal %ld/%ld\n",
                tol.at("recorded_profile").get<std::string>().c_str(), worst.at("tensor").get<std::string>().c_str(),
                worst.at("layer").get<int>(), worst.at("rel_l2").get<double>(),
                tol.at("logprobs").at("rel_l2").get<double>(), tol.at("logprobs").at("max_abs").get<double>(),
                long(fd.at("indexer").at("same").get<int64_t>()), long(fd.at("indexer").at("rows").get<int64_t>()),
                long(fd.at("routing").at("same").get<int64_t>()), long(fd.at("routing").at("rows").get<int64_t>()));
  };

  const std::string t = temp_trace("fast_full.h5");
  auto r = test::run_cli("record --preset tiny --seed 7 --random 200 --device cuda --numerics fast --capture full --out " +
                         t);
  ASSERT_EQ(r.code, 0) << r.out;
  r = test::run_cli("replay " + t + " --device cpu --tolerance --json " + t + ".json");
  EXPECT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("step 0: WITHIN TOLERANCE, not bitwise: recorded in fast numerics"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("re-executed in exact numerics (profile 'train') with the recorded decisions forced"),
            std::string::npos)
      << r.out;
  EXPECT_NE(r.out.find(": within tolerance, not bitwise (1 step compared within tolerance)"), std::string::npos)
      << r.out;
  tolerance_of(t + ".json");
  r = test::run_cli("replay " + t + " --device cuda --tolerance");
  EXPECT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("step 0: bit-identical"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("note: --tolerance: step 0 in fast numerics, replayed bit for bit as usual"), std::string::npos)
      << r.out;

  const std::string g = temp_trace("fast_gen_full.h5");
  const std::string prompts = temp_trace("prompts_tolerance.jsonl");
  {
    std::ofstream f(prompts);
    f << "{\"id\": \"a\", \"prompt\": [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16], \"max_new_tokens\": 24}\n"
      << "{\"id\": \"b\", \"prompt\": [9, 8, 7], \"max_new_tokens\": 12, \"temperature\": 0.7, \"seed\": 3}\n";
  }
  r = test::run_cli("generate --preset tiny --seed 7 --prompts " + prompts +
                    " --device cuda --numerics fast --capture full --record " + g + " --out " + g + ".jsonl");
  ASSERT_EQ(r.code, 0) << r.out;
  r = test::run_cli("replay " + g + " --device cpu --tolerance --json " + g + ".json");
  EXPECT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("note: a generation step"), std::string::npos) << r.out;
  tolerance_of(g + ".json");
}

// Keeps the row digests of every reported tensor, in order; optionally checks the device digests
// against libxxhash over the downloaded values.
class DigestObserver : public Observer {
 public:
  explicit DigestObserver(bool check_values) : check_values_(check_values) {}
  void on_tensor(const TensorRecord& t) override {
    names.push_back(std::string(t.name) + "@" + std::to_string(t.layer));
    digests.push_back(digest_rows(t));
    if (t.row_digests) ++device_digests;
    if (t.rows() > 0) ++nonempty;
    if (t.host) ++host_values;
    if (!check_values_) return;
    TensorRecord h = t;  // the same tensor, hashed on the host from its downloaded values
    h.row_digests = nullptr;
    h.fetch = nullptr;
    h.host = t.data();
    EXPECT_EQ(digest_rows(h), digests.back()) << names.back();
  }
  std::vector<std::string> names;
  std::vector<std::vector<uint64_t>> digests;
  int device_digests = 0, host_values = 0, nonempty = 0;

 private:
  bool check_values_;
};

TEST(GpuRecord, DeviceDigestsEqualHostDigests) {
  DSV4_REQUIRE_CUDA_DEVICE();
  for (const char* preset_name : {"tiny", "tiny-b"}) {
    const Weights w = Weights::init(preset(preset_name), 3);
    for (const char* profile : {"train", "rollout"}) {
      for (int64_t T : {1, 37, 300}) {
        const auto toks = random_tokens(T, w.config().vocab_size, uint64_t(T));
        RunOptions o;
        o.profile = profile_by_name(profile);
        DigestObserver cpu(false), gpu(true);
        o.observer = &cpu;
        forward(w, {toks}, o);
        o.device = Device::cuda;
        o.observer = &gpu;
        forward(w, {toks}, o);
        const std::string what = std::string(preset_name) + " " + profile + " T=" + std::to_string(T);
        ASSERT_EQ(cpu.names, gpu.names) << what;
        EXPECT_EQ(cpu.digests, gpu.digests) << what;
        EXPECT_EQ(cpu.device_digests, 0) << what;
        EXPECT_GE(gpu.device_digests, gpu.nonempty)
            << what << ": every non-empty GPU tensor has device digests";
        EXPECT_EQ(gpu.host_values, 0) << what << ": no GPU tensor arrives on the host unasked";
      }
    }
  }
}

// Every report of a run, with the values of the tensors named in `with_values`. With `late`, the
// observer takes its reports late (Observer::deferrable): on the GPU they then come through
// model/late_reports.h, and any other tensor's data() must throw.
class ReportLog : public DecisionLog {
 public:
  ReportLog(bool late, std::set<std::string> with_values) : late_(late), with_values_(std::move(with_values)) {}
  void on_tensor(const TensorRecord& t) override {
    names.push_back(std::string(t.name) + "@" + std::to_string(t.layer));
    digests.push_back(digest_rows(t));
    if (with_values_.count(std::string(t.name))) {
      const int64_t n = t.rows() * t.row_elems();
      const uint32_t* v = static_cast<const uint32_t*>(t.data());
      values.push_back(std::vector<uint32_t>(v, v + n));
    } else if (late_ && t.fetch) {
      EXPECT_THROW(t.data(), std::logic_error) << names.back();
      ++refused;
    }
  }
  bool wants_tensors() const override { return true; }
  bool deferrable() const override { return late_; }
  bool wants_values(std::string_view name, int) const override { return with_values_.count(std::string(name)) > 0; }

  std::vector<std::string> names;
  std::vector<std::vector<uint64_t>> digests;
  std::vector<std::vector<uint32_t>> values;  // bit patterns
  int refused = 0;

 private:
  bool late_;
  std::set<std::string> with_values_;
};

template <typename R>
void expect_same_records(const R& cpu, const R& gpu, const std::string& what) {
  ASSERT_EQ(cpu.size(), gpu.size()) << what;
  for (auto a = cpu.begin(), b = gpu.begin(); a != cpu.end(); ++a, ++b) {
    ASSERT_EQ(a->first, b->first) << what;
    EXPECT_EQ(a->second.T, b->second.T) << what;
    if constexpr (requires { a->second.ids; }) {
      EXPECT_EQ(a->second.ids, b->second.ids) << what;
    }
    if constexpr (requires { a->second.margin; }) {
      EXPECT_TRUE(test::bitwise_equal(a->second.margin, b->second.margin)) << what;
    }
    if constexpr (requires { a->second.weights; }) {
      EXPECT_TRUE(test::bitwise_equal(a->second.weights, b->second.weights)) << what;
    }
    if constexpr (requires { a->second.comb; }) {
      EXPECT_TRUE(test::bitwise_equal(a->second.pre, b->second.pre)) << what;
      EXPECT_TRUE(test::bitwise_equal(a->second.post, b->second.post)) << what;
      EXPECT_TRUE(test::bitwise_equal(a->second.comb, b->second.comb)) << what;
    }
  }
}

// Runs `batch` on the CPU (immediate reports) and on the GPU (late reports, at most `bytes` in flight)
// and expects the same reports: names, digests, wanted values, decisions, and the same logprobs.
void expect_late_reports_equal_the_cpus(const Weights& w, const char* profile,
                                        const std::vector<std::vector<int32_t>>& batch, size_t bytes,
                                        const std::string& what) {
  const std::set<std::string> with_values = {"attn.q", "indexer.score", "logits", "logprobs"};
  RunOptions o;
  o.profile = profile_by_name(profile);
  o.late_report_bytes = bytes;
  ReportLog cpu(false, with_values), gpu(true, with_values);
  o.observer = &cpu;
  const ForwardResult rc = forward(w, batch, o);
  o.device = Device::cuda;
  o.observer = &gpu;
  const ForwardResult rg = forward(w, batch, o);
  ASSERT_EQ(cpu.names, gpu.names) << what;
  EXPECT_EQ(cpu.digests, gpu.digests) << what;
  EXPECT_EQ(cpu.values, gpu.values) << what;
  EXPECT_GT(gpu.refused, 0) << what;
  EXPECT_EQ(cpu.refused, 0) << what;
  expect_same_records(cpu.indexer, gpu.indexer, what + " indexer");
  expect_same_records(cpu.routing, gpu.routing, what + " routing");
  expect_same_records(cpu.mhc, gpu.mhc, what + " mhc");
  for (size_t s = 0; s < batch.size(); ++s)
    EXPECT_TRUE(test::bitwise_equal(rc.seqs[s].logprobs, rg.seqs[s].logprobs)) << what;
}

// Late reports (downloads on the copy stream, handed on once landed) carry the same digests,
// decisions and values, in the same order, as the CPU's immediate ones; all of them arrive before
// forward() returns, also with back-pressure on every report (late_report_bytes = 1).
TEST(GpuRecord, LateReportsEqualTheCpusImmediateOnes) {
  DSV4_REQUIRE_CUDA_DEVICE();
  for (const char* preset_name : {"tiny", "tiny-b"}) {
    const Weights w = Weights::init(preset(preset_name), 5);
    for (const char* profile : {"train", "rollout"}) {
      for (int64_t T : {1, 37, 300}) {
        for (size_t bytes : {size_t(256) << 20, size_t(1)}) {
          const std::vector<std::vector<int32_t>> batch = {random_tokens(T, w.config().vocab_size, uint64_t(T)),
                                                           random_tokens(9, w.config().vocab_size, 4)};
          expect_late_reports_equal_the_cpus(
              w, profile, batch, bytes,
              fmt::format("{} {} T={} late_report_bytes={}", preset_name, profile, T, bytes));
        }
      }
    }
  }
}

// The digests of late reports run on a stream of their own while the model goes on. With each
// download's digests held back 3 ms there, the model runs far ahead of them: a reported buffer that
// the graph wrote again, or freed (and reused) without waiting for its digests, would be hashed with
// other bytes and differ from the CPU's digests.
TEST(GpuRecord, LateDigestsSeeTheReportedBytesWhenTheyRunLate) {
  DSV4_REQUIRE_CUDA_DEVICE();
  const test::DigestDelay delay(3000);
  for (const char* preset_name : {"tiny", "tiny-b"}) {
    const Weights w = Weights::init(preset(preset_name), 5);
    for (int64_t T : {37, 300}) {
      const std::vector<std::vector<int32_t>> batch = {random_tokens(T, w.config().vocab_size, uint64_t(T)),
                                                       random_tokens(9, w.config().vocab_size, 4)};
      expect_late_reports_equal_the_cpus(w, "rollout", batch, size_t(256) << 20,
                                         fmt::format("{} T={}, digests 3 ms late", preset_name, T));
    }
  }
}

// With LaunchTimes::on, the kernel records carry their launch calls' host times, on the clock of the
// kernels' own times: a call ends after it starts, and a kernel starts after its call began.
TEST(GpuRecord, KernelRecordsCarryTheirLaunchCallsTimes) {
  DSV4_REQUIRE_CUDA_DEVICE();
  DSV4_SKIP_UNDER_COMPUTE_SANITIZER("it holds CUPTI, so there are no kernel records");
  const Weights w = Weights::init(preset("tiny"), 5);
  RunOptions o;
  o.device = Device::cuda;
  const std::vector<std::vector<int32_t>> batch = {random_tokens(100, w.config().vocab_size, 3)};
  forward(w, batch, o);  // uploads the weights
  KernelRecorder rec;
  ASSERT_TRUE(rec.start(KernelRecorder::LaunchTimes::on)) << rec.reason();
  forward(w, batch, o);
  const KernelRecords k = rec.stop();
  ASSERT_TRUE(k.available) << k.reason;
  ASSERT_FALSE(k.kernels.empty());
  size_t timed = 0;
  for (const KernelRecord& r : k.kernels) {
    if (!r.launch_start_ns) continue;  // launched by a driver API call (not a runtime one)
    ++timed;
    EXPECT_LE(r.launch_start_ns, r.launch_end_ns) << r.name;
    EXPECT_LE(r.launch_start_ns, r.start_ns) << r.name;
  }
  EXPECT_GE(timed * 10, k.kernels.size() * 9) << "kernels with their launch call's times";

  ASSERT_TRUE(rec.start()) << rec.reason();  // off: none
  forward(w, batch, o);
  for (const KernelRecord& r : rec.stop().kernels) EXPECT_EQ(r.launch_start_ns, 0) << r.name;
}

// The model's stream never waits for late digests: with each download's digests held back 30 ms on
// their stream, a free of a buffer they still read would hold the compute stream until they pass;
// release() defers such frees instead, so every model kernel ends before the first held-back digest.
TEST(GpuRecord, TheModelDoesNotWaitForLateDigests) {
  DSV4_REQUIRE_CUDA_DEVICE();
  DSV4_SKIP_UNDER_COMPUTE_SANITIZER("it holds CUPTI and serializes kernels, so there is no timing to check");
  const Weights w = Weights::init(preset("tiny"), 5);
  const std::vector<std::vector<int32_t>> batch = {random_tokens(300, w.config().vocab_size, 3)};
  RunOptions o;
  o.device = Device::cuda;
  o.late_report_bytes = size_t(256) << 20;
  ReportLog warm(true, {}), log(true, {});
  o.observer = &warm;
  forward(w, batch, o);  // uploads the weights and makes the streams
  const test::DigestDelay delay(30000);
  KernelRecorder rec;
  ASSERT_TRUE(rec.start()) << rec.reason();
  o.observer = &log;
  forward(w, batch, o);
  const KernelRecords k = rec.stop();
  ASSERT_TRUE(k.available) << k.reason;
  int64_t first_delay_end = INT64_MAX, last_model_end = 0;
  for (const KernelRecord& r : k.kernels) {
    if (r.name.find("digest_delay_kernel") != std::string::npos)
      first_delay_end = std::min(first_delay_end, r.end_ns);
    if (!is_report_kernel(r)) last_model_end = std::max(last_model_end, r.end_ns);
  }
  ASSERT_NE(first_delay_end, INT64_MAX) << "no digest was held back";
  EXPECT_LT(last_model_end, first_delay_end)
      << "the model's last kernel ended " << double(last_model_end - first_delay_end) * 1e-6
      << " ms after the first held-back digest";
  EXPECT_EQ(log.names, warm.names);
  EXPECT_EQ(log.digests, warm.digests);
}

// Rows of a multiple of 512 values take their digests from block sums that the ops writing them form
// (kernels/row_sums.h): hc_pre's and hc_head's y, the norms, hc_post's streams and the MoE's output,
// whose kernels hold whole blocks at a hidden size of 1024. The digests still equal the CPU's, also when they
// run late, and the sums came from those kernels (digests_from_sums ran; no op fell back to a second pass).
TEST(GpuRecord, LateDigestsFromTheOpsBlockSumsEqualTheCpus) {
  DSV4_REQUIRE_CUDA_DEVICE();
  ModelConfig c = preset("tiny");
  c.hidden_size = 1024;
  const Weights w = Weights::init(c, 5);
  for (int delay_us : {0, 3000}) {
    const test::DigestDelay delay(delay_us);
    for (const char* profile : {"train", "rollout"}) {
      for (int64_t T : {1, 300}) {
        const std::vector<std::vector<int32_t>> batch = {random_tokens(T, c.vocab_size, uint64_t(T)),
                                                         random_tokens(9, c.vocab_size, 4)};
        // Under compute-sanitizer (which holds CUPTI) the digests are checked, not which kernels ran.
        const bool records = !test::under_compute_sanitizer();
        KernelRecorder rec;
        if (records) {
          ASSERT_TRUE(rec.start()) << rec.reason();
        }
        expect_late_reports_equal_the_cpus(
            w, profile, batch, size_t(256) << 20,
            fmt::format("hidden 1024 {} T={}, digests {} us late", profile, T, delay_us));
        if (!records) continue;
        const KernelRecords k = rec.stop();
        int from_sums = 0, second_pass = 0;
        for (const KernelRecord& r : k.kernels) {
          from_sums += r.name.find("digest_from_sums_kernel") != std::string::npos;
          second_pass += r.name.find("digest_row_sums_kernel") != std::string::npos;
        }
        // Per sequence: 2 hc_pre, 2 norms, 2 hc_post and moe.out a layer, then head.hc and head.norm.
        EXPECT_EQ(from_sums, int(batch.size()) * (7 * c.num_hidden_layers + 2)) << profile << " T=" << T;
        EXPECT_EQ(second_pass, 0) << profile << " T=" << T;
      }
    }
  }
}

// A trace recorded on the GPU (late reports, each step's end queued to the writer while the next step
// computes) holds what the CPU's holds: every decision, digest and stored tensor, over three steps of
// two sequences into one writer.
TEST(GpuRecord, TraceOfSeveralStepsEqualsTheCpus) {
  DSV4_REQUIRE_CUDA_DEVICE();
  const Weights w = Weights::init(preset("tiny-b"), 7);
  const std::string cpu = temp_trace("steps_cpu.h5"), gpu = temp_trace("steps_gpu.h5");
  for (const auto& [t, device] : {std::pair{cpu, Device::cpu}, std::pair{gpu, Device::cuda}}) {
    TraceWriter::Options wo;
    wo.policy = CapturePolicy::parse("attn.q@1,indexer.*,logits");
    auto writer = TraceWriter::create(t, w.config(), make_trace_header(w), wo);
    for (int step = 0; step < 3; ++step) {
      StepSpec s;
      s.seqs = {random_tokens(40 + 29 * step, w.config().vocab_size, uint64_t(step + 1)),
                random_tokens(7, w.config().vocab_size, uint64_t(step + 10))};
      RunOptions o;
      o.device = device;
      o.observer = &writer->begin_step(s);
      writer->end_step(forward(w, s.seqs, o));
    }
    writer->close();
  }
  const TraceReader a = TraceReader::open(cpu), b = TraceReader::open(gpu);
  ASSERT_EQ(a.steps().size(), 3u);
  ASSERT_EQ(b.steps().size(), 3u);
  int stored = 0;
  for (int step = 0; step < 3; ++step) {
    EXPECT_TRUE(b.steps()[size_t(step)].complete);
    for (int q = 0; q < 2; ++q) {
      const std::string at = fmt::format("step {} sequence {}", step, q);
      EXPECT_EQ(a.tokens(step, q), b.tokens(step, q)) << at;
      EXPECT_TRUE(test::bitwise_equal(a.logprobs(step, q), b.logprobs(step, q))) << at;
      EXPECT_EQ(a.digests(step, q).values, b.digests(step, q).values) << at;
      ASSERT_EQ(a.decision_layers(step, q), b.decision_layers(step, q)) << at;
      for (int layer : a.decision_layers(step, q)) {
        const auto ia = a.indexer(step, q, layer), ib = b.indexer(step, q, layer);
        ASSERT_EQ(ia.has_value(), ib.has_value()) << at << " layer " << layer;
        if (ia) {
          EXPECT_EQ(ia->ids, ib->ids) << at << " layer " << layer;
        }
        const auto ra = a.routing(step, q, layer), rb = b.routing(step, q, layer);
        ASSERT_EQ(ra.has_value(), rb.has_value()) << at << " layer " << layer;
        if (ra) {
          EXPECT_EQ(ra->ids, rb->ids) << at << " layer " << layer;
          EXPECT_TRUE(test::bitwise_equal(ra->weights, rb->weights)) << at << " layer " << layer;
        }
        for (Sublayer sub : {Sublayer::attn, Sublayer::ffn}) {
          const auto ma = a.mhc(step, q, layer, sub), mb = b.mhc(step, q, layer, sub);
          ASSERT_EQ(ma.has_value(), mb.has_value()) << at << " layer " << layer;
          if (ma) {
            EXPECT_TRUE(test::bitwise_equal(ma->comb, mb->comb)) << at << " layer " << layer;
          }
        }
      }
      ASSERT_EQ(a.full_tensors(step, q), b.full_tensors(step, q)) << at;
      for (const auto& [name, layer] : a.full_tensors(step, q)) {
        const auto ta = a.tensor(step, q, layer, name), tb = b.tensor(step, q, layer, name);
        ASSERT_TRUE(ta && tb) << at << " " << name;
        EXPECT_TRUE(test::bitwise_equal(ta->f, tb->f)) << at << " " << name << " layer " << layer;
        EXPECT_EQ(ta->i, tb->i) << at << " " << name;
        ++stored;
      }
    }
  }
  EXPECT_GT(stored, 6);
  EXPECT_EQ(test::run_cli("replay " + gpu + " --device cpu").code, 0);
}

TEST(GpuRecord, CpuRecordSaysNoKernels) {
  const std::string t = temp_trace("cpu.h5");
  auto r = test::run_cli("record --preset tiny --seed 7 --random 12 --out " + t);
  ASSERT_EQ(r.code, 0) << r.out;
  const KernelRecords k = TraceReader::open(t).kernels(0);
  EXPECT_FALSE(k.available);
  EXPECT_TRUE(k.kernels.empty());
  EXPECT_FALSE(k.reason.empty());
}

}  // namespace
}  // namespace dsv4
