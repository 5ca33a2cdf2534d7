// dsv4 bisect: which precision choice makes two numerics profiles (or two recorded steps) disagree
// (replay/bisect.h, docs/PROFILES.md "Bisect").
#include <fmt/core.h>
#include <fmt/format.h>

#include <cstdio>
#include <fstream>
#include <memory>
#include <optional>

#include "capture/trace_reader.h"
#include "cli/commands.h"
#include "model/error.h"
#include "model/profile.h"
#include "replay/bisect.h"
#include "replay/replay.h"

namespace dsv4::cli {

namespace {

struct BisectArgs {
  std::vector<std::string> traces;  // 0 or 2
  int step_a = 0, step_b = 0;
  std::string profile_a, profile_b;
  ModelArgs model;
  std::string tokens;
  int64_t random = 0;
  uint64_t token_seed = 1;
  std::string device = "cpu";
  int threads = 0;
  bool json = false;
  std::string out;
};

TraceStepInfo step_of(const TraceReader& r, int step) {
  const std::vector<TraceStepInfo> steps = r.steps();
  if (step < 0 || step >= int(steps.size()))
    throw InputError(fmt::format("{}: no step {} (the trace has {})", r.path(), step, steps.size()));
  return steps[size_t(step)];
}

int run_bisect(const BisectArgs& a) {
  BisectOptions o;
  o.device = parse_device(a.device);
  o.threads = a.threads;
  std::vector<std::vector<int32_t>> seqs;
  std::optional<Weights> w;
  if (!a.traces.empty()) {
    if (a.traces.size() != 2) throw InputError("bisect: give two traces, or --profile-a and --profile-b");
    if (!a.profile_a.empty() || !a.profile_b.empty() || !a.tokens.empty() || a.random > 0)
      throw InputError(
          "bisect: with two traces the profiles and tokens are the recorded ones; drop --profile-a/-b, "
          "--tokens "
          "and --random");
    const TraceReader ra = TraceReader::open(a.traces[0]), rb = TraceReader::open(a.traces[1]);
    const TraceStepInfo sa = step_of(ra, a.step_a), sb = step_of(rb, a.step_b);
    o.a = recorded_profile(sa, ra.path());
    o.b = recorded_profile(sb, rb.path());
    for (size_t q = 0; q < sa.seq_lengths.size(); ++q) seqs.push_back(ra.tokens(a.step_a, int(q)));
    w.emplace(!a.model.preset.empty() ? open_model(a.model) : weights_for_trace(ra, a.model.model));
  } else {
    if (a.profile_a.empty() || a.profile_b.empty())
      throw InputError("bisect: give --profile-a and --profile-b (names or files), or two traces");
    o.a = load_profile(a.profile_a);
    o.b = load_profile(a.profile_b);
    w.emplace(open_model(a.model));
    seqs.push_back(get_tokens(a.tokens, a.random, a.token_seed, w->config()));
  }
  o.progress = [](const std::string& what, int run, int runs) {
    fmt::print(stderr, "bisect: forward {}/{}: {}\n", run, runs, what);
  };
  const BisectReport rep = bisect_profiles(*w, seqs, o);
  const std::string text = a.json ? bisect_to_json(rep) + "\n" : bisect_to_table(rep);
  if (!a.out.empty()) {
    std::ofstream f(a.out, std::ios::binary);
    f << bisect_to_json(rep) << "\n";
    if (!f) throw Error(fmt::format("{}: write failed", a.out));
  }
  fmt::print("{}", text);
  return 0;
}

}  // namespace

void register_bisect_command(CLI::App& app) {
  auto a = std::make_shared<BisectArgs>();
  CLI::App* b = app.add_subcommand(
      "bisect",
      "Rank the precision sites that separate two profiles (or two recorded steps) by how much of the "
      "log-prob mismatch and how many decision flips each explains");
  b->add_option("traces", a->traces, "Two traces: bisect their steps' recorded profiles on A's tokens")
      ->expected(0, 2);
  b->add_option("--step-a", a->step_a, "With two traces: A's step")->capture_default_str();
  b->add_option("--step-b", a->step_b, "With two traces: B's step")->capture_default_str();
  b->add_option("--profile-a", a->profile_a, std::string("Profile A (the baseline). ") + kProfileHelp);
  b->add_option("--profile-b", a->profile_b,
                std::string("Profile B (the one whose sites are switched in). ") + kProfileHelp);
  add_model_options(b, a->model);
  b->add_option("--tokens", a->tokens, "Token ids (comma-separated) or @FILE");
  b->add_option("--random", a->random, "N random tokens (with --token-seed)");
  b->add_option("--token-seed", a->token_seed, "Seed of --random")
      ->capture_default_str()
      ->check(CLI::NonNegativeNumber);
  b->add_option("--device", a->device, "cpu or cuda")->capture_default_str();
  add_threads_option(b, a->threads, "CPU threads (0: all); results do not depend on it");
  b->add_flag("--json", a->json, "Print the report as JSON (format dsv4-bisect)");
  b->add_option("--out", a->out, "Also write the JSON report to this file (the viewer opens it)");
  b->callback([a] { set_action([a] { return run_bisect(*a); }); });
}

}  // namespace dsv4::cli
