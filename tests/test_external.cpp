// External steps (capture/external.h): decisions another engine computed, written through
// ExternalTraceWriter and read back through TraceReader; diffed against a step of ours, forced into our
// model, refused by replay; every bad input named with its request, layer and row; row slices equal the
// rows of the whole.
#include <gtest/gtest.h>

#include <filesystem>
#include <map>
#include <string>
#include <vector>

#include "capture/errors.h"
#include "capture/external.h"
#include "capture/layout.h"
#include "capture/policy.h"
#include "capture/trace_reader.h"
#include "capture/trace_writer.h"
#include "capture/validate.h"
#include "model/config.h"
#include "model/decision_sets.h"
#include "model/forward.h"
#include "model/profile.h"
#include "model/tokens.h"
#include "replay/diff.h"
#include "replay/replay.h"
#include "test_util.h"
#include "tiny_model.h"

namespace dsv4 {
namespace {

namespace fs = std::filesystem;
using test::TempDir;
using test::tiny;

std::vector<std::vector<int32_t>> batch() { return {random_tokens(70, 512, 31), random_tokens(33, 512, 32)}; }

// A train step of ours over batch(), capture 'full' (so full tensors can be sliced).
void record_ours(const std::string& path) {
  TraceWriter::Options o;
  o.policy = CapturePolicy::parse("full");
  auto tw = TraceWriter::create(path, tiny().config(), make_trace_header(tiny()), o);
  StepSpec s;
  s.seqs = batch();
  RunOptions ro;
  ro.profile = profile_by_name("train");
  ro.threads = 1;
  ro.observer = &tw->begin_step(s);
  tw->end_step(forward(tiny(), s.seqs, ro));
  tw->close();
}

ExternalModel tiny_model_unknown_weights() {
  ExternalModel m;
  m.config_json = config_to_json(tiny().config());
  return m;
}

// What an engine would report for sequence `s` of our step: every layer's routing (hash layers included)
// and every C4 layer's indexer, in the engines' layout — T − 1 rows, the full index_topk width padded
// with −1, the ids of a row in reverse order (engines report score order, not sets).
ExternalSequence engine_view(const TraceReader& r, int s, bool with_logprobs) {
  const ModelConfig c = r.config();
  ExternalSequence e;
  e.id = "req-" + std::to_string(s);
  e.tokens = r.tokens(0, s);
  const int64_t T = int64_t(e.tokens.size());
  if (with_logprobs) e.logprobs = r.logprobs(0, s);
  for (int layer = 0; layer < c.num_hidden_layers; ++layer) {
    const RoutingRecord rt = *r.routing(0, s, layer);
    ExternalRouting x;
    x.layer = layer;
    x.rows = T - 1;
    x.k = rt.k;
    for (int64_t t = 0; t < T - 1; ++t)
      for (int j = rt.k - 1; j >= 0; --j) x.ids.push_back(rt.ids[size_t(t * rt.k + j)]);
    e.routing.push_back(x);
    if (c.ratio(layer) != 4) continue;
    const IndexerRecord ix = *r.indexer(0, s, layer);
    ExternalIndexer y;
    y.layer = layer;
    y.rows = T - 1;
    y.width = c.index_topk;
    for (int64_t t = 0; t < T - 1; ++t) {
      std::vector<int32_t> row = valid_ids(ix.ids, ix.k, t);
      std::reverse(row.begin(), row.end());
      row.resize(size_t(c.index_topk), -1);
      y.ids.insert(y.ids.end(), row.begin(), row.end());
    }
    e.indexer.push_back(y);
  }
  return e;
}

struct Pair {
  TempDir dir;
  std::string ours = dir / "ours.h5", theirs = dir / "theirs.h5";
};

// Ours, and an external trace of the same decisions (sequence 0 with log-probs, sequence 1 without).
std::unique_ptr<Pair> make_pair(const std::function<void(ExternalSequence&)>& edit = {}) {
  auto p = std::make_unique<Pair>();
  record_ours(p->ours);
  const TraceReader r = TraceReader::open(p->ours);
  auto w = ExternalTraceWriter::create(p->theirs, tiny_model_unknown_weights());
  ExternalStepSpec spec;
  spec.engine = "sglang";
  spec.source = "responses.jsonl";
  w->begin_step(spec);
  for (int s = 0; s < 2; ++s) {
    ExternalSequence e = engine_view(r, s, s == 0);
    if (s == 0 && edit) edit(e);
    w->add_sequence(e);
  }
  w->end_step();
  w->close();
  return p;
}

TEST(ExternalSteps, RoundTripAsSets) {
  auto p = make_pair();
  const TraceReader ours = TraceReader::open(p->ours), theirs = TraceReader::open(p->theirs);
  EXPECT_EQ(theirs.format_version(), kExternalFormatVersion);
  EXPECT_EQ(theirs.model().model_digest, trace_layout::kUnknownDigest);
  const auto steps = theirs.steps();
  ASSERT_EQ(steps.size(), 1u);
  EXPECT_TRUE(steps[0].complete);
  EXPECT_TRUE(steps[0].external());
  EXPECT_EQ(steps[0].engine, "sglang");
  EXPECT_EQ(steps[0].source, "responses.jsonl");
  EXPECT_EQ(steps[0].capture, trace_layout::kExternalCapture);
  EXPECT_EQ(steps[0].seq_lengths, (std::vector<int64_t>{70, 33}));
  EXPECT_EQ(theirs.seal().state, SealCheck::State::verified);
  const ModelConfig c = tiny().config();
  for (int s = 0; s < 2; ++s) {
    EXPECT_EQ(theirs.sequence_id(0, s), "req-" + std::to_string(s));
    EXPECT_EQ(theirs.tokens(0, s), ours.tokens(0, s));
    EXPECT_EQ(theirs.has_logprobs(0, s), s == 0);
    if (s == 0) EXPECT_TRUE(test::bitwise_equal(theirs.logprobs(0, s), ours.logprobs(0, s)));
    else EXPECT_THROW(theirs.logprobs(0, s), TraceError);
    const int64_t T = int64_t(ours.tokens(0, s).size());
    for (int layer = 0; layer < c.num_hidden_layers; ++layer) {
      const RoutingRecord a = *ours.routing(0, s, layer), b = *theirs.routing(0, s, layer);
      ASSERT_EQ(b.T, T - 1);
      EXPECT_EQ(b.hashed, c.is_hash_layer(layer));
      EXPECT_TRUE(b.weights.empty());
      EXPECT_TRUE(b.margin.empty());
      for (int64_t t = 0; t < T - 1; ++t) EXPECT_EQ(valid_ids(a.ids, a.k, t), valid_ids(b.ids, b.k, t));
      if (c.ratio(layer) != 4) {
        EXPECT_FALSE(theirs.indexer(0, s, layer));
        continue;
      }
      const IndexerRecord x = *ours.indexer(0, s, layer), y = *theirs.indexer(0, s, layer);
      ASSERT_EQ(y.T, T - 1);
      EXPECT_EQ(y.k, c.indexer_width(T));  // stored at the runtime's width: the padding held only -1
      EXPECT_TRUE(y.margin.empty());
      for (int64_t t = 0; t < T - 1; ++t) EXPECT_EQ(valid_ids(x.ids, x.k, t), valid_ids(y.ids, y.k, t)) << t;
    }
  }
}

TEST(ExternalSteps, RowSlicesEqualTheRowsOfTheWhole) {
  auto p = make_pair();
  for (const std::string& path : {p->ours, p->theirs}) {
    const TraceReader r = TraceReader::open(path);
    const ModelConfig c = r.config();
    for (int layer = 0; layer < c.num_hidden_layers; ++layer) {
      const auto whole = r.routing(0, 0, layer);
      const auto part = r.routing_rows(0, 0, layer, 5, 12);
      ASSERT_EQ(part->T, 7);
      EXPECT_EQ(part->ids, std::vector<int32_t>(whole->ids.begin() + 5 * whole->k, whole->ids.begin() + 12 * whole->k));
      if (c.ratio(layer) != 4) continue;
      const auto iw = r.indexer(0, 0, layer);
      for (auto [a, b] : {std::pair<int64_t, int64_t>{0, 1}, {17, 40}, {60, 1000}}) {
        const auto ip = r.indexer_rows(0, 0, layer, a, b);
        const int64_t end = std::min(b, iw->T);
        ASSERT_EQ(ip->T, end - a);
        EXPECT_EQ(ip->ids, std::vector<int32_t>(iw->ids.begin() + a * iw->k, iw->ids.begin() + end * iw->k));
        if (!iw->margin.empty()) {
          EXPECT_EQ(ip->margin, std::vector<float>(iw->margin.begin() + a, iw->margin.begin() + end));
        }
      }
      EXPECT_THROW(r.indexer_rows(0, 0, layer, 500, 600), TraceError);
    }
  }
  const TraceReader r = TraceReader::open(p->ours);
  const auto whole = r.tensor(0, 0, 2, "attn.q");
  const auto part = r.tensor_rows(0, 0, 2, "attn.q", 3, 9);
  ASSERT_TRUE(whole && part);
  ASSERT_EQ(part->shape[0], 6);
  const size_t row = size_t(whole->f.size() / size_t(whole->shape[0]));
  EXPECT_TRUE(test::bitwise_equal(part->f, std::vector<float>(whole->f.begin() + 3 * row, whole->f.begin() + 9 * row)));
}

TEST(ExternalSteps, DiffAgainstOursAgreesAndFindsAnEditedRow) {
  {
    auto p = make_pair();
    const DiffReport d = diff_traces(p->ours, p->theirs, {});
    for (const LayerDiff& L : d.layers) {
      EXPECT_EQ(L.indexer_rows_differing, 0) << L.layer;
      EXPECT_EQ(L.routing_rows_differing, 0) << L.layer;
    }
    EXPECT_TRUE(d.tensors.empty());
    EXPECT_EQ(d.logprob_abs_max, 0.0);                  // sequence 0 carries our own log-probs
    EXPECT_EQ(d.tokens.size(), size_t(70 - 1));          // sequence 1 has none: left out, and said so
    bool noted_external = false, noted_weights = false;
    for (const auto& n : d.notes) {
      noted_external |= n.find("external step (engine 'sglang')") != std::string::npos;
      noted_weights |= n.find("does not name its weights") != std::string::npos;
    }
    EXPECT_TRUE(noted_external);
    EXPECT_TRUE(noted_weights);
  }
  // One expert of one row of a learned layer swapped for another: exactly that row differs, a
  // confident flip (the engine reported no margin; ours decides).
  const ModelConfig c = tiny().config();
  const int layer = c.num_hash_layers;  // the first learned layer
  const int64_t row = 21;
  auto p = make_pair([&](ExternalSequence& e) {
    ExternalRouting& x = e.routing[size_t(layer)];
    std::set<int32_t> used(x.ids.begin() + row * x.k, x.ids.begin() + (row + 1) * x.k);
    int32_t other = 0;
    while (used.count(other)) ++other;
    x.ids[size_t(row * x.k)] = other;
  });
  const DiffReport d = diff_traces(p->ours, p->theirs, {});
  EXPECT_EQ(d.layers[size_t(layer)].routing_rows_differing, 1);
  EXPECT_EQ(d.layers[size_t(layer)].routing_tie_flips + d.layers[size_t(layer)].routing_confident_flips, 1);
  for (const LayerDiff& L : d.layers)
    if (L.layer != layer) {
      EXPECT_EQ(L.routing_rows_differing, 0) << L.layer;
    }
}

TEST(ExternalSteps, ForcedIntoOurModelTheirOwnDecisionsChangeNoLogProb) {
  // Our decisions, reported the engines' way (T − 1 rows): forcing them completes the last row, which
  // predicts nothing, so every log-prob is the recorded one, bit for bit.
  auto p = make_pair();
  ReplayOptions o;
  o.take_decisions_from = p->theirs;
  o.threads = 1;
  const ReplayReport rep = replay_trace(p->ours, o);
  ASSERT_EQ(rep.steps.size(), 1u);
  const StepReplay& s = rep.steps[0];
  EXPECT_EQ(s.counterfactual_decisions_equal, true);
  ASSERT_TRUE(s.mean_abs_dlogprob_forced);
  EXPECT_EQ(*s.mean_abs_dlogprob_forced, 0.0);
  EXPECT_EQ(*s.mean_logprob_forced, *s.mean_logprob_recorded);
  EXPECT_FALSE(s.mean_abs_dlogprob_before);  // sequence 1 of theirs holds no log-probs
  EXPECT_NE(s.counterfactual_source.find("engine sglang"), std::string::npos);
  EXPECT_NE(replay_to_json(rep).find("\"mean_abs_dlogprob_forced\": 0.0"), std::string::npos);
}

TEST(ExternalSteps, ReplayRefusesThem) {
  auto p = make_pair();
  try {
    replay_trace(p->theirs, {});
    FAIL() << "replayed an external step";
  } catch (const InputError& e) {
    EXPECT_NE(std::string(e.what()).find("external step"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("--take-decisions-from"), std::string::npos) << e.what();
  }
  ReplayOptions o;
  o.step = 0;
  EXPECT_THROW(replay_trace(p->theirs, o), InputError);
}

// Each bad sequence is refused with its request, layer and row named, and leaves nothing behind: the
// step still ends with the good sequences only.
TEST(ExternalSteps, BadInputNamedAndNothingWritten) {
  TempDir dir;
  const std::string ours = dir / "ours.h5";
  record_ours(ours);
  const TraceReader r = TraceReader::open(ours);
  const ModelConfig c = r.config();
  const ExternalSequence good = engine_view(r, 0, true);
  int c4 = -1;
  for (int l = 0; l < c.num_hidden_layers && c4 < 0; ++l)
    if (c.ratio(l) == 4) c4 = l;
  ASSERT_GE(c4, 0);
  const auto idx_of = [&](ExternalSequence& e) -> ExternalIndexer& {
    for (auto& x : e.indexer)
      if (x.layer == c4) return x;
    throw std::logic_error("no C4 layer");
  };
  const int learned = c.num_hash_layers;
  struct Case {
    std::string what;
    std::function<void(ExternalSequence&)> edit;
    std::vector<std::string> says;
  };
  const std::vector<Case> cases = {
      {"future position", [&](ExternalSequence& e) { idx_of(e).ids[size_t(9 * c.index_topk)] = 5; },
       {"request 'req-0'", fmt::format("layer {}", c4), "row 9", "future position"}},
      {"duplicate group",
       [&](ExternalSequence& e) {
         ExternalIndexer& x = idx_of(e);
         x.ids[size_t(40 * c.index_topk + 1)] = x.ids[size_t(40 * c.index_topk)];
       },
       {"request 'req-0'", "row 40", "appears twice"}},
      {"id below -1", [&](ExternalSequence& e) { idx_of(e).ids[size_t(30 * c.index_topk)] = -7; }, {"row 30", "-7"}},
      {"too narrow",
       [&](ExternalSequence& e) {
         ExternalIndexer& x = idx_of(e);
         x.width = 1;
         x.ids.resize(size_t(x.rows));
       },
       {"width 1"}},
      {"rows", [&](ExternalSequence& e) { e.routing[0].rows = 10; }, {"layer 0", "10 rows for 70 tokens"}},
      {"expert out of range", [&](ExternalSequence& e) { e.routing[size_t(learned)].ids[7] = c.n_routed_experts; },
       {fmt::format("layer {}", learned), fmt::format("row {}", 7 / c.num_experts_per_tok), "outside [0,"}},
      {"expert -1", [&](ExternalSequence& e) { e.routing[size_t(learned)].ids[0] = -1; }, {"row 0", "expert id -1"}},
      {"weights size", [&](ExternalSequence& e) { e.routing[0].weights = {1.0f}; }, {"1 weights"}},
      {"not a C4 layer",
       [&](ExternalSequence& e) {
         int other = 0;
         while (c.ratio(other) == 4) ++other;
         idx_of(e).layer = other;
       },
       {"only C4 layers have an indexer"}},
      {"layer twice", [&](ExternalSequence& e) { e.routing.push_back(e.routing[0]); }, {"routing of layer 0 given twice"}},
      {"log-probs", [&](ExternalSequence& e) { e.logprobs.pop_back(); }, {"68 log-probs for 70 tokens"}},
      {"token", [&](ExternalSequence& e) { e.tokens[3] = c.vocab_size; }, {"position 3", "outside the vocabulary"}},
      {"bf16", [&](ExternalSequence& e) {
         e.tensors.push_back({"x", 0, DType::bf16, {1, 1}, {1.0f + 1e-6f}, {}});
       }, {"tensor 'x' layer 0", "not a bf16 value"}},
  };
  const std::string path = dir / "theirs.h5";
  auto w = ExternalTraceWriter::create(path, tiny_model_unknown_weights());
  ExternalStepSpec spec;
  spec.engine = "test";
  w->begin_step(spec);
  for (const Case& k : cases) {
    ExternalSequence e = good;
    k.edit(e);
    try {
      w->add_sequence(e);
      ADD_FAILURE() << k.what << ": accepted";
    } catch (const InputError& err) {
      const std::string m = err.what();
      EXPECT_NE(m.find(path), std::string::npos) << k.what << ": " << m;
      for (const std::string& s : k.says) EXPECT_NE(m.find(s), std::string::npos) << k.what << ": " << m;
    }
  }
  w->add_sequence(good);
  w->end_step();
  w->close();
  const TraceReader back = TraceReader::open(path);
  EXPECT_EQ(back.steps()[0].seq_lengths, std::vector<int64_t>{70});
  const ValidateReport v = validate_trace(path);
  EXPECT_TRUE(v.ok());
  for (const TraceProblem& p : v.problems) ADD_FAILURE() << p.where << ": " << p.what;
}

TEST(ExternalSteps, WriterThatDiesLeavesAnIncompleteFile) {
  TempDir dir;
  const std::string path = dir / "t.h5";
  {
    auto w = ExternalTraceWriter::create(path, tiny_model_unknown_weights());
    ExternalStepSpec spec;
    spec.engine = "python";
    w->begin_step(spec);
    ExternalSequence e;
    e.tokens = {1, 2, 3};
    w->add_sequence(e);
  }  // no end_step, no close: what a crash leaves
  EXPECT_FALSE(fs::exists(path));
  ASSERT_TRUE(fs::exists(path + ".incomplete"));
  const TraceReader r = TraceReader::open(path + ".incomplete");
  ASSERT_EQ(r.steps().size(), 1u);
  EXPECT_FALSE(r.steps()[0].complete);
  EXPECT_TRUE(r.steps()[0].damage.empty());  // status 0: stopped mid-step, not damaged
  EXPECT_EQ(r.steps()[0].seq_lengths, std::vector<int64_t>{3});
  EXPECT_THROW(ExternalTraceWriter::create(dir / "bad.txt", tiny_model_unknown_weights()), InputError);
  ExternalModel m;
  m.config_json = "{ not json";
  EXPECT_THROW(ExternalTraceWriter::create(dir / "x.h5", m), InputError);
}

}  // namespace
}  // namespace dsv4
