#include "train/step.h"

#include <fmt/format.h>
#include <omp.h>

#include <chrono>
#include <cmath>
#include <cstring>
#include <nlohmann/json.hpp>

#include "kernels/numerics/numerics.h"
#include "model/error.h"
#include "model/profile.h"
#include "model/tape.h"
#include "model/threads.h"
#include "train/grad_tree.h"

namespace dsv4::train {

namespace {

using Clock = std::chrono::steady_clock;
double since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

int64_t tape_bytes(const Tape& t) {
  int64_t b = 0;
  auto add = [&](const auto& buf) { b += int64_t(buf.bytes()); };
  for (const AttentionTape& a : t.attn) {
    for (const auto* f : {&a.H_in, &a.post, &a.comb, &a.a_in, &a.x, &a.qa, &a.qr, &a.q_lin, &a.q, &a.kv_lin,
                          &a.kvp, &a.sc, &a.kvcat, &a.o_attn, &a.lse, &a.o, &a.u, &a.out, &a.qi, &a.ki, &a.wt,
                          &a.ikvp, &a.isc, &a.iscore})
      add(*f);
    add(a.idx);
    add(a.sel);
  }
  for (const FfnTape& f : t.ffn) {
    for (const auto* x : {&f.H_in, &f.post, &f.comb, &f.f_in, &f.x, &f.logits, &f.weights, &f.out}) add(*x);
    add(f.ids);
  }
  for (const auto* x : {&t.H_final, &t.y_hc, &t.y, &t.logits}) add(*x);
  add(t.tokens);
  return b;
}


}  // namespace

void check_indexer_kl(const TrainStepOptions& o) {
  if (!std::isfinite(o.indexer_kl_coeff) || o.indexer_kl_coeff < 0)
    throw InputError(fmt::format("--indexer-kl must be a finite coefficient >= 0, got {}", o.indexer_kl_coeff));
  if (o.indexer_kl_target != "l1" && o.indexer_kl_target != "heads_sum")
    throw InputError(fmt::format("--indexer-kl-target must be l1 or heads_sum, got '{}'", o.indexer_kl_target));
  if (o.groups.trained.count(ParamGroup::indexer) && o.indexer_kl_coeff == 0)
    throw InputError(
        "parameter group 'indexer' cannot be trained without its KL objective: only integer ids leave the "
        "indexer (MODEL.md §3.7); pass --indexer-kl COEFF (MODEL.md §5.5)");
}

std::string TrainStepOptions::to_json() const {
  nlohmann::ordered_json j;
  j["profile"] = profile.name;
  j["temperature"] = temperature;
  j["loss"] = {{"eps_low", loss.eps_low},   {"eps_high", loss.eps_high}, {"tis", loss.tis},
               {"tis_cap", loss.tis_cap},   {"kl_coef", loss.kl_coef}};
  j["adamw"] = {{"lr", adamw.lr},       {"beta1", adamw.beta1},
                {"beta2", adamw.beta2}, {"eps", adamw.eps},
                {"weight_decay", adamw.weight_decay}, {"clip_grad", adamw.clip_grad}};
  j["trained_groups"] = groups.describe();
  j["mhc_backward"] = train_mixer ? "full" : "legacy";
  j["group_scale_by_std"] = group_scale_by_std;
  j["micro_batch"] = micro_batch;
  j["decisions_source"] = decisions_source;
  j["decisions_kinds"] = decisions_kinds;
  j["decisions_model_digest"] = decisions_model_digest;
  if (indexer_kl_coeff != 0) j["indexer_kl"] = {{"coeff", indexer_kl_coeff}, {"target", indexer_kl_target}};
  return j.dump();
}

TrainStepOptions TrainStepOptions::from_json(const std::string& text) {
  TrainStepOptions o;
  try {
    const nlohmann::json j = nlohmann::json::parse(text);
    const std::string profile = j.at("profile").get<std::string>();
    if (is_builtin_profile(profile))
      o.profile = profile_by_name(profile);
    else
      o.profile.name = profile;  // the trace's recorded text is the profile (replay/training.cpp)
    o.temperature = j.at("temperature").get<float>();
    const auto& l = j.at("loss");
    o.loss.eps_low = l.at("eps_low").get<double>();
    o.loss.eps_high = l.at("eps_high").get<double>();
    o.loss.tis = l.at("tis").get<bool>();
    o.loss.tis_cap = l.at("tis_cap").get<double>();
    o.loss.kl_coef = l.at("kl_coef").get<double>();
    const auto& a = j.at("adamw");
    o.adamw.lr = a.at("lr").get<double>();
    o.adamw.beta1 = a.at("beta1").get<double>();
    o.adamw.beta2 = a.at("beta2").get<double>();
    o.adamw.eps = a.at("eps").get<double>();
    o.adamw.weight_decay = a.at("weight_decay").get<double>();
    o.adamw.clip_grad = a.at("clip_grad").get<double>();
    o.groups.trained.clear();
    const std::string g = j.at("trained_groups").get<std::string>();
    if (g != "(none)") o.groups.train(g);
    const std::string mode = j.at("mhc_backward").get<std::string>();
    if (mode != "full" && mode != "legacy") throw InputError(fmt::format("mhc_backward '{}'", mode));
    o.train_mixer = mode == "full";
    o.group_scale_by_std = j.at("group_scale_by_std").get<bool>();
    o.micro_batch = j.at("micro_batch").get<int>();
    o.decisions_source = j.at("decisions_source").get<std::string>();
    o.decisions_kinds = j.at("decisions_kinds").get<std::string>();
    o.decisions_model_digest = j.at("decisions_model_digest").get<std::string>();
    if (j.contains("indexer_kl")) {  // absent: a step without the objective (and every older trace)
      o.indexer_kl_coeff = j.at("indexer_kl").at("coeff").get<double>();
      o.indexer_kl_target = j.at("indexer_kl").at("target").get<std::string>();
    }
  } catch (const nlohmann::json::exception& e) {
    throw InputError(fmt::format("training settings: {}", e.what()));
  }
  return o;
}

OptimizerState fresh_optimizer_state(const Weights& w, const TrainGroups& g) {
  OptimizerState s;
  for (const auto& [name, t] : w.tensors()) {
    if (t.f.empty() || !g.trains(name)) continue;
    s.master[name] = t.f;
    s.m[name] = std::vector<float>(t.f.size(), 0.0f);
    s.v[name] = std::vector<float>(t.f.size(), 0.0f);
    s.ndim[name] = int(t.shape.size());
  }
  return s;
}

void check_optimizer_state(const OptimizerState& s, const Weights& w, const TrainGroups& g,
                           const std::string& what) {
  for (const auto& [name, t] : w.tensors()) {
    if (t.f.empty() || !g.trains(name)) continue;
    const auto it = s.master.find(name);
    if (it == s.master.end())
      throw InputError(fmt::format("{}: no master weights for the trained tensor '{}'", what, name));
    if (it->second.size() != t.f.size())
      throw InputError(fmt::format("{}: '{}' has {} elements, the model {}", what, name, it->second.size(),
                                   t.f.size()));
    const bool keep_f32 = t.dtype == StDType::F32 || t.dtype == StDType::F16;
    for (size_t i = 0; i < t.f.size(); ++i) {
      const float v = keep_f32 ? it->second[i] : num::bf16_round(it->second[i]);
      if (std::memcmp(&v, &t.f[i], sizeof(float)) != 0)
        throw InputError(fmt::format(
            "{}: the master weights of '{}' do not round to the checkpoint's values (element {}: {} vs {}); "
            "the state belongs to another checkpoint",
            what, name, i, v, t.f[i]));
    }
  }
  for (const auto& [name, v] : s.master)
    if (!w.has(name) || !g.trains(name))
      throw InputError(fmt::format("{}: it holds '{}', which is not a trained tensor of this model", what, name));
}

TrainStepResult train_step(const Weights& w, const std::vector<TrainSample>& samples, OptimizerState& state,
                           const TrainStepOptions& o, const TrainStepHooks& hooks, Weights* updated) {
  const ModelConfig& c = w.config();
  if (samples.empty()) throw InputError("train-step: no samples");
  if (o.micro_batch < 1) throw InputError(fmt::format("--micro-batch must be >= 1, got {}", o.micro_batch));
  check(o.loss);
  check(o.adamw);
  for (ParamGroup g : o.groups.trained)
    if (const char* why = untrainable_reason(g))
      throw InputError(fmt::format("parameter group '{}' cannot be trained: {}", to_string(g), why));
  check_indexer_kl(o);
  check_optimizer_state(state, w, o.groups, "the optimizer state");

  std::vector<std::vector<int32_t>> batch;
  for (const TrainSample& s : samples) batch.push_back(s.tokens());
  if (hooks.decisions) check_overrides(*hooks.decisions, c, batch);

  // Advantages: given per sample, or group-relative from the rewards.
  TrainStepResult res;
  const bool by_reward = samples[0].reward.has_value();
  if (by_reward) {
    std::vector<double> rewards;
    std::vector<std::string> groups;
    for (const TrainSample& s : samples) {
      if (!s.reward) throw InputError(fmt::format("sample '{}': no reward (the batch uses rewards)", s.id));
      rewards.push_back(*s.reward);
      groups.push_back(s.group);
    }
    res.advantages = group_advantages(rewards, groups, o.group_scale_by_std);
  } else {
    for (const TrainSample& s : samples) {
      if (!s.advantage) throw InputError(fmt::format("sample '{}': neither an advantage nor a reward", s.id));
      res.advantages.push_back(*s.advantage);
    }
  }
  int64_t n_tokens = 0, n_rows = 0;
  for (const TrainSample& s : samples) {
    n_tokens += int64_t(s.response.size());
    n_rows += int64_t(s.prompt.size() + s.response.size());
  }

  RunOptions ro;
  ro.profile = o.profile;
  ro.threads = o.threads;
  ro.temperature = o.temperature;
  ro.device = o.device;
  ro.experts = o.experts;
  ro.observer = hooks.observer;
  ro.overrides = hooks.decisions;
  BackwardOptions bo;
  bo.trainable = [&](const std::string& name) { return o.groups.trains(name); };
  bo.train_mixer = o.train_mixer;
  bo.on_grad = hooks.on_grad;
  // The indexer's KL: each row weighs coefficient / (the batch's token rows), so a sample's gradient
  // does not depend on the micro-batch it is computed in.
  bo.indexer_kl.enabled = o.indexer_kl_coeff != 0;
  bo.indexer_kl.l1_target = o.indexer_kl_target == "l1";
  bo.indexer_kl.row_weight = float(o.indexer_kl_coeff / double(n_rows));
  std::vector<double> kl_per_sample(samples.size(), 0.0);

  require_exact_numerics(o.profile, "train-step");
  const OmpThreadScope threads(o.threads);
  std::unique_ptr<backend::Backend> be = backend::make_backend(o.device, w);
  GradTree tree;
  std::vector<SampleLogprobs> loss_in;
  const int64_t n = int64_t(samples.size());
  for (int64_t first = 0; first < n; first += o.micro_batch) {
    const int64_t last = std::min<int64_t>(n, first + o.micro_batch);
    for (int64_t i = first; i < last; ++i) {
      const TrainSample& s = samples[size_t(i)];
      const std::vector<int32_t>& toks = batch[size_t(i)];
      auto t0 = Clock::now();
      Tape tape;
      tape.keep_indexer = bo.indexer_kl.enabled;
      const SequenceResult fr = forward_with_tape(*be, w, int(i), toks, ro, tape);
      res.seconds_forward += since(t0);
      res.tape_bytes_max = std::max(res.tape_bytes_max, tape_bytes(tape));
      const int64_t P = int64_t(s.prompt.size()), R = int64_t(s.response.size());
      SampleLogprobs sl;
      sl.logp.assign(fr.logprobs.begin() + (P - 1), fr.logprobs.begin() + (P - 1 + R));
      sl.old = s.old_logprobs.empty() ? sl.logp : s.old_logprobs;
      sl.rollout = s.rollout_logprobs;
      sl.ref = s.ref_logprobs;
      sl.advantage = res.advantages[size_t(i)];
      std::vector<std::vector<float>> dl;
      policy_loss(o.loss, {sl}, &dl, n_tokens);
      std::vector<float> dlogprobs(fr.logprobs.size(), 0.0f);
      std::copy(dl[0].begin(), dl[0].end(), dlogprobs.begin() + (P - 1));
      t0 = Clock::now();
      bo.on_indexer_kl = [&](int, double sum) { kl_per_sample[size_t(i)] += sum; };
      GradSet g = backward(*be, w, tape, int(i), dlogprobs, ro, bo);
      // Every sample contributes every trained tensor (a part of the graph a short sample never
      // reaches, e.g. a compressor without a complete group, contributes zeros).
      for (const auto& [name, master] : state.master)
        if (!g.count(name)) g[name] = std::vector<float>(master.size(), 0.0f);
      tree.add(std::move(g));
      res.seconds_backward += since(t0);
      res.logprobs.push_back(sl.logp);
      res.seq_logprobs.push_back(fr.logprobs);
      loss_in.push_back(std::move(sl));
      if (hooks.progress) hooks.progress(i + 1, n);
    }
  }
  be->synchronize();
  res.metrics = policy_loss(o.loss, loss_in, nullptr, 0);
  res.grads = tree.finish();
  for (double v : kl_per_sample) res.indexer_kl += v;
  res.indexer_kl /= double(n_rows);

  const auto t0 = Clock::now();
  res.stats = adamw_step(o.adamw, res.grads, state);
  res.seconds_optimizer = since(t0);
  if (updated) *updated = w.with_values(state.master, fmt::format("train-step:{}", state.step));
  return res;
}

}  // namespace dsv4::train
