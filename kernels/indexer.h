// Lightning indexer scores + top-k (MODEL.md §3.7) and the attention index construction (§3.6).
#pragma once

#include <cstdint>

#include "kernels/reduce.h"

namespace dsv4 {

// Top-k of a score row: larger score first, then smaller index (documented tie-break); NaN never
// selected before a number. Writes the k chosen indices *sorted ascending* into ids (the set is what
// attention uses; a canonical order makes forced and free runs bit-identical) and returns the margin
// score(k-th chosen) - score(best unchosen), or +inf when fewer than k+1 candidates exist or k = 0.
// n candidates, k <= n. Scratch must hold n int32.
float topk_row(const float* score, int64_t n, int k, int32_t* ids, int32_t* scratch);

struct IndexerParams {
  int64_t T = 0;
  int64_t pos0 = 0;  // position of query row 0 (a decoding engine's chunk starts later); ki holds groups
                     // from 0
  int Hi = 0;
  int64_t Di = 0;
  int64_t G = 0;  // compressed groups (rows of ki)
  int k = 0;      // width: min(index_topk, G)
  int ratio = 4;
  const float* qi = nullptr;  // [T, Hi, Di] bf16 values (after RoPE, Hadamard, optional fp8 sim)
  const float* ki = nullptr;  // [G, Di]
  const float* wt = nullptr;  // [T, Hi] fp32 head weights (already scaled by Hi^-1/2 Di^-1/2)
  ReduceOrder order{};
  bool bf16_scores = false;  // the score chain in bf16 arithmetic (below); false: fp32
  int32_t* ids = nullptr;    // [T, k] out: chosen groups ascending, then -1 for empty slots
  float* margin = nullptr;  // [T] out (may be nullptr)
  float* score = nullptr;   // [T, k] out: score of each chosen id, NaN for -1 slots (may be nullptr)
};
// score[p][g] = sum_h wt[p][h] * relu(dot(qi[p,h], ki[g])) as fma chain over h from 0, with
// relu(x) = (x < 0 ? 0 : x) (NaN propagates); with bf16_scores (an engine that runs the score in
// bf16, MODEL.md §12.1), s = 0, s = s + bf16(wt[p][h] * relu(bf16(dot))) for h from 0, score = bf16(s)
// (kernels/detail/indexer.h index_score_step); for query row t at position p = pos0 + t only groups
// g < min(G, floor((p+1)/ratio)) are candidates (causal: the group is complete). Row p takes
// min(k, #candidates) ids. The CPU computes the q.k dot products of a chunk of query rows as one
// GEMM (each element the same dot()); memory is O(T * k + threads * G) plus a 16 MiB chunk buffer:
// no [T, G] score matrix is kept.
const char* indexer_check(const IndexerParams& p);
void indexer_topk(const IndexerParams& p);

// Scores of given (e.g. forced) ids for row-wise reporting: score[p][j] for ids[p][j] (NaN for -1
// and any id outside [0, G)); no causal mask is applied.
void indexer_score_ids(const IndexerParams& p, const int32_t* ids, float* score);

// Attention index rows (§3.6): idx[p] = window part (width Kw = min(T, W): start = max(0, p-W+1),
// entry m = start+m if <= p else -1) followed by the compressed part:
//   kind none: nothing; kind c128: width floor(T/ratio), entry g = g + T if g < floor((p+1)/ratio) else -1;
//   kind c4: width k, entry = sel[p][j] + T if sel >= 0, else -1 (sel must be visible: checked by the
//   caller).
// The KV rows they point into are the T window rows, then the compressed rows.
//
// A chunk of a decoding engine (pos0 > 0) has its T query rows at positions pos0 .. pos0 + T - 1 and
// KV rows [the hist window rows of positions pos0 - hist .. pos0 - 1 | its own T rows | compressed
// rows]; hist must be min(pos0, W - 1) or more. Widths and entries are those of a prefill of pos0 + T
// tokens restricted to the chunk's rows, with row numbers shifted to that KV layout, so every row
// lists the same keys in the same order as in the whole-sequence prefill (pos0 = hist = 0).
enum class CompressedKind { none, c128, c4 };
struct IndexBuildParams {
  int64_t T = 0;
  int64_t pos0 = 0;  // position of query row 0
  int64_t hist = 0;  // window rows before the chunk's own rows
  int W = 128;
  CompressedKind kind = CompressedKind::none;
  int ratio = 0;
  int k = 0;                     // c4 width
  const int32_t* sel = nullptr;  // c4: [T, k]
  int32_t* idx = nullptr;        // [T, index_width()]
};
int64_t index_window_width(const IndexBuildParams& p);  // min(pos0 + T, W)
int64_t index_width(const IndexBuildParams& p);
void build_index(const IndexBuildParams& p);

}  // namespace dsv4
