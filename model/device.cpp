// The CPU and CUDA backends of the forward graph (model/device.h) and the per-Weights device copy
// of the weights.
#include "model/device.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <atomic>
#include <bit>
#include <cstring>
#include <deque>
#include <map>
#include <mutex>

#include "kernels/logits.h"
#include "kernels/numerics/numerics.h"
#include "model/error.h"
#include "model/expert_parallel.h"

#if defined(DSV4_HAVE_CUDA)
#include "kernels/cuda/check.h"
#include "kernels/cuda/grad.h"
#include "kernels/cuda/ops.h"
#include "kernels/xxh3.h"
#endif

namespace dsv4 {

const char* to_string(Device d) {
  return d == Device::cuda ? "cuda" : "cpu";
}

Device parse_device(const std::string& name) {
  if (name == "cpu") return Device::cpu;
  if (name == "cuda") return Device::cuda;
  throw InputError(fmt::format("unknown device '{}': expected 'cpu' or 'cuda'", name));
}

bool cuda_built() {
#if defined(DSV4_HAVE_CUDA)
  return true;
#else
  return false;
#endif
}

bool cuda_device_available() {
#if defined(DSV4_HAVE_CUDA)
  return cuda::device_available();
#else
  return false;
#endif
}

void require_profile_runs_on(const NumericsProfile& p, Device d, const char* what) {
  const std::vector<std::string> tc = tensor_core_sites(p);
  if (!tc.empty() && d != Device::cuda)
    throw InputError(fmt::format(
        "{}: profile '{}' is in fast numerics ({} = tensor_core): a GPU's tensor-core order, which the {} does "
        "not compute; run it with --device cuda, or use exact numerics",
        what, p.name, fmt::join(tc, ", "), to_string(d)));
}

void require_exact_numerics(const NumericsProfile& p, const char* what) {
  const std::vector<std::string> tc = tensor_core_sites(p);
  if (!tc.empty())
    throw InputError(fmt::format(
        "{}: profile '{}' is in fast numerics ({} = tensor_core), which is for forward passes only: the "
        "backward has no tensor-core order; use exact numerics",
        what, p.name, fmt::join(tc, ", ")));
}

namespace backend {

void require(const char* why, const char* op, int layer) {
  if (why) throw Error(fmt::format("internal: {} cannot run at layer {}: {}", op, layer, why));
}

RopeTables rope_tables(Backend& be, const ModelConfig& c, int64_t p0, int64_t T) {
  std::vector<int64_t> pos(static_cast<size_t>(std::max<int64_t>(T, 0)));
  for (int64_t t = 0; t < T; ++t) pos[size_t(t)] = p0 + t;
  const RopeSpec plain{c.qk_rope_head_dim, c.rope_theta, false};
  const RopeSpec comp{c.qk_rope_head_dim,
                      c.compress_rope_theta,
                      c.rope_scaling.type == "yarn",
                      c.rope_scaling.factor,
                      c.rope_scaling.original_max_position_embeddings,
                      c.rope_scaling.beta_fast,
                      c.rope_scaling.beta_slow};
  std::vector<float> freq_plain(static_cast<size_t>(c.qk_rope_head_dim / 2)), freq_comp(freq_plain.size());
  rope_freqs(plain, freq_plain.data());
  rope_freqs(comp, freq_comp.data());
  RopeTables r;
  r.pos = be.longs(T);
  be.upload(r.pos.data(), pos);
  r.plain = be.floats(int64_t(freq_plain.size()));
  be.upload(r.plain.data(), freq_plain);
  r.comp = be.floats(int64_t(freq_comp.size()));
  be.upload(r.comp.data(), freq_comp);
  return r;
}

RopeApplyParams rope_rows_params(const ModelConfig& c, float* x, int64_t T, int heads, int64_t head_dim,
                                 const int64_t* pos, const float* freq, bool inverse, bool round_bf16) {
  RopeApplyParams p;
  p.rows = T;
  p.heads = heads;
  p.x = x;
  p.ld = heads * head_dim;
  p.head_stride = head_dim;
  p.offset = head_dim - c.qk_rope_head_dim;
  p.pos = pos;
  p.freq = freq;
  p.rd = c.qk_rope_head_dim;
  p.inverse = inverse;
  p.round_bf16 = round_bf16;
  return p;
}

[[noreturn]] static void no_backward(const Backend& be, const char* op) {
  throw Error(fmt::format("the {} backend has no backward op '{}'", to_string(be.device()), op));
}
void Backend::zero(float*, int64_t) { no_backward(*this, "zero"); }
void Backend::add(float*, const float*, int64_t) { no_backward(*this, "add"); }
void Backend::gemm_dx(const GemmDxParams&) { no_backward(*this, "gemm_dx"); }
void Backend::gemm_dw(const GemmDwParams&) { no_backward(*this, "gemm_dw"); }
void Backend::rmsnorm_backward(const RmsNormBwdParams&) { no_backward(*this, "rmsnorm_backward"); }
void Backend::embed_backward(const float*, int64_t, const int32_t*, int64_t, int, float*) {
  no_backward(*this, "embed_backward");
}
void Backend::log_softmax_backward(const float*, int64_t, int64_t, const int32_t*, const float*, float, float*) {
  no_backward(*this, "log_softmax_backward");
}
void Backend::sparse_attention_backward(const SparseAttnBwdParams&) {
  no_backward(*this, "sparse_attention_backward");
}
void Backend::compressor_pool_backward(const CompressorPoolBwdParams&) {
  no_backward(*this, "compressor_pool_backward");
}
void Backend::hc_post_backward(const HcPostBwdParams&) { no_backward(*this, "hc_post_backward"); }
void Backend::hc_pre_backward(const HcPreBwdParams&) { no_backward(*this, "hc_pre_backward"); }
void Backend::hc_head_backward(const HcHeadBwdParams&) { no_backward(*this, "hc_head_backward"); }
void Backend::router_backward(const RouterBwdParams&) { no_backward(*this, "router_backward"); }
void Backend::moe_experts_backward(const MoeBwdParams&) { no_backward(*this, "moe_experts_backward"); }

namespace {
// The communicator must move the backend's memory: host buffers over MPI, device buffers over NCCL.
void check_memory(const Backend& be, const Communicator& comm, int layer) {
  const bool gpu = be.device() != Device::cpu;
  if (comm.device_memory() != gpu)
    throw InputError(fmt::format("layer {}: expert parallelism over {} moves {} memory, but the forward runs on "
                                 "the {}: {}",
                                 layer, comm.transport(), comm.device_memory() ? "GPU" : "host",
                                 gpu ? "GPU" : "CPU", gpu ? "use NCCL on GPUs" : "use MPI on CPUs"));
}

// The routed experts' weight gradients, each from its owner (model/expert_parallel.h
// expert_grad_matrices' order), through the backend's own memory: every rank ends with every expert's.
void gather_expert_grads(Backend& be, const MoeBwdParams& p, Communicator& comm) {
  const MoeParams& f = p.fwd;
  if (!p.grads || f.T <= 0) return;
  const int n = comm.size();
  const int64_t ID = f.I * f.D;
  const size_t mat = size_t(ID) * sizeof(float);
  std::vector<int64_t> bytes(size_t(n), 0);
  int64_t all_bytes = 0;
  for (int r = 0; r < n; ++r) {
    const ExpertRange e = expert_range(f.E, r, n);
    bytes[size_t(r)] = int64_t(expert_grad_matrices(p, e.first, e.last).size() * mat);
    all_bytes += bytes[size_t(r)];
  }
  const ExpertRange mine = expert_range(f.E, comm.rank(), n);
  Buffer<float> own = be.floats(std::max<int64_t>(bytes[size_t(comm.rank())] / int64_t(sizeof(float)), 1));
  Buffer<float> all = be.floats(std::max<int64_t>(all_bytes / int64_t(sizeof(float)), 1));
  float* at = own.data();
  for (float* g : expert_grad_matrices(p, mine.first, mine.last)) {
    be.copy(at, g, mat);
    at += ID;
  }
  be.synchronize();
  comm.all_gather_v(own.data(), all.data(), bytes);
  const float* from = all.data();
  for (float* g : expert_grad_matrices(p, 0, f.E)) {
    be.copy(g, from, mat);
    from += ID;
  }
}
}  // namespace

void Backend::moe_experts_backward_parallel(const MoeBwdParams& p, int layer, Communicator& comm) {
  check_memory(*this, comm, layer);
  dsv4::moe_experts_backward_parallel(p, comm);
  gather_expert_grads(*this, p, comm);
}

namespace {
// The experts a MoE computes, [e0, e1), must be among those this process loaded (MoeParams::loaded_*).
void require_loaded(const MoeParams& p, int e0, int e1, int layer) {
  const int last = p.loaded_last < 0 ? p.E : p.loaded_last;
  if (e0 < p.loaded_first || e1 > last)
    throw InputError(fmt::format("layer {}: the MoE needs experts {}..{} but this process loaded experts {}..{} only",
                                 layer, e0, e1 - 1, p.loaded_first, last - 1));
}
void require_own_loaded(const MoeParams& p, const Communicator& comm, int layer) {
  const ExpertRange mine = expert_range(p.E, comm.rank(), comm.size());
  require_loaded(p, mine.first, mine.last, layer);
}
}  // namespace

void Backend::moe_experts_parallel(const MoeParams& p, int layer, Communicator& comm) {
  check_memory(*this, comm, layer);
  require(moe_check(p), "moe", layer);
  require_own_loaded(p, comm, layer);
  dsv4::moe_experts_parallel(p, comm);
}
void Backend::moe_experts_dispatch(const MoeParams& p, int layer, Communicator& comm) {
  if (device() != Device::cpu)
    throw InputError(fmt::format("layer {}: sequences split among the ranks (--dp) run on the CPU only; on GPUs "
                                 "every rank runs every sequence (leave out --dp)",
                                 layer));
  check_memory(*this, comm, layer);
  require(moe_check(p), "moe", layer);
  require_own_loaded(p, comm, layer);
  dsv4::moe_experts_dispatch(p, comm);
}
void Backend::hadamard_backward(float*, int64_t, int64_t, int64_t) { no_backward(*this, "hadamard_backward"); }
void Backend::attention_mass(const AttentionMassParams&) { no_backward(*this, "attention_mass"); }
void Backend::indexer_kl(const IndexerKlParams&) { no_backward(*this, "indexer_kl"); }
void Backend::indexer_score_backward(const IndexerScoreBwdParams&) {
  no_backward(*this, "indexer_score_backward");
}

namespace {
std::atomic<int> digest_delay_us{0};  // set_digest_delay_for_tests
}  // namespace

void set_digest_delay_for_tests(int microseconds) {
  digest_delay_us.store(std::max(microseconds, 0));
}

namespace {

// ---- CPU: the reference kernels on host memory ---------------------------------------------------

template <typename T>
Buffer<T> host_buffer(int64_t n) {
  if (n <= 0) return {};
  return Buffer<T>(new T[size_t(n)](), n, [](void* p) { delete[] static_cast<T*>(p); });
}

class CpuBackend final : public Backend {
 public:
  explicit CpuBackend(const Weights& w) : w_(w) {}
  Device device() const override { return Device::cpu; }

  Buffer<float> floats(int64_t n) override { return host_buffer<float>(n); }
  Buffer<int32_t> ints(int64_t n) override { return host_buffer<int32_t>(n); }
  Buffer<int64_t> longs(int64_t n) override { return host_buffer<int64_t>(n); }
  Buffer<uint8_t> bytes(int64_t n) override { return host_buffer<uint8_t>(n); }
  Buffer<uint64_t> u64s(int64_t n) override { return host_buffer<uint64_t>(n); }
  void upload(void* dst, const void* host, size_t bytes) override {
    if (bytes) std::memcpy(dst, host, bytes);
  }
  void download(void* host, const void* src, size_t bytes) override {
    if (bytes) std::memcpy(host, src, bytes);
  }
  void copy(void* dst, const void* src, size_t bytes) override {
    if (bytes) std::memcpy(dst, src, bytes);
  }
  const float* weight(const std::string& name) override { return w_.f(name); }
  const int32_t* weight_i(const std::string& name) override { return w_.i(name); }

  void gemm(const GemmParams& p) override { dsv4::gemm(p); }
  void rmsnorm(const RmsNormParams& p) override { dsv4::rmsnorm(p); }
  void rope_apply(const RopeApplyParams& p) override { dsv4::rope_apply(p); }
  void quant_sim(const Fp8SimParams& p, QuantSim kind) override {
    switch (kind) {
      case QuantSim::none: return;
      case QuantSim::fp8: dsv4::fp8_sim(p); return;
      case QuantSim::fp8_inplace_bf16_cast: dsv4::fp8_sim_inplace_bf16_cast(p); return;
      case QuantSim::fp4: dsv4::fp4_sim(p); return;
    }
  }
  void compressor(const CompressorParams& p) override { dsv4::compressor(p); }
  void compressor_pool(const CompressorPoolParams& p) override { dsv4::compressor_pool(p); }
  void kv_store(const KvStoreParams& p) override { dsv4::kv_store(p); }
  void kv_load(const KvLoadParams& p) override { dsv4::kv_load(p); }
  void hadamard(float* x, int64_t rows, int64_t n, int64_t ld) override { dsv4::hadamard(x, rows, n, ld); }
  void scale_bf16(float* x, int64_t n, float scale) override {
    for (int64_t i = 0; i < n; ++i) x[i] = num::bf16_round(x[i] * scale);
  }
  void divide(float* x, int64_t n, float d) override {
    for (int64_t i = 0; i < n; ++i) x[i] = x[i] / d;
  }
  void embed(const float* table, int64_t D, const int32_t* tokens, int64_t T, int copies,
             float* out) override {
    for (int64_t t = 0; t < T; ++t)
      for (int j = 0; j < copies; ++j)
        std::copy(table + int64_t(tokens[t]) * D, table + int64_t(tokens[t] + 1) * D,
                  out + (t * copies + j) * D);
  }
  void indexer_topk(const IndexerParams& p) override { dsv4::indexer_topk(p); }
  void indexer_score_ids(const IndexerParams& p, const int32_t* ids, float* score) override {
    dsv4::indexer_score_ids(p, ids, score);
  }
  void build_index(const IndexBuildParams& p) override { dsv4::build_index(p); }
  void sparse_attention(const SparseAttnParams& p, int layer) override {
    require(sparse_attention_check(p), "sparse_attention", layer);
    dsv4::sparse_attention(p);
  }
  void hc_pre(const HcPreParams& p) override { dsv4::hc_pre(p); }
  void hc_post(const HcPostParams& p) override { dsv4::hc_post(p); }
  void hc_head(const HcHeadParams& p) override { dsv4::hc_head(p); }
  void router(const RouterParams& p) override { dsv4::router(p); }
  void moe_experts(const MoeParams& p, int layer) override {
    require(moe_check(p), "moe", layer);
    require_loaded(p, 0, p.E, layer);
    dsv4::moe_experts(p);
  }
  void log_softmax_gather(const float* logits, int64_t rows, int64_t V, const int32_t* target,
                          float* logprob) override {
    dsv4::log_softmax_gather(logits, rows, V, target, logprob);
  }
  void synchronize() override {}

  void zero(float* x, int64_t n) override {
    if (n > 0) std::memset(x, 0, size_t(n) * sizeof(float));
  }
  void add(float* y, const float* x, int64_t n) override {
    for (int64_t i = 0; i < n; ++i) y[i] = y[i] + x[i];
  }
  void gemm_dx(const GemmDxParams& p) override { dsv4::gemm_dx(p); }
  void gemm_dw(const GemmDwParams& p) override { dsv4::gemm_dw(p); }
  void rmsnorm_backward(const RmsNormBwdParams& p) override { dsv4::rmsnorm_backward(p); }
  void embed_backward(const float* dH, int64_t D, const int32_t* tokens, int64_t T, int copies,
                      float* dtable) override {
    dsv4::embed_backward(dH, D, tokens, T, copies, dtable);
  }
  void log_softmax_backward(const float* logits, int64_t rows, int64_t V, const int32_t* target,
                            const float* dlogprob, float temperature, float* dlogits) override {
    dsv4::log_softmax_backward(logits, rows, V, target, dlogprob, temperature, dlogits);
  }
  void sparse_attention_backward(const SparseAttnBwdParams& p) override {
    require(sparse_attention_backward_check(p), "sparse_attention_backward", -1);
    dsv4::sparse_attention_backward(p);
  }
  void compressor_pool_backward(const CompressorPoolBwdParams& p) override { dsv4::compressor_pool_backward(p); }
  void hc_post_backward(const HcPostBwdParams& p) override { dsv4::hc_post_backward(p); }
  void hc_pre_backward(const HcPreBwdParams& p) override { dsv4::hc_pre_backward(p); }
  void hc_head_backward(const HcHeadBwdParams& p) override { dsv4::hc_head_backward(p); }
  void router_backward(const RouterBwdParams& p) override { dsv4::router_backward(p); }
  void moe_experts_backward(const MoeBwdParams& p) override { dsv4::moe_experts_backward(p); }
  void hadamard_backward(float* x, int64_t rows, int64_t n, int64_t ld) override {
    dsv4::hadamard_backward(x, rows, n, ld);
  }
  void attention_mass(const AttentionMassParams& p) override {
    require(attention_mass_check(p), "attention_mass", -1);
    dsv4::attention_mass(p);
  }
  void indexer_kl(const IndexerKlParams& p) override {
    require(indexer_kl_check(p), "indexer_kl", -1);
    dsv4::indexer_kl(p);
  }
  void indexer_score_backward(const IndexerScoreBwdParams& p) override {
    require(indexer_score_backward_check(p), "indexer_score_backward", -1);
    dsv4::indexer_score_backward(p);
  }

 private:
  const Weights& w_;
};

#if defined(DSV4_HAVE_CUDA)

// ---- CUDA: weights uploaded once per Weights object -----------------------------------------------

// The device copy of one Weights object: every tensor in one allocation. `host` and `sizes` identify
// the host data it was copied from (a Weights object later created at the same address has other
// tensor storage, so it is uploaded afresh). Its float tensors of 2 or more dimensions are registered
// for bf16 copies kept across the fast numerics' GEMMs (cuda::keep_bf16_weights): nothing writes to
// the arena.
struct DeviceWeights {
  std::vector<const void*> host;
  std::vector<size_t> sizes;
  void* arena = nullptr;
  size_t arena_bytes = 0;
  std::map<std::string, const void*> ptr;
  DeviceWeights() = default;
  DeviceWeights(const DeviceWeights&) = delete;
  DeviceWeights& operator=(const DeviceWeights&) = delete;
  ~DeviceWeights() {
    if (!arena) return;
    cuda::forget_bf16_weights(arena, static_cast<char*>(arena) + arena_bytes);
    cudaFree(arena);  // errors ignored: this may run while the process exits
  }
};

void fingerprint(const Weights& w, std::vector<const void*>& host, std::vector<size_t>& sizes) {
  host.clear();
  sizes.clear();
  for (const auto& [name, t] : w.tensors()) {
    host.push_back(t.f.empty() ? static_cast<const void*>(t.i.data()) : static_cast<const void*>(t.f.data()));
    sizes.push_back(t.f.empty() ? t.i.size() * sizeof(int32_t) : t.f.size() * sizeof(float));
  }
}

std::unique_ptr<DeviceWeights> upload_weights(const Weights& w) {
  auto d = std::make_unique<DeviceWeights>();
  fingerprint(w, d->host, d->sizes);
  constexpr size_t kAlign = 256;
  size_t total = 0;
  for (size_t s : d->sizes) total += (s + kAlign - 1) / kAlign * kAlign;
  if (total) CUDA_CHECK(cudaMalloc(&d->arena, total));
  d->arena_bytes = total;
  size_t off = 0, i = 0;
  for (const auto& [name, t] : w.tensors()) {
    char* dst = static_cast<char*>(d->arena) + off;
    if (d->sizes[i]) CUDA_CHECK(cudaMemcpy(dst, d->host[i], d->sizes[i], cudaMemcpyHostToDevice));
    if (!t.f.empty() && t.shape.size() >= 2) {  // a matrix of rows of its last dimension
      int64_t rows = 1;
      for (size_t a = 0; a + 1 < t.shape.size(); ++a) rows *= t.shape[a];
      cuda::keep_bf16_weights(reinterpret_cast<const float*>(dst), rows, t.shape.back());
    }
    d->ptr[name] = dst;
    off += (d->sizes[i] + kAlign - 1) / kAlign * kAlign;
    ++i;
  }
  return d;
}

std::mutex& cache_mutex() {
  static std::mutex m;
  return m;
}

// A process-wide T that lives until exit. It is created after the CUDA runtime is initialised, so it
// is destroyed (and frees its device or pinned memory) before the runtime shuts down.
template <typename T>
T& after_runtime() {
  static const bool runtime_ready = (cudaFree(nullptr), true);
  (void)runtime_ready;
  static T object;
  return object;
}

std::map<const Weights*, std::unique_ptr<DeviceWeights>>& weight_cache() {
  return after_runtime<std::map<const Weights*, std::unique_ptr<DeviceWeights>>>();
}

const DeviceWeights& device_weights(const Weights& w) {
  std::lock_guard<std::mutex> lock(cache_mutex());
  auto& cache = weight_cache();
  auto& entry = cache[&w];
  if (entry) {
    std::vector<const void*> host;
    std::vector<size_t> sizes;
    fingerprint(w, host, sizes);
    if (host == entry->host && sizes == entry->sizes) return *entry;
    entry.reset();
  }
  entry = upload_weights(w);
  return *entry;
}

// ---- CUDA: pinned host memory and asynchronous downloads -------------------------------------------

// CUDA objects kept for reuse by size class (making them costs far more than the copies they serve):
// Traits::make(size) and Traits::destroy(object). The objects held are at most what was once in use.
template <typename Traits>
class ReusePool {
 public:
  using T = typename Traits::Object;
  ~ReusePool() {
    for (auto& [size, objects] : free_)
      for (T o : objects) Traits::destroy(o);  // errors ignored: this may run while the process exits
  }
  T take(size_t size) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto& objects = free_[size];
      if (!objects.empty()) {
        T o = objects.back();
        objects.pop_back();
        return o;
      }
    }
    return Traits::make(size);
  }
  void give(T o, size_t size) {
    std::lock_guard<std::mutex> lock(mu_);
    free_[size].push_back(o);
  }

 private:
  std::mutex mu_;
  std::map<size_t, std::vector<T>> free_;
};

// Pinned host blocks for asynchronous downloads, in power-of-two sizes (pinned_size).
struct PinnedBlocks {
  using Object = void*;
  static void* make(size_t size) {
    void* p = nullptr;
    CUDA_CHECK(cudaHostAlloc(&p, size, cudaHostAllocDefault));
    return p;
  }
  static void destroy(void* p) { cudaFreeHost(p); }
};
size_t pinned_size(size_t bytes) { return std::bit_ceil(std::max<size_t>(bytes, 4096)); }

// The events that say a download has landed (one size class).
struct DoneEvents {
  using Object = cudaEvent_t;
  static cudaEvent_t make(size_t) {
    cudaEvent_t e = nullptr;
    CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
    return e;
  }
  static void destroy(cudaEvent_t e) { cudaEventDestroy(e); }
};

ReusePool<PinnedBlocks>& pinned_pool() { return after_runtime<ReusePool<PinnedBlocks>>(); }
ReusePool<DoneEvents>& event_pool() { return after_runtime<ReusePool<DoneEvents>>(); }

// One pinned block holding every part at its offset (the layout of the device snapshot it is copied
// from in one piece), and the event that says the copy has landed.
class CudaAsyncDownload final : public Backend::AsyncDownload {
 public:
  CudaAsyncDownload(std::vector<size_t> offsets, std::vector<size_t> sizes, size_t total)
      : offsets_(std::move(offsets)), sizes_(std::move(sizes)), done_(event_pool().take(0)) {
    if (total) {
      block_size_ = pinned_size(total);
      block_ = pinned_pool().take(block_size_);
    }
  }
  ~CudaAsyncDownload() override {
    // The block goes back to the pool only once no copy writes into it.
    if (recorded_ && !landed_) cudaEventSynchronize(done_);
    event_pool().give(done_, 0);
    if (block_) pinned_pool().give(block_, block_size_);
  }
  bool ready() override {
    if (landed_ || !recorded_) return landed_ = true;
    const cudaError_t e = cudaEventQuery(done_);
    if (e == cudaErrorNotReady) return false;
    CUDA_CHECK(e);
    return landed_ = true;
  }
  void wait() override {
    if (landed_ || !recorded_) return;
    CUDA_CHECK(cudaEventSynchronize(done_));
    landed_ = true;
  }
  const void* part(size_t i) const override {
    return sizes_.at(i) ? static_cast<const char*>(block_) + offsets_[i] : nullptr;
  }
  size_t bytes() const override { return block_size_; }

  void* block() const { return block_; }
  void record(cudaStream_t s) {
    CUDA_CHECK(cudaEventRecord(done_, s));
    recorded_ = true;
  }

 private:
  std::vector<size_t> offsets_, sizes_;
  void* block_ = nullptr;
  size_t block_size_ = 0;
  cudaEvent_t done_;
  bool recorded_ = false, landed_ = false;
};

class CudaBackend final : public Backend {
 public:
  explicit CudaBackend(const Weights& w) : w_(w), dw_(device_weights(w)) {
    cuda::keep_scratch_memory();
    // The model's kernels go first: the digests of late reports (digests_) fill the SMs they leave.
    int highest = 0;
    CUDA_CHECK(cudaDeviceGetStreamPriorityRange(&lowest_priority_, &highest));
    CUDA_CHECK(cudaStreamCreateWithPriority(&s_, cudaStreamNonBlocking, highest));
  }
  ~CudaBackend() override {
    cudaStreamSynchronize(s_);
    if (digests_) {
      cudaStreamSynchronize(digests_);
      settle_reads();  // every read is done: the deferred frees go out on s_
      for (const Reads& r : reads_) event_pool().give(r.done, 0);  // left only after an error
      for (const Deferred& d : deferred_) cudaFreeAsync(d.p, s_);
      cudaStreamSynchronize(s_);
      cudaStreamDestroy(digests_);
    }
    cudaStreamDestroy(s_);
    if (copies_) {  // downloads still in flight keep their own events; their copies complete
      cudaStreamSynchronize(copies_);
      cudaStreamDestroy(copies_);
      cudaEventDestroy(taken_);
    }
  }
  Device device() const override { return Device::cuda; }

  Buffer<float> floats(int64_t n) override { return alloc<float>(n); }
  Buffer<int32_t> ints(int64_t n) override { return alloc<int32_t>(n); }
  Buffer<int64_t> longs(int64_t n) override { return alloc<int64_t>(n); }
  Buffer<uint8_t> bytes(int64_t n) override { return alloc<uint8_t>(n); }
  Buffer<uint64_t> u64s(int64_t n) override { return alloc<uint64_t>(n); }
  void upload(void* dst, const void* host, size_t bytes) override {
    if (bytes) CUDA_CHECK(cudaMemcpyAsync(dst, host, bytes, cudaMemcpyHostToDevice, s_));
  }
  void download(void* host, const void* src, size_t bytes) override {
    if (!bytes) return;
    CUDA_CHECK(cudaMemcpyAsync(host, src, bytes, cudaMemcpyDeviceToHost, s_));
    CUDA_CHECK(cudaStreamSynchronize(s_));
  }
  void copy(void* dst, const void* src, size_t bytes) override {
    if (bytes) CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, s_));
  }
  const float* weight(const std::string& name) override {
    w_.get(name);  // throws WeightsError naming an unknown tensor
    return static_cast<const float*>(dw_.ptr.at(name));
  }
  const int32_t* weight_i(const std::string& name) override {
    w_.get(name);
    return static_cast<const int32_t*>(dw_.ptr.at(name));
  }

  void gemm(const GemmParams& p) override { cuda::gemm(p, s_); }
  Buffer<uint16_t> gemm_x_copy(const float* x, int64_t rows, int64_t k, int64_t ldx,
                               ReduceOrder order) override {
    if (!order.tensor_core || rows <= 0 || k <= 0) return {};
    Buffer<uint16_t> copy = alloc<uint16_t>(rows * cuda::gemm_bf16_row_width(k));
    cuda::gemm_x_to_bf16(x, rows, k, ldx, copy.data(), s_);
    return copy;
  }
  void rmsnorm(const RmsNormParams& p) override { cuda::rmsnorm(p, s_); }
  void rope_apply(const RopeApplyParams& p) override { cuda::rope_apply(p, s_); }
  void quant_sim(const Fp8SimParams& p, QuantSim kind) override {
    switch (kind) {
      case QuantSim::none: return;
      case QuantSim::fp8: cuda::fp8_sim(p, s_); return;
      case QuantSim::fp8_inplace_bf16_cast: cuda::fp8_sim_inplace_bf16_cast(p, s_); return;
      case QuantSim::fp4: cuda::fp4_sim(p, s_); return;
    }
  }
  void compressor(const CompressorParams& p) override { cuda::compressor(p, s_); }
  void compressor_pool(const CompressorPoolParams& p) override { cuda::compressor_pool(p, s_); }
  void kv_store(const KvStoreParams& p) override { cuda::kv_store(p, s_); }
  void kv_load(const KvLoadParams& p) override { cuda::kv_load(p, s_); }
  void hadamard(float* x, int64_t rows, int64_t n, int64_t ld) override {
    cuda::hadamard(x, rows, n, ld, s_);
  }
  void scale_bf16(float* x, int64_t n, float scale) override { cuda::scale_bf16(x, n, scale, s_); }
  void divide(float* x, int64_t n, float d) override { cuda::divide(x, n, d, s_); }
  void embed(const float* table, int64_t D, const int32_t* tokens, int64_t T, int copies,
             float* out) override {
    cuda::embed_streams(table, D, tokens, T, copies, out, s_);
  }
  void indexer_topk(const IndexerParams& p) override { cuda::indexer_topk(p, s_); }
  void indexer_score_ids(const IndexerParams& p, const int32_t* ids, float* score) override {
    cuda::indexer_score_ids(p, ids, score, s_);
  }
  void build_index(const IndexBuildParams& p) override { cuda::build_index(p, s_); }
  void sparse_attention(const SparseAttnParams& p, int layer) override {
    require(cuda::sparse_attention_check(p), "sparse_attention", layer);
    cuda::sparse_attention(p, s_);
  }
  void hc_pre(const HcPreParams& p) override { cuda::hc_pre(p, s_); }
  void hc_post(const HcPostParams& p) override { cuda::hc_post(p, s_); }
  void hc_head(const HcHeadParams& p) override { cuda::hc_head(p, s_); }
  void router(const RouterParams& p) override { cuda::router(p, s_); }
  void moe_experts(const MoeParams& p, int layer) override {
    require(cuda::moe_check(p), "moe", layer);
    require_loaded(p, 0, p.E, layer);
    cuda::moe_experts(p, s_);
  }
  // As the CPU's moe_experts_parallel (model/expert_parallel.h), on the device: this rank's pairs'
  // outputs, gathered in rank order (= the pairs of every expert in order, since each rank owns a
  // contiguous block), put back in slot order and summed as moe_experts sums them.
  void moe_experts_parallel(const MoeParams& p, int layer, Communicator& comm) override {
    check_memory(*this, comm, layer);
    require(cuda::moe_check(p), "moe", layer);
    require_own_loaded(p, comm, layer);
    if (p.T <= 0) return;
    const std::vector<int64_t> pairs = pairs_per_rank(cuda::moe_expert_counts(p, s_), comm.size());
    std::vector<int64_t> sizes;
    int64_t rows = 0;
    for (const int64_t m : pairs) {
      sizes.push_back(m * p.D * int64_t(sizeof(float)));
      rows += m;
    }
    const ExpertRange mine = expert_range(p.E, comm.rank(), comm.size());
    Buffer<float> y = floats(std::max<int64_t>(sizes[size_t(comm.rank())] / int64_t(sizeof(float)), 1));
    Buffer<float> all = floats(std::max<int64_t>(rows * p.D, 1)), slot = floats(p.T * p.k * p.D);
    cuda::moe_routed_outputs(p, mine.first, mine.last, y.data(), s_);
    CUDA_CHECK(cudaStreamSynchronize(s_));
    comm.all_gather_v(y.data(), all.data(), sizes);
    cuda::moe_scatter_pairs(p, all.data(), slot.data(), s_);
    cuda::moe_combine(p, slot.data(), p.out, s_);
  }
  void log_softmax_gather(const float* logits, int64_t rows, int64_t V, const int32_t* target,
                          float* logprob) override {
    cuda::log_softmax_gather(logits, rows, V, target, logprob, s_);
  }
  bool row_digests(const void* data, DType dt, int64_t rows, int64_t row_elems, uint64_t* out) override {
    if (rows <= 0) return true;
    Buffer<uint64_t> d = alloc<uint64_t>(rows);
    enqueue_digests(data, dt, rows, row_elems, d.data(), s_);
    download(out, d.data(), size_t(rows) * sizeof(uint64_t));
    return true;
  }
  void synchronize() override {
    CUDA_CHECK(cudaStreamSynchronize(s_));
    if (digests_) {
      CUDA_CHECK(cudaStreamSynchronize(digests_));
      settle_reads();
    }
  }

  // The snapshot is one device buffer, laid out as the pinned block it goes to: the copied parts are
  // copied into it on the compute stream; the digest parts' kernels write it on the digest stream,
  // which waits for the compute stream's work so far and reads the reported buffers while the model
  // goes on (those buffers are not written again, and their frees are deferred: release()). The copy stream
  // waits for both, copies the snapshot in one piece and frees it, stream-ordered, so the compute
  // stream never waits for a download.
  std::unique_ptr<AsyncDownload> download_async(const std::vector<AsyncPart>& parts) override {
    constexpr size_t kAlign = 256;
    auto align = [](size_t n) { return (n + kAlign - 1) / kAlign * kAlign; };
    std::vector<size_t> offsets, sizes;
    size_t total = 0;
    for (const AsyncPart& a : parts) {
      offsets.push_back(total);
      sizes.push_back(a.host_bytes());
      total += align(a.host_bytes());
    }
    if (!copies_) {
      CUDA_CHECK(cudaStreamCreateWithFlags(&copies_, cudaStreamNonBlocking));
      CUDA_CHECK(cudaStreamCreateWithPriority(&digests_, cudaStreamNonBlocking, lowest_priority_));
      CUDA_CHECK(cudaEventCreateWithFlags(&taken_, cudaEventDisableTiming));
    }
    settle_reads();
    auto d = std::make_unique<CudaAsyncDownload>(offsets, sizes, total);
    if (total == 0) return d;
    char* snap = nullptr;
    CUDA_CHECK(cudaMallocAsync(reinterpret_cast<void**>(&snap), total, s_));
    Reads reads{nullptr, {}, 0};
    try {  // digest parts: a kernel each; the other parts: copied together, whole words in one launch
      std::vector<cuda::WordCopy> words;
      auto copy_words = [&] {
        cuda::copy_words(words.data(), int(words.size()), s_);
        words.clear();
      };
      for (size_t i = 0; i < parts.size(); ++i) {
        const AsyncPart& a = parts[i];
        if (!sizes[i]) continue;
        char* at = snap + offsets[i];
        if (a.digests) {
          if (!reads.done) {  // the first digest part: the digest stream catches up with the model
            reads.done = event_pool().take(0);
            CUDA_CHECK(cudaEventRecord(reads.done, s_));
            CUDA_CHECK(cudaStreamWaitEvent(digests_, reads.done, 0));
            cuda::digest_delay(digest_delay_us.load(), digests_);
          }
          if (a.sums) {
            const int64_t nb = a.row_elems / xxh3::kSumRowValues;
            if (a.dt != DType::bf16 || !xxh3::bf16_row_has_sums(a.row_elems))
              throw std::logic_error("download_async: block sums of rows that have none");
            const char* src = reinterpret_cast<const char*>(a.sums);
            reads.ranges.push_back({src, src + size_t(a.rows * nb) * 64});
            cuda::digests_from_sums(a.sums, a.rows, nb, reinterpret_cast<uint64_t*>(at), digests_);
          } else {
            const char* src = static_cast<const char*>(a.src);
            reads.ranges.push_back({src, src + size_t(a.rows) * size_t(a.row_elems) * 4});
            enqueue_digests(a.src, a.dt, a.rows, a.row_elems, reinterpret_cast<uint64_t*>(at), digests_);
          }
        } else if (sizes[i] % 4 == 0 && reinterpret_cast<uintptr_t>(a.src) % 4 == 0) {
          words.push_back({reinterpret_cast<uint32_t*>(at), static_cast<const uint32_t*>(a.src), int64_t(sizes[i] / 4)});
          if (words.size() == size_t(cuda::kMaxWordCopies)) copy_words();
        } else {
          CUDA_CHECK(cudaMemcpyAsync(at, a.src, sizes[i], cudaMemcpyDeviceToDevice, s_));
        }
      }
      if (!words.empty()) copy_words();
      CUDA_CHECK(cudaEventRecord(taken_, s_));
      CUDA_CHECK(cudaStreamWaitEvent(copies_, taken_, 0));
      if (reads.done) {
        CUDA_CHECK(cudaEventRecord(reads.done, digests_));
        CUDA_CHECK(cudaStreamWaitEvent(copies_, reads.done, 0));
        reads.seq = next_read_++;
        reads_.push_back(std::move(reads));
      }
    } catch (...) {
      if (reads.done) {  // the digest stream may have started: nothing may reuse what it reads
        cudaStreamSynchronize(digests_);
        event_pool().give(reads.done, 0);
      }
      cudaFreeAsync(snap, s_);
      throw;
    }
    try {  // from here on the snapshot is the copy stream's
      CUDA_CHECK(cudaMemcpyAsync(d->block(), snap, total, cudaMemcpyDeviceToHost, copies_));
      d->record(copies_);
    } catch (...) {
      cudaFreeAsync(snap, copies_);
      throw;
    }
    CUDA_CHECK(cudaFreeAsync(snap, copies_));
    return d;
  }

  void zero(float* x, int64_t n) override { cuda::zero(x, n, s_); }
  void add(float* y, const float* x, int64_t n) override { cuda::add(y, x, n, s_); }
  void gemm_dx(const GemmDxParams& p) override { cuda::gemm_dx(p, s_); }
  void gemm_dw(const GemmDwParams& p) override { cuda::gemm_dw(p, s_); }
  void rmsnorm_backward(const RmsNormBwdParams& p) override { cuda::rmsnorm_backward(p, s_); }
  void embed_backward(const float* dH, int64_t D, const int32_t* tokens, int64_t T, int copies,
                      float* dtable) override {
    cuda::embed_backward(dH, D, tokens, T, copies, dtable, w_.config().vocab_size, s_);
  }
  void log_softmax_backward(const float* logits, int64_t rows, int64_t V, const int32_t* target,
                            const float* dlogprob, float temperature, float* dlogits) override {
    cuda::log_softmax_backward(logits, rows, V, target, dlogprob, temperature, dlogits, s_);
  }
  void sparse_attention_backward(const SparseAttnBwdParams& p) override { cuda::sparse_attention_backward(p, s_); }
  void compressor_pool_backward(const CompressorPoolBwdParams& p) override { cuda::compressor_pool_backward(p, s_); }
  void hc_post_backward(const HcPostBwdParams& p) override { cuda::hc_post_backward(p, s_); }
  void hc_pre_backward(const HcPreBwdParams& p) override { cuda::hc_pre_backward(p, s_); }
  void hc_head_backward(const HcHeadBwdParams& p) override { cuda::hc_head_backward(p, s_); }
  void router_backward(const RouterBwdParams& p) override { cuda::router_backward(p, s_); }
  void moe_experts_backward(const MoeBwdParams& p) override { cuda::moe_experts_backward(p, s_); }
  // As the CPU's moe_experts_backward_parallel (model/expert_parallel.h), on the device: this rank's
  // experts' part, the pairs' gradients gathered in rank order (= every expert's pairs in order) and
  // combined, then the routed experts' weight gradients from their owners.
  void moe_experts_backward_parallel(const MoeBwdParams& p, int layer, Communicator& comm) override {
    check_memory(*this, comm, layer);
    const MoeParams& f = p.fwd;
    if (f.T <= 0) return;
    if (!f.ids) throw InputError(fmt::format("layer {}: moe backward without routing ids", layer));
    std::vector<int32_t> ids(size_t(f.T * f.k));
    download(ids.data(), f.ids, ids.size() * sizeof(int32_t));
    std::vector<int64_t> count(size_t(f.E), 0);
    for (const int32_t id : ids)
      if (id >= 0 && id < f.E) ++count[size_t(id)];  // a bad id is named by the kernels' check
    const int n = comm.size();
    const std::vector<int64_t> pairs = pairs_per_rank(count, n);
    int64_t total = 0;
    std::vector<int64_t> dx_bytes, dw_bytes;
    for (const int64_t m : pairs) {
      dx_bytes.push_back(p.dx ? m * f.D * int64_t(sizeof(float)) : 0);
      dw_bytes.push_back(m * int64_t(sizeof(float)));
      total += m;
    }
    const ExpertRange mine = expert_range(f.E, comm.rank(), n);
    const int64_t m = pairs[size_t(comm.rank())];
    const int64_t rows_dx = p.dx ? m * f.D : 0, all_dx = p.dx ? total * f.D : 0;
    Buffer<float> dx1 = floats(std::max<int64_t>(rows_dx, 1)), dx3 = floats(std::max<int64_t>(rows_dx, 1)),
                  dw = floats(std::max<int64_t>(m, 1));
    cuda::moe_backward_routed(p, mine.first, mine.last, dx1.data(), dx3.data(), dw.data(), s_);
    CUDA_CHECK(cudaStreamSynchronize(s_));
    Buffer<float> dx1_all = floats(std::max<int64_t>(all_dx, 1)), dx3_all = floats(std::max<int64_t>(all_dx, 1)),
                  dw_all = floats(std::max<int64_t>(total, 1));
    if (p.dx) {
      comm.all_gather_v(dx1.data(), dx1_all.data(), dx_bytes);
      comm.all_gather_v(dx3.data(), dx3_all.data(), dx_bytes);
    }
    comm.all_gather_v(dw.data(), dw_all.data(), dw_bytes);
    cuda::moe_backward_combine(p, dx1_all.data(), dx3_all.data(), dw_all.data(), s_);

    gather_expert_grads(*this, p, comm);
  }
  void hadamard_backward(float* x, int64_t rows, int64_t n, int64_t ld) override {
    cuda::hadamard_backward(x, rows, n, ld, s_);
  }
  void attention_mass(const AttentionMassParams& p) override { cuda::attention_mass(p, s_); }
  void indexer_kl(const IndexerKlParams& p) override { cuda::indexer_kl(p, s_); }
  void indexer_score_backward(const IndexerScoreBwdParams& p) override { cuda::indexer_score_backward(p, s_); }

 private:
  // The per-row digests of [rows, row_elems] of `dt` at `data` into out[rows] (device memory), on
  // `stream`.
  static void enqueue_digests(const void* data, DType dt, int64_t rows, int64_t row_elems, uint64_t* out,
                              cudaStream_t stream) {
    if (dt != DType::bf16)
      cuda::digest_rows(data, rows, row_elems * 4, out, stream);
    else
      cuda::digest_rows_bf16(static_cast<const float*>(data), rows, row_elems, out, stream);
  }

  template <typename T>
  Buffer<T> alloc(int64_t n) {
    if (n <= 0) return {};
    void* p = nullptr;
    const size_t bytes = size_t(n) * sizeof(T);
    CUDA_CHECK(cudaMallocAsync(&p, bytes, s_));
    return Buffer<T>(static_cast<T*>(p), n, [this, bytes](void* q) { release(q, bytes); });
  }
  // Frees a buffer in stream order. A buffer that digests still read is freed once they have
  // (settle_reads), so the compute stream does not wait for the digest stream, which runs at the
  // lowest priority and may be far behind; past kDeferredBytes of such buffers the compute stream
  // waits for the digests instead (the memory may go to the next allocation at once).
  void release(void* p, size_t bytes) noexcept {
    const char* b = static_cast<const char*>(p);
    const char* e = b + bytes;
    const Reads* last = nullptr;  // the events complete in order: the last one reading p is enough
    for (const Reads& r : reads_)
      for (const auto& [rb, re] : r.ranges)
        if (rb < e && b < re) last = &r;
    bool deferred = false;
    if (last && deferred_bytes_ + bytes <= kDeferredBytes) try {
        deferred_.push_back({p, bytes, last->seq});
        deferred_bytes_ += bytes;
        deferred = true;
      } catch (...) {  // no memory for the list: wait, as past the bound
      }
    if (last && !deferred) cudaStreamWaitEvent(s_, last->done, 0);
    if (!deferred) cudaFreeAsync(p, s_);
    if (reads_.size() > kReadsKept || !deferred_.empty()) settle_reads();
  }
  // Forgets the reads that have finished and frees the buffers that waited for them.
  void settle_reads() noexcept {
    while (!reads_.empty()) {
      const cudaEvent_t e = reads_.front().done;
      if (cudaEventQuery(e) != cudaSuccess) break;
      event_pool().give(e, 0);
      settled_ = reads_.front().seq + 1;
      reads_.pop_front();
    }
    std::erase_if(deferred_, [&](const Deferred& d) {
      if (d.read >= settled_) return false;
      cudaFreeAsync(d.p, s_);
      deferred_bytes_ -= d.bytes;
      return true;
    });
  }

  const Weights& w_;
  const DeviceWeights& dw_;
  cudaStream_t s_ = nullptr;       // the compute stream, of the highest priority
  int lowest_priority_ = 0;        // the digest stream's
  cudaStream_t copies_ = nullptr;  // asynchronous downloads (created on the first)
  cudaStream_t digests_ = nullptr;  // their digest kernels (created with copies_)
  cudaEvent_t taken_ = nullptr;    // recorded on s_ after a download's snapshot; copies_ waits for it
  // The buffers the digest stream reads, a download's ranges with the event recorded after its digests,
  // oldest first; finished ones are forgotten at the next download or past kReadsKept.
  struct Reads {
    cudaEvent_t done;
    std::vector<std::pair<const char*, const char*>> ranges;
    uint64_t seq;  // the downloads' count before this one's
  };
  static constexpr size_t kReadsKept = 64;
  std::deque<Reads> reads_;
  uint64_t next_read_ = 0;  // the next Reads' seq
  uint64_t settled_ = 0;    // every Reads before this seq has finished
  // Buffers released while digests read them (Reads `read` and earlier), not yet freed.
  struct Deferred {
    void* p;
    size_t bytes;
    uint64_t read;
  };
  static constexpr size_t kDeferredBytes = size_t(1) << 30;
  std::vector<Deferred> deferred_;
  size_t deferred_bytes_ = 0;
};

#endif  // DSV4_HAVE_CUDA

}  // namespace

std::unique_ptr<Backend> make_backend(Device d, const Weights& w) {
  if (d == Device::cpu) return std::make_unique<CpuBackend>(w);
#if defined(DSV4_HAVE_CUDA)
  if (!cuda::device_available()) throw InputError("device 'cuda': no usable CUDA device was found");
  return std::make_unique<CudaBackend>(w);
#else
  throw InputError("device 'cuda': this dsv4 was built without CUDA");
#endif
}

}  // namespace backend
}  // namespace dsv4
