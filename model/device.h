// Where the forward runs (Device) and the backend seam the graph in model/forward.cpp is written
// against: buffers plus one call per kernel, with the CPU reference (kernels/cpu) and the CUDA
// backend (kernels/cuda, built with DSV4_CUDA) behind it.
//
// A backend takes the same Params structs as the kernels; every pointer in them is backend memory
// (host memory for the CPU, device memory for CUDA) obtained from Buffer or weight(). Results are
// bit-identical across backends (docs/NUMERICS.md); only what the graph downloads (decisions,
// log-probabilities, row digests, and the reported tensors an Observer asks for) crosses to the host.
#pragma once

#include <algorithm>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "kernels/attention.h"
#include "kernels/compressor.h"
#include "kernels/grad.h"
#include "kernels/indexer.h"
#include "kernels/kvcache.h"
#include "kernels/linear.h"
#include "kernels/mhc.h"
#include "kernels/moe.h"
#include "kernels/norm.h"
#include "kernels/quant.h"
#include "kernels/rope.h"
#include "model/communicator.h"
#include "model/observer.h"
#include "model/profile.h"
#include "model/weights.h"

namespace dsv4 {

enum class Device { cpu, cuda };
const char* to_string(Device d);
// "cpu" or "cuda"; anything else throws InputError naming the accepted values.
Device parse_device(const std::string& name);
// Whether this dsv4 was built with the CUDA backend, and whether a CUDA device is usable now.
bool cuda_built();
bool cuda_device_available();
// Throws InputError when profile `p` cannot run on `d` in `what` ("forward", "generate", ...): fast
// numerics (model/profile.h tensor_core_sites) run on CUDA only.
void require_profile_runs_on(const NumericsProfile& p, Device d, const char* what);
// Throws InputError when `p` is in fast numerics: `what` (the training step, its replay) has no
// tensor-core order for its backward.
void require_exact_numerics(const NumericsProfile& p, const char* what);

namespace backend {

// An owned array in one backend's memory. Move-only; the contents of a new buffer are zero on the CPU
// and unspecified on CUDA (every op writes all of its outputs).
template <typename T>
class Buffer {
 public:
  Buffer() = default;
  Buffer(T* p, int64_t n, std::function<void(void*)> release) : p_(p), n_(n), release_(std::move(release)) {}
  Buffer(Buffer&& o) noexcept { swap(o); }
  Buffer& operator=(Buffer&& o) noexcept {
    Buffer tmp(std::move(o));
    swap(tmp);
    return *this;
  }
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
  ~Buffer() {
    if (p_ && release_) release_(p_);
  }
  T* data() const { return p_; }
  int64_t size() const { return n_; }
  size_t bytes() const { return size_t(n_) * sizeof(T); }

 private:
  void swap(Buffer& o) noexcept {
    std::swap(p_, o.p_);
    std::swap(n_, o.n_);
    std::swap(release_, o.release_);
  }
  T* p_ = nullptr;
  int64_t n_ = 0;
  std::function<void(void*)> release_;
};

// Turns a kernel's `*_check` answer into an exception naming the op and the layer.
void require(const char* why, const char* op, int layer);

// One thread at a time uses a backend and frees its buffers (a device backend's work goes to one
// compute stream, and its buffers' frees consult the downloads still reading them). Its buffers are
// freed before it is destroyed.
class Backend {
 public:
  virtual ~Backend() = default;
  virtual Device device() const = 0;

  // ---- memory
  virtual Buffer<float> floats(int64_t n) = 0;
  virtual Buffer<int32_t> ints(int64_t n) = 0;
  virtual Buffer<int64_t> longs(int64_t n) = 0;
  virtual Buffer<uint8_t> bytes(int64_t n) = 0;
  virtual Buffer<uint64_t> u64s(int64_t n) = 0;
  virtual void upload(void* dst, const void* host, size_t bytes) = 0;  // host -> backend
  virtual void download(void* host, const void* src,
                        size_t bytes) = 0;                          // backend -> host, complete on return
  virtual void copy(void* dst, const void* src, size_t bytes) = 0;  // within the backend
  // The weights of the Weights object the backend was made for (uploaded once per object for CUDA).
  virtual const float* weight(const std::string& name) = 0;
  virtual const int32_t* weight_i(const std::string& name) = 0;

  // ---- ops (shape checks that read no data are done by the caller; ops that must scan data check it)
  virtual void gemm(const GemmParams& p) = 0;
  // The bf16 copy of x [rows, k] (row stride ldx) that a GEMM of `order` would make, for GemmParams::x16:
  // GEMMs that read the same x share it instead of each converting x (the same bits). Empty where the
  // order reads no copy (the exact orders; the CPU). The caller keeps x unchanged while the copy is used.
  virtual Buffer<uint16_t> gemm_x_copy(const float* x, int64_t rows, int64_t k, int64_t ldx,
                                       ReduceOrder order) {
    (void)x, (void)rows, (void)k, (void)ldx, (void)order;
    return {};
  }
  virtual void rmsnorm(const RmsNormParams& p) = 0;
  virtual void rope_apply(const RopeApplyParams& p) = 0;
  // A block quantisation simulated in place (kernels/quant.h): fp8_sim, its in-place bf16-cast twin, or
  // fp4_sim; `none` leaves x as it is.
  virtual void quant_sim(const Fp8SimParams& p, QuantSim kind) = 0;
  virtual void compressor(const CompressorParams& p) = 0;
  virtual void compressor_pool(const CompressorPoolParams& p) = 0;
  virtual void kv_store(const KvStoreParams& p) = 0;  // pool and slots in backend memory
  virtual void kv_load(const KvLoadParams& p) = 0;
  virtual void hadamard(float* x, int64_t rows, int64_t n, int64_t ld) = 0;
  virtual void scale_bf16(float* x, int64_t n, float scale) = 0;  // x = bf16(x * scale)
  virtual void divide(float* x, int64_t n, float d) = 0;          // x = x / d
  // out[t, j, :] = table[tokens[t], :] for j < copies.
  virtual void embed(const float* table, int64_t D, const int32_t* tokens, int64_t T, int copies,
                     float* out) = 0;
  virtual void indexer_topk(const IndexerParams& p) = 0;
  virtual void indexer_score_ids(const IndexerParams& p, const int32_t* ids, float* score) = 0;
  virtual void build_index(const IndexBuildParams& p) = 0;
  virtual void sparse_attention(const SparseAttnParams& p, int layer) = 0;
  virtual void hc_pre(const HcPreParams& p) = 0;
  virtual void hc_post(const HcPostParams& p) = 0;
  virtual void hc_head(const HcHeadParams& p) = 0;
  virtual void router(const RouterParams& p) = 0;
  // `p.experts` / `p.shared` are host arrays whose pointers come from weight().
  virtual void moe_experts(const MoeParams& p, int layer) = 0;
  // moe_experts with the routed experts shared out among `comm`'s ranks (model/expert_parallel.h):
  // the same bits. The communicator must move this backend's memory (Communicator::device_memory:
  // MPI for the CPU, NCCL for CUDA); otherwise InputError naming the layer and both.
  virtual void moe_experts_parallel(const MoeParams& p, int layer, Communicator& comm);
  // moe_experts of this rank's own tokens (p.T may be 0) when every rank runs its own sequences, the
  // pairs dispatched to the experts' owners and back (model/expert_parallel.h moe_experts_dispatch):
  // the same bits as moe_experts of these tokens. Host memory only: a GPU backend throws InputError
  // naming the layer (not built on GPUs yet).
  virtual void moe_experts_dispatch(const MoeParams& p, int layer, Communicator& comm);
  virtual void log_softmax_gather(const float* logits, int64_t rows, int64_t V, const int32_t* target,
                                  float* logprob) = 0;
  // ---- backward ops of the training step (kernels/grad.h), same Params structs. A backend without
  // them throws Error naming the op (the base class's answer).
  virtual void zero(float* x, int64_t n);                    // x[0..n) = 0
  virtual void add(float* y, const float* x, int64_t n);     // y = y + x elementwise
  virtual void gemm_dx(const GemmDxParams& p);
  virtual void gemm_dw(const GemmDwParams& p);
  virtual void rmsnorm_backward(const RmsNormBwdParams& p);
  virtual void embed_backward(const float* dH, int64_t D, const int32_t* tokens, int64_t T, int copies,
                              float* dtable);
  virtual void log_softmax_backward(const float* logits, int64_t rows, int64_t V, const int32_t* target,
                                    const float* dlogprob, float temperature, float* dlogits);
  virtual void sparse_attention_backward(const SparseAttnBwdParams& p);
  virtual void compressor_pool_backward(const CompressorPoolBwdParams& p);
  virtual void hc_post_backward(const HcPostBwdParams& p);
  virtual void hc_pre_backward(const HcPreBwdParams& p);
  virtual void hc_head_backward(const HcHeadBwdParams& p);
  virtual void router_backward(const RouterBwdParams& p);
  virtual void moe_experts_backward(const MoeBwdParams& p);
  // moe_experts_backward with the routed experts shared out among `comm`'s ranks
  // (model/expert_parallel.h moe_experts_backward_parallel): every rank ends with the single-device
  // gradients. Like moe_experts_parallel, refuses a communicator of the other memory.
  virtual void moe_experts_backward_parallel(const MoeBwdParams& p, int layer, Communicator& comm);
  // The indexer's KL objective (MODEL.md §5.5).
  virtual void hadamard_backward(float* x, int64_t rows, int64_t n, int64_t ld);
  virtual void attention_mass(const AttentionMassParams& p);  // the backend validates (idx is data)
  virtual void indexer_kl(const IndexerKlParams& p);
  virtual void indexer_score_backward(const IndexerScoreBwdParams& p);  // the backend validates

  // Per-row XXH3-64 digests of a tensor in backend memory ([rows, row_elems] of `dt`; bf16 hashed as
  // its 2-byte patterns), written to the host array `out` [rows], computed where the tensor lives.
  // Returns false when the backend leaves digests to the host (the CPU: the data is there already).
  virtual bool row_digests(const void* data, DType dt, int64_t rows, int64_t row_elems, uint64_t* out) {
    (void)data, (void)dt, (void)rows, (void)row_elems, (void)out;
    return false;
  }
  // Waits for all enqueued work (a no-op on the CPU).
  virtual void synchronize() = 0;

  // ---- downloads that do not wait (device backends)
  // One part of an asynchronous download: `bytes` of backend memory at `src`; or, with `digests`, the
  // per-row digests of the tensor at `src` ([rows, row_elems] of `dt`, as row_digests gives them),
  // hashed from the rows, or, with `sums`, from the rows' block sums that the op writing them formed
  // (kernels/row_sums.h; bf16 rows; `src` is then not read).
  struct AsyncPart {
    const void* src = nullptr;
    size_t bytes = 0;
    bool digests = false;
    DType dt = DType::f32;
    int64_t rows = 0, row_elems = 0;
    const uint64_t* sums = nullptr;  // [rows, row_elems / 512, 8] in backend memory, or nullptr
    size_t host_bytes() const { return digests ? size_t(std::max<int64_t>(rows, 0)) * 8 : bytes; }
  };
  // Host copies of the parts, landing while the caller goes on enqueuing work.
  class AsyncDownload {
   public:
    virtual ~AsyncDownload() = default;  // waits for copies still in flight
    virtual bool ready() = 0;            // the copies have landed (Error on a device fault)
    virtual void wait() = 0;
    // The host copy of part i (nullptr for an empty part); read it only once ready() or wait().
    virtual const void* part(size_t i) const = 0;
    virtual size_t bytes() const = 0;  // host memory held
  };
  // Snapshots the parts after the work enqueued so far and copies the snapshots into pinned host
  // memory on a stream of their own, ordered by events; nothing waits. The copied parts' buffers may
  // be changed or freed at once. A digest part's buffer may be freed at once (its memory is given
  // back once the digests have read it) but must not be written again: its digests may run while later work
  // goes on. nullptr from a backend whose memory is the host's (the CPU: its observers read the buffers where
  // they are).
  virtual std::unique_ptr<AsyncDownload> download_async(const std::vector<AsyncPart>& parts) {
    (void)parts;
    return nullptr;
  }

  // Helpers on top of the interface.
  template <typename T>
  void upload(T* dst, const std::vector<T>& host) {
    if (!host.empty())
      upload(static_cast<void*>(dst), static_cast<const void*>(host.data()), host.size() * sizeof(T));
  }
  template <typename T>
  std::vector<T> download(const T* src, int64_t n) {
    std::vector<T> h(static_cast<size_t>(n > 0 ? n : 0));
    if (n > 0) download(static_cast<void*>(h.data()), static_cast<const void*>(src), h.size() * sizeof(T));
    return h;
  }
};

// The RoPE inputs of a graph of T positions p0 .. p0+T-1 in backend memory (MODEL.md §3.3): the
// positions, and the frequencies of C1 layers (rope_theta, no YaRN) and of compressed layers
// (compress_rope_theta with the config's YaRN scaling). The forward and the backward both use these.
struct RopeTables {
  Buffer<int64_t> pos;
  Buffer<float> plain, comp;
};
RopeTables rope_tables(Backend& be, const ModelConfig& c, int64_t p0, int64_t T);
// The rotation of the last qk_rope_head_dim dims of each of `heads` heads of `head_dim` in the rows
// [T, heads * head_dim] of x, at positions `pos` with frequencies `freq` (from RopeTables).
RopeApplyParams rope_rows_params(const ModelConfig& c, float* x, int64_t T, int heads, int64_t head_dim,
                                 const int64_t* pos, const float* freq, bool inverse, bool round_bf16);

// Tests of late reports only: each asynchronous download's digests start `microseconds` late on the
// device's digest stream, so that a reported buffer written or freed before its digests ran shows in
// them. 0 (the default): none. Process-wide; a no-op without CUDA.
void set_digest_delay_for_tests(int microseconds);

// The backend for `d` over the weights `w` (which must outlive it). Device::cuda throws InputError
// when this dsv4 was built without CUDA or no CUDA device is usable.
std::unique_ptr<Backend> make_backend(Device d, const Weights& w);

}  // namespace backend
}  // namespace dsv4
