#include "model/backward.h"

#include <fmt/format.h>

#include <cmath>

#include "kernels/compressor.h"
#include "kernels/detail/compressor.h"
#include "kernels/grad.h"
#include "kernels/rope.h"
#include "model/error.h"
#include "model/mhc_mixer.h"

namespace dsv4 {

namespace {

using backend::Backend;
using FBuf = backend::Buffer<float>;

// The backward graph of one sequence, the forward's sublayers in reverse. Activation gradients are
// fp32 backend buffers; a tensor that fed several consumers sums their gradients in the order
// written here (docs/TRAINING.md "Order of accumulation").
class SequenceBackward {
 public:
  SequenceBackward(Backend& be, const Weights& w, const Tape& tape, int seq, const RunOptions& opt,
                   const BackwardOptions& bo)
      : be_(be), w_(w), c_(w.config()), tape_(tape), seq_(seq), opt_(opt), bo_(bo), R_(opt.profile.reduce) {
    T_ = tape.tokens.size();
    backend::RopeTables rope = backend::rope_tables(be_, c_, 0, T_);
    pos_ = std::move(rope.pos);
    freq_plain_ = std::move(rope.plain);
    freq_comp_ = std::move(rope.comp);
  }

  GradSet run(const std::vector<float>& dlogprobs);

 private:
  FBuf zeros(int64_t n) {
    FBuf b = be_.floats(n);
    be_.zero(b.data(), n);
    return b;
  }
  bool trainable(const std::string& name) const { return bo_.trainable && bo_.trainable(name); }
  // The gradient buffer of a trainable weight (zero on first use), else nullptr.
  float* grad(const std::string& name) {
    if (!trainable(name)) return nullptr;
    auto it = grads_.find(name);
    if (it == grads_.end()) {
      const int64_t n = int64_t(w_.get(name).f.size());
      it = grads_.emplace(name, zeros(n)).first;
    }
    return it->second.data();
  }
  void report(int layer, const char* name, const FBuf& g, int64_t rows, int64_t cols) {
    if (!bo_.on_grad) return;
    GradRecord r;
    r.seq = seq_;
    r.layer = layer;
    r.name = name;
    r.rows = rows;
    r.cols = cols;
    std::vector<float> host;
    std::vector<uint64_t> digests;
    if (be_.device() == Device::cpu) {
      r.data = g.data();
    } else {
      digests.resize(size_t(std::max<int64_t>(rows, 0)));
      if (be_.row_digests(g.data(), DType::f32, rows, cols, digests.data())) r.row_digests = digests.data();
      r.fetch = [&]() -> const float* {
        if (host.empty() && rows * cols > 0) host = be_.download(g.data(), rows * cols);
        return host.data();
      };
    }
    bo_.on_grad(r);
  }

  // Backward of y [rows, n] = x [rows, k] · W^T for the weight `wname` (row stride k): the weight
  // gradient when trainable (+=), then dx (+= when accumulate, else overwritten).
  void linear_bwd(const float* dy, int64_t lddy, const float* x, int64_t ldx, int64_t rows, int64_t n,
                  int64_t k, const std::string& wname, const float* w, int64_t ldw, float* dw, float* dx,
                  int64_t lddx, bool accumulate) {
    if (dw) {
      GemmDwParams g;
      g.m = rows;
      g.n = n;
      g.k = k;
      g.dy = dy;
      g.lddy = lddy;
      g.x = x;
      g.ldx = ldx;
      g.dw = dw;
      g.lddw = ldw;
      g.accumulate = true;
      g.order = R_.gemm;
      backend::require(gemm_dw_check(g), ("gemm_dw(" + wname + ")").c_str(), -1);
      be_.gemm_dw(g);
    }
    if (dx) {
      GemmDxParams g;
      g.m = rows;
      g.n = n;
      g.k = k;
      g.dy = dy;
      g.lddy = lddy;
      g.w = w;
      g.ldw = ldw;
      g.dx = dx;
      g.lddx = lddx;
      g.accumulate = accumulate;
      g.order = R_.gemm;
      backend::require(gemm_dx_check(g), ("gemm_dx(" + wname + ")").c_str(), -1);
      be_.gemm_dx(g);
    }
  }
  void linear_bwd(const FBuf& dy, const FBuf& x, int64_t rows, int64_t n, int64_t k, const std::string& wname,
                  float* dx, bool accumulate) {
    linear_bwd(dy.data(), n, x.data(), k, rows, n, k, wname, be_.weight(wname), k, grad(wname), dx, k, accumulate);
  }

  // dx (+)= RMSNorm backward of rows [rows, dim] with forward input x and weight `wname` ("" = none).
  void norm_bwd(const FBuf& x, int64_t rows, int64_t dim, const std::string& wname, const float* dy, float* dx,
                bool accumulate) {
    RmsNormBwdParams p;
    p.rows = rows;
    p.dim = dim;
    p.x = x.data();
    p.ldx = dim;
    p.w = wname.empty() ? nullptr : be_.weight(wname);
    p.dy = dy;
    p.lddy = dim;
    p.dx = dx;
    p.lddx = dim;
    p.accumulate_dx = accumulate;
    p.dw = wname.empty() ? nullptr : grad(wname);
    p.eps = c_.rms_norm_eps;
    p.order = R_.norm;
    backend::require(rmsnorm_backward_check(p), "rmsnorm_backward", -1);
    be_.rmsnorm_backward(p);
  }

  // The transpose of a RoPE application on the last rd dims of each head: the opposite rotation,
  // fp32 (gradients are not rounded).
  void rope_bwd(FBuf& g, int heads, int64_t head_dim, const float* freq, bool forward_was_inverse, int layer) {
    const RopeApplyParams p = backend::rope_rows_params(c_, g.data(), T_, heads, head_dim, pos_.data(), freq,
                                                        !forward_was_inverse, false);
    backend::require(rope_apply_check(p), "rope (backward)", layer);
    be_.rope_apply(p);
  }

  // hc_post then hc_pre of one sublayer: dH (the gradient of the sublayer's hc_post output) in,
  // the gradient of the streams that entered hc_pre out; `sub_bwd` maps the gradient of the
  // sublayer output f to the gradient of hc_pre's y.
  template <typename SubBwd>
  FBuf mhc_sublayer_bwd(const FBuf& dH, const FBuf& H_in, const FBuf& post, const FBuf& comb, const FBuf& f,
                        const std::string& hc_prefix, int layer, SubBwd sub_bwd);

  FBuf attention_bwd(const FBuf& dout, int L);  // -> d(attn_norm output)
  void indexer_kl_bwd(int L);                   // the indexer's KL objective into its weights' gradients
  // A compressor's backward (prefix `cp`, head dim d) from the gradient of its G rows: the pooling,
  // then its two projections of x; dx (+=) when not null.
  void compressor_bwd(const std::string& cp, int64_t d, int ratio, int64_t G, const FBuf& kvp, const FBuf& sc,
                      const float* dout, const FBuf& x, float* dx, int L);
  FBuf moe_bwd(const FBuf& dout, int L);        // -> d(ffn_norm output)

  Backend& be_;
  const Weights& w_;
  const ModelConfig& c_;
  const Tape& tape_;
  int seq_;
  const RunOptions& opt_;
  const BackwardOptions& bo_;
  ReduceSites R_;  // the profile's reduction orders per op family
  int64_t T_ = 0;
  backend::Buffer<int64_t> pos_;
  FBuf freq_plain_, freq_comp_;
  std::map<std::string, FBuf> grads_;
};

template <typename SubBwd>
FBuf SequenceBackward::mhc_sublayer_bwd(const FBuf& dH, const FBuf& H_in, const FBuf& post, const FBuf& comb,
                                        const FBuf& f, const std::string& hc_prefix, int layer, SubBwd sub_bwd) {
  const int hc = c_.hc_mult;
  const int64_t D = c_.hidden_size;
  FBuf df = zeros(T_ * D), dR = zeros(T_ * hc * D), dpost = be_.floats(T_ * hc), dcomb = be_.floats(T_ * hc * hc);
  HcPostBwdParams pp;
  pp.T = T_;
  pp.hc = hc;
  pp.D = D;
  pp.f = f.data();
  pp.R = H_in.data();
  pp.post = post.data();
  pp.comb = comb.data();
  pp.dout = dH.data();
  pp.order = R_.mhc;
  pp.df = df.data();
  pp.dR = dR.data();
  pp.dpost = dpost.data();
  pp.dcomb = dcomb.data();
  be_.hc_post_backward(pp);

  const FBuf dy = sub_bwd(df);

  HcPreBwdParams p;
  set_mhc_mixer(p, be_, c_, hc_prefix, T_, H_in.data(), R_.mhc);
  p.dy = dy.data();
  p.dpost = dpost.data();
  p.dcomb = dcomb.data();
  p.train_mixer = bo_.train_mixer;
  p.dX = dR.data();
  if (bo_.train_mixer) {
    p.dfn = grad(hc_prefix + "fn");
    p.dscale = grad(hc_prefix + "scale");
    p.dbase = grad(hc_prefix + "base");
  }
  backend::require(hc_pre_backward_check(p), "hc_pre_backward", layer);
  be_.hc_pre_backward(p);
  return dR;
}

FBuf SequenceBackward::moe_bwd(const FBuf& dout, int L) {
  const FfnTape& t = tape_.ffn[size_t(L)];
  const std::string m = layer_prefix(L) + "mlp.";
  const int64_t D = c_.hidden_size, I = c_.moe_intermediate_size;
  const int E = c_.n_routed_experts, k = c_.num_experts_per_tok;

  std::vector<ExpertWeights> experts(static_cast<size_t>(E));
  std::vector<ExpertGrads> egrads(static_cast<size_t>(E));
  for (int e = 0; e < E; ++e) {
    const std::string ep = m + fmt::format("experts.{}.", e);
    experts[size_t(e)] = ExpertWeights{be_.weight(ep + "gate_proj.weight"), be_.weight(ep + "up_proj.weight"),
                                       be_.weight(ep + "down_proj.weight")};
    egrads[size_t(e)] =
        ExpertGrads{grad(ep + "gate_proj.weight"), grad(ep + "up_proj.weight"), grad(ep + "down_proj.weight")};
  }
  std::vector<ExpertWeights> shared;
  std::vector<ExpertGrads> sgrads;
  if (c_.n_shared_experts > 0) {
    const std::string sp = m + "shared_experts.";
    shared.push_back(ExpertWeights{be_.weight(sp + "gate_proj.weight"), be_.weight(sp + "up_proj.weight"),
                                   be_.weight(sp + "down_proj.weight")});
    sgrads.push_back(
        ExpertGrads{grad(sp + "gate_proj.weight"), grad(sp + "up_proj.weight"), grad(sp + "down_proj.weight")});
  }
  FBuf dx = zeros(T_ * D), dweights = be_.floats(T_ * k);
  MoeBwdParams p;
  p.fwd.T = T_;
  p.fwd.D = D;
  p.fwd.I = I;
  p.fwd.I_shared = I * c_.n_shared_experts;
  p.fwd.E = E;
  p.fwd.k = k;
  p.fwd.n_shared = int(shared.size());
  p.fwd.x = t.x.data();
  p.fwd.ids = t.ids.data();
  p.fwd.weights = t.weights.data();
  p.fwd.experts = experts.data();
  p.fwd.shared = shared.data();
  p.fwd.swiglu_limit = c_.swiglu_limit;
  p.fwd.clamp_shared = opt_.profile.clamp_shared_expert;
  p.fwd.order = R_.moe;
  p.dout = dout.data();
  p.dx = dx.data();
  p.dweights = dweights.data();
  p.grads = egrads.data();
  p.shared_grads = sgrads.data();
  if (opt_.experts)
    be_.moe_experts_backward_parallel(p, L, *opt_.experts);
  else
    be_.moe_experts_backward(p);

  // The routing weights are differentiable (the ids are not): into the router logits, then through
  // the gate GEMM into the MoE input (and into the gate weight when it is trained).
  FBuf dlogits = be_.floats(T_ * E);
  RouterBwdParams rp;
  rp.T = T_;
  rp.E = E;
  rp.k = k;
  rp.logits = t.logits.data();
  rp.ids = t.ids.data();
  rp.dweights = dweights.data();
  rp.norm_topk_prob = c_.norm_topk_prob;
  rp.routed_scaling_factor = c_.routed_scaling_factor;
  rp.dlogits = dlogits.data();
  be_.router_backward(rp);
  report(L, "grad.moe.router_logits", dlogits, T_, E);
  linear_bwd(dlogits, t.x, T_, E, D, m + "gate.weight", dx.data(), true);
  return dx;
}

void SequenceBackward::compressor_bwd(const std::string& cp, int64_t d, int ratio, int64_t G, const FBuf& kvp,
                                      const FBuf& sc, const float* dout, const FBuf& x, float* dx, int L) {
  const int64_t cw = common::compressor_row_width(ratio, d);
  FBuf dkvp = be_.floats(T_ * cw), dsc = be_.floats(T_ * cw);
  CompressorPoolBwdParams p;
  p.g0 = 0;
  p.G = G;
  p.row0 = 0;
  p.rows = T_;
  p.ratio = ratio;
  p.d = d;
  p.rd = c_.qk_rope_head_dim;
  p.kvp = kvp.data();
  p.sc = sc.data();
  p.ape = be_.weight(cp + "ape");
  p.norm = be_.weight(cp + "norm.weight");
  p.freq = freq_comp_.data();
  p.rms_eps = c_.rms_norm_eps;
  p.order = R_.compressor;
  p.dout = dout;
  p.dkvp = dkvp.data();
  p.dsc = dsc.data();
  p.dape = grad(cp + "ape");
  p.dnorm = grad(cp + "norm.weight");
  backend::require(compressor_pool_backward_check(p), "compressor_pool_backward", L);
  be_.compressor_pool_backward(p);
  linear_bwd(dkvp, x, T_, cw, c_.hidden_size, cp + "wkv.weight", dx, true);
  linear_bwd(dsc, x, T_, cw, c_.hidden_size, cp + "wgate.weight", dx, true);
}

void SequenceBackward::indexer_kl_bwd(int L) {
  const AttentionTape& t = tape_.attn[size_t(L)];
  const IndexerKlOptions& kl = bo_.indexer_kl;
  if (!kl.enabled || c_.ratio(L) != 4) return;
  if (t.qi.size() == 0 && T_ > 0)
    throw Error(fmt::format("backward: sequence {} layer {}: the tape holds no indexer tensors (the forward "
                            "was not asked to keep them)",
                            seq_, L));
  const std::string ix = layer_prefix(L) + "self_attn.indexer.", cp = ix + "compressor.";
  const int H = c_.num_attention_heads, Hi = c_.index_n_heads, k = t.k;
  const int64_t D = c_.hidden_size, Dh = c_.head_dim, Di = c_.index_head_dim, ql = c_.q_lora_rank;
  const int64_t G = int64_t(t.ki.size()) / Di;

  // The target: the attention's mass on the compressed slots, the last k columns of the index rows
  // (their entries are the selected groups, shifted past the window rows: indexer.h build_index).
  FBuf mass = be_.floats(T_ * k);
  AttentionMassParams mp;
  mp.T = T_;
  mp.H = H;
  mp.Dh = Dh;
  mp.N = t.N;
  mp.K = t.K;
  mp.c0 = t.K - k;
  mp.n = k;
  mp.q = t.q.data();
  mp.kv = t.kvcat.data();
  mp.idx = t.idx.data();
  mp.lse = t.lse.data();
  mp.scale = float(1.0 / std::sqrt(double(Dh)));
  mp.order = R_.attention;
  mp.mass = mass.data();
  be_.attention_mass(mp);

  FBuf row_loss = be_.floats(T_), dscore = be_.floats(T_ * k);
  IndexerKlParams kp;
  kp.T = T_;
  kp.k = k;
  kp.ids = t.sel.data();
  kp.score = t.iscore.data();
  kp.mass = mass.data();
  kp.l1_target = kl.l1_target;
  kp.coeff = kl.row_weight;
  kp.loss = row_loss.data();
  kp.dscore = dscore.data();
  be_.indexer_kl(kp);
  if (bo_.on_indexer_kl) {
    double sum = 0;
    for (float v : be_.download(row_loss.data(), T_)) sum += double(v);
    bo_.on_indexer_kl(L, sum);
  }
  report(L, "grad.indexer.score", dscore, T_, k);
  const bool trained = trainable(ix + "wq_b.weight") || trainable(ix + "weights_proj.weight") ||
                       trainable(cp + "wkv.weight") || trainable(cp + "wgate.weight") || trainable(cp + "ape") ||
                       trainable(cp + "norm.weight");
  if (!trained) return;

  FBuf dqi = be_.floats(T_ * Hi * Di), dwt = be_.floats(T_ * Hi), dki = be_.floats(G * Di);
  IndexerScoreBwdParams sp;
  sp.T = T_;
  sp.Hi = Hi;
  sp.Di = Di;
  sp.G = G;
  sp.k = k;
  sp.qi = t.qi.data();
  sp.ki = t.ki.data();
  sp.wt = t.wt.data();
  sp.ids = t.sel.data();
  sp.dscore = dscore.data();
  sp.wt_scale = float(1.0 / std::sqrt(double(Hi) * double(Di)));  // the forward's head-weight scale
  sp.order = R_.indexer;
  sp.dqi = dqi.data();
  sp.dwt = dwt.data();
  sp.dki = dki.data();
  be_.indexer_score_backward(sp);
  report(L, "grad.indexer.q", dqi, T_, Hi * Di);
  report(L, "grad.indexer.weights", dwt, T_, Hi);
  report(L, "grad.indexer.k", dki, G, Di);

  // Queries: FP8 simulation straight-through, the Hadamard rotation's transpose, RoPE, wq_b (its input
  // qr is detached: no gradient leaves the indexer).
  be_.hadamard_backward(dqi.data(), T_ * Hi, Di, Di);
  rope_bwd(dqi, Hi, Di, freq_comp_.data(), false, L);
  linear_bwd(dqi, t.qr, T_, Hi * Di, ql, ix + "wq_b.weight", nullptr, false);
  // Head weights (the scale is in dwt): weights_proj.
  linear_bwd(dwt, t.x, T_, Hi, D, ix + "weights_proj.weight", nullptr, false);
  // Keys: FP8 simulation straight-through, the Hadamard rotation's transpose, then the indexer
  // compressor as the main one (MODEL.md §5.3).
  if (G > 0) {
    be_.hadamard_backward(dki.data(), G, Di, Di);
    compressor_bwd(cp, Di, 4, G, t.ikvp, t.isc, dki.data(), t.x, nullptr, L);
  }
}

FBuf SequenceBackward::attention_bwd(const FBuf& dout, int L) {
  indexer_kl_bwd(L);
  const AttentionTape& t = tape_.attn[size_t(L)];
  const std::string a = layer_prefix(L) + "self_attn.";
  const int64_t D = c_.hidden_size, Dh = c_.head_dim, ql = c_.q_lora_rank;
  const int H = c_.num_attention_heads;
  const int ratio = c_.ratio(L);
  const float* freq = ratio ? freq_comp_.data() : freq_plain_.data();

  // out = u · wo_b^T; u[t, g] = wo_a[g] · o[t, heads of g].
  const int Gr = c_.o_groups;
  const int64_t R = c_.o_lora_rank, gw = int64_t(H / Gr) * Dh;
  FBuf du = be_.floats(T_ * Gr * R);
  linear_bwd(dout, t.u, T_, D, Gr * R, a + "wo_b.weight", du.data(), false);
  report(L, "grad.attn.u", du, T_, Gr * R);
  FBuf dO = be_.floats(T_ * H * Dh);
  const float* wo_a = be_.weight(a + "wo_a.weight");
  float* dwo_a = grad(a + "wo_a.weight");
  for (int g = 0; g < Gr; ++g)
    linear_bwd(du.data() + g * R, Gr * R, t.o.data() + g * gw, H * Dh, T_, R, gw, a + "wo_a.weight",
               wo_a + g * R * gw, gw, dwo_a ? dwo_a + g * R * gw : nullptr, dO.data() + g * gw, H * Dh, false);
  rope_bwd(dO, H, Dh, freq, true, L);  // the forward rotated o back (inverse RoPE)
  report(L, "grad.attn.o", dO, T_, H * Dh);

  FBuf dq = be_.floats(T_ * H * Dh), dkv = be_.floats(t.N * Dh);
  SparseAttnBwdParams sp;
  sp.T = T_;
  sp.H = H;
  sp.Dh = Dh;
  sp.N = t.N;
  sp.K = t.K;
  sp.q = t.q.data();
  sp.kv = t.kvcat.data();
  sp.idx = t.idx.data();
  sp.sink = be_.weight(a + "attn_sink");
  sp.scale = float(1.0 / std::sqrt(double(Dh)));
  sp.o = t.o_attn.data();
  sp.lse = t.lse.data();
  sp.dO = dO.data();
  sp.order = R_.attention;
  sp.dq = dq.data();
  sp.dkv = dkv.data();
  FBuf dsink_scratch;
  sp.dsink = grad(a + "attn_sink");
  if (!sp.dsink) {  // frozen sink: the kernel still wants somewhere to add
    dsink_scratch = zeros(H);
    sp.dsink = dsink_scratch.data();
  }
  // The backend validates (the CPU's check scans idx, which lives in device memory on CUDA).
  be_.sparse_attention_backward(sp);
  report(L, "grad.attn.q", dq, T_, H * Dh);
  report(L, "grad.attn.kvcat", dkv, t.N, Dh);

  FBuf dx = zeros(T_ * D);
  // Compressed rows (FP8 simulation straight-through) -> the main compressor.
  if (ratio > 0 && t.G > 0) {
    compressor_bwd(a + "compressor.", Dh, ratio, t.G, t.kvp, t.sc, dkv.data() + T_ * Dh, t.x, dx.data(), L);
  }
  // Window rows: RoPE, kv_norm, wkv.
  FBuf dkvw = be_.floats(T_ * Dh);
  be_.copy(dkvw.data(), dkv.data(), size_t(T_ * Dh) * sizeof(float));
  rope_bwd(dkvw, 1, Dh, freq, false, L);
  FBuf dkv_lin = be_.floats(T_ * Dh);
  norm_bwd(t.kv_lin, T_, Dh, a + "kv_norm.weight", dkvw.data(), dkv_lin.data(), false);
  linear_bwd(dkv_lin, t.x, T_, Dh, D, a + "wkv.weight", dx.data(), true);

  // Query path: RoPE, the per-head norm (no weight), wq_b, q_norm, wq_a. The indexer is not
  // differentiated (MODEL.md §3.7): no gradient reaches qr or x through it.
  rope_bwd(dq, H, Dh, freq, false, L);
  FBuf dq_lin = be_.floats(T_ * H * Dh);
  norm_bwd(t.q_lin, T_ * H, Dh, "", dq.data(), dq_lin.data(), false);
  FBuf dqr = be_.floats(T_ * ql);
  linear_bwd(dq_lin, t.qr, T_, H * Dh, ql, a + "wq_b.weight", dqr.data(), false);
  FBuf dqa = be_.floats(T_ * ql);
  norm_bwd(t.qa, T_, ql, a + "q_norm.weight", dqr.data(), dqa.data(), false);
  linear_bwd(dqa, t.x, T_, ql, D, a + "wq_a.weight", dx.data(), true);
  report(L, "grad.attn.norm", dx, T_, D);
  return dx;
}

GradSet SequenceBackward::run(const std::vector<float>& dlogprobs) {
  const int hc = c_.hc_mult;
  const int64_t D = c_.hidden_size, V = c_.vocab_size;
  if (int64_t(dlogprobs.size()) != std::max<int64_t>(T_ - 1, 0))
    throw Error(fmt::format("backward: sequence {}: {} log-prob gradients for {} tokens", seq_, dlogprobs.size(), T_));

  // Log-probs -> logits (the last row has no target) -> lm_head -> final norm -> hc_head.
  FBuf dlogits = zeros(T_ * V);
  if (T_ > 1) {
    FBuf dlp = be_.floats(T_ - 1);
    be_.upload(dlp.data(), dlogprobs);
    be_.log_softmax_backward(tape_.logits.data(), T_ - 1, V, tape_.tokens.data() + 1, dlp.data(), opt_.temperature,
                             dlogits.data());
  }
  report(-1, "grad.logits", dlogits, T_, V);
  FBuf dy = be_.floats(T_ * D);
  linear_bwd(dlogits, tape_.y, T_, V, D, "lm_head.weight", dy.data(), false);
  FBuf dyhc = be_.floats(T_ * D);
  norm_bwd(tape_.y_hc, T_, D, "model.norm.weight", dy.data(), dyhc.data(), false);
  report(-1, "grad.head.hc", dyhc, T_, D);
  FBuf dH = zeros(T_ * hc * D);
  HcHeadBwdParams hp;
  const std::string head = kHeadMhcPrefix;
  set_mhc_mixer(hp, be_, c_, head, T_, tape_.H_final.data(), R_.mhc);
  hp.dy = dyhc.data();
  hp.train_mixer = bo_.train_mixer;
  hp.dX = dH.data();
  if (bo_.train_mixer) {
    hp.dfn = grad(head + "fn");
    hp.dscale = grad(head + "scale");
    hp.dbase = grad(head + "base");
  }
  backend::require(hc_head_backward_check(hp), "hc_head_backward", -1);
  be_.hc_head_backward(hp);

  for (int L = c_.num_hidden_layers - 1; L >= 0; --L) {
    const std::string p = layer_prefix(L);
    report(L, "grad.ffn.hc_post", dH, T_, hc * D);
    const FfnTape& ft = tape_.ffn[size_t(L)];
    const std::string ffn_mixer = mhc_prefix(L, Sublayer::ffn), attn_mixer = mhc_prefix(L, Sublayer::attn);
    dH = mhc_sublayer_bwd(dH, ft.H_in, ft.post, ft.comb, ft.out, ffn_mixer, L, [&](const FBuf& df) {
      report(L, "grad.moe.out", df, T_, D);
      FBuf dx = moe_bwd(df, L);
      report(L, "grad.ffn.norm", dx, T_, D);
      FBuf dfin = be_.floats(T_ * D);
      norm_bwd(ft.f_in, T_, D, p + "post_attention_layernorm.weight", dx.data(), dfin.data(), false);
      report(L, "grad.ffn.hc_pre", dfin, T_, D);
      return dfin;
    });
    report(L, "grad.attn.hc_post", dH, T_, hc * D);
    const AttentionTape& at = tape_.attn[size_t(L)];
    dH = mhc_sublayer_bwd(dH, at.H_in, at.post, at.comb, at.out, attn_mixer, L, [&](const FBuf& da) {
      report(L, "grad.attn.out", da, T_, D);
      FBuf dx = attention_bwd(da, L);
      FBuf dain = be_.floats(T_ * D);
      norm_bwd(at.a_in, T_, D, p + "input_layernorm.weight", dx.data(), dain.data(), false);
      report(L, "grad.attn.hc_pre", dain, T_, D);
      return dain;
    });
  }
  report(-1, "grad.embed", dH, T_, hc * D);
  if (float* de = grad("model.embed_tokens.weight"))
    be_.embed_backward(dH.data(), D, tape_.tokens.data(), T_, hc, de);

  GradSet out;
  for (auto& [name, buf] : grads_) out.emplace(name, be_.download(buf.data(), buf.size()));
  return out;
}

}  // namespace

GradSet backward(backend::Backend& be, const Weights& w, const Tape& tape, int seq,
                 const std::vector<float>& dlogprobs, const RunOptions& opt, const BackwardOptions& bo) {
  if (tape.attn.size() != size_t(w.config().num_hidden_layers) || tape.tokens.size() == 0)
    throw Error(fmt::format("backward: sequence {}: the tape does not come from a training forward", seq));
  SequenceBackward b(be, w, tape, seq, opt, bo);
  return b.run(dlogprobs);
}

}  // namespace dsv4
