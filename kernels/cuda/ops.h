// The CUDA backend: one function per op of kernels/*.h, taking the same Params struct as the CPU
// reference (every pointer in it is a device pointer unless stated) plus the stream to launch on.
//
// Contract shared by all ops ("exact" mode): every output element is computed with the operation
// order that the op's header documents and the CPU reference (kernels/cpu) implements, with explicit
// fma (__fmaf_rn) where the CPU calls fma, IEEE division and sqrt, and the shared numerics functions
// of kernels/numerics; the .cu files are compiled with --fmad=false so no other contraction happens.
// Results are therefore bit-identical to the CPU for every input (NaN payloads aside: the GPU
// produces the canonical NaN). Work is split over independent outputs only; no reduction uses
// atomics, so results are also identical run to run and for any launch configuration.
//
// Every function validates its parameters first (the CPU op's *_check where that check reads no
// data, otherwise a shape-only check below) and throws dsv4::Error naming the bad field before
// anything is launched; every CUDA call is checked (kernels/cuda/check.h). Functions return once
// the work is enqueued on `stream`; scratch memory comes from the stream-ordered allocator.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <vector>

#include "kernels/attention.h"
#include "kernels/compressor.h"
#include "kernels/indexer.h"
#include "kernels/kvcache.h"
#include "kernels/linear.h"
#include "kernels/logits.h"
#include "kernels/mhc.h"
#include "kernels/moe.h"
#include "kernels/norm.h"
#include "kernels/quant.h"
#include "kernels/rope.h"

namespace dsv4::cuda {

// True when the CUDA runtime reports at least one usable device (any error, e.g. no driver, is false).
bool device_available();
// Keeps the memory that the kernels' stream-ordered scratch buffers free (cudaFreeAsync) in the current
// device's default pool, instead of returning it to the driver at every synchronisation and mapping it
// again on the next call (the pool's release threshold: unlimited). Set once per device by the model's
// backend and by the benchmark.
void keep_scratch_memory();

// ---- dense ----------------------------------------------------------------------------------
void gemm(const GemmParams& p, cudaStream_t stream);
// The same GEMM (same contract, same bits) with the tiled kernel only (8 lane accumulators per
// output in one thread): a reference point for the tests and the benchmark. In the tensor_core order
// it is the mma.sync kernel, the reference of the wgmma kernel that gemm runs on Hopper.
void gemm_tiled(const GemmParams& p, cudaStream_t stream);
// True when gemm's tensor_core order runs the Hopper wgmma kernel on the current device (compute
// capability 9.0 and sm_90a code in this binary: CMAKE_CUDA_ARCHITECTURES 90a-real), false when it
// runs the mma.sync kernel.
bool gemm_tensor_core_uses_wgmma();
// Weights kept in bf16 across the GEMMs of the tensor_core order (fast numerics). Each call of that
// order reads its operands as bf16 copies (kernels/cuda/linear_tc.cu); for a matrix registered here,
// the first call that reads rows of it (w inside the matrix at a row start, ldw = k = cols) makes the
// bf16 copy of the whole matrix once, and every later call reads that copy instead of converting w
// again. The bits are the same either way: the copy is the one each call would make.
//   - The fp32 matrix [rows, cols] at w (device memory) must not change while it is registered, and
//     must be forgotten before it is freed. model/device.cpp registers every 2-D weight it uploads.
//   - The copy costs 2 bytes per weight (cols padded to a multiple of 32), allocated on first use, so
//     exact numerics never pays for it; when the device has no room for it, the calls go on
//     converting w each time.
//   - The first use waits for the copy on the caller's stream (once per matrix).
void keep_bf16_weights(const float* w, int64_t rows, int64_t cols);
// Forgets, and frees the bf16 copies of, the matrices registered with w in [begin, end).
void forget_bf16_weights(const void* begin, const void* end);
// The number of matrices registered and of those with a bf16 copy made (tests, the benchmark).
struct KeptWeights {
  int64_t registered = 0, copied = 0, copy_bytes = 0;
};
KeptWeights kept_bf16_weights();
// The bf16 copy of x that a GEMM of the tensor_core order reads (GemmParams::x16): rows [rows, width]
// of bf16 patterns, width = gemm_bf16_row_width(k) (k rounded up to the order's k tile of 32), x's
// values rounded to nearest even and zeros past k. GEMMs that read the same x can share one copy
// instead of each making its own: the bits are the same. `out` holds rows * width values.
int64_t gemm_bf16_row_width(int64_t k);
void gemm_x_to_bf16(const float* x, int64_t rows, int64_t k, int64_t ldx, uint16_t* out, cudaStream_t stream);
void rmsnorm(const RmsNormParams& p, cudaStream_t stream);
// pos [rows] and freq [rd/2] are device arrays (freq from dsv4::rope_freqs on the host, uploaded).
void rope_apply(const RopeApplyParams& p, cudaStream_t stream);

// ---- mHC ------------------------------------------------------------------------------------
void hc_pre(const HcPreParams& p, cudaStream_t stream);
const char* hc_post_check(const HcPostParams& p);
void hc_post(const HcPostParams& p, cudaStream_t stream);
const char* hc_head_check(const HcHeadParams& p);
void hc_head(const HcHeadParams& p, cudaStream_t stream);

// ---- compressor, indexer, attention ---------------------------------------------------------
void compressor(const CompressorParams& p, cudaStream_t stream);
void compressor_pool(const CompressorPoolParams& p, cudaStream_t stream);
void hadamard(float* x, int64_t rows, int64_t n, int64_t ld, cudaStream_t stream);
// pool and slots are device arrays.
void kv_store(const KvStoreParams& p, cudaStream_t stream);
void kv_load(const KvLoadParams& p, cudaStream_t stream);
void indexer_topk(const IndexerParams& p, cudaStream_t stream);
// The same top-k (same contract, same bits) with the one-block-per-query-row kernel only: a
// reference point for the tests and the benchmark.
void indexer_topk_row_per_block(const IndexerParams& p, cudaStream_t stream);
// ids [T, k] and score [T, k] are device arrays.
void indexer_score_ids(const IndexerParams& p, const int32_t* ids, float* score, cudaStream_t stream);
const char* build_index_check(const IndexBuildParams& p);
void build_index(const IndexBuildParams& p, cudaStream_t stream);
// Shape-only: the index values live on the device and are not scanned. A slot outside [0, N) is
// treated like -1 (never loaded), so a bad index cannot read out of bounds.
const char* sparse_attention_check(const SparseAttnParams& p);
void sparse_attention(const SparseAttnParams& p, cudaStream_t stream);
// The tensor_core order (same contract, same bits) with the mma.sync kernel only: the reference of the
// wgmma kernel that sparse_attention runs on Hopper. Throws for another order.
void sparse_attention_mma_sync(const SparseAttnParams& p, cudaStream_t stream);
// num::exp_fast_nonpos, the tensor_core attention's exponent, of n values on the device: the tests
// compare its bits with the host's, whose accuracy they measure.
void exp_fast_nonpos(const float* x, float* y, int64_t n, cudaStream_t stream);
// The exact orders by the kernels for any shape (tiles of up to 8 heads, each kv row loaded once per
// tile), which sparse_attention leaves for its 64-head kernel where that one takes the call: the
// latter's reference in tests and baseline in bench_gpu. Throws for the tensor_core order.
void sparse_attention_small_tiles(const SparseAttnParams& p, cudaStream_t stream);
// True when sparse_attention runs p with the 64-head kernel (the exact two-pass order, at least 32
// heads, Dh a multiple of 32 up to 512, q, kv and o 16-byte aligned, K up to about 700).
bool sparse_attention_uses_head_tiles(const SparseAttnParams& p);
// True when sparse_attention runs p with the Hopper wgmma kernel on the current device (tensor_core
// order, compute capability 9.0 with sm_90a code in this binary, Dh padded to 256 or 512, a call that
// reads the bf16 copy of kv, and K small enough for its shared memory).
bool sparse_attention_uses_wgmma(const SparseAttnParams& p);

// ---- MoE ------------------------------------------------------------------------------------
void router(const RouterParams& p, cudaStream_t stream);
// Shape-only (the ids live on the device and are not scanned; ids outside [0, E) contribute
// nothing). `experts` and `shared` are *host* arrays whose ExpertWeights hold device pointers.
const char* moe_check(const MoeParams& p);
void moe_experts(const MoeParams& p, cudaStream_t stream);
// moe_experts in parts, for expert parallelism (model/expert_parallel.h), as on the CPU (kernels/moe.h);
// every pointer a device pointer. The pairs of each expert, counted ([E], on the host); the routed
// outputs [pairs, D] of the pairs of experts [e0, e1) in moe_pairs' order; the outputs of the pairs of
// every expert in that order put in slot order (y_slot [T * k, D]; pairs of no expert 0); the sum.
// moe_combine over the slots of every expert's outputs gives moe_experts' bits, whoever computed them.
std::vector<int64_t> moe_expert_counts(const MoeParams& p, cudaStream_t stream);
void moe_routed_outputs(const MoeParams& p, int e0, int e1, float* y, cudaStream_t stream);
void moe_scatter_pairs(const MoeParams& p, const float* y_pairs, float* y_slot, cudaStream_t stream);
void moe_combine(const MoeParams& p, const float* y_slot, float* out, cudaStream_t stream);

// ---- logits ---------------------------------------------------------------------------------
void log_softmax_gather(const float* logits, int64_t rows, int64_t V, const int32_t* target, float* logprob,
                        cudaStream_t stream);

// ---- FP8 / FP4 simulation -------------------------------------------------------------------
void act_quant(const ActQuantParams& p, cudaStream_t stream);
void fp8_sim(const Fp8SimParams& p, cudaStream_t stream);
void fp8_sim_inplace_bf16_cast(const Fp8SimParams& p, cudaStream_t stream);
void fp4_sim(const Fp8SimParams& p, cudaStream_t stream);

// ---- element-wise steps of the graph ----------------------------------------------------------
void bf16_round(float* x, int64_t n, cudaStream_t stream);               // x = bf16(x)
void scale_bf16(float* x, int64_t n, float scale, cudaStream_t stream);  // x = bf16(x * scale)
void divide(float* x, int64_t n, float d, cudaStream_t stream);          // x = x / d
// H[t, j, :] = table[tokens[t], :] for j < hc (the embedding copied into the hc residual streams).
void embed_streams(const float* table, int64_t D, const int32_t* tokens, int64_t T, int hc, float* H,
                   cudaStream_t stream);

// Copies of whole 4-byte words between device buffers, up to kMaxWordCopies in one launch (the
// parts of a report's snapshot: decisions, tensor values). Throws for more copies, a negative count
// or a null pointer with words to copy.
struct WordCopy {
  uint32_t* dst = nullptr;
  const uint32_t* src = nullptr;
  int64_t words = 0;
};
inline constexpr int kMaxWordCopies = 8;
void copy_words(const WordCopy* copies, int n, cudaStream_t stream);

}  // namespace dsv4::cuda
