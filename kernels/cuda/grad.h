// The CUDA backend's backward ops (kernels/grad.h): one function per op, the same Params structs (every
// pointer a device pointer unless stated), the same contract as kernels/cuda/ops.h: every output
// element with the operation order kernels/grad.h documents and the CPU reference implements, so
// results are bit-identical to the CPU; no atomics; parameters validated before anything is launched.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "kernels/grad.h"

namespace dsv4::cuda {

// ---- elementwise / dense (kernels/cuda/grad_linear.cu) --------------------------------------------
void zero(float* x, int64_t n, cudaStream_t stream);
void add(float* y, const float* x, int64_t n, cudaStream_t stream);  // y = y + x
void gemm_dx(const GemmDxParams& p, cudaStream_t stream);
void gemm_dw(const GemmDwParams& p, cudaStream_t stream);
void rmsnorm_backward(const RmsNormBwdParams& p, cudaStream_t stream);
// tokens: device [T]
void embed_backward(const float* dH, int64_t D, const int32_t* tokens, int64_t T, int copies, float* dtable,
                    int64_t vocab, cudaStream_t stream);
void log_softmax_backward(const float* logits, int64_t rows, int64_t V, const int32_t* target,
                          const float* dlogprob, float temperature, float* dlogits, cudaStream_t stream);

// ---- MoE (kernels/cuda/grad_moe.cu) -----------------------------------------------------------------
void router_backward(const RouterBwdParams& p, cudaStream_t stream);
// p.fwd.experts / p.fwd.shared / p.grads / p.shared_grads are host arrays of device pointers.
void moe_experts_backward(const MoeBwdParams& p, cudaStream_t stream);
// moe_experts_backward in two parts, for expert parallelism (every pointer a device pointer): the
// routed experts [e0, e1) (their weight gradients +=; per pair of theirs, in moe_pairs' order, the two
// input-gradient halves dG . w1 and dU . w3 [pairs, D] and the routing-weight gradient [pairs]); then,
// given those of every expert's pairs in that order, dweights, the shared experts and dx += the
// slot-order sum, as moe_experts_backward forms them. Together they give its bits.
void moe_backward_routed(const MoeBwdParams& p, int e0, int e1, float* dx1_pairs, float* dx3_pairs, float* dw_pairs,
                         cudaStream_t stream);
void moe_backward_combine(const MoeBwdParams& p, const float* dx1_pairs, const float* dx3_pairs, const float* dw_pairs,
                          cudaStream_t stream);

// ---- mHC (kernels/cuda/grad_mhc.cu) ------------------------------------------------------------------
void hc_post_backward(const HcPostBwdParams& p, cudaStream_t stream);
void hc_pre_backward(const HcPreBwdParams& p, cudaStream_t stream);
void hc_head_backward(const HcHeadBwdParams& p, cudaStream_t stream);

// ---- attention and compressor (kernels/cuda/grad_attention.cu, grad_compressor.cu) ----------------
void sparse_attention_backward(const SparseAttnBwdParams& p, cudaStream_t stream);
void compressor_pool_backward(const CompressorPoolBwdParams& p, cudaStream_t stream);

// ---- the indexer's KL objective (kernels/cuda/grad_indexer.cu; the Hadamard transpose in compressor.cu) --
void hadamard_backward(float* x, int64_t rows, int64_t n, int64_t ld, cudaStream_t stream);
void attention_mass(const AttentionMassParams& p, cudaStream_t stream);
void indexer_kl(const IndexerKlParams& p, cudaStream_t stream);
void indexer_score_backward(const IndexerScoreBwdParams& p, cudaStream_t stream);

}  // namespace dsv4::cuda
