#include "adapters/sglang.h"

#include <fmt/core.h>

#include <cstdio>
#include <fstream>
#include <limits>

#include "adapters/base64.h"
#include "model/error.h"

namespace dsv4 {

using json = nlohmann::json;

namespace {

std::vector<int32_t> token_list(const json& v, const std::string& where) {
  if (!v.is_array()) throw InputError(fmt::format("{}: not an array of token ids", where));
  std::vector<int32_t> out;
  out.reserve(v.size());
  for (size_t i = 0; i < v.size(); ++i) {
    const json& x = v[i];
    if (!x.is_number_integer() || x.get<int64_t>() < 0 ||
        x.get<int64_t>() > std::numeric_limits<int32_t>::max())
      throw InputError(fmt::format("{}[{}]: {} is not a token id", where, i, x.dump()));
    out.push_back(int32_t(x.get<int64_t>()));
  }
  return out;
}

// The [logprob, token_id, ...] entries SGLang returns per position.
const json* logprob_entries(const json& meta, const char* field, const std::string& where) {
  auto it = meta.find(field);
  if (it == meta.end() || it->is_null()) return nullptr;
  if (!it->is_array()) throw InputError(fmt::format("{}: meta_info.{} is not an array", where, field));
  for (size_t i = 0; i < it->size(); ++i)
    if (!(*it)[i].is_array() || (*it)[i].size() < 2)
      throw InputError(fmt::format("{}: meta_info.{}[{}] is not [logprob, token_id, ...]", where, field, i));
  return &*it;
}

// Decodes meta_info.<field> (a base64 string) into int32 words and releases the string.
R3Buffer decode_buffer(json& meta, const char* field, const R3Origin& o) {
  R3Buffer b;
  auto it = meta.find(field);
  if (it == meta.end() || it->is_null()) return b;
  if (!it->is_string())
    throw InputError(fmt::format("{}: meta_info.{} is not a base64 string", o.describe(), field));
  std::string text = std::move(it->get_ref<std::string&>());
  std::string error;
  const size_t bytes = base64_decoded_size(text, error);
  if (error.empty()) {
    // Decoded straight into the int32 words (one allocation); the spare words take a partial last
    // word and EVP's padding bytes until the length is checked.
    b.words.resize(bytes / 4 + 2);
    base64_decode_into(text, reinterpret_cast<uint8_t*>(b.words.data()), error);
  }
  if (!error.empty()) throw InputError(fmt::format("{}: meta_info.{}: {}", o.describe(), field, error));
  r3_check_bytes(bytes, o, field);
  b.words.resize(bytes / 4);
  b.present = true;
  return b;
}

}  // namespace

R3Request sglang_request(json& response, R3Origin origin, std::vector<std::string>& notes) {
  if (!response.is_object()) throw InputError(fmt::format("{}: not a JSON object", origin.describe()));
  auto mi = response.find("meta_info");
  if (mi == response.end() || !mi->is_object())
    throw InputError(
        fmt::format("{}: no meta_info object (not an SGLang /generate response)", origin.describe()));
  json& meta = *mi;
  if (auto id = meta.find("id"); id != meta.end()) {
    if (id->is_string())
      origin.id = id->get<std::string>();
    else if (id->is_number_integer())
      origin.id = std::to_string(id->get<int64_t>());
  }
  const std::string who = origin.describe();

  R3Request q;
  auto in = response.find("input_ids");
  if (in == response.end())
    throw InputError(
        fmt::format("{}: no input_ids: SGLang does not echo the prompt's token ids, so the dump must "
                    "hold the ids the request sent as \"input_ids\"",
                    who));
  std::vector<int32_t> prompt = token_list(*in, who + ": input_ids");
  const json* out_lp = logprob_entries(meta, "output_token_logprobs", who);
  std::vector<int32_t> output;
  if (auto o = response.find("output_ids"); o != response.end()) {
    output = token_list(*o, who + ": output_ids");
    if (out_lp && out_lp->size() != output.size())
      throw InputError(fmt::format("{}: output_ids holds {} tokens, meta_info.output_token_logprobs {}", who,
                                   output.size(), out_lp->size()));
  } else if (out_lp) {
    for (size_t i = 0; i < out_lp->size(); ++i) {
      const json& e = (*out_lp)[i][1];
      if (!e.is_number_integer() || e.get<int64_t>() < 0 ||
          e.get<int64_t>() > std::numeric_limits<int32_t>::max())
        throw InputError(fmt::format("{}: meta_info.output_token_logprobs[{}][1]: {} is not a token id", who,
                                     i, e.dump()));
      output.push_back(int32_t(e.get<int64_t>()));
    }
  } else {
    throw InputError(
        fmt::format("{}: no output_ids and no meta_info.output_token_logprobs: the generated tokens are "
                    "unknown",
                    who));
  }
  auto count_check = [&](const char* field, size_t have, const char* list) {
    auto it = meta.find(field);
    if (it != meta.end() && it->is_number_integer() && it->get<int64_t>() != int64_t(have))
      throw InputError(fmt::format("{}: meta_info.{} is {} but {} holds {} tokens", who, field,
                                   it->get<int64_t>(), list, have));
  };
  count_check("prompt_tokens", prompt.size(), "input_ids");
  count_check("completion_tokens", output.size(), "the output");

  q.prompt_length = int64_t(prompt.size());
  q.tokens = std::move(prompt);
  q.tokens.insert(q.tokens.end(), output.begin(), output.end());

  // Log-probs: ExternalSequence holds one per position or none, so a response's are kept only when the
  // prompt's are there too (input_token_logprobs, whose first entry has no value).
  if (out_lp && !out_lp->empty()) {
    const json* in_lp = logprob_entries(meta, "input_token_logprobs", who);
    const size_t P = size_t(q.prompt_length), T = q.tokens.size();
    bool complete = in_lp && in_lp->size() == P && P >= 1;
    std::vector<float> lp;
    if (complete) {
      lp.reserve(T - 1);
      for (size_t p = 1; p < T && complete; ++p) {
        const json& e = p < P ? (*in_lp)[p][0] : (*out_lp)[p - P][0];
        if (!e.is_number())
          complete = false;
        else
          lp.push_back(e.get<float>());
      }
    }
    if (complete)
      q.logprobs = std::move(lp);
    else
      notes.push_back(
          fmt::format("{}: log-probs of the response only (no input_token_logprobs for the prompt); not "
                      "stored, since a trace holds log-probs for every position or none",
                      who));
  }

  q.routed_experts = decode_buffer(meta, "routed_experts", origin);
  q.indexer_topk = decode_buffer(meta, "indexer_topk", origin);
  if (q.indexer_topk.present) {
    auto n = meta.find("indexer_topk_num_layers");
    if (n == meta.end() || !n->is_number_integer())
      throw InputError(
          fmt::format("{}: meta_info.indexer_topk without an integer indexer_topk_num_layers", who));
    q.indexer_num_layers = int(n->get<int64_t>());
  }
  if (!q.routed_experts.present && !q.indexer_topk.present)
    throw InputError(
        fmt::format("{}: meta_info has neither routed_experts nor indexer_topk (send the request with "
                    "return_routed_experts / return_indexer_topk)",
                    who));
  q.origin = std::move(origin);
  return q;
}

int64_t sglang_read(const std::string& path, const std::function<void(R3Request&&)>& on_request,
                    std::vector<std::string>& notes, const std::function<void(int64_t)>& on_progress) {
  std::ifstream f(path, std::ios::binary);
  if (!f) throw InputError(fmt::format("{}: cannot open", path));
  int first = f.peek();
  while (first != EOF && std::isspace(first)) {
    f.get();
    first = f.peek();
  }
  if (first == EOF) throw InputError(fmt::format("{}: empty file (no responses)", path));
  int64_t count = 0;
  auto handle = [&](json& response, const std::string& where) {
    on_request(sglang_request(response, R3Origin{where, "", count}, notes));
    ++count;
    if (on_progress) on_progress(int64_t(f.tellg()));
  };

  if (first == '[') {
    // An array: each element is handled once parsed and then dropped from the array, so memory holds
    // one response.
    auto cb = [&](int depth, json::parse_event_t event, json& parsed) {
      if (depth != 1) return true;
      if (event == json::parse_event_t::value && !parsed.is_object())
        throw InputError(fmt::format("{}: element #{} is not a response object", path, count));
      if (event != json::parse_event_t::object_end) return true;
      handle(parsed, path);
      return false;
    };
    try {
      // The elements went to `handle`; what is left is an empty array.
      const json rest = json::parse(f, cb);
    } catch (const json::exception& e) {
      throw InputError(fmt::format("{}: not JSON: {}", path, e.what()));
    }
    return count;
  }

  // A line that parses on its own starts a JSONL file; otherwise the file is one (pretty-printed) object.
  std::string line;
  std::getline(f, line);
  if (json::accept(line)) {
    int64_t lineno = 1;
    do {
      if (line.find_first_not_of(" \t\r") != std::string::npos) {
        json response;
        try {
          response = json::parse(line);
        } catch (const json::exception& e) {
          throw InputError(fmt::format("{}:{}: not JSON: {}", path, lineno, e.what()));
        }
        line = std::string();  // the text is not needed once parsed
        handle(response, fmt::format("{}:{}", path, lineno));
      }
      ++lineno;
    } while (std::getline(f, line));
    return count;
  }
  f.clear();
  f.seekg(0);
  std::string text((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  json response;
  try {
    response = json::parse(text);
  } catch (const json::exception& e) {
    throw InputError(fmt::format("{}: not JSON: {}", path, e.what()));
  }
  text = std::string();
  handle(response, path);
  return count;
}

json sglang_response(const std::string& id, const std::vector<int32_t>& tokens, int64_t prompt_length,
                     const R3EngineBuffers& b) {
  const size_t P = prompt_length < 0 ? tokens.size() : std::min(tokens.size(), size_t(prompt_length));
  json r;
  r["input_ids"] = std::vector<int32_t>(tokens.begin(), tokens.begin() + int64_t(P));
  r["output_ids"] = std::vector<int32_t>(tokens.begin() + int64_t(P), tokens.end());
  json meta;
  meta["id"] = id;
  meta["prompt_tokens"] = P;
  meta["completion_tokens"] = tokens.size() - P;
  auto bytes = [](const std::vector<int32_t>& w) {
    return std::span<const uint8_t>(reinterpret_cast<const uint8_t*>(w.data()), w.size() * 4);
  };
  if (b.num_layers > 0) meta["routed_experts"] = base64_encode(bytes(b.routed_experts));
  if (b.indexer_num_layers > 0) {
    meta["indexer_topk"] = base64_encode(bytes(b.indexer_topk));
    meta["indexer_topk_num_layers"] = b.indexer_num_layers;
  }
  r["meta_info"] = std::move(meta);
  return r;
}

}  // namespace dsv4
