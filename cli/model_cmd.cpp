// dsv4 model init | info
#include <fmt/core.h>
#include <fmt/format.h>

#include <fstream>
#include <memory>
#include <nlohmann/json.hpp>

#include "cli/commands.h"
#include "model/checkpoint.h"
#include "model/config.h"
#include "model/error.h"
#include "model/weights.h"

namespace dsv4::cli {

namespace {

struct InitArgs {
  std::string preset = "tiny";
  std::string config;
  uint64_t seed = 0;
  std::string out;
  int64_t shard_mb = 0;
};

struct InfoArgs {
  std::string model;
  std::string preset;
  bool json = false;
};

std::string human(int64_t n) {
  if (n >= 1000000000LL) return fmt::format("{:.2f}B", n / 1e9);
  if (n >= 1000000LL) return fmt::format("{:.2f}M", n / 1e6);
  if (n >= 1000LL) return fmt::format("{:.1f}K", n / 1e3);
  return fmt::format("{}", n);
}

int run_init(const InitArgs& a) {
  ModelConfig c = a.config.empty() ? preset(a.preset) : config_from_file(a.config);
  Weights w = Weights::init(c, a.seed);
  w.save(a.out, a.shard_mb * 1024 * 1024);
  fmt::print("wrote {}/config.json and {} weights ({} tensors, {} parameters, seed {})\n", a.out,
             a.shard_mb > 0 ? "sharded" : "model.safetensors", w.tensors().size(), human(total_params(c)),
             a.seed);
  return 0;
}

int run_info(const InfoArgs& a) {
  if (a.model.empty() == a.preset.empty())
    throw InputError("model info: give exactly one of --model DIR or --preset NAME");
  ModelConfig c;
  std::string source;
  if (!a.model.empty()) {
    Weights w = open_checkpoint(a.model);  // loads and checks every tensor
    c = w.config();
    source = a.model;
  } else {
    c = preset(a.preset);
    source = "preset " + a.preset;
  }
  const auto counts = param_counts(c);
  const DecisionBytes db = decision_bytes_per_token(c);
  int n_c1 = 0, n_c4 = 0, n_c128 = 0;
  for (int r : c.compress_ratios) (r == 0 ? n_c1 : r == 4 ? n_c4 : n_c128)++;
  if (a.json) {
    nlohmann::json j;
    j["source"] = source;
    j["config"] = nlohmann::json::parse(config_to_json(c));
    for (const auto& pc : counts) j["params"][pc.component] = pc.params;
    j["params_total"] = total_params(c);
    j["layers"] = {{"c1", n_c1}, {"c4", n_c4}, {"c128", n_c128}, {"hash", c.num_hash_layers}};
    j["trace_bytes_per_token"] = {{"indexer_topk_int32", db.indexer_raw},
                                  {"routing_int32_plus_weights", db.routing_raw},
                                  {"margins", db.margins},
                                  {"mhc", db.mhc},
                                  {"total_raw", db.total_raw()}};
    fmt::print("{}\n", j.dump(2));
    return 0;
  }
  fmt::print("model: {}\n", source);
  fmt::print("  hidden {}  layers {} (C1 {}, C4 {}, C128 {}; hash-routed {})  heads {} x {}  vocab {}\n",
             c.hidden_size, c.num_hidden_layers, n_c1, n_c4, n_c128, c.num_hash_layers, c.num_attention_heads,
             c.head_dim, c.vocab_size);
  fmt::print("  experts {} (top {}, shared {}, inter {})  indexer {} heads x {} top {}  window {}  hc {}\n",
             c.n_routed_experts, c.num_experts_per_tok, c.n_shared_experts, c.moe_intermediate_size,
             c.index_n_heads, c.index_head_dim, c.index_topk, c.sliding_window, c.hc_mult);
  fmt::print("\nparameters\n");
  for (const auto& pc : counts)
    fmt::print("  {:<16} {:>14}  ({})\n", pc.component, pc.params, human(pc.params));
  fmt::print("  {:<16} {:>14}  ({})\n", "total", total_params(c), human(total_params(c)));
  fmt::print("\ntrace bytes per token (decisions, uncompressed)\n");
  fmt::print("  indexer top-k (int32)       {:>10}\n", db.indexer_raw);
  fmt::print("  routing ids + weights       {:>10}\n", db.routing_raw);
  fmt::print("  margins (fp32)              {:>10}\n", db.margins);
  fmt::print("  mHC pre/post/comb (fp32)    {:>10}\n", db.mhc);
  fmt::print("  total                       {:>10}\n", db.total_raw());
  return 0;
}

}  // namespace

void register_model_commands(CLI::App& app) {
  CLI::App* model = app.add_subcommand("model", "Make, inspect or check a DSV4 checkpoint");
  model->require_subcommand(1);

  auto init = std::make_shared<InitArgs>();
  CLI::App* ci = model->add_subcommand("init", "Write a seeded checkpoint (config.json + model.safetensors)");
  ci->add_option("--preset", init->preset, "Built-in config: tiny, tiny-b, mid, flash, pro")
      ->capture_default_str();
  ci->add_option("--config", init->config, "Use this config.json instead of a preset")
      ->check(CLI::ExistingFile);
  ci->add_option("--seed", init->seed, "Seed of the weights")->capture_default_str()->check(CLI::NonNegativeNumber);
  ci->add_option("--out", init->out, "Output directory")->required();
  ci->add_option("--shard-mb", init->shard_mb,
                 "Write shards of at most this many MiB plus an index (0: one file)")
      ->capture_default_str()
      ->check(CLI::Range(int64_t(0), int64_t(1) << 30));
  ci->callback([init] { set_action([init] { return run_init(*init); }); });

  auto info = std::make_shared<InfoArgs>();
  CLI::App* cinfo = model->add_subcommand(
      "info", "Print shapes, parameter counts per component and the trace bytes per token");
  cinfo->add_option("--model", info->model, "Checkpoint directory (loads and checks every tensor)");
  cinfo->add_option("--preset", info->preset,
                    "Built-in config: tiny, tiny-b, mid, flash, pro (shape math only)");
  cinfo->add_flag("--json", info->json, "Print JSON");
  cinfo->callback([info] { set_action([info] { return run_info(*info); }); });
}

}  // namespace dsv4::cli
