// dsv4 train-step
#include <fmt/core.h>
#include <fmt/format.h>

#include <sys/resource.h>

#include <chrono>
#include <filesystem>
#include <memory>
#include <nlohmann/json.hpp>

#include "capture/digest.h"
#include "capture/trace_reader.h"
#include "cli/commands.h"
#include "model/error.h"
#include "replay/replay.h"
#include "train/record.h"
#include "train/step.h"

namespace dsv4::cli {

namespace {

struct TrainArgs {
  ModelArgs model;
  std::string data;
  int data_step = 0;
  std::string rewards;
  std::string decisions_from;
  int decisions_step = 0;
  std::string replay_kinds = "indexer,routing";
  std::string other_weights = "refuse";
  std::string optimizer_state;
  std::string out_model;
  std::string out_optimizer_state;
  std::string record;
  ParallelArgs parallel;
  std::string capture = "decisions";
  std::string capture_params;
  bool append = false;
  std::string device = "cpu";
  std::string train_groups, freeze_groups;
  std::string mhc_backward = "full";
  std::string profile = "train";
  bool no_std_scaling = false;
  bool json = false;
  bool quiet = false;
  train::TrainStepOptions o;
};

// R3: the decisions a rollout trace recorded for these samples' tokens, as forced decisions keyed by
// sample index. Hash layers are recorded but never forced (MODEL.md §6.5).
Overrides decisions_from_trace(const TrainArgs& a, const Weights& w, const std::vector<train::TrainSample>& samples,
                               std::string* source_digest) {
  const TraceReader r = TraceReader::open(a.decisions_from);
  const auto steps = r.steps();
  if (a.decisions_step < 0 || a.decisions_step >= int(steps.size()))
    throw InputError(fmt::format("--replay-decisions-from {}: no step {} (the trace has {})", a.decisions_from,
                                 a.decisions_step, steps.size()));
  const TraceStepInfo& info = steps[size_t(a.decisions_step)];
  if (!info.complete)
    throw InputError(fmt::format("--replay-decisions-from {}: step {} is incomplete", a.decisions_from,
                                 a.decisions_step));
  *source_digest = r.model().model_digest;
  const std::string here = hex16(model_digest(w).whole);
  if (*source_digest != here) {
    const std::string msg = fmt::format(
        "--replay-decisions-from {}: its decisions were made with other weights (model digest {} vs {} here)",
        a.decisions_from, *source_digest, here);
    if (a.other_weights == "refuse")
      throw InputError(msg + "; pass --on-other-weights warn to use them anyway");
    fmt::print(stderr, "warning: {}\n", msg);
  }
  const bool indexer = a.replay_kinds.find("indexer") != std::string::npos;
  const bool routing = a.replay_kinds.find("routing") != std::string::npos;
  Overrides ov;
  for (size_t i = 0; i < samples.size(); ++i) {
    const std::vector<int32_t> toks = samples[i].tokens();
    int match = -1;
    for (int s = 0; s < int(info.seq_lengths.size()) && match < 0; ++s)
      if (info.seq_lengths[size_t(s)] == int64_t(toks.size()) && r.tokens(a.decisions_step, s) == toks) match = s;
    if (match < 0)
      throw InputError(fmt::format(
          "--replay-decisions-from {}: step {} holds no sequence with the tokens of sample '{}' (line {})",
          a.decisions_from, a.decisions_step, samples[i].id, samples[i].line));
    for (int layer : r.decision_layers(a.decisions_step, match)) {
      if (indexer)
        if (auto x = r.indexer(a.decisions_step, match, layer))
          ov.force_indexer(int(i), layer, ForcedSelection{x->T, x->k, x->ids});
      if (routing)
        if (auto x = r.routing(a.decisions_step, match, layer); x && !x->hashed)
          ov.force_experts(int(i), layer, ForcedSelection{x->T, x->k, x->ids});
    }
  }
  return ov;
}

int run_train_step(TrainArgs& a) {
  Communicator* const comm = open_parallel(a.parallel, a.device);
  a.o.experts = comm;
  const Weights w = open_model(a.model);
  a.o.device = parse_device(a.device);
  a.o.train_mixer = a.mhc_backward == "full";
  a.o.profile = load_profile(a.profile);
  a.o.group_scale_by_std = !a.no_std_scaling;
  if (a.o.indexer_kl_coeff != 0) a.o.groups.trained.insert(train::ParamGroup::indexer);  // its objective
  if (!a.train_groups.empty()) a.o.groups.train(a.train_groups);
  if (!a.freeze_groups.empty()) a.o.groups.freeze(a.freeze_groups);
  train::check_indexer_kl(a.o);
  const bool data_is_trace = train::is_hdf5_file(a.data);
  if (data_is_trace && a.rewards.empty())
    throw InputError(fmt::format("--data {} is a trace: its samples' rewards or advantages come from --rewards FILE "
                                 "(docs/TRAINING.md \"Data\")",
                                 a.data));
  if (!data_is_trace && !a.rewards.empty())
    throw InputError(fmt::format("--rewards is for trace data; {} is a JSONL file (its lines hold the rewards)", a.data));
  const std::vector<train::TrainSample> samples =
      data_is_trace ? train::read_samples_trace(a.data, a.data_step, a.rewards, w.config())
                    : train::read_samples_jsonl(a.data, w.config());

  train::OptimizerState state = a.optimizer_state.empty() ? train::fresh_optimizer_state(w, a.o.groups)
                                                          : train::OptimizerState::load(a.optimizer_state);
  if (!a.optimizer_state.empty()) train::check_optimizer_state(state, w, a.o.groups, a.optimizer_state);

  Overrides decisions;
  train::TrainStepHooks hooks;
  if (!a.decisions_from.empty()) {
    a.o.decisions_source = a.decisions_from;
    a.o.decisions_kinds = a.replay_kinds;
    decisions = decisions_from_trace(a, w, samples, &a.o.decisions_model_digest);
    hooks.decisions = &decisions;
  }
  auto last = std::chrono::steady_clock::now() - std::chrono::seconds(1);
  hooks.progress = [&](int64_t done, int64_t total) {
    const auto now = std::chrono::steady_clock::now();
    if (a.quiet || (now - last < std::chrono::milliseconds(500) && done < total)) return;
    last = now;
    fmt::print(stderr, "\rtrain-step: {}/{} samples   ", done, total);
  };

  const auto t0 = std::chrono::steady_clock::now();
  Weights updated = w;
  train::TrainStepResult res;
  if (comm && comm->rank() != 0) {  // every rank ends with the same update: rank 0 records and writes it
    hooks.progress = nullptr;
    train::train_step(w, samples, state, a.o, hooks, &updated);
    return 0;
  }
  if (a.record.empty()) {
    res = train::train_step(w, samples, state, a.o, hooks, &updated);
  } else {
    train::RecordTrainOptions ro;
    ro.capture = a.capture;
    ro.capture_params = a.capture_params;
    ro.seed = a.model.seed;
    ro.append = a.append;
    ro.optimizer_state_path = a.optimizer_state.empty() ? "" : std::filesystem::absolute(a.optimizer_state).string();
    res = train::record_train_step(w, samples, state, a.o, hooks, &updated, a.record, ro);
  }
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();

  updated.save(a.out_model);
  const std::string state_path = a.out_optimizer_state.empty()
                                     ? (std::filesystem::path(a.out_model) / "optimizer.safetensors").string()
                                     : a.out_optimizer_state;
  state.save(state_path);

  const train::LossMetrics& m = res.metrics;
  rusage ru{};
  getrusage(RUSAGE_SELF, &ru);
  const double peak_mib = double(ru.ru_maxrss) / 1024.0;  // ru_maxrss is in KiB on Linux
  if (a.json) {
    nlohmann::ordered_json j;
    j["step"] = state.step;
    j["loss"] = m.loss;
    j["pg_loss"] = m.pg_loss;
    j["kl"] = m.kl;
    j["clip_fraction"] = m.clip_fraction;
    j["ratio"] = {{"mean", m.ratio_mean}, {"min", m.ratio_min}, {"max", m.ratio_max}};
    j["tis_mean"] = m.tis_mean;
    j["mismatch"] = {{"mean_abs", m.mismatch_mean_abs}, {"max_abs", m.mismatch_max_abs}, {"k3", m.mismatch_k3},
                     {"tokens", m.mismatch_tokens}};
    j["tokens"] = m.tokens;
    j["grad_norm"] = res.stats.grad_norm;
    j["clip_coef"] = res.stats.clip_coef;
    j["update_norm"] = res.stats.update_norm;
    if (a.o.indexer_kl_coeff != 0) j["indexer_kl"] = res.indexer_kl;
    j["seconds"] = {{"total", secs},
                    {"forward", res.seconds_forward},
                    {"backward", res.seconds_backward},
                    {"optimizer", res.seconds_optimizer}};
    j["tape_bytes_max"] = res.tape_bytes_max;
    j["peak_rss_mib"] = peak_mib;
    j["out_model"] = a.out_model;
    j["optimizer_state"] = state_path;
    if (!a.record.empty()) j["trace"] = a.record;
    fmt::print("{}\n", j.dump(2));
  } else if (!a.quiet) {
    fmt::print(stderr, "\r");
    fmt::print(
        "train-step: step {} on {} samples ({} response tokens), loss {:.6g} (pg {:.6g}, kl {:.6g}), clip "
        "fraction {:.4f}, ratio {:.4f} [{:.4f}, {:.4f}]\n",
        state.step, samples.size(), m.tokens, m.loss, m.pg_loss, m.kl, m.clip_fraction, m.ratio_mean, m.ratio_min,
        m.ratio_max);
    if (m.mismatch_tokens > 0)
      fmt::print("  rollout vs train log-probs: mean |diff| {:.4g}, max {:.4g}, k3 KL {:.4g} over {} tokens\n",
                 m.mismatch_mean_abs, m.mismatch_max_abs, m.mismatch_k3, m.mismatch_tokens);
    if (a.o.indexer_kl_coeff != 0)
      fmt::print("  indexer KL {:.6g} (coefficient {:.4g}, target {})\n", res.indexer_kl, a.o.indexer_kl_coeff,
                 a.o.indexer_kl_target);
    fmt::print(
        "  grad norm {:.6g} (clip coefficient {:.4g}), update norm {:.4g}; {:.3f} s (forward {:.3f}, backward "
        "{:.3f}, optimizer {:.3f}); largest tape {:.1f} MiB, peak memory {:.0f} MiB\n",
        res.stats.grad_norm, res.stats.clip_coef, res.stats.update_norm, secs, res.seconds_forward,
        res.seconds_backward, res.seconds_optimizer, double(res.tape_bytes_max) / (1 << 20), peak_mib);
    fmt::print("  wrote {} and {}{}\n", a.out_model, state_path,
               a.record.empty() ? "" : fmt::format(", recorded {}", a.record));
  }
  return 0;
}

}  // namespace

void register_train_command(CLI::App& app) {
  auto ta = std::make_shared<TrainArgs>();
  CLI::App* t = app.add_subcommand(
      "train-step",
      "One RL training step (forward, policy loss, backward, AdamW) on a batch of samples; writes the "
      "updated checkpoint and optimizer state so steps chain (docs/TRAINING.md)");
  add_model_options(t, ta->model);
  add_parallel_options(t, ta->parallel);
  t->add_option("--data", ta->data,
                "JSONL samples: {\"prompt\": [ids], \"response\": [ids], \"reward\" or \"advantage\", ...} "
                "(docs/TRAINING.md; the output of dsv4 generate with rewards added works), or a rollout "
                "trace (dsv4 generate --record, dsv4 record) with --rewards")
      ->required();
  t->add_option("--data-step", ta->data_step, "With trace data: the step holding the rollout")
      ->capture_default_str()
      ->check(CLI::NonNegativeNumber);
  t->add_option("--rewards", ta->rewards,
                "With trace data: JSONL of {\"id\" or \"seq\", \"reward\" [+ \"group\"] or \"advantage\", "
                "\"prompt_length\" (dsv4 record steps)} per sample");
  t->add_option("--out-model", ta->out_model, "Write the updated checkpoint to this directory")->required();
  t->add_option("--optimizer-state", ta->optimizer_state,
                "Start from this optimizer state (default: a fresh one from the checkpoint)");
  t->add_option("--out-optimizer-state", ta->out_optimizer_state,
                "Write the new optimizer state here (default: OUT_MODEL/optimizer.safetensors)");
  t->add_option("--replay-decisions-from", ta->decisions_from,
                "R3: force the indexer selections and expert ids this rollout trace recorded for the "
                "samples' tokens");
  t->add_option("--decisions-step", ta->decisions_step, "Step of that trace")->capture_default_str();
  t->add_option("--replay-kinds", ta->replay_kinds, "Which decisions to force: indexer, routing or both")
      ->capture_default_str()
      ->check(CLI::IsMember({"indexer", "routing", "indexer,routing", "routing,indexer"}));
  t->add_option("--on-other-weights", ta->other_weights,
                "When the decisions were made with other weights: refuse or warn")
      ->capture_default_str()
      ->check(CLI::IsMember({"refuse", "warn"}));
  t->add_option("--micro-batch", ta->o.micro_batch, "Samples per micro-batch (the result does not depend on it)")
      ->capture_default_str()
      ->check(CLI::Range(1, 1 << 20));
  t->add_option("--lr", ta->o.adamw.lr, "AdamW learning rate")->capture_default_str();
  t->add_option("--beta1", ta->o.adamw.beta1, "AdamW beta1")->capture_default_str();
  t->add_option("--beta2", ta->o.adamw.beta2, "AdamW beta2")->capture_default_str();
  t->add_option("--adam-eps", ta->o.adamw.eps, "AdamW epsilon")->capture_default_str();
  t->add_option("--weight-decay", ta->o.adamw.weight_decay, "Decoupled weight decay (tensors of 2+ dims)")
      ->capture_default_str();
  t->add_option("--clip-grad", ta->o.adamw.clip_grad, "Global gradient-norm clipping threshold (0: off)")
      ->capture_default_str();
  t->add_option("--eps-low", ta->o.loss.eps_low, "Policy ratio clip: lower epsilon")->capture_default_str();
  t->add_option("--eps-high", ta->o.loss.eps_high, "Policy ratio clip: upper epsilon")->capture_default_str();
  t->add_flag("--tis", ta->o.loss.tis, "Truncated importance sampling against the samples' rollout_logprobs");
  t->add_option("--tis-cap", ta->o.loss.tis_cap, "TIS cap C")->capture_default_str();
  t->add_option("--kl-coef", ta->o.loss.kl_coef, "k3 KL penalty against the samples' ref_logprobs (0: off)")
      ->capture_default_str();
  t->add_flag("--no-std-scaling", ta->no_std_scaling,
              "Group-relative advantages without dividing by the group's standard deviation");
  t->add_option("--temperature", ta->o.temperature, "Log-probs of logits / temperature (the rollout's)")
      ->capture_default_str();
  t->add_option("--train", ta->train_groups,
                "Also train these parameter groups (comma-separated; e.g. router)");
  t->add_option("--freeze", ta->freeze_groups, "Freeze these parameter groups (comma-separated)");
  t->add_option("--indexer-kl", ta->o.indexer_kl_coeff,
                "Train the lightning indexer with its KL objective (MODEL.md §5.5) at this coefficient "
                "(0: off; --freeze indexer keeps only the KL metric)")
      ->capture_default_str()
      ->check(CLI::NonNegativeNumber);
  t->add_option("--indexer-kl-target", ta->o.indexer_kl_target,
                "The KL's target: l1 (attention mass renormalised over the selected groups) or heads_sum")
      ->capture_default_str()
      ->check(CLI::IsMember({"l1", "heads_sum"}));
  t->add_option("--mhc-backward", ta->mhc_backward,
                "mHC backward: full (mixer differentiated) or legacy (pre/post/comb constants)")
      ->capture_default_str()
      ->check(CLI::IsMember({"full", "legacy"}));
  t->add_option("--profile", ta->profile, kProfileHelp)
      ->capture_default_str();
  t->add_option("--device", ta->device, "cpu or cuda")->capture_default_str();
  add_threads_option(t, ta->o.threads, "CPU threads (0: all); results do not depend on it");
  t->add_option("--record", ta->record, "Record the step into this trace (replay it with dsv4 replay)");
  t->add_option("--capture", ta->capture, "With --record: the forward's capture policy")->capture_default_str();
  t->add_option("--capture-params", ta->capture_params,
                "With --record: store these parameters' gradients and updated weights in full "
                "(comma-separated glob patterns, e.g. '*.attn_sink,lm_head.weight')");
  t->add_flag("--append", ta->append, "With --record: add the step to an existing trace");
  t->add_flag("--json", ta->json, "Print the step's metrics as JSON");
  t->add_flag("--quiet", ta->quiet, "No progress or summary");
  t->callback([ta] { set_action([ta] { return run_train_step(*ta); }); });
}

}  // namespace dsv4::cli
