// GPU benchmarks of the CUDA backend (exact mode): whole-model tokens/s on the GPU vs the CPU for the
// "mid" preset, per-op times of one layer (a mid-preset C4 layer and a Flash-shaped attention layer:
// hidden 4096, 64 heads, head dim 512, window 128, C4 with indexer top-512, fewer experts), and the
// card's measured copy bandwidth and exact-GEMM rate as the roofline references (the GEMM also with
// the tiled kernel, cuda::gemm_tiled, there and at the Flash projection shapes). With cuBLAS
// (DSV4_HAVE_CUBLAS) the card's bf16 tensor-core GEMM rate is measured too, and each op also gets a
// hardware roofline: max(bytes / copy bandwidth, FLOPs / bf16 rate), what a tensor-core
// implementation could reach; exact mode (fp32 fma in the CPU order) cannot. A plain timer
// program (CUDA events around the ops; wall clock around whole forwards), so it needs no benchmark
// library. Lines starting with "RESULT" are meant for scripts (scripts/gpu-check.sh).
//
// Usage: bench_gpu [--quick] [--cpu-long] [--no-flash] [--flash-T N] [--dump DIR] [--layers-only]
//   --quick     small sizes (a smoke run)      --cpu-long  also time the CPU at T = 16384
//   --no-flash  skip the Flash-shaped layer    --flash-T N run the Flash-shaped layer at T = N
//   --layers-only  the roofline references and the per-op tables only (no GEMM table, no whole model)
//                                                          (a multiple of 4; default 8192, 1024 quick)
//   --dump DIR  after the Flash-shaped layer, write its attention-path tensors to DIR (see Dumper;
//               bench/torch_layer.py reads them). Sizes at T = 8192 add up to several GiB.
//   --fast      also the fast numerics: the GEMM table against cuBLAS, the Flash-shaped layer in fast
//               numerics, the mid model exact against fast
//   --fast-gemm-only  the roofline references and the fast GEMM table only (a profiler's run)
//   --fast-layer-only  the roofline references and the Flash-shaped layer in fast numerics only
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "model/device.h"
#include "model/forward.h"
#include "model/tokens.h"
#include "model/weights.h"

#if defined(DSV4_HAVE_CUDA)
#include <cuda_runtime_api.h>

#include <algorithm>
#include <filesystem>
#include <functional>
#include <memory>
#include <stdexcept>
#include <tuple>
#include <type_traits>
#include <utility>

#include "bench/dump.h"
#include "kernels/cuda/check.h"
#include "kernels/cuda/ops.h"
#if defined(DSV4_HAVE_CUBLAS)
#include <cublas_v2.h>
#endif

namespace {

using namespace dsv4;

std::string fmt_speedup(double x) {
  char b[48];
  std::snprintf(b, sizeof b, "   (x%.2f)", x);
  return b;
}

double now_s() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// ---- device buffers filled with deterministic pseudo-random bf16-ish values ---------------------------
struct Dev {
  std::vector<void*> owned;
  ~Dev() {
    for (void* p : owned) {
      cuda::forget_bf16_weights(p, static_cast<char*>(p) + 1);
      cudaFree(p);
    }
  }
  // A weight matrix [rows, cols], registered as the model's are (cuda::keep_bf16_weights): the fast
  // numerics' GEMMs make its bf16 copy once and read that.
  float* weights(int64_t rows, int64_t cols, float scale) {
    float* p = floats(rows * cols, scale);
    cuda::keep_bf16_weights(p, rows, cols);
    return p;
  }
  float* floats(int64_t n, float scale = 1.0f) {
    float* p = nullptr;
    CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&p), size_t(std::max<int64_t>(n, 1)) * sizeof(float)));
    owned.push_back(p);
    // A 1M-value random tile, copied over the buffer.
    static std::vector<float> tile = [] {
      std::vector<float> t(size_t(1) << 20);
      uint64_t s = 0x9e3779b97f4a7c15ull;
      for (float& v : t) {
        s = s * 6364136223846793005ull + 1442695040888963407ull;
        v = float(int((s >> 40) & 0xffff) - 32768) / 32768.0f;
      }
      return t;
    }();
    std::vector<float> scaled(tile.size());
    for (size_t i = 0; i < tile.size(); ++i) scaled[i] = tile[i] * scale;
    for (int64_t off = 0; off < n; off += int64_t(tile.size())) {
      const int64_t len = std::min<int64_t>(int64_t(tile.size()), n - off);
      CUDA_CHECK(cudaMemcpy(p + off, scaled.data(), size_t(len) * sizeof(float), cudaMemcpyHostToDevice));
    }
    cuda::bf16_round(p, n, nullptr);
    return p;
  }
  // x [rows, k] (row stride k) as the bf16 copy a tensor_core GEMM reads (GemmParams::x16).
  uint16_t* bf16_copy_of(const float* x, int64_t rows, int64_t k) {
    uint16_t* p = nullptr;
    const size_t n = size_t(std::max<int64_t>(rows * cuda::gemm_bf16_row_width(k), 1));
    CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&p), n * sizeof(uint16_t)));
    owned.push_back(p);
    cuda::gemm_x_to_bf16(x, rows, k, k, p, nullptr);
    return p;
  }
  template <typename T>
  T* upload(const std::vector<T>& h) {
    T* p = nullptr;
    CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&p), std::max<size_t>(h.size(), 1) * sizeof(T)));
    owned.push_back(p);
    if (!h.empty()) CUDA_CHECK(cudaMemcpy(p, h.data(), h.size() * sizeof(T), cudaMemcpyHostToDevice));
    return p;
  }
};

// Median time of `reps` runs of fn (after one warm-up), in milliseconds, with CUDA events.
double time_ms(const std::function<void()>& fn, int reps = 3) {
  fn();
  CUDA_CHECK(cudaDeviceSynchronize());
  cudaEvent_t a, b;
  CUDA_CHECK(cudaEventCreate(&a));
  CUDA_CHECK(cudaEventCreate(&b));
  std::vector<double> ms;
  for (int r = 0; r < reps; ++r) {
    CUDA_CHECK(cudaEventRecord(a, nullptr));
    fn();
    CUDA_CHECK(cudaEventRecord(b, nullptr));
    CUDA_CHECK(cudaEventSynchronize(b));
    float t = 0;
    CUDA_CHECK(cudaEventElapsedTime(&t, a, b));
    ms.push_back(t);
  }
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  std::sort(ms.begin(), ms.end());
  return ms[ms.size() / 2];
}

// ---- tensor dump ------------------------------------------------------------------------------------
// Writes device tensors to DIR/<name>.bin as raw little-endian float32 or int32 (row-major, no
// header) and, on finish(), DIR/manifest.json:
//   {"attrs": {<name>: <number>, ...}, "tensors": [{"name", "file", "dtype", "shape"}, ...]}
// Every tensor is copied back with a synchronous cudaMemcpy, so it holds the device state at the
// time of the put() call.
// Downloads device tensors into the dump of bench/dump.h.
struct Dumper : dsv4::bench::Dumper {
  using dsv4::bench::Dumper::Dumper;
  template <typename T>
  void put(const std::string& name, const T* dev, const std::vector<int64_t>& shape) {
    int64_t n = 1;
    for (int64_t e : shape) n *= e;
    std::vector<T> h(size_t(std::max<int64_t>(n, 0)));
    CUDA_CHECK(cudaDeviceSynchronize());
    if (n > 0) CUDA_CHECK(cudaMemcpy(h.data(), dev, size_t(n) * sizeof(T), cudaMemcpyDeviceToHost));
    dsv4::bench::Dumper::put(name, h, shape);
  }
};

struct Roofline {
  double copy_gbs = 0;      // device-to-device copy bandwidth (read + write bytes / s)
  double gemm_gflops = 0;   // exact fp32 GEMM rate at a large square shape (cuda::gemm)
  double tiled_gflops = 0;  // the same with the tiled kernel (cuda::gemm_tiled)
  double bf16_gflops = 0;   // cuBLAS bf16 tensor-core GEMM (fp32 accumulate) at 8192^3; 0 without cuBLAS
};

// GFLOP/s of a cuBLAS bf16 GEMM (inputs bf16, fp32 compute and output) at m = n = k: the card's
// tensor-core rate, the ceiling for the GEMMs of a non-exact implementation.
// With n and k: y [m, n] = x [m, k] . w [n, k]^T, the layout of cuda::gemm.
double bf16_gemm_gflops(int64_t m, int64_t n = 0, int64_t k = 0) {
  if (n <= 0) n = m;
  if (k <= 0) k = m;
#if defined(DSV4_HAVE_CUBLAS)
  cublasHandle_t h = nullptr;
  if (cublasCreate(&h) != CUBLAS_STATUS_SUCCESS) return 0;
  void *a = nullptr, *b = nullptr, *c = nullptr;
  CUDA_CHECK(cudaMalloc(&a, size_t(n * k) * 2));
  CUDA_CHECK(cudaMalloc(&b, size_t(m * k) * 2));
  CUDA_CHECK(cudaMalloc(&c, size_t(m * n) * 4));
  CUDA_CHECK(cudaMemset(a, 0x3c, size_t(n * k) * 2));  // bf16 0x3c3c ~ 0.0115: finite, no denormals
  CUDA_CHECK(cudaMemset(b, 0x3c, size_t(m * k) * 2));
  const float one = 1.0f, zero = 0.0f;
  cublasStatus_t st = CUBLAS_STATUS_SUCCESS;
  // Column-major: C^T [n, m] = W [n, k] . X^T, i.e. op(A) = A^T of the k x n array w.
  const double ms = time_ms([&] {
    st = cublasGemmEx(h, CUBLAS_OP_T, CUBLAS_OP_N, int(n), int(m), int(k), &one, a, CUDA_R_16BF, int(k), b,
                      CUDA_R_16BF, int(k), &zero, c, CUDA_R_32F, int(n), CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
  });
  cudaFree(a);
  cudaFree(b);
  cudaFree(c);
  cublasDestroy(h);
  if (st != CUBLAS_STATUS_SUCCESS) return 0;
  return 2.0 * double(m) * double(n) * double(k) / (ms * 1e6);
#else
  (void)m;
  return 0;
#endif
}

// GFLOP/s of cuda::gemm and of cuda::gemm_tiled on one m x n x k GEMM (dense rows).
std::pair<double, double> gemm_rates(int64_t m, int64_t n, int64_t k, ReduceOrder order) {
  Dev d;
  GemmParams g;
  g.m = m, g.n = n, g.k = k, g.ldx = k, g.ldw = k, g.ldy = n, g.order = order;
  g.x = d.floats(m * k), g.w = d.floats(n * k, 0.02f), g.y = d.floats(m * n);
  const double flop = 2.0 * double(m) * double(n) * double(k);
  const double ms = time_ms([&] { cuda::gemm(g, nullptr); });
  const double base_ms = time_ms([&] { cuda::gemm_tiled(g, nullptr); });
  return {flop / (ms * 1e6), flop / (base_ms * 1e6)};
}

Roofline measure_roofline(bool quick) {
  Roofline r;
  const int64_t n = quick ? (int64_t(1) << 24) : (int64_t(1) << 28);
  void *a = nullptr, *b = nullptr;
  CUDA_CHECK(cudaMalloc(&a, size_t(n) * 4));
  CUDA_CHECK(cudaMalloc(&b, size_t(n) * 4));
  const double ms =
      time_ms([&] { CUDA_CHECK(cudaMemcpyAsync(b, a, size_t(n) * 4, cudaMemcpyDeviceToDevice)); });
  r.copy_gbs = 2.0 * double(n) * 4 / (ms * 1e-3) / 1e9;
  cudaFree(a);
  cudaFree(b);
  const int64_t m = quick ? 1024 : 4096;
  std::tie(r.gemm_gflops, r.tiled_gflops) = gemm_rates(m, m, m, ReduceOrder{});
  r.bf16_gflops = bf16_gemm_gflops(quick ? 4096 : 8192);
  return r;
}

// The exact GEMM at the Flash-shaped layer's projection shapes (wq_a, wq_b, wo_b), both kernels,
// both reduction orders.
void print_gemm_table(bool quick) {
  const int64_t m = quick ? 1024 : 8192;
  std::printf("\nExact GEMM, GFLOP/s (m=%ld): cuda::gemm vs cuda::gemm_tiled\n", long(m));
  std::printf("%-18s %10s %10s %7s %10s %10s %7s\n", "n x k", "chain", "tiled", "x", "block64", "tiled", "x");
  for (const auto& [n, k] :
       std::vector<std::pair<int64_t, int64_t>>{{1024, 4096}, {32768, 1024}, {4096, 8192}}) {
    const auto [c, cb] = gemm_rates(m, n, k, ReduceOrder{});
    const auto [b, bb] = gemm_rates(m, n, k, ReduceOrder{64});
    const std::string shape = std::to_string(n) + " x " + std::to_string(k);
    std::printf("%-18s %10.0f %10.0f %7.2f %10.0f %10.0f %7.2f\n", shape.c_str(), c, cb, c / cb, b, bb,
                b / bb);
  }
}

// The tensor_core order (fast numerics) against cuBLAS's bf16 GEMM at the same shapes, same run. Our
// kernel reads fp32 x and w (the model's buffers) and rounds them to bf16 as it stages them; cuBLAS
// reads bf16 arrays, half the bytes.
void print_fast_gemm_table(bool quick) {
  const int64_t m = quick ? 1024 : 8192;
  const char* kernel = cuda::gemm_tensor_core_uses_wgmma() ? "wgmma" : "mma.sync";
  std::printf("\nFast GEMM (tensor_core order, %s kernel), GFLOP/s (m=%ld) with the operands' bf16 copies, against "
              "cuBLAS bf16 at the same shape and the mma.sync kernel\n",
              kernel, long(m));
  std::printf(
      "(kept w: w registered with keep_bf16_weights, as the model's weights are, so only x is copied "
      "each call; bf16 x: also x handed over as its bf16 copy, made once outside the timing, as cuBLAS "
      "is handed bf16 x and as the model shares one copy among the GEMMs that read the same x)\n");
  std::printf("%-18s %12s %12s %8s %12s %8s %12s %8s %12s %8s %12s %8s\n", "n x k", "tensor_core", "kept w",
              "ratio", "bf16 x", "ratio", "cuBLAS", "ratio", "mma.sync", "x mma", "exact", "speedup");
  for (const auto& [n, k] : std::vector<std::pair<int64_t, int64_t>>{
           {1024, 4096}, {32768, 1024}, {4096, 8192}, {8192, 8192}, {2048, 4096}, {4096, 2048}}) {
    Dev d;
    GemmParams g;
    g.m = m, g.n = n, g.k = k, g.ldx = k, g.ldw = k, g.ldy = n, g.order = ReduceOrder{.block = 0, .tensor_core = true};
    g.x = d.floats(m * k), g.w = d.floats(n * k, 0.02f), g.y = d.floats(m * n);
    const double flop = 2.0 * double(m) * double(n) * double(k);
    const double fast = flop / (time_ms([&] { cuda::gemm(g, nullptr); }) * 1e6);
    const double mma = flop / (time_ms([&] { cuda::gemm_tiled(g, nullptr); }) * 1e6);  // the mma.sync kernel
    cuda::keep_bf16_weights(g.w, n, k);  // from here on w is read from its kept bf16 copy
    const double kept = flop / (time_ms([&] { cuda::gemm(g, nullptr); }) * 1e6);
    g.x16 = d.bf16_copy_of(g.x, m, k);
    const double given = flop / (time_ms([&] { cuda::gemm(g, nullptr); }) * 1e6);
    g.x16 = nullptr;
    g.order = ReduceOrder{};
    const double exact = flop / (time_ms([&] { cuda::gemm(g, nullptr); }, 1) * 1e6);
    const double cublas = bf16_gemm_gflops(m, n, k);
    const std::string shape = std::to_string(n) + " x " + std::to_string(k);
    const auto of_cublas = [&](double r) { return cublas > 0 ? r / cublas : 0.0; };
    std::printf("%-18s %12.0f %12.0f %8.2f %12.0f %8.2f %12.0f %8.2f %12.0f %8.2f %12.0f %8.1f\n",
                shape.c_str(), fast, kept, of_cublas(kept), given, of_cublas(given), cublas, of_cublas(fast),
                mma, fast / mma, exact, kept / exact);
    std::printf("RESULT fast_gemm %s %.1f kept_w %.1f bf16_x %.1f cublas %.1f mma_sync %.1f\n", shape.c_str(),
                fast, kept, given, cublas, mma);
    std::fflush(stdout);
  }
}

// ---- one layer, op by op -------------------------------------------------------------------------
struct LayerShape {
  std::string name;
  int64_t T, D, ql, Dh, Di, I;
  int H, Hi, topk, W, E, k, groups;
  int64_t R;
  ReduceOrder order;
  bool fast = false;  // the GEMMs, experts, indexer and attention in the tensor_core order (fast numerics)
  // The order of a site that fast numerics puts on tensor cores (GEMMs, experts, indexer, attention).
  ReduceOrder tc_site_order() const { return fast ? ReduceOrder{.block = 0, .tensor_core = true} : order; }
};

struct OpTime {
  std::string op;
  double ms, flops, bytes;
  bool in_total = true;  // false: a reference row (a previous kernel of the op before it)
};

void print_op_table(const LayerShape& s, const std::vector<OpTime>& ops, const Roofline& rf) {
  const bool hw = rf.bf16_gflops > 0;
  std::printf("\nPer-op times, %s layer at T=%ld (%s, %s order)\n", s.name.c_str(), long(s.T),
              s.fast ? "fast numerics: GEMMs, experts, indexer and attention on tensor cores" : "exact mode",
              s.order.block ? "blocked" : "chain");
  std::printf("roofline ms = max(bytes / copy bandwidth, FLOPs / exact GEMM rate)%s\n",
              hw ? "; hw ms = the same with the bf16 tensor-core GEMM rate" : "");
  std::printf("%-26s %10s %10s %10s %12s %8s", "op", "ms", "GFLOP/s", "GB/s", "roofline ms", "x roof");
  std::printf(hw ? " %10s %8s\n" : "\n", "hw ms", "x hw");
  double total = 0, total_roof = 0, total_hw = 0;
  for (const OpTime& o : ops) {
    const double mem_ms = o.bytes / (rf.copy_gbs * 1e9) * 1e3;
    const double roof = std::max(mem_ms, o.flops / (rf.gemm_gflops * 1e9) * 1e3);
    const double hw_roof = hw ? std::max(mem_ms, o.flops / (rf.bf16_gflops * 1e9) * 1e3) : 0.0;
    std::printf("%-26s %10.3f %10.1f %10.1f %12.3f %8.1f", o.op.c_str(), o.ms, o.flops / (o.ms * 1e6),
                o.bytes / (o.ms * 1e6), roof, roof > 0 ? o.ms / roof : 0.0);
    if (hw)
      std::printf(" %10.3f %8.1f\n", hw_roof, hw_roof > 0 ? o.ms / hw_roof : 0.0);
    else
      std::printf("\n");
    std::printf("RESULT op %s%s %s T=%ld %.4f ms\n", s.name.c_str(), s.fast ? "-fast" : "", o.op.c_str(),
                long(s.T), o.ms);
    if (!o.in_total) continue;
    total += o.ms;
    total_roof += roof;
    total_hw += hw_roof;
  }
  std::printf("%-26s %10.3f %10s %10s %12.3f %8.1f", "total", total, "", "", total_roof, total / total_roof);
  if (hw)
    std::printf(" %10.3f %8.1f\n", total_hw, total / total_hw);
  else
    std::printf("\n");
}

// Times the ops of one layer. Each op runs on its own pseudo-random inputs, except that the sparse
// attention reads the q buffer the q-head ops wrote and wo_a reads the attention output. When
// dump_dir is non-empty, the attention path is also computed once as a chain and dumped (dump_layer).
std::vector<OpTime> bench_layer(const LayerShape& s, const std::string& dump_dir = {}) {
  Dev d;
  std::vector<OpTime> out;
  const int64_t T = s.T, D = s.D, hc = 4, hcD = hc * D, rd = 64;
  const int64_t G = T / 4, k4 = std::min<int64_t>(s.topk, G), K = std::min<int64_t>(T, s.W) + k4;
  auto add = [&](const std::string& op, double flops, double bytes, const std::function<void()>& fn) {
    out.push_back({op, time_ms(fn), flops, bytes, true});
  };
  // Fast numerics: the GEMMs that read the attention's normed x share its bf16 copy, made once by an op
  // of its own, as the model does (model/forward.cpp attention); each such GEMM then reads bf16 x.
  float* xs = d.floats(T * D);
  uint16_t* xs16 = nullptr;
  auto gemm_op = [&](const std::string& op, int64_t m, int64_t n, int64_t k, OutRound r,
                     bool reads_xs = false) {
    GemmParams g;
    g.m = m, g.n = n, g.k = k, g.ldx = k, g.ldw = k, g.ldy = n, g.round = r, g.order = s.tc_site_order();
    g.x = reads_xs ? xs : d.floats(m * k), g.w = d.weights(n, k, 0.02f), g.y = d.floats(m * n);
    g.x16 = reads_xs ? xs16 : nullptr;
    add(op, 2.0 * m * n * k, (g.x16 ? 2.0 : 4.0) * m * k + 4.0 * (n * k + m * n),
        [=] { cuda::gemm(g, nullptr); });
    return g;
  };
  // mHC pre (attention sublayer)
  {
    HcPreParams p;
    p.T = T, p.hc = hc, p.D = D, p.order = s.order;
    const int64_t rows = (2 + hc) * hc;
    p.X = d.floats(T * hcD), p.fn = d.floats(rows * hcD, 0.01f), p.scale = d.floats(3),
    p.base = d.floats(rows);
    p.y = d.floats(T * D), p.pre = d.floats(T * hc), p.post = d.floats(T * hc),
    p.comb = d.floats(T * hc * hc);
    add("hc_pre", 2.0 * T * rows * hcD + 2.0 * T * hcD, 4.0 * (T * hcD + T * D),
        [=] { cuda::hc_pre(p, nullptr); });
  }
  {
    RmsNormParams p;
    p.rows = T, p.dim = D, p.ldx = p.ldy = D, p.order = s.order;
    p.x = d.floats(T * D), p.w = d.floats(D), p.y = d.floats(T * D);
    add("rmsnorm", 4.0 * T * D, 8.0 * T * D, [=] { cuda::rmsnorm(p, nullptr); });
  }
  if (s.fast) {
    xs16 = d.bf16_copy_of(xs, T, D);
    add("bf16 copy of x (shared)", 0, 4.0 * T * D + 2.0 * T * cuda::gemm_bf16_row_width(D),
        [=] { cuda::gemm_x_to_bf16(xs, T, D, D, xs16, nullptr); });
  }
  const GemmParams g_wq_a = gemm_op("gemm wq_a", T, s.ql, D, OutRound::bf16, true);
  const GemmParams g_wq_b = gemm_op("gemm wq_b", T, s.H * s.Dh, s.ql, OutRound::bf16);
  float* q = d.floats(T * s.H * s.Dh);
  {
    RmsNormParams p;
    p.rows = T * s.H, p.dim = s.Dh, p.ldx = p.ldy = s.Dh, p.order = s.order, p.x = q, p.y = q;
    add("rmsnorm q heads", 4.0 * T * s.H * s.Dh, 8.0 * T * s.H * s.Dh, [=] { cuda::rmsnorm(p, nullptr); });
  }
  std::vector<int64_t> pos(static_cast<size_t>(T));
  for (int64_t t = 0; t < T; ++t) pos[size_t(t)] = t;
  std::vector<float> freq(size_t(rd / 2));
  rope_freqs(RopeSpec{int(rd), 160000.0f, true}, freq.data());
  const int64_t* dpos = d.upload(pos);
  const float* dfreq = d.upload(freq);
  {
    RopeApplyParams p;
    p.rows = T, p.heads = s.H, p.x = q, p.ld = s.H * s.Dh, p.head_stride = s.Dh, p.offset = s.Dh - rd;
    p.pos = dpos, p.freq = dfreq, p.rd = int(rd);
    add("rope q", 6.0 * T * s.H * rd, 8.0 * T * s.H * rd, [=] { cuda::rope_apply(p, nullptr); });
  }
  const GemmParams g_wkv = gemm_op("gemm wkv", T, s.Dh, D, OutRound::bf16, true);
  float* x = xs;
  auto compressor_op = [&](const std::string& op, int64_t dd, bool had) -> float* {
    CompressorParams p;
    p.T = T, p.D = D, p.ratio = 4, p.d = dd, p.rd = int(rd), p.hadamard = had, p.order = s.order;
    p.x = x, p.wkv = d.weights(2 * dd, D, 0.02f), p.wgate = d.weights(2 * dd, D, 0.02f),
    p.ape = d.floats(4 * 2 * dd);
    p.norm = d.floats(dd), p.freq = dfreq, p.out = d.floats(G * dd);
    if (!s.fast) {
      add(op, 2.0 * 2 * (G * 4) * (2 * dd) * D, 4.0 * (T * D + 2 * 2 * dd * D),
          [=] { cuda::compressor(p, nullptr); });
      return p.out;
    }
    // Fast numerics, as the model runs it: the two projections are GEMMs of the gemm site (tensor
    // cores), the pooling keeps the compressor site's exact order.
    const int64_t cw = 2 * dd;
    GemmParams g;
    g.m = T, g.n = cw, g.k = D, g.ldx = D, g.ldw = D, g.ldy = cw, g.round = OutRound::f32, g.order = s.tc_site_order();
    g.x = x, g.x16 = xs16;
    float* kvp = d.floats(T * cw);
    float* sc = d.floats(T * cw);
    CompressorPoolParams q;
    q.g0 = 0, q.G = G, q.row0 = 0, q.rows = T, q.ratio = 4, q.d = dd, q.rd = int(rd), q.kvp = kvp, q.sc = sc;
    q.ape = p.ape, q.norm = p.norm, q.freq = dfreq, q.hadamard = had, q.order = s.order, q.out = p.out;
    add(op, 2.0 * 2 * T * cw * D, 2.0 * T * D + 4.0 * (2 * cw * D + 2 * T * cw), [=]() mutable {
      g.w = p.wkv, g.y = kvp;
      cuda::gemm(g, nullptr);
      g.w = p.wgate, g.y = sc;
      cuda::gemm(g, nullptr);
      cuda::compressor_pool(q, nullptr);
    });
    return p.out;
  };
  float* comp = compressor_op("compressor (C4 kv)", s.Dh, false);
  (void)comp;
  gemm_op("gemm indexer wq_b", T, s.Hi * s.Di, s.ql, OutRound::bf16);
  float* qi = d.floats(T * s.Hi * s.Di);
  add("hadamard indexer q", 2.0 * T * s.Hi * s.Di * 7, 8.0 * T * s.Hi * s.Di,
      [=] { cuda::hadamard(qi, T * s.Hi, s.Di, s.Di, nullptr); });
  float* ki = compressor_op("compressor (indexer k)", s.Di, true);
  gemm_op("gemm indexer weights", T, s.Hi, D, OutRound::bf16, true);
  int32_t* sel = nullptr;
  {
    IndexerParams p;
    p.T = T, p.Hi = s.Hi, p.Di = s.Di, p.G = G, p.k = int(k4), p.ratio = 4, p.order = s.tc_site_order();
    p.qi = qi, p.ki = ki, p.wt = d.floats(T * s.Hi, 0.05f);
    p.ids = d.upload(std::vector<int32_t>(size_t(T * k4))), p.margin = d.floats(T),
    p.score = d.floats(T * k4);
    sel = p.ids;
    const double flops = 2.0 * T * (G / 2) * s.Hi * s.Di,
                 bytes = 4.0 * (T * s.Hi * s.Di + T * (G / 2) * s.Di);
    add("indexer_topk", flops, bytes, [=] { cuda::indexer_topk(p, nullptr); });
    add("indexer_topk_row_per_block", flops, bytes, [=] { cuda::indexer_topk_row_per_block(p, nullptr); });
    out.back().in_total = false;  // the same op again: not part of the layer
  }
  int32_t* idx = d.upload(std::vector<int32_t>(size_t(T * K)));
  {
    IndexBuildParams p;
    p.T = T, p.W = s.W, p.kind = CompressedKind::c4, p.ratio = 4, p.k = int(k4), p.sel = sel, p.idx = idx;
    add("build_index", 0, 8.0 * T * K, [=] { cuda::build_index(p, nullptr); });
  }
  float* o = d.floats(T * s.H * s.Dh);
  SparseAttnParams attn;
  {
    SparseAttnParams& p = attn;
    p.T = T, p.H = s.H, p.Dh = s.Dh, p.N = T + G, p.K = K, p.scale = 0.0625f, p.order = s.tc_site_order();
    p.q = q, p.kv = d.floats((T + G) * s.Dh), p.idx = idx, p.sink = d.floats(s.H), p.o = o,
    p.lse = d.floats(T * s.H);
    add("sparse_attention", 4.0 * T * s.H * K * s.Dh, 4.0 * (2 * T * s.H * s.Dh + T * K * s.Dh),
        [=] { cuda::sparse_attention(p, nullptr); });
    if (!s.fast && cuda::sparse_attention_uses_head_tiles(p)) {  // the same bits by 8-head tiles
      add("sparse_attention_small_tiles", 4.0 * T * s.H * K * s.Dh, 4.0 * (2 * T * s.H * s.Dh + T * K * s.Dh),
          [=] { cuda::sparse_attention_small_tiles(p, nullptr); });
      out.back().in_total = false;  // the same op again: not part of the layer
    }
    if (s.fast && cuda::sparse_attention_uses_wgmma(p)) {  // the same bits by the mma.sync kernel
      add("sparse_attention_mma_sync", 4.0 * T * s.H * K * s.Dh, 4.0 * (2 * T * s.H * s.Dh + T * K * s.Dh),
          [=] { cuda::sparse_attention_mma_sync(p, nullptr); });
      out.back().in_total = false;  // the same op again: not part of the layer
    }
  }
  const int64_t gw = (s.H / s.groups) * s.Dh;
  float* wo_a = d.weights(s.groups * s.R, gw, 0.02f);
  float* wo_a_out = d.floats(T * s.groups * s.R);
  {
    GemmParams g;
    g.m = T, g.n = s.R, g.k = gw, g.ldx = s.H * s.Dh, g.ldw = gw, g.ldy = s.groups * s.R, g.order = s.tc_site_order();
    float* w = wo_a;
    float* u = wo_a_out;
    add("gemm wo_a (groups)", 2.0 * T * s.R * gw * s.groups, 4.0 * (T * s.H * s.Dh + s.groups * s.R * gw),
        [=]() mutable {
          for (int gi = 0; gi < s.groups; ++gi) {
            g.x = o + gi * gw, g.w = w + gi * s.R * gw, g.y = u + gi * s.R;
            cuda::gemm(g, nullptr);
          }
        });
  }
  const GemmParams g_wo_b = gemm_op("gemm wo_b", T, D, s.groups * s.R, OutRound::bf16);
  {
    HcPostParams p;
    p.T = T, p.hc = hc, p.D = D;
    p.f = d.floats(T * D), p.R = d.floats(T * hcD), p.post = d.floats(T * hc), p.comb = d.floats(T * hc * hc);
    p.out = d.floats(T * hcD);
    add("hc_post", 2.0 * T * hcD * hc, 4.0 * (2 * T * hcD + T * D), [=] { cuda::hc_post(p, nullptr); });
  }
  gemm_op("gemm router", T, s.E, D, OutRound::f32);
  int32_t* ids = d.upload(std::vector<int32_t>(size_t(T * s.k)));
  float* wts = d.floats(T * s.k);
  {
    RouterParams p;
    p.T = T, p.E = s.E, p.k = s.k, p.logits = d.floats(T * s.E), p.bias = d.floats(s.E, 0.01f);
    p.ids = ids, p.weights = wts, p.margin = d.floats(T);
    add("router", 0, 4.0 * T * s.E, [=] { cuda::router(p, nullptr); });
  }
  {
    std::vector<ExpertWeights> ex(static_cast<size_t>(s.E)), sh(1);
    for (auto& e : ex) e = {d.weights(s.I, D, 0.02f), d.weights(s.I, D, 0.02f), d.weights(D, s.I, 0.02f)};
    sh[0] = {d.weights(s.I, D, 0.02f), d.weights(s.I, D, 0.02f), d.weights(D, s.I, 0.02f)};
    MoeParams p;
    p.T = T, p.D = D, p.I = s.I, p.I_shared = s.I, p.E = s.E, p.k = s.k, p.n_shared = 1, p.order = s.tc_site_order();
    p.x = x, p.ids = ids, p.weights = wts, p.out = d.floats(T * D);
    add("moe_experts", 2.0 * 3 * T * (s.k + 1) * s.I * D, 4.0 * 3 * (s.E + 1) * s.I * D, [=] {
      MoeParams q = p;
      q.experts = ex.data();
      q.shared = sh.data();
      cuda::moe_experts(q, nullptr);
    });
  }
  if (!dump_dir.empty()) {
    CUDA_CHECK(cudaDeviceSynchronize());
    Dumper du(dump_dir);
    for (const auto& [k, v] : std::vector<std::pair<const char*, double>>{{"T", double(T)},
                                                                          {"D", double(D)},
                                                                          {"ql", double(s.ql)},
                                                                          {"H", s.H},
                                                                          {"Dh", double(s.Dh)},
                                                                          {"Hi", s.Hi},
                                                                          {"topk", s.topk},
                                                                          {"Di", double(s.Di)},
                                                                          {"W", s.W},
                                                                          {"G", double(G)},
                                                                          {"K", double(K)},
                                                                          {"N", double(attn.N)},
                                                                          {"scale", attn.scale},
                                                                          {"groups", s.groups},
                                                                          {"R", double(s.R)},
                                                                          {"E", s.E},
                                                                          {"eps", 1e-6}})
      du.attr(k, v);
    // Query and kv path as one chain on fresh inputs: x = rmsnorm(x_raw, attn_norm);
    // qa = bf16(x wq_a^T); qr = rmsnorm(qa, q_norm); qb = bf16(qr wq_b^T); q_heads = rmsnorm of each
    // Dh-row of qb (no weight); kv_a = bf16(x wkv^T); kv = rmsnorm(kv_a, kv_norm).
    auto norm = [&](const float* in, const float* w, float* y, int64_t rows, int64_t dim) {
      RmsNormParams p;
      p.rows = rows, p.dim = dim, p.ldx = p.ldy = dim, p.x = in, p.w = w, p.y = y, p.order = s.order;
      cuda::rmsnorm(p, nullptr);
    };
    auto mm = [&](GemmParams g, const float* in, float* y) {
      g.x = in, g.y = y, g.x16 = nullptr;  // the chain's own x: the GEMM makes its copy
      cuda::gemm(g, nullptr);
    };
    float* x_raw = d.floats(T * D);
    float* attn_norm = d.floats(D);
    float* q_norm = d.floats(s.ql);
    float* kv_norm = d.floats(s.Dh);
    float* xn = d.floats(T * D);
    float* qa = d.floats(T * s.ql);
    float* qr = d.floats(T * s.ql);
    float* qb = d.floats(T * s.H * s.Dh);
    float* qh = d.floats(T * s.H * s.Dh);
    float* kva = d.floats(T * s.Dh);
    float* kvn = d.floats(T * s.Dh);
    norm(x_raw, attn_norm, xn, T, D);
    mm(g_wq_a, xn, qa);
    norm(qa, q_norm, qr, T, s.ql);
    mm(g_wq_b, qr, qb);
    norm(qb, nullptr, qh, T * s.H, s.Dh);
    mm(g_wkv, xn, kva);
    norm(kva, kv_norm, kvn, T, s.Dh);
    du.put("x_raw", x_raw, {T, D});
    du.put("attn_norm", attn_norm, {D});
    du.put("x", xn, {T, D});
    du.put("wq_a", g_wq_a.w, {s.ql, D});
    du.put("qa", qa, {T, s.ql});
    du.put("q_norm", q_norm, {s.ql});
    du.put("qr", qr, {T, s.ql});
    du.put("wq_b", g_wq_b.w, {s.H * s.Dh, s.ql});
    du.put("qb", qb, {T, s.H * s.Dh});
    du.put("q_heads", qh, {T, s.H, s.Dh});
    du.put("wkv", g_wkv.w, {s.Dh, D});
    du.put("kv_a", kva, {T, s.Dh});
    du.put("kv_norm", kv_norm, {s.Dh});
    du.put("kv", kvn, {T, s.Dh});
    // The timed sparse attention (its q is the bench's q buffer after the q-head ops; KVcat holds
    // the window rows then the compressed rows, idx the row numbers with -1 for empty slots). It is
    // run once more here so that o and lse come from exactly the dumped inputs.
    cuda::sparse_attention(attn, nullptr);
    du.put("attn_q", attn.q, {T, s.H, s.Dh});
    du.put("KVcat", attn.kv, {attn.N, s.Dh});
    du.put("idx", attn.idx, {T, K});
    du.put("sink", attn.sink, {s.H});
    du.put("o", attn.o, {T, s.H, s.Dh});
    du.put("lse", attn.lse, {T, s.H});
    // Output projection of that o: wo_a per group g (o[:, g*gw:(g+1)*gw] wo_a[g]^T, bf16) into
    // wo_a_out, then attn_out = bf16(wo_a_out wo_b^T), the attention sublayer's output.
    {
      GemmParams g;
      g.m = T, g.n = s.R, g.k = gw, g.ldx = s.H * s.Dh, g.ldw = gw, g.ldy = s.groups * s.R, g.order = s.tc_site_order();
      for (int gi = 0; gi < s.groups; ++gi) {
        g.x = o + gi * gw, g.w = wo_a + gi * s.R * gw, g.y = wo_a_out + gi * s.R;
        cuda::gemm(g, nullptr);
      }
    }
    float* attn_out = d.floats(T * D);
    mm(g_wo_b, wo_a_out, attn_out);
    du.put("wo_a", wo_a, {s.groups, s.R, gw});
    du.put("wo_a_out", wo_a_out, {T, s.groups * s.R});
    du.put("wo_b", g_wo_b.w, {D, s.groups * s.R});
    du.put("attn_out", attn_out, {T, D});
    du.finish();
    std::printf("dumped the %s layer's attention path (T=%ld) to %s\n", s.name.c_str(), long(T),
                dump_dir.c_str());
  }
  return out;
}

// Whole model, mid preset: exact against fast numerics on the GPU, same run.
void bench_model_fast(int64_t T) {
  std::printf("\nWhole model, preset mid (train profile) on CUDA, T=%ld: exact vs fast numerics\n", long(T));
  const Weights w = Weights::init(preset("mid"), 7);
  const auto toks = random_tokens(T, w.config().vocab_size, 1);
  std::printf("%-8s %12s %12s\n", "numerics", "seconds", "tokens/s");
  double exact_s = 0;
  for (Numerics n : {Numerics::exact, Numerics::fast}) {
    RunOptions o;
    o.device = Device::cuda;
    o.profile = with_numerics(profile_train(), n);
    forward(w, {toks}, o);  // warm-up
    double best = 1e30;
    for (int r = 0; r < 3; ++r) {
      const double t0 = now_s();
      forward(w, {toks}, o);
      best = std::min(best, now_s() - t0);
    }
    if (n == Numerics::exact) exact_s = best;
    std::printf("%-8s %12.4f %12.1f%s\n", to_string(n), best, double(T) / best,
                n == Numerics::fast ? fmt_speedup(exact_s / best).c_str() : "");
    std::printf("RESULT tokens_per_s cuda-%s mid T=%ld %.1f\n", to_string(n), long(T), double(T) / best);
    std::fflush(stdout);
  }
}

void bench_model(const std::vector<int64_t>& lengths, bool cpu_long, bool quick) {
  std::printf("\nWhole model, preset mid (train profile): tokens/s\n");
  const Weights w = Weights::init(preset("mid"), 7);
  std::printf("%-8s %-6s %12s %12s\n", "device", "T", "seconds", "tokens/s");
  for (int64_t T : lengths) {
    const auto toks = random_tokens(T, w.config().vocab_size, 1);
    for (Device dev : {Device::cuda, Device::cpu}) {
      if (dev == Device::cpu && T > (quick ? 256 : 4096) && !cpu_long) continue;
      RunOptions o;
      o.device = dev;
      if (dev == Device::cuda) forward(w, {toks}, o);  // warm-up: weight upload, allocator pool
      const int reps = dev == Device::cuda ? 3 : 1;
      double best = 1e30;
      for (int r = 0; r < reps; ++r) {
        const double t0 = now_s();
        forward(w, {toks}, o);
        best = std::min(best, now_s() - t0);
      }
      std::printf("%-8s %-6ld %12.3f %12.1f\n", to_string(dev), long(T), best, double(T) / best);
      std::printf("RESULT tokens_per_s %s mid T=%ld %.1f\n", to_string(dev), long(T), double(T) / best);
      std::fflush(stdout);
    }
  }
}

}  // namespace

int main(int argc, char** argv) {
  bool quick = false, cpu_long = false, flash = true, layers_only = false, fast = false, fast_gemm_only = false,
       fast_layer_only = false, model_only = false;
  int64_t flash_T = 0;
  std::string dump_dir;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--flash-T" && i + 1 < argc) {
      flash_T = std::atoll(argv[++i]);
      if (flash_T < 4 || flash_T % 4 != 0) {
        std::fprintf(stderr, "bench_gpu: --flash-T needs a positive multiple of 4\n");
        return 2;
      }
    } else if (a == "--dump" && i + 1 < argc)
      dump_dir = argv[++i];
    else if (a == "--quick")
      quick = true;
    else if (a == "--cpu-long")
      cpu_long = true;
    else if (a == "--no-flash")
      flash = false;
    else if (a == "--layers-only")
      layers_only = true;
    else if (a == "--fast")
      fast = true;
    else if (a == "--fast-gemm-only")
      fast = fast_gemm_only = true;
    else if (a == "--fast-layer-only")
      fast = fast_layer_only = true;
    else if (a == "--model-only")
      model_only = true;
    else {
      std::fprintf(stderr,
                   "usage: bench_gpu [--quick] [--cpu-long] [--no-flash] [--flash-T N] [--dump DIR] "
                   "[--layers-only] [--fast] [--fast-gemm-only] [--fast-layer-only] [--model-only]\n"
                   "  --fast: also the fast numerics (GEMMs, experts, indexer and attention on tensor cores): GEMMs\n"
                   "          against cuBLAS, the Flash-shaped layer in fast numerics, the mid model exact against fast\n"
                   "  --fast-gemm-only: the roofline references and the fast GEMM table only\n"
                   "  --fast-layer-only: the roofline references and the Flash-shaped layer in fast numerics only\n"
                   "  --model-only: the mid model exact against fast only (T = 4096, 1024 with --quick)\n");
      return 2;
    }
  }
  if (!dsv4::cuda_device_available()) {
    std::printf("bench_gpu: no CUDA device; nothing to measure\n");
    return 0;
  }
  try {
    cudaDeviceProp prop{};
    CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
    std::printf("device: %s, %d SMs, %.1f GiB\n", prop.name, prop.multiProcessorCount,
                double(prop.totalGlobalMem) / (1 << 30));
    cuda::keep_scratch_memory();  // scratch memory stays mapped between calls, as in the model's backend
    if (model_only) {
      bench_model_fast(quick ? 1024 : 4096);
      return 0;
    }
    const Roofline rf = measure_roofline(quick);
    std::printf("roofline references: device copy %.0f GB/s, exact fp32 GEMM %.0f GFLOP/s\n", rf.copy_gbs,
                rf.gemm_gflops);
    std::printf("exact fp32 GEMM with the tiled kernel: %.0f GFLOP/s (lane-split kernel x%.2f)\n",
                rf.tiled_gflops, rf.gemm_gflops / rf.tiled_gflops);
    std::printf("RESULT copy_gbs %.1f\nRESULT exact_gemm_gflops %.1f\nRESULT tiled_gemm_gflops %.1f\n",
                rf.copy_gbs, rf.gemm_gflops, rf.tiled_gflops);
    if (rf.bf16_gflops > 0) {
      std::printf("bf16 tensor-core GEMM (cuBLAS): %.0f GFLOP/s\n", rf.bf16_gflops);
      std::printf("RESULT bf16_gemm_gflops %.1f\n", rf.bf16_gflops);
    } else {
      std::printf("bf16 tensor-core GEMM: not measured (built without cuBLAS)\n");
    }
    if (!layers_only && !fast_gemm_only && !fast_layer_only) print_gemm_table(quick);
    if (fast && !fast_layer_only) print_fast_gemm_table(quick);
    if (fast_gemm_only) return 0;

    const LayerShape mid{"mid", quick ? 512 : 4096, 1024, 256, 256, 128, 512, 8, 4, 64, 128, 16, 2, 2,
                         128,   ReduceOrder{}};
    if (!fast_layer_only) print_op_table(mid, bench_layer(mid), rf);
    if (flash) {
      const LayerShape fl{"flash-attn",
                          flash_T > 0 ? flash_T : (quick ? 1024 : 8192),
                          4096,
                          1024,
                          512,
                          128,
                          2048,
                          64,
                          64,
                          512,
                          128,
                          16,
                          6,
                          8,
                          1024,
                          ReduceOrder{}};
      if (!fast_layer_only) print_op_table(fl, bench_layer(fl, dump_dir), rf);
      if (fast) {
        LayerShape ff = fl;
        ff.fast = true;
        print_op_table(ff, bench_layer(ff), rf);
      }
    }
    if (fast_layer_only) return 0;
    if (fast) bench_model_fast(quick ? 1024 : 4096);
    if (!layers_only)
      bench_model(quick ? std::vector<int64_t>{256, 1024} : std::vector<int64_t>{4096, 16384}, cpu_long, quick);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_gpu: %s\n", e.what());
    return 1;
  }
  return 0;
}

#else  // !DSV4_HAVE_CUDA

int main() {
  std::printf("bench_gpu: this dsv4 was built without CUDA; nothing to measure\n");
  return 0;
}

#endif
