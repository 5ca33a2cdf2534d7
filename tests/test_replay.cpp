// End-to-end record → replay in rr's shape: the tiny model records a step with the TraceWriter, the
// replay re-executes it and must be bit-identical across profiles, thread counts, sequence lengths
// and batches. Doctored copies of a trace (edited with the HDF5 C API at the paths of
// traces/FORMAT.md) must make the replay name exactly what was changed: a digest, a decision, a
// weight byte, an environment field. Also the counterfactual (another trace's decisions), the
// bundle, and bad input.
#include <gtest/gtest.h>
#include <hdf5.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>
#include <set>
#include <stdexcept>
#include <string>
#include <tuple>
#include <vector>

#include "capture/digest.h"
#include "capture/env.h"
#include "capture/errors.h"
#include "capture/trace_reader.h"
#include "capture/trace_writer.h"
#include "cli_util.h"
#include "h5_edit.h"
#include "model/checkpoint.h"
#include "model/collect.h"
#include "model/error.h"
#include "model/forward.h"
#include "model/manifest.h"
#include "model/tokens.h"
#include "model/weights.h"
#include "replay/replay.h"
#include "test_util.h"
#include "tiny_model.h"
#include "trace_test_util.h"

namespace dsv4 {
namespace {

namespace fs = std::filesystem;

using test::H5Edit;
using test::tiny;

// A fresh directory per test, named after it, removed when the test ends.
struct Scratch {
  fs::path dir;
  Scratch() {
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    dir = fs::path(::testing::TempDir()) /
          ("dsv4_replay_" + std::to_string(getpid()) + "_" + info->test_suite_name() + "_" + info->name());
    fs::remove_all(dir);
    fs::create_directories(dir);
  }
  ~Scratch() {
    std::error_code ec;
    fs::remove_all(dir, ec);
  }
};

struct StepIn {
  std::vector<std::vector<int32_t>> seqs;
  std::string profile = "train";
  int threads = 1;
};

// Records `steps` into a new trace at `path` the way `dsv4 record` does (one writer, one step each).
fs::path record(const fs::path& path, const std::vector<StepIn>& steps, const Weights& w = tiny(),
                const std::string& capture = "decisions") {
  TraceWriter::Options o;
  o.policy = CapturePolicy::parse(capture);
  auto writer = TraceWriter::create(path.string(), w.config(), make_trace_header(w), o);
  for (const StepIn& in : steps) {
    StepSpec s;
    s.profile = in.profile;
    s.kind = in.profile == "rollout" ? "rollout" : "train";
    s.threads = in.threads;
    s.seqs = in.seqs;
    RunOptions ro;
    ro.profile = profile_by_name(in.profile);
    ro.threads = in.threads;
    ro.observer = &writer->begin_step(s);
    writer->end_step(forward(w, s.seqs, ro));
  }
  writer->close();
  return path;
}

fs::path copy_of(const fs::path& trace, const std::string& name) {
  const fs::path out = trace.parent_path() / name;
  fs::copy_file(trace, out, fs::copy_options::overwrite_existing);
  return out;
}

// Records the replay of one sequence must compare: the model's tensor manifest for its length.
int64_t manifest_records(const std::vector<std::vector<int32_t>>& seqs) {
  int64_t n = 0;
  for (const auto& s : seqs) n += int64_t(tensor_manifest(tiny().config(), int64_t(s.size())).size());
  return n;
}

void expect_identical(const ReplayReport& rep, const std::vector<StepIn>& steps, const std::string& what) {
  EXPECT_TRUE(rep.identical()) << what;
  EXPECT_TRUE(rep.weight_mismatches.empty()) << what;
  ASSERT_EQ(rep.steps.size(), steps.size()) << what;
  for (size_t i = 0; i < steps.size(); ++i) {
    const StepReplay& s = rep.steps[i];
    EXPECT_TRUE(s.identical) << what << " step " << i;
    EXPECT_FALSE(s.first.has_value())
        << what << " step " << i << ": " << s.first->tensor << " layer " << s.first->layer << " row "
        << s.first->row << " (" << s.first->reason << ")";
    EXPECT_TRUE(s.decision_changes.empty()) << what << " step " << i;
    EXPECT_EQ(s.records_compared, manifest_records(steps[i].seqs)) << what << " step " << i;
    EXPECT_EQ(s.rows_differing, 0) << what << " step " << i;
    EXPECT_GT(s.rows_compared, 0) << what << " step " << i;
  }
}

// Steps of one sequence of 1, 17 and 130 tokens, then a batch of two sequences (40 and 5 tokens).
std::vector<StepIn> length_steps(const std::string& profile, int threads) {
  std::vector<StepIn> steps;
  uint64_t seed = 100;
  for (int64_t T : {1, 17, 130}) steps.push_back({{random_tokens(T, 512, seed++)}, profile, threads});
  steps.push_back({{random_tokens(40, 512, seed++), random_tokens(5, 512, seed++)}, profile, threads});
  return steps;
}

TEST(Replay, BitIdenticalAcrossProfilesThreadsAndLengths) {
  const Scratch scratch;
  const fs::path& dir = scratch.dir;
  for (const std::string profile : {"train", "rollout"}) {
    for (const auto& [rec_threads, rep_threads] : {std::pair{1, 2}, std::pair{2, 1}}) {
      const std::string what = profile + " recorded with " + std::to_string(rec_threads) +
                               " thread(s), replayed with " + std::to_string(rep_threads);
      const auto steps = length_steps(profile, rec_threads);
      const fs::path trace = record(dir / (profile + "_" + std::to_string(rec_threads) + ".h5"), steps);
      ReplayOptions opt;
      opt.threads = rep_threads;
      const ReplayReport rep = replay_trace(trace.string(), opt);
      expect_identical(rep, steps, what);
      for (const auto& s : rep.steps) EXPECT_EQ(s.threads, rep_threads);
      EXPECT_EQ(rep.model_source, "init:seed=7");
      if (rec_threads == 2) {
        // Indexer and routing replay of the recorded decisions reproduce the recording too.
        opt.force_indexer = opt.force_routing = true;
        expect_identical(replay_trace(trace.string(), opt), steps, what + ", forced decisions");
      }
    }
  }
}

TEST(Replay, OneStepOfSeveral) {
  const Scratch scratch;
  const fs::path& dir = scratch.dir;
  const auto steps = length_steps("train", 1);
  const fs::path trace = record(dir / "t.h5", steps);
  ReplayOptions opt;
  opt.step = 2;
  const ReplayReport rep = replay_trace(trace.string(), opt);
  ASSERT_EQ(rep.steps.size(), 1u);
  EXPECT_EQ(rep.steps[0].step, 2);
  EXPECT_TRUE(rep.identical());
  EXPECT_EQ(rep.steps[0].records_compared, manifest_records(steps[2].seqs));
}

// Index of the digest of (tensor, layer, row) in a sequence's digests/value.
int64_t digest_index(const fs::path& trace, const std::string& tensor, int layer, int64_t row) {
  const DigestTable d = TraceReader::open(trace.string()).digests(0, 0);
  for (const auto& r : d.records)
    if (r.name == tensor && r.layer == layer) return r.first + row;
  throw std::runtime_error("no digest record " + tensor);
}

TEST(Replay, ChangedDigestNamesTensorLayerAndRow) {
  const Scratch scratch;
  const fs::path& dir = scratch.dir;
  const std::vector<StepIn> steps{{{random_tokens(17, 512, 5)}}};
  const fs::path trace = record(dir / "t.h5", steps, tiny(), "attn.q@2");
  const std::string seq = "/steps/000000/seq_000";

  // Only the digest changes: the recorded full tensor still equals the replay, so the report says
  // the digest itself is wrong.
  const fs::path bad = copy_of(trace, "digest.h5");
  const int64_t at = digest_index(bad, "attn.q", 2, 3);
  {
    H5Edit e(bad);
    auto v = e.read<uint64_t>(seq + "/digests/value", H5T_NATIVE_UINT64);
    v[size_t(at)] ^= 1;
    e.write(seq + "/digests/value", H5T_NATIVE_UINT64, v);
  }
  ReplayReport rep = replay_trace(bad.string(), {});
  EXPECT_FALSE(rep.identical());
  ASSERT_EQ(rep.steps.size(), 1u);
  ASSERT_TRUE(rep.steps[0].first.has_value());
  const Divergence& d = *rep.steps[0].first;
  EXPECT_EQ(d.seq, 0);
  EXPECT_EQ(d.tensor, "attn.q");
  EXPECT_EQ(d.layer, 2);
  EXPECT_EQ(d.row, 3);
  EXPECT_EQ(rep.steps[0].rows_differing, 1);
  EXPECT_EQ(rep.steps[0].records_differing, 1);
  EXPECT_EQ(rep.steps[0].records_compared, manifest_records(steps[0].seqs));  // counting goes on
  const auto& c = tiny().config();
  ASSERT_EQ(d.replayed_row.size(), size_t(c.num_attention_heads * c.head_dim));
  EXPECT_FALSE(test::all_zero(d.replayed_row));
  EXPECT_TRUE(d.has_elements);
  EXPECT_EQ(d.first_index, -1);
  EXPECT_NE(d.reason.find("digest itself"), std::string::npos) << d.reason;

  // Digest and full tensor both changed at element 4 of that row: the element diff finds it, one
  // bf16 ulp away from the replayed value.
  const fs::path bad2 = copy_of(bad, "digest_and_tensor.h5");
  std::vector<hsize_t> dims;
  uint16_t original = 0;
  {
    H5Edit e(bad2);
    const std::string ds = seq + "/tensors/attn.q/layer_002";
    auto v = e.read<uint16_t>(ds, H5T_NATIVE_UINT16, &dims);
    ASSERT_EQ(dims.size(), 2u);
    original = v[size_t(3 * dims[1] + 4)];
    v[size_t(3 * dims[1] + 4)] = uint16_t(original + 1);
    e.write(ds, H5T_NATIVE_UINT16, v);
  }
  rep = replay_trace(bad2.string(), {});
  ASSERT_TRUE(rep.steps[0].first.has_value());
  const Divergence& e = *rep.steps[0].first;
  EXPECT_EQ(e.tensor, "attn.q");
  EXPECT_EQ(e.row, 3);
  ASSERT_TRUE(e.has_elements);
  EXPECT_EQ(e.first_index, 4);
  auto widen = [](uint16_t b) {
    const uint32_t u = uint32_t(b) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return double(f);
  };
  EXPECT_EQ(e.recorded, widen(uint16_t(original + 1)));
  EXPECT_EQ(e.replayed, widen(original));
  EXPECT_EQ(double(e.replayed_row[4]), widen(original));
  EXPECT_EQ(e.ulp, 1);
  EXPECT_GT(e.max_abs, 0);
  EXPECT_EQ(e.max_abs, std::fabs(e.recorded - e.replayed));
}

TEST(Replay, ChangedExpertIsADecisionChangeAndForcedItDivergesThere) {
  const Scratch scratch;
  const fs::path& dir = scratch.dir;
  const std::vector<StepIn> steps{{{random_tokens(33, 512, 9)}}};
  const fs::path trace = record(dir / "t.h5", steps);
  const fs::path bad = copy_of(trace, "expert.h5");
  // Layer 3, token 5: the first id replaced by an expert not in the row, the row kept ascending.
  test::doctor_routing_row(bad, 3, 5, tiny().config().n_routed_experts);

  // Free replay: the model's own choice differs from the (doctored) record at layer 3 token 5; the
  // digests do not cover decisions and still match.
  ReplayReport rep = replay_trace(bad.string(), {});
  ASSERT_EQ(rep.steps.size(), 1u);
  const StepReplay& s = rep.steps[0];
  EXPECT_FALSE(s.first.has_value());
  EXPECT_EQ(s.rows_differing, 0);
  ASSERT_EQ(s.decision_changes.size(), 1u);
  EXPECT_EQ(s.decision_changes[0].seq, 0);
  EXPECT_EQ(s.decision_changes[0].layer, 3);
  EXPECT_EQ(s.decision_changes[0].kind, "routing");
  EXPECT_EQ(s.decision_changes[0].first_row, 5);
  EXPECT_EQ(s.decision_changes[0].rows_changed, 1);
  EXPECT_FALSE(rep.identical());

  // Routing replay forces the doctored experts: the computation first differs in layer 3's MoE
  // output at token 5.
  ReplayOptions opt;
  opt.force_routing = true;
  rep = replay_trace(bad.string(), opt);
  ASSERT_TRUE(rep.steps[0].first.has_value());
  EXPECT_EQ(rep.steps[0].first->layer, 3);
  EXPECT_EQ(rep.steps[0].first->tensor, "moe.out");
  EXPECT_EQ(rep.steps[0].first->row, 5);
  EXPECT_TRUE(rep.steps[0].decision_changes.empty());  // the replay used exactly the recorded ids
}

// File offset of a tensor's data in a single-file safetensors checkpoint.
int64_t safetensors_offset(const fs::path& file, const std::string& name) {
  std::ifstream f(file, std::ios::binary);
  uint64_t n = 0;
  f.read(reinterpret_cast<char*>(&n), 8);
  std::string header(n, '\0');
  f.read(header.data(), std::streamsize(n));
  const auto j = nlohmann::json::parse(header);
  return 8 + int64_t(n) + j.at(name).at("data_offsets").at(0).get<int64_t>();
}

TEST(Replay, FlippedWeightByteIsNamed) {
  const Scratch scratch;
  const fs::path& dir = scratch.dir;
  tiny().save((dir / "ckpt").string());
  const std::vector<StepIn> steps{{{random_tokens(9, 512, 3)}}};
  const fs::path trace = record(dir / "t.h5", steps);

  // The saved checkpoint is the recorded model.
  ReplayOptions opt;
  opt.model_dir = (dir / "ckpt").string();
  expect_identical(replay_trace(trace.string(), opt), steps, "--model of the saved checkpoint");

  fs::copy(dir / "ckpt", dir / "flipped");
  const fs::path st = dir / "flipped" / "model.safetensors";
  const SafetensorsReader reader = SafetensorsReader::open(st.string());
  std::string name;
  for (const auto& n : reader.names())
    if (n.find("layers.2.") != std::string::npos && reader.info(n).dtype == StDType::BF16) {
      name = n;
      break;
    }
  ASSERT_FALSE(name.empty());
  const int64_t at = safetensors_offset(st, name);
  {
    std::fstream f(st, std::ios::in | std::ios::out | std::ios::binary);
    f.seekg(at);
    char b = 0;
    f.read(&b, 1);
    b = char(b ^ 0x01);  // lowest mantissa bit of the first bf16 value: still finite
    f.seekp(at);
    f.write(&b, 1);
  }
  const TraceReader r = TraceReader::open(trace.string());
  EXPECT_EQ(weight_mismatches(r, weights_for_trace(r, (dir / "flipped").string())),
            std::vector<std::string>{name});
  opt.model_dir = (dir / "flipped").string();
  const ReplayReport rep = replay_trace(trace.string(), opt);
  EXPECT_EQ(rep.weight_mismatches, std::vector<std::string>{name});
  EXPECT_FALSE(rep.identical());
}

// A model whose embedding row of one token is NaN: the NaN flows through the forward, and a
// divergence at a row holding NaN says that NaN bit patterns differ between CPU and CUDA.
TEST(Replay, DivergenceAtANanRowSaysNanBitsDifferAcrossDevices) {
  const Scratch scratch;
  const fs::path& dir = scratch.dir;
  Weights w = Weights::init(tiny().config(), 7);
  const int32_t bad_token = 11;
  const int64_t D = tiny().config().hidden_size;
  auto& embed = const_cast<WeightTensor&>(w.get("model.embed_tokens.weight"));
  for (int64_t d = 0; d < D; ++d)
    embed.f[size_t(bad_token * D + d)] = std::numeric_limits<float>::quiet_NaN();
  w.save((dir / "ckpt").string());
  const Weights nan_model = Weights::load(tiny().config(), (dir / "ckpt").string());
  std::vector<int32_t> toks = random_tokens(9, 512, 3);
  toks[4] = bad_token;
  const std::vector<StepIn> steps{{{toks}}};
  const fs::path trace = record(dir / "t.h5", steps, nan_model);
  ReplayOptions opt;
  opt.model_dir = (dir / "ckpt").string();
  expect_identical(replay_trace(trace.string(), opt), steps, "NaN model, same device");

  const std::string seq = "/steps/000000/seq_000";
  for (const int64_t row : {int64_t(4), int64_t(2)}) {  // the NaN token's row, and a clean row before it
    const fs::path bad = copy_of(trace, "nan_row" + std::to_string(row) + ".h5");
    const int64_t at = digest_index(bad, "embed", -1, row);
    {
      H5Edit e(bad);
      auto v = e.read<uint64_t>(seq + "/digests/value", H5T_NATIVE_UINT64);
      v[size_t(at)] ^= 1;
      e.write(seq + "/digests/value", H5T_NATIVE_UINT64, v);
    }
    const ReplayReport rep = replay_trace(bad.string(), opt);
    ASSERT_TRUE(rep.steps.at(0).first.has_value());
    const Divergence& dv = *rep.steps[0].first;
    EXPECT_EQ(dv.tensor, "embed");
    EXPECT_EQ(dv.row, row);
    const bool nan_row = row == 4;
    EXPECT_EQ(std::isnan(dv.replayed_row.at(0)), nan_row);
    EXPECT_EQ(dv.reason.find("NaN bit patterns") != std::string::npos, nan_row) << dv.reason;
  }
}

TEST(Replay, PlantedEnvDifferenceRanksCompileFlagsFirst) {
  const Scratch scratch;
  const fs::path& dir = scratch.dir;
  const fs::path trace = record(dir / "t.h5", {{{random_tokens(5, 512, 1)}}});
  const fs::path bad = copy_of(trace, "env.h5");
  {
    H5Edit e(bad);
    e.set_attr("/meta/env", "compile_flags", "-O3 -ffast-math");
    e.set_attr("/meta/env", "threads", "13");
  }
  const EnvFingerprint recorded = TraceReader::open(bad.string()).env();
  EnvFingerprint here = environment_fingerprint();
  here["threads"] = "2";
  const auto diffs = compare_env(recorded, here);
  ASSERT_GE(diffs.size(), 2u);
  EXPECT_EQ(diffs[0].key, "compile_flags");
  EXPECT_EQ(diffs[0].recorded, "-O3 -ffast-math");
  EXPECT_EQ(diffs[0].rank, 1);
  bool threads = false;
  for (const auto& d : diffs) {
    if (d.key == "threads") {
      threads = true;
      EXPECT_EQ(d.rank, 5);
      EXPECT_EQ(d.recorded, "13");
    }
    EXPECT_NE(d.key, "compiler");  // unchanged fields are not listed
  }
  EXPECT_TRUE(threads);

  // The replay reports the same ranking (and the results stay identical: env is not the model).
  const ReplayReport rep = replay_trace(bad.string(), {});
  ASSERT_FALSE(rep.env_differences.empty());
  EXPECT_EQ(rep.env_differences[0].key, "compile_flags");
  EXPECT_TRUE(rep.identical());
  // Host differences are expected; they rank last.
  const auto host = compare_env({{"host", "a"}, {"hdf5", "1"}}, {{"host", "b"}, {"hdf5", "2"}});
  ASSERT_EQ(host.size(), 2u);
  EXPECT_EQ(host.back().key, "host");
}

// A trace recorded on another instruction set (here planted: an aarch64 build, or an x86-64 one when
// this is aarch64) names both machines in the report, and the ISA difference heads the culprit list,
// before the compile flags.
TEST(Replay, AnotherIsaIsNamedAndRankedFirst) {
  const Scratch scratch;
  const fs::path trace = record(scratch.dir / "t.h5", {{{random_tokens(5, 512, 1)}}});
  const fs::path other = copy_of(trace, "other-isa.h5");
  const bool here_arm = build_isa() == "aarch64";
  const std::string isa = here_arm ? "x86-64-v3" : "aarch64", machine = here_arm ? "x86_64" : "aarch64";
  const std::string cpu = here_arm ? "AMD EPYC 9654" : "Neoverse-V2";
  {
    H5Edit e(other);
    e.set_attr("/meta/env", "isa", isa);
    e.set_attr("/meta/env", "machine", machine);
    e.set_attr("/meta/env", "cpu_model", cpu);
    e.set_attr("/meta/env", "compile_flags", "-O2 -ffp-contract=off");
  }
  const ReplayReport rep = replay_trace(other.string(), {});
  EXPECT_TRUE(rep.identical());
  const std::string recorded_on = isa + " build on " + machine + ", " + cpu;
  EXPECT_EQ(rep.recorded_on, recorded_on);
  EXPECT_EQ(rep.replayed_on, machine_summary(environment_fingerprint()));
  ASSERT_GE(rep.env_differences.size(), 3u);
  EXPECT_EQ(rep.env_differences[0].key, "isa");
  EXPECT_EQ(rep.env_differences[1].key, "machine");
  EXPECT_EQ(rep.env_differences[2].key, "compile_flags");
  // The CLI's last line says it in words.
  const auto r = test::run_cli("replay " + other.string());
  EXPECT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("recorded on " + recorded_on + ", replayed on " + rep.replayed_on + ": bit-identical"),
            std::string::npos)
      << r.out;
}

TEST(Replay, CounterfactualForcesTheOtherTracesDecisions) {
  const Scratch scratch;
  const fs::path& dir = scratch.dir;
  const auto toks = random_tokens(150, 512, 21);
  const fs::path a = record(dir / "a.h5", {{{toks}, "rollout"}});
  const fs::path b = record(dir / "b.h5", {{{toks}, "train"}});

  ReplayOptions opt;
  opt.take_decisions_from = a.string();
  const ReplayReport rep = replay_trace(b.string(), opt);
  ASSERT_EQ(rep.steps.size(), 1u);
  const StepReplay& s = rep.steps[0];
  ASSERT_TRUE(s.counterfactual_decisions_equal.has_value());
  EXPECT_TRUE(*s.counterfactual_decisions_equal);
  EXPECT_TRUE(s.counterfactual_mismatches.empty());
  EXPECT_FALSE(s.decision_changes.empty())
      << "the rollout and train profiles should decide differently at T=150";
  ASSERT_TRUE(s.mean_abs_dlogprob_before && s.mean_abs_dlogprob_after && s.kl_before && s.kl_after);
  EXPECT_GT(*s.mean_abs_dlogprob_before, 0);
  EXPECT_GE(*s.mean_abs_dlogprob_after, 0);
  EXPECT_TRUE(std::isfinite(*s.kl_before) && std::isfinite(*s.kl_after));

  // Bitwise: the decisions of B's model forced with A's recorded decisions are A's id tables.
  const TraceReader ra = TraceReader::open(a.string());
  DecisionLog forced_from_a;
  for (int layer : ra.decision_layers(0, 0)) {
    if (auto x = ra.indexer(0, 0, layer)) forced_from_a.indexer[{0, layer}] = *x;
    if (auto x = ra.routing(0, 0, layer)) forced_from_a.routing[{0, layer}] = *x;
  }
  const Overrides ov = forced_from_a.to_overrides();
  DecisionLog got;
  RunOptions ro;
  ro.profile = profile_train();
  ro.observer = &got;
  ro.overrides = &ov;
  forward(tiny(), {toks}, ro);
  ASSERT_EQ(got.indexer.size(), forced_from_a.indexer.size());
  for (const auto& [key, x] : forced_from_a.indexer)
    EXPECT_EQ(got.indexer.at(key).ids, x.ids) << "indexer layer " << key.second;
  ASSERT_EQ(got.routing.size(), forced_from_a.routing.size());
  for (const auto& [key, x] : forced_from_a.routing)
    EXPECT_EQ(got.routing.at(key).ids, x.ids) << "routing layer " << key.second;
}

TEST(Replay, BundleReplaysWithoutTheOriginalCheckpoint) {
  const Scratch scratch;
  const fs::path& dir = scratch.dir;
  tiny().save((dir / "ckpt").string());
  const Weights w = open_checkpoint((dir / "ckpt").string());
  const std::vector<StepIn> steps{{{random_tokens(20, 512, 4)}}};
  const fs::path trace = record(dir / "t.h5", steps, w);

  const fs::path out = dir / "bundle";
  bundle_trace(trace.string(), "", out.string());
  std::ifstream mf(out / "MANIFEST.json");
  const auto m = nlohmann::json::parse(mf);
  EXPECT_EQ(m.at("trace"), "t.h5");
  EXPECT_EQ(m.at("model_digest"), TraceReader::open(trace.string()).model().model_digest);
  std::set<std::string> names;
  for (const auto& f : m.at("files")) {
    const std::string n = f.at("name");
    names.insert(n);
    std::ifstream in(out / n, std::ios::binary);
    const std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    EXPECT_EQ(f.at("bytes").get<int64_t>(), int64_t(bytes.size())) << n;
    EXPECT_EQ(f.at("xxh3").get<std::string>(), hex16(xxh3_64(bytes.data(), bytes.size()))) << n;
  }
  EXPECT_EQ(names, (std::set<std::string>{"t.h5", "model/config.json", "model/model.safetensors"}));

  fs::rename(dir / "ckpt", dir / "moved");  // the bundle must not need the original
  expect_identical(replay_trace((out / "t.h5").string(), {}), steps, "bundled trace, recorded weights path");
  ReplayOptions opt;
  opt.model_dir = (out / "model").string();
  expect_identical(replay_trace((out / "t.h5").string(), opt), steps, "bundled trace, --model bundle/model");

  EXPECT_THROW(bundle_trace(trace.string(), (dir / "moved").string(), out.string()), InputError);
}

TEST(Replay, BadInputIsAnInputError) {
  const Scratch scratch;
  const fs::path& dir = scratch.dir;
  auto message = [](auto&& f) -> std::string {
    try {
      f();
    } catch (const InputError& e) {
      return e.what();
    } catch (const std::exception& e) {
      return std::string("not an InputError: ") + e.what();
    }
    return "no exception";
  };

  {
    std::ofstream(dir / "text.h5") << "not a trace\n";
    const std::string m = message([&] { replay_trace((dir / "text.h5").string(), {}); });
    EXPECT_NE(m.find("text.h5"), std::string::npos) << m;
  }

  const auto toks = random_tokens(12, 512, 2);
  const fs::path trace = record(dir / "t.h5", {{{toks}}, {{toks}}});
  {
    ReplayOptions opt;
    opt.step = 2;
    const std::string m = message([&] { replay_trace(trace.string(), opt); });
    EXPECT_NE(m.find("no step 2"), std::string::npos) << m;
    EXPECT_NE(m.find("has 2 steps"), std::string::npos) << m;
  }
  {
    auto other = toks;
    other[7] = (other[7] + 1) % 512;
    const fs::path b = record(dir / "other.h5", {{{other}}});
    ReplayOptions opt;
    opt.take_decisions_from = b.string();
    opt.take_step = 0;
    const std::string m = message([&] { replay_trace(trace.string(), opt); });
    EXPECT_NE(m.find("other tokens"), std::string::npos) << m;
    EXPECT_NE(m.find("position 7"), std::string::npos) << m;
  }
  {
    // A trace recorded from a checkpoint that is gone: the message says to pass --model.
    tiny().save((dir / "ckpt").string());
    const fs::path t2 = record(dir / "t2.h5", {{{toks}}}, open_checkpoint((dir / "ckpt").string()));
    fs::remove_all(dir / "ckpt");
    const std::string m = message([&] { replay_trace(t2.string(), {}); });
    EXPECT_NE(m.find("--model"), std::string::npos) << m;
  }
}

TEST(Replay, IncompleteStepsAreSkipped) {
  const Scratch scratch;
  const fs::path& dir = scratch.dir;
  const std::vector<StepIn> steps{{{random_tokens(8, 512, 6)}}};
  fs::path partial;
  {
    TraceWriter::Options o;
    auto writer = TraceWriter::create((dir / "t.h5").string(), tiny().config(), make_trace_header(tiny()), o);
    RunOptions ro;
    ro.threads = 1;
    StepSpec s;
    s.threads = 1;
    s.seqs = steps[0].seqs;
    ro.observer = &writer->begin_step(s);
    writer->end_step(forward(tiny(), s.seqs, ro));
    writer->begin_step(s);  // never finished: what a killed recorder leaves
    partial = writer->writing_path();
  }
  const ReplayReport rep = replay_trace(partial.string(), {});
  ASSERT_EQ(rep.skipped.size(), 1u);
  EXPECT_EQ(rep.skipped[0].step, 1);
  EXPECT_NE(rep.skipped[0].reason.find("incomplete (status 0)"), std::string::npos) << rep.skipped[0].reason;
  EXPECT_FALSE(rep.verified_all());
  expect_identical(rep, steps, "the complete step of a partial trace");
  ReplayOptions opt;
  opt.step = 1;
  EXPECT_THROW(replay_trace(partial.string(), opt), TraceIncomplete);
}

}  // namespace
}  // namespace dsv4

namespace dsv4 {
namespace {

// Launches with the given names, grid x and shared memory; times grow with the index (times and ids
// never count as differences).
KernelRecords launches(std::initializer_list<std::tuple<const char*, int, int64_t>> ks) {
  std::vector<test::Launch> ls;
  for (const auto& [name, grid, smem] : ks)
    ls.push_back({name, {grid, 1, 1}, smem, 0, int64_t(ls.size()) * 10, 5 + int64_t(ls.size())});
  return test::kernel_records(ls);
}

TEST(CompareKernels, FirstDifferingLaunch) {
  const KernelRecords rec = launches({{"a", 4, 0}, {"b", 8, 1024}, {"c", 2, 0}});
  {
    StepReplay sr;
    KernelRecords rep = rec;
    for (auto& k : rep.kernels) k.end_ns += 1000, k.correlation += 7, k.registers = 99;
    compare_kernels(rec, rep, sr);
    ASSERT_TRUE(sr.kernels_equal.has_value());
    EXPECT_TRUE(*sr.kernels_equal);
    EXPECT_EQ(sr.kernel_first_difference, -1);
    EXPECT_EQ(sr.kernels_recorded, 3);
    EXPECT_EQ(sr.kernels_replayed, 3);
  }
  {
    StepReplay sr;
    compare_kernels(rec, launches({{"a", 4, 0}, {"b", 16, 1024}, {"c", 2, 0}}), sr);
    EXPECT_FALSE(*sr.kernels_equal);
    EXPECT_EQ(sr.kernel_first_difference, 1);
    EXPECT_NE(sr.kernels_note.find("grid (8,1,1)"), std::string::npos) << sr.kernels_note;
    EXPECT_NE(sr.kernels_note.find("grid (16,1,1)"), std::string::npos) << sr.kernels_note;
  }
  {
    StepReplay sr;
    compare_kernels(rec, launches({{"a", 4, 0}, {"b", 8, 2048}, {"c", 2, 0}}), sr);
    EXPECT_EQ(sr.kernel_first_difference, 1);  // shared memory
  }
  {
    StepReplay sr;
    compare_kernels(rec, launches({{"a", 4, 0}, {"x", 8, 1024}}), sr);
    EXPECT_EQ(sr.kernel_first_difference, 1);  // name
  }
  {
    StepReplay sr;
    compare_kernels(rec, launches({{"a", 4, 0}, {"b", 8, 1024}}), sr);
    EXPECT_FALSE(*sr.kernels_equal);
    EXPECT_EQ(sr.kernel_first_difference, 2);
    EXPECT_NE(sr.kernels_note.find("the replay launched no more kernels"), std::string::npos)
        << sr.kernels_note;
  }
  {
    StepReplay sr;
    compare_kernels(launches({{"a", 4, 0}}), rec, sr);
    EXPECT_EQ(sr.kernel_first_difference, 1);
    EXPECT_NE(sr.kernels_note.find("the trace records no more kernels"), std::string::npos)
        << sr.kernels_note;
  }
  {
    StepReplay sr;
    KernelRecords none;
    none.reason = "built without CUDA";
    compare_kernels(rec, none, sr);
    EXPECT_FALSE(sr.kernels_equal.has_value());
    EXPECT_NE(sr.kernels_note.find("built without CUDA"), std::string::npos);
  }
}

// The report kernels (row digests, snapshot copies) depend on the observer, not on the model: a
// recording that took its reports late launched copies that an immediate replay does not, and neither
// counts them; a model launch between them still differs where it differs.
TEST(CompareKernels, ReportKernelsAreLeftOut) {
  const char* digest = "void dsv4::cuda::(anonymous namespace)::digest_rows_kernel<Bf16Patterns>(long)";
  const char* copies = "dsv4::cuda::(anonymous namespace)::copy_words_kernel(WordCopies)";
  const KernelRecords rec =
      launches({{"a", 4, 0}, {digest, 9, 1152}, {copies, 3, 0}, {"b", 8, 1024}, {copies, 1, 0}, {"c", 2, 0}});
  {
    StepReplay sr;
    compare_kernels(rec, launches({{"a", 4, 0}, {digest, 9, 1152}, {"b", 8, 1024}, {"c", 2, 0}}), sr);
    ASSERT_TRUE(sr.kernels_equal.has_value());
    EXPECT_TRUE(*sr.kernels_equal) << sr.kernels_note;
    EXPECT_EQ(sr.kernels_recorded, 3);
    EXPECT_EQ(sr.kernels_replayed, 3);
  }
  {
    StepReplay sr;
    compare_kernels(rec, launches({{"a", 4, 0}, {copies, 1, 0}, {"b", 8, 1024}, {"x", 2, 0}}), sr);
    EXPECT_FALSE(*sr.kernels_equal);
    EXPECT_EQ(sr.kernel_first_difference, 2);  // among the model's launches
    EXPECT_NE(sr.kernels_note.find("replayed x"), std::string::npos) << sr.kernels_note;
  }
  EXPECT_TRUE(is_report_kernel(rec.kernels[1]));
  EXPECT_FALSE(is_report_kernel(rec.kernels[0]));
  const std::vector<KernelRecord> model = model_launches(rec);
  ASSERT_EQ(model.size(), 3u);
  EXPECT_EQ(model[1].name, "b");
}

}  // namespace
}  // namespace dsv4
