// Writes a small trace of the tiny preset (seed 7) for tests that read traces with other tools:
//   make_sample_trace OUT.h5                two complete steps (train, rollout profiles), sequences of
//                                           1, 9 and 70 tokens, capture "attn.q@1,indexer.*,logits"
//   make_sample_trace OUT.h5 --die-in-step  one complete step, then SIGKILL in the middle of the
//                                           second (what a crashed recorder leaves)
//   make_sample_trace OUT.h5 --train-step   the two steps, then a step of kind "train-step" over the
//                                           same sequences with a training record (format version 3)
//                                           whose values are made up but follow every rule of the format
//   make_sample_trace OUT.h5 --external     one external step (format version 4) of engine "sample":
//                                           the decisions of a forward over the same sequences, laid out
//                                           as engines report them (T - 1 rows of the index_topk width,
//                                           ids in reverse order) for the first two sequences and with a
//                                           row per token, routing weights, log-probs and a bf16 tensor
//                                           for the third; the first holds no log-probs
#include <csignal>
#include <cstdio>
#include <cstring>
#include <exception>

#include "capture/digest.h"
#include "capture/external.h"
#include "capture/layout.h"
#include "capture/trace_writer.h"
#include "capture/training.h"
#include "model/collect.h"
#include "model/forward.h"
#include "model/tokens.h"
#include "model/weights.h"

namespace {

using namespace dsv4;

// A record for `seqs` (prompts of a third of each sequence): every float tensor of the model with its
// real shape, weight digests of its actual rows and made-up digests for the rest (integer tensors not
// trained), an activation gradient per sequence and layer 0 plus one model-level, a full gradient and
// a full weight.
TrainingRecord sample_record(const Weights& w, const std::vector<std::vector<int32_t>>& seqs) {
  TrainingRecord t;
  t.settings_json = R"({"loss":"grpo","adamw":{"lr":1e-06}})";
  t.optimizer_step_before = 3;
  t.optimizer_state_path = "optimizer-000003.state";
  t.optimizer_state_digest = 0x8000000000000001ull;
  t.metrics = {{"loss", 0.5}, {"kl", 0.01}, {"grad_norm", 2.0}, {"clip_fraction", 0.0}};
  uint64_t made_up = 1;
  const auto digests = [&](int64_t n) {
    std::vector<uint64_t> v(static_cast<size_t>(n));
    for (auto& x : v) x = xxh3_64(&++made_up, sizeof made_up);
    return v;
  };
  for (size_t i = 0; i < seqs.size(); ++i) {
    SampleLossInputs s;
    const int64_t T = int64_t(seqs[i].size()), P = (T + 2) / 3, R = T - P;
    s.id = "sample-" + std::to_string(i);
    s.prompt_length = P;
    s.advantage = i % 2 ? -0.5 : 0.5;
    s.reward = double(i);
    s.has_reward = i != 1;
    s.group = "g" + std::to_string(i / 2);
    for (int64_t j = 0; j < R; ++j) {
      s.rollout_logprobs.push_back(-0.25f * float(j + 1));
      if (i != 2) s.old_logprobs.push_back(-0.5f * float(j + 1));
    }
    t.samples.push_back(std::move(s));
    for (const char* name : {"grad.attn.o", "grad.ffn.out"})
      t.act_grads.push_back({int(i), 0, name, T, 16, digests(T)});
    t.act_grads.push_back({int(i), -1, "grad.embed", T, w.config().hidden_size, digests(T)});
  }
  for (const std::string& name : make_trace_header(w).model.names) {
    const WeightTensor& x = w.get(name);
    ParamDigests p;
    p.name = name;
    const int64_t numel = int64_t(x.f.size() + x.i.size());
    p.rows = x.shape.size() >= 2 ? x.shape[0] : 1;  // a 1-D tensor is one row
    p.row_elems = p.rows > 0 ? numel / p.rows : 0;
    if (!x.f.empty()) {
      for (int64_t r = 0; r < p.rows; ++r)
        p.weight.push_back(xxh3_64(x.f.data() + r * p.row_elems, size_t(p.row_elems) * sizeof(float)));
      p.grad = digests(p.rows);
      p.master = digests(p.rows);
      p.m = digests(p.rows);
      p.v = digests(p.rows);
    }
    t.params.push_back(std::move(p));
  }
  const WeightTensor& norm = w.get("model.norm.weight");
  t.full_weights["model.norm.weight"] = norm.f;
  t.full_grads["model.norm.weight"] = std::vector<float>(norm.f.size(), 0.125f);
  return t;
}

// The external step of --external (see the usage above).
void write_external(const std::string& path, const Weights& w, const std::vector<std::vector<int32_t>>& seqs) {
  DecisionLog log;
  RunOptions o;
  o.threads = 1;
  o.observer = &log;
  const ForwardResult fr = forward(w, seqs, o);
  const ModelConfig& c = w.config();
  ExternalModel m;
  m.config_json = config_to_json(c);
  auto writer = ExternalTraceWriter::create(path, m);
  ExternalStepSpec spec;
  spec.engine = "sample";
  spec.source = "make_sample_trace";
  writer->begin_step(spec);
  for (int s = 0; s < int(seqs.size()); ++s) {
    const bool engine_layout = s < 2;
    ExternalSequence e;
    e.id = "request-" + std::to_string(s);
    e.tokens = seqs[size_t(s)];
    const int64_t T = int64_t(e.tokens.size()), R = engine_layout ? T - 1 : T;
    e.prompt_length = (T + 1) / 2;
    if (s > 0) e.logprobs = fr.seqs[size_t(s)].logprobs;
    for (int layer = 0; layer < c.num_hidden_layers; ++layer) {
      const RoutingRecord& rt = log.routing.at({s, layer});
      ExternalRouting x{layer, R, rt.k, {}, {}};
      for (int64_t t = 0; t < R; ++t)
        for (int j = 0; j < rt.k; ++j) {
          const int jj = engine_layout ? rt.k - 1 - j : j;
          x.ids.push_back(rt.ids[size_t(t * rt.k + jj)]);
          if (!engine_layout) x.weights.push_back(rt.weights[size_t(t * rt.k + jj)]);
        }
      e.routing.push_back(std::move(x));
      if (c.ratio(layer) != 4) continue;
      const IndexerRecord& ix = log.indexer.at({s, layer});
      const int width = engine_layout ? c.index_topk : ix.k;
      ExternalIndexer y{layer, R, width, std::vector<int32_t>(size_t(R * width), -1), nullptr};
      for (int64_t t = 0; t < R; ++t)
        for (int j = 0; j < ix.k; ++j) y.ids[size_t(t * width + (engine_layout ? ix.k - 1 - j : j))] = ix.ids[size_t(t * ix.k + j)];
      e.indexer.push_back(std::move(y));
    }
    if (!engine_layout) {
      ExternalTensor h{"engine.hidden", 0, DType::bf16, {T, 4}, {}, {}};
      for (int64_t i = 0; i < T * 4; ++i) h.f.push_back(float(i % 7) * 0.5f);
      e.tensors.push_back(std::move(h));
    }
    writer->add_sequence(e);
  }
  writer->end_step();
  writer->close();
}

}  // namespace

int main(int argc, char** argv) {
  using namespace dsv4;
  const bool die = argc == 3 && std::strcmp(argv[2], "--die-in-step") == 0;
  const bool train_step = argc == 3 && std::strcmp(argv[2], "--train-step") == 0;
  const bool external = argc == 3 && std::strcmp(argv[2], "--external") == 0;
  if (argc < 2 || argc > 3 || (argc == 3 && !die && !train_step && !external)) {
    std::fprintf(stderr, "usage: %s OUT.h5 [--die-in-step | --train-step | --external]\n", argv[0]);
    return 2;
  }
  try {
    const Weights w = Weights::init(preset("tiny"), 7);
    if (external) {
      const int vocab = w.config().vocab_size;
      write_external(argv[1], w, {random_tokens(1, vocab, 1), random_tokens(9, vocab, 2), random_tokens(70, vocab, 3)});
      return 0;
    }
    TraceWriter::Options opt;
    opt.policy = CapturePolicy::parse("attn.q@1,indexer.*,logits");
    auto writer = TraceWriter::create(argv[1], w.config(), make_trace_header(w), opt);
    const int vocab = w.config().vocab_size;
    const std::vector<std::vector<int32_t>> seqs = {random_tokens(1, vocab, 1), random_tokens(9, vocab, 2),
                                                    random_tokens(70, vocab, 3)};
    for (int step = 0; step < (train_step ? 3 : 2); ++step) {
      StepSpec s;
      s.kind = step == 0 ? "train" : step == 1 ? "rollout" : trace_layout::kKindTrainStep;
      s.profile = step == 1 ? "rollout" : "train";
      s.seed = uint64_t(step);
      s.threads = 1;
      s.seqs = seqs;
      RunOptions o;
      o.profile = step == 1 ? profile_rollout() : profile_train();
      o.threads = 1;
      o.observer = &writer->begin_step(s);
      const ForwardResult r = forward(w, seqs, o);
      if (die && step == 1) {
        writer->flush();  // step 0 complete and step 1 laid out on disk, as a recorder killed later leaves them
        std::raise(SIGKILL);
      }
      if (step == 2) writer->set_training(sample_record(w, seqs));
      writer->end_step(r);
    }
    writer->close();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "make_sample_trace: %s\n", e.what());
    return 1;
  }
  return 0;
}
