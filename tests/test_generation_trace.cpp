// Generations in traces: `record_generation` writes one step of kind "generate" (format version 2)
// whose sequences are laid out exactly as a prefill of the computed tokens — so its digests, decisions
// and log-probs equal those of a recorded prefill of the same tokens — plus the sampling record;
// replay re-runs the engine and is bit-identical; a doctored token, log-prob or digest is named at
// its request, position and decode step.
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <random>

#include "capture/digest.h"
#include "capture/generation.h"
#include "capture/layout.h"
#include "capture/policy.h"
#include "capture/record.h"
#include "capture/trace_reader.h"
#include "cli_util.h"
#include "h5_edit.h"
#include "model/error.h"
#include "model/forward.h"
#include "replay/attribution.h"
#include "replay/generation.h"
#include "replay/replay.h"
#include "rollout_test_util.h"
#include "test_util.h"
#include "tiny_model.h"

namespace dsv4 {
namespace {

namespace fs = std::filesystem;
using test::tiny;

using test::TempDir;

std::vector<rollout::Request> requests() {
  std::vector<rollout::Request> out;
  std::uniform_int_distribution<int32_t> tok(0, tiny().config().vocab_size - 1);
  for (int i = 0; i < 4; ++i) {
    rollout::Request q;
    q.id = fmt::format("r{}", i);
    const int len = i == 3 ? 41 : 5 + 17 * i;  // r3 repeats r2's prompt and forks its cache
    std::mt19937_64 pg(i == 3 ? 2 : i);
    for (int t = 0; t < len; ++t) q.prompt.push_back(tok(pg));
    q.max_new_tokens = 9 + i;
    q.sampling.temperature = i == 1 ? 0.0f : 0.9f;
    q.sampling.top_p = 0.95f;
    q.sampling.seed = 4;
    out.push_back(q);
  }
  return out;
}

rollout::EngineOptions engine_options() {
  rollout::EngineOptions o;
  o.profile = profile_rollout();
  o.max_batch = 2;
  o.prefill_chunk = 7;
  o.page_size = 8;
  return o;
}

TEST(GenerationTrace, RecordsAPrefillLayoutAndReplaysBitIdentically) {
  TempDir tmp;
  const std::string path = (tmp.dir / "gen.h5").string();
  GenerateRecordOptions ro;
  ro.capture = "decisions,logits";
  ro.seed = 7;
  const CollectedGeneration c = record_generation(tiny(), requests(), engine_options(), path, ro);
  ASSERT_EQ(c.gens.size(), 4u);
  EXPECT_EQ(c.gens[3].prefix_source, 2);

  const TraceReader r = TraceReader::open(path);
  EXPECT_EQ(r.format_version(), 2);
  const auto steps = r.steps();
  ASSERT_EQ(steps.size(), 1u);
  EXPECT_EQ(steps[0].kind, "generate");
  const auto g = r.generation(0);
  ASSERT_TRUE(g);
  ASSERT_EQ(g->requests.size(), 4u);
  for (size_t i = 0; i < 4; ++i) {
    EXPECT_EQ(g->requests[i].tokens, c.gens[i].tokens);
    EXPECT_TRUE(test::bitwise_equal(g->requests[i].logprobs, c.gens[i].logprobs));
    EXPECT_EQ(r.tokens(0, int(i)), c.computed[i]);
  }
  EXPECT_FALSE(g->schedule.empty());

  // The same computed tokens recorded as a prefill in the same profile: the same digests, decisions
  // and log-probs, sequence by sequence.
  const std::string prefill = (tmp.dir / "prefill.h5").string();
  RecordOptions po;
  po.profile = "rollout";
  po.capture = "decisions";
  record_step(tiny(), c.computed, prefill, po);
  const TraceReader p = TraceReader::open(prefill);
  const auto reqs = requests();
  for (int s = 0; s < 4; ++s) {
    // Every digest but the log-probs' (the prefill records them at temperature 1, a generation at each
    // request's sampling temperature).
    const DigestTable a = r.digests(0, s), b = p.digests(0, s);
    ASSERT_EQ(a.records.size(), b.records.size());
    int64_t rows = 0;
    for (size_t i = 0; i < a.records.size(); ++i) {
      ASSERT_EQ(a.records[i].name, b.records[i].name);
      if (a.records[i].name == "logprobs") continue;
      for (int64_t j = 0; j < a.records[i].rows; ++j, ++rows)
        ASSERT_EQ(a.values[size_t(a.records[i].first + j)], b.values[size_t(b.records[i].first + j)])
            << "sequence " << s << " " << a.records[i].name << " layer " << a.records[i].layer << " row "
            << j;
    }
    EXPECT_GT(rows, 0);
    RunOptions fo;
    fo.profile = profile_rollout();
    fo.temperature = reqs[size_t(s)].sampling.temperature > 0 ? reqs[size_t(s)].sampling.temperature : 1.0f;
    const auto lp = forward(tiny(), {c.computed[size_t(s)]}, fo).seqs[0].logprobs;
    EXPECT_TRUE(test::bitwise_equal(r.logprobs(0, s), lp)) << "sequence " << s;
    for (int L : r.decision_layers(0, s)) {
      const auto a = r.indexer(0, s, L), b = p.indexer(0, s, L);
      ASSERT_EQ(a.has_value(), b.has_value());
      if (a) {
        EXPECT_EQ(a->ids, b->ids) << "indexer layer " << L;
      }
      const auto ra = r.routing(0, s, L), rb = p.routing(0, s, L);
      ASSERT_TRUE(ra && rb);
      EXPECT_EQ(ra->ids, rb->ids);
    }
  }

  ReplayOptions opt;
  const ReplayReport rep = replay_trace(path, opt);
  ASSERT_EQ(rep.steps.size(), 1u);
  EXPECT_TRUE(rep.identical()) << (rep.steps[0].first ? rep.steps[0].first->reason : "decision changes");
  EXPECT_GT(rep.steps[0].records_compared, 0);
  // A second prefill-recorded step in the same file stays version-2 readable; the prefill trace alone
  // is version 1.
  EXPECT_EQ(p.format_version(), 1);
}

// Hands every report on the way a late report reaches a deferrable observer (model/late_reports.h): a
// tensor with its row digests and no host values, whose data() throws unless the observer asked for its
// values (wants_values). A deferrable observer that reads what it did not ask for fails here, on the
// CPU, as it would with a device backend.
class AsLateReports final : public Observer {
 public:
  explicit AsLateReports(Observer& o) : o_(o) {}
  void on_tensor(const TensorRecord& t) override {
    struct Values final : TensorFetch {
      const void* v = nullptr;
      bool wanted = false;
      std::string what;
      const void* fetch() override {
        if (!wanted) throw std::logic_error("the values of " + what + " were read, not asked for");
        return v;
      }
    };
    const std::vector<uint64_t> digests = digest_rows(t);
    Values f;
    f.v = t.data();
    f.wanted = o_.wants_values(t.name, t.layer);
    f.what = std::string(t.name) + " layer " + std::to_string(t.layer);
    TensorRecord late = t;
    late.host = nullptr;
    late.fetch = &f;
    late.row_digests = digests.data();
    ++tensors;
    values += f.wanted ? 1 : 0;
    o_.on_tensor(late);
  }
  void on_indexer(const IndexerDecision& d) override { o_.on_indexer(d); }
  void on_routing(const RoutingDecision& d) override { o_.on_routing(d); }
  void on_mhc(const MhcDecision& d) override { o_.on_mhc(d); }
  bool deferrable() const override { return o_.deferrable(); }
  int64_t tensors = 0, values = 0;

 private:
  Observer& o_;
};

// The collector takes its reports late (deferrable): with only the row digests and the values it asks
// for, it emits the same sequences, byte for byte, as with every report on time — with the values of
// the tensors the policy keeps, and with none beyond its own needs.
TEST(GenerationTrace, CollectorTakesItsReportsLate) {
  for (const std::string capture : {"decisions", "decisions,logits,attn.q"}) {
    SCOPED_TRACE(capture);
    const CapturePolicy policy = CapturePolicy::parse(capture);
    const auto keep = [&](std::string_view name, int layer) { return policy.wants_tensor(name, layer); };
    const auto run = [&](bool late, int64_t* asked) {
      GenerationCollector c(tiny().config(), keep);
      EXPECT_TRUE(c.deferrable());
      const auto reqs = requests();
      for (const auto& r : reqs)
        c.add_request(r.prompt, r.sampling.temperature > 0 ? r.sampling.temperature : 1.0f);
      AsLateReports as_late(c);
      rollout::EngineOptions o = engine_options();
      o.feed_last_token = true;
      o.observer = late ? static_cast<Observer*>(&as_late) : &c;
      rollout::Engine engine(tiny(), o);
      for (const auto& r : reqs) engine.submit(r);
      const std::vector<rollout::Generation> gens = engine.run();
      if (asked) *asked = as_late.values;
      if (late) {
        EXPECT_GT(as_late.tensors, as_late.values);
      }
      test::ReportTranscript out;
      for (size_t i = 0; i < gens.size(); ++i) {
        if (gens[i].prefix_source >= 0) c.set_prefix(int(i), gens[i].prefix_source, gens[i].shared_prefix);
        const int64_t T = int64_t(gens[i].prompt.size() + gens[i].tokens.size());
        c.report_request(int(i), T, int(i), gens[i].logprobs, out);
      }
      return out.text;
    };
    int64_t asked = 0;
    const std::string on_time = run(false, nullptr), late = run(true, &asked);
    EXPECT_GT(asked, 0);
    EXPECT_FALSE(on_time.empty());
    EXPECT_TRUE(on_time == late) << "the late collector emitted other bytes";
  }
}

TEST(GenerationTrace, DoctoredTraceIsNamedAtTheRightPlace) {
  TempDir tmp;
  const std::string path = (tmp.dir / "gen.h5").string();
  GenerateRecordOptions ro;
  ro.seed = 7;
  const CollectedGeneration c = record_generation(tiny(), requests(), engine_options(), path, ro);

  {  // a generated token
    const std::string bad = (tmp.dir / "token.h5").string();
    fs::copy_file(path, bad);
    {
      test::H5Edit e(bad);
      auto toks = e.read<int32_t>("/steps/000000/seq_001/generation/tokens", H5T_NATIVE_INT32);
      toks[4] = (toks[4] + 1) % tiny().config().vocab_size;
      e.write("/steps/000000/seq_001/generation/tokens", H5T_NATIVE_INT32, toks);
    }
    const ReplayReport rep = replay_trace(bad, {});
    ASSERT_TRUE(rep.steps[0].first);
    const Divergence& d = *rep.steps[0].first;
    EXPECT_EQ(d.seq, 1);
    EXPECT_EQ(d.tensor, "generation:tokens");
    EXPECT_EQ(d.row, 4);
    EXPECT_NE(d.reason.find("request 'r1'"), std::string::npos) << d.reason;
    EXPECT_NE(d.reason.find("decode step 3"), std::string::npos) << d.reason;
  }
  {  // a digest of a decode row: attn.q of layer 2 at the request's second generated position
    const std::string bad = (tmp.dir / "digest.h5").string();
    fs::copy_file(path, bad);
    const TraceReader r = TraceReader::open(path);
    const DigestTable t = r.digests(0, 2);
    const int64_t P = int64_t(requests()[2].prompt.size());
    int64_t first = -1;
    for (const auto& rec : t.records)
      if (rec.name == "attn.q" && rec.layer == 2) first = rec.first;
    ASSERT_GE(first, 0);
    {
      test::H5Edit e(bad);
      auto v = e.read<uint64_t>("/steps/000000/seq_002/digests/value", H5T_NATIVE_UINT64);
      v[size_t(first + P + 1)] ^= 1;
      e.write("/steps/000000/seq_002/digests/value", H5T_NATIVE_UINT64, v);
    }
    const ReplayReport rep = replay_trace(bad, {});
    ASSERT_TRUE(rep.steps[0].first);
    const Divergence& d = *rep.steps[0].first;
    EXPECT_EQ(d.seq, 2);
    EXPECT_EQ(d.layer, 2);
    EXPECT_EQ(d.tensor, "attn.q");
    EXPECT_EQ(d.row, P + 1);
    EXPECT_NE(d.reason.find("decode step 1"), std::string::npos) << d.reason;
  }
  {  // a log-prob of a generated token
    const std::string bad = (tmp.dir / "logprob.h5").string();
    fs::copy_file(path, bad);
    {
      test::H5Edit e(bad);
      auto lp = e.read<float>("/steps/000000/seq_000/generation/logprobs", H5T_NATIVE_FLOAT);
      lp[2] = std::nextafter(lp[2], 0.0f);
      e.write("/steps/000000/seq_000/generation/logprobs", H5T_NATIVE_FLOAT, lp);
    }
    const ReplayReport rep = replay_trace(bad, {});
    ASSERT_TRUE(rep.steps[0].first);
    EXPECT_EQ(rep.steps[0].first->tensor, "generation:logprobs");
    EXPECT_EQ(rep.steps[0].first->row, 2);
  }
}

TEST(GenerationTrace, ForcedDecisionsAreRefusedOnGenerationSteps) {
  TempDir tmp;
  const std::string path = (tmp.dir / "gen.h5").string();
  GenerateRecordOptions ro;
  record_generation(tiny(), {requests()[0]}, engine_options(), path, ro);
  ReplayOptions opt;
  opt.force_routing = true;
  try {
    replay_trace(path, opt);
    ADD_FAILURE() << "accepted";
  } catch (const InputError& e) {
    EXPECT_NE(std::string(e.what()).find("generation"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace dsv4

namespace dsv4 {
namespace {

// The user's flow through the CLI: generate with --record and --out, record the samples as a training
// prefill (`record --batch samples.jsonl`), replay the generation, diff the two. In one profile the
// decode path agrees with the prefill to the bit: no first divergence, zero log-prob mismatch; across
// profiles the diff measures the mismatch.
TEST(GenerationTrace, GenerateRecordReplayDiffThroughTheCli) {
  TempDir tmp;
  const fs::path d = tmp.dir;
  {
    std::ofstream f(d / "prompts.jsonl");
    f << "{\"id\": \"x\", \"prompt\": [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, "
         "20]}\n"
      << "{\"id\": \"y\", \"prompt\": [9, 8, 7], \"temperature\": 1, \"top_k\": 30}\n";
  }
  const std::string base = "--preset tiny --seed 7 --prompts " + (d / "prompts.jsonl").string() +
                           " --max-new-tokens 24 --prefill-chunk 6 --quiet";
  auto r = test::run_cli("generate " + base + " --out " + (d / "samples.jsonl").string() + " --record " +
                         (d / "gen.h5").string());
  ASSERT_EQ(r.code, 0) << r.out;
  r = test::run_cli("replay " + (d / "gen.h5").string());
  EXPECT_EQ(r.code, 0) << r.out;
  for (const char* profile : {"rollout", "train"}) {
    const std::string train = (d / (std::string(profile) + ".h5")).string();
    r = test::run_cli("record --preset tiny --seed 7 --batch " + (d / "samples.jsonl").string() +
                      " --profile " + profile + " --out " + train);
    ASSERT_EQ(r.code, 0) << r.out;
    const std::string json = (d / (std::string(profile) + ".json")).string();
    r = test::run_cli("diff " + train + " " + (d / "gen.h5").string() + " --json " + json);
    ASSERT_EQ(r.code, 0) << r.out;
    std::ifstream jf(json);
    const nlohmann::json j = nlohmann::json::parse(jf);
    const double abs_mean = j["logprobs"]["abs_mean"].get<double>();
    // Sample y draws at temperature 1, sample x at the default 1: every log-prob is at temperature 1.
    EXPECT_EQ(j["logprobs"]["tokens"].get<int64_t>(), 20 + 24 - 1 + 3 + 24 - 1);
    if (std::string(profile) == "rollout") {
      EXPECT_TRUE(j["first_divergence"].is_null()) << j["first_divergence"].dump();
      EXPECT_EQ(abs_mean, 0.0);
    } else {
      EXPECT_FALSE(j["first_divergence"].is_null());
      EXPECT_GT(abs_mean, 0.0);
    }
  }
}

}  // namespace
}  // namespace dsv4

namespace dsv4 {
namespace {

// --attribute: the decode stage is exactly zero in exact mode (decode ≡ prefill), the FP8 caches of
// the rollout profile account for a real part of the mismatch, the signed stages add up to the total,
// and a prefill step given as the rollout is refused.
TEST(GenerationTrace, AttributionStagesAddUp) {
  TempDir tmp;
  const std::string gen = (tmp.dir / "gen.h5").string(), train = (tmp.dir / "train.h5").string();
  auto reqs = requests();
  for (auto& q : reqs) q.sampling.temperature = q.sampling.temperature == 0.0f ? 0.0f : 1.0f;
  GenerateRecordOptions ro;
  ro.seed = 7;
  const CollectedGeneration c = record_generation(tiny(), reqs, engine_options(), gen, ro);
  RecordOptions po;
  po.profile = "train";
  record_step(tiny(), c.computed, train, po);
  const Attribution a = attribute_mismatch(gen, 0, train, 0);
  ASSERT_EQ(a.stages.size(), 4u);
  EXPECT_EQ(a.stages[0].logprob_abs_mean, 0.0);
  EXPECT_EQ(a.stages[0].indexer_rows_differing, 0);
  EXPECT_GT(a.stages[0].tokens, 0);
  EXPECT_GT(a.stages[1].logprob_abs_mean, 0.0);
  EXPECT_GT(a.stages[3].logprob_abs_mean, 0.0);
  const double sum = a.stages[0].logprob_mean + a.stages[1].logprob_mean + a.stages[2].logprob_mean;
  EXPECT_NEAR(sum, a.stages[3].logprob_mean, 1e-9);
  try {
    attribute_mismatch(train, 0, gen, 0);
    ADD_FAILURE() << "a prefill step accepted as the rollout";
  } catch (const InputError& e) {
    EXPECT_NE(std::string(e.what()).find("generation step"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace dsv4
