// Reading and writing the training data JSONL of `dsv4 train-step`; the format is in train/samples.h.
#include "train/samples.h"

#include <fmt/format.h>

#include <charconv>
#include <fstream>
#include <map>
#include <cmath>
#include <limits>
#include <nlohmann/json.hpp>

#include "capture/errors.h"
#include "capture/generation.h"
#include "capture/trace_open.h"
#include "capture/trace_reader.h"
#include "model/error.h"
#include "model/jsonl.h"

namespace dsv4::train {

namespace {

using nlohmann::json;

// [n] numbers that round to finite fp32 values (rounded to nearest).
std::vector<float> logprobs(const JsonLineReader& r, const json& v, const std::string& field, size_t n) {
  if (!v.is_array())
    r.fail(fmt::format("field '{}' must be an array of numbers, found {}", field, json_type_of(v)));
  if (v.size() != n)
    r.fail(fmt::format("field '{}' has {} values, expected {} (one per token of 'response')", field, v.size(),
                       n));
  std::vector<float> out(n);
  for (size_t i = 0; i < n; ++i) {
    const json& x = v[i];
    if (!x.is_number())
      r.fail(fmt::format("field '{}', index {}: expected a number, found {}", field, i, json_type_of(x)));
    const double d = x.get<double>();
    // Below 2^128 - 2^103 (half an ulp above the largest float) the value rounds to a finite fp32.
    if (!(std::fabs(d) < 0x1.ffffffp+127))
      r.fail(fmt::format("field '{}', index {}: {} is not a finite fp32 number", field, i, x.dump()));
    out[i] = float(d);
  }
  return out;
}

std::string group(const JsonLineReader& r, const json& v) {
  if (!v.is_string()) r.fail(fmt::format("field 'group' must be a string, found {}", json_type_of(v)));
  if (v.get<std::string>().empty()) r.fail("field 'group' must not be empty");
  return v.get<std::string>();
}

// The fields of a `dsv4 generate` sample (cli/generate_cmd.cpp) are known too: its "logprobs" are the
// engine's log-probs of the response tokens (read as rollout_logprobs); the rest is ignored.
TrainSample read_line(const json& j, const JsonLineReader& r, const ModelConfig& config, size_t index) {
  r.only_fields(
      j,
      {"id", "prompt", "response", "rollout_logprobs", "old_logprobs", "ref_logprobs", "advantage", "reward",
       "group", "index", "logprobs", "finish_reason", "sampling", "prefix"},
      "known fields: id, prompt, response, rollout_logprobs, old_logprobs, ref_logprobs, advantage, "
      "reward, group; and those of dsv4 generate: index, logprobs, finish_reason, sampling, prefix");

  TrainSample s;
  s.id = r.id_or_index(j, index);
  for (const char* f : {"prompt", "response"})
    if (!j.contains(f)) r.fail(fmt::format("field '{}' is missing (an array of token ids)", f));
  s.prompt = r.token_ids(j.at("prompt"), "prompt", config.vocab_size, JsonLineReader::Empty::kRefused);
  s.response = r.token_ids(j.at("response"), "response", config.vocab_size, JsonLineReader::Empty::kRefused);
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
    s.rollout_logprobs = logprobs(r, j.at("rollout_logprobs"), "rollout_logprobs", n);
  else if (j.contains("logprobs"))
    s.rollout_logprobs = logprobs(r, j.at("logprobs"), "logprobs", n);
  if (j.contains("old_logprobs")) s.old_logprobs = logprobs(r, j.at("old_logprobs"), "old_logprobs", n);
  if (j.contains("ref_logprobs")) s.ref_logprobs = logprobs(r, j.at("ref_logprobs"), "ref_logprobs", n);

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
    if (j.contains("group")) s.group = group(r, j.at("group"));
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
  std::vector<TrainSample> out;
  JsonLineIds ids;
  int first_adv_line = 0, first_reward_line = 0;
  for_each_json_line(path, "training data file", "samples", [&](const json& j, const JsonLineReader& r) {
    TrainSample s = read_line(j, r, c, out.size());
    s.line = r.line();
    if (s.advantage && first_reward_line)
      r.fail(fmt::format(
          "field 'advantage': line {} gives 'reward' (a file uses advantages or rewards, not both)",
          first_reward_line));
    if (s.reward && first_adv_line)
      r.fail(fmt::format(
          "field 'reward': line {} gives 'advantage' (a file uses advantages or rewards, not both)",
          first_adv_line));
    if (s.advantage && !first_adv_line) first_adv_line = s.line;
    if (s.reward && !first_reward_line) first_reward_line = s.line;
    ids.claim(s.id, r);
    out.push_back(std::move(s));
  });
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

namespace dsv4::train {

bool is_hdf5_file(const std::string& path) {
  // HDF5's signature at 0 or after a user block (a sealed trace's is 512 bytes): capture/trace_open.h.
  try {
    return writer_marks(path).hdf5;
  } catch (const TraceError&) {
    return false;
  }
}

std::vector<TrainSample> read_samples_trace(const std::string& trace_path, int step, const std::string& rewards_path,
                                            const ModelConfig& c) {
  const TraceReader r = TraceReader::open(trace_path);
  const std::vector<TraceStepInfo> steps = r.steps();
  if (step < 0 || step >= int(steps.size()))
    throw InputError(fmt::format("{}: no step {} (the trace has {} step{})", trace_path, step, steps.size(),
                                 steps.size() == 1 ? "" : "s"));
  const TraceStepInfo& info = steps[size_t(step)];
  if (!info.complete)
    throw InputError(fmt::format("{}: step {} is incomplete (run `dsv4 trace salvage`)", trace_path, step));
  if (info.kind == "train-step")
    throw InputError(fmt::format("{}: step {} is a training step, not a rollout", trace_path, step));
  const std::optional<GenerationRecord> gen = r.generation(step);
  const size_t n = info.seq_lengths.size();
  const std::string where = fmt::format("{} step {}", trace_path, step);

  // The samples' tokens and rollout log-probs; prefill steps are split once the rewards give the
  // prompt lengths.
  std::vector<TrainSample> out(n);
  std::vector<std::vector<int32_t>> tokens(n);
  std::map<std::string, size_t> by_id;
  for (size_t i = 0; i < n; ++i) {
    tokens[i] = r.tokens(step, int(i));
    for (size_t t = 0; t < tokens[i].size(); ++t)
      if (tokens[i][t] < 0 || tokens[i][t] >= c.vocab_size)
        throw InputError(fmt::format("{} sequence {} token {}: id {} is outside the model's vocabulary [0, {})",
                                     where, i, t, tokens[i][t], c.vocab_size));
    TrainSample& s = out[i];
    if (gen) {
      const GenerationRequestRecord& q = gen->requests.at(i);
      const size_t P = size_t(q.prompt_length);
      if (P < 1 || P + q.tokens.size() != tokens[i].size() || q.tokens.empty() ||
          !std::equal(q.tokens.begin(), q.tokens.end(), tokens[i].begin() + std::ptrdiff_t(P)))
        throw InputError(fmt::format("{} request '{}': its prompt and generated tokens do not make sequence {}",
                                     where, q.id, i));
      s.id = q.id;
      s.prompt.assign(tokens[i].begin(), tokens[i].begin() + std::ptrdiff_t(P));
      s.response = q.tokens;
      s.rollout_logprobs = q.logprobs;
    } else {
      s.id = std::to_string(i);
    }
    by_id.emplace(s.id, i);
  }

  std::vector<int> line_of(n, 0);
  std::vector<int64_t> prompt_length(n, 0);
  int first_adv_line = 0, first_reward_line = 0;
  for_each_json_line(rewards_path, "rewards file", "rewards", [&](const json& j, const JsonLineReader& lr) {
    lr.only_fields(j, {"id", "seq", "reward", "advantage", "group", "prompt_length"},
                   "known fields: id, seq, reward, advantage, group, prompt_length");
    if (j.contains("id") == j.contains("seq")) lr.fail("give exactly one of 'id' and 'seq' (the sample it is for)");
    size_t i = 0;
    if (j.contains("seq")) {
      i = size_t(lr.integer(j.at("seq"), "seq", 0, int64_t(n) - 1));
    } else {
      const std::string id = lr.id(j.at("id"));
      const auto it = by_id.find(id);
      if (it == by_id.end())
        lr.fail(fmt::format("field 'id': no sample '{}' in {}{}", id, where,
                            gen ? "" : " (a prefill step's samples are named by their sequence index)"));
      i = it->second;
    }
    if (line_of[i]) lr.fail(fmt::format("sample '{}' already has line {}", out[i].id, line_of[i]));
    line_of[i] = lr.line();
    TrainSample& s = out[i];
    s.line = lr.line();
    const bool has_adv = j.contains("advantage"), has_reward = j.contains("reward");
    if (has_adv == has_reward) lr.fail("give exactly one of 'advantage' and 'reward'");
    if (has_adv) {
      if (first_reward_line)
        lr.fail(fmt::format("field 'advantage': line {} gives 'reward' (a file uses one or the other)",
                            first_reward_line));
      if (j.contains("group")) lr.fail("field 'group' is only used with 'reward'");
      s.advantage = lr.number(j.at("advantage"), "advantage");
      if (!first_adv_line) first_adv_line = lr.line();
    } else {
      if (first_adv_line)
        lr.fail(fmt::format("field 'reward': line {} gives 'advantage' (a file uses one or the other)",
                            first_adv_line));
      s.reward = lr.number(j.at("reward"), "reward");
      if (j.contains("group")) s.group = group(lr, j.at("group"));
      if (!first_reward_line) first_reward_line = lr.line();
    }
    if (j.contains("prompt_length")) {
      if (gen) lr.fail("field 'prompt_length': a generation step knows its prompts");
      prompt_length[i] = lr.integer(j.at("prompt_length"), "prompt_length", 1, int64_t(tokens[i].size()) - 1);
    } else if (!gen) {
      lr.fail(fmt::format("field 'prompt_length' is needed: {} is a prefill (dsv4 record) step, which does "
                          "not know where sequence {}'s response starts",
                          where, i));
    }
  });
  for (size_t i = 0; i < n; ++i)
    if (!line_of[i])
      throw InputError(fmt::format("{}: no line for sample '{}' of {} ({} samples, every one needs its reward "
                                   "or advantage)",
                                   rewards_path, out[i].id, where, n));

  if (!gen) {  // split the prefills; their recorded log-probs of the response tokens
    for (size_t i = 0; i < n; ++i) {
      TrainSample& s = out[i];
      const size_t P = size_t(prompt_length[i]);
      s.prompt.assign(tokens[i].begin(), tokens[i].begin() + std::ptrdiff_t(P));
      s.response.assign(tokens[i].begin() + std::ptrdiff_t(P), tokens[i].end());
      const std::vector<float> lp = r.logprobs(step, int(i));  // lp[t]: token t + 1
      if (lp.size() + 1 != tokens[i].size())
        throw InputError(fmt::format("{} sequence {}: {} log-probs for {} tokens", where, i, lp.size(),
                                     tokens[i].size()));
      s.rollout_logprobs.assign(lp.begin() + std::ptrdiff_t(P - 1), lp.end());
    }
  } else if (first_reward_line) {  // GRPO groups: the requests of one prompt, unless the file names them
    std::map<std::vector<int32_t>, std::string> group_of_prompt;
    for (TrainSample& s : out)
      if (s.group.empty()) s.group = "prompt of " + group_of_prompt.emplace(s.prompt, s.id).first->second;
  }
  for (const TrainSample& s : out)
    if (int64_t(s.prompt.size() + s.response.size()) > c.max_position_embeddings)
      throw InputError(fmt::format("{} sample '{}': {} tokens exceed max_position_embeddings = {}", where, s.id,
                                   s.prompt.size() + s.response.size(), c.max_position_embeddings));
  return out;
}

}  // namespace dsv4::train
