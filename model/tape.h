// What the backward of one sequence needs from its forward (docs/TRAINING.md "Memory"): the forward
// of model/forward.cpp keeps these buffers when given a Tape, and model/backward.cpp reads them.
// Everything kept is linear in T (the attention keeps its [T, K] index rows, K bounded by the window
// and the indexer width); what is cheaper to recompute than to keep is recomputed by the backward
// kernels (the mHC mixing weights and Sinkhorn iterates, the compressor's pooled rows, the experts'
// hidden activations, the attention probabilities).
#pragma once

#include <cstdint>
#include <vector>

#include "model/device.h"

namespace dsv4 {

struct AttentionTape {
  backend::Buffer<float> H_in;           // [T, hc, D] streams entering hc_pre
  backend::Buffer<float> post, comb;     // [T, hc], [T, hc, hc] hc_pre's mixing weights
  backend::Buffer<float> a_in;           // [T, D] hc_pre output (attn_norm input)
  backend::Buffer<float> x;              // [T, D] attn_norm output (the sublayer input)
  backend::Buffer<float> qa;             // [T, q_lora] wq_a output (q_norm input)
  backend::Buffer<float> qr;             // [T, q_lora] q_norm output
  backend::Buffer<float> q_lin;          // [T, H * Dh] wq_b output (per-head norm input)
  backend::Buffer<float> q;              // [T, H * Dh] the attention's queries
  backend::Buffer<float> kv_lin;         // [T, Dh] wkv output (kv_norm input)
  backend::Buffer<float> kvp, sc;        // [T, coff * Dh] main compressor projections (C4 / C128)
  backend::Buffer<float> kvcat;          // [N, Dh] the attention's KV rows
  backend::Buffer<int32_t> idx;          // [T, K]
  int64_t N = 0, K = 0, G = 0;           // kv rows, index width, compressed rows
  backend::Buffer<float> o_attn, lse;    // [T, H * Dh] attention output (before the inverse RoPE), [T, H]
  backend::Buffer<float> o;              // [T, H * Dh] after the inverse RoPE (wo_a input)
  backend::Buffer<float> u;              // [T, G * R] wo_b input
  backend::Buffer<float> out;            // [T, D] the sublayer output
  // The lightning indexer (C4 layers, kept only for its KL objective: Tape::keep_indexer).
  backend::Buffer<float> qi, ki, wt;     // [T, Hi * Di] queries, [G, Di] keys, [T, Hi] head weights
  backend::Buffer<float> ikvp, isc;      // [T, 2 * Di] its compressor's projections
  backend::Buffer<int32_t> sel;          // [T, k] the selected groups (forced or free)
  backend::Buffer<float> iscore;         // [T, k] their index scores
  int k = 0;                             // indexer width
};

struct FfnTape {
  backend::Buffer<float> H_in, post, comb;  // as AttentionTape
  backend::Buffer<float> f_in;              // [T, D] ffn_norm input
  backend::Buffer<float> x;                 // [T, D] MoE input
  backend::Buffer<float> logits;            // [T, E] router logits
  backend::Buffer<int32_t> ids;             // [T, k]
  backend::Buffer<float> weights;           // [T, k]
  backend::Buffer<float> out;               // [T, D] MoE output
};

struct Tape {
  bool keep_indexer = false;  // keep the indexer's tensors (set before the forward; for its KL objective)
  std::vector<AttentionTape> attn;
  std::vector<FfnTape> ffn;
  backend::Buffer<float> H_final;  // [T, hc, D] streams entering hc_head
  backend::Buffer<float> y_hc;     // [T, D] hc_head output (final norm input)
  backend::Buffer<float> y;        // [T, D] final norm output (lm_head input)
  backend::Buffer<float> logits;   // [T, V] (divided by the temperature when it is not 1)
  backend::Buffer<int32_t> tokens;  // [T]
};

struct RunOptions;
struct SequenceResult;
class Weights;

// The whole-sequence forward of `tokens` as sequence `seq` on `be` (made for `w`), exactly forward()'s
// computation and reports, keeping in `tape` what the backward needs.
SequenceResult forward_with_tape(backend::Backend& be, const Weights& w, int seq,
                                 const std::vector<int32_t>& tokens, const RunOptions& opt, Tape& tape);

}  // namespace dsv4
