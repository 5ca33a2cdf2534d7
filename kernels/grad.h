// Backward kernels of the training step (MODEL.md §5): one Params struct and one function per op,
// like the forward kernels. Conventions (docs/TRAINING.md "Gradient numerics"):
//
// - Every gradient is fp32 and is never rounded to bf16: the forward's bf16 roundings, the FP8
//   simulation and the bf16 output of a GEMM are straight-through (derivative 1).
// - Outputs marked "(+=)" are accumulated: out = out + contribution, one fp32 add per element per
//   call, so a tensor fed to several consumers sums their gradients in the order the graph calls
//   them. Outputs not marked are overwritten.
// - A sum over the tokens of a sequence (weight gradients, d_sink, dnorm, dape, dfn, the embedding
//   rows of repeated tokens, an expert's gradient over the tokens routed to it) is reduced in one
//   documented order that depends on nothing but the tokens: GEMM weight gradients use the canonical
//   dot of kernels/reduce.h over the token axis (in increasing token order); the others are a
//   sequential fp32 sum in increasing token order, each token's contribution formed first. No
//   atomics; results do not depend on the thread count.
// - Products over a feature axis (D, Dh, hc*D) use the canonical dot with the given ReduceOrder.
#pragma once

#include <cstdint>

#include "kernels/moe.h"
#include "kernels/reduce.h"

namespace dsv4 {

// ---- dense linear: Y [m, n] = X [m, k] · W [n, k]^T -----------------------------------------------

// dX[r, c] (+=) dot_n(dY[r, :], W[:, c]) over n = 0..n-1 in the canonical order (the column of W is
// gathered contiguously first). Rows independent. n == 0 gives dX = 0 (or dX + 0). dx must not
// overlap dy or w.
struct GemmDxParams {
  int64_t m = 0, n = 0, k = 0;
  const float* dy = nullptr;  // [m, n], row stride lddy
  int64_t lddy = 0;
  const float* w = nullptr;  // [n, k], row stride ldw
  int64_t ldw = 0;
  float* dx = nullptr;  // [m, k], row stride lddx
  int64_t lddx = 0;
  bool accumulate = false;
  ReduceOrder order{};
};
const char* gemm_dx_check(const GemmDxParams& p);
void gemm_dx(const GemmDxParams& p);

// dW[r, c] (+=) dot_m(dY[:, r], X[:, c]) over the m rows (tokens) in increasing order, canonical
// order (both columns gathered contiguously first). m == 0 gives dW = 0 (or dW + 0). dw must not
// overlap dy or x.
struct GemmDwParams {
  int64_t m = 0, n = 0, k = 0;
  const float* dy = nullptr;  // [m, n], row stride lddy
  int64_t lddy = 0;
  const float* x = nullptr;  // [m, k], row stride ldx
  int64_t ldx = 0;
  float* dw = nullptr;  // [n, k], row stride lddw
  int64_t lddw = 0;
  bool accumulate = true;
  ReduceOrder order{};
};
const char* gemm_dw_check(const GemmDwParams& p);
void gemm_dw(const GemmDwParams& p);

// ---- RMSNorm (kernels/norm.h), weighted or not ---------------------------------------------------

// Per row, with x the forward input (fp32 values), r = 1 / sqrt(sum_squares(x)/dim + eps) recomputed
// exactly as the forward does, g_i = dy_i * w_i (g_i = dy_i when w is null):
//   dx_i (+=) r * g_i - (r^3 / dim) * dot(g, x) * x_i
//   dw_i (+=) sum over rows (sequential, increasing row) of dy_i * x_i * r    (if dw != nullptr)
// dot(g, x) in the canonical order. Operation order (kernels/detail/grad_norm.h): c = (((r * r) * r)
// / dim) * dot(g, x); dx_i = r * g_i - c * x_i; the dw term of a row is (dy_i * x_i) * r, summed per
// element in an fp32 accumulator from 0, then added to dw once.
struct RmsNormBwdParams {
  int64_t rows = 0, dim = 0;
  const float* x = nullptr;  // forward input
  int64_t ldx = 0;
  const float* w = nullptr;  // [dim] or nullptr
  const float* dy = nullptr;
  int64_t lddy = 0;
  float* dx = nullptr;  // must not alias x or dy
  int64_t lddx = 0;
  bool accumulate_dx = false;
  float* dw = nullptr;  // [dim] (+=), or nullptr
  float eps = 1e-6f;
  ReduceOrder order{};
};
const char* rmsnorm_backward_check(const RmsNormBwdParams& p);
void rmsnorm_backward(const RmsNormBwdParams& p);

// ---- embedding and log-probabilities -----------------------------------------------------------

// dtable[tokens[t], d] += sum_j dH[t, j, d] for t = 0..T-1 in increasing order, j = 0..copies-1
// inside each t, one fp32 add each (a vocabulary row of a repeated token sums in token order).
// dH is [T, copies, D]; the tokens must be rows of dtable (not checked).
void embed_backward(const float* dH, int64_t D, const int32_t* tokens, int64_t T, int copies, float* dtable);

// logprob[t] = log_softmax(logits[t] / temperature)[target[t]]; given dlogprob[t]:
//   dlogits[t, v] = (dlogprob[t] / temperature) * ((v == target[t]) - exp_f(l[v]/temperature - lse_t))
// with lse_t recomputed by logsumexp_row of kernels/logits.h over l/temperature (each value divided
// in fp32 first, as the forward's divide does). Rows independent; rows with dlogprob 0 or without a
// target (target outside [0, V), as log_softmax_gather skips them) give zeros.
void log_softmax_backward(const float* logits, int64_t rows, int64_t V, const int32_t* target,
                          const float* dlogprob, float temperature, float* dlogits);

// ---- sparse attention with sink (kernels/attention.h, exact order; MODEL.md §5.1) ----------------

// From the forward's q, kv, idx, sink, o (bf16 output) and lse, and dO [T, H, Dh], for each (t, h)
// and valid slot j (idx[t][j] != -1; slot order):
//   Δ[t,h]   = dot(o[t,h], dO[t,h])
//   z_j      = scale * dot(q[t,h], kv[idx[t][j]])              (as the forward)
//   P_j      = exp_f(z_j - lse[t,h]);   p_sink = exp_f(sink[h] - lse[t,h])   (unrounded)
//   dz_j     = P_j * (dot(dO[t,h], kv[idx[t][j]]) - Δ[t,h])
//   dq[t,h]  = scale * acc, acc = fma(dz_j, kv[idx[t][j]], acc) over the valid slots from 0
//   dkv[n]   = sequential fp32 sum from 0 over the slots (t, j) with idx[t][j] == n, t increasing
//              then j increasing, and inside each slot over h increasing, of the term
//              (scale * dz_j) * q[t,h] + P_j * dO[t,h]   (two products, one add; one add per term)
//   dsink[h] (+=) -S, S = sequential sum from 0 over t increasing of Δ[t,h] * p_sink[t,h]
// (dots in the canonical order). A slot repeated in a row is one logit per slot, as in the forward.
// dq and dkv are overwritten; every dkv row no slot points to is 0 (also when T == 0). Empty rows
// give dq = 0 (and, their o being 0, a zero sink term). dsink may be nullptr (not formed). No
// atomics: each kv row is one sum in the order above, built from the inverse map of idx
// (kernels/detail/grad_attention.h); the CPU keeps P and scale * dz, 2 * T * K * H floats.
struct SparseAttnBwdParams {
  int64_t T = 0;
  int H = 0;
  int64_t Dh = 0;
  int64_t N = 0, K = 0;
  const float* q = nullptr;      // [T, H, Dh]
  const float* kv = nullptr;     // [N, Dh]
  const int32_t* idx = nullptr;  // [T, K]
  const float* sink = nullptr;   // [H]
  float scale = 0.0f;
  const float* o = nullptr;    // [T, H, Dh] forward output (before the inverse RoPE)
  const float* lse = nullptr;  // [T, H]
  const float* dO = nullptr;   // [T, H, Dh]
  ReduceOrder order{};
  float* dq = nullptr;     // [T, H, Dh]
  float* dkv = nullptr;    // [N, Dh]
  float* dsink = nullptr;  // [H] (+=) or nullptr
};
const char* sparse_attention_backward_check(const SparseAttnBwdParams& p);
void sparse_attention_backward(const SparseAttnBwdParams& p);

// ---- compressor pooling (kernels/compressor.h CompressorPoolParams, hadamard = false) ------------

// Backward of compressor_pool for groups g0 .. g0+G-1 from the kept fp32 projections kvp, sc of
// tokens [row0, row0 + rows) and dout [G, d] (the gradient of the pooled, normed, rotated rows), per
// group g (the bf16 roundings of the forward are straight-through):
//   1. dy = dout[g] with its last rd dims turned back: each pair (a, b) -> (a c + b s, b c - a s),
//      c, s = cos_f / sin_f of the forward's angle fp32(g * ratio) * freq[i] (fp32, not rounded);
//   2. RMSNorm backward with x = bf16(c_g) (c_g recomputed as the forward pools it), weight norm,
//      r = 1 / sqrt(sum_squares(x)/d + eps) as the forward: gw_i = dy_i * norm_i, s = dot(gw, x),
//      k = (((r * r) * r) / d) * s, dc_i = r * gw_i - k * x_i; dnorm's term (dy_i * x_i) * r;
//   3. pooling, per channel: w_s = e_s / Z with the forward's m, e_s = exp_f(sc + ape - m) and Z;
//      A = fma(w_s, dc * kv_s, A) over the slots from 0; dkv_s = w_s * dc;
//      dscore_s = w_s * (dc * kv_s - A);
//   4. scatter the slots back to their tokens and feature halves (ratio 4: slots 0..3 of group g are
//      tokens of group g-1, features [0, d); slots 4..7 its own tokens, features [d, 2d); group 0's
//      previous slots receive nothing). Each element of dkvp / dsc receives at most one term.
//   dape[k, col] (+=) S, S = sequential sum from 0 over groups in increasing order of the dscore of
//   the slot that read ape[k, col]; dnorm[i] (+=) the same sum of the groups' terms of step 2.
// dkvp and dsc [rows, coff*d] are overwritten whenever rows > 0 (elements no group reads, e.g. the
// rows of the incomplete tail and the halves of groups outside g0 .. g0+G-1: 0). The dkvp / dsc
// elements a group writes do not depend on the other groups of the call (a chunk gives the same bits
// as the whole sequence). Arithmetic: kernels/detail/grad_compressor.h.
struct CompressorPoolBwdParams {
  int64_t g0 = 0, G = 0;
  int64_t row0 = 0, rows = 0;
  int ratio = 4;
  int64_t d = 0;
  int rd = 64;
  const float* kvp = nullptr;
  const float* sc = nullptr;
  const float* ape = nullptr;
  const float* norm = nullptr;
  const float* freq = nullptr;
  float rms_eps = 1e-6f;
  ReduceOrder order{};
  const float* dout = nullptr;  // [G, d]
  float* dkvp = nullptr;        // [rows, coff*d]
  float* dsc = nullptr;         // [rows, coff*d]
  float* dape = nullptr;        // [ratio, coff*d] (+=) or nullptr
  float* dnorm = nullptr;       // [d] (+=) or nullptr
};
const char* compressor_pool_backward_check(const CompressorPoolBwdParams& p);
void compressor_pool_backward(const CompressorPoolBwdParams& p);

// ---- manifold hyper-connections (kernels/mhc.h; MODEL.md §5.2) -----------------------------------
// Per-token arithmetic in kernels/detail/grad_mhc.h (shared with a device backend); hc <= 16 for
// hc_pre_backward / hc_head_backward.

// hc_post backward: out[t,k] = post_k f[t] + sum_j comb[j][k] R[t,j].
//   df[t,d]      (+=) v, v = fma chain over k from 0 (v = 0 first) of post_k * dout[t,k,d]
//   dR[t,j,d]    (+=) v, v = fma chain over k from 0 of comb[j][k] * dout[t,k,d]
//   dpost[t,k]   = dot(dout[t,k], f[t])                    (canonical order over D)
//   dcomb[t,j,k] = dot(dout[t,k], R[t,j])
// Tokens independent. dR must not alias R or dout, df not f.
struct HcPostBwdParams {
  int64_t T = 0;
  int hc = 4;
  int64_t D = 0;
  const float* f = nullptr;     // [T, D]
  const float* R = nullptr;     // [T, hc, D]
  const float* post = nullptr;  // [T, hc]
  const float* comb = nullptr;  // [T, hc, hc]
  const float* dout = nullptr;  // [T, hc, D]
  ReduceOrder order{};
  float* df = nullptr;     // [T, D] (+=)
  float* dR = nullptr;     // [T, hc, D] (+=)
  float* dpost = nullptr;  // [T, hc]
  float* dcomb = nullptr;  // [T, hc, hc]
};
const char* hc_post_backward_check(const HcPostBwdParams& p);
void hc_post_backward(const HcPostBwdParams& p);

// hc_pre backward (MODEL.md §5.2). Per token, with x = X[t] flattened (n = hc*D values), everything
// of the forward recomputed with hc_pre's operations (bit-identical): rho = rms_scale(sum_squares(x)),
// u_i = raw_i = dot(fn_i, x) (one gemm with fp32 out, as the forward), m_i = rho * u_i,
// a_i = m_i * scale[g(i)] + base_i, pre_j = sigmoid_f(a_j) + hc_eps, and the 2*iters + 1 Sinkhorn
// iterates of a[2hc..] (the softmax p, then the input of each normalisation step, then comb). Then:
//   dpre_j  = dot(dy[t], X[t,j])                                        (canonical order over D)
//   da_j    = dpre_j * (s * (1 - s)),  s = sigmoid_f(a_j)                 j < hc
//   da_hc+k = dpost_k * (2 * (s * (1 - s))), s = sigmoid_f(a_(hc+k))
//   da_2hc+ = Sinkhorn backward of dcomb through every step, last first: a column (odd step) or row
//             (even step) normalisation c' = c / d with d = sequential sum of the line of c + hc_eps
//             gives, per line, w = fma chain over the line (increasing, from 0) of dc' * c,
//             dc = (dc' - w / d) / d; the first row step (softmax p, then + eps) gives per row
//             w = fma chain over k of dc1 * p, dC0 = p * (dc1 - w)
//   dm_i = da_i * scale[g(i)];  gc_i = rho * dm_i
//   c    = (((rho * rho) * rho) / float(n)) * (fma chain over i from 0 of dm_i * u_i)
//   dX[t,q] (+=) v, q = j*D + d:  v = pre_j * dy[t,d];  v = fma(gc_i, fn[i,q], v) for the
//           (2+hc)*hc rows i from 0 (24 for hc = 4);  v = fma(-c, x_q, v)
//           (= pre_j dy + rho fn^T dm - (rho^3/n) <dm, u> x)
//   dfn[i,q] (+=) sequential fp32 sum over t increasing (from 0) of (gc_i[t] * x_q[t])
//   dbase[i] (+=) sequential sum over t of da_i[t]
//   dscale[g] (+=) sequential sum over t of the token's (fma chain over the rows i of group g,
//           increasing, from 0, of da_i * m_i)
// Each "(+=)" is out = out + (the whole contribution of the call), one add per element.
// legacy mode (train_mixer = false; MODEL.md §5.2 (b)): pre, post, comb are constants:
// dX[t,q] (+=) pre_j * dy[t,d] only; dpost / dcomb are not read (may be null) and dfn / dscale /
// dbase are untouched (may be null). In full mode with dfn, dscale and dbase all null (the mixer's
// weights frozen), dX is the full mode's and no weight gradient is formed. dX must not alias X or dy.
struct HcPreBwdParams {
  int64_t T = 0;
  int hc = 4;
  int64_t D = 0;
  const float* X = nullptr;  // [T, hc, D] streams that entered hc_pre
  const float* fn = nullptr;
  const float* scale = nullptr;
  const float* base = nullptr;
  float rms_eps = 1e-6f, hc_eps = 1e-6f;
  int sinkhorn_iters = 20;
  ReduceOrder order{};
  const float* dy = nullptr;     // [T, D]
  const float* dpost = nullptr;  // [T, hc]
  const float* dcomb = nullptr;  // [T, hc, hc]
  bool train_mixer = true;
  float* dX = nullptr;      // [T, hc, D] (+=)
  float* dfn = nullptr;     // [(2+hc)*hc, hc*D] (+=)
  float* dscale = nullptr;  // [3] (+=)
  float* dbase = nullptr;   // [(2+hc)*hc] (+=)
};
const char* hc_pre_backward_check(const HcPreBwdParams& p);
void hc_pre_backward(const HcPreBwdParams& p);

// hc_head backward: as hc_pre's without post / comb / Sinkhorn: rows = hc, one scale group,
// w_j = sigmoid_f(a_j) + hc_eps in place of pre_j, dw_j = dot(dy[t], X[t,j]), da_j = dw_j * (s * (1 - s));
// dX, dfn [hc, hc*D], dbase [hc] and dscale [1] in the orders above; legacy mode: dX (+=) w_j * dy only.
struct HcHeadBwdParams {
  int64_t T = 0;
  int hc = 4;
  int64_t D = 0;
  const float* X = nullptr;
  const float* fn = nullptr;
  const float* scale = nullptr;
  const float* base = nullptr;
  float rms_eps = 1e-6f, hc_eps = 1e-6f;
  ReduceOrder order{};
  const float* dy = nullptr;  // [T, D]
  bool train_mixer = true;
  float* dX = nullptr;  // (+=)
  float* dfn = nullptr;
  float* dscale = nullptr;
  float* dbase = nullptr;
};
const char* hc_head_backward_check(const HcHeadBwdParams& p);
void hc_head_backward(const HcHeadBwdParams& p);

// ---- MoE (kernels/moe.h; MODEL.md §5.3) ---------------------------------------------------------

// Router backward: with s_e = sqrt(softplus_f(logit_e)) recomputed, S = sum_i s_(ids_i) (sequential
// over i), lambda = routed_scaling_factor and dw the gradient of the routing weights [T, k]:
//   norm_topk_prob: ds_i = lambda * (dw_i / S - (sum_j dw_j * s_j) / (S * S))   (sums sequential in i)
//   else:           ds_i = lambda * dw_i
//   dlogits[t, e] = ds_i * sigmoid_f(logit_e) / (2 * s_e) for e = ids_i, 0 for the other experts
// (the ids are constants; the bias never receives a gradient). dlogits is overwritten.
// Operation order (kernels/detail/grad_moe.h router_backward_row): S and A = sum_j dw_j * s_j are
// fp32 accumulators from 0 (one multiply, one add per term); ds_i = lambda * ((dw_i / S) - (A / (S * S)));
// the term is (ds_i * sigmoid_f(logit_e)) / (2 * s_e), 0 where s_e == 0 (softplus underflowed); a
// repeated id sums its slots' terms in slot order.
struct RouterBwdParams {
  int64_t T = 0;
  int E = 0, k = 0;
  const float* logits = nullptr;  // [T, E]
  const int32_t* ids = nullptr;   // [T, k]
  const float* dweights = nullptr;
  bool norm_topk_prob = true;
  float routed_scaling_factor = 1.0f;
  float* dlogits = nullptr;  // [T, E]
};
const char* router_backward_check(const RouterBwdParams& p);
void router_backward(const RouterBwdParams& p);

// Gradients of one SwiGLU expert's weights (layout of ExpertWeights), fp32.
struct ExpertGrads {
  float* dw1 = nullptr;  // [I, D] (+=), or nullptr (frozen)
  float* dw3 = nullptr;  // [I, D] (+=)
  float* dw2 = nullptr;  // [D, I] (+=)
};
// Experts backward: recomputes each routed and shared expert's g, u (bf16, clamped) and a from x as
// moe_experts does; given dout [T, D]:
//   da[t]  = dot_D(dout[t], w2 column) for each of the I hidden units (canonical order over D)
//   routed: dweights[t, i] = dot_I(da, silu(g) * u) ; dh = weight * da; shared: dh = da
//   dg = dh * u * silu'(g) where g passed its clamp (g <= L), else 0;
//   du = dh * silu(g) where -L <= u <= L, else 0           (clamp only when L > 0; shared: only when
//                                                            clamp_shared)
//   dx[t] (+=) dot_I(dg, w1 column) + dot_I(du, w3 column), summed over the token's routed experts in
//          ascending slot order, then the shared experts
//   dw2 (+=) sum over the expert's tokens (increasing t) of dout[t] ⊗ a[t]; dw1 (+=) dg ⊗ x; dw3 (+=)
//   du ⊗ x (canonical order over the gathered tokens).
// Precisely (kernels/detail/grad_moe.h): g, u are the forward's bf16 GEMM outputs, g_c, u_c the
// clamped values, silu(g) * u is silu_f(g_c) * u_c (unweighted, unrounded), a is the forward's bf16
// activation (swiglu_act); dh = weight * da; dg = (dh * u_c) * silu'(g_c) with silu'(g) =
// s * (1 + g * (1 - s)), s = sigmoid_f(g); du = dh * silu_f(g_c); the clamp boundaries pass the
// gradient; every dot uses fwd.order. The weight gradients' tokens are the expert's (token, slot)
// pairs in increasing token (then slot) order, the m rows of a gemm_dw. dx: each term is
// (dot_I(dg, w1 col) + dot_I(du, w3 col)); a token's terms are summed in an fp32 accumulator from 0
// (routed in slot order, then shared experts in order), and the sum is added to dx once. dx,
// dweights, grads, shared_grads and any dw* may be null (not wanted).
struct MoeBwdParams {
  MoeParams fwd;                // the forward's parameters (out unused)
  const float* dout = nullptr;  // [T, D]
  float* dx = nullptr;          // [T, D] (+=)
  float* dweights = nullptr;    // [T, k]
  const ExpertGrads* grads = nullptr;         // [E]
  const ExpertGrads* shared_grads = nullptr;  // [n_shared]
};
const char* moe_experts_backward_check(const MoeBwdParams& p);
void moe_experts_backward(const MoeBwdParams& p);
// moe_experts_backward in two parts, for expert parallelism (model/expert_parallel.h), as the forward
// (kernels/moe.h moe_routed_outputs / moe_combine). The pairs of experts [e0, e1) in moe_pairs' order:
// their experts' weight gradients (+=), each pair's input gradient (row of dx_pairs [pairs, D], unless
// null) and routing-weight gradient (dw_pairs [pairs]). Then, given those of every expert's pairs in
// that order: dweights, the shared experts' gradients and dx, each summed as moe_experts_backward sums
// it, so the two parts give its bits whoever computed each pair.
void moe_backward_routed(const MoeBwdParams& p, int e0, int e1, float* dx_pairs, float* dw_pairs);
void moe_backward_combine(const MoeBwdParams& p, const float* dx_pairs, const float* dw_pairs);

// ---- the lightning indexer's KL objective (MODEL.md §5.5; docs/TRAINING.md "Indexer KL") ---------

// The transpose of kernels/compressor.h hadamard() for gradients: the same butterflies (the Sylvester
// matrix is symmetric) over each of the `rows` vectors of length n (a power of two), then each value
// times s = 1.0f / sqrt(float(n)) in fp32; no bf16 rounding (the forward's is straight-through).
void hadamard_backward(float* x, int64_t rows, int64_t n, int64_t ld);

// The main attention's probability mass on a column range of the index rows, the KL's target: for
// each row t and index slot j in [c0, c0 + n) of idx [T, K],
//   mass[t, j - c0] = S, S = fp32 sum from 0 over h increasing of exp_f(z - lse[t, h]),
//   z = scale * dot(q[t, h], kv[idx[t][j]])   (the forward's score and the backward's probability)
// and 0 for a slot -1. The probabilities are those of the full softmax (window, compressed slots and
// the sink share lse). Rows independent.
struct AttentionMassParams {
  int64_t T = 0;
  int H = 0;
  int64_t Dh = 0;
  int64_t N = 0, K = 0;
  int64_t c0 = 0, n = 0;         // the slot columns
  const float* q = nullptr;      // [T, H, Dh]
  const float* kv = nullptr;     // [N, Dh]
  const int32_t* idx = nullptr;  // [T, K]
  const float* lse = nullptr;    // [T, H]
  float scale = 0.0f;
  ReduceOrder order{};
  float* mass = nullptr;  // [T, n]
};
const char* attention_mass_check(const AttentionMassParams& p);
void attention_mass(const AttentionMassParams& p);

// The KL objective of each query row over its selected groups, and its gradient with respect to the
// index scores. Row t's valid slots are those with ids[t][j] >= 0 (an empty row: loss 0, gradient 0).
// With tiny = FLT_MIN (the fp32 smallest normal; probabilities are clamped to it before the logs):
//   predict: m = max of the valid scores; e_j = exp_f(s_j - m); Z = sequential sum of e_j; π_j = e_j / Z
//   target:  l1 (default): μ = mass, M = sequential sum of μ_j; τ_j = μ_j / M (M == 0: the row gives 0)
//            heads_sum:    τ_j = μ_j (the heads-summed mass, not renormalised)
//   loss[t] = fp32 sum from 0 over valid j with τ_j > 0 of
//             τ_j * (log_f(max(τ_j, tiny)) - log_f(max(π_j, tiny)))
//   A = fp32 sum from 0 over valid j with π_j >= tiny of τ_j
//   dscore[t, j] = coeff * ((π_j * A) - (π_j >= tiny ? τ_j : 0))   (0 for the invalid slots)
// (the exact derivative of the loss above, the clamp included, times coeff). Arithmetic:
// kernels/detail/grad_indexer.h indexer_kl_row.
struct IndexerKlParams {
  int64_t T = 0;
  int k = 0;
  const int32_t* ids = nullptr;  // [T, k] selected groups, -1 = empty slot
  const float* score = nullptr;  // [T, k] their index scores (the forward's)
  const float* mass = nullptr;   // [T, k] the attention mass on them (attention_mass)
  bool l1_target = true;
  float coeff = 1.0f;           // the loss weight of every row (the objective's coefficient / divisor)
  float* loss = nullptr;        // [T] the rows' KL (without coeff)
  float* dscore = nullptr;      // [T, k]
};
const char* indexer_kl_check(const IndexerKlParams& p);
void indexer_kl(const IndexerKlParams& p);

// Backward of the index scores of given ids (kernels/indexer.h: score[t][j] = fma chain over h of
// wt[t][h] * relu(dot(qi[t,h], ki[ids[t][j]]))) for the gradient dscore [T, k]; the ids are constants.
// With d_thj = dot(qi[t,h], ki[ids[t][j]]) recomputed as the forward forms it (canonical order) and
// e_thj = (dscore[t,j] * wt[t,h]) if d_thj > 0, else 0 (relu'(0) = 0; NaN gives 0):
//   dwt[t, h]  = wt_scale * S, S = fp32 sum from 0 over valid j increasing of dscore[t,j] * relu(d_thj)
//   dqi[t,h,:] = fma chain from 0 over valid j increasing: acc = fma(e_thj, ki[ids[t][j]], acc)
//   dki[g, :]  = fma chain from 0 over the slots (t, j) with ids[t][j] == g, t increasing then j
//                increasing, and inside each slot h increasing: acc = fma(e_thj, qi[t,h], acc)
// (wt_scale turns the gradient of the scaled head weights into that of the weights_proj output).
// dqi, dwt and dki are overwritten; dki rows no slot points to are 0. Slots with ids outside [0, G)
// are skipped like -1 (the CPU check rejects them). No atomics: dki is built from the inverse map of
// ids as the attention's dkv is. The CPU keeps e, T * k * Hi floats.
struct IndexerScoreBwdParams {
  int64_t T = 0;
  int Hi = 0;
  int64_t Di = 0;
  int64_t G = 0;
  int k = 0;
  const float* qi = nullptr;      // [T, Hi, Di]
  const float* ki = nullptr;      // [G, Di]
  const float* wt = nullptr;      // [T, Hi]
  const int32_t* ids = nullptr;   // [T, k]
  const float* dscore = nullptr;  // [T, k]
  float wt_scale = 1.0f;
  ReduceOrder order{};
  float* dqi = nullptr;  // [T, Hi, Di]
  float* dwt = nullptr;  // [T, Hi]
  float* dki = nullptr;  // [G, Di]
};
const char* indexer_score_backward_check(const IndexerScoreBwdParams& p);
void indexer_score_backward(const IndexerScoreBwdParams& p);

}  // namespace dsv4
