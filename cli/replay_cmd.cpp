// dsv4 replay | diff | trace bundle
#include <fmt/core.h>
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <cmath>
#include <fstream>
#include <memory>
#include <nlohmann/json.hpp>

#include "cli/commands.h"
#include "model/error.h"
#include "replay/attribution.h"
#include "replay/diff.h"
#include "replay/replay.h"

namespace dsv4::cli {

namespace {

struct ReplayArgs {
  std::string trace, model, json_out, force, take_from, optimizer_state;
  bool tolerance_given = false;  // --tolerance, with or without a value
  std::string tolerance;         // its value ("" without one)
  std::string tolerance_logprobs;  // --tolerance-logprobs ("" when not given)
  int step = -1;
  bool all = false;
  int threads = 0;
  std::string device = "cpu";
  ParallelArgs parallel;
};

std::string row_preview(const std::vector<float>& v) {
  std::vector<std::string> s;
  for (size_t i = 0; i < v.size() && i < 8; ++i) s.push_back(fmt::format("{:.6g}", v[i]));
  return fmt::format("[{}{}]", fmt::join(s, ", "), v.size() > 8 ? ", ..." : "");
}

// The exit code of a replay: a divergence or a step outside tolerance (1) outranks steps that could not
// be verified (2: the trace is not whole); 0 only when every step was verified bit-identical (or, under
// --tolerance, within tolerance).
int replay_exit_code(const ReplayReport& r) {
  if (!r.passed()) return 1;
  return r.skipped.empty() ? 0 : 2;
}

std::string number(double x) {
  return std::isinf(x) ? (x > 0 ? "inf" : "-inf") : fmt::format("{:.3e}", x);
}

std::string tensor_at(const ToleranceTensor& t) {
  std::string s = fmt::format("{} {} sequence {}: rel-L2 {} (max abs {})", t.tensor,
                              t.layer < 0 ? std::string("(model)") : fmt::format("layer {}", t.layer), t.seq,
                              number(t.rel_l2), number(t.max_abs));
  if (t.nonfinite_mismatches > 0)
    s += fmt::format(", {} non-finite values at other places", t.nonfinite_mismatches);
  return s;
}

std::string free_kind(const char* what, const FreeDecisionKind& k) {
  const int64_t flips = k.rows - k.same;
  std::string s = fmt::format("{} rows with the recorded set {}/{}", what, k.same, k.rows);
  if (flips > 0)
    s += fmt::format(" ({} flip{}: {} tie, {} confident; largest recorded margin of a flip {:.3g})", flips,
                     flips == 1 ? "" : "s", k.tie_flips, k.confident_flips, k.largest_flip_margin);
  return s;
}

// A step compared within tolerance (replay/tolerance.h): what was compared, against which bounds, and
// what could not be.
void print_tolerance_step(const StepReplay& s) {
  const ToleranceReplay& t = *s.tolerance;
  fmt::print("step {}: {}, not bitwise: {}; re-executed in exact numerics (profile '{}') with the recorded decisions "
             "forced ({:.2f} s)\n",
             s.step, s.passed() ? "WITHIN TOLERANCE" : "OUTSIDE TOLERANCE", t.why_not_bitwise, t.replay_profile,
             s.seconds);
  fmt::print("  exact profile: {}\n", t.profile_note);
  if (t.tensors_compared == 0)
    fmt::print("  tensors: the trace holds no full tensor of this step (record with --capture full to compare "
               "tensors by value)\n");
  else if (t.worst->rel_l2 == 0)
    fmt::print("  tensors: {} recorded full tensors compared by value, {} over the bound (rel-L2 <= {:g}); every one "
               "equal (rel-L2 0)\n",
               t.tensors_compared, t.tensors_over, t.bounds.tensor_rel_l2);
  else
    fmt::print("  tensors: {} recorded full tensors compared by value, {} over the bound (rel-L2 <= {:g}); worst {}\n",
               t.tensors_compared, t.tensors_over, t.bounds.tensor_rel_l2, tensor_at(*t.worst));
  if (t.first_over) fmt::print("  first over the bound: {}\n", tensor_at(*t.first_over));
  fmt::print("  log-probs: rel-L2 {} (bound {:g}){}, max abs {} over {} log-probs{}\n", number(t.logprob_rel_l2),
             t.bounds.logprob_rel_l2, t.logprobs_within() ? "" : " OVER THE BOUND", number(t.logprob_max_abs),
             t.logprobs,
             t.logprob_nonfinite_mismatches > 0
                 ? fmt::format(", {} non-finite values at other places", t.logprob_nonfinite_mismatches)
                 : std::string());
  if (t.digest_only == 0)
    fmt::print("  digest-only records: 0 (the trace holds the full tensor of every record)\n");
  else
    fmt::print("  digest-only records: {} (the trace holds only their row digests: they cannot be compared within a "
               "tolerance and are not counted as passed; {} of them equal bit for bit anyway)\n",
               t.digest_only, t.digest_only_equal);
  fmt::print("  records equal bit for bit: {} of {}\n", t.records_bitwise_equal, s.records_compared);
  if (t.free)
    fmt::print("  free decisions (a second exact run, nothing forced): {}; {}\n",
               free_kind("indexer", t.free->indexer), free_kind("routing", t.free->routing));
  for (const std::string& n : t.notes) fmt::print("  note: {}\n", n);
}

int run_replay(const ReplayArgs& a) {
  ReplayOptions o;
  o.experts = open_parallel(a.parallel, a.device);
  if (a.step >= 0 && a.all) throw InputError("give --step N or --all, not both");
  if (a.step >= 0) o.step = a.step;
  o.model_dir = a.model;
  o.threads = a.threads;
  o.device = parse_device(a.device);
  o.optimizer_state = a.optimizer_state;
  for (const std::string& f : [&] {
         std::vector<std::string> v;
         size_t i = 0;
         while (i < a.force.size()) {
           size_t j = a.force.find(',', i);
           if (j == std::string::npos) j = a.force.size();
           v.push_back(a.force.substr(i, j - i));
           i = j + 1;
         }
         return v;
       }()) {
    if (f == "indexer")
      o.force_indexer = true;
    else if (f == "routing")
      o.force_routing = true;
    else if (!f.empty())
      throw InputError(fmt::format("--force-decisions: unknown kind '{}' (expected indexer, routing)", f));
  }
  o.take_decisions_from = a.take_from;
  if (!a.tolerance_logprobs.empty() && !a.tolerance_given)
    throw InputError("--tolerance-logprobs " + a.tolerance_logprobs + " needs --tolerance (it sets one of its bounds)");
  if (a.tolerance_given) o.tolerance = parse_tolerance(a.tolerance, a.tolerance_logprobs);
  const ReplayReport r = replay_trace(a.trace, o);
  // Every rank verified the same outputs (the expert outputs are gathered to all): rank 0 reports,
  // and every rank exits with the verdict.
  const bool quiet = o.experts && o.experts->rank() != 0;
  if (quiet) return replay_exit_code(r);
  if (!a.json_out.empty()) {
    std::ofstream f(a.json_out);
    f << replay_to_json(r) << "\n";
    if (!f) throw Error(fmt::format("{}: write failed", a.json_out));
  }
  fmt::print("replay of {} with weights {}\n", r.trace, r.model_source);
  if (!r.layout_note.empty()) fmt::print("{}\n", r.layout_note);
  if (!r.weight_mismatches.empty())
    fmt::print("WEIGHTS DIFFER from the recorded model: {}\n", fmt::join(r.weight_mismatches, ", "));
  for (const auto& s : r.steps) {
    if (s.tolerance) {
      print_tolerance_step(s);
      if (s.first) {  // a structural divergence: the replay's records do not follow the recorded ones
        const Divergence& d = *s.first;
        fmt::print("  DIVERGES at sequence {} layer {} tensor {} row {}\n", d.seq, d.layer, d.tensor, d.row);
        if (!d.reason.empty()) fmt::print("  {}\n", d.reason);
      }
    } else if (s.identical) {
      fmt::print("step {}: bit-identical ({} tensors, {} rows compared, {:.2f} s)\n", s.step,
                 s.records_compared, s.rows_compared, s.seconds);
    } else if (s.first) {
      const Divergence& d = *s.first;
      fmt::print("step {}: DIVERGES at sequence {} layer {} tensor {} row {}\n", s.step, d.seq, d.layer,
                 d.tensor, d.row);
      if (!d.reason.empty()) fmt::print("  {}\n", d.reason);
      if (d.has_elements)
        fmt::print(
            "  first differing element {}: recorded {:.9g}, replayed {:.9g} ({} ulp); over the row max abs "
            "{:.3g}, max rel {:.3g}\n",
            d.first_index, d.recorded, d.replayed, d.ulp, d.max_abs, d.max_rel);
      else if (!d.replayed_row.empty())
        fmt::print("  the trace holds only digests of this tensor; replayed row here: {}\n",
                   row_preview(d.replayed_row));
    }
    if (s.kernels_equal == true)
      fmt::print("  GPU kernels: the same {} launches as recorded\n", s.kernels_recorded);
    else if (s.kernels_equal == false)
      fmt::print("  GPU kernels differ ({} recorded, {} replayed): {}\n", s.kernels_recorded,
                 s.kernels_replayed, s.kernels_note);
    for (const auto& c : s.decision_changes)
      fmt::print("  {} decisions of layer {} changed at {} positions (first: token {})\n", c.kind, c.layer,
                 c.rows_changed, c.first_row);
    if (s.mean_abs_dlogprob_before)
      fmt::print(
          "  counterfactual: mean |Δ log-prob| {:.4e} -> {:.4e}, KL {:.4e} -> {:.4e} with the other trace's "
          "decisions forced\n",
          *s.mean_abs_dlogprob_before, *s.mean_abs_dlogprob_after, *s.kl_before, *s.kl_after);
    if (s.mean_abs_dlogprob_forced)
      fmt::print(
          "  with the decisions of {}: mean log-prob {:.6f} (recorded {:.6f}), mean |Δ log-prob| {:.4e}{}\n",
          s.counterfactual_source, *s.mean_logprob_forced, *s.mean_logprob_recorded, *s.mean_abs_dlogprob_forced,
          s.mean_abs_dlogprob_before ? "" : "; the other trace holds no log-probs to compare with");
  }
  for (const auto& k : r.skipped) fmt::print("step {}: NOT VERIFIED: {}\n", k.step, k.reason);
  for (const auto& n : r.notes) fmt::print("note: {}\n", n);
  if (!r.passed() && !r.env_differences.empty()) {
    fmt::print("environment differences (likely culprit first):\n");
    for (const auto& e : r.env_differences)
      fmt::print("  {:<14} recorded '{}'  here '{}'\n", e.key, e.recorded.substr(0, 80),
                 e.here.substr(0, 80));
  }
  const int code = replay_exit_code(r);
  // Steps compared within tolerance that passed; whether every failure is a tolerance step's value
  // outside its bounds (rather than a divergence of the bits, the record order or the weights).
  int64_t within = 0;
  bool only_outside_tolerance = r.weight_mismatches.empty();
  for (const auto& s : r.steps) {
    if (s.tolerance && s.passed()) ++within;
    if (!s.passed() && !(s.tolerance && !s.first && s.decision_changes.empty())) only_outside_tolerance = false;
  }
  std::string verdict = "bit-identical";
  if (code == 2)
    verdict = "not every step verified";
  else if (code == 1)
    verdict = only_outside_tolerance ? "OUTSIDE TOLERANCE (above)" : "DIFFERENT (above)";
  else if (within > 0)
    verdict = fmt::format("within tolerance, not bitwise ({} step{} compared within tolerance{})", within,
                          within == 1 ? "" : "s",
                          int64_t(r.steps.size()) == within ? "" : ", the others bit-identical");
  fmt::print("recorded on {}, replayed on {}: {}\n", r.recorded_on, r.replayed_on, verdict);
  if (code == 2)
    fmt::print(stderr,
               "dsv4: error: {}: {} of {} step{} not verified (listed above); `dsv4 trace validate` tells more, "
               "`dsv4 trace salvage` copies the intact steps, `--step N` replays one step\n",
               r.trace, r.skipped.size(), r.skipped.size() + r.steps.size(),
               r.skipped.size() + r.steps.size() == 1 ? "" : "s");
  return code;
}

struct DiffArgs {
  std::string a, b, json_out, csv_dir;
  std::vector<int> steps;
  bool allow_model_mismatch = false;
  double tie = -1;
  bool attribute = false;
  std::string model;
};

int run_diff(const DiffArgs& d) {
  DiffOptions o;
  if (d.steps.size() == 2) {
    o.step_a = d.steps[0];
    o.step_b = d.steps[1];
  } else if (!d.steps.empty()) {
    throw InputError("--step takes two values: the step of A and the step of B");
  }
  o.allow_model_mismatch = d.allow_model_mismatch;
  o.tie_threshold = d.tie;
  const DiffReport r = diff_traces(d.a, d.b, o);
  fmt::print("{}", diff_to_table(r));
  if (!d.json_out.empty()) {
    std::ofstream f(d.json_out);
    f << diff_to_json(r) << "\n";
    if (!f) throw Error(fmt::format("{}: write failed", d.json_out));
  }
  if (!d.csv_dir.empty()) diff_to_csv(r, d.csv_dir);
  if (d.attribute)
    fmt::print("{}", attribution_to_table(attribute_mismatch(d.b, o.step_b, d.a, o.step_a, d.model)));
  return 0;
}

struct BundleArgs {
  std::string trace, model, out;
};

}  // namespace

void register_replay_commands(CLI::App& app) {
  auto ra = std::make_shared<ReplayArgs>();
  CLI::App* rp = app.add_subcommand("replay",
                                    "Re-execute recorded steps and verify every digest (exit 0 identical, "
                                    "1 divergence, 2 bad input)");
  rp->add_option("TRACE", ra->trace, "Trace file")->required();
  rp->add_option("--step", ra->step, "Replay only this step")->check(CLI::NonNegativeNumber);
  rp->add_flag("--all", ra->all, "Replay every complete step (the default)");
  rp->add_option("--model", ra->model, "Weights directory (default: the recorded weights path)");
  rp->add_option("--device", ra->device, "Where the replay runs: cpu or cuda (cuda compares GPU kernels too)")
      ->capture_default_str();
  add_threads_option(rp, ra->threads, "CPU threads (0: all); results do not depend on it");
  rp->add_option("--force-decisions", ra->force,
                 "Feed recorded decisions through Overrides: indexer,routing");
  rp->add_option("--take-decisions-from", ra->take_from,
                 "Counterfactual: force the decisions of this other trace (same tokens)");
  rp->add_option("--optimizer-state", ra->optimizer_state,
                 "Training steps: the optimizer state the step started from, when it is no longer at the "
                 "recorded path");
  CLI::Option* tolerance =
      rp->add_option(
            "--tolerance", ra->tolerance,
            fmt::format("A step in fast numerics that cannot be replayed bit for bit here (another GPU "
                        "architecture, the CPU, tensor-core kernels of another revision): re-execute it in "
                        "exact numerics with its recorded decisions and compare it within tolerances instead "
                        "of refusing it: every recorded full tensor "
                        "within rel-L2 X (default {:g}), the log-probs within rel-L2 {:g} (docs/NUMERICS.md "
                        "\"Fast numerics\"); exit 0 within, 1 outside. Other steps replay bit for bit",
                        kDefaultTensorRelL2, kDefaultLogprobRelL2))
          ->expected(0, 1)
          ->type_name("[X]");
  rp->add_option("--tolerance-logprobs", ra->tolerance_logprobs,
                 fmt::format("With --tolerance: the log-probs' rel-L2 bound (default {:g})", kDefaultLogprobRelL2))
      ->type_name("Y");
  rp->add_option("--json", ra->json_out, "Also write the report as JSON to this file");
  add_parallel_options(rp, ra->parallel);
  rp->callback([ra, tolerance] {
    ra->tolerance_given = tolerance->count() > 0;
    set_action([ra] { return run_replay(*ra); });
  });

  auto da = std::make_shared<DiffArgs>();
  CLI::App* df =
      app.add_subcommand("diff", "Compare two traces of the same tokens (e.g. rollout vs training)");
  df->add_option("A", da->a, "Reference trace")->required();
  df->add_option("B", da->b, "Candidate trace")->required();
  df->add_option("--step", da->steps, "Steps to compare: N M (default 0 0)")
      ->expected(2)
      ->check(CLI::NonNegativeNumber);
  df->add_flag("--allow-model-mismatch", da->allow_model_mismatch, "Compare traces of different weights");
  df->add_option("--tie-threshold", da->tie,
                 "Margin below which a flip counts as a tie flip (default: see docs)")
      ->check(finite_non_negative());
  df->add_option("--json", da->json_out, "Also write the report as JSON to this file");
  df->add_option("--csv", da->csv_dir, "Also write layers.csv, tensors.csv, tokens.csv into this directory");
  df->add_flag(
      "--attribute", da->attribute,
      "B is a generation step (dsv4 generate --record): split the log-prob and decision mismatch into "
      "decode vs prefill, the FP8 caches and the rest of the profile (re-runs the model on B's tokens)");
  df->add_option("--model", da->model, "With --attribute: weights directory (default: B's recorded weights)");
  df->callback([da] { set_action([da] { return run_diff(*da); }); });
}

void register_bundle_command(CLI::App& trace) {
  auto ba = std::make_shared<BundleArgs>();
  CLI::App* b =
      trace.add_subcommand("bundle", "Copy a trace and its weights (with a manifest) to move them together");
  b->add_option("TRACE", ba->trace, "Trace file")->required();
  b->add_option("--model", ba->model, "Weights directory (default: the recorded weights path)");
  b->add_option("--out", ba->out, "Output directory")->required();
  b->callback([ba] {
    set_action([ba] {
      bundle_trace(ba->trace, ba->model, ba->out);
      fmt::print("bundled {} into {}\n", ba->trace, ba->out);
      return 0;
    });
  });
}

}  // namespace dsv4::cli
