// Reading and writing the training data JSONL of `dsv4 train-step`; the format is in train/samples.h.
#include "train/samples.h"

#include <fmt/format.h>

#include <charconv>
#include <cmath>
#include <fstream>
#include <limits>
#include <map>
#include <nlohmann/json.hpp>

#include "model/error.h"

namespace dsv4::train {

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

  // A non-empty array of token ids in [0, vocab_size).
  std::vector<int32_t> token_ids(const json& v, const std::string& field) const {
    if (!v.is_array())
      fail(fmt::format("field '{}' must be an array of token ids, found {}", field, type_of(v)));
    if (v.empty()) fail(fmt::format("field '{}' is empty (at least one token id is needed)", field));
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

  // A finite number (fp64).
  double number(const json& v, const std::string& field) const {
    if (!v.is_number()) fail(fmt::format("field '{}' must be a number, found {}", field, type_of(v)));
    const double x = v.get<double>();
    if (!std::isfinite(x)) fail(fmt::format("field '{}' must be finite, found {}", field, v.dump()));
    return x;
  }

  // [n] numbers that round to finite fp32 values (rounded to nearest).
  std::vector<float> logprobs(const json& v, const std::string& field, size_t n) const {
    if (!v.is_array())
      fail(fmt::format("field '{}' must be an array of numbers, found {}", field, type_of(v)));
    if (v.size() != n)
      fail(fmt::format("field '{}' has {} values, expected {} (one per token of 'response')", field, v.size(),
                       n));
    std::vector<float> out(n);
    for (size_t i = 0; i < n; ++i) {
      const json& x = v[i];
      if (!x.is_number())
        fail(fmt::format("field '{}', index {}: expected a number, found {}", field, i, type_of(x)));
      const double d = x.get<double>();
      // Below 2^128 - 2^103 (half an ulp above the largest float) the value rounds to a finite fp32.
      if (!(std::fabs(d) < 0x1.ffffffp+127))
        fail(fmt::format("field '{}', index {}: {} is not a finite fp32 number", field, i, x.dump()));
      out[i] = float(d);
    }
    return out;
  }

  std::string id(const json& v) const {
    if (v.is_string()) {
      if (v.get<std::string>().empty()) fail("field 'id' must not be empty");
      return v.get<std::string>();
    }
    if (v.is_number_integer()) return v.dump();
    fail(fmt::format("field 'id' must be a string or an integer, found {}", type_of(v)));
  }

  std::string group(const json& v) const {
    if (!v.is_string()) fail(fmt::format("field 'group' must be a string, found {}", type_of(v)));
    if (v.get<std::string>().empty()) fail("field 'group' must not be empty");
    return v.get<std::string>();
  }

 private:
  std::string where_;
  const ModelConfig& config_;
};

const char* const kFields[] = {"id",           "prompt",       "response",  "rollout_logprobs",
                               "old_logprobs", "ref_logprobs", "advantage", "reward",
                               "group"};
// The other fields of a `dsv4 generate` sample (cli/generate_cmd.cpp): its "logprobs" are the
// engine's log-probs of the response tokens (read as rollout_logprobs); the rest is ignored.
const char* const kGenerateFields[] = {"index", "logprobs", "finish_reason", "sampling", "prefix"};

TrainSample read_line(const json& j, const LineReader& r, const ModelConfig& config, size_t index) {
  if (!j.is_object()) r.fail(fmt::format("expected a JSON object, found {}", type_of(j)));
  for (const auto& [key, value] : j.items()) {
    bool known = false;
    for (const char* f : kFields) known = known || key == f;
    for (const char* f : kGenerateFields) known = known || key == f;
    if (!known)
      r.fail(
          fmt::format("unknown field '{}' (known fields: id, prompt, response, rollout_logprobs, "
                      "old_logprobs, ref_logprobs, advantage, reward, group; and those of dsv4 generate: "
                      "index, logprobs, finish_reason, sampling, prefix)",
                      key));
  }

  TrainSample s;
  s.id = j.contains("id") ? r.id(j.at("id")) : std::to_string(index);
  for (const char* f : {"prompt", "response"})
    if (!j.contains(f)) r.fail(fmt::format("field '{}' is missing (an array of token ids)", f));
  s.prompt = r.token_ids(j.at("prompt"), "prompt");
  s.response = r.token_ids(j.at("response"), "response");
  const int64_t limit = config.max_position_embeddings;
  const int64_t total = int64_t(s.prompt.size()) + int64_t(s.response.size());
  if (total > limit)
    r.fail(
        fmt::format("field 'response': prompt length {} + response length {} = {} exceeds "
                    "max_position_embeddings = {}",
                    s.prompt.size(), s.response.size(), total, limit));

  const size_t n = s.response.size();
  if (j.contains("rollout_logprobs") && j.contains("logprobs"))
    r.fail("fields 'rollout_logprobs' and 'logprobs' (dsv4 generate's name for them) are both given");
  if (j.contains("rollout_logprobs"))
    s.rollout_logprobs = r.logprobs(j.at("rollout_logprobs"), "rollout_logprobs", n);
  else if (j.contains("logprobs"))
    s.rollout_logprobs = r.logprobs(j.at("logprobs"), "logprobs", n);
  if (j.contains("old_logprobs")) s.old_logprobs = r.logprobs(j.at("old_logprobs"), "old_logprobs", n);
  if (j.contains("ref_logprobs")) s.ref_logprobs = r.logprobs(j.at("ref_logprobs"), "ref_logprobs", n);

  const bool has_adv = j.contains("advantage"), has_reward = j.contains("reward");
  if (has_adv && has_reward)
    r.fail("fields 'advantage' and 'reward' are both given (a sample has one or the other)");
  if (!has_adv && !has_reward) r.fail("field 'advantage' or 'reward' is needed (neither is given)");
  if (has_adv) {
    s.advantage = r.number(j.at("advantage"), "advantage");
    if (j.contains("group"))
      r.fail("field 'group' is only used with 'reward' (this sample gives 'advantage')");
  } else {
    s.reward = r.number(j.at("reward"), "reward");
    if (j.contains("group")) s.group = r.group(j.at("group"));
  }
  return s;
}

// The shortest decimal text that reads back (as fp64, then rounded to fp32) to exactly x, as the
// fp64 value that text denotes; nlohmann then prints it with those digits.
double json_value_of(float x) {
  char buf[64];
  const auto res = std::to_chars(buf, buf + sizeof(buf), x);
  double d = 0;
  const auto back = std::from_chars(buf, res.ptr, d);
  if (back.ec == std::errc() && float(d) == x) return d;
  return double(x);  // exact, printed with up to 17 digits
}

}  // namespace

std::vector<int32_t> TrainSample::tokens() const {
  std::vector<int32_t> t = prompt;
  t.insert(t.end(), response.begin(), response.end());
  return t;
}

std::vector<TrainSample> read_samples_jsonl(const std::string& path, const ModelConfig& c) {
  std::ifstream f(path);
  if (!f) throw InputError(fmt::format("{}: cannot open the training data file", path));
  std::vector<TrainSample> out;
  std::map<std::string, int> line_of_id;
  int first_adv_line = 0, first_reward_line = 0;
  std::string text;
  int lineno = 0;
  while (std::getline(f, text)) {
    ++lineno;
    if (text.find_first_not_of(" \t\r") == std::string::npos) continue;
    const LineReader r(fmt::format("{} line {}", path, lineno), c);
    json j;
    try {
      j = json::parse(text);
    } catch (const json::parse_error& e) {
      r.fail(fmt::format("not valid JSON (error at byte {})", e.byte));
    } catch (const json::out_of_range&) {
      r.fail("not valid JSON (a number is too large for fp64)");
    }
    TrainSample s = read_line(j, r, c, out.size());
    s.line = lineno;
    if (s.advantage && first_reward_line)
      r.fail(fmt::format(
          "field 'advantage': line {} gives 'reward' (a file uses advantages or rewards, not both)",
          first_reward_line));
    if (s.reward && first_adv_line)
      r.fail(fmt::format(
          "field 'reward': line {} gives 'advantage' (a file uses advantages or rewards, not both)",
          first_adv_line));
    if (s.advantage && !first_adv_line) first_adv_line = lineno;
    if (s.reward && !first_reward_line) first_reward_line = lineno;
    const auto [it, inserted] = line_of_id.emplace(s.id, lineno);
    if (!inserted) r.fail(fmt::format("field 'id': '{}' is already the id of line {}", s.id, it->second));
    out.push_back(std::move(s));
  }
  if (f.bad()) throw InputError(fmt::format("{}: read error after line {}", path, lineno));
  if (out.empty())
    throw InputError(fmt::format("{}: no samples (the file is empty or holds only blank lines)", path));
  return out;
}

std::string sample_to_json(const TrainSample& s) {
  auto bad = [&](const std::string& what) {
    return Error(fmt::format("sample '{}': cannot write it as a training data line: {}", s.id, what));
  };
  nlohmann::ordered_json j = nlohmann::ordered_json::object();  // fields in the order of the format
  if (s.id.empty()) throw bad("the id is empty");
  j["id"] = s.id;
  j["prompt"] = s.prompt;
  j["response"] = s.response;
  for (const auto& [field, v] :
       {std::pair<const char*, const std::vector<float>*>{"rollout_logprobs", &s.rollout_logprobs},
        {"old_logprobs", &s.old_logprobs},
        {"ref_logprobs", &s.ref_logprobs}}) {
    if (v->empty()) continue;
    if (v->size() != s.response.size())
      throw bad(
          fmt::format("'{}' has {} values but the response {} tokens", field, v->size(), s.response.size()));
    nlohmann::ordered_json a = nlohmann::ordered_json::array();
    for (size_t i = 0; i < v->size(); ++i) {
      if (!std::isfinite((*v)[i])) throw bad(fmt::format("'{}' index {} is {}", field, i, (*v)[i]));
      a.push_back(json_value_of((*v)[i]));
    }
    j[field] = std::move(a);
  }
  if (s.advantage.has_value() == s.reward.has_value())
    throw bad("exactly one of 'advantage' and 'reward' must be set");
  const char* field = s.advantage ? "advantage" : "reward";
  const double value = s.advantage ? *s.advantage : *s.reward;
  if (!std::isfinite(value)) throw bad(fmt::format("'{}' is {}", field, value));
  j[field] = value;
  if (!s.group.empty()) {
    if (s.advantage) throw bad("'group' is only written with 'reward'");
    j["group"] = s.group;
  }
  return j.dump();
}

}  // namespace dsv4::train
