// Reading the prompts JSONL file of `dsv4 generate`; the format is in rollout/prompts.h.
#include "rollout/prompts.h"

#include <fmt/format.h>

#include <cmath>
#include <fstream>
#include <limits>
#include <map>
#include <nlohmann/json.hpp>

#include "model/error.h"

namespace dsv4::rollout {

namespace {

using nlohmann::json;

// JSON's name for the type of v, for "expected X, found Y" messages.
std::string type_of(const json& v) {
  if (v.is_number_integer()) return "an integer";
  if (v.is_number_float()) return "a number with a fraction or exponent";
  if (v.is_boolean()) return "a boolean";
  return std::string("a ") + v.type_name();
}

// Reads one line's fields; every message is prefixed with "<path> line <n>: ".
class LineReader {
 public:
  LineReader(std::string where, const ModelConfig& config) : where_(std::move(where)), config_(config) {}

  [[noreturn]] void fail(const std::string& msg) const {
    throw InputError(fmt::format("{}: {}", where_, msg));
  }

  // An array of token ids in [0, vocab_size); `field` names it in messages.
  std::vector<int32_t> token_ids(const json& v, const std::string& field) const {
    if (!v.is_array())
      fail(fmt::format("field '{}' must be an array of token ids, found {}", field, type_of(v)));
    std::vector<int32_t> ids;
    ids.reserve(v.size());
    for (size_t i = 0; i < v.size(); ++i) {
      const json& x = v[i];
      if (!x.is_number_integer())
        fail(fmt::format("field '{}', index {}: a token id must be an integer, found {}", field, i,
                         type_of(x)));
      const bool negative = !x.is_number_unsigned() && x.get<int64_t>() < 0;
      if (negative || x.get<uint64_t>() >= uint64_t(config_.vocab_size))
        fail(fmt::format("field '{}', index {}: token id {} is outside the vocabulary [0, {})", field, i,
                         x.dump(), config_.vocab_size));
      ids.push_back(x.get<int32_t>());
    }
    return ids;
  }

  // An integer in [lo, hi].
  int64_t integer(const json& v, const std::string& field, int64_t lo, int64_t hi) const {
    if (!v.is_number_integer())
      fail(fmt::format("field '{}' must be an integer, found {}", field, type_of(v)));
    // nlohmann stores non-negative literals as unsigned; values above INT64_MAX are out of any range here.
    const bool fits =
        !v.is_number_unsigned() || v.get<uint64_t>() <= uint64_t(std::numeric_limits<int64_t>::max());
    const int64_t x = fits ? v.get<int64_t>() : 0;
    if (!fits || x < lo || x > hi)
      fail(fmt::format("field '{}' must be in [{}, {}], found {}", field, lo, hi, v.dump()));
    return x;
  }

  // A number representable as a finite fp32 value (range only; it is rounded to fp32).
  float number(const json& v, const std::string& field) const {
    if (!v.is_number()) fail(fmt::format("field '{}' must be a number, found {}", field, type_of(v)));
    const double x = v.get<double>();
    if (!(std::fabs(x) <= double(std::numeric_limits<float>::max())))
      fail(fmt::format("field '{}' is outside the fp32 range, found {}", field, v.dump()));
    return float(x);
  }

  uint64_t seed(const json& v) const {
    if (!v.is_number_integer() || (!v.is_number_unsigned() && v.get<int64_t>() < 0))
      fail(fmt::format("field 'seed' must be an integer in [0, 2^64), found {}",
                       v.is_number_integer() ? v.dump() : type_of(v)));
    return v.get<uint64_t>();
  }

  std::string id(const json& v) const {
    if (v.is_string()) {
      if (v.get<std::string>().empty()) fail("field 'id' must not be empty");
      return v.get<std::string>();
    }
    if (v.is_number_integer()) return v.dump();
    fail(fmt::format("field 'id' must be a string or an integer, found {}", type_of(v)));
  }

  const std::string& where() const { return where_; }

 private:
  std::string where_;
  const ModelConfig& config_;
};

const char* const kFields[] = {"id",    "prompt", "max_new_tokens", "temperature",
                               "top_p", "top_k",  "seed",           "stop"};

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

PromptRequest read_line(const json& j, LineReader& r, const ModelConfig& config, const GenerateDefaults& d,
                        size_t index) {
  if (!j.is_object()) r.fail(fmt::format("expected a JSON object, found {}", type_of(j)));
  for (const auto& [key, value] : j.items()) {
    bool known = false;
    for (const char* f : kFields) known = known || key == f;
    if (!known)
      r.fail(
          fmt::format("unknown field '{}' (known fields: id, prompt, max_new_tokens, temperature, top_p, "
                      "top_k, seed, stop)",
                      key));
  }

  PromptRequest q;
  q.id = j.contains("id") ? r.id(j.at("id")) : std::to_string(index);
  if (!j.contains("prompt")) r.fail("field 'prompt' is missing (an array of token ids)");
  q.prompt = r.token_ids(j.at("prompt"), "prompt");
  if (q.prompt.empty()) r.fail("field 'prompt' is empty (at least one token id is needed)");
  q.max_new_tokens =
      j.contains("max_new_tokens")
          ? int(r.integer(j.at("max_new_tokens"), "max_new_tokens", 1, std::numeric_limits<int>::max()))
          : d.max_new_tokens;
  q.stop_ids = j.contains("stop") ? r.token_ids(j.at("stop"), "stop") : d.stop_ids;

  q.sampling = d.sampling;
  if (j.contains("temperature")) q.sampling.temperature = r.number(j.at("temperature"), "temperature");
  if (j.contains("top_p")) q.sampling.top_p = r.number(j.at("top_p"), "top_p");
  if (j.contains("top_k"))
    q.sampling.top_k = int(r.integer(j.at("top_k"), "top_k", 0, std::numeric_limits<int>::max()));
  if (j.contains("seed")) q.sampling.seed = r.seed(j.at("seed"));
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
  std::ifstream f(path);
  if (!f) throw InputError(fmt::format("{}: cannot open the prompts file", path));
  std::vector<PromptRequest> out;
  std::map<std::string, int> line_of_id;
  std::string text;
  int lineno = 0;
  while (std::getline(f, text)) {
    ++lineno;
    if (text.find_first_not_of(" \t\r") == std::string::npos) continue;
    LineReader r(fmt::format("{} line {}", path, lineno), config);
    json j;
    try {
      j = json::parse(text);
    } catch (const json::parse_error& e) {
      r.fail(fmt::format("not valid JSON (error at byte {})", e.byte));
    }
    PromptRequest q = read_line(j, r, config, d, out.size());
    q.line = lineno;
    const auto [it, inserted] = line_of_id.emplace(q.id, lineno);
    if (!inserted) r.fail(fmt::format("field 'id': '{}' is already the id of line {}", q.id, it->second));
    out.push_back(std::move(q));
  }
  if (f.bad()) throw InputError(fmt::format("{}: read error after line {}", path, lineno));
  if (out.empty())
    throw InputError(fmt::format("{}: no requests (the file is empty or holds only blank lines)", path));
  return out;
}

}  // namespace dsv4::rollout
