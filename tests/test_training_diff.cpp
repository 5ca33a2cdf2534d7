// The diff of two training steps (replay/training_diff.h, through replay/diff.h): a step against an
// identical re-run is rel-L2 0 and cosine 1 everywhere; a step with forced rollout decisions (R3)
// against one without gives, per parameter and per (kind, layer) and per layer, the numbers computed
// here independently from the full gradients read back; with digests only the differing rows are still
// counted; the metrics and settings side by side; a training step against a non-training step, or
// steps of other samples, get a clear message; `dsv4 diff` prints and writes the training section.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <random>
#include <set>
#include <tuple>

#include "capture/trace_reader.h"
#include "capture/trace_writer.h"
#include "cli_util.h"
#include "model/error.h"
#include "model/forward.h"
#include "model/overrides.h"
#include "model/profile.h"
#include "replay/diff.h"
#include "replay/training_diff.h"
#include "test_util.h"
#include "train_test_util.h"
#include "tiny_model.h"
#include "train/record.h"

namespace dsv4 {
namespace {

using test::TempDir;
using train::TrainSample;

using test::make_sample;
const int kVocab = test::tiny().config().vocab_size;
using test::seq_tokens;

// A short sample and one of T = 80 > 4 * index_topk, so that the indexer selects in the C4 layers.
std::vector<TrainSample> samples() {
  return {make_sample("short", 5, 9, kVocab, 100, 1.25), make_sample("long", 30, 50, kVocab, 9, -0.75)};
}

// The decisions of a rollout-profile forward of the samples, as forced decisions (R3).
Overrides rollout_decisions(const std::vector<TrainSample>& s) {
  const ModelConfig& c = test::tiny().config();
  struct Log : Observer {
    std::map<std::pair<int, int>, std::vector<int32_t>> idx, exp;
    std::map<std::pair<int, int>, int> width;
    void on_indexer(const IndexerDecision& d) override {
      idx[{d.seq, d.layer}].assign(d.ids, d.ids + d.T * d.k);
      width[{d.seq, d.layer}] = d.k;
    }
    void on_routing(const RoutingDecision& d) override {
      if (!d.hashed) exp[{d.seq, d.layer}].assign(d.ids, d.ids + d.T * d.k);
    }
    bool wants_tensors() const override { return false; }
  } log;
  RunOptions ro;
  ro.profile = profile_by_name("rollout");
  ro.observer = &log;
  std::vector<std::vector<int32_t>> seqs;
  for (const auto& x : s) seqs.push_back(x.tokens());
  forward(test::tiny(), seqs, ro);
  Overrides ov;
  for (const auto& [key, ids] : log.idx)
    ov.force_indexer(key.first, key.second,
                     ForcedSelection{int64_t(ids.size()) / log.width[key], log.width[key], ids});
  for (const auto& [key, ids] : log.exp)
    ov.force_experts(
        key.first, key.second,
        ForcedSelection{int64_t(ids.size()) / c.num_experts_per_tok, c.num_experts_per_tok, ids});
  return ov;
}

struct StepVariant {
  bool r3 = false;
  double lr = 1e-3;
  std::string capture_params = "*";
  std::vector<TrainSample> samples = dsv4::samples();
};

void record(const std::string& path, const StepVariant& v) {
  const Weights& w = test::tiny();
  train::TrainStepOptions o;
  o.adamw.lr = v.lr;
  train::TrainStepHooks h;
  Overrides ov;
  if (v.r3) {
    ov = rollout_decisions(v.samples);
    h.decisions = &ov;
    o.decisions_source = "a rollout-profile forward";
    o.decisions_kinds = "indexer,routing";
  }
  train::OptimizerState st = train::fresh_optimizer_state(w, o.groups);
  Weights after = w;
  train::RecordTrainOptions ro;
  ro.capture_params = v.capture_params;
  ro.seed = 7;
  train::record_train_step(w, v.samples, st, o, h, &after, path, ro);
}

// The traces every test reads, recorded once.
// A plain (non-training) step of the given sequences.
void record_prefill(const std::string& path, const std::vector<std::vector<int32_t>>& seqs) {
  const Weights& w = test::tiny();
  auto wr = TraceWriter::create(path, w.config(), make_trace_header(w), TraceWriter::Options{});
  StepSpec spec;
  spec.seqs = seqs;
  RunOptions ro;
  ro.observer = &wr->begin_step(spec);
  wr->end_step(forward(w, spec.seqs, ro));
  wr->close();
}

struct Traces {
  TempDir dir;
  // a and a_again: the same step twice; r3: with the rollout's decisions forced; lr: another learning
  // rate and one advantage changed; moved: sample 1's first response token moved into its prompt;
  // prefill: the samples' tokens as a plain step, prefill_other: other tokens.
  std::string a, a_again, r3, lr, moved, prefill, prefill_other;
  Traces() {
    a = dir / "a.h5";
    a_again = dir / "a_again.h5";
    r3 = dir / "r3.h5";
    lr = dir / "lr.h5";
    moved = dir / "moved.h5";
    prefill = dir / "prefill.h5";
    prefill_other = dir / "prefill_other.h5";
    record(a, {});
    record(a_again, {});
    record(r3, {.r3 = true});
    StepVariant other;
    other.lr = 1e-4;
    other.samples[1].advantage = 0.5;
    other.capture_params = "";
    record(lr, other);
    StepVariant m;
    m.capture_params = "";
    std::vector<int32_t>& p = m.samples[1].prompt;
    std::vector<int32_t>& resp = m.samples[1].response;
    resp.insert(resp.begin(), p.back());
    p.pop_back();
    record(moved, m);
    std::vector<std::vector<int32_t>> seqs;
    for (const auto& s : dsv4::samples()) seqs.push_back(s.tokens());
    record_prefill(prefill, seqs);
    seqs[0][7] ^= 1;
    record_prefill(prefill_other, seqs);
  }
};

const Traces& traces() {
  static const Traces t;
  return t;
}

TrainingRecord training_of(const std::string& path) {
  const auto t = TraceReader::open(path).training(0);
  EXPECT_TRUE(t.has_value()) << path;
  return *t;
}

// Independent numbers of two gradient vectors (concatenated in the given order), in long double.
struct Ref {
  long double sq_a = 0, sq_b = 0, sq_d = 0, dot = 0, max_abs = 0;
  void add(const std::vector<float>& a, const std::vector<float>& b) {
    ASSERT_EQ(a.size(), b.size());
    for (size_t i = 0; i < a.size(); ++i) {
      const long double x = a[i], y = b[i];
      sq_a += x * x;
      sq_b += y * y;
      sq_d += (y - x) * (y - x);
      dot += x * y;
      max_abs = std::max(max_abs, std::fabs(y - x));
    }
  }
  double rel_l2() const { return double(std::sqrt(sq_d) / std::sqrt(sq_a)); }
  double cosine() const { return double(dot / (std::sqrt(sq_a) * std::sqrt(sq_b))); }
};

int64_t differing_rows(const std::vector<float>& a, const std::vector<float>& b, int64_t rows) {
  const size_t per = a.size() / size_t(rows);
  int64_t n = 0;
  for (int64_t r = 0; r < rows; ++r)
    n += std::memcmp(a.data() + size_t(r) * per, b.data() + size_t(r) * per, per * sizeof(float)) != 0;
  return n;
}

// Relative agreement of the library's fp64 sums with the long-double reference.
constexpr double kTol = 1e-9;

TEST(ParamSite, LayerKindAndExpertFromTheName) {
  const ParamSite e = param_site("model.layers.3.mlp.experts.5.down_proj.weight");
  EXPECT_EQ(e.layer, 3);
  EXPECT_EQ(e.expert, 5);
  EXPECT_EQ(e.kind, "mlp.experts.*.down_proj.weight");
  const ParamSite q = param_site("model.layers.12.self_attn.wq_a.weight");
  EXPECT_EQ(q.layer, 12);
  EXPECT_EQ(q.expert, -1);
  EXPECT_EQ(q.kind, "self_attn.wq_a.weight");
  const ParamSite sh = param_site("model.layers.0.mlp.shared_experts.up_proj.weight");
  EXPECT_EQ(sh.layer, 0);
  EXPECT_EQ(sh.expert, -1);
  EXPECT_EQ(sh.kind, "mlp.shared_experts.up_proj.weight");
  for (const char* model_level : {"lm_head.weight", "model.embed_tokens.weight", "model.hc_head_fn",
                                  "model.layers.03.self_attn.wkv.weight", "model.layers.x.attn_sink"}) {
    const ParamSite m = param_site(model_level);
    EXPECT_EQ(m.layer, -1) << model_level;
    EXPECT_EQ(m.kind, model_level);
  }
  // Every weight of a config: the layer prefix and the kind (expert index put back) give the name.
  for (const WeightSpec& s : weight_specs(preset("tiny"))) {
    const ParamSite p = param_site(s.name);
    std::string kind = p.kind;
    if (p.expert >= 0) kind.replace(kind.find('*'), 1, std::to_string(p.expert));
    EXPECT_EQ((p.layer >= 0 ? layer_prefix(p.layer) : std::string()) + kind, s.name);
    EXPECT_EQ(p.expert >= 0, s.name.find(".mlp.experts.") != std::string::npos) << s.name;
  }
}

TEST(TrainingDiff, IdenticalStepsAreEqualEverywhere) {
  const Traces& t = traces();
  const DiffReport r = diff_traces(t.a, t.a_again, DiffOptions{});
  ASSERT_TRUE(r.training.has_value());
  EXPECT_TRUE(r.training_note.empty());
  const TrainingDiff& d = *r.training;
  EXPECT_GT(d.params_trained, 100);
  EXPECT_EQ(d.params_full, d.params_trained);
  EXPECT_EQ(d.params_differing, 0);
  EXPECT_TRUE(d.settings.empty());
  EXPECT_TRUE(d.notes.empty());
  for (const ParamGradDiff& p : d.params) {
    EXPECT_EQ(p.rows_differing, 0) << p.name;
    EXPECT_EQ(p.weight_rows_differing, 0) << p.name;
    EXPECT_EQ(p.rel_l2, 0.0) << p.name;
    EXPECT_EQ(p.cosine, 1.0) << p.name;
    EXPECT_EQ(p.max_abs, 0.0) << p.name;
    EXPECT_EQ(p.norm_a, p.norm_b) << p.name;
  }
  for (const auto* v : {&d.cells, &d.layers})
    for (const GradAggregate& c : *v) {
      EXPECT_EQ(c.rel_l2, 0.0) << c.kind << " " << c.layer;
      EXPECT_EQ(c.cosine, 1.0) << c.kind << " " << c.layer;
      EXPECT_EQ(c.rows_differing, 0);
      EXPECT_EQ(c.params_differing, 0);
      EXPECT_EQ(c.full_params, c.params);
    }
  for (const MetricDiff& m : d.metrics) EXPECT_EQ(m.a, m.b) << m.name;
  // The untrained groups (indexer, router, expert bias) are listed without gradients.
  const auto router = std::find_if(d.params.begin(), d.params.end(), [](const ParamGradDiff& p) {
    return p.name == "model.layers.2.mlp.gate.weight";
  });
  ASSERT_NE(router, d.params.end());
  EXPECT_FALSE(router->grad_a || router->grad_b);
  EXPECT_EQ(d.cell("mlp.gate.weight", 2), nullptr);
}

TEST(TrainingDiff, ForcedDecisionsMatchAnIndependentComputation) {
  const Traces& t = traces();
  const DiffReport r = diff_traces(t.a, t.r3, DiffOptions{});
  ASSERT_TRUE(r.training.has_value());
  const TrainingDiff& d = *r.training;
  const TrainingRecord ra = training_of(t.a), rb = training_of(t.r3);
  ASSERT_GT(d.params_differing, 0) << "the rollout decisions change no gradient";

  // The settings say which step forced decisions; the metrics sit side by side.
  std::set<std::string> keys;
  for (const SettingDiff& s : d.settings) keys.insert(s.key);
  EXPECT_EQ(keys, (std::set<std::string>{"decisions_kinds", "decisions_source"}));
  bool saw_loss = false;
  for (const MetricDiff& m : d.metrics)
    if (m.name == "loss") {
      saw_loss = true;
      EXPECT_EQ(m.a, ra.metrics.at("loss"));
      EXPECT_EQ(m.b, rb.metrics.at("loss"));
    }
  EXPECT_TRUE(saw_loss);

  // Every parameter against the full gradients read back.
  int checked = 0;
  for (const ParamGradDiff& p : d.params) {
    if (!p.grad_a) continue;
    const auto& ga = ra.full_grads.at(p.name);
    const auto& gb = rb.full_grads.at(p.name);
    ASSERT_TRUE(p.full) << p.name;
    EXPECT_EQ(p.rows_differing, differing_rows(ga, gb, p.rows)) << p.name;
    Ref ref;
    ref.add(ga, gb);
    if (ref.sq_d == 0) {
      EXPECT_EQ(p.rel_l2, 0.0) << p.name;
      continue;
    }
    EXPECT_NEAR(p.rel_l2, ref.rel_l2(), kTol * ref.rel_l2()) << p.name;
    EXPECT_NEAR(p.cosine, ref.cosine(), kTol) << p.name;
    EXPECT_EQ(p.max_abs, double(ref.max_abs)) << p.name;
    EXPECT_NEAR(p.norm_a, double(std::sqrt(ref.sq_a)), kTol * double(std::sqrt(ref.sq_a))) << p.name;
    ++checked;
  }
  EXPECT_GT(checked, 10);

  // A (kind, layer) cell: every routed expert of the layer, concatenated in name order.
  const ModelConfig& c = test::tiny().config();
  const int layer = 3;  // learned routing
  const GradAggregate* cell = d.cell("mlp.experts.*.down_proj.weight", layer);
  ASSERT_NE(cell, nullptr);
  EXPECT_EQ(cell->params, c.n_routed_experts);
  EXPECT_EQ(cell->full_params, c.n_routed_experts);
  std::map<std::string, int> names;  // name order, as the record keeps them
  for (int e = 0; e < c.n_routed_experts; ++e)
    names[layer_prefix(layer) + "mlp.experts." + std::to_string(e) + ".down_proj.weight"] = e;
  Ref ref;
  int64_t rows = 0, differing = 0;
  for (const auto& [name, e] : names) {
    ref.add(ra.full_grads.at(name), rb.full_grads.at(name));
    const int64_t R = c.hidden_size;  // down_proj is [D, I]
    rows += R;
    differing += differing_rows(ra.full_grads.at(name), rb.full_grads.at(name), R);
  }
  EXPECT_EQ(cell->rows, rows);
  EXPECT_EQ(cell->rows_differing, differing);
  ASSERT_GT(ref.sq_d, 0) << "layer 3's experts: no gradient changed";
  EXPECT_NEAR(cell->rel_l2, ref.rel_l2(), kTol * ref.rel_l2());
  EXPECT_NEAR(cell->cosine, ref.cosine(), kTol);
  EXPECT_EQ(cell->max_abs, double(ref.max_abs));

  // A layer: every parameter trained in both steps whose name has the layer's prefix.
  for (const GradAggregate& L : d.layers) {
    Ref lr;
    int params = 0;
    for (const auto& [name, g] : ra.full_grads) {
      const bool in_layer =
          L.layer >= 0 ? name.rfind(layer_prefix(L.layer), 0) == 0 : name.rfind("model.layers.", 0) != 0;
      if (!in_layer) continue;
      lr.add(g, rb.full_grads.at(name));
      ++params;
    }
    EXPECT_EQ(L.params, params) << L.layer;
    if (lr.sq_d == 0) {
      EXPECT_EQ(L.rel_l2, 0.0) << L.layer;
    } else {
      EXPECT_NEAR(L.rel_l2, lr.rel_l2(), kTol * lr.rel_l2()) << L.layer;
      EXPECT_NEAR(L.cosine, lr.cosine(), kTol) << L.layer;
    }
  }
  EXPECT_EQ(d.layers.front().layer, -1);
  EXPECT_EQ(int(d.layers.size()), c.num_hidden_layers + 1);
  // The kinds: those of the layers first, ascending, then the model-level weights.
  const auto split = std::find(d.kinds.begin(), d.kinds.end(), "lm_head.weight");
  ASSERT_NE(split, d.kinds.end());
  EXPECT_TRUE(std::is_sorted(d.kinds.begin(), split));
  EXPECT_TRUE(std::is_sorted(split, d.kinds.end()));
  EXPECT_EQ(d.kinds.back(), "model.norm.weight");
  for (auto k = d.kinds.begin(); k != d.kinds.end(); ++k)
    for (const GradAggregate& cl : d.cells)
      if (cl.kind == *k) {
        EXPECT_EQ(cl.layer >= 0, k < split) << *k;
      }
  EXPECT_NE(std::find(d.kinds.begin(), split, "mlp.experts.*.gate_proj.weight"), split);
  EXPECT_EQ(int(std::count(d.kinds.begin(), d.kinds.end(), "self_attn.wq_a.weight")), 1);
}

TEST(TrainingDiff, DigestsAloneCountDifferingRows) {
  const Traces& t = traces();
  const DiffReport full = diff_traces(t.a, t.r3, DiffOptions{});
  // The same records keeping only lm_head.weight in full (as `--capture-params lm_head.weight` would).
  TrainingRecord ra = training_of(t.a), rb = training_of(t.r3);
  for (TrainingRecord* r : {&ra, &rb})
    std::erase_if(r->full_grads, [](const auto& kv) { return kv.first != "lm_head.weight"; });
  const std::optional<TrainingDiff> dig = training_gradient_diff(ra, rb);
  ASSERT_TRUE(full.training);
  ASSERT_EQ(full.training->params.size(), dig->params.size());
  EXPECT_EQ(dig->params_full, 1);  // lm_head.weight
  EXPECT_EQ(dig->params_differing, full.training->params_differing);
  for (size_t i = 0; i < full.training->params.size(); ++i) {
    const ParamGradDiff &f = full.training->params[i], &g = dig->params[i];
    ASSERT_EQ(f.name, g.name);
    EXPECT_EQ(f.rows_differing, g.rows_differing) << f.name;
    if (!g.grad_a || g.name == "lm_head.weight") continue;
    EXPECT_FALSE(g.full) << g.name;
    if (g.rows_differing == 0) {
      EXPECT_EQ(g.rel_l2, 0.0) << g.name;
      EXPECT_EQ(g.cosine, 1.0) << g.name;
    } else {
      EXPECT_TRUE(std::isnan(g.rel_l2) && std::isnan(g.cosine)) << g.name;
    }
  }
  const ParamGradDiff& head =
      *std::find_if(dig->params.begin(), dig->params.end(),
                    [](const ParamGradDiff& p) { return p.name == "lm_head.weight"; });
  EXPECT_TRUE(head.full);
  EXPECT_GT(head.rows_differing, 0);
  EXPECT_GT(head.rel_l2, 0.0);
  // A cell without full gradients whose rows differ is unknown; the rows still add up.
  ASSERT_EQ(dig->cells.size(), full.training->cells.size());
  for (size_t i = 0; i < dig->cells.size(); ++i) {
    const GradAggregate& c = dig->cells[i];
    EXPECT_EQ(c.rows_differing, full.training->cells[i].rows_differing);
    if (c.kind == "lm_head.weight") continue;
    EXPECT_EQ(c.full_params, 0);
    EXPECT_EQ(std::isnan(c.rel_l2), c.rows_differing > 0) << c.kind << " " << c.layer;
  }
}

TEST(TrainingDiff, OtherLearningRateAndAdvantageAreNamed) {
  const Traces& t = traces();
  const DiffReport r = diff_traces(t.a, t.lr, DiffOptions{});
  ASSERT_TRUE(r.training.has_value());
  const TrainingDiff& d = *r.training;
  ASSERT_EQ(d.settings.size(), 1u);
  EXPECT_EQ(d.settings[0].key, "adamw.lr");
  ASSERT_EQ(d.notes.size(), 1u);
  EXPECT_NE(d.notes[0].find("sample 1 ('long'): advantage -0.75 in A, 0.5 in B"), std::string::npos)
      << d.notes[0];
  EXPECT_GT(d.params_differing, 0);
}

TEST(TrainingDiff, NonTrainingStepsAndOtherSamplesGetAMessage) {
  const Traces& t = traces();
  // One training step: the forward is compared as for any two steps; the note says why no gradients.
  for (const auto& [a, b, who] :
       {std::tuple{t.lr, t.prefill, "only A"}, std::tuple{t.prefill, t.lr, "only B"}}) {
    const DiffReport r = diff_traces(a, b, DiffOptions{});
    EXPECT_FALSE(r.training.has_value());
    EXPECT_NE(r.training_note.find(who), std::string::npos) << r.training_note;
    EXPECT_NE(r.training_note.find("kind 'train'"), std::string::npos) << r.training_note;
    EXPECT_NE(diff_to_table(r).find(r.training_note), std::string::npos);
    EXPECT_EQ(nlohmann::json::parse(diff_to_json(r))["training"], nullptr);
    EXPECT_FALSE(r.tensors.empty());
  }
  // Two plain steps: no note at all, and the report is what it always was.
  const DiffReport plain = diff_traces(t.prefill, t.prefill, DiffOptions{});
  EXPECT_FALSE(plain.training.has_value());
  EXPECT_TRUE(plain.training_note.empty());
  EXPECT_EQ(diff_to_table(plain).find("training"), std::string::npos);

  // The same tokens split into another prompt and response: refused, naming the sample.
  try {
    diff_traces(t.lr, t.moved, DiffOptions{});
    FAIL() << "no error";
  } catch (const InputError& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("different samples: sample 1 ('long') has a prompt of 30 tokens in A and 29 in B"),
              std::string::npos)
        << m;
    EXPECT_NE(m.find(t.lr), std::string::npos) << m;
  }
  // Other tokens: the diff's rule for any two steps.
  try {
    diff_traces(t.lr, t.prefill_other, DiffOptions{});
    FAIL() << "no error";
  } catch (const InputError& e) {
    EXPECT_NE(std::string(e.what()).find("different tokens: sequence 0 differs at position 7"),
              std::string::npos)
        << e.what();
  }
  // The records alone: another sample count.
  TrainingRecord ra = training_of(t.a), rb = ra;
  rb.samples.pop_back();
  EXPECT_THROW(training_gradient_diff(ra, rb), InputError);
}

TEST(TrainingDiff, JsonAndCsvCarryTheTrainingSection) {
  const Traces& t = traces();
  const DiffReport r = diff_traces(t.a, t.r3, DiffOptions{});
  const auto j = nlohmann::json::parse(diff_to_json(r));
  const auto& tr = j["training"];
  ASSERT_TRUE(tr.is_object());
  EXPECT_EQ(tr["params_differing"], r.training->params_differing);
  EXPECT_EQ(tr["params"].size(), r.training->params.size());
  EXPECT_EQ(tr["cells"].size(), r.training->cells.size());
  EXPECT_EQ(tr["layers"].size(), r.training->layers.size());
  EXPECT_EQ(tr["kinds"].size(), r.training->kinds.size());
  for (const auto& p : tr["params"])
    if (p["name"] == "lm_head.weight") {
      EXPECT_EQ(p["layer"], -1);
      EXPECT_EQ(p["full"], true);
      EXPECT_TRUE(p["rel_l2"].is_number());
    }
  EXPECT_EQ(j["training_note"], "");
  TempDir d;
  diff_to_csv(r, d / "csv");
  std::ifstream g(d / "csv/gradients.csv"), c(d / "csv/gradient_cells.csv");
  std::string line;
  int n = 0;
  while (std::getline(g, line)) ++n;
  EXPECT_EQ(n, int(r.training->params.size()) + 1);
  n = 0;
  while (std::getline(c, line)) ++n;
  EXPECT_EQ(n, int(r.training->cells.size()) + 1);
}

// `dsv4 diff` of two recorded training steps: the table's training section, --json, and exit 2 for
// steps of other samples.
TEST(TrainingDiffCli, PrintsTheTrainingSection) {
  const Traces& t = traces();
  TempDir d;
  auto r = test::run_cli("diff " + t.a + " " + t.r3 + " --json " + (d / "diff.json"));
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("training steps: the gradients of B against A"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("setting decisions_kinds: \"\" in A, \"indexer,routing\" in B"), std::string::npos)
      << r.out;
  EXPECT_NE(r.out.find("parameter (largest rel_l2 first)"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("grad_norm"), std::string::npos) << r.out;
  // The largest rel-L2 is the first row of the table.
  const DiffReport rep = diff_traces(t.a, t.r3, DiffOptions{});
  const ParamGradDiff* worst = nullptr;
  for (const auto& p : rep.training->params)
    if (p.grad_a && p.rows_differing > 0 && (!worst || p.rel_l2 > worst->rel_l2)) worst = &p;
  ASSERT_NE(worst, nullptr);
  const size_t head = r.out.find("parameter (largest rel_l2 first)");
  const size_t first_row = r.out.find('\n', head) + 1;
  EXPECT_EQ(r.out.compare(first_row + 2, worst->name.size(), worst->name), 0) << r.out.substr(first_row, 120);
  std::ifstream f(d / "diff.json");
  const auto j = nlohmann::json::parse(f);
  EXPECT_EQ(j["training"]["params_differing"], rep.training->params_differing);

  r = test::run_cli("diff " + t.lr + " " + t.lr);
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("every gradient row agrees"), std::string::npos) << r.out;

  r = test::run_cli("diff " + t.lr + " " + t.prefill);
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("is a training step; B"), std::string::npos) << r.out;

  r = test::run_cli("diff " + t.lr + " " + t.moved);
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_NE(r.out.find("different samples: sample 1 ('long')"), std::string::npos) << r.out;
}

}  // namespace
}  // namespace dsv4
