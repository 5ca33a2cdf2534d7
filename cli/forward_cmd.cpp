// dsv4 forward | demo
#include <fmt/core.h>
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <chrono>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <memory>

#include "cli/commands.h"
#include "model/checkpoint.h"
#include "model/collect.h"
#include "model/compare.h"
#include "model/error.h"
#include "model/forward.h"
#include "model/forward_json.h"
#include "model/tokens.h"
#include "replay/replay.h"
#include "rollout/engine.h"
#include "train/record.h"

namespace dsv4::cli {

namespace {

struct ForwardArgs {
  ModelArgs model;
  std::string tokens;
  int64_t random = 0;
  uint64_t token_seed = 1;
  std::string profile = "train";
  std::string numerics = "exact";
  int threads = 0;
  float temperature = 1.0f;
  std::string out;
  std::string device = "cpu";
  ParallelArgs parallel;
};

int run_forward(const ForwardArgs& a) {
  Communicator* const comm = open_parallel(a.parallel, a.device);
  Weights w = open_model(a.model, comm);
  const std::vector<int32_t> tokens = get_tokens(a.tokens, a.random, a.token_seed, w.config());
  DecisionLog log;
  RunOptions opt;
  opt.experts = comm;
  opt.profile = load_profile(a.profile, parse_numerics(a.numerics));
  opt.threads = a.threads;
  opt.device = parse_device(a.device);
  opt.observer = &log;
  opt.temperature = a.temperature;
  // With --dp the one sequence is rank 0's (sequence_range); the other ranks serve their experts.
  opt.split_sequences = a.parallel.dp;
  std::vector<std::vector<int32_t>> batch{tokens};
  if (comm && a.parallel.dp) {
    const BlockRange b = sequence_range(1, comm->rank(), comm->size());
    batch.assign(batch.begin() + b.first, batch.begin() + b.last);
  }
  const auto t0 = std::chrono::steady_clock::now();
  ForwardResult res = forward(w, batch, opt);
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  if (comm && comm->rank() != 0) return 0;  // rank 0 holds the sequence's result and reports it
  const std::string json = forward_to_json(res.seqs[0], log, opt.profile.name);
  if (!a.out.empty()) {
    std::ofstream f(a.out);
    f << json << "\n";
    if (!f) throw Error(fmt::format("{}: write failed", a.out));
  } else {
    fmt::print("{}\n", json);
  }
  double sum = 0;
  for (float v : res.seqs[0].logprobs) sum += v;
  fmt::print(stderr, "forward: {} tokens, profile {}, {:.3f} s ({:.0f} tokens/s), mean log-prob {:.6f}{}{}\n",
             tokens.size(), opt.profile.name, secs, tokens.size() / secs,
             res.seqs[0].logprobs.empty() ? 0.0 : sum / res.seqs[0].logprobs.size(),
             comm ? fmt::format(", experts over {} {} ranks{} (rank 0 received {:.1f} MB, {:.0f} bytes per token; "
                                "holds {:.1f} MB of weights)",
                                comm->size(), comm->transport(), a.parallel.dp ? ", sequences split" : "",
                                double(comm->bytes_received()) / 1e6,
                                double(comm->bytes_received()) / double(tokens.size()), double(w.loaded_bytes()) / 1e6)
                  : fmt::format(", {:.1f} MB of weights", double(w.loaded_bytes()) / 1e6),
             a.out.empty() ? "" : fmt::format(", wrote {}", a.out));
  return 0;
}

struct DemoArgs {
  std::string preset = "tiny";
  uint64_t seed = 7;
  int64_t length = 64;
  std::string dir;
  int threads = 0;
};

int run_demo(const DemoArgs& a) {
  namespace fs = std::filesystem;
  const std::string dir = a.dir.empty() ? (fs::temp_directory_path() / "dsv4-demo-model").string() : a.dir;
  fmt::print("1. dsv4 model init --preset {} --seed {} --out {}\n", a.preset, a.seed, dir);
  Weights::init(preset(a.preset), a.seed).save(dir);
  Weights w = open_checkpoint(dir);
  const std::vector<int32_t> tokens = random_tokens(a.length, w.config().vocab_size, a.seed);
  fmt::print("2. forward of {} tokens in the train and rollout profiles\n\n", tokens.size());

  DecisionLog log_train, log_roll;
  RunOptions ot;
  ot.profile = profile_train();
  ot.threads = a.threads;
  ot.observer = &log_train;
  RunOptions orl = ot;
  orl.profile = profile_rollout();
  orl.observer = &log_roll;
  const auto rt = forward(w, {tokens}, ot).seqs[0];
  const auto rr = forward(w, {tokens}, orl).seqs[0];

  fmt::print("{:>5} {:>6} {:>13} {:>13} {:>11}\n", "pos", "next", "train", "rollout", "|diff|");
  double max_diff = 0, sum_diff = 0;
  for (size_t t = 0; t < rt.logprobs.size(); ++t) {
    const double d = std::fabs(double(rt.logprobs[t]) - double(rr.logprobs[t]));
    max_diff = std::max(max_diff, d);
    sum_diff += d;
    fmt::print("{:>5} {:>6} {:>13.6f} {:>13.6f} {:>11.3e}\n", t, tokens[t + 1], rt.logprobs[t],
               rr.logprobs[t], d);
  }
  fmt::print("\nlog-prob |train - rollout|: mean {:.3e}, max {:.3e}\n\n", sum_diff / rt.logprobs.size(),
             max_diff);
  fmt::print("{:>5} {:>8} {:>10} {:>18}\n", "layer", "decision", "positions", "positions differing");
  int64_t total_rows = 0, total_diff = 0;
  for (const auto& d : compare_decisions(log_train, log_roll, 0)) {
    fmt::print("{:>5} {:>8} {:>10} {:>18}{}\n", d.layer, d.kind, d.rows, d.rows_differing,
               d.hashed ? "  (hash-routed)" : "");
    total_rows += d.rows;
    total_diff += d.rows_differing;
  }
  fmt::print("\n{} of {} indexer/routing decisions differ between the profiles.\n", total_diff, total_rows);

  // 3. The rollout engine: the prompt's first half and its second half as two requests, decoded token
  // by token from paged FP8 caches; then the trainer's view, a prefill of each sample.
  const int64_t half = std::max<int64_t>(1, int64_t(tokens.size()) / 2);
  const std::vector<std::vector<int32_t>> prompts{{tokens.begin(), tokens.begin() + half},
                                                  {tokens.begin() + half, tokens.end()}};
  rollout::EngineOptions eo;
  eo.profile = profile_rollout();
  eo.threads = a.threads;
  eo.prefill_chunk = 16;
  rollout::Engine engine(w, eo);
  for (size_t i = 0; i < prompts.size(); ++i) {
    rollout::Request q;
    q.id = fmt::format("demo-{}", i);
    q.prompt = prompts[i];
    q.max_new_tokens = 16;
    q.sampling.temperature = i == 0 ? 0.0f : 1.0f;  // greedy, then sampled
    q.sampling.seed = a.seed;
    engine.submit(q);
  }
  fmt::print(
      "\n3. dsv4 generate: {} requests decoded token by token from paged caches (rollout profile, FP8 KV)\n",
      prompts.size());
  double max_decode_vs_prefill = 0;
  std::vector<train::TrainSample> samples;
  for (const auto& g : engine.run()) {
    train::TrainSample ts;
    ts.id = g.id;
    ts.prompt = g.prompt;
    ts.response = g.tokens;
    ts.rollout_logprobs = g.logprobs;
    ts.reward = g.index == 0 ? 1.0 : 0.0;  // a toy reward: the greedy answer is the good one
    ts.group = "demo";
    samples.push_back(std::move(ts));
    std::vector<int32_t> sample = g.prompt;
    sample.insert(sample.end(), g.tokens.begin(), g.tokens.end());
    const auto lp = forward(w, {sample}, orl).seqs[0].logprobs;  // the trainer's prefill, same profile
    for (size_t i = 0; i < g.logprobs.size(); ++i)
      max_decode_vs_prefill = std::max(
          max_decode_vs_prefill, std::fabs(double(g.logprobs[i]) - double(lp[g.prompt.size() - 1 + i])));
    fmt::print("   {} ({}): {} prompt tokens, generated {}\n", g.id, g.index == 0 ? "greedy" : "sampled",
               g.prompt.size(), fmt::join(g.tokens, " "));
  }
  fmt::print("   decoded log-probs vs a prefill of the same tokens: max |diff| {:.3e} ({})\n",
             max_decode_vs_prefill, max_decode_vs_prefill == 0 ? "bit-identical" : "DIFFERENT");

  // 4. The trainer: one step on the two samples with the rollout's decisions forced (R3; a rollout-
  // profile prefill decides exactly as the decoding did), recorded, then replayed.
  DecisionLog decisions;
  RunOptions od = orl;
  od.observer = &decisions;
  std::vector<std::vector<int32_t>> seqs;
  for (const auto& ts : samples) seqs.push_back(ts.tokens());
  forward(w, seqs, od);
  train::TrainStepOptions to;
  to.threads = a.threads;
  to.adamw.lr = 1e-4;
  to.decisions_source = "the demo's rollout";
  to.decisions_kinds = "indexer,routing";
  train::TrainStepHooks th;
  const Overrides forced = decisions.to_overrides();
  th.decisions = &forced;
  train::OptimizerState state = train::fresh_optimizer_state(w, to.groups);
  Weights updated = w;
  const std::string step_trace = (fs::path(dir) / "train-step.h5").string();
  fs::remove(step_trace);
  train::RecordTrainOptions rto;
  rto.seed = a.seed;
  const train::TrainStepResult tr = train::record_train_step(w, samples, state, to, th, &updated, step_trace, rto);
  const ReplayReport rep = replay_trace(step_trace, ReplayOptions{});
  const train::LossMetrics& m = tr.metrics;
  fmt::print(
      "\n4. dsv4 train-step --replay-decisions-from ...: one GRPO step on the {} samples (train profile, the "
      "rollout's decisions forced)\n"
      "   loss {:.5g}, rollout vs train log-probs: mean |diff| {:.3e}, max {:.3e}; grad norm {:.4g}\n"
      "   recorded {}; dsv4 replay: {}\n",
      samples.size(), m.loss, m.mismatch_mean_abs, m.mismatch_max_abs, tr.stats.grad_norm, step_trace,
      rep.identical() ? "forward, every gradient and the update bit-identical" : "DIVERGES");
  return max_decode_vs_prefill == 0 && rep.identical() ? 0 : 1;
}

}  // namespace

void register_forward_commands(CLI::App& app) {
  auto fa = std::make_shared<ForwardArgs>();
  CLI::App* f =
      app.add_subcommand("forward", "Run the forward pass on one sequence and write log-probs and decisions");
  add_model_options(f, fa->model);
  f->add_option("--tokens", fa->tokens, "Token ids: 1,2,3 or @file (commas/whitespace)");
  f->add_option("--random", fa->random, "Use N seeded random token ids instead of --tokens");
  f->add_option("--token-seed", fa->token_seed, "Seed of --random")->capture_default_str()->check(CLI::NonNegativeNumber);
  f->add_option("--profile", fa->profile, kProfileHelp)
      ->capture_default_str();
  add_numerics_option(f, fa->numerics);
  add_threads_option(f, fa->threads, "CPU threads (0: all); results do not depend on it");
  f->add_option("--temperature", fa->temperature, "Divide logits by this before log_softmax")
      ->capture_default_str();
  f->add_option("--out", fa->out, "Write the JSON result here (default: stdout)");
  f->add_option("--device", fa->device, "Where the forward runs: cpu or cuda (same bits on both)")
      ->capture_default_str();
  add_parallel_options(f, fa->parallel, true);
  f->callback([fa] { set_action([fa] { return run_forward(*fa); }); });

  auto da = std::make_shared<DemoArgs>();
  CLI::App* d = app.add_subcommand(
      "demo", "Make a tiny checkpoint, run both numerics profiles and show where they disagree");
  d->add_option("--preset", da->preset, "Built-in config")->capture_default_str();
  d->add_option("--seed", da->seed, "Seed of the weights and the prompt")->capture_default_str()->check(CLI::NonNegativeNumber);
  d->add_option("--length", da->length, "Prompt length in tokens")
      ->capture_default_str()
      ->check(CLI::Range(2, 1 << 20));
  d->add_option("--dir", da->dir, "Where to write the checkpoint (default: a temp directory)");
  add_threads_option(d, da->threads, "CPU threads (0: all)");
  d->callback([da] { set_action([da] { return run_demo(*da); }); });
}

}  // namespace dsv4::cli
