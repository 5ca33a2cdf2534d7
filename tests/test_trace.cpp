// Traces (traces/FORMAT.md): what the writer records reads back bit for bit, capture policies keep
// exactly the tensors they name, append/create refuse what they must, a trace that was not closed
// (or whose recorder was killed) keeps its complete steps, a trace can be read while it is written,
// and damaged or foreign files fail with the right error naming the file.
#include <gtest/gtest.h>
#include <hdf5.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <set>
#include <string_view>

#include "capture/digest.h"
#include "capture/errors.h"
#include "capture/trace_reader.h"
#include "capture/trace_seal.h"
#include "capture/trace_writer.h"
#include "model/collect.h"
#include "model/forward.h"
#include "model/manifest.h"
#include "model/tokens.h"
#include "model/weights.h"
#include "test_util.h"
#include "tiny_model.h"

extern char** environ;

namespace dsv4 {
namespace {

namespace fs = std::filesystem;

using test::tiny;

using test::TempDir;

// Forwards every report to several observers.
class FanOut : public Observer {
 public:
  explicit FanOut(std::vector<Observer*> to) : to_(std::move(to)) {}
  void on_tensor(const TensorRecord& t) override {
    for (auto* o : to_) o->on_tensor(t);
  }
  void on_indexer(const IndexerDecision& d) override {
    for (auto* o : to_) o->on_indexer(d);
  }
  void on_routing(const RoutingDecision& d) override {
    for (auto* o : to_) o->on_routing(d);
  }
  void on_mhc(const MhcDecision& d) override {
    for (auto* o : to_) o->on_mhc(d);
  }
  bool wants_tensors() const override {
    for (auto* o : to_)
      if (o->wants_tensors()) return true;
    return false;
  }

 private:
  std::vector<Observer*> to_;
};

std::vector<std::vector<int32_t>> batch_of(std::initializer_list<int64_t> lengths, uint64_t seed) {
  std::vector<std::vector<int32_t>> b;
  for (int64_t T : lengths) b.push_back(random_tokens(T, tiny().config().vocab_size, seed + uint64_t(T)));
  return b;
}

StepSpec spec_of(const std::vector<std::vector<int32_t>>& seqs, bool rollout) {
  StepSpec s;
  s.kind = rollout ? "rollout" : "train";
  s.profile = rollout ? "rollout" : "train";
  s.seed = 1234;
  s.threads = 1;
  s.seqs = seqs;
  return s;
}

struct Recorded {
  std::unique_ptr<DecisionLog> log = std::make_unique<DecisionLog>(true);
  ForwardResult result;
  std::vector<std::vector<int32_t>> seqs;
};

// One step: forward over `seqs` with the writer and a DecisionLog listening.
Recorded record_step(TraceWriter& w, const std::vector<std::vector<int32_t>>& seqs, bool rollout = false) {
  Recorded r;
  r.seqs = seqs;
  const NumericsProfile p = rollout ? profile_rollout() : profile_train();
  Observer& obs = w.begin_step(spec_of(seqs, rollout));
  FanOut fan({&obs, r.log.get()});
  RunOptions o;
  o.profile = p;
  o.threads = 1;  // results do not depend on it (test_model); one thread avoids OpenMP spinning on busy CI
  o.observer = &fan;
  r.result = forward(tiny(), seqs, o);
  w.end_step(r.result);
  return r;
}

TraceWriter::Options options(const std::string& policy, int64_t queue_bytes = int64_t(256) << 20) {
  TraceWriter::Options o;
  o.policy = CapturePolicy::parse(policy);
  o.queue_bytes = queue_bytes;
  return o;
}

const TraceHeader& header() {
  static const TraceHeader h = make_trace_header(tiny());
  return h;
}

std::unique_ptr<TraceWriter> create(const std::string& path, const std::string& policy,
                                    int64_t queue_bytes = int64_t(256) << 20) {
  return TraceWriter::create(path, tiny().config(), header(), options(policy, queue_bytes));
}

template <typename F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "(no exception)";
}

// Every decision, log-prob, token, digest and (when `tensors`) full tensor of `r` equals step `step`.
void expect_step_equals(const TraceReader& t, int step, const Recorded& r, bool tensors) {
  const ModelConfig& c = tiny().config();
  for (size_t s = 0; s < r.seqs.size(); ++s) {
    const int si = int(s);
    SCOPED_TRACE("step " + std::to_string(step) + " seq " + std::to_string(s) +
                 " T=" + std::to_string(r.seqs[s].size()));
    EXPECT_EQ(t.tokens(step, si), r.seqs[s]);
    EXPECT_TRUE(test::bitwise_equal(t.logprobs(step, si), r.result.seqs[s].logprobs));
    std::vector<int> layers(size_t(c.num_hidden_layers));
    for (int L = 0; L < c.num_hidden_layers; ++L) layers[size_t(L)] = L;
    EXPECT_EQ(t.decision_layers(step, si), layers);
    for (int L = 0; L < c.num_hidden_layers; ++L) {
      const auto key = std::make_pair(si, L);
      auto ix = t.indexer(step, si, L);
      ASSERT_EQ(ix.has_value(), r.log->indexer.count(key) == 1) << "layer " << L;
      if (ix) {
        const IndexerRecord& want = r.log->indexer.at(key);
        EXPECT_EQ(ix->T, want.T);
        EXPECT_EQ(ix->k, want.k);
        EXPECT_EQ(ix->ids, want.ids) << "layer " << L;
        EXPECT_TRUE(test::bitwise_equal(ix->margin, want.margin)) << "layer " << L;
      }
      auto ro = t.routing(step, si, L);
      ASSERT_TRUE(ro.has_value());
      const RoutingRecord& rw = r.log->routing.at(key);
      EXPECT_EQ(ro->k, rw.k);
      EXPECT_EQ(ro->hashed, rw.hashed);
      EXPECT_EQ(ro->ids, rw.ids) << "layer " << L;
      EXPECT_TRUE(test::bitwise_equal(ro->weights, rw.weights)) << "layer " << L;
      EXPECT_TRUE(test::bitwise_equal(ro->margin, rw.margin)) << "layer " << L;
      for (Sublayer sub : {Sublayer::attn, Sublayer::ffn}) {
        auto m = t.mhc(step, si, L, sub);
        ASSERT_TRUE(m.has_value());
        const MhcRecord& mw = r.log->mhc.at({key, sub});
        EXPECT_EQ(m->hc, mw.hc);
        EXPECT_TRUE(test::bitwise_equal(m->pre, mw.pre)) << "layer " << L << " " << to_string(sub);
        EXPECT_TRUE(test::bitwise_equal(m->post, mw.post)) << "layer " << L << " " << to_string(sub);
        EXPECT_TRUE(test::bitwise_equal(m->comb, mw.comb)) << "layer " << L << " " << to_string(sub);
      }
    }
    // Digests: the records in manifest (= execution) order, each equal to digest_rows() recomputed
    // from the tensor the forward reported.
    const DigestTable dt = t.digests(step, si);
    const auto manifest = tensor_manifest(c, int64_t(r.seqs[s].size()));
    ASSERT_EQ(dt.records.size(), manifest.size());
    std::vector<std::pair<DecisionLog::Key, std::string>> order;
    for (const auto& k : r.log->tensor_order)
      if (k.first.first == si) order.push_back(k);
    ASSERT_EQ(order.size(), manifest.size());
    for (size_t i = 0; i < manifest.size(); ++i) {
      const DigestRecord& rec = dt.records[i];
      EXPECT_EQ(rec.name, manifest[i].name);
      EXPECT_EQ(rec.layer, manifest[i].layer);
      EXPECT_EQ(rec.rows, manifest[i].rows());
      ASSERT_EQ(order[i].second, rec.name);
      ASSERT_EQ(order[i].first.second, rec.layer);
      const TensorCopy& tc = r.log->tensors.at(order[i]);
      TensorRecord tr;
      tr.seq = si;
      tr.layer = rec.layer;
      tr.name = rec.name;
      tr.dtype = tc.dtype;
      tr.shape = tc.shape;
      tr.host = tc.dtype == DType::i32 ? static_cast<const void*>(tc.i.data()) : tc.f.data();
      const auto want = digest_rows(tr);
      const std::vector<uint64_t> got(dt.values.begin() + rec.first,
                                      dt.values.begin() + rec.first + rec.rows);
      EXPECT_EQ(got, want) << rec.name << " layer " << rec.layer;
      if (tensors) {
        auto full = t.tensor(step, si, rec.layer, rec.name);
        ASSERT_TRUE(full.has_value()) << rec.name << " layer " << rec.layer;
        EXPECT_EQ(full->dtype, tc.dtype);
        EXPECT_EQ(full->shape, tc.shape) << rec.name;
        EXPECT_TRUE(test::bitwise_equal(full->f, tc.f)) << rec.name << " layer " << rec.layer;
        EXPECT_TRUE(test::bitwise_equal(full->i, tc.i)) << rec.name << " layer " << rec.layer;
      }
    }
    if (tensors) {
      EXPECT_EQ(t.full_tensors(step, si).size(), manifest.size());
    }
  }
}

TEST(Trace, FullRoundTripBothProfiles) {
  TempDir d;
  const std::string path = d / "full.h5";
  // A small queue exercises back-pressure: the forward waits for the writer thread.
  auto w = create(path, "full", int64_t(1) << 18);
  EXPECT_EQ(w->writing_path(), path + ".incomplete");
  const auto seqs = batch_of({1, 3, 70, 130}, 1);
  const Recorded train = record_step(*w, seqs, false);
  const Recorded rollout = record_step(*w, seqs, true);
  EXPECT_EQ(w->steps_written(), 2);
  const WriterStats st = w->stats();
  EXPECT_GT(st.bytes_queued, 0);
  EXPECT_GT(st.queue_high_water, 0);
  EXPECT_GE(st.seconds_blocked, 0.0);
  w->close();
  EXPECT_TRUE(fs::exists(path));
  EXPECT_FALSE(fs::exists(path + ".incomplete"));

  const TraceReader t = TraceReader::open(path);
  EXPECT_EQ(t.format_version(), kPrefillFormatVersion);  // prefill steps only: still version 1
  EXPECT_EQ(t.producer().rfind("dsv4 ", 0), 0u);
  EXPECT_EQ(t.created().size(), 20u);  // 2026-01-01T00:00:00Z
  EXPECT_EQ(t.env(), header().env);
  EXPECT_EQ(config_to_json(t.config()), config_to_json(tiny().config()));
  EXPECT_EQ(t.tensor_names(), tensor_names(tiny().config()));
  const TraceModelMeta m = t.model();
  EXPECT_EQ(m.model_digest, hex16(header().model.whole));
  EXPECT_EQ(m.tensor_names, header().model.names);
  EXPECT_EQ(m.tensor_digests, header().model.digests);
  EXPECT_EQ(m.weights_path, tiny().source());
  const auto steps = t.steps();
  ASSERT_EQ(steps.size(), 2u);
  for (const auto& s : steps) {
    EXPECT_TRUE(s.complete);
    EXPECT_EQ(s.capture, "full");
    EXPECT_EQ(s.seed, 1234u);
    EXPECT_EQ(s.threads, 1);
    EXPECT_EQ(s.seq_lengths, (std::vector<int64_t>{1, 3, 70, 130}));
  }
  EXPECT_EQ(steps[0].profile, "train");
  EXPECT_EQ(steps[1].profile, "rollout");
  EXPECT_EQ(steps[1].kind, "rollout");
  expect_step_equals(t, 0, train, true);
  expect_step_equals(t, 1, rollout, true);
  // The two profiles differ somewhere, so the comparison above is not vacuous.
  EXPECT_FALSE(test::bitwise_equal(t.logprobs(0, 3), t.logprobs(1, 3)));
  EXPECT_GT(t.file_bytes(), 0);
}

TEST(Trace, DecisionsPolicyStoresNoTensors) {
  TempDir d;
  const std::string path = d / "dec.h5";
  auto w = create(path, "decisions");
  const Recorded r = record_step(*w, batch_of({40, 9}, 2));
  w->close();
  const TraceReader t = TraceReader::open(path);
  for (int s = 0; s < 2; ++s) {
    EXPECT_TRUE(t.full_tensors(0, s).empty());
    EXPECT_FALSE(t.tensor(0, s, 1, "attn.q").has_value());
  }
  expect_step_equals(t, 0, r, false);
}

TEST(Trace, PatternPolicyStoresExactlyItsTensors) {
  TempDir d;
  const std::string path = d / "pat.h5";
  auto w = create(path, "attn.*@1-2,logits");
  const Recorded r = record_step(*w, batch_of({33}, 3));
  w->close();
  const TraceReader t = TraceReader::open(path);
  std::set<std::pair<std::string, int>> want;
  for (const auto& s : tensor_manifest(tiny().config(), 33))
    if ((s.name.rfind("attn.", 0) == 0 && (s.layer == 1 || s.layer == 2)) ||
        (s.name == "logits" && s.layer == -1))
      want.emplace(s.name, s.layer);
  const auto got = t.full_tensors(0, 0);
  const std::set<std::pair<std::string, int>> got_set(got.begin(), got.end());
  EXPECT_EQ(got_set, want);
  EXPECT_EQ(got.size(), want.size());
  EXPECT_GT(want.size(), 10u);
  for (const auto& [name, layer] : want) {
    auto c = t.tensor(0, 0, layer, name);
    ASSERT_TRUE(c.has_value());
    EXPECT_TRUE(test::bitwise_equal(c->f, r.log->tensors.at({{0, layer}, name}).f)) << name << " " << layer;
  }
}

TEST(Trace, AppendAddsStepsAndRefusesAnotherModel) {
  TempDir d;
  const std::string path = d / "app.h5";
  {
    auto w = create(path, "decisions");
    record_step(*w, batch_of({20}, 4));
    w->close();
  }
  Recorded second;
  {
    auto w = TraceWriter::append(path, tiny().config(), header(), options("decisions"));
    EXPECT_EQ(w->writing_path(), path);
    second = record_step(*w, batch_of({12, 5}, 5), true);
    w->close();
  }
  {
    const TraceReader t = TraceReader::open(path);
    ASSERT_EQ(t.steps().size(), 2u);
    EXPECT_EQ(t.steps()[1].group, "/steps/000001");
    EXPECT_TRUE(t.steps()[0].complete);
    EXPECT_TRUE(t.steps()[1].complete);
    expect_step_equals(t, 1, second, false);
  }
  const Weights other = Weights::init(preset("tiny"), 8);
  const TraceHeader oh = make_trace_header(other);
  try {
    TraceWriter::append(path, other.config(), oh, options("decisions"));
    FAIL() << "append accepted another model";
  } catch (const InputError& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find(path), std::string::npos) << msg;
    EXPECT_NE(msg.find(hex16(header().model.whole)), std::string::npos) << msg;
    EXPECT_NE(msg.find(hex16(oh.model.whole)), std::string::npos) << msg;
    EXPECT_NE(msg.find("first differing tensor: '"), std::string::npos) << msg;
  }
  EXPECT_EQ(TraceReader::open(path).steps().size(), 2u);
  EXPECT_THROW(TraceWriter::append(d / "missing.h5", tiny().config(), header(), options("decisions")),
               InputError);
}

TEST(Trace, CreateRefusesAnExistingFile) {
  TempDir d;
  const std::string path = d / "x.h5";
  std::ofstream(path) << "keep me";
  const std::string msg = error_of([&] { create(path, "decisions"); });
  EXPECT_NE(msg.find(path), std::string::npos) << msg;
  EXPECT_THROW(create(path, "decisions"), InputError);
  std::ifstream in(path);
  std::string content;
  std::getline(in, content);
  EXPECT_EQ(content, "keep me");
  EXPECT_THROW(create(d / "x.hdf5", "decisions"), InputError);
}

TEST(Trace, UnclosedTraceKeepsItsCompleteSteps) {
  TempDir d;
  const std::string path = d / "open.h5";
  Recorded first;
  {
    auto w = create(path, "decisions");
    first = record_step(*w, batch_of({17}, 6));
    // Step 1 runs but is never ended, and the writer is never closed.
    const auto seqs = batch_of({25}, 7);
    Observer& obs = w->begin_step(spec_of(seqs, false));
    RunOptions o;
    o.threads = 1;
    o.observer = &obs;
    forward(tiny(), seqs, o);
  }
  EXPECT_FALSE(fs::exists(path));
  ASSERT_TRUE(fs::exists(path + ".incomplete"));
  const TraceReader t = TraceReader::open(path + ".incomplete");
  ASSERT_EQ(t.steps().size(), 2u);
  EXPECT_TRUE(t.steps()[0].complete);
  EXPECT_FALSE(t.steps()[1].complete);
  expect_step_equals(t, 0, first, false);
  EXPECT_THROW(t.tokens(1, 0), TraceIncomplete);
  EXPECT_THROW(t.tokens(5, 0), TraceError);
  EXPECT_THROW(t.tokens(0, 3), TraceError);
}

TEST(Trace, ReadWhileWriting) {
  TempDir d;
  const std::string path = d / "live.h5";
  auto w = create(path, "decisions");
  const Recorded first = record_step(*w, batch_of({30}, 8));
  const auto seqs = batch_of({21}, 9);
  Observer& obs = w->begin_step(spec_of(seqs, false));
  RunOptions o;
  o.threads = 1;
  o.observer = &obs;
  const ForwardResult r = forward(tiny(), seqs, o);
  w->flush();  // what was handed over is on disk; the step stays open
  {
    const TraceReader t = TraceReader::open(w->writing_path());
    const auto steps = t.steps();
    ASSERT_EQ(steps.size(), 2u);
    EXPECT_TRUE(steps[0].complete);
    EXPECT_FALSE(steps[1].complete);
    EXPECT_EQ(steps[1].seq_lengths, std::vector<int64_t>{21});
    expect_step_equals(t, 0, first, false);
    EXPECT_THROW(t.logprobs(1, 0), TraceIncomplete);
  }
  // A reader that stays open while the writer finishes this step and writes another one.
  TraceReader live = TraceReader::open(w->writing_path());
  w->end_step(r);
  const Recorded third = record_step(*w, batch_of({13}, 10));
  w->flush();
  EXPECT_EQ(live.steps().size(), 2u);  // until refreshed
  live.refresh();
  ASSERT_EQ(live.steps().size(), 3u);
  EXPECT_TRUE(live.steps()[2].complete);
  expect_step_equals(live, 2, third, false);
  w->close();
  TraceReader t = TraceReader::open(path);
  ASSERT_EQ(t.steps().size(), 3u);
  EXPECT_TRUE(t.steps()[1].complete);
  EXPECT_TRUE(test::bitwise_equal(t.logprobs(1, 0), r.seqs[0].logprobs));
}

#ifdef DSV4_SAMPLE_TRACE
// A recorder killed (SIGKILL) in the middle of a step, while the file is in SWMR-write mode: the
// file opens (SWMR read) and its finished step reads back.
TEST(Trace, KilledRecorderLeavesReadableSteps) {
  TempDir d;
  const std::string path = d / "killed.h5";
  std::vector<std::string> args = {DSV4_SAMPLE_TRACE, path, "--die-in-step"};
  std::vector<char*> argv;
  for (auto& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  pid_t pid = 0;
  ASSERT_EQ(posix_spawn(&pid, argv[0], nullptr, nullptr, argv.data(), environ), 0);
  int status = 0;
  ASSERT_EQ(waitpid(pid, &status, 0), pid);
  ASSERT_TRUE(WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL) << "status " << status;
  EXPECT_FALSE(fs::exists(path));
  const TraceReader t = TraceReader::open(path + ".incomplete");
  ASSERT_EQ(t.steps().size(), 2u);
  EXPECT_TRUE(t.steps()[0].complete);
  EXPECT_FALSE(t.steps()[1].complete);
  EXPECT_EQ(int64_t(t.tokens(0, 0).size()), t.steps()[0].seq_lengths[0]);
  EXPECT_FALSE(t.digests(0, 0).values.empty());
  EXPECT_THROW(t.tokens(1, 0), TraceIncomplete);
}
#endif

TEST(Trace, ManifestContractIsChecked) {
  TempDir d;
  auto w = create(d / "m.h5", "decisions");
  w->begin_step(spec_of(batch_of({8}, 10), false));
  ForwardResult empty;
  empty.seqs.resize(1);
  empty.seqs[0].logprobs.resize(7);
  // end_step() queues the check; the writer's error surfaces at the next call that waits for it.
  w->end_step(empty);
  const std::string msg = error_of([&] { w->flush(); });
  EXPECT_NE(msg.find("did not report tensor 'embed'"), std::string::npos) << msg;
  EXPECT_NE(error_of([&] { w->close(); }).find("did not report tensor 'embed'"), std::string::npos);
}

// ---- bad files --------------------------------------------------------------------------------

void make_trace(const std::string& path, const std::string& policy) {
  auto w = create(path, policy);
  record_step(*w, batch_of({64}, 11));
  w->close();
}

template <typename E>
void expect_error(const std::string& path, const std::string& text) {
  try {
    const TraceReader t = TraceReader::open(path);
    FAIL() << path << " opened";
  } catch (const E& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find(path), std::string::npos) << msg;
    EXPECT_NE(msg.find(text), std::string::npos) << msg;
  } catch (const std::exception& e) {
    FAIL() << "wrong error type: " << e.what();
  }
}

// The file offset and size of the first chunk of `dataset`: the chunk's stored bytes (direct chunk
// read), found in the file. Works for every chunk index type (H5Dget_chunk_info does not in 1.10).
std::pair<uint64_t, uint64_t> first_chunk(const std::string& path, const std::string& dataset) {
  std::vector<char> chunk;
  {
    hid_t f = H5Fopen(path.c_str(), H5F_ACC_RDONLY, H5P_DEFAULT);
    hid_t ds = H5Dopen2(f, dataset.c_str(), H5P_DEFAULT);
    hsize_t offset[3] = {};
    hsize_t size = 0;
    uint32_t filters = 0;
    if (H5Dget_chunk_storage_size(ds, offset, &size) >= 0 && size > 0) {
      chunk.resize(size);
      if (H5Dread_chunk(ds, H5P_DEFAULT, offset, &filters, chunk.data()) < 0) chunk.clear();
    }
    H5Dclose(ds);
    H5Fclose(f);
  }
  if (chunk.size() < 8) return {0, 0};
  std::ifstream in(path, std::ios::binary);
  const std::string file((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const size_t at = file.find(std::string_view(chunk.data(), chunk.size()));
  if (at == std::string::npos) return {0, 0};
  return {at, chunk.size()};
}

void flip_byte(const std::string& path, uint64_t at) {
  std::fstream f(path, std::ios::in | std::ios::out | std::ios::binary);
  f.seekg(std::streamoff(at));
  char c = 0;
  f.read(&c, 1);
  c = char(c ^ 0x5a);
  f.seekp(std::streamoff(at));
  f.write(&c, 1);
}

TEST(Trace, ForeignAndDamagedFiles) {
  TempDir d;
  const std::string text = d / "text.h5";
  std::ofstream(text) << "hello, not a trace\n";
  expect_error<NotATrace>(text, "not an HDF5 file");

  const std::string plain = d / "plain.h5";
  {
    hid_t f = H5Fcreate(plain.c_str(), H5F_ACC_TRUNC, H5P_DEFAULT, H5P_DEFAULT);
    hid_t g = H5Gcreate2(f, "data", H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT);
    H5Gclose(g);
    H5Fclose(f);
  }
  expect_error<NotATrace>(plain, "an HDF5 file but not a dsv4 trace (no format attribute)");

  const std::string good = d / "good.h5";
  make_trace(good, "attn.q@1,logits");

  const std::string newer = d / "newer.h5";
  fs::copy_file(good, newer);
  {
    hid_t f = H5Fopen(newer.c_str(), H5F_ACC_RDWR, H5P_DEFAULT);
    hid_t a = H5Aopen(f, "format_version", H5P_DEFAULT);
    const int32_t v = 999;
    EXPECT_GE(H5Awrite(a, H5T_NATIVE_INT32, &v), 0);
    H5Aclose(a);
    H5Fclose(f);
    seal_trace(newer);  // a newer writer's file is sealed too
  }
  expect_error<UnsupportedTraceVersion>(newer, "format_version 999 is newer than this dsv4 reads (" +
                                                   std::to_string(kTraceFormatVersion) + "); upgrade dsv4");
  expect_error<UnsupportedTraceVersion>(newer, "written by dsv4 ");

  const std::string truncated = d / "truncated.h5";
  fs::copy_file(good, truncated);
  fs::resize_file(truncated, fs::file_size(good) / 2);
  expect_error<TraceCorrupt>(truncated, "damaged: the file no longer matches the seal");
  expect_error<TraceCorrupt>(truncated, "cut short");
  // Behind the seal (a file without one, or --no-seal-check), HDF5 refuses it.
  set_seal_checks(false);
  expect_error<TraceError>(truncated, "cannot open");

  // A flipped byte inside a data chunk: the seal refuses the file; behind it, the read of that dataset
  // fails with the fletcher32 checksum error.
  struct Case {
    std::string dataset;
    std::function<void(const TraceReader&)> read;
  };
  const std::string seq = "/steps/000000/seq_000/";
  const std::vector<Case> cases = {
      {seq + "tokens", [](const TraceReader& t) { t.tokens(0, 0); }},
      {seq + "logprobs", [](const TraceReader& t) { t.logprobs(0, 0); }},
      {seq + "decisions/layer_001/indexer_gaps", [](const TraceReader& t) { t.indexer(0, 0, 1); }},
      {seq + "decisions/layer_003/experts", [](const TraceReader& t) { t.routing(0, 0, 3); }},
      {seq + "digests/value", [](const TraceReader& t) { t.digests(0, 0); }},
      {seq + "tensors/logits/model", [](const TraceReader& t) { t.tensor(0, 0, -1, "logits"); }},
  };
  for (size_t i = 0; i < cases.size(); ++i) {
    const std::string bad = d / ("flipped" + std::to_string(i) + ".h5");
    fs::copy_file(good, bad);
    const auto [addr, size] = first_chunk(bad, cases[i].dataset);
    ASSERT_GT(size, 0u) << cases[i].dataset;
    flip_byte(bad, addr + size / 2);
    set_seal_checks(true);
    expect_error<TraceCorrupt>(bad, "damaged: the file no longer matches the seal");
    set_seal_checks(false);
    const TraceReader t = TraceReader::open(bad);  // metadata is intact
    try {
      cases[i].read(t);
      ADD_FAILURE() << cases[i].dataset << ": a flipped byte went unnoticed";
    } catch (const TraceError& e) {
      const std::string msg = e.what();
      EXPECT_NE(msg.find(bad), std::string::npos) << msg;
      EXPECT_NE(msg.find(cases[i].dataset), std::string::npos) << msg;
      EXPECT_NE(msg.find("Fletcher32 checksum"), std::string::npos) << msg;  // HDF5's innermost message
    }
  }
  set_seal_checks(true);
}

// Bytes per token of a 'decisions' trace of the tiny preset at T=512 (docs/TRACE_SIZES.md).
TEST(Trace, SizesOfADecisionsTrace) {
  TempDir d;
  const std::string path = d / "sizes.h5";
  auto w = create(path, "decisions");
  record_step(*w, batch_of({512}, 12));
  w->close();
  const TraceReader t = TraceReader::open(path);
  int64_t seq_stored = 0, seq_logical = 0, dec_stored = 0, dec_logical = 0;
  for (const auto& g : t.sizes()) {
    if (g.group == "/steps/000000/seq_000") seq_stored = g.stored_bytes, seq_logical = g.logical_bytes;
    if (g.group == "/steps/000000/seq_000/decisions")
      dec_stored = g.stored_bytes, dec_logical = g.logical_bytes;
    EXPECT_LE(g.stored_bytes, g.logical_bytes + 4096) << g.group;
  }
  ASSERT_GT(seq_stored, 0);
  ASSERT_GT(dec_stored, 0);
  EXPECT_LT(dec_stored, dec_logical);
  std::printf(
      "tiny, T=512, capture 'decisions': stored %.1f B/token for the sequence (%.1f logical), %.1f B/token "
      "for its decisions (%.1f logical); file %lld bytes\n",
      seq_stored / 512.0, seq_logical / 512.0, dec_stored / 512.0, dec_logical / 512.0,
      (long long)t.file_bytes());
  RecordProperty("bytes_per_token_stored", std::to_string(seq_stored / 512.0));
}

}  // namespace
}  // namespace dsv4
