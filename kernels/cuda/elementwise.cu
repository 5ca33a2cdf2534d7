// Element-wise steps of the graph on the GPU (kernels/cuda/ops.h): bf16 rounding, scaling, the
// temperature division and the embedding lookup. One thread per element, grid-stride; each output
// element is one fp32 operation (then bf16 rounding where stated), as in model/forward.cpp.
#include "kernels/cuda/common.cuh"

namespace dsv4::cuda {

namespace {

constexpr int kThreads = 256;

#define DSV4_GRID_STRIDE(i, n)                                              \
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < (n); \
       i += int64_t(gridDim.x) * blockDim.x)

__global__ void bf16_round_kernel(float* x, int64_t n) {
  DSV4_GRID_STRIDE(i, n) x[i] = num::bf16_round(x[i]);
}
__global__ void scale_bf16_kernel(float* x, int64_t n, float s) {
  DSV4_GRID_STRIDE(i, n) x[i] = num::bf16_round(x[i] * s);
}
__global__ void divide_kernel(float* x, int64_t n, float d) {
  DSV4_GRID_STRIDE(i, n) x[i] = x[i] / d;
}
// One thread per (t, j, d) of H [T, hc, D].
__global__ void embed_kernel(const float* table, int64_t D, const int32_t* tokens, int64_t T, int hc,
                             float* H) {
  DSV4_GRID_STRIDE(e, T * hc * D) {
    const int64_t t = e / (hc * D), d = e % D;
    H[e] = table[int64_t(tokens[t]) * D + d];
  }
}

struct WordCopies {
  WordCopy c[kMaxWordCopies];
  int n;
};
// Copy after copy, each spread over the whole grid.
__global__ void copy_words_kernel(WordCopies w) {
  for (int k = 0; k < w.n; ++k) {
    const WordCopy c = w.c[k];
    DSV4_GRID_STRIDE(i, c.words) c.dst[i] = c.src[i];
  }
}

void check_ptr(const void* p, int64_t n, const char* op, const char* field) {
  if (n < 0) require("negative size", op);
  if (n > 0 && !p) require(field, op);
}

}  // namespace

void bf16_round(float* x, int64_t n, cudaStream_t stream) {
  check_ptr(x, n, "bf16_round", "x is null");
  if (n <= 0) return;
  bf16_round_kernel<<<detail::grid_for(n, kThreads), kThreads, 0, stream>>>(x, n);
  DSV4_LAUNCH_CHECK();
}

void scale_bf16(float* x, int64_t n, float scale, cudaStream_t stream) {
  check_ptr(x, n, "scale_bf16", "x is null");
  if (n <= 0) return;
  scale_bf16_kernel<<<detail::grid_for(n, kThreads), kThreads, 0, stream>>>(x, n, scale);
  DSV4_LAUNCH_CHECK();
}

void divide(float* x, int64_t n, float d, cudaStream_t stream) {
  check_ptr(x, n, "divide", "x is null");
  if (n <= 0) return;
  divide_kernel<<<detail::grid_for(n, kThreads), kThreads, 0, stream>>>(x, n, d);
  DSV4_LAUNCH_CHECK();
}

void embed_streams(const float* table, int64_t D, const int32_t* tokens, int64_t T, int hc, float* H,
                   cudaStream_t stream) {
  if (T < 0 || D < 1 || hc < 1) require("T, D or hc out of range", "embed_streams");
  if (T == 0) return;
  check_ptr(table, 1, "embed_streams", "table is null");
  check_ptr(tokens, T, "embed_streams", "tokens is null");
  check_ptr(H, T, "embed_streams", "H is null");
  embed_kernel<<<detail::grid_for(T * hc * D, kThreads), kThreads, 0, stream>>>(table, D, tokens, T, hc, H);
  DSV4_LAUNCH_CHECK();
}

void copy_words(const WordCopy* copies, int n, cudaStream_t stream) {
  if (n < 0 || n > kMaxWordCopies) require("more copies than kMaxWordCopies (or a negative count)", "copy_words");
  WordCopies w{};
  int64_t most = 0;
  for (int k = 0; k < n; ++k) {
    check_ptr(copies[k].src, copies[k].words, "copy_words", "src is null");
    check_ptr(copies[k].dst, copies[k].words, "copy_words", "dst is null");
    w.c[k] = copies[k];
    most = std::max(most, copies[k].words);
  }
  w.n = n;
  if (most == 0) return;
  copy_words_kernel<<<detail::grid_for(most, kThreads), kThreads, 0, stream>>>(w);
  DSV4_LAUNCH_CHECK();
}

}  // namespace dsv4::cuda
