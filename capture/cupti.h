// Kernel launch records of a GPU step, from CUPTI activity records (traces/FORMAT.md, the
// /steps/NNNNNN/kernels group). This header needs no CUDA: KernelRecords is what the trace stores and
// replay compares on every build; KernelRecorder reports "built without CUDA" where CUPTI is not
// compiled in.
#pragma once

#include <array>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace dsv4 {

struct KernelRecord {
  std::string name;  // demangled (the mangled name when demangling fails)
  std::array<int32_t, 3> grid{}, block{};
  int64_t shared_bytes = 0;  // static + dynamic shared memory per block
  int32_t registers = 0;     // per thread
  int64_t stream = 0;        // CUPTI stream id
  int64_t start_ns = 0, end_ns = 0;
  int64_t correlation = 0;  // CUPTI correlation id (launch order on the host)
  // The host's launch call (cudaLaunchKernel and the like) on CUPTI's clock, which start_ns/end_ns
  // share; 0 unless the recorder ran with LaunchTimes::on. Not part of a trace.
  int64_t launch_start_ns = 0, launch_end_ns = 0;
};

// The kernels of one step in launch order (ascending correlation id). available = false: nothing was
// recorded and `reason` says why (CPU run, built without CUDA, CUPTI failed with code N, ...).
struct KernelRecords {
  bool available = false;
  std::string reason;
  std::vector<KernelRecord> kernels;
};

// Launch configuration equality (name, grid, block, shared memory): what replay compares.
bool same_launch(const KernelRecord& a, const KernelRecord& b);

// A kernel that the recording machinery launches for an observer rather than the model: the row
// digests, and the block sums of rows whose op could not form them (kernels/cuda/xxh3.cu), and the
// snapshot copies of late reports (cuda::copy_words). Which of
// them run depends on the observer (reports taken late or at once, values wanted or not), not on the
// computation, so replay compares the model's launches only.
bool is_report_kernel(const KernelRecord& k);
// The launches of `r` that are not report kernels, in their order.
std::vector<KernelRecord> model_launches(const KernelRecords& r);

// Records every kernel that runs on the GPU between start() and stop() (all streams and contexts of
// the process). One recorder may be active at a time (CUPTI's activity API is process-wide). Nothing
// here throws: when CUPTI cannot record (no GPU: CUPTI returns an error such as 999; another recorder
// active; built without CUDA) available() is false, reason() says why and stop() returns records
// with available = false.
class KernelRecorder {
 public:
  KernelRecorder();
  ~KernelRecorder();  // stops if still recording
  KernelRecorder(const KernelRecorder&) = delete;
  KernelRecorder& operator=(const KernelRecorder&) = delete;

  // With `on`, each kernel also gets its launch call's host times (CUPTI's runtime API records; they
  // cost every runtime call some host time, so recording steps leaves them off).
  enum class LaunchTimes { off, on };
  // Enables CUPTI kernel activity records. Returns available().
  bool start(LaunchTimes launch_times = LaunchTimes::off);
  // Synchronizes the device, flushes CUPTI's buffers, disables the records and returns the kernels
  // run since start(), sorted by correlation id.
  KernelRecords stop();

  bool available() const { return available_; }
  const std::string& reason() const { return reason_; }
  // Now on CUPTI's clock, the one of KernelRecord's times (0 where CUPTI is not built in): host events
  // placed among the kernels.
  static int64_t now_ns();

 private:
  bool available_ = false;
  // Read only where CUPTI is built in (a build without it never starts recording).
  [[maybe_unused]] bool running_ = false;
  [[maybe_unused]] bool launch_times_ = false;
  std::string reason_ = "not started";
};

// Version strings for the environment fingerprint: CUPTI's API version ("none" without CUDA or
// when CUPTI does not answer).
std::string cupti_version_string();

}  // namespace dsv4
