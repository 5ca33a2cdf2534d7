// Record on the GPU, replay on the CPU, through the dsv4 binary: `dsv4 record --device cuda` writes a
// trace whose step holds CUPTI kernel records (available = 1, at least one kernel, sane launch
// shapes), and `dsv4 replay --device cpu` finds it bit-identical (exit 0). Replaying on the GPU also
// compares the kernel sequence. The row digests the CUDA backend computes on the device equal
// libxxhash's over the downloaded values and the CPU run's digests, and values are only downloaded
// when an observer asks. Skipped without a CUDA device.
#include <gtest/gtest.h>

#include <filesystem>
#include <string>

#include "capture/digest.h"
#include "capture/trace_reader.h"
#include "cli_util.h"
#include "gpu_test_util.h"
#include "model/forward.h"
#include "model/tokens.h"
#include "model/weights.h"

namespace dsv4 {
namespace {

namespace fs = std::filesystem;

std::string temp_trace(const std::string& name) {
  const fs::path dir = fs::temp_directory_path() / ("dsv4_gpu_record_" + std::to_string(::getpid()));
  fs::create_directories(dir);
  const fs::path p = dir / name;
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
