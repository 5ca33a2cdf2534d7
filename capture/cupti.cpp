// KernelRecorder over CUPTI's activity API (capture/cupti.h). CUPTI hands out records in buffers that
// it requests from and returns to two callbacks; the callbacks are process-wide, so the records go to
// one process-wide list guarded by a mutex, owned by the active recorder.
#include "capture/cupti.h"

#include <algorithm>
#include <cstdlib>
#include <iterator>
#include <mutex>
#include <tuple>
#include <unordered_map>
#include <utility>

#if defined(DSV4_HAVE_CUPTI)
#include <cuda_runtime_api.h>
#include <cupti.h>
#include <cxxabi.h>
#endif

namespace dsv4 {

bool same_launch(const KernelRecord& a, const KernelRecord& b) {
  return a.name == b.name && a.grid == b.grid && a.block == b.block && a.shared_bytes == b.shared_bytes;
}

bool is_report_kernel(const KernelRecord& k) {
  for (const char* name : {"digest_rows_kernel", "digest_row_sums_kernel", "digest_from_sums_kernel",
                           "digest_delay_kernel", "copy_words_kernel"})
    if (k.name.find(name) != std::string::npos) return true;
  return false;
}

std::vector<KernelRecord> model_launches(const KernelRecords& r) {
  std::vector<KernelRecord> m;
  std::copy_if(r.kernels.begin(), r.kernels.end(), std::back_inserter(m),
               [](const KernelRecord& k) { return !is_report_kernel(k); });
  return m;
}

#if defined(DSV4_HAVE_CUPTI)
namespace {

constexpr size_t kBufferBytes = size_t(8) << 20;
constexpr size_t kAlign = 8;

std::mutex g_mu;
bool g_active = false;  // a recorder is between start() and stop()
std::vector<KernelRecord> g_records;
std::unordered_map<int64_t, std::pair<int64_t, int64_t>> g_calls;  // correlation id -> runtime call's times

std::string demangle(const char* name) {
  if (!name) return "?";
  int status = 0;
  char* d = abi::__cxa_demangle(name, nullptr, nullptr, &status);
  if (status != 0 || !d) return name;
  std::string s(d);
  std::free(d);
  return s;
}

std::string cupti_error(const char* call, CUptiResult r) {
  const char* s = nullptr;
  cuptiGetResultString(r, &s);
  return std::string(call) + " failed: " + (s ? s : "unknown error") + " (" + std::to_string(int(r)) + ")";
}

void CUPTIAPI buffer_requested(uint8_t** buffer, size_t* size, size_t* max_records) {
  void* p = std::aligned_alloc(kAlign, kBufferBytes);
  *buffer = static_cast<uint8_t*>(p);
  *size = p ? kBufferBytes : 0;
  *max_records = 0;  // as many as fit
}

void CUPTIAPI buffer_completed(CUcontext, uint32_t, uint8_t* buffer, size_t, size_t valid) {
  std::vector<KernelRecord> got;
  std::vector<std::pair<int64_t, std::pair<int64_t, int64_t>>> calls;
  CUpti_Activity* rec = nullptr;
  while (cuptiActivityGetNextRecord(buffer, valid, &rec) == CUPTI_SUCCESS) {
    if (rec->kind == CUPTI_ACTIVITY_KIND_RUNTIME) {
      const auto* a = reinterpret_cast<const CUpti_ActivityAPI*>(rec);
      calls.push_back({int64_t(a->correlationId), {int64_t(a->start), int64_t(a->end)}});
      continue;
    }
    if (rec->kind != CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL && rec->kind != CUPTI_ACTIVITY_KIND_KERNEL)
      continue;
    const auto* k = reinterpret_cast<const CUpti_ActivityKernel10*>(rec);
    KernelRecord r;
    r.name = demangle(k->name);
    r.grid = {k->gridX, k->gridY, k->gridZ};
    r.block = {k->blockX, k->blockY, k->blockZ};
    r.shared_bytes = int64_t(k->staticSharedMemory) + int64_t(k->dynamicSharedMemory);
    r.registers = int32_t(k->registersPerThread);
    r.stream = int64_t(k->streamId);
    r.start_ns = int64_t(k->start);
    r.end_ns = int64_t(k->end);
    r.correlation = int64_t(k->correlationId);
    got.push_back(std::move(r));
  }
  std::free(buffer);
  std::lock_guard lk(g_mu);
  if (!g_active) return;
  g_records.insert(g_records.end(), std::make_move_iterator(got.begin()), std::make_move_iterator(got.end()));
  g_calls.insert(calls.begin(), calls.end());
}

// Gives up the active slot after a failed start.
bool fail_start(std::string& reason, std::string why) {
  reason = std::move(why);
  std::lock_guard lk(g_mu);
  g_active = false;
  return false;
}

}  // namespace

KernelRecorder::KernelRecorder() = default;

KernelRecorder::~KernelRecorder() {
  if (running_) stop();
}

bool KernelRecorder::start(LaunchTimes launch_times) {
  if (running_) return available_;
  available_ = false;
  int n = 0;
  const cudaError_t e = cudaGetDeviceCount(&n);
  if (e != cudaSuccess || n == 0) {
    cudaGetLastError();
    reason_ = e != cudaSuccess ? std::string("no CUDA device: ") + cudaGetErrorName(e) : "no CUDA device";
    return false;
  }
  {
    std::lock_guard lk(g_mu);
    if (g_active) {
      reason_ = "another kernel recorder is active";
      return false;
    }
    g_active = true;
    g_records.clear();
    g_calls.clear();
  }
  CUptiResult r = cuptiActivityRegisterCallbacks(buffer_requested, buffer_completed);
  if (r != CUPTI_SUCCESS) return fail_start(reason_, cupti_error("cuptiActivityRegisterCallbacks", r));
  r = cuptiActivityEnable(CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL);
  if (r != CUPTI_SUCCESS)
    return fail_start(reason_, cupti_error("cuptiActivityEnable(CONCURRENT_KERNEL)", r));
  launch_times_ = launch_times == LaunchTimes::on;
  if (launch_times_ && (r = cuptiActivityEnable(CUPTI_ACTIVITY_KIND_RUNTIME)) != CUPTI_SUCCESS) {
    cuptiActivityDisable(CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL);
    launch_times_ = false;
    return fail_start(reason_, cupti_error("cuptiActivityEnable(RUNTIME)", r));
  }
  running_ = true;
  available_ = true;
  reason_.clear();
  return true;
}

KernelRecords KernelRecorder::stop() {
  KernelRecords out;
  if (!running_) {
    out.reason = reason_;
    return out;
  }
  running_ = false;
  cudaDeviceSynchronize();  // kernel records complete when their kernels do; errors are not ours to report
  cudaGetLastError();
  const CUptiResult f = cuptiActivityFlushAll(CUPTI_ACTIVITY_FLAG_FLUSH_FORCED);
  cuptiActivityDisable(CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL);
  if (launch_times_) cuptiActivityDisable(CUPTI_ACTIVITY_KIND_RUNTIME);
  cuptiActivityFlushAll(CUPTI_ACTIVITY_FLAG_FLUSH_FORCED);
  std::lock_guard lk(g_mu);
  g_active = false;
  if (f != CUPTI_SUCCESS) {
    available_ = false;
    reason_ = cupti_error("cuptiActivityFlushAll", f);
    out.reason = reason_;
    g_records.clear();
    g_calls.clear();
    return out;
  }
  out.available = true;
  out.kernels = std::move(g_records);
  g_records.clear();
  for (KernelRecord& k : out.kernels)
    if (const auto c = g_calls.find(k.correlation); c != g_calls.end())
      std::tie(k.launch_start_ns, k.launch_end_ns) = c->second;
  g_calls.clear();
  std::stable_sort(out.kernels.begin(), out.kernels.end(), [](const KernelRecord& a, const KernelRecord& b) {
    return a.correlation < b.correlation;
  });
  return out;
}

int64_t KernelRecorder::now_ns() {
  uint64_t t = 0;
  return cuptiGetTimestamp(&t) == CUPTI_SUCCESS ? int64_t(t) : 0;
}

std::string cupti_version_string() {
  uint32_t v = 0;
  if (cuptiGetVersion(&v) != CUPTI_SUCCESS) return "none";
  return std::to_string(v);
}

#else  // built without CUDA

KernelRecorder::KernelRecorder() = default;
KernelRecorder::~KernelRecorder() = default;
bool KernelRecorder::start(LaunchTimes) {
  reason_ = "built without CUDA";
  return false;
}
KernelRecords KernelRecorder::stop() {
  KernelRecords out;
  out.reason = reason_;
  return out;
}
int64_t KernelRecorder::now_ns() {
  return 0;
}
std::string cupti_version_string() {
  return "none";
}

#endif

}  // namespace dsv4
