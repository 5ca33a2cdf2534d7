#include "model/forward.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <memory>
#include <string>

#include "kernels/attention.h"
#include "kernels/compressor.h"
#include "kernels/detail/compressor.h"
#include "kernels/indexer.h"
#include "kernels/linear.h"
#include "kernels/logits.h"
#include "kernels/mhc.h"
#include "kernels/moe.h"
#include "kernels/norm.h"
#include "kernels/numerics/numerics.h"
#include "kernels/quant.h"
#include "kernels/rope.h"
#include "kernels/row_sums.h"
#include "model/device.h"
#include "model/error.h"
#include "model/expert_parallel.h"
#include "model/late_reports.h"
#include "model/mhc_mixer.h"
#include "model/tape.h"
#include "model/threads.h"

namespace dsv4 {

namespace {

// ---- forced decisions ------------------------------------------------------------------------

// Checks a forced indexer selection against the rules of MODEL.md §3.6-3.7 and returns it with every
// row in canonical order (ascending, -1 last).
std::vector<int32_t> canonical_indexer(const ForcedSelection& s, const ModelConfig& c, int seq, int layer,
                                       int64_t T) {
  const int k = c.indexer_width(T);
  if (s.T != T)
    throw OverrideError(
        fmt::format("forced indexer selection for sequence {} layer {}: {} rows, but the sequence has "
                    "{} tokens",
                    seq, layer, s.T, T));
  if (s.k != k)
    throw OverrideError(
        fmt::format("forced indexer selection for sequence {} layer {}: width {}, expected "
                    "min(index_topk, floor(T/4)) = min({}, {}) = {}",
                    seq, layer, s.k, c.index_topk, T / 4, k));
  if (int64_t(s.ids.size()) != T * k)
    throw OverrideError(
        fmt::format("forced indexer selection for sequence {} layer {}: {} ids for a [{}, {}] table", seq,
                    layer, s.ids.size(), T, k));
  std::vector<int32_t> out(s.ids);
  for (int64_t p = 0; p < T; ++p) {
    int32_t* row = out.data() + p * k;
    const int64_t visible = (p + 1) / 4;
    for (int j = 0; j < k; ++j) {
      const int32_t g = row[j];
      if (g == -1) continue;
      if (g < 0 || g >= compressor_groups(T, 4))
        throw OverrideError(
            fmt::format("forced indexer selection, sequence {} layer {} token {}: group {} is out of "
                        "range [0, {})",
                        seq, layer, p, g, compressor_groups(T, 4)));
      if (g >= visible)
        throw OverrideError(
            fmt::format("forced indexer selection, sequence {} layer {} token {}: group {} is not yet "
                        "visible (a token at position {} sees groups < {})",
                        seq, layer, p, g, p, visible));
    }
    // -1 sorts last when compared as unsigned.
    std::sort(row, row + k, [](int32_t a, int32_t b) { return uint32_t(a) < uint32_t(b); });
    for (int j = 1; j < k; ++j)
      if (row[j] != -1 && row[j] == row[j - 1])
        throw OverrideError(
            fmt::format("forced indexer selection, sequence {} layer {} token {}: group {} appears twice",
                        seq, layer, p, row[j]));
  }
  return out;
}

std::vector<int32_t> canonical_experts(const ForcedSelection& s, const ModelConfig& c, int seq, int layer,
                                       int64_t T) {
  const int k = c.num_experts_per_tok;
  if (s.T != T)
    throw OverrideError(
        fmt::format("forced experts for sequence {} layer {}: {} rows, but the sequence has {} tokens", seq,
                    layer, s.T, T));
  if (s.k != k || int64_t(s.ids.size()) != T * k)
    throw OverrideError(
        fmt::format("forced experts for sequence {} layer {}: width {}, expected num_experts_per_tok = {}",
                    seq, layer, s.k, k));
  std::vector<int32_t> out(s.ids);
  for (int64_t t = 0; t < T; ++t) {
    int32_t* row = out.data() + t * k;
    for (int j = 0; j < k; ++j)
      if (row[j] < 0 || row[j] >= c.n_routed_experts)
        throw OverrideError(
            fmt::format("forced experts, sequence {} layer {} token {}: expert id {} is out of range "
                        "[0, {})",
                        seq, layer, t, row[j], c.n_routed_experts));
    std::sort(row, row + k);
    for (int j = 1; j < k; ++j)
      if (row[j] == row[j - 1])
        throw OverrideError(fmt::format(
            "forced experts, sequence {} layer {} token {}: expert {} appears twice", seq, layer, t, row[j]));
  }
  return out;
}

void check_override_targets(const Overrides& o, const ModelConfig& c,
                            const std::vector<std::vector<int32_t>>& batch) {
  auto check_key = [&](int seq, int layer, const char* what) {
    if (seq < 0 || seq >= int(batch.size()))
      throw OverrideError(
          fmt::format("forced {} for sequence {}: the batch has {} sequences", what, seq, batch.size()));
    if (layer < 0 || layer >= c.num_hidden_layers)
      throw OverrideError(
          fmt::format("forced {} for layer {}: the model has {} layers", what, layer, c.num_hidden_layers));
  };
  for (const auto& [key, sel] : o.all_indexer()) {
    check_key(key.first, key.second, "indexer selection");
    if (c.ratio(key.second) != 4)
      throw OverrideError(
          fmt::format("forced indexer selection for layer {}: layer {} has compress ratio {} and no "
                      "indexer (only ratio-4 layers do)",
                      key.second, key.second, c.ratio(key.second)));
  }
  for (const auto& [key, sel] : o.all_experts()) {
    check_key(key.first, key.second, "experts");
    if (c.is_hash_layer(key.second))
      throw OverrideError(
          fmt::format("forced experts for layer {}: layer {} is hash-routed (layers < num_hash_layers = "
                      "{} route by token id) and is never overridden",
                      key.second, key.second, c.num_hash_layers));
  }
}

// ---- the per-sequence forward -----------------------------------------------------------------
//
// The graph is written once against backend::Backend: buffers live in the backend's memory (host for
// the CPU, device for CUDA) and every step is one backend call taking the kernel's Params struct. What
// the Observer sees is downloaded only when it is reported: tensors only when the observer wants
// them, decisions always (they are small).

using backend::Backend;
using backend::require;
using FBuf = backend::Buffer<float>;
using IBuf = backend::Buffer<int32_t>;
using SumsBuf = backend::Buffer<uint64_t>;  // block sums of reported rows (kernels/row_sums.h)

// A layer's MoE problem without its tokens (T = 0): dimensions, the experts' weights, the profile's
// rules. The weights' pointer arrays live as long as the MoeLayer.
struct MoeLayer {
  std::vector<ExpertWeights> experts, shared;
  MoeParams p;
  MoeLayer(Backend& be, const Weights& w, const NumericsProfile& P, int L) {
    const ModelConfig& c = w.config();
    const std::string m = layer_prefix(L) + "mlp.";
    // The experts this process loaded (all, or a rank's own: model/weights.h only_experts); the
    // others stay null and p.loaded_* says which are there.
    int first = -1, last = -1;
    for (int e = 0; e < c.n_routed_experts; ++e) {
      const std::string ep = m + fmt::format("experts.{}.", e);
      if (!w.has(ep + "gate_proj.weight")) {
        experts.push_back(ExpertWeights{});
        continue;
      }
      if (first < 0) first = e;
      if (last >= 0 && last != e)
        throw InputError(fmt::format("layer {}: the loaded experts are not one range (expert {} after {})", L, e, last - 1));
      last = e + 1;
      experts.push_back(ExpertWeights{be.weight(ep + "gate_proj.weight"), be.weight(ep + "up_proj.weight"),
                                      be.weight(ep + "down_proj.weight")});
    }
    p.loaded_first = first < 0 ? 0 : first;
    p.loaded_last = first < 0 ? 0 : last;
    if (c.n_shared_experts > 0)
      shared.push_back(ExpertWeights{be.weight(m + "shared_experts.gate_proj.weight"),
                                     be.weight(m + "shared_experts.up_proj.weight"),
                                     be.weight(m + "shared_experts.down_proj.weight")});
    p.D = c.hidden_size;
    p.I = c.moe_intermediate_size;
    p.I_shared = p.I * c.n_shared_experts;
    p.E = c.n_routed_experts;
    p.k = c.num_experts_per_tok;
    p.n_shared = int(shared.size());
    p.experts = experts.data();
    p.shared = shared.data();
    p.swiglu_limit = c.swiglu_limit;
    p.clamp_shared = P.clamp_shared_expert;
    p.round_each = P.expert_output_bf16;
    p.order = P.reduce.moe;
  }
};

class SequenceForward {
 public:
  // cache == nullptr: the whole sequence `tokens` from position 0. Else a chunk: `tokens` at
  // positions cache->length() .. + T - 1, reading and extending the cache.
  SequenceForward(const Weights& w, const RunOptions& opt, Backend& be, int seq,
                  const std::vector<int32_t>& tokens, SequenceCache* cache = nullptr, Tape* tape = nullptr)
      : w_(w),
        c_(w.config()),
        opt_(opt),
        P_(opt.profile),
        be_(be),
        seq_(seq),
        tokens_(tokens),
        T_(int64_t(tokens.size())),
        cache_(cache),
        tape_(tape),
        p0_(cache ? cache->length() : 0) {
    if (tape_) {
      tape_->attn.resize(size_t(c_.num_hidden_layers));
      tape_->ffn.resize(size_t(c_.num_hidden_layers));
    }
    backend::RopeTables rope = backend::rope_tables(be_, c_, p0_, T_);
    pos_ = std::move(rope.pos);
    freq_plain_ = std::move(rope.plain);
    freq_comp_ = std::move(rope.comp);
    tokens_dev_ = be_.ints(T_);
    be_.upload(tokens_dev_.data(), tokens_);
    if (opt_.observer && opt_.observer->deferrable() && be_.device() != Device::cpu)
      late_ = std::make_unique<LateReports>([this](const auto& parts) { return be_.download_async(parts); },
                                            *opt_.observer, opt_.late_report_bytes);
  }

  SequenceResult run();

 private:
  // Groups of `ratio` complete before this chunk and after it.
  int64_t groups_before(int ratio) const { return compressor_groups(p0_, ratio); }
  int64_t groups_after(int ratio) const { return compressor_groups(p0_ + T_, ratio); }

  bool want_tensors() const { return opt_.observer && opt_.observer->wants_tensors(); }
  // Reports a tensor held in backend memory. With a device backend the row digests are computed on
  // the device and the values are downloaded only if an observer asks for them (TensorRecord::data).
  // row0: the index of the tensor's row 0 within the sequence (default: the chunk's first position).
  // sums: the rows' block sums from the op that wrote them (sums_for), hashed instead of the rows.
  // The graph does not write a reported buffer again: a late report's digests may still be reading it
  // (Backend::download_async). A step that changes it makes a new buffer (normed(), not norm_rows()).
  void report(int layer, const char* name, DType dt, std::vector<int64_t> shape, const void* data,
              int64_t row0 = -1, SumsBuf sums = {}) {
    if (!want_tensors()) return;
    TensorRecord r;
    r.seq = seq_;
    r.layer = layer;
    r.pos0 = row0 >= 0 ? row0 : p0_;
    r.name = name;
    r.dtype = dt;
    r.shape = std::move(shape);
    if (be_.device() == Device::cpu) {
      r.host = data;
      opt_.observer->on_tensor(r);
      return;
    }
    if (late_) return late_->tensor(r, data, std::move(sums));
    const int64_t rows = std::max<int64_t>(r.rows(), 0), elems = r.row_elems();
    std::vector<uint64_t> digests(static_cast<size_t>(rows));
    if (be_.row_digests(data, dt, rows, elems, digests.data())) r.row_digests = digests.data();
    DownloadOnce fetch(be_, data, dt, rows * elems);
    r.fetch = &fetch;
    opt_.observer->on_tensor(r);
  }
  // The buffer for the block sums of a bf16 tensor of `rows` rows of n values that is about to be
  // written and then reported late: the op that writes it forms them (kernels/row_sums.h), and the
  // report's digests come from them instead of a second pass over the rows. Empty (ask the op for
  // none) where reports are not late or such rows have no sums.
  SumsBuf sums_for(int64_t rows, int64_t n) {
    if (!late_ || !want_tensors() || !xxh3::bf16_row_has_sums(n)) return {};
    return be_.u64s(rows * (n / xxh3::kSumRowValues) * 8);
  }
  // Downloads a reported tensor on the first fetch() and keeps the copy for the rest of the report.
  class DownloadOnce final : public TensorFetch {
   public:
    DownloadOnce(Backend& be, const void* src, DType dt, int64_t n) : be_(be), src_(src), dt_(dt), n_(n) {}
    const void* fetch() override {
      if (dt_ == DType::i32) {
        if (i_.empty() && n_ > 0) i_ = be_.download(static_cast<const int32_t*>(src_), n_);
        return i_.data();
      }
      if (f_.empty() && n_ > 0) f_ = be_.download(static_cast<const float*>(src_), n_);
      return f_.data();
    }

   private:
    Backend& be_;
    const void* src_;
    DType dt_;
    int64_t n_;
    std::vector<float> f_;
    std::vector<int32_t> i_;
  };
  // A host view of n values in backend memory: the pointer itself on the CPU, else a downloaded copy
  // kept in `keep`.
  template <typename T>
  const T* host_view(const T* data, int64_t n, std::vector<T>& keep) {
    if (be_.device() == Device::cpu) return data;
    keep = be_.download(data, n);
    return keep.data();
  }

  // Hands a decision whose arrays are backend memory to the observer: late (LateReports), or now,
  // through host views of the arrays.
  void report(IndexerDecision d) {
    if (late_) return late_->indexer(d);
    std::vector<int32_t> ids;
    std::vector<float> margin;
    d.ids = host_view(d.ids, d.T * d.k, ids);
    d.margin = host_view(d.margin, d.T, margin);
    opt_.observer->on_indexer(d);
  }
  void report(RoutingDecision d) {
    if (late_) return late_->routing(d);
    std::vector<int32_t> ids;
    std::vector<float> weights, margin;
    d.ids = host_view(d.ids, d.T * d.k, ids);
    d.weights = host_view(d.weights, d.T * d.k, weights);
    d.margin = host_view(d.margin, d.T, margin);
    opt_.observer->on_routing(d);
  }
  void report(MhcDecision d) {
    if (late_) return late_->mhc(d);
    std::vector<float> pre, post, comb;
    d.pre = host_view(d.pre, d.T * d.hc, pre);
    d.post = host_view(d.post, d.T * d.hc, post);
    d.comb = host_view(d.comb, d.T * d.hc * d.hc, comb);
    opt_.observer->on_mhc(d);
  }

  // A copy of a buffer for the tape (the graph goes on to change the original in place).
  FBuf clone(const FBuf& b) {
    FBuf c = be_.floats(b.size());
    if (b.size() > 0) be_.copy(c.data(), b.data(), b.bytes());
    return c;
  }
  IBuf clone(const IBuf& b) {
    IBuf c = be_.ints(b.size());
    if (b.size() > 0) be_.copy(c.data(), b.data(), b.bytes());
    return c;
  }

  // x16: x's bf16 copy for the tensor_core order when the caller shares one (Backend::gemm_x_copy).
  FBuf linear(const FBuf& x, int64_t rows, int64_t k, const std::string& wname, int64_t n, OutRound round,
              int layer, const uint16_t* x16 = nullptr) {
    FBuf y = be_.floats(rows * n);
    GemmParams g;
    g.m = rows;
    g.n = n;
    g.k = k;
    g.x = x.data();
    g.ldx = k;
    g.w = be_.weight(wname);
    g.ldw = k;
    g.y = y.data();
    g.ldy = n;
    g.round = round;
    g.order = P_.reduce.gemm;
    g.x16 = x16;
    require(gemm_check(g), "gemm", layer);
    be_.gemm(g);
    return y;
  }

  void norm_rows(FBuf& x, int64_t rows, int64_t dim, const float* weight, int layer, Arith arith = Arith::fp32) {
    norm_rows_into(x, x, rows, dim, weight, layer, arith);
  }
  // The normalised rows in a new buffer, to be reported (with the block sums `sums` asks for); x is
  // kept (it was reported, or the tape keeps it).
  FBuf normed(const FBuf& x, int64_t rows, int64_t dim, const float* weight, int layer, SumsBuf& sums) {
    FBuf y = be_.floats(x.size());
    sums = sums_for(rows, dim);
    norm_rows_into(x, y, rows, dim, weight, layer, Arith::fp32, sums.data());
    return y;
  }
  void norm_rows_into(const FBuf& x, FBuf& y, int64_t rows, int64_t dim, const float* weight, int layer,
                      Arith arith, uint64_t* y_sums = nullptr) {
    RmsNormParams p;
    p.rows = rows;
    p.dim = dim;
    p.x = x.data();
    p.ldx = dim;
    p.w = weight;
    p.y = y.data();
    p.ldy = dim;
    p.eps = c_.rms_norm_eps;
    p.order = P_.reduce.norm;
    p.bf16_arith = arith == Arith::bf16;
    p.y_sums = y_sums;
    require(rmsnorm_check(p), "rmsnorm", layer);
    be_.rmsnorm(p);
  }

  void rope_rows(FBuf& x, int heads, int64_t head_dim, const float* freq, bool inverse, int layer) {
    const RopeApplyParams p =
        backend::rope_rows_params(c_, x.data(), T_, heads, head_dim, pos_.data(), freq, inverse, true);
    require(rope_apply_check(p), "rope", layer);
    be_.rope_apply(p);
  }

  // The block quantisation of a profile site on x (nothing for QuantSim::none); `what` names the tensor.
  void quant(FBuf& x, int64_t rows, int64_t cols, int64_t ld, const NumericsProfile::QuantSite& q, const char* what,
             int layer) {
    if (q.kind == QuantSim::none || rows == 0) return;
    Fp8SimParams p;
    p.rows = rows;
    p.cols = cols;
    p.ld = ld;
    p.block = q.block;
    p.fmt = q.scale;
    p.x = x.data();
    if (const char* why = fp8_sim_check(p))
      throw InputError(fmt::format("profile '{}': {} simulation of {} at layer {} cannot run: {} (block {} for {} "
                                   "values a row; profile site {})",
                                   P_.name, q.kind == QuantSim::fp4 ? "FP4" : "FP8", what, layer, why, q.block, cols,
                                   q.block_key));
    be_.quant_sim(p, q.kind);
  }

  // A site's simulation around the cache store of its rows: a cache that keeps FP8 rows quantises them
  // itself, so they go in first (decoding gives the simulated values); any other simulation comes first
  // and the cache keeps its bf16 results.
  template <typename Store>
  void quant_around_store(FBuf& x, int64_t rows, int64_t cols, int64_t ld, const NumericsProfile::QuantSite& q,
                          const char* what, int layer, Store store) {
    if (!q.cached_fp8) quant(x, rows, cols, ld, q, what, layer);
    store();
    if (q.cached_fp8) quant(x, rows, cols, ld, q, what, layer);
  }

  // The compressor (MODEL.md §3.5, §7.2) over this chunk: the projections of the chunk's tokens,
  // after the projections the cache kept of the tokens before it (the incomplete group, and for the
  // overlapping ratio 4 the group before that), pooled into the groups that complete in this chunk.
  // A whole sequence keeps no state: the same code with nothing kept. Returns the new groups' rows
  // [groups_after - groups_before, d].
  // keep_kvp / keep_sc (whole sequences only): receive the projections, for the tape.
  // x16: x's shared bf16 copy, or nullptr.
  FBuf compress(const FBuf& x, const uint16_t* x16, int layer, const std::string& prefix, int64_t d,
                int ratio, bool hadamard_rot, CacheStream stream, FBuf* keep_kvp = nullptr,
                FBuf* keep_sc = nullptr) {
    const int64_t cw = common::compressor_row_width(ratio, d);
    FBuf kvp = linear(x, T_, c_.hidden_size, prefix + "wkv.weight", cw, OutRound::f32, layer, x16);
    FBuf sc = linear(x, T_, c_.hidden_size, prefix + "wgate.weight", cw, OutRound::f32, layer, x16);
    int64_t row0 = p0_, rows = T_;
    CompressorState* st = cache_ ? &cache_->compressor_state(layer, stream) : nullptr;
    if (st && st->rows > 0) {  // prepend the kept projections of tokens [st->row0, p0)
      if (st->row0 + st->rows != p0_)
        throw Error(
            fmt::format("layer {}: the {} compressor state holds tokens [{}, {}), the chunk starts at {}",
                        layer, to_string(stream), st->row0, st->row0 + st->rows, p0_));
      FBuf kvp2 = be_.floats((st->rows + T_) * cw), sc2 = be_.floats((st->rows + T_) * cw);
      be_.copy(kvp2.data(), st->kvp.data(), st->kvp.bytes());
      be_.copy(kvp2.data() + st->rows * cw, kvp.data(), kvp.bytes());
      be_.copy(sc2.data(), st->sc.data(), st->sc.bytes());
      be_.copy(sc2.data() + st->rows * cw, sc.data(), sc.bytes());
      kvp = std::move(kvp2);
      sc = std::move(sc2);
      row0 = st->row0;
      rows += st->rows;
    }
    const int64_t g0 = groups_before(ratio), G = groups_after(ratio) - g0;
    FBuf out = be_.floats(G * d);
    CompressorPoolParams p;
    p.g0 = g0;
    p.G = G;
    p.row0 = row0;
    p.rows = rows;
    p.ratio = ratio;
    p.d = d;
    p.rd = c_.qk_rope_head_dim;
    p.kvp = kvp.data();
    p.sc = sc.data();
    p.ape = be_.weight(prefix + "ape");
    p.norm = be_.weight(prefix + "norm.weight");
    p.freq = freq_comp_.data();
    p.rms_eps = c_.rms_norm_eps;
    p.hadamard = hadamard_rot;
    p.order = P_.reduce.compressor;
    p.out = out.data();
    require(compressor_pool_check(p), "compressor", layer);
    be_.compressor_pool(p);
    if (st) {  // keep the tokens the next groups read: from the start of the group before the incomplete one
      const int64_t end = p0_ + T_;
      const int64_t keep0 = std::max<int64_t>(groups_after(ratio) - (ratio == 4 ? 1 : 0), 0) * ratio;
      const int64_t n = end - keep0;
      CompressorState next;
      next.row0 = keep0;
      next.rows = n;
      next.kvp = be_.floats(n * cw);
      next.sc = be_.floats(n * cw);
      be_.copy(next.kvp.data(), kvp.data() + (keep0 - row0) * cw, size_t(n * cw) * sizeof(float));
      be_.copy(next.sc.data(), sc.data() + (keep0 - row0) * cw, size_t(n * cw) * sizeof(float));
      *st = std::move(next);
    }
    if (keep_kvp) *keep_kvp = std::move(kvp);
    if (keep_sc) *keep_sc = std::move(sc);
    return out;
  }

  // Writes rows [0, g_before) of a cached stream, then the chunk's `fresh` rows, to dst: the
  // compressed rows a query of this chunk can see.
  void put_with_history(int layer, CacheStream stream, int64_t g_before, const FBuf& fresh, int64_t dim,
                        float* dst) {
    if (cache_ && g_before > 0) cache_->load(layer, stream, 0, g_before, dst);
    be_.copy(dst + g_before * dim, fresh.data(), fresh.bytes());
  }

  struct Mix {
    FBuf y, pre, post, comb;
  };
  struct Streams {  // hc_post's output, to be reported with its block sums
    FBuf H;
    SumsBuf sums;
  };
  Mix hc_pre_sublayer(const FBuf& H, int layer, Sublayer sub);
  Streams hc_post_sublayer(const FBuf& f, const FBuf& H, const Mix& m);
  FBuf attention(const FBuf& x, int layer);
  FBuf moe(const FBuf& x, int layer);

  const Weights& w_;
  const ModelConfig& c_;
  const RunOptions& opt_;
  const NumericsProfile& P_;
  Backend& be_;
  int seq_;
  const std::vector<int32_t>& tokens_;
  int64_t T_;
  SequenceCache* cache_;
  Tape* tape_;  // the training forward: keep what the backward needs (model/tape.h)
  int64_t p0_;
  backend::Buffer<int64_t> pos_;
  FBuf freq_plain_, freq_comp_;
  IBuf tokens_dev_;
  std::unique_ptr<LateReports> late_;  // a deferrable observer on a device backend
};

SequenceForward::Mix SequenceForward::hc_pre_sublayer(const FBuf& H, int layer, Sublayer sub) {
  const int hc = c_.hc_mult;
  const int64_t D = c_.hidden_size;
  Mix m;
  m.y = be_.floats(T_ * D);
  m.pre = be_.floats(T_ * hc);
  m.post = be_.floats(T_ * hc);
  m.comb = be_.floats(T_ * hc * hc);
  HcPreParams hp;
  set_mhc_mixer(hp, be_, c_, mhc_prefix(layer, sub), T_, H.data(), P_.reduce.mhc);
  hp.y = m.y.data();
  hp.pre = m.pre.data();
  hp.post = m.post.data();
  hp.comb = m.comb.data();
  SumsBuf y_sums = sums_for(T_, D);
  hp.y_sums = y_sums.data();
  require(hc_pre_check(hp), "hc_pre", layer);
  be_.hc_pre(hp);
  if (opt_.observer) {
    MhcDecision d;
    d.seq = seq_;
    d.layer = layer;
    d.pos0 = p0_;
    d.sublayer = sub;
    d.T = T_;
    d.hc = hc;
    d.pre = m.pre.data();
    d.post = m.post.data();
    d.comb = m.comb.data();
    report(d);
  }
  report(layer, sub == Sublayer::attn ? "attn.hc_pre" : "ffn.hc_pre", DType::bf16, {T_, D}, m.y.data(), -1,
         std::move(y_sums));
  return m;
}

SequenceForward::Streams SequenceForward::hc_post_sublayer(const FBuf& f, const FBuf& H, const Mix& m) {
  Streams s{be_.floats(H.size()), sums_for(T_, c_.hc_mult * c_.hidden_size)};
  FBuf& out = s.H;
  HcPostParams p;
  p.T = T_;
  p.hc = c_.hc_mult;
  p.D = c_.hidden_size;
  p.f = f.data();
  p.R = H.data();
  p.post = m.post.data();
  p.comb = m.comb.data();
  p.out = out.data();
  p.out_sums = s.sums.data();
  be_.hc_post(p);
  return s;
}

FBuf SequenceForward::attention(const FBuf& x, int L) {
  const std::string a = layer_prefix(L) + "self_attn.";
  const int64_t D = c_.hidden_size, Dh = c_.head_dim, ql = c_.q_lora_rank, rd = c_.qk_rope_head_dim;
  const int H = c_.num_attention_heads;
  const int ratio = c_.ratio(L);
  const float* freq = ratio ? freq_comp_.data() : freq_plain_.data();

  // Query path: qr feeds both the main query and the indexer.
  AttentionTape* tp = tape_ ? &tape_->attn[size_t(L)] : nullptr;
  // The GEMMs that read x (wq_a, wkv, the compressors' wkv and wgate, weights_proj) share one bf16 copy
  // of it in the tensor_core order, instead of each making the same copy; x does not change here.
  const backend::Buffer<uint16_t> x16 = be_.gemm_x_copy(x.data(), T_, D, D, P_.reduce.gemm);
  FBuf qr = linear(x, T_, D, a + "wq_a.weight", ql, OutRound::bf16, L, x16.data());
  if (tp) tp->qa = clone(qr);
  norm_rows(qr, T_, ql, be_.weight(a + "q_norm.weight"), L);
  report(L, "attn.qr", DType::bf16, {T_, ql}, qr.data());
  FBuf q = linear(qr, T_, ql, a + "wq_b.weight", H * Dh, OutRound::bf16, L);
  if (tp) tp->q_lin = clone(q);
  norm_rows(q, T_ * H, Dh, nullptr, L, P_.q_norm);  // per-head RMS normalisation, no weight
  rope_rows(q, H, Dh, freq, false, L);
  report(L, "attn.q", DType::bf16, {T_, H * Dh}, q.data());

  // Window KV: one shared K=V head. A chunk stores its last W rows in the cache, around the KV site's
  // simulation as quant_around_store orders them.
  FBuf kv = linear(x, T_, D, a + "wkv.weight", Dh, OutRound::bf16, L, x16.data());
  if (tp) tp->kv_lin = clone(kv);
  norm_rows(kv, T_, Dh, be_.weight(a + "kv_norm.weight"), L);
  rope_rows(kv, 1, Dh, freq, false, L);
  // KVcat = window rows (a chunk: the hist cached rows before it, then its own) then the G compressed
  // rows visible to the chunk; index rows point into it (§3.6). The cached rows are read before the
  // chunk's own rows are stored: the ring slots they occupy may be the ones being overwritten.
  const int64_t hist = cache_ ? std::min<int64_t>(p0_, c_.sliding_window - 1) : 0;
  const int64_t G = ratio > 0 ? groups_after(ratio) : 0;
  FBuf kvcat = be_.floats((hist + T_ + G) * Dh);
  if (hist > 0) cache_->load(L, CacheStream::window, p0_ - hist, hist, kvcat.data());
  const NumericsProfile::QuantSite kvq = P_.kv_site();
  quant_around_store(kv, T_, Dh - rd, Dh, kvq, "the window KV", L, [&] {
    if (!cache_) return;
    const int64_t m = std::min<int64_t>(T_, c_.sliding_window);
    cache_->store(L, CacheStream::window, p0_ + T_ - m, m, kv.data() + (T_ - m) * Dh);
  });
  report(L, "attn.kv", DType::bf16, {T_, Dh}, kv.data());

  // Compressed KV (C4 / C128) and the lightning indexer (C4). G counts the compressed rows visible
  // to this chunk: g_before from the cache, then the groups completing in the chunk.
  if (ratio > 0) {
    const int64_t g_before = groups_before(ratio);
    FBuf fresh = compress(x, x16.data(), L, a + "compressor.", Dh, ratio, false, CacheStream::compressed,
                          tp ? &tp->kvp : nullptr, tp ? &tp->sc : nullptr);
    const int64_t n = G - g_before;
    quant_around_store(fresh, n, Dh - rd, Dh, kvq, "the compressed KV", L, [&] {
      if (cache_ && n > 0) cache_->store(L, CacheStream::compressed, g_before, n, fresh.data());
    });
    report(L, "attn.compressed_kv", DType::bf16, {n, Dh}, fresh.data(), g_before);
    put_with_history(L, CacheStream::compressed, g_before, fresh, Dh, kvcat.data() + (hist + T_) * Dh);
  }
  IBuf sel;
  int k4 = 0;
  if (ratio == 4) {
    const int Hi = c_.index_n_heads;
    const int64_t Di = c_.index_head_dim;
    const std::string ix = a + "indexer.";
    FBuf qi = linear(qr, T_, ql, ix + "wq_b.weight", Hi * Di, OutRound::bf16, L);
    rope_rows(qi, Hi, Di, freq, false, L);
    be_.hadamard(qi.data(), T_ * Hi, Di, Di);
    const NumericsProfile::QuantSite iq = P_.indexer_site(Di);
    quant(qi, T_ * Hi, Di, Di, iq, "the indexer queries", L);
    report(L, "indexer.q", DType::bf16, {T_, Hi * Di}, qi.data());
    const int64_t g_before = groups_before(4), n = G - g_before;
    const bool keep = tp && tape_->keep_indexer;
    FBuf kfresh = compress(x, x16.data(), L, ix + "compressor.", Di, 4, true, CacheStream::indexer_keys,
                           keep ? &tp->ikvp : nullptr, keep ? &tp->isc : nullptr);
    quant_around_store(kfresh, n, Di, Di, iq, "the indexer keys", L, [&] {
      if (cache_ && n > 0) cache_->store(L, CacheStream::indexer_keys, g_before, n, kfresh.data());
    });
    report(L, "indexer.k", DType::bf16, {n, Di}, kfresh.data(), g_before);
    FBuf ki;  // every key a query of this chunk can see: the cached ones, then the chunk's
    if (g_before == 0) {
      ki = std::move(kfresh);
    } else {
      ki = be_.floats(G * Di);
      put_with_history(L, CacheStream::indexer_keys, g_before, kfresh, Di, ki.data());
    }
    FBuf wt = linear(x, T_, D, ix + "weights_proj.weight", Hi, OutRound::bf16, L, x16.data());
    const float wscale = float(1.0 / std::sqrt(double(Hi) * double(Di)));
    be_.scale_bf16(wt.data(), wt.size(), wscale);
    report(L, "indexer.weights", DType::f32, {T_, Hi}, wt.data());

    k4 = c_.indexer_width(p0_ + T_);  // a chunk: the width of a prefill of the positions so far
    sel = be_.ints(T_ * k4);
    FBuf margin = be_.floats(T_);
    FBuf score = be_.floats(T_ * k4);
    IndexerParams ip;
    ip.T = T_;
    ip.pos0 = p0_;
    ip.Hi = Hi;
    ip.Di = Di;
    ip.G = G;
    ip.k = k4;
    ip.ratio = 4;
    ip.qi = qi.data();
    ip.ki = ki.data();
    ip.wt = wt.data();
    ip.order = P_.reduce.indexer;
    ip.bf16_scores = P_.indexer_score == Arith::bf16;
    ip.ids = sel.data();
    ip.margin = margin.data();
    ip.score = score.data();
    require(indexer_check(ip), "indexer", L);
    const ForcedSelection* forced = opt_.overrides ? opt_.overrides->indexer(seq_, L) : nullptr;
    if (forced && cache_)
      throw InputError(
          fmt::format("forced indexer selection for sequence {} layer {}: forced decisions "
                      "apply to whole-sequence forwards, not to decoding chunks",
                      seq_, L));
    if (forced) {
      be_.upload(sel.data(), canonical_indexer(*forced, c_, seq_, L, T_));
      // The natural top-k still provides the margins (how close the free choice was).
      IBuf natural = be_.ints(T_ * k4);
      ip.ids = natural.data();
      ip.score = nullptr;
      be_.indexer_topk(ip);
      be_.indexer_score_ids(ip, sel.data(), score.data());
    } else {
      be_.indexer_topk(ip);
    }
    report(L, "indexer.score", DType::f32, {T_, k4}, score.data());
    if (keep) {
      tp->qi = clone(qi);
      tp->ki = clone(ki);
      tp->wt = clone(wt);
      tp->sel = clone(sel);
      tp->iscore = clone(score);
      tp->k = k4;
    }
    if (opt_.observer) {
      IndexerDecision d;
      d.seq = seq_;
      d.layer = L;
      d.pos0 = p0_;
      d.T = T_;
      d.k = k4;
      d.forced = forced != nullptr;
      d.ids = sel.data();
      d.margin = margin.data();
      report(d);
    }
  }

  be_.copy(kvcat.data() + hist * Dh, kv.data(), kv.bytes());
  IndexBuildParams bp;
  bp.T = T_;
  bp.pos0 = p0_;
  bp.hist = hist;
  bp.W = c_.sliding_window;
  bp.kind = ratio == 0 ? CompressedKind::none : ratio == 4 ? CompressedKind::c4 : CompressedKind::c128;
  bp.ratio = ratio;
  bp.k = k4;
  bp.sel = sel.data();
  const int64_t K = index_width(bp);
  IBuf idx = be_.ints(T_ * K);
  bp.idx = idx.data();
  be_.build_index(bp);

  FBuf o = be_.floats(T_ * H * Dh);
  SparseAttnParams sp;
  sp.T = T_;
  sp.H = H;
  sp.Dh = Dh;
  sp.N = hist + T_ + G;
  sp.K = K;
  sp.q = q.data();
  sp.kv = kvcat.data();
  sp.idx = idx.data();
  sp.sink = be_.weight(a + "attn_sink");
  sp.scale = float(1.0 / std::sqrt(double(Dh)));
  sp.order = P_.reduce.attention;
  // A decode step (one token after a cache) may use an inference engine's split-KV order; prefill
  // chunks always take the exact order (model/profile.h decode_attention_splits).
  sp.splits = (cache_ && T_ == 1) ? P_.decode_attention_splits : 0;
  sp.online_block = P_.attention_online_block;
  sp.o = o.data();
  FBuf lse = tp ? be_.floats(T_ * H) : FBuf();
  sp.lse = tp ? lse.data() : nullptr;
  be_.sparse_attention(sp, L);
  if (tp) tp->o_attn = clone(o);
  rope_rows(o, H, Dh, freq, true, L);
  report(L, "attn.o", DType::bf16, {T_, H * Dh}, o.data());

  // Grouped low-rank output: u[t, g] = wo_a[g] · o[t, heads of group g]; out = u · wo_b^T.
  const int Gr = c_.o_groups;
  const int64_t R = c_.o_lora_rank, gw = int64_t(H / Gr) * Dh;
  FBuf u = be_.floats(T_ * Gr * R);
  const float* wo_a = be_.weight(a + "wo_a.weight");
  for (int g = 0; g < Gr; ++g) {
    GemmParams gp;
    gp.m = T_;
    gp.n = R;
    gp.k = gw;
    gp.x = o.data() + g * gw;
    gp.ldx = H * Dh;
    gp.w = wo_a + g * R * gw;
    gp.ldw = gw;
    gp.y = u.data() + g * R;
    gp.ldy = Gr * R;
    gp.round = OutRound::bf16;
    gp.order = P_.reduce.gemm;
    require(gemm_check(gp), "gemm(wo_a)", L);
    be_.gemm(gp);
  }
  report(L, "attn.u", DType::bf16, {T_, Gr * R}, u.data());
  FBuf out = linear(u, T_, Gr * R, a + "wo_b.weight", D, OutRound::bf16, L);
  report(L, "attn.out", DType::bf16, {T_, D}, out.data());
  if (tp) {
    tp->qr = std::move(qr);
    tp->q = std::move(q);
    tp->kvcat = std::move(kvcat);
    tp->idx = std::move(idx);
    tp->N = sp.N;
    tp->K = K;
    tp->G = G;
    tp->lse = std::move(lse);
    tp->o = std::move(o);
    tp->u = std::move(u);
  }
  return out;
}

FBuf SequenceForward::moe(const FBuf& x, int L) {
  const std::string m = layer_prefix(L) + "mlp.";
  const int64_t D = c_.hidden_size;
  const int E = c_.n_routed_experts, k = c_.num_experts_per_tok;
  const bool hashed = c_.is_hash_layer(L);

  FBuf logits = linear(x, T_, D, m + "gate.weight", E, OutRound::f32, L);
  report(L, "moe.router_logits", DType::f32, {T_, E}, logits.data());

  IBuf forced_ids;
  const ForcedSelection* forced = (!hashed && opt_.overrides) ? opt_.overrides->experts(seq_, L) : nullptr;
  if (forced && cache_)
    throw InputError(
        fmt::format("forced experts for sequence {} layer {}: forced decisions apply to "
                    "whole-sequence forwards, not to decoding chunks",
                    seq_, L));
  if (forced) {
    const std::vector<int32_t> canon = canonical_experts(*forced, c_, seq_, L, T_);
    forced_ids = be_.ints(int64_t(canon.size()));
    be_.upload(forced_ids.data(), canon);
  }

  IBuf ids = be_.ints(T_ * k);
  FBuf weights = be_.floats(T_ * k);
  FBuf margin = be_.floats(T_);
  RouterParams rp;
  rp.T = T_;
  rp.E = E;
  rp.k = k;
  rp.logits = logits.data();
  rp.bias = hashed ? nullptr : be_.weight(m + "gate.e_score_correction_bias");
  rp.tid2eid = hashed ? be_.weight_i(m + "topk.tid2eid") : nullptr;
  rp.tokens = tokens_dev_.data();
  rp.forced = forced ? forced_ids.data() : nullptr;
  rp.norm_topk_prob = c_.norm_topk_prob;
  rp.routed_scaling_factor = c_.routed_scaling_factor;
  rp.ids = ids.data();
  rp.weights = weights.data();
  rp.margin = margin.data();
  require(router_check(rp), "router", L);
  be_.router(rp);
  if (opt_.observer) {
    RoutingDecision d;
    d.seq = seq_;
    d.layer = L;
    d.pos0 = p0_;
    d.T = T_;
    d.k = k;
    d.hashed = hashed;
    d.forced = forced != nullptr;
    d.ids = ids.data();
    d.weights = weights.data();
    d.margin = margin.data();
    report(d);
  }

  FBuf out = be_.floats(T_ * D);
  MoeLayer ml(be_, w_, P_, L);
  MoeParams& mp = ml.p;
  mp.T = T_;
  mp.x = x.data();
  mp.ids = ids.data();
  mp.weights = weights.data();
  mp.out = out.data();
  SumsBuf out_sums = sums_for(T_, D);
  mp.out_sums = out_sums.data();
  if (opt_.experts && opt_.split_sequences) {
    be_.moe_experts_dispatch(mp, L, *opt_.experts);
  } else if (opt_.experts) {
    be_.moe_experts_parallel(mp, L, *opt_.experts);
  } else {
    be_.moe_experts(mp, L);
  }
  report(L, "moe.out", DType::bf16, {T_, D}, out.data(), -1, std::move(out_sums));
  if (tape_) {
    FfnTape& tp = tape_->ffn[size_t(L)];
    tp.logits = std::move(logits);
    tp.ids = std::move(ids);
    tp.weights = std::move(weights);
  }
  return out;
}

SequenceResult SequenceForward::run() {
  const int hc = c_.hc_mult;
  const int64_t D = c_.hidden_size, V = c_.vocab_size;

  // Embedding, copied into the hc residual streams.
  FBuf H = be_.floats(T_ * hc * D);
  const float* embed = be_.weight("model.embed_tokens.weight");
  be_.embed(embed, D, tokens_dev_.data(), T_, hc, H.data());
  if (want_tensors()) {
    FBuf e = be_.floats(T_ * D);
    be_.embed(embed, D, tokens_dev_.data(), T_, 1, e.data());
    report(-1, "embed", DType::bf16, {T_, D}, e.data());
  }

  for (int L = 0; L < c_.num_hidden_layers; ++L) {
    const std::string p = layer_prefix(L);
    Mix ma = hc_pre_sublayer(H, L, Sublayer::attn);
    SumsBuf sums;
    FBuf xa = normed(ma.y, T_, D, be_.weight(p + "input_layernorm.weight"), L, sums);
    report(L, "attn.norm", DType::bf16, {T_, D}, xa.data(), -1, std::move(sums));
    FBuf a = attention(xa, L);
    Streams Ha = hc_post_sublayer(a, H, ma);
    if (tape_) {
      AttentionTape& tp = tape_->attn[size_t(L)];
      tp.H_in = std::move(H);
      tp.post = std::move(ma.post);
      tp.comb = std::move(ma.comb);
      tp.a_in = std::move(ma.y);
      tp.x = std::move(xa);
      tp.out = std::move(a);
    }
    H = std::move(Ha.H);
    report(L, "attn.hc_post", DType::bf16, {T_, hc * D}, H.data(), -1, std::move(Ha.sums));

    Mix mf = hc_pre_sublayer(H, L, Sublayer::ffn);
    FBuf xf = normed(mf.y, T_, D, be_.weight(p + "post_attention_layernorm.weight"), L, sums);
    report(L, "ffn.norm", DType::bf16, {T_, D}, xf.data(), -1, std::move(sums));
    FBuf f = moe(xf, L);
    Streams Hf = hc_post_sublayer(f, H, mf);
    if (tape_) {
      FfnTape& tp = tape_->ffn[size_t(L)];
      tp.H_in = std::move(H);
      tp.post = std::move(mf.post);
      tp.comb = std::move(mf.comb);
      tp.f_in = std::move(mf.y);
      tp.x = std::move(xf);
      tp.out = std::move(f);
    }
    H = std::move(Hf.H);
    report(L, "ffn.hc_post", DType::bf16, {T_, hc * D}, H.data(), -1, std::move(Hf.sums));
  }

  FBuf y = be_.floats(T_ * D);
  HcHeadParams hp;
  set_mhc_mixer(hp, be_, c_, kHeadMhcPrefix, T_, H.data(), P_.reduce.mhc);
  hp.y = y.data();
  SumsBuf sums = sums_for(T_, D);
  hp.y_sums = sums.data();
  be_.hc_head(hp);
  report(-1, "head.hc", DType::bf16, {T_, D}, y.data(), -1, std::move(sums));
  FBuf yn = normed(y, T_, D, be_.weight("model.norm.weight"), -1, sums);
  report(-1, "head.norm", DType::bf16, {T_, D}, yn.data(), -1, std::move(sums));

  FBuf logits = linear(yn, T_, D, "lm_head.weight", V, OutRound::f32, -1);
  if (opt_.temperature != 1.0f) be_.divide(logits.data(), logits.size(), opt_.temperature);
  report(-1, "logits", DType::f32, {T_, V}, logits.data());

  SequenceResult r;
  r.tokens = tokens_;
  if (cache_) {  // a chunk: the next token is not known yet; the caller samples from the last row
    r.last_logits = be_.download(logits.data() + (T_ - 1) * V, V);
    cache_->advance(T_);
    if (late_) late_->finish();
    return r;
  }
  FBuf lp = be_.floats(T_ - 1);
  if (T_ > 1) be_.log_softmax_gather(logits.data(), T_ - 1, V, tokens_dev_.data() + 1, lp.data());
  r.logprobs = be_.download(lp.data(), T_ - 1);
  report(-1, "logprobs", DType::f32, {T_ - 1}, lp.data());
  if (tape_) {
    tape_->H_final = std::move(H);
    tape_->y_hc = std::move(y);
    tape_->y = std::move(yn);
    tape_->logits = std::move(logits);
    tape_->tokens = std::move(tokens_dev_);
  }
  if (late_) late_->finish();  // every report reaches the observer before the forward returns
  return r;
}

}  // namespace

void check_overrides(const Overrides& o, const ModelConfig& c, const std::vector<std::vector<int32_t>>& batch) {
  check_override_targets(o, c, batch);
}

SequenceResult forward_with_tape(backend::Backend& be, const Weights& w, int seq,
                                 const std::vector<int32_t>& tokens, const RunOptions& opt, Tape& tape) {
  const ModelConfig& c = w.config();
  if (tokens.empty()) throw InputError(fmt::format("forward: sequence {} is empty", seq));
  for (size_t t = 0; t < tokens.size(); ++t)
    if (tokens[t] < 0 || tokens[t] >= c.vocab_size)
      throw InputError(fmt::format("forward: sequence {} position {}: token id {} is outside the vocabulary [0, {})",
                                   seq, t, tokens[t], c.vocab_size));
  if (int64_t(tokens.size()) > c.max_position_embeddings)
    throw InputError(fmt::format("forward: sequence {}: {} tokens exceed max_position_embeddings = {}", seq,
                                 tokens.size(), c.max_position_embeddings));
  if (opt.temperature <= 0.0f || !std::isfinite(opt.temperature))
    throw InputError(fmt::format("forward: temperature must be positive, got {}", opt.temperature));
  const bool keep_indexer = tape.keep_indexer;
  tape = Tape{};
  tape.keep_indexer = keep_indexer;
  SequenceForward f(w, opt, be, seq, tokens, nullptr, &tape);
  return f.run();
}

SequenceResult forward_chunk(backend::Backend& be, const Weights& w, int seq,
                             const std::vector<int32_t>& tokens, SequenceCache& cache,
                             const RunOptions& opt) {
  const ModelConfig& c = w.config();
  const int64_t p0 = cache.length();
  require_profile_runs_on(opt.profile, be.device(), "forward");
  if (tokens.empty()) throw InputError(fmt::format("forward: sequence {}: a chunk holds no token", seq));
  for (size_t t = 0; t < tokens.size(); ++t)
    if (tokens[t] < 0 || tokens[t] >= c.vocab_size)
      throw InputError(
          fmt::format("forward: sequence {} position {}: token id {} is outside the vocabulary [0, {})", seq,
                      p0 + int64_t(t), tokens[t], c.vocab_size));
  if (p0 + int64_t(tokens.size()) > c.max_position_embeddings)
    throw InputError(
        fmt::format("forward: sequence {}: positions up to {} exceed max_position_embeddings = {}", seq,
                    p0 + int64_t(tokens.size()), c.max_position_embeddings));
  if (opt.temperature != 1.0f)
    throw InputError("forward: a decoding chunk returns raw logits; apply the temperature when sampling");
  SequenceForward f(w, opt, be, seq, tokens, &cache);
  return f.run();
}

namespace {
// The largest number of sequences any rank of `comm` holds.
int64_t most_sequences(Communicator& comm, size_t mine) {
  std::vector<int64_t> all(size_t(comm.size()));
  const int64_t n = int64_t(mine);
  comm.all_gather_v(&n, all.data(), std::vector<int64_t>(all.size(), int64_t(sizeof n)));
  return *std::max_element(all.begin(), all.end());
}
}  // namespace

ForwardResult forward(const Weights& w, const std::vector<std::vector<int32_t>>& batch,
                      const RunOptions& opt) {
  const ModelConfig& c = w.config();
  if (opt.split_sequences && !opt.experts)
    throw InputError("forward: sequences split among ranks need a communicator (RunOptions::experts)");
  if (opt.split_sequences && opt.device != Device::cpu)  // before the first collective
    throw InputError("forward: sequences split among the ranks (--dp) run on the CPU only; on GPUs every rank runs "
                     "every sequence");
  require_profile_runs_on(opt.profile, opt.device, "forward");
  if (batch.empty() && !opt.split_sequences) throw InputError("forward: the batch holds no sequence");
  for (size_t s = 0; s < batch.size(); ++s) {
    if (batch[s].empty()) throw InputError(fmt::format("forward: sequence {} is empty", s));
    for (size_t t = 0; t < batch[s].size(); ++t)
      if (batch[s][t] < 0 || batch[s][t] >= c.vocab_size)
        throw InputError(
            fmt::format("forward: sequence {} position {}: token id {} is outside the vocabulary [0, {})", s,
                        t, batch[s][t], c.vocab_size));
  }
  if (opt.overrides) check_override_targets(*opt.overrides, c, batch);
  if (opt.temperature <= 0.0f || !std::isfinite(opt.temperature))
    throw InputError(fmt::format("forward: temperature must be positive, got {}", opt.temperature));

  std::unique_ptr<backend::Backend> be = backend::make_backend(opt.device, w);
  const OmpThreadScope threads(opt.threads);
  ForwardResult result;
  // Split sequences: every rank walks through as many sequences as the busiest rank holds; past its
  // own, a rank only serves its experts (one dispatch per layer with no tokens), so the ranks' MoE
  // exchanges pair up.
  const size_t rounds = opt.split_sequences ? size_t(most_sequences(*opt.experts, batch.size())) : batch.size();
  for (size_t s = 0; s < rounds; ++s) {
    if (s < batch.size()) {
      SequenceForward f(w, opt, *be, int(s), batch[s]);
      result.seqs.push_back(f.run());
      continue;
    }
    for (int L = 0; L < c.num_hidden_layers; ++L) {
      MoeLayer idle(*be, w, opt.profile, L);
      be->moe_experts_dispatch(idle.p, L, *opt.experts);
    }
  }
  be->synchronize();
  return result;
}

}  // namespace dsv4
