#include "train/record.h"

#include <fmt/format.h>
#include <fnmatch.h>

#include "capture/digest.h"
#include "capture/env.h"
#include "capture/trace_writer.h"
#include "model/fanout.h"

namespace dsv4::train {

namespace {

bool matches_any(const std::string& name, const std::string& patterns) {
  size_t i = 0;
  while (i < patterns.size()) {
    size_t j = patterns.find(',', i);
    if (j == std::string::npos) j = patterns.size();
    const std::string p = patterns.substr(i, j - i);
    if (!p.empty() && fnmatch(p.c_str(), name.c_str(), 0) == 0) return true;
    i = j + 1;
  }
  return false;
}

}  // namespace

int64_t tensor_rows(const WeightTensor& t) {
  return t.shape.size() >= 2 ? t.shape[0] : 1;
}

std::vector<uint64_t> tensor_row_digests(const std::vector<float>& v, int64_t rows) {
  std::vector<uint64_t> d(static_cast<size_t>(rows > 0 ? rows : 0));
  if (rows <= 0) return d;
  const size_t per = v.size() / size_t(rows);
  for (int64_t r = 0; r < rows; ++r) d[size_t(r)] = xxh3_64(v.data() + size_t(r) * per, per * sizeof(float));
  return d;
}

uint64_t optimizer_state_digest(const OptimizerState& s) {
  if (s.step == 0) return 0;
  std::vector<uint8_t> buf;
  auto put = [&](const void* p, size_t n) {
    const auto* b = static_cast<const uint8_t*>(p);
    buf.insert(buf.end(), b, b + n);
  };
  put(&s.step, sizeof(s.step));
  for (const TensorSet* set : {&s.master, &s.m, &s.v})
    for (const auto& [name, v] : *set) {
      put(name.data(), name.size() + 1);
      const uint64_t h = xxh3_64(v.data(), v.size() * sizeof(float));
      put(&h, sizeof(h));
    }
  return xxh3_64(buf.data(), buf.size());
}

void ActGradCollector::operator()(const GradRecord& g) {
  ActGradDigests d;
  d.seq = g.seq;
  d.layer = g.layer;
  d.name = g.name;
  d.rows = g.rows;
  d.cols = g.cols;
  if (g.row_digests) {
    d.digests.assign(g.row_digests, g.row_digests + g.rows);
  } else {
    const float* v = g.values();
    d.digests.resize(static_cast<size_t>(g.rows));
    for (int64_t r = 0; r < g.rows; ++r)
      d.digests[size_t(r)] = xxh3_64(v + r * g.cols, size_t(g.cols) * sizeof(float));
  }
  out_.push_back(std::move(d));
}

TrainingRecord make_training_record(const Weights& before, const Weights& after, const OptimizerState& state,
                                    const TrainStepResult& res, const std::vector<TrainSample>& samples,
                                    const TrainStepOptions& o, const std::string& capture_params) {
  TrainingRecord t;
  t.settings_json = o.to_json();
  t.optimizer_step_before = state.step - 1;
  for (size_t i = 0; i < samples.size(); ++i) {
    const TrainSample& s = samples[i];
    SampleLossInputs in;
    in.id = s.id;
    in.prompt_length = int64_t(s.prompt.size());
    in.advantage = res.advantages[i];
    in.has_reward = s.reward.has_value();
    in.reward = s.reward.value_or(0.0);
    in.group = s.group;
    in.rollout_logprobs = s.rollout_logprobs;
    in.old_logprobs = s.old_logprobs;
    in.ref_logprobs = s.ref_logprobs;
    t.samples.push_back(std::move(in));
  }
  const LossMetrics& m = res.metrics;
  t.metrics = {{"loss", m.loss},
               {"pg_loss", m.pg_loss},
               {"kl", m.kl},
               {"clip_fraction", m.clip_fraction},
               {"ratio_mean", m.ratio_mean},
               {"ratio_min", m.ratio_min},
               {"ratio_max", m.ratio_max},
               {"tis_mean", m.tis_mean},
               {"mismatch_mean_abs", m.mismatch_mean_abs},
               {"mismatch_max_abs", m.mismatch_max_abs},
               {"mismatch_k3", m.mismatch_k3},
               {"tokens", double(m.tokens)},
               {"grad_norm", res.stats.grad_norm},
               {"clip_coef", res.stats.clip_coef},
               {"update_norm", res.stats.update_norm}};
  if (o.indexer_kl_coeff != 0) t.metrics["indexer_kl"] = res.indexer_kl;
  for (const auto& [name, wt] : before.tensors()) {
    if (wt.f.empty()) continue;  // integer tables are not trained
    ParamDigests p;
    p.name = name;
    p.rows = tensor_rows(wt);
    p.row_elems = int64_t(wt.f.size()) / std::max<int64_t>(p.rows, 1);
    const WeightTensor& nw = after.get(name);
    p.weight = tensor_row_digests(nw.f, p.rows);
    const auto g = res.grads.find(name);
    if (g != res.grads.end()) {
      p.grad = tensor_row_digests(g->second, p.rows);
      p.master = tensor_row_digests(state.master.at(name), p.rows);
      p.m = tensor_row_digests(state.m.at(name), p.rows);
      p.v = tensor_row_digests(state.v.at(name), p.rows);
      if (matches_any(name, capture_params)) t.full_grads[name] = g->second;
    }
    if (matches_any(name, capture_params)) t.full_weights[name] = nw.f;
    t.params.push_back(std::move(p));
  }
  return t;
}

TrainStepResult record_train_step(const Weights& w, const std::vector<TrainSample>& samples, OptimizerState& state,
                                  const TrainStepOptions& o, const TrainStepHooks& hooks, Weights* updated,
                                  const std::string& out, const RecordTrainOptions& ro) {
  TraceWriter::Options wo;
  wo.policy = CapturePolicy::parse(ro.capture);
  StepSpec spec;
  spec.kind = "train-step";
  spec.set_profile(o.profile);
  spec.seed = ro.seed;
  spec.threads = o.threads;
  for (const TrainSample& s : samples) spec.seqs.push_back(s.tokens());
  const uint64_t state_digest = optimizer_state_digest(state);
  const int64_t step_before = state.step;
  TraceHeader header = make_trace_header(w);
  if (o.experts) header.env[kEnvParallel] = parallel_layout(*o.experts);
  auto writer = ro.append ? TraceWriter::append(out, w.config(), header, wo)
                          : TraceWriter::create(out, w.config(), header, wo);
  std::vector<Observer*> targets{&writer->begin_step(spec)};
  if (hooks.observer) targets.push_back(hooks.observer);
  FanoutObserver fan(targets);
  ActGradCollector grads;
  TrainStepHooks h = hooks;
  h.observer = &fan;
  h.on_grad = [&](const GradRecord& g) {
    grads(g);
    if (hooks.on_grad) hooks.on_grad(g);
  };
  Weights after = w;
  TrainStepResult res = train_step(w, samples, state, o, h, &after);
  TrainingRecord t = make_training_record(w, after, state, res, samples, o, ro.capture_params);
  t.optimizer_step_before = step_before;
  t.optimizer_state_path = ro.optimizer_state_path;
  t.optimizer_state_digest = state_digest;
  t.act_grads = grads.take();
  writer->set_training(std::move(t));
  KernelRecords none;
  none.reason = o.device == Device::cuda ? "not recorded for training steps" : "recorded on the cpu";
  writer->set_kernel_records(std::move(none));
  ForwardResult fr;
  for (size_t i = 0; i < samples.size(); ++i) {
    SequenceResult sr;
    sr.tokens = spec.seqs[i];
    sr.logprobs = res.seq_logprobs[i];
    fr.seqs.push_back(std::move(sr));
  }
  writer->end_step(fr);
  writer->close();
  if (updated) *updated = std::move(after);
  return res;
}

}  // namespace dsv4::train
