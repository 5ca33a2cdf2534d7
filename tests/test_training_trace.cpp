// Training steps in traces (traces/FORMAT.md "Training steps"): a step of kind "train-step" written by
// the TraceWriter with its TrainingRecord reads back field for field, bit for bit; the writer refuses
// a record that does not fit its step; a damaged record is a TraceCorrupt naming the dataset (and a
// problem of `dsv4 trace validate`); a trace holding a training step is format version 3, and traces
// of versions 1 and 2 still read, also once a training step is appended to them.
#include <gtest/gtest.h>
#include <hdf5.h>

#include <bit>
#include <cmath>
#include <filesystem>
#include <functional>
#include <limits>
#include <random>

#include "capture/errors.h"
#include "capture/layout.h"
#include "capture/salvage.h"
#include "capture/trace_reader.h"
#include "capture/trace_seal.h"
#include "capture/trace_writer.h"
#include "capture/training.h"
#include "capture/validate.h"
#include "h5_edit.h"
#include "model/forward.h"
#include "model/tokens.h"
#include "replay/generation.h"
#include "test_util.h"
#include "tiny_model.h"

namespace dsv4 {
namespace {

namespace fs = std::filesystem;
using test::TempDir;
using test::tiny;
using trace_layout::kKindTrainStep;

const TraceHeader& header() {
  static const TraceHeader h = make_trace_header(tiny());
  return h;
}

// Three samples of 9, 14 and 5 tokens (prompts of 4, 6 and 5: the last has no response).
std::vector<std::vector<int32_t>> samples() {
  const int vocab = tiny().config().vocab_size;
  return {random_tokens(9, vocab, 1), random_tokens(14, vocab, 2), random_tokens(5, vocab, 3)};
}

float nan_with_payload(uint32_t payload) {
  return std::bit_cast<float>(0x7fc00000u | payload);
}

// A record of every shape the format has: samples with and without each loss input and one with an
// empty response, values that only a bit-exact round trip keeps (-0, NaN payloads, subnormals,
// infinities), parameters trained, frozen, of one row and of none, activation gradients of the
// model level and of no rows, full tensors of dotted names and of no values.
TrainingRecord record() {
  const float inf = std::numeric_limits<float>::infinity();
  const float sub = std::numeric_limits<float>::denorm_min();
  std::mt19937_64 g(17);
  const auto digests = [&](int64_t n) {
    std::vector<uint64_t> v(static_cast<size_t>(n));
    for (auto& x : v) x = g();
    if (n > 0) v[0] |= uint64_t(1) << 63;  // beyond int64
    return v;
  };
  const auto floats = [&](int64_t n) {
    std::uniform_real_distribution<float> u(-3.0f, 0.0f);
    std::vector<float> v(static_cast<size_t>(n));
    for (auto& x : v) x = u(g);
    return v;
  };

  TrainingRecord t;
  t.settings_json = R"({"loss":{"kind":"grpo","clip":0.2},"adamw":{"lr":1e-06},"note":"é ∂"})";
  t.optimizer_step_before = 41;
  t.optimizer_state_path = "/runs/a/optimizer-000041.state";
  t.optimizer_state_digest = 0xfedcba9876543210ull;

  SampleLossInputs s0;
  s0.id = "sample-0";
  s0.prompt_length = 4;
  s0.advantage = -0.75;
  s0.reward = 1.0;
  s0.has_reward = true;
  s0.group = "prompt-a";
  s0.rollout_logprobs = {-0.0f, sub, nan_with_payload(0x1234), -inf, -1.5f};
  s0.old_logprobs = floats(5);
  SampleLossInputs s1;
  s1.id = "sample-1 é";
  s1.prompt_length = 6;
  s1.advantage = 0.1 + 0.2;  // not a float32 value: stored as float64
  s1.reward = -std::numeric_limits<double>::denorm_min();
  s1.has_reward = true;
  s1.group = "prompt-a";
  s1.old_logprobs = floats(8);
  s1.ref_logprobs = floats(8);
  SampleLossInputs s2;
  s2.id = "sample-2";
  s2.prompt_length = 5;  // the whole sequence: an empty response
  s2.advantage = 1e300;
  s2.has_reward = false;
  s2.group = "";
  t.samples = {s0, s1, s2};

  t.metrics = {{"loss", 0.12345678901234568},
               {"pg_loss", -0.0},
               {"kl", std::numeric_limits<double>::infinity()},
               {"grad_norm", 3.0e-310},
               {"clip_fraction", 0.25}};

  const auto& names = header().model.names;
  ParamDigests trained{names.at(0), 3, 5, digests(3), digests(3), digests(3), digests(3), digests(3)};
  ParamDigests frozen{names.at(1), 2, 4, {}, digests(2), {}, {}, {}};
  ParamDigests vec{names.at(2), 1, 7, digests(1), digests(1), digests(1), digests(1), digests(1)};
  ParamDigests none{names.at(3), 0, 6, {}, {}, {}, {}, {}};
  t.params = {trained, frozen, vec, none};

  t.act_grads = {{0, 2, "grad.attn.o", 9, 16, digests(9)},
                 {0, -1, "grad.embed", 9, 8, digests(9)},
                 {1, 0, "grad.ffn.out", 0, 3, {}},
                 {2, 1, "grad.attn.q", 5, 12, digests(5)}};

  std::vector<float> w0 = floats(15);
  w0[3] = nan_with_payload(7);
  w0[4] = -0.0f;
  t.full_grads = {{trained.name, floats(15)}, {vec.name, floats(7)}};
  t.full_weights = {{trained.name, w0}, {none.name, {}}};
  return t;
}

StepSpec spec(const std::string& kind, const std::vector<std::vector<int32_t>>& seqs) {
  StepSpec s;
  s.kind = kind;
  s.profile = "train";
  s.seed = 5;
  s.threads = 1;
  s.seqs = seqs;
  return s;
}

ForwardResult run(Observer& obs, const std::vector<std::vector<int32_t>>& seqs) {
  RunOptions o;
  o.profile = profile_train();
  o.threads = 1;
  o.observer = &obs;
  return forward(tiny(), seqs, o);
}

// One step of `kind` over samples(), with `t` as its training record when given.
void write_step(TraceWriter& w, const std::string& kind, const TrainingRecord* t = nullptr) {
  const auto seqs = samples();
  const ForwardResult r = run(w.begin_step(spec(kind, seqs)), seqs);
  if (t) w.set_training(*t);
  w.end_step(r);
}

// A trace of a prefill step ("train") then a training step holding record().
void write_trace(const std::string& path) {
  auto w = TraceWriter::create(path, tiny().config(), header(), {});
  write_step(*w, "train");
  const TrainingRecord t = record();
  write_step(*w, kKindTrainStep, &t);
  w->close();
}

uint64_t bits(double x) {
  return std::bit_cast<uint64_t>(x);
}

void expect_same(const TrainingRecord& a, const TrainingRecord& b) {
  EXPECT_EQ(a.settings_json, b.settings_json);
  EXPECT_EQ(a.optimizer_step_before, b.optimizer_step_before);
  EXPECT_EQ(a.optimizer_state_path, b.optimizer_state_path);
  EXPECT_EQ(a.optimizer_state_digest, b.optimizer_state_digest);
  ASSERT_EQ(a.samples.size(), b.samples.size());
  for (size_t i = 0; i < a.samples.size(); ++i) {
    const SampleLossInputs &x = a.samples[i], &y = b.samples[i];
    EXPECT_EQ(x.id, y.id) << i;
    EXPECT_EQ(x.prompt_length, y.prompt_length) << i;
    EXPECT_EQ(bits(x.advantage), bits(y.advantage)) << i;
    EXPECT_EQ(bits(x.reward), bits(y.reward)) << i;
    EXPECT_EQ(x.has_reward, y.has_reward) << i;
    EXPECT_EQ(x.group, y.group) << i;
    EXPECT_TRUE(test::bitwise_equal(x.rollout_logprobs, y.rollout_logprobs)) << i;
    EXPECT_TRUE(test::bitwise_equal(x.old_logprobs, y.old_logprobs)) << i;
    EXPECT_TRUE(test::bitwise_equal(x.ref_logprobs, y.ref_logprobs)) << i;
  }
  ASSERT_EQ(a.metrics.size(), b.metrics.size());
  for (auto i = a.metrics.begin(), j = b.metrics.begin(); i != a.metrics.end(); ++i, ++j) {
    EXPECT_EQ(i->first, j->first);
    EXPECT_EQ(bits(i->second), bits(j->second)) << i->first;
  }
  ASSERT_EQ(a.params.size(), b.params.size());
  for (size_t i = 0; i < a.params.size(); ++i) {
    const ParamDigests &x = a.params[i], &y = b.params[i];
    EXPECT_EQ(x.name, y.name);
    EXPECT_EQ(x.rows, y.rows) << x.name;
    EXPECT_EQ(x.row_elems, y.row_elems) << x.name;
    EXPECT_EQ(x.grad, y.grad) << x.name;
    EXPECT_EQ(x.weight, y.weight) << x.name;
    EXPECT_EQ(x.master, y.master) << x.name;
    EXPECT_EQ(x.m, y.m) << x.name;
    EXPECT_EQ(x.v, y.v) << x.name;
  }
  ASSERT_EQ(a.act_grads.size(), b.act_grads.size());
  for (size_t i = 0; i < a.act_grads.size(); ++i) {
    const ActGradDigests &x = a.act_grads[i], &y = b.act_grads[i];
    EXPECT_EQ(x.seq, y.seq) << i;
    EXPECT_EQ(x.layer, y.layer) << i;
    EXPECT_EQ(x.name, y.name) << i;
    EXPECT_EQ(x.rows, y.rows) << i;
    EXPECT_EQ(x.cols, y.cols) << i;
    EXPECT_EQ(x.digests, y.digests) << i;
  }
  for (const auto& [what, x, y] : {std::tuple{"full_grads", &a.full_grads, &b.full_grads},
                                   std::tuple{"full_weights", &a.full_weights, &b.full_weights}}) {
    ASSERT_EQ(x->size(), y->size()) << what;
    for (auto i = x->begin(), j = y->begin(); i != x->end(); ++i, ++j) {
      EXPECT_EQ(i->first, j->first) << what;
      EXPECT_TRUE(test::bitwise_equal(i->second, j->second)) << what << " " << i->first;
    }
  }
}

std::string all_problems(const ValidateReport& r) {
  std::string s;
  for (const auto& p : r.problems) s += "\n  " + p.where + ": " + p.what;
  return s;
}

int32_t root_version(const std::string& path) {
  return int32_t(TraceReader::open(path).format_version());
}

TEST(TrainingTrace, RoundTripsEveryFieldExactly) {
  TempDir tmp;
  const std::string path = tmp / "train.h5";
  write_trace(path);

  const TraceReader r = TraceReader::open(path);
  EXPECT_EQ(r.format_version(), 3);
  EXPECT_EQ(kTrainingFormatVersion, 3);
  const auto steps = r.steps();
  ASSERT_EQ(steps.size(), 2u);
  EXPECT_EQ(steps[0].kind, "train");
  EXPECT_EQ(steps[1].kind, "train-step");
  EXPECT_TRUE(steps[1].complete);
  EXPECT_FALSE(r.training(0));  // a prefill step has none
  EXPECT_FALSE(r.generation(1));
  const std::optional<TrainingRecord> t = r.training(1);
  ASSERT_TRUE(t);
  expect_same(*t, record());
  // The forward of the samples is laid out as a prefill of them: the same tokens and digests as the
  // prefill step of the same samples before it.
  const auto seqs = samples();
  for (int s = 0; s < 3; ++s) {
    EXPECT_EQ(r.tokens(1, s), seqs[size_t(s)]);
    EXPECT_EQ(r.digests(1, s).values, r.digests(0, s).values) << s;
    EXPECT_TRUE(test::bitwise_equal(r.logprobs(1, s), r.logprobs(0, s))) << s;
  }
  const ValidateReport v = validate_trace(path);
  EXPECT_TRUE(v.ok()) << all_problems(v);
}

template <typename E, typename F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const E& e) {
    return e.what();
  } catch (const std::exception& e) {
    ADD_FAILURE() << "unexpected exception type: " << e.what();
    return "";
  }
  ADD_FAILURE() << "no exception";
  return "";
}

TEST(TrainingTrace, WriterRefusesARecordThatDoesNotFitItsStep) {
  TempDir tmp;
  const std::string path = tmp / "refused.h5";
  auto w = TraceWriter::create(path, tiny().config(), header(), {});
  const auto seqs = samples();

  {  // a training record belongs to a "train-step" step only
    const ForwardResult r = run(w->begin_step(spec("train", seqs)), seqs);
    const std::string e = error_of<Error>([&] { w->set_training(record()); });
    EXPECT_NE(e.find("kind 'train'"), std::string::npos) << e;
    w->end_step(r);
  }

  const ForwardResult r = run(w->begin_step(spec(kKindTrainStep, seqs)), seqs);
  {
    const std::string e = error_of<Error>([&] { w->end_step(r); });
    EXPECT_NE(e.find("set_training"), std::string::npos) << e;
  }
  struct Case {
    std::function<void(TrainingRecord&)> edit;
    std::string needle;
  };
  const std::string p0 = header().model.names.at(0);
  const std::vector<Case> cases = {
      {[](TrainingRecord& t) { t.samples.pop_back(); }, "training/samples/id: 2 samples for a step of 3"},
      {[](TrainingRecord& t) { t.samples[1].prompt_length = 15; },
       "training/samples/prompt_length: sample 1"},
      {[](TrainingRecord& t) { t.samples[0].old_logprobs.pop_back(); },
       "training/samples/old_logprobs: sample 0 has 4 values, its response 5 tokens"},
      {[](TrainingRecord& t) { t.samples[2].ref_logprobs = {-1.0f}; },
       "training/samples/ref_logprobs: sample 2"},
      {[](TrainingRecord& t) { t.params[1].name = t.params[0].name; }, "is listed twice"},
      {[](TrainingRecord& t) { t.params[3].name = "a/b"; }, "training/params/name: 'a/b'"},
      {[](TrainingRecord& t) { t.params[0].m.pop_back(); },
       "training/params/m: parameter '" + p0 + "' has 2"},
      {[](TrainingRecord& t) { t.act_grads[1].seq = 3; }, "training/act_grads/seq: entry 1"},
      {[](TrainingRecord& t) { t.act_grads[0].digests.pop_back(); }, "training/act_grads/digests: entry 0"},
      {[](TrainingRecord& t) { t.full_grads["nope"] = {1.0f}; }, "training/full_grads/nope: 'nope' is not"},
      {[](TrainingRecord& t) { t.full_weights.begin()->second.pop_back(); },
       "14 values for a parameter of [3, 5]"},
  };
  for (const Case& c : cases) {
    TrainingRecord t = record();
    c.edit(t);
    const std::string e = error_of<Error>([&] { w->set_training(t); });
    EXPECT_NE(e.find(c.needle), std::string::npos) << e;
  }
  // The step is still open and takes a record that fits.
  w->set_training(record());
  w->end_step(r);
  w->close();
  const std::optional<TrainingRecord> t = TraceReader::open(path).training(1);
  ASSERT_TRUE(t);
  expect_same(*t, record());
}

TEST(TrainingTrace, DamagedRecordIsTraceCorruptNamingTheDataset) {
  TempDir tmp;
  const std::string good = tmp / "good.h5";
  write_trace(good);
  const std::string tr = "/steps/000001/training/";
  const std::string p0 = header().model.names.at(0);

  struct Case {
    std::string name;
    std::function<void(test::H5Edit&)> edit;
    std::string dataset, needle;  // what the message names, and says
  };
  const auto edit_i64 = [](const std::string& ds, size_t i, int64_t delta) {
    return [=](test::H5Edit& e) {
      auto v = e.read<int64_t>(ds, H5T_NATIVE_INT64);
      v.at(i) += delta;
      e.write(ds, H5T_NATIVE_INT64, v);
    };
  };
  const std::vector<Case> cases = {
      {"counts past the end", edit_i64(tr + "params/grad_count", 0, 2),
       tr + "params/grad:", "runs past its end at entry 0"},
      {"counts short of the end", edit_i64(tr + "params/weight_count", 1, -1),
       tr + "params/weight:", "holds 6 values, weight_count sums to 5"},
      {"a negative count", edit_i64(tr + "samples/rollout_logprobs_count", 1, -1),
       tr + "samples/rollout_logprobs_count:", "entry 1 has length -1"},
      {"a truncated ragged dataset",
       [&](test::H5Edit& e) {
         auto v = e.read<float>(tr + "samples/old_logprobs", H5T_NATIVE_FLOAT);
         v.pop_back();
         e.replace(tr + "samples/old_logprobs", H5T_IEEE_F32LE, H5T_NATIVE_FLOAT, v);
       },
       tr + "samples/old_logprobs:", "runs past its end at entry 1"},
      {"a truncated column",
       [&](test::H5Edit& e) {
         auto v = e.read<double>(tr + "samples/advantage", H5T_NATIVE_DOUBLE);
         v.pop_back();
         e.replace(tr + "samples/advantage", H5T_IEEE_F64LE, H5T_NATIVE_DOUBLE, v);
       },
       tr + "samples/advantage:", "2 entries, expected 3 (as id)"},
      {"a missing dataset", [&](test::H5Edit& e) { e.remove(tr + "act_grads/cols"); },
       tr + "act_grads/cols:", "missing"},
      {"a retyped dataset",
       [&](test::H5Edit& e) {
         auto v = e.read<float>(tr + "metric_values", H5T_NATIVE_FLOAT);
         e.replace(tr + "metric_values", H5T_IEEE_F32LE, H5T_NATIVE_FLOAT, v);
       },
       tr + "metric_values:", "stored as float32, expected float64"},
      {"rows that disagree with the digests", edit_i64(tr + "act_grads/rows", 3, 1),
       tr + "act_grads/digests:", "runs past its end at entry 3"},
      {"a prompt longer than its sequence", edit_i64(tr + "samples/prompt_length", 2, 1),
       tr + "samples/prompt_length:", "sample 2 has prompt length 6, its sequence 5 tokens"},
      {"has_reward neither 0 nor 1",
       [&](test::H5Edit& e) {
         auto v = e.read<uint8_t>(tr + "samples/has_reward", H5T_NATIVE_UINT8);
         v[0] = 2;
         e.write(tr + "samples/has_reward", H5T_NATIVE_UINT8, v);
       },
       tr + "samples/has_reward:", "2 at sample 0, expected 0 or 1"},
      {"a full tensor of another shape",
       [&](test::H5Edit& e) {
         auto v = e.read<float>(tr + "full_grads/" + p0, H5T_NATIVE_FLOAT);
         e.replace(tr + "full_grads/" + p0, H5T_IEEE_F32LE, H5T_NATIVE_FLOAT, v, {5, 3});
       },
       tr + "full_grads/" + p0 + ":", "shape [5, 3], the parameter is [3, 5]"},
      {"a full tensor of no parameter",
       [&](test::H5Edit& e) {
         e.create(tr + "full_weights/unknown.weight", H5T_IEEE_F32LE, H5T_NATIVE_FLOAT,
                  std::vector<float>{1, 2}, {1, 2});
       },
       tr + "full_weights/unknown.weight:", "not one of the parameters"},
      {"the whole group missing", [&](test::H5Edit& e) { e.remove("/steps/000001/training"); },
       "/steps/000001/training:", "missing"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    const std::string bad = tmp / "bad.h5";
    fs::remove(bad);
    fs::copy_file(good, bad);
    {
      test::H5Edit e(bad);
      c.edit(e);
    }
    const TraceReader r = TraceReader::open(bad);
    const std::string e = error_of<TraceCorrupt>([&] { r.training(1); });
    EXPECT_NE(e.find(bad + " step 1: "), std::string::npos) << e;
    EXPECT_NE(e.find(c.dataset), std::string::npos) << e;
    EXPECT_NE(e.find(c.needle), std::string::npos) << e;
    // The rest of the trace still reads, and validation reports the damage.
    EXPECT_EQ(r.tokens(1, 0), samples()[0]);
    const ValidateReport v = validate_trace(bad);
    EXPECT_FALSE(v.ok());
    bool named = false;
    for (const auto& p : v.problems)
      named = named || (p.where + ": " + p.what).find(c.dataset) != std::string::npos;
    EXPECT_TRUE(named) << all_problems(v);
  }

  // A training step in a file that claims an older version: readers of version 2 would misread it.
  const std::string old = tmp / "claims-v2.h5";
  fs::copy_file(good, old);
  {
    const hid_t f = H5Fopen(old.c_str(), H5F_ACC_RDWR, H5P_DEFAULT);
    const hid_t a = H5Aopen(f, "format_version", H5P_DEFAULT);
    const int32_t two = 2;
    EXPECT_GE(H5Awrite(a, H5T_NATIVE_INT32, &two), 0);
    H5Aclose(a);
    H5Fclose(f);
    seal_trace(old);  // as a writer with that bug would have: the check behind the seal is tested
  }
  const ValidateReport v = validate_trace(old);
  ASSERT_EQ(v.problems.size(), 1u) << all_problems(v);
  EXPECT_NE(v.problems[0].what.find("needs format_version 3, the file has 2"), std::string::npos)
      << all_problems(v);
}

std::vector<rollout::Request> requests() {
  const int vocab = tiny().config().vocab_size;
  std::vector<rollout::Request> out;
  for (int i = 0; i < 2; ++i) {
    rollout::Request q;
    q.id = "r" + std::to_string(i);
    q.prompt = random_tokens(6 + 5 * i, vocab, uint64_t(10 + i));
    q.max_new_tokens = 4;
    q.sampling.temperature = 0.8f;
    q.sampling.seed = 3;
    out.push_back(q);
  }
  return out;
}

TEST(TrainingTrace, VersionOneAndTwoTracesStillReadAndGainVersionThreeWithATrainingStep) {
  TempDir tmp;
  // Version 2: a generation.
  const std::string gen = tmp / "gen.h5";
  rollout::EngineOptions eo;
  eo.profile = profile_rollout();
  eo.max_batch = 2;
  eo.prefill_chunk = 5;
  eo.page_size = 8;
  record_generation(tiny(), requests(), eo, gen, GenerateRecordOptions{});
  const auto before = TraceReader::open(gen).generation(0);
  ASSERT_TRUE(before);
  {
    const TraceReader r = TraceReader::open(gen);
    EXPECT_EQ(r.format_version(), kGenerationFormatVersion);
    EXPECT_FALSE(r.training(0));
    EXPECT_TRUE(validate_trace(gen).ok()) << all_problems(validate_trace(gen));
  }
  // Salvage keeps a trace's version.
  const std::string salvaged = tmp / "gen-salvaged.h5";
  EXPECT_EQ(salvage_trace(gen, salvaged).copied.size(), 1u);
  EXPECT_EQ(root_version(salvaged), kGenerationFormatVersion);

  // Version 1: prefill steps only; a second prefill step keeps it.
  const std::string pre = tmp / "prefill.h5";
  {
    auto w = TraceWriter::create(pre, tiny().config(), header(), {});
    write_step(*w, "train");
    w->close();
    auto a = TraceWriter::append(pre, tiny().config(), header(), {});
    write_step(*a, "rollout");
    a->close();
  }
  EXPECT_EQ(root_version(pre), kPrefillFormatVersion);

  // A training step appended to either makes it version 3; what was there reads as before.
  const TrainingRecord t = record();
  for (const std::string& path : {gen, pre}) {
    SCOPED_TRACE(path);
    auto a = TraceWriter::append(path, tiny().config(), header(), {});
    write_step(*a, kKindTrainStep, &t);
    a->close();
    const TraceReader r = TraceReader::open(path);
    EXPECT_EQ(r.format_version(), kTrainingFormatVersion);
    const int last = int(r.steps().size()) - 1;
    const auto got = r.training(last);
    ASSERT_TRUE(got);
    expect_same(*got, t);
    EXPECT_FALSE(r.training(0));
    const ValidateReport v = validate_trace(path);
    EXPECT_TRUE(v.ok()) << all_problems(v);
  }
  const auto after = TraceReader::open(gen).generation(0);
  ASSERT_TRUE(after);
  ASSERT_EQ(after->requests.size(), before->requests.size());
  for (size_t i = 0; i < before->requests.size(); ++i) {
    EXPECT_EQ(after->requests[i].tokens, before->requests[i].tokens);
    EXPECT_TRUE(test::bitwise_equal(after->requests[i].logprobs, before->requests[i].logprobs));
  }

  // A later generation step does not lower the version.
  record_generation(tiny(), requests(), eo, gen, GenerateRecordOptions{"decisions", 0, true});
  EXPECT_EQ(root_version(gen), kTrainingFormatVersion);
  EXPECT_TRUE(TraceReader::open(gen).generation(2));
}

}  // namespace
}  // namespace dsv4
