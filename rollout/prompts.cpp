// Reading the prompts JSONL file of `dsv4 generate`; the format is in rollout/prompts.h.
#include "rollout/prompts.h"

#include <fmt/format.h>

#include <cmath>
#include <limits>
#include <nlohmann/json.hpp>

#include "model/error.h"
#include "model/jsonl.h"

namespace dsv4::rollout {

namespace {

using nlohmann::json;

// A number representable as a finite fp32 value (range only; it is rounded to fp32).
float fp32_number(const JsonLineReader& r, const json& v, const std::string& field) {
  const double x = r.number(v, field);
  if (!(std::fabs(x) <= double(std::numeric_limits<float>::max())))
    r.fail(fmt::format("field '{}' is outside the fp32 range, found {}", field, v.dump()));
  return float(x);
}

uint64_t seed(const JsonLineReader& r, const json& v) {
  if (!v.is_number_integer() || (!v.is_number_unsigned() && v.get<int64_t>() < 0))
    r.fail(fmt::format("field 'seed' must be an integer in [0, 2^64), found {}",
                       v.is_number_integer() ? v.dump() : json_type_of(v)));
  return v.get<uint64_t>();
}

void check_defaults(const GenerateDefaults& d, const ModelConfig& config) {
  const std::string where = "generate defaults";
  if (d.max_new_tokens < 1)
    throw InputError(fmt::format("{}: max_new_tokens must be >= 1, found {}", where, d.max_new_tokens));
  check_sampling(d.sampling, where);
  for (size_t i = 0; i < d.stop_ids.size(); ++i)
    if (d.stop_ids[i] < 0 || d.stop_ids[i] >= config.vocab_size)
      throw InputError(fmt::format("{}: stop id {} (index {}) is outside the vocabulary [0, {})", where,
                                   d.stop_ids[i], i, config.vocab_size));
}

PromptRequest read_line(const json& j, const JsonLineReader& r, const ModelConfig& config,
                        const GenerateDefaults& d, size_t index) {
  r.only_fields(j, {"id", "prompt", "max_new_tokens", "temperature", "top_p", "top_k", "seed", "stop"},
                "known fields: id, prompt, max_new_tokens, temperature, top_p, top_k, seed, stop");

  PromptRequest q;
  q.id = r.id_or_index(j, index);
  if (!j.contains("prompt")) r.fail("field 'prompt' is missing (an array of token ids)");
  q.prompt = r.token_ids(j.at("prompt"), "prompt", config.vocab_size, JsonLineReader::Empty::kRefused);
  q.max_new_tokens =
      j.contains("max_new_tokens")
          ? int(r.integer(j.at("max_new_tokens"), "max_new_tokens", 1, std::numeric_limits<int>::max()))
          : d.max_new_tokens;
  q.stop_ids = j.contains("stop")
                   ? r.token_ids(j.at("stop"), "stop", config.vocab_size, JsonLineReader::Empty::kAllowed)
                   : d.stop_ids;

  q.sampling = d.sampling;
  if (j.contains("temperature")) q.sampling.temperature = fp32_number(r, j.at("temperature"), "temperature");
  if (j.contains("top_p")) q.sampling.top_p = fp32_number(r, j.at("top_p"), "top_p");
  if (j.contains("top_k"))
    q.sampling.top_k = int(r.integer(j.at("top_k"), "top_k", 0, std::numeric_limits<int>::max()));
  if (j.contains("seed")) q.sampling.seed = seed(r, j.at("seed"));
  check_sampling(q.sampling, r.where());

  const int64_t limit = config.max_position_embeddings;
  const int64_t total = int64_t(q.prompt.size()) + q.max_new_tokens;
  if (total > limit)
    r.fail(fmt::format("prompt length {} + max_new_tokens {} = {} exceeds max_position_embeddings = {}",
                       q.prompt.size(), q.max_new_tokens, total, limit));
  return q;
}

}  // namespace

std::vector<PromptRequest> read_prompts(const std::string& path, const ModelConfig& config,
                                        const GenerateDefaults& d) {
  check_defaults(d, config);
  std::vector<PromptRequest> out;
  JsonLineIds ids;
  for_each_json_line(path, "prompts file", "requests", [&](const json& j, const JsonLineReader& r) {
    PromptRequest q = read_line(j, r, config, d, out.size());
    q.line = r.line();
    ids.claim(q.id, r);
    out.push_back(std::move(q));
  });
  return out;
}

}  // namespace dsv4::rollout
