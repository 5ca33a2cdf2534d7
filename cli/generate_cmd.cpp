// dsv4 generate
#include <fmt/core.h>
#include <fmt/format.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <memory>
#include <nlohmann/json.hpp>

#include "cli/commands.h"
#include "model/error.h"
#include "replay/generation.h"
#include "rollout/engine.h"
#include "rollout/prompts.h"

namespace dsv4::cli {

namespace {

struct GenerateArgs {
  ModelArgs model;
  std::string prompts;
  rollout::GenerateDefaults defaults;
  std::string stop;
  std::string profile = "rollout";
  std::string numerics = "exact";
  std::string decode_attention = "exact";
  std::string device = "cpu";
  int threads = 0;
  rollout::EngineOptions engine;
  bool no_prefix_sharing = false;
  std::string out;
  std::string record;
  std::string capture = "decisions";
  bool append = false;
  bool quiet = false;
};

std::vector<int32_t> parse_ids(const std::string& list, const char* option) {
  std::vector<int32_t> ids;
  size_t i = 0;
  while (i < list.size()) {
    size_t j = list.find(',', i);
    if (j == std::string::npos) j = list.size();
    const std::string item = list.substr(i, j - i);
    try {
      size_t used = 0;
      const long v = std::stol(item, &used);
      if (used != item.size() || v < INT32_MIN || v > INT32_MAX) throw std::invalid_argument(item);
      ids.push_back(int32_t(v));
    } catch (const std::exception&) {
      throw InputError(fmt::format("{}: '{}' is not a token id", option, item));
    }
    i = j + 1;
  }
  return ids;
}

nlohmann::json generation_json(const rollout::Generation& g, const rollout::PromptRequest& r) {
  nlohmann::json j;
  j["id"] = g.id;
  j["index"] = g.index;
  j["prompt"] = g.prompt;
  j["response"] = g.tokens;
  j["logprobs"] = g.logprobs;
  j["finish_reason"] = rollout::to_string(g.finish);
  j["sampling"] = {{"temperature", r.sampling.temperature},
                   {"top_k", r.sampling.top_k},
                   {"top_p", r.sampling.top_p},
                   {"seed", r.sampling.seed},
                   {"request_key", rollout::request_key(g.id)}};
  if (g.prefix_source >= 0) j["prefix"] = {{"source", g.prefix_source}, {"length", g.shared_prefix}};
  return j;
}

int run_generate(GenerateArgs& a) {
  Weights w = open_model(a.model);
  const ModelConfig& c = w.config();
  if (!a.stop.empty())
    a.defaults.stop_ids = parse_ids(a.stop, "--stop");
  else if (c.eos_token_id >= 0)
    a.defaults.stop_ids = {c.eos_token_id};
  const std::vector<rollout::PromptRequest> reqs = rollout::read_prompts(a.prompts, c, a.defaults);

  a.engine.profile = load_profile(a.profile, parse_numerics(a.numerics));
  a.engine.profile.decode_attention_splits = parse_decode_attention(a.decode_attention);
  a.engine.device = parse_device(a.device);
  a.engine.threads = a.threads;
  a.engine.prefix_sharing = !a.no_prefix_sharing;
  std::vector<rollout::Request> requests;
  for (const auto& r : reqs)
    requests.push_back(rollout::Request{r.id, r.prompt, r.max_new_tokens, r.stop_ids, r.sampling});

  // Progress on stderr at most twice a second, and once at the end.
  auto last = std::chrono::steady_clock::now() - std::chrono::seconds(1);
  int64_t prompt_tokens = 0;
  for (const auto& r : reqs) prompt_tokens += int64_t(r.prompt.size());
  rollout::StepInfo final_info;
  const auto progress = [&](const rollout::StepInfo& s) {
    final_info = s;
    const auto now = std::chrono::steady_clock::now();
    if (a.quiet || now - last < std::chrono::milliseconds(500)) return;
    last = now;
    fmt::print(stderr, "\rgenerate: step {}, {}/{} requests done, {} tokens generated, {:.1f} tok/s   ",
               s.step, s.finished, s.total, s.generated, s.seconds > 0 ? s.generated / s.seconds : 0.0);
  };
  std::vector<rollout::Generation> gens;
  if (!a.record.empty()) {
    GenerateRecordOptions ro;
    ro.capture = a.capture;
    ro.seed = a.model.seed;
    ro.append = a.append;
    gens = record_generation(w, requests, a.engine, a.record, ro, progress).gens;
  } else {
    rollout::Engine engine(w, a.engine);
    for (const auto& r : requests) engine.submit(r);
    gens = engine.run(progress);
  }

  // The samples file appears only complete: written beside, renamed at the end.
  std::string text;
  for (const auto& g : gens) text += generation_json(g, reqs[size_t(g.index)]).dump() + "\n";
  if (a.out.empty()) {
    fmt::print("{}", text);
  } else {
    const std::string tmp = a.out + ".partial";
    {
      std::ofstream f(tmp, std::ios::binary | std::ios::trunc);
      f << text;
      f.flush();
      if (!f) throw Error(fmt::format("{}: write failed", tmp));
    }
    std::filesystem::rename(tmp, a.out);
  }
  const double secs = final_info.seconds;
  if (!a.quiet)
    fmt::print(
        stderr,
        "\rgenerate: {} requests, {} prompt + {} generated tokens in {} steps, {:.3f} s ({:.1f} generated "
        "tok/s), profile {}, device {}{}{}\n",
        gens.size(), prompt_tokens, final_info.generated, final_info.step + 1, secs,
        secs > 0 ? final_info.generated / secs : 0.0, a.profile, a.device,
        a.out.empty() ? "" : fmt::format(", wrote {}", a.out),
        a.record.empty() ? "" : fmt::format(", recorded {}", a.record));
  return 0;
}

}  // namespace

void register_generate_command(CLI::App& app) {
  auto ga = std::make_shared<GenerateArgs>();
  CLI::App* g = app.add_subcommand(
      "generate", "Decode prompts token by token from caches (continuous batching, seeded sampling)");
  add_model_options(g, ga->model);
  g->add_option("--prompts", ga->prompts,
                "JSONL file, one request per line: {\"prompt\": [ids], ...} (docs/SAMPLING.md)")
      ->required();
  g->add_option("--max-new-tokens", ga->defaults.max_new_tokens, "Tokens to generate per request at most")
      ->capture_default_str()
      ->check(CLI::Range(1, 1 << 30));
  g->add_option("--temperature", ga->defaults.sampling.temperature, "Sampling temperature (0: greedy)")
      ->capture_default_str();
  g->add_option("--top-p", ga->defaults.sampling.top_p, "Nucleus sampling mass in (0, 1]")
      ->capture_default_str();
  g->add_option("--top-k", ga->defaults.sampling.top_k, "Keep the k most likely tokens (0: all)")
      ->capture_default_str();
  g->add_option("--sampling-seed", ga->defaults.sampling.seed,
                "Sampling seed: with the request id and the position it keys each draw (--seed is the "
                "preset's weight seed, as in the other commands)")
      ->capture_default_str()
      ->check(CLI::NonNegativeNumber);
  g->add_option("--stop", ga->stop, "Stop token ids, comma-separated (default: the config's eos_token_id)");
  g->add_option("--profile", ga->profile, kProfileHelp)
      ->capture_default_str();
  add_numerics_option(g, ga->numerics);
  g->add_option("--decode-attention", ga->decode_attention,
                "Decode-step attention order: exact (decode = prefill bit for bit) or split:N (an inference "
                "engine's split-KV reduction over N parts)")
      ->capture_default_str()
      ->check([](const std::string& s) {
        try {
          parse_decode_attention(s);
          return std::string();
        } catch (const InputError& e) {
          return std::string(e.what());
        }
      });
  g->add_option("--device", ga->device, "cpu or cuda (same bits on both)")->capture_default_str();
  add_threads_option(g, ga->threads, "CPU threads (0: all); results do not depend on it");
  g->add_option("--max-batch", ga->engine.max_batch, "Requests running at once at most")
      ->capture_default_str()
      ->check(CLI::Range(1, 1 << 20));
  g->add_option("--page-size", ga->engine.page_size, "Cache rows per page")
      ->capture_default_str()
      ->check(CLI::Range(1, 1 << 20));
  g->add_option("--prefill-chunk", ga->engine.prefill_chunk,
                "Prompt tokens per step and request at most (0: whole)")
      ->capture_default_str()
      ->check(CLI::Range(0, 1 << 30));
  g->add_option("--token-budget", ga->engine.token_budget, "Tokens per step over all requests (0: no limit)")
      ->capture_default_str()
      ->check(CLI::Range(int64_t(0), int64_t(1) << 40));
  g->add_flag("--no-prefix-sharing", ga->no_prefix_sharing,
              "Prefill every prompt itself instead of forking the cache of an earlier equal prompt");
  g->add_option("--out", ga->out, "Write the samples (JSONL) here (default: stdout)");
  g->add_option(
      "--record", ga->record,
      "Record the generation into this trace (one step of kind generate; replay it with dsv4 replay)");
  g->add_option("--capture", ga->capture, "With --record: capture policy (decisions, full, or patterns)")
      ->capture_default_str();
  g->add_flag("--append", ga->append, "With --record: add the step to an existing trace");
  g->add_flag("--quiet", ga->quiet, "No progress on stderr");
  g->callback([ga] { set_action([ga] { return run_generate(*ga); }); });
}

}  // namespace dsv4::cli
