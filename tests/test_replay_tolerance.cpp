// `dsv4 replay --tolerance` (replay/tolerance.h): a step in fast numerics that cannot be replayed bit for
// bit here is re-executed in exact numerics with its recorded decisions forced and compared within
// tolerances. The CPU cannot record fast numerics, so the traces here are exact recordings whose stored
// profile is rewritten to its fast form (`train.fast`: name, text and digest) and whose env says they
// were recorded on an sm_90 GPU: the replay on the CPU then recomputes exactly the recorded numbers, so
// every rel-L2 is 0, and a recorded tensor or log-prob perturbed by a known amount must come back as
// exactly the rel-L2 that amount gives.
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <gtest/gtest.h>
#include <hdf5.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "capture/trace_reader.h"
#include "cli_util.h"
#include "h5_edit.h"
#include "kernels/reduce.h"
#include "model/error.h"
#include "model/profile.h"
#include "replay/replay.h"
#include "replay/tolerance.h"
#include "test_util.h"
#include "tiny_model.h"

namespace dsv4 {
namespace {

namespace fs = std::filesystem;
using test::H5Edit;

std::string read_text(const std::string& path) {
  std::ifstream f(path);
  return std::string(std::istreambuf_iterator<char>(f), {});
}

nlohmann::json read_json(const std::string& path) {
  return nlohmann::json::parse(read_text(path));
}

// Rewrites step `step`'s stored profile to its fast form and the env's GPU architecture, as a
// `record --device cuda --numerics fast` on that GPU would have stored them.
void make_fast(const std::string& trace, int step = 0, const std::string& arch = "sm_90") {
  const TraceStepInfo info = TraceReader::open(trace).steps().at(size_t(step));
  const NumericsProfile fast = with_numerics(recorded_profile(info, trace), Numerics::fast);
  H5Edit e(trace);
  e.set_attr(info.group, "profile", fast.name);
  e.set_attr(info.group, "profile_text", profile_text(fast));
  e.set_attr(info.group, "profile_digest", profile_digest(fast));
  e.set_attr("/meta/env", "gpu_arch", arch);
}

// A fast-looking trace of the tiny preset: 60 random tokens recorded with `capture`.
std::string fast_trace(const test::TempDir& d, const std::string& name, const std::string& capture = "full") {
  const std::string t = d / name;
  const auto r = test::run_cli("record --preset tiny --seed 7 --random 60 --capture " + capture + " --out " + t);
  EXPECT_EQ(r.code, 0) << r.out;
  make_fast(t);
  return t;
}

// rel-L2 of `replayed` against `recorded`, computed here in long double: ||b − a|| / ||a||.
double rel_l2(const std::vector<float>& recorded, const std::vector<float>& replayed) {
  long double num = 0, den = 0;
  for (size_t i = 0; i < recorded.size(); ++i) {
    const long double d = (long double)replayed[i] - (long double)recorded[i];
    num += d * d;
    den += (long double)recorded[i] * recorded[i];
  }
  return double(std::sqrt(num / den));
}

bool has(const std::string& out, const std::string& what) {
  return out.find(what) != std::string::npos;
}

// The sites fast numerics put in the tensor_core order, as the messages list them.
std::string fast_sites() {
  return fmt::format("{}", fmt::join(tensor_core_sites(with_numerics(profile_train(), Numerics::fast)), ", "));
}

// ---- the CLI ------------------------------------------------------------------------------------------

// Without --tolerance nothing changes: the fast step is refused before it runs, and the sentence now
// names --tolerance as the other way out.
TEST(ReplayTolerance, FastStepIsRefusedWithoutTolerance) {
  test::TempDir d;
  const std::string t = fast_trace(d, "fast.h5");
  const auto r = test::run_cli("replay " + t);
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_TRUE(has(r.out, "step 0: recorded in fast numerics (profile 'train.fast': " + fast_sites() +
                             " = tensor_core) on a GPU of architecture sm_90"))
      << r.out;
  EXPECT_TRUE(has(r.out, "this replay would run on the cpu: replay it with --device cuda on a sm_90 GPU, or give "
                         "--tolerance to re-execute it in exact numerics"))
      << r.out;
  // The library says the same without the option.
  try {
    replay_trace(t, {});
    ADD_FAILURE() << "no error";
  } catch (const InputError& e) {
    EXPECT_TRUE(has(e.what(), "--tolerance")) << e.what();
  }
}

// A fast step replays bit for bit only on a GPU of the recorded architecture with tensor-core kernels of
// the recorded revision (a trace without the revision is taken at revision 1); every other case says what
// was recorded, what alone reproduces it, where the replay would run and what to do instead.
TEST(ReplayTolerance, FastReplayNeedsTheRecordedArchitectureAndRevision) {
  const EnvFingerprint env = {{"gpu_arch", "sm_90"}, {"tensor_core_revision", "3"}, {"build_id", "abc123"}};
  EXPECT_FALSE(fast_replay_obstacle(env, Device::cuda, "sm_90", 3));

  // Another architecture, or no GPU: the architecture is named, whatever the revisions.
  for (const int rev : {3, 4}) {
    const auto o = fast_replay_obstacle(env, Device::cuda, "sm_80", rev);
    ASSERT_TRUE(o);
    EXPECT_EQ(o->recorded, "a GPU of architecture sm_90");
    EXPECT_EQ(o->only, "a GPU of that architecture");
    EXPECT_EQ(o->here, "a GPU of architecture sm_80");
    EXPECT_EQ(o->remedy, "replay it with --device cuda on a sm_90 GPU");
  }
  const auto cpu = fast_replay_obstacle(env, Device::cpu, "sm_90", 3);
  ASSERT_TRUE(cpu);
  EXPECT_EQ(cpu->here, "the cpu");

  // The recorded architecture, another revision: the revision and the recording's build are named.
  const auto rev = fast_replay_obstacle(env, Device::cuda, "sm_90", 4);
  ASSERT_TRUE(rev);
  EXPECT_EQ(rev->recorded, "a GPU of architecture sm_90 by tensor-core kernels of revision 3");
  EXPECT_EQ(rev->only, "tensor-core kernels of that revision");
  EXPECT_EQ(rev->here, "a GPU of architecture sm_90 with this build's tensor-core kernels, revision 4");
  EXPECT_EQ(
      rev->remedy,
      "replay it with a build whose tensor-core kernels are revision 3 (the recording's build_id: abc123)");

  // A value that is not this build's number never matches it.
  EXPECT_TRUE(fast_replay_obstacle({{"gpu_arch", "sm_90"}, {"tensor_core_revision", "03"}}, Device::cuda,
                                   "sm_90", 3));

  // Written before the key existed: revision 1. Written before gpu_arch existed: never bitwise.
  const EnvFingerprint old = {{"gpu_arch", "sm_90"}};
  EXPECT_FALSE(fast_replay_obstacle(old, Device::cuda, "sm_90", 1));
  const auto old2 = fast_replay_obstacle(old, Device::cuda, "sm_90", 2);
  ASSERT_TRUE(old2);
  EXPECT_EQ(old2->remedy,
            "replay it with a build whose tensor-core kernels are revision 1 (the recording's build_id: "
            "(not recorded))");
  const auto older = fast_replay_obstacle({}, Device::cuda, "sm_90", 1);
  ASSERT_TRUE(older);
  EXPECT_EQ(older->recorded, "a GPU of architecture (not recorded)");
}

// A recording's env holds this build's revision. A fast trace of another revision replayed on the CPU is
// refused for its architecture, which is checked first.
TEST(ReplayTolerance, TracesRecordTheTensorCoreRevision) {
  test::TempDir d;
  const std::string t = fast_trace(d, "fast.h5");
  EXPECT_EQ(TraceReader::open(t).env().at("tensor_core_revision"), std::to_string(kTensorCoreRevision));
  H5Edit(t).set_attr("/meta/env", "tensor_core_revision", std::to_string(kTensorCoreRevision + 1));
  const auto r = test::run_cli("replay " + t);
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_TRUE(has(r.out,
                  "on a GPU of architecture sm_90; its bits are reproducible only by a GPU of that "
                  "architecture, and this replay would run on the cpu"))
      << r.out;
}

// The same numbers: every tensor and the log-probs at rel-L2 0, reported as within tolerance and not
// bitwise, with the default bounds, the exact profile used and the free decisions all kept.
TEST(ReplayTolerance, SameNumbersAreWithinToleranceAtRelL2Zero) {
  test::TempDir d;
  const std::string t = fast_trace(d, "fast.h5");
  const std::string js = d / "r.json";
  const auto r = test::run_cli("replay " + t + " --tolerance --json " + js);
  EXPECT_EQ(r.code, 0) << r.out;
  EXPECT_TRUE(has(r.out, "step 0: WITHIN TOLERANCE, not bitwise: recorded in fast numerics (" + fast_sites() +
                             " = tensor_core) on a GPU of architecture sm_90, replayed on the cpu; re-executed in exact "
                             "numerics (profile 'train') with the recorded decisions forced"))
      << r.out;
  EXPECT_TRUE(has(r.out, " recorded full tensors compared by value, 0 over the bound (rel-L2 <= 0.1); every one equal "
                         "(rel-L2 0)"))
      << r.out;
  EXPECT_TRUE(has(r.out, "log-probs: rel-L2 0.000e+00 (bound 0.005), max abs 0.000e+00 over 59 log-probs")) << r.out;
  EXPECT_TRUE(has(r.out, "digest-only records: 0 (the trace holds the full tensor of every record)")) << r.out;
  EXPECT_TRUE(has(r.out, ": within tolerance, not bitwise (1 step compared within tolerance)")) << r.out;
  EXPECT_FALSE(has(r.out, "bit-identical")) << r.out;

  const auto j = read_json(js);
  EXPECT_FALSE(j.at("identical").get<bool>());
  EXPECT_TRUE(j.at("passed").get<bool>());
  EXPECT_TRUE(j.at("verified_all").get<bool>());
  const auto& s = j.at("steps").at(0);
  EXPECT_EQ(s.at("numerics"), "fast");
  EXPECT_FALSE(s.at("identical").get<bool>());
  EXPECT_TRUE(s.at("passed").get<bool>());
  const auto& tol = s.at("tolerance");
  EXPECT_EQ(tol.at("compared"), "within tolerance, not bitwise");
  EXPECT_TRUE(tol.at("within").get<bool>());
  EXPECT_EQ(tol.at("recorded_profile"), "train.fast");
  EXPECT_EQ(tol.at("replay_profile"), "train");
  EXPECT_EQ(tol.at("bounds").at("tensor_rel_l2").get<double>(), kDefaultTensorRelL2);
  EXPECT_EQ(tol.at("bounds").at("logprob_rel_l2").get<double>(), kDefaultLogprobRelL2);
  const int64_t records = s.at("records_compared").get<int64_t>();
  EXPECT_GT(records, 0);
  EXPECT_EQ(tol.at("tensors").at("compared").get<int64_t>(), records);  // capture full: every record
  EXPECT_EQ(tol.at("tensors").at("over_bound").get<int64_t>(), 0);
  EXPECT_EQ(tol.at("tensors").at("worst").at("rel_l2").get<double>(), 0.0);
  EXPECT_TRUE(tol.at("tensors").at("first_over").is_null());
  EXPECT_EQ(tol.at("digest_only").at("records").get<int64_t>(), 0);
  EXPECT_EQ(tol.at("records_bitwise_equal").get<int64_t>(), records);
  EXPECT_EQ(tol.at("logprobs").at("count").get<int64_t>(), 59);
  EXPECT_EQ(tol.at("logprobs").at("rel_l2").get<double>(), 0.0);
  EXPECT_EQ(tol.at("logprobs").at("max_abs").get<double>(), 0.0);
  const auto& free = tol.at("free_decisions");
  for (const char* kind : {"indexer", "routing"}) {
    EXPECT_GT(free.at(kind).at("rows").get<int64_t>(), 0) << kind;
    EXPECT_EQ(free.at(kind).at("same"), free.at(kind).at("rows")) << kind;
  }
}

// A recorded full tensor perturbed by a known amount: the reported rel-L2 is the one that amount gives,
// and over the bound the replay exits 1 naming the tensor; a larger --tolerance lets it pass.
TEST(ReplayTolerance, PerturbedTensorReportsItsRelL2) {
  test::TempDir d;
  const std::string t = fast_trace(d, "fast.h5");
  const std::string ds = "/steps/000000/seq_000/tensors/attn.q/layer_001";
  const std::vector<float> original = TraceReader::open(t).tensor(0, 0, 1, "attn.q")->f;
  ASSERT_FALSE(original.empty());
  // Every 7th element scaled by `factor`, rounded to bf16 by truncation (attn.q is stored as bf16).
  auto perturbed_copy = [&](const std::string& name, float factor) {
    const std::string p = d / name;
    fs::copy_file(t, p);
    H5Edit e(p);
    std::vector<uint16_t> v = e.read<uint16_t>(ds, H5T_NATIVE_UINT16);
    EXPECT_EQ(v.size(), original.size());
    for (size_t i = 0; i < v.size(); i += 7) {
      const float x = original[i] * factor;
      uint32_t bits;
      std::memcpy(&bits, &x, 4);
      v[i] = uint16_t(bits >> 16);
    }
    e.write(ds, H5T_NATIVE_UINT16, v);
    return p;
  };
  for (const auto& [factor, within] : {std::pair{1.01f, true}, std::pair{1.5f, false}}) {
    SCOPED_TRACE(factor);
    const std::string p = perturbed_copy(fmt::format("p{}.h5", within), factor);
    const std::vector<float> recorded = TraceReader::open(p).tensor(0, 0, 1, "attn.q")->f;
    const double want = rel_l2(recorded, original);  // the replay recomputes the original values
    ASSERT_GT(want, 0);
    EXPECT_EQ(want <= kDefaultTensorRelL2, within) << want;

    ReplayOptions o;
    o.tolerance = ToleranceBounds{};
    const ReplayReport rep = replay_trace(p, o);
    ASSERT_EQ(rep.steps.size(), 1u);
    const StepReplay& s = rep.steps[0];
    ASSERT_TRUE(s.tolerance.has_value());
    const ToleranceReplay& tol = *s.tolerance;
    ASSERT_TRUE(tol.worst.has_value());
    EXPECT_EQ(tol.worst->tensor, "attn.q");
    EXPECT_EQ(tol.worst->layer, 1);
    EXPECT_EQ(tol.worst->seq, 0);
    EXPECT_NEAR(tol.worst->rel_l2, want, 1e-9 * want);
    EXPECT_EQ(tol.logprob_rel_l2, 0.0);
    EXPECT_EQ(s.passed(), within);
    EXPECT_EQ(rep.passed(), within);
    EXPECT_FALSE(s.first.has_value());
    EXPECT_EQ(tol.tensors_over, within ? 0 : 1);

    const std::string js = d / "r.json";
    auto r = test::run_cli("replay " + p + " --tolerance --json " + js);
    EXPECT_EQ(r.code, within ? 0 : 1) << r.out;
    EXPECT_TRUE(has(r.out, fmt::format("worst attn.q layer 1 sequence 0: rel-L2 {:.3e}", want))) << r.out;
    const auto j = read_json(js).at("steps").at(0).at("tolerance");
    EXPECT_NEAR(j.at("tensors").at("worst").at("rel_l2").get<double>(), want, 1e-9 * want);
    if (!within) {
      EXPECT_TRUE(has(r.out, "step 0: OUTSIDE TOLERANCE, not bitwise")) << r.out;
      EXPECT_TRUE(has(r.out, fmt::format("first over the bound: attn.q layer 1 sequence 0: rel-L2 {:.3e}", want)))
          << r.out;
      EXPECT_TRUE(has(r.out, ": OUTSIDE TOLERANCE (above)")) << r.out;
      EXPECT_EQ(j.at("tensors").at("first_over").at("tensor"), "attn.q");
      EXPECT_FALSE(j.at("within").get<bool>());
      // The value of --tolerance is the per-tensor bound.
      r = test::run_cli("replay " + p + " --tolerance 0.5 --json " + js);
      EXPECT_EQ(r.code, 0) << r.out;
      EXPECT_TRUE(has(r.out, "0 over the bound (rel-L2 <= 0.5)")) << r.out;
      EXPECT_EQ(read_json(js).at("steps").at(0).at("tolerance").at("bounds").at("tensor_rel_l2").get<double>(), 0.5);
    }
  }
}

// Perturbed log-probs: rel-L2 and max abs as computed here; past the log-prob bound, exit 1.
TEST(ReplayTolerance, PerturbedLogprobsReportTheirRelL2AndMaxAbs) {
  test::TempDir d;
  const std::string t = fast_trace(d, "fast.h5");
  const std::string ds = "/steps/000000/seq_000/logprobs";
  const std::vector<float> original = TraceReader::open(t).logprobs(0, 0);
  for (const auto& [delta, within] : {std::pair{0.01f, true}, std::pair{0.5f, false}}) {
    SCOPED_TRACE(delta);
    const std::string p = d / fmt::format("lp{}.h5", within);
    fs::copy_file(t, p);
    {
      H5Edit e(p);
      std::vector<float> v = e.read<float>(ds, H5T_NATIVE_FLOAT);
      for (size_t i = 0; i < v.size(); i += 5) v[i] -= delta;
      e.write(ds, H5T_NATIVE_FLOAT, v);
    }
    const std::vector<float> recorded = TraceReader::open(p).logprobs(0, 0);
    const double want = rel_l2(recorded, original);
    double max_abs = 0;
    for (size_t i = 0; i < recorded.size(); ++i)
      max_abs = std::max(max_abs, std::fabs(double(original[i]) - double(recorded[i])));
    EXPECT_EQ(want <= kDefaultLogprobRelL2, within) << want;

    ReplayOptions o;
    o.tolerance = ToleranceBounds{};
    const ReplayReport rep = replay_trace(p, o);
    const ToleranceReplay& tol = *rep.steps.at(0).tolerance;
    EXPECT_NEAR(tol.logprob_rel_l2, want, 1e-9 * want);
    EXPECT_EQ(tol.logprob_max_abs, max_abs);
    EXPECT_EQ(tol.logprobs, int64_t(original.size()));
    EXPECT_EQ(tol.tensors_over, 0);
    EXPECT_EQ(tol.logprobs_within(), within);

    const std::string js = d / "r.json";
    const auto r = test::run_cli("replay " + p + " --tolerance --json " + js);
    EXPECT_EQ(r.code, within ? 0 : 1) << r.out;
    EXPECT_TRUE(has(r.out, fmt::format("log-probs: rel-L2 {:.3e} (bound 0.005){}, max abs {:.3e}", want,
                                       within ? "" : " OVER THE BOUND", max_abs)))
        << r.out;
    const auto j = read_json(js).at("steps").at(0).at("tolerance").at("logprobs");
    EXPECT_NEAR(j.at("rel_l2").get<double>(), want, 1e-9 * want);
    EXPECT_EQ(j.at("within").get<bool>(), within);

    // The log-probs' bound set on the command line, on the other side of the same rel-L2.
    const double bound = within ? want / 2 : want * 2;
    const auto other = test::run_cli(fmt::format("replay {} --tolerance --tolerance-logprobs {:.6e}", p, bound));
    EXPECT_EQ(other.code, within ? 1 : 0) << other.out;
    EXPECT_TRUE(has(other.out, fmt::format("(bound {:g}){}", std::stod(fmt::format("{:.6e}", bound)),
                                           within ? " OVER THE BOUND" : "")))
        << other.out;
  }
}

// A trace of digests only (capture decisions): no tensor can be compared by value, every record is
// counted as digest-only (and how many the replay reproduced bit for bit), the log-probs still are.
// With a policy that keeps some tensors, those are compared and the rest are digest-only.
TEST(ReplayTolerance, DigestOnlyRecordsAreCountedNotPassed) {
  test::TempDir d;
  for (const std::string capture : {"decisions", "attn.q,moe.out"}) {
    SCOPED_TRACE(capture);
    const std::string t = fast_trace(d, capture == "decisions" ? "digests.h5" : "some.h5", capture);
    ReplayOptions o;
    o.tolerance = ToleranceBounds{};
    const ReplayReport rep = replay_trace(t, o);
    const StepReplay& s = rep.steps.at(0);
    const ToleranceReplay& tol = *s.tolerance;
    EXPECT_EQ(tol.tensors_compared + tol.digest_only, s.records_compared);
    EXPECT_EQ(tol.digest_only_equal, tol.digest_only);  // the same numbers: every digest matches
    EXPECT_EQ(tol.logprobs, 59);
    const auto r = test::run_cli("replay " + t + " --tolerance");
    EXPECT_EQ(r.code, 0) << r.out;
    EXPECT_TRUE(has(r.out, fmt::format("digest-only records: {} (the trace holds only their row digests: they cannot "
                                       "be compared within a tolerance and are not counted as passed; {} of them "
                                       "equal bit for bit anyway)",
                                       tol.digest_only, tol.digest_only_equal)))
        << r.out;
    if (capture == "decisions") {
      EXPECT_EQ(tol.tensors_compared, 0);
      EXPECT_EQ(tol.digest_only, s.records_compared);
      EXPECT_FALSE(tol.worst.has_value());
      EXPECT_TRUE(has(r.out, "tensors: the trace holds no full tensor of this step")) << r.out;
    } else {
      EXPECT_GT(tol.tensors_compared, 0);
      EXPECT_GT(tol.digest_only, 0);
    }
  }
}

// A doctored expert id: forced, it changes the numbers after that layer (values compared, bits not);
// left free, exactly one routing row chooses another set than the recorded one.
TEST(ReplayTolerance, FreeDecisionsCountTheRowsThatKeepTheirSet) {
  test::TempDir d;
  const std::string t = fast_trace(d, "fast.h5");
  test::doctor_routing_row(t, 3, 5, test::tiny().config().n_routed_experts);
  ReplayOptions o;
  o.tolerance = ToleranceBounds{};
  const ReplayReport rep = replay_trace(t, o);
  const StepReplay& s = rep.steps.at(0);
  const ToleranceReplay& tol = *s.tolerance;
  EXPECT_TRUE(s.decision_changes.empty());  // the doctored ids were forced
  ASSERT_TRUE(tol.free.has_value());
  EXPECT_EQ(tol.free->routing.rows - tol.free->routing.same, 1);
  EXPECT_EQ(tol.free->routing.tie_flips + tol.free->routing.confident_flips, 1);
  EXPECT_GT(tol.free->tie_factor, 0);
  ASSERT_TRUE(tol.worst.has_value());
  EXPECT_GT(tol.worst->rel_l2, 0);
  EXPECT_GE(tol.worst->layer, 3);
  EXPECT_LT(tol.records_bitwise_equal, s.records_compared);
  const auto r = test::run_cli("replay " + t + " --tolerance");
  EXPECT_TRUE(has(r.out, "free decisions (a second exact run, nothing forced): indexer rows with the recorded set")) << r.out;
  EXPECT_TRUE(has(r.out, "(1 flip: ")) << r.out;
}

// A step that can be replayed bit for bit is, even under --tolerance, and a note says so.
TEST(ReplayTolerance, ExactStepReplaysBitwiseWithANote) {
  test::TempDir d;
  const std::string t = d / "exact.h5";
  ASSERT_EQ(test::run_cli("record --preset tiny --seed 7 --random 30 --out " + t).code, 0);
  const auto r = test::run_cli("replay " + t + " --tolerance");
  EXPECT_EQ(r.code, 0) << r.out;
  EXPECT_TRUE(has(r.out, "step 0: bit-identical")) << r.out;
  EXPECT_TRUE(has(r.out, "note: --tolerance: step 0 in exact numerics, replayed bit for bit as usual")) << r.out;
  EXPECT_TRUE(has(r.out, ": bit-identical\n")) << r.out;
  ReplayOptions o;
  o.tolerance = ToleranceBounds{};
  const ReplayReport rep = replay_trace(t, o);
  EXPECT_TRUE(rep.identical());
  EXPECT_FALSE(rep.steps.at(0).tolerance.has_value());
  EXPECT_EQ(rep.steps.at(0).numerics, "exact");
}

// A generation step in fast numerics: its recorded tokens are fed as a prefill per request (at each
// request's temperature), compared within tolerance; without --tolerance it is refused like a prefill.
TEST(ReplayTolerance, GenerationStepIsComparedAsAPrefillOfItsTokens) {
  test::TempDir d;
  const std::string prompts = d / "prompts.jsonl";
  {
    std::ofstream f(prompts);
    f << "{\"id\": \"a\", \"prompt\": [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12], \"max_new_tokens\": 9}\n"
      << "{\"id\": \"b\", \"prompt\": [9, 8, 7], \"max_new_tokens\": 6, \"temperature\": 0.7, \"seed\": 3}\n";
  }
  const std::string g = d / "gen.h5";
  auto r = test::run_cli("generate --preset tiny --seed 7 --prompts " + prompts + " --capture full --record " + g +
                         " --out " + d / "samples.jsonl");
  ASSERT_EQ(r.code, 0) << r.out;
  make_fast(g);
  r = test::run_cli("replay " + g);
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_TRUE(has(r.out, "recorded in fast numerics")) << r.out;
  const std::string js = d / "g.json";
  r = test::run_cli("replay " + g + " --tolerance --json " + js);
  EXPECT_EQ(r.code, 0) << r.out;
  EXPECT_TRUE(has(r.out, "WITHIN TOLERANCE, not bitwise")) << r.out;
  EXPECT_TRUE(has(r.out, "note: a generation step: each request's recorded tokens (prompt + response) were fed as "
                         "one prefill"))
      << r.out;
  const auto j = read_json(js).at("steps").at(0).at("tolerance");
  EXPECT_GT(j.at("tensors").at("compared").get<int64_t>(), 0);
  EXPECT_EQ(j.at("digest_only").at("records").get<int64_t>(), 0);
  EXPECT_EQ(j.at("tensors").at("worst").at("rel_l2").get<double>(), 0.0);
  EXPECT_EQ(j.at("tensors").at("over_bound").get<int64_t>(), 0);
  // (12 + 9 - 1) + (3 + 6 - 1) log-probs, request b's at its temperature 0.7 as the recorder takes them
  // (from the raw logits rows): the same bits.
  EXPECT_EQ(j.at("logprobs").at("count").get<int64_t>(), 28);
  EXPECT_EQ(j.at("logprobs").at("rel_l2").get<double>(), 0.0);
  EXPECT_EQ(j.at("records_bitwise_equal"), read_json(js).at("steps").at(0).at("records_compared"));
  EXPECT_EQ(j.at("free_decisions").at("routing").at("same"), j.at("free_decisions").at("routing").at("rows"));
}

// Bad input: a tolerance that is no finite number >= 0, and a counterfactual of a fast step.
TEST(ReplayTolerance, BadInputIsRefused) {
  test::TempDir d;
  const std::string t = fast_trace(d, "fast.h5", "decisions");
  for (const std::string v : {"=-1", " -1", " nan", " inf", " abc", " 1e999", " 0.1x", "=-0.5", "=-inf"}) {
    SCOPED_TRACE(v);
    const auto r = test::run_cli("replay " + t + " --tolerance" + v);
    EXPECT_EQ(r.code, 2) << r.out;
    EXPECT_TRUE(has(r.out, "--tolerance: '")) << r.out;
    EXPECT_TRUE(has(r.out, "is not a finite number >= 0")) << r.out;
  }
  // "-inf" after a space reads as an unknown option: refused too.
  EXPECT_EQ(test::run_cli("replay " + t + " --tolerance -inf").code, 2);
  // The value may come first, and the trace right after a bare --tolerance.
  EXPECT_EQ(test::run_cli("replay --tolerance 0.05 " + t).code, 0);
  EXPECT_EQ(test::run_cli("replay --tolerance " + t).code, 0);
  EXPECT_EQ(test::run_cli("replay --tolerance=0 " + t).code, 0);  // 0: equal values only (these are)

  const auto r = test::run_cli("replay " + t + " --tolerance --take-decisions-from " + t);
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_TRUE(has(r.out, "does not combine with --take-decisions-from")) << r.out;

  EXPECT_EQ(parse_tolerance("").tensor_rel_l2, kDefaultTensorRelL2);
  EXPECT_EQ(parse_tolerance("").logprob_rel_l2, kDefaultLogprobRelL2);
  EXPECT_EQ(parse_tolerance("5e-2").tensor_rel_l2, 0.05);
  EXPECT_EQ(parse_tolerance("0").tensor_rel_l2, 0.0);
  EXPECT_EQ(parse_tolerance("0.2").logprob_rel_l2, kDefaultLogprobRelL2);
  EXPECT_THROW(parse_tolerance("-0.1"), InputError);
  EXPECT_THROW(parse_tolerance("nan"), InputError);
  EXPECT_EQ(parse_tolerance("", "0.02").logprob_rel_l2, 0.02);
  EXPECT_EQ(parse_tolerance("", "0.02").tensor_rel_l2, kDefaultTensorRelL2);
  EXPECT_THROW(parse_tolerance("", "-1"), InputError);

  // --tolerance-logprobs: a bad value, and the option without --tolerance.
  for (const std::string v : {"-1", "nan", "x"}) {
    const auto b = test::run_cli("replay " + t + " --tolerance --tolerance-logprobs=" + v);
    EXPECT_EQ(b.code, 2) << b.out;
    EXPECT_TRUE(has(b.out, "--tolerance-logprobs: '" + v + "' is not a finite number >= 0")) << b.out;
  }
  const auto alone = test::run_cli("replay " + t + " --tolerance-logprobs 0.1");
  EXPECT_EQ(alone.code, 2) << alone.out;
  EXPECT_TRUE(has(alone.out, "--tolerance-logprobs 0.1 needs --tolerance")) << alone.out;
}

// ---- the pieces -----------------------------------------------------------------------------------------

// JSON has no infinity: a rel-L2 that is not finite is null in the replay report, as in `dsv4 diff --json`.
TEST(ReplayTolerance, NonFiniteNumbersAreNullInTheJsonReport) {
  ReplayReport r;
  StepReplay s;
  s.identical = false;
  ToleranceReplay t;
  t.tensors_compared = 1, t.tensors_over = 1;
  t.worst = ToleranceTensor{0, 2, "attn.o", std::numeric_limits<double>::infinity(), 0.25, 1};
  t.logprobs = 4, t.logprob_rel_l2 = std::nan(""), t.logprob_max_abs = 1e-3;
  s.tolerance = t;
  r.steps.push_back(s);
  const auto j = nlohmann::json::parse(replay_to_json(r)).at("steps").at(0).at("tolerance");
  EXPECT_TRUE(j.at("tensors").at("worst").at("rel_l2").is_null());
  EXPECT_EQ(j.at("tensors").at("worst").at("max_abs").get<double>(), 0.25);
  EXPECT_TRUE(j.at("logprobs").at("rel_l2").is_null());
  EXPECT_EQ(j.at("logprobs").at("max_abs").get<double>(), 1e-3);
}

TEST(ReplayTolerance, RelL2) {
  RelL2 e;
  EXPECT_EQ(e.rel_l2(), 0.0);
  const float inf = std::numeric_limits<float>::infinity(), nan = std::numeric_limits<float>::quiet_NaN();
  const std::vector<float> a{3, 4, -inf, nan, 0}, b{3, 4 + 0.5f, -inf, nan, 0};
  e.add(a.data(), b.data(), int64_t(a.size()));
  EXPECT_DOUBLE_EQ(e.rel_l2(), 0.5 / 5.0);  // the non-finite pairs agree and are left out
  EXPECT_EQ(e.max_abs(), 0.5);
  EXPECT_EQ(e.elements(), 5);
  EXPECT_EQ(e.nonfinite_mismatches(), 0);
  e.add(-inf, 1.0);  // a masked score that is not masked in the replay
  EXPECT_EQ(e.nonfinite_mismatches(), 1);
  EXPECT_EQ(e.rel_l2(), std::numeric_limits<double>::infinity());
  EXPECT_FALSE(within_bound(e.rel_l2(), 1e300));
  RelL2 z;
  z.add(0.0, 1e-3);  // nothing recorded, something replayed
  EXPECT_EQ(z.rel_l2(), std::numeric_limits<double>::infinity());
  EXPECT_FALSE(within_bound(std::nan(""), 1.0));
}

TEST(ReplayTolerance, ExactReplayProfile) {
  // Made from a built-in: the built-in itself.
  for (const std::string& name : profile_names()) {
    const ExactReplayProfile e = exact_replay_profile(with_numerics(profile_by_name(name), Numerics::fast));
    EXPECT_EQ(e.profile.name, name);
    EXPECT_TRUE(profile_diff(e.profile, profile_by_name(name)).empty()) << name;
    EXPECT_TRUE(has(e.note, "the built-in profile '" + name + "'")) << e.note;
  }
  // Made from a profile file: its order on the GEMM sites is not known; the default exact order stands in.
  NumericsProfile mine = profile_by_name("rollout");
  mine.name = "my-engine";
  mine.reduce.norm = ReduceOrder{.block = 32};
  const NumericsProfile fast = with_numerics(mine, Numerics::fast);
  ExactReplayProfile e = exact_replay_profile(fast);
  EXPECT_EQ(numerics_of(e.profile), Numerics::exact);
  EXPECT_EQ(e.profile.reduce.gemm.block, 0);
  EXPECT_EQ(e.profile.reduce.moe.block, 0);
  EXPECT_EQ(e.profile.reduce.norm.block, 32);
  EXPECT_EQ(profile_diff(e.profile, fast).size(), tensor_core_sites(fast).size());
  EXPECT_TRUE(has(e.note, fast_sites() + " = 0 (the default exact order")) << e.note;
  EXPECT_TRUE(has(e.note, "the profile 'my-engine' it was made from")) << e.note;
  // A profile that sets tensor_core itself (one site), under a name of its own.
  NumericsProfile own = profile_train();
  own.name = "gemm-on-tensor-cores";
  own.reduce.gemm = ReduceOrder{.block = 0, .tensor_core = true};
  e = exact_replay_profile(own);
  EXPECT_EQ(numerics_of(e.profile), Numerics::exact);
  ASSERT_EQ(profile_diff(e.profile, own).size(), 1u);
  EXPECT_TRUE(has(e.note, "a profile that sets tensor_core itself")) << e.note;
  // A fast built-in with another site changed is not the built-in.
  NumericsProfile other = with_numerics(profile_train(), Numerics::fast);
  other.reduce.norm = ReduceOrder{.block = 64};
  e = exact_replay_profile(other);
  EXPECT_NE(e.profile.name, "train");
  EXPECT_EQ(e.profile.reduce.norm.block, 64);
  EXPECT_EQ(numerics_of(e.profile), Numerics::exact);
  EXPECT_THROW(exact_replay_profile(profile_train()), Error);
}

}  // namespace
}  // namespace dsv4
