// dsv4 import sglang|miles | export sglang|miles: the rollout engines' R3 data (docs/ADAPTERS.md).
#include <fmt/core.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <memory>

#include "adapters/convert.h"
#include "capture/trace_reader.h"
#include "cli/commands.h"
#include "model/error.h"

namespace dsv4::cli {

namespace {

// One line per second at most (a carriage-return line on a terminal).
class ImportProgressLine {
 public:
  explicit ImportProgressLine(std::string engine) : engine_(std::move(engine)), tty_(isatty(2)) {}
  void operator()(const ImportProgress& p) {
    if (p.seconds - last_ < 1.0) return;
    last_ = p.seconds;
    fmt::print(stderr, "{}import {}: {} requests, {:.1f} MB read, {:.1f} MB/s{}", tty_ ? "\r" : "", engine_,
               p.requests, p.bytes_read / 1e6, p.bytes_read / 1e6 / std::max(p.seconds, 1e-9),
               tty_ ? "   " : "\n");
    shown_ = true;
  }
  void finish() {
    if (shown_ && tty_) fmt::print(stderr, "\n");
  }

 private:
  std::string engine_;
  bool tty_;
  bool shown_ = false;
  double last_ = 0;
};

int run_import_cmd(const ImportJob& a) {
  ImportProgressLine line(a.engine);
  const ImportResult r = run_import(a, [&](const ImportProgress& p) { line(p); });
  line.finish();
  const ImportSummary& s = r.summary;
  constexpr size_t kNotesShown = 10;
  for (size_t i = 0; i < s.notes.size() && i < kNotesShown; ++i)
    fmt::print(stderr, "import {}: note: {}\n", a.engine, s.notes[i]);
  if (s.notes.size() > kNotesShown)
    fmt::print(stderr, "import {}: note: ... and {} more notes\n", a.engine, s.notes.size() - kNotesShown);
  fmt::print(stderr,
             "import {}: {} requests, {} tokens, {:.1f} MB read in {:.2f} s ({:.1f} MB/s); {} ({:.1f} MB, "
             "{:.3f} of the {:.1f} MB of int32 buffers)\n",
             a.engine, s.requests, s.tokens, s.input_bytes / 1e6, s.seconds,
             s.input_bytes / 1e6 / std::max(s.seconds, 1e-9), r.trace, r.trace_bytes / 1e6,
             r.int32_bytes > 0 ? double(r.trace_bytes) / double(r.int32_bytes) : 0.0, r.int32_bytes / 1e6);
  return 0;
}

struct ExportArgs {
  std::string engine;
  std::string trace, out;
  int step = -1;
  bool incremental = false;
};

int run_export(const ExportArgs& a) {
  TraceReader r = TraceReader::open(a.trace);
  const int step = export_step(r, a.step);
  const auto t0 = std::chrono::steady_clock::now();
  const int64_t n =
      a.engine == "sglang" ? export_sglang(r, step, a.out, a.incremental) : export_miles(r, step, a.out);
  fmt::print(stderr, "export {}: step {} of {}: {} sequences in {:.2f} s → {}\n", a.engine, step, a.trace, n,
             std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(), a.out);
  return 0;
}

void add_import(CLI::App* import, const std::string& engine, const std::string& inputs_help,
                const std::string& example) {
  auto a = std::make_shared<ImportJob>();
  a->engine = engine;
  CLI::App* cmd =
      import->add_subcommand(engine, fmt::format("Import {} R3 data as one external step", engine));
  cmd->add_option("INPUTS", a->inputs, inputs_help)->required();
  cmd->add_option("--config", a->config, "The model's config.json (no hash-layer check)");
  cmd->add_option("--model", a->model,
                  "Checkpoint directory: config and weights (checks hash layers against tid2eid)");
  cmd->add_option("--preset", a->preset,
                  "Built-in config: tiny, tiny-b, mid, flash, pro (no hash-layer check)");
  cmd->add_option("--out", a->out, "New trace file (NAME.h5)")->required();
  cmd->add_option("--kind", a->kind, "rollout (an inference engine) or train (a trainer's forward)")
      ->capture_default_str()
      ->check(CLI::IsMember({"rollout", "train"}));
  cmd->add_option("--profile", a->profile, "The engine's numerics profile, when one of ours describes it")
      ->capture_default_str();
  if (engine == "sglang")
    cmd->add_option_function<int64_t>(
           "--prefix-memory", [a](int64_t mb) { a->prefix_budget_bytes = mb << 20; },
                    "MiB of earlier requests' routing kept to complete incremental buffers "
                    "(routed_experts_start_len > 0); the oldest are dropped first")
        ->default_str(std::to_string(R3RoutingPrefixes::kDefaultBudgetBytes >> 20))
        ->check(CLI::Range(int64_t(0), int64_t(1) << 30));
  cmd->footer("Example:\n  " + example + "\nLayouts, fields read and the checks: docs/ADAPTERS.md");
  cmd->callback([a] { set_action([a] { return run_import_cmd(*a); }); });
}

void add_export(CLI::App* exp, const std::string& engine, const std::string& out_help,
                const std::string& example) {
  auto a = std::make_shared<ExportArgs>();
  a->engine = engine;
  CLI::App* cmd =
      exp->add_subcommand(engine, fmt::format("Write a step's decisions in {}'s R3 layout", engine));
  cmd->add_option("TRACE", a->trace, "Trace file")->required();
  cmd->add_option("--step", a->step, "Step index (default: the trace's only complete step)")
      ->check(CLI::NonNegativeNumber);
  cmd->add_option("--out", a->out, out_help)->required();
  if (engine == "sglang")
    cmd->add_flag("--incremental", a->incremental,
                  "Each sequence's routed_experts starts after the rows an earlier sequence of the step "
                  "holds for the same tokens (routed_experts_start_len), as a session server's turns do");
  cmd->footer("Example:\n  " + example + "\nLayouts: docs/ADAPTERS.md");
  cmd->callback([a] { set_action([a] { return run_export(*a); }); });
}

}  // namespace

void register_adapter_commands(CLI::App& app) {
  CLI::App* import =
      app.add_subcommand("import", "Import another engine's routing / indexer decisions (R3) as a trace");
  import->require_subcommand(1);
  add_import(import, "sglang",
             "SGLang responses: JSON (an object or an array of them) or JSONL, one file or more",
             "dsv4 import sglang responses.jsonl --model /ckpt/dsv4-flash --out rollout.h5");
  add_import(import, "miles",
             "miles samples: .npz files, sample directories of .npy files, or directories of those",
             "dsv4 import miles dumps/rollout_0/ --config flash/config.json --out rollout.h5");

  CLI::App* exp = app.add_subcommand("export", "Write a trace's decisions in another engine's R3 layout");
  exp->require_subcommand(1);
  add_export(exp, "sglang", "JSONL file, one SGLang response per sequence",
             "dsv4 export sglang run.h5 --step 0 --out responses.jsonl");
  add_export(exp, "miles", "Directory for one .npz per sequence (sample_000000.npz, ...)",
             "dsv4 export miles run.h5 --out samples/");
}

}  // namespace dsv4::cli
