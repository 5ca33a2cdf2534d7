#include "replay/training.h"

#include <fmt/format.h>

#include <chrono>
#include <filesystem>
#include <cmath>
#include <cstring>
#include <map>

#include "capture/errors.h"
#include "model/error.h"
#include "train/record.h"

namespace dsv4 {

namespace {

// Compares row digests; returns the first differing row or -1, counting into sr.
int64_t compare_rows(const std::vector<uint64_t>& rec, const std::vector<uint64_t>& rep, StepReplay& sr,
                     int64_t* differing) {
  ++sr.records_compared;
  sr.rows_compared += int64_t(rec.size());
  int64_t first = -1;
  *differing = 0;
  if (rec.size() != rep.size()) {
    *differing = int64_t(std::max(rec.size(), rep.size()));
    first = 0;
  } else {
    for (size_t i = 0; i < rec.size(); ++i)
      if (rec[i] != rep[i]) {
        ++*differing;
        if (first < 0) first = int64_t(i);
      }
  }
  if (*differing > 0) {
    ++sr.records_differing;
    sr.rows_differing += *differing;
  }
  return first;
}

void diverge(StepReplay& sr, int step, int seq, int layer, std::string tensor, int64_t row, std::string reason) {
  if (sr.first) return;
  Divergence d;
  d.step = step;
  d.seq = seq;
  d.layer = layer;
  d.tensor = std::move(tensor);
  d.row = row;
  d.reason = std::move(reason);
  sr.first = std::move(d);
}

}  // namespace

const char* backward_op_of(const std::string& n) {
  static const std::map<std::string, const char*> ops = {
      {"grad.logits", "log_softmax_backward (the policy loss's d logp into the logits)"},
      {"grad.head.hc", "lm_head gemm_dx, then the final RMSNorm backward"},
      {"grad.ffn.hc_post", "hc_pre backward of the layer above (or hc_head backward for the last layer)"},
      {"grad.moe.out", "hc_post backward (df)"},
      {"grad.moe.router_logits", "moe_experts_backward (d routing weights), then router_backward"},
      {"grad.ffn.norm", "moe_experts_backward (dx) and the router gate's gemm_dx"},
      {"grad.ffn.hc_pre", "ffn_norm RMSNorm backward"},
      {"grad.attn.hc_post", "hc_pre backward of the FFN sublayer (streams)"},
      {"grad.attn.out", "hc_post backward (df)"},
      {"grad.indexer.score", "attention_mass, then indexer_kl (the indexer KL objective's d score)"},
      {"grad.indexer.q", "indexer_score_backward (dqi)"},
      {"grad.indexer.weights", "indexer_score_backward (d head weights)"},
      {"grad.indexer.k", "indexer_score_backward (dki)"},
      {"grad.attn.u", "wo_b gemm_dx"},
      {"grad.attn.o", "wo_a gemm_dx per group, then the inverse RoPE's transpose"},
      {"grad.attn.q", "sparse_attention_backward (dq)"},
      {"grad.attn.kvcat", "sparse_attention_backward (dkv)"},
      {"grad.attn.norm",
       "compressor_pool_backward + compressor gemm_dx, kv_norm backward + wkv gemm_dx, q path (RoPE, head norm, "
       "wq_b, q_norm, wq_a)"},
      {"grad.attn.hc_pre", "attn_norm RMSNorm backward"},
      {"grad.embed", "hc_pre backward of layer 0 (streams)"},
  };
  const auto it = ops.find(n);
  return it == ops.end() ? "(unknown op)" : it->second;
}

TrainingReplayPlan plan_training_replay(const TraceReader& r, int step) {
  TrainingReplayPlan p;
  p.step = step;
  std::optional<TrainingRecord> t = r.training(step);
  if (!t) throw TraceError(fmt::format("{}: step {} is a training step without its training record", r.path(), step));
  p.record = std::move(*t);
  p.settings = train::TrainStepOptions::from_json(p.record.settings_json);
  for (const TraceStepInfo& s : r.steps())
    if (s.index == step) p.settings.profile = recorded_profile(s, r.path());
  p.force_indexer = p.settings.decisions_kinds.find("indexer") != std::string::npos;
  p.force_routing = p.settings.decisions_kinds.find("routing") != std::string::npos;
  return p;
}

void replay_training_step(const TraceReader& r, const TrainingReplayPlan& plan, const Weights& w,
                          const ReplayOptions& opt, const Overrides& decisions, Observer& forward_verifier,
                          StepReplay& sr) {
  const TrainingRecord& rec = plan.record;
  const int step = plan.step;
  const int n = int(rec.samples.size());

  // The samples, as the step was given them.
  std::vector<train::TrainSample> samples;
  for (int s = 0; s < n; ++s) {
    const SampleLossInputs& in = rec.samples[size_t(s)];
    const std::vector<int32_t> toks = r.tokens(step, s);
    if (in.prompt_length < 1 || in.prompt_length >= int64_t(toks.size()))
      throw TraceError(fmt::format("{}: step {} sample {}: prompt length {} for {} tokens", r.path(), step, s,
                                     in.prompt_length, toks.size()));
    train::TrainSample ts;
    ts.id = in.id;
    ts.prompt.assign(toks.begin(), toks.begin() + in.prompt_length);
    ts.response.assign(toks.begin() + in.prompt_length, toks.end());
    ts.rollout_logprobs = in.rollout_logprobs;
    ts.old_logprobs = in.old_logprobs;
    ts.ref_logprobs = in.ref_logprobs;
    if (in.has_reward)
      ts.reward = in.reward;
    else
      ts.advantage = in.advantage;
    ts.group = in.group;
    samples.push_back(std::move(ts));
  }

  // The optimizer state the step started from.
  train::OptimizerState state;
  if (rec.optimizer_state_digest == 0) {
    state = train::fresh_optimizer_state(w, plan.settings.groups);
  } else {
    std::string path = opt.optimizer_state.empty() ? rec.optimizer_state_path : opt.optimizer_state;
    if (path.empty() || !std::filesystem::exists(path))
      throw InputError(fmt::format(
          "{}: step {} started from the optimizer state {} (step {}), which is not here; pass "
          "--optimizer-state FILE",
          r.path(), step, rec.optimizer_state_path.empty() ? "(unnamed)" : rec.optimizer_state_path,
          rec.optimizer_step_before));
    state = train::OptimizerState::load(path);
    if (train::optimizer_state_digest(state) != rec.optimizer_state_digest)
      throw InputError(fmt::format("{}: the optimizer state {} is not the one step {} started from (digest differs)",
                                   r.path(), path, step));
  }

  train::TrainStepOptions o = plan.settings;
  o.device = opt.device;
  o.threads = opt.threads;
  o.experts = opt.experts;
  train::TrainStepHooks hooks;
  hooks.decisions = (plan.force_indexer || plan.force_routing) ? &decisions : nullptr;
  hooks.observer = &forward_verifier;
  // Activation gradients, compared as they are produced (execution order).
  size_t next = 0;
  bool lost = false;
  hooks.on_grad = [&](const GradRecord& g) {
    if (lost) return;
    if (next >= rec.act_grads.size()) {
      lost = true;
      ++sr.records_differing;
      diverge(sr, step, g.seq, g.layer, g.name, 0,
              fmt::format("extra gradient record: the trace holds {}, the replay computed {} layer {} after them",
                          rec.act_grads.size(), g.name, g.layer));
      return;
    }
    const ActGradDigests& a = rec.act_grads[next++];
    if (a.seq != g.seq || a.layer != g.layer || a.name != g.name || a.rows != g.rows || a.cols != g.cols) {
      lost = true;
      ++sr.records_differing;
      diverge(sr, step, g.seq, g.layer, g.name, 0,
              fmt::format("gradient record order differs: the trace holds {} layer {} of sample {} ({}x{}), the "
                          "replay computed {} layer {} of sample {} ({}x{})",
                          a.name, a.layer, a.seq, a.rows, a.cols, g.name, g.layer, g.seq, g.rows, g.cols));
      return;
    }
    train::ActGradCollector c;
    c(g);
    int64_t differing = 0;
    const int64_t row = compare_rows(a.digests, c.take()[0].digests, sr, &differing);
    if (row >= 0)
      diverge(sr, step, g.seq, g.layer, g.name, row,
              fmt::format("gradient digest differs ({} of {} rows); produced by {}", differing, a.rows,
                          backward_op_of(g.name)));
  };

  const auto t0 = std::chrono::steady_clock::now();
  Weights after = w;
  const train::TrainStepResult res = train::train_step(w, samples, state, o, hooks, &after);
  sr.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  if (!lost && next < rec.act_grads.size()) {
    ++sr.records_differing;
    const ActGradDigests& a = rec.act_grads[next];
    diverge(sr, step, a.seq, a.layer, a.name, 0,
            fmt::format("missing gradient record: the trace holds {}, the replay computed {}", rec.act_grads.size(),
                        next));
  }

  // The step's outputs, in the order the step produced them: metrics, gradients, the update.
  const TrainingRecord mine =
      train::make_training_record(w, after, state, res, samples, o, /*capture_params=*/"");
  for (const auto& [name, value] : rec.metrics) {
    const auto it = mine.metrics.find(name);
    ++sr.records_compared;
    if (it == mine.metrics.end() || std::memcmp(&it->second, &value, sizeof(double)) != 0) {
      ++sr.records_differing;
      diverge(sr, step, -1, -1, "metric:" + name, 0,
              fmt::format("recorded {:.17g}, replayed {:.17g}", value,
                          it == mine.metrics.end() ? std::nan("") : it->second));
    }
  }
  std::map<std::string, const ParamDigests*> by_name;
  for (const ParamDigests& p : mine.params) by_name[p.name] = &p;
  for (const char* what : {"grad", "weight", "master", "adam_m", "adam_v"}) {
    for (const ParamDigests& p : rec.params) {
      const auto it = by_name.find(p.name);
      if (it == by_name.end()) {
        ++sr.records_differing;
        diverge(sr, step, -1, -1, std::string(what) + ":" + p.name, 0, "the replayed model has no such weight");
        continue;
      }
      const ParamDigests& q = *it->second;
      const std::string_view wv(what);
      const auto& a = wv == "grad" ? p.grad : wv == "weight" ? p.weight : wv == "master" ? p.master : wv == "adam_m" ? p.m : p.v;
      const auto& b = wv == "grad" ? q.grad : wv == "weight" ? q.weight : wv == "master" ? q.master : wv == "adam_m" ? q.m : q.v;
      int64_t differing = 0;
      const int64_t row = compare_rows(a, b, sr, &differing);
      if (row >= 0)
        diverge(sr, step, -1, -1, std::string(what) + ":" + p.name, row,
                fmt::format("digest differs ({} of {} rows)", differing, std::max(a.size(), b.size())));
    }
  }
}

}  // namespace dsv4
