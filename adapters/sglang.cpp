#include "adapters/sglang.h"

#include <fmt/core.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <limits>
#include <optional>
#include <string_view>

#include "adapters/base64.h"
#include "model/error.h"
#include "model/huge_pages.h"
#include "model/mapped_file.h"

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

// A base64 field: cut out of the JSON text ahead of the parse (see lift()) and left where it stands, to
// be decoded a row at a time by r3_import; or, on the whole-parse path, decoded from the parsed string.
struct Decoded {
  bool present = false;
  size_t bytes = 0;
  std::string error;
  std::string_view text;       // lifted: the base64 text, inside the response's text
  std::vector<int32_t> words;  // decoded: bytes / 4 + 2 words
};

// Decodes `text` as decode_buffer does: straight into the int32 words (one allocation); the spare words
// take a partial last word and the padding bytes until the length is checked.
void decode_text(std::string_view text, Decoded& d) {
  d.present = true;
  d.bytes = base64_decoded_size(text, d.error);
  if (!d.error.empty()) return;
  reserve_huge(d.words, d.bytes / 4 + 2);
  d.words.resize(d.bytes / 4 + 2);
  base64_decode_into(text, reinterpret_cast<uint8_t*>(d.words.data()), d.error);
}

// meta_info.<field> (a base64 string) as an R3Buffer. `pre`, when present, is the field lifted out of
// the text (the JSON then holds an empty string in its place); with `keep_text` the buffer keeps that
// text, undecoded (the indexer's, 1.4 GB decoded at 32k Flash tokens, is read a row at a time).
// Otherwise the string is decoded into int32 words (and released).
R3Buffer decode_buffer(json& meta, const char* field, const R3Origin& o, Decoded* pre, bool keep_text) {
  R3Buffer b;
  auto it = meta.find(field);
  if (it == meta.end() || it->is_null()) return b;
  if (!it->is_string())
    throw InputError(fmt::format("{}: meta_info.{} is not a base64 string", o.describe(), field));
  Decoded d;
  // A lifted text with JSON escapes ("\/") is decoded from what they stand for, when its length
  // says so here or the decoder refuses a backslash (r3_import, for a kept text).
  const std::optional<std::string> unescaped =
      pre && pre->present && (!keep_text || !pre->error.empty() || pre->bytes % 4 != 0)
          ? r3_json_unescape(pre->text)
          : std::nullopt;
  if (unescaped) {
    decode_text(*unescaped, d);
  } else if (pre && pre->present && keep_text) {
    d = std::move(*pre);
  } else if (pre && pre->present) {
    decode_text(pre->text, d);
  } else {
    std::string text = std::move(it->get_ref<std::string&>());
    decode_text(text, d);
  }
  if (!d.error.empty()) throw InputError(fmt::format("{}: meta_info.{}: {}", o.describe(), field, d.error));
  r3_check_bytes(d.bytes, o, field);
  if (!d.text.empty()) {
    b.base64 = d.text;
    b.base64_words = d.bytes / 4;
  } else {
    b.words = std::move(d.words);
    b.words.resize(d.bytes / 4);
  }
  b.present = true;
  return b;
}

// The two large fields, decoded ahead of the parse.
struct Lifted {
  Decoded routed, indexer;
};

R3Request request_from(json& response, R3Origin origin, std::vector<std::string>& notes, Lifted* lifted);

}  // namespace

R3Request sglang_request(json& response, R3Origin origin, std::vector<std::string>& notes) {
  return request_from(response, std::move(origin), notes, nullptr);
}

namespace {

// routed_experts_start_len: a request field (the dump stores it with the response, as it stores
// input_ids), or meta_info's when the dump put it there; both must agree. SGLang accepts [0, prompt_tokens].
int64_t routed_experts_start(const json& response, const json& meta, int64_t prompt_length,
                             const std::string& who) {
  const char* kField = "routed_experts_start_len";
  std::optional<int64_t> start;
  for (const json* where : {&response, &meta}) {
    auto it = where->find(kField);
    if (it == where->end() || it->is_null()) continue;
    const std::string name = where == &meta ? std::string("meta_info.") + kField : std::string(kField);
    if (!it->is_number_integer())
      throw InputError(fmt::format("{}: {} is {}, not an integer", who, name, it->dump()));
    const int64_t v = it->get<int64_t>();
    if (v < 0 || v > prompt_length)
      throw InputError(fmt::format("{}: {} is {}; SGLang accepts [0, prompt_tokens] = [0, {}]", who, name, v,
                                   prompt_length));
    if (start && *start != v)
      throw InputError(fmt::format("{}: routed_experts_start_len is {} but meta_info.routed_experts_start_len {}",
                                   who, *start, v));
    start = v;
  }
  return start.value_or(0);
}

R3Request request_from(json& response, R3Origin origin, std::vector<std::string>& notes, Lifted* lifted) {
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

  q.routed_experts = decode_buffer(meta, "routed_experts", origin, lifted ? &lifted->routed : nullptr, false);
  q.routed_experts_start = routed_experts_start(response, meta, q.prompt_length, who);
  q.indexer_topk = decode_buffer(meta, "indexer_topk", origin, lifted ? &lifted->indexer : nullptr, true);
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

// ---- Lifting the base64 fields out of the text ----
//
// nlohmann parses about 25 MB/s, and a Flash response of 32k tokens is 1.9 GB of base64 in two strings.
// lift() walks the text's structure (top-level object → meta_info → its members) just far enough to find
// meta_info.routed_experts and meta_info.indexer_topk, decodes their text where it stands, and leaves
// the rest (ids, counts, log-probs: small) to nlohmann with those strings emptied. It validates nothing
// itself: anything it does not expect (an escape in a key, a repeated key, a string with an escape or
// a control character, text that is not an object...) makes it give up, and the text is then parsed
// whole as before; so is text whose emptied form does not parse, so that every error reads as before.

size_t skip_ws(std::string_view s, size_t i) {
  while (i < s.size() && (s[i] == ' ' || s[i] == '\t' || s[i] == '\n' || s[i] == '\r')) ++i;
  return i;
}

// The index of the first `ch` in s[from, s.size()), or npos: two threads over a long text (a base64
// field of 1.9 GB is read at a few GB/s by one core), each scanning its blocks in order.
size_t find_first(std::string_view s, size_t from, char ch) {
  constexpr size_t kBlock = size_t(32) << 20;
  constexpr size_t npos = std::string_view::npos;
  if (from >= s.size()) return npos;
  const size_t n = s.size() - from;
  if (n < 2 * kBlock) {
    const void* q = std::memchr(s.data() + from, ch, n);
    return q ? size_t(static_cast<const char*>(q) - s.data()) : npos;
  }
  const int64_t blocks = int64_t((n + kBlock - 1) / kBlock);
  std::atomic<int64_t> first_block{blocks};  // the lowest block with a hit
  std::vector<size_t> hit(size_t(blocks), npos);
#pragma omp parallel for schedule(static, 1)
  for (int64_t b = 0; b < blocks; ++b) {
    if (b > first_block.load(std::memory_order_relaxed)) continue;
    const size_t at = from + size_t(b) * kBlock, len = std::min(kBlock, s.size() - at);
    if (const void* q = std::memchr(s.data() + at, ch, len)) {
      hit[size_t(b)] = size_t(static_cast<const char*>(q) - s.data());
      int64_t cur = first_block.load();
      while (b < cur && !first_block.compare_exchange_weak(cur, b)) {
      }
    }
  }
  const int64_t b = first_block.load();
  return b < blocks ? hit[size_t(b)] : npos;
}

// s[i] == '"': the index past the closing quote (npos if none); `escaped` says whether a backslash
// occurred.
size_t skip_string(std::string_view s, size_t i, bool& escaped) {
  escaped = false;
  ++i;
  for (;;) {
    const void* q = std::memchr(s.data() + i, '"', s.size() - i);
    if (!q) return std::string_view::npos;
    const size_t e = size_t(static_cast<const char*>(q) - s.data());
    if (!escaped && std::memchr(s.data() + i, '\\', e - i)) escaped = true;
    size_t bs = 0;
    while (e - bs > i && s[e - 1 - bs] == '\\') ++bs;
    if (bs % 2 == 0) return e + 1;
    i = e + 1;
  }
}

// The same without looking for escapes (a value skipped whole, which may be a base64 buffer of
// gigabytes: one pass over it, on two threads).
size_t skip_string(std::string_view s, size_t i) {
  ++i;
  for (;;) {
    const size_t e = find_first(s, i, '"');
    if (e == std::string_view::npos) return e;
    size_t bs = 0;
    while (e - bs > i && s[e - 1 - bs] == '\\') ++bs;
    if (bs % 2 == 0) return e + 1;
    i = e + 1;
  }
}

// s[i] == '"' opening a base64 field: the index past its closing quote (npos if none, or when the
// quote found is escaped: the caller then gives up). Escapes elsewhere in the string are not looked
// for: the alphabet has none, so the decoder refuses a backslash, and r3_json_unescape() takes over.
size_t skip_base64_string(std::string_view s, size_t i) {
  const size_t e = find_first(s, i + 1, '"');
  if (e == std::string_view::npos || s[e - 1] == '\\') return std::string_view::npos;
  return e + 1;
}

// Any JSON value at s[i]: the index past it (npos when the text ends first). Literals and numbers end
// at the first structural character or blank.
size_t skip_value(std::string_view s, size_t i) {
  if (i >= s.size()) return std::string_view::npos;
  if (s[i] == '"') return skip_string(s, i);
  if (s[i] == '{' || s[i] == '[') {
    int64_t depth = 0;
    while (i < s.size()) {
      const char ch = s[i];
      if (ch == '"') {
        i = skip_string(s, i);
        if (i == std::string_view::npos) return i;
        continue;
      }
      if (ch == '{' || ch == '[') ++depth;
      if (ch == '}' || ch == ']') {
        if (--depth == 0) return i + 1;
      }
      ++i;
    }
    return std::string_view::npos;
  }
  const size_t from = i;
  while (i < s.size() && !std::strchr(",:{}[]\" \t\r\n", s[i])) ++i;
  return i == from ? std::string_view::npos : i;
}

// Walks the members of the object at s[i] == '{', calling on_member(key, value_index) for each; it
// returns the index past the value it consumed (npos to give up). Returns the index past the object.
template <class F>
size_t members(std::string_view s, size_t i, F&& on_member) {
  constexpr size_t npos = std::string_view::npos;
  i = skip_ws(s, i + 1);
  if (i < s.size() && s[i] == '}') return i + 1;
  for (;;) {
    if (i >= s.size() || s[i] != '"') return npos;
    bool escaped;
    const size_t k = skip_string(s, i, escaped);
    if (k == npos || escaped) return npos;
    const std::string_view key = s.substr(i + 1, k - i - 2);
    i = skip_ws(s, k);
    if (i >= s.size() || s[i] != ':') return npos;
    i = on_member(key, skip_ws(s, i + 1));
    if (i == npos) return npos;
    i = skip_ws(s, i);
    if (i >= s.size()) return npos;
    if (s[i] == '}') return i + 1;
    if (s[i] != ',') return npos;
    i = skip_ws(s, i + 1);
  }
}

// The field's text, kept where it stands (r3_import decodes it a row at a time; a character outside the
// alphabet is reported then, naming the field).
void lift_field(std::string_view text, Decoded& d) {
  d.present = true;
  d.bytes = base64_decoded_size(text, d.error);
  d.text = text;
}

// The text with the two fields' strings emptied (into `rest`) and lifted (into `out`, as views of `s`);
// false to give up (parse the text whole). With `object_end`, the object may be followed by more text
// (the rest of a JSONL file): `rest` stops at the object's end and *object_end receives the index past
// it, and *multi_line whether a line break stands between its tokens (the lifted strings cannot hold
// one: JSON strings hold no raw control characters).
bool lift(std::string_view s, std::string& rest, Lifted& out, size_t* object_end = nullptr,
          bool* multi_line = nullptr) {
  constexpr size_t npos = std::string_view::npos;
  struct Cut {
    size_t from, to;  // the string's characters, quotes excluded
    Decoded* into;
  };
  std::vector<Cut> cuts;
  int meta_seen = 0;
  size_t i = skip_ws(s, 0);
  if (i >= s.size() || s[i] != '{') return false;
  i = members(s, i, [&](std::string_view key, size_t v) -> size_t {
    if (key != "meta_info") return skip_value(s, v);
    if (++meta_seen > 1) return npos;
    if (v >= s.size() || s[v] != '{') return skip_value(s, v);
    return members(s, v, [&](std::string_view mkey, size_t w) -> size_t {
      Decoded* into = mkey == "routed_experts" ? &out.routed
                      : mkey == "indexer_topk" ? &out.indexer
                                               : nullptr;
      if (!into || w >= s.size() || s[w] != '"') return skip_value(s, w);
      for (const Cut& c : cuts)
        if (c.into == into) return npos;  // a repeated key: nlohmann keeps the last; parse it whole
      const size_t e = skip_base64_string(s, w);
      if (e == npos) return npos;
      cuts.push_back(Cut{w + 1, e - 1, into});
      return e;
    });
  });
  if (i == npos || cuts.empty()) return false;
  const size_t end = object_end ? i : s.size();
  for (const Cut& c : cuts) lift_field(s.substr(c.from, c.to - c.from), *c.into);
  rest.clear();
  size_t at = 0;
  for (const Cut& c : cuts) {
    rest.append(s.substr(at, c.from - at));
    at = c.to;
  }
  rest.append(s.substr(at, end - at));
  if (object_end) {
    *object_end = end;
    if (multi_line) *multi_line = rest.find('\n') != std::string::npos;
  }
  return true;
}

// Parses one response's text: with its base64 fields lifted out where possible, else whole. Throws
// json::exception for text that is not JSON (the same exception as a whole parse).
json parse_response(std::string_view text, Lifted& lifted, SglangTimes* times) {
  using Clock = std::chrono::steady_clock;
  auto t0 = Clock::now();
  std::string rest;
  const bool ok = lift(text, rest, lifted);
  auto t1 = Clock::now();
  json j;
  bool parsed = false;
  if (ok) {
    try {
      j = json::parse(rest);
      parsed = true;
    } catch (const json::exception&) {
    }
  }
  if (!parsed) {
    lifted = Lifted{};
    j = json::parse(text);
  }
  if (times) {
    times->decode_s += std::chrono::duration<double>(t1 - t0).count();
    times->parse_s += std::chrono::duration<double>(Clock::now() - t1).count();
  }
  return j;
}

}  // namespace

// The JSONL line that starts at text[0] (text: the rest of the file) when it is one object, its base64
// fields lifted, and nothing but blanks after it: the response, with *line_end the index of the '\n'
// that ends the line (or text.size()). nullopt otherwise (the caller then parses the line whole, which
// names the error). Finding the line's end from the object's, rather than by searching the text for
// it, saves a pass over the base64 text.
std::optional<json> parse_jsonl_object(std::string_view text, Lifted& lifted, size_t& line_end) {
  std::string rest;
  size_t end = 0;
  bool multi_line = false;
  if (!lift(text, rest, lifted, &end, &multi_line) || multi_line) return std::nullopt;
  while (end < text.size() && (text[end] == ' ' || text[end] == '\t' || text[end] == '\r')) ++end;
  if (end < text.size() && text[end] != '\n') return std::nullopt;
  try {
    json j = json::parse(rest);
    line_end = end;
    return j;
  } catch (const json::exception&) {
    return std::nullopt;
  }
}

R3Request sglang_parse(std::string_view text, R3Origin origin, std::vector<std::string>& notes,
                       SglangTimes* times) {
  Lifted lifted;
  json response;
  try {
    response = parse_response(text, lifted, times);
  } catch (const json::exception& e) {
    throw InputError(fmt::format("{}: not JSON: {}", origin.describe(), e.what()));
  }
  return request_from(response, std::move(origin), notes, &lifted);
}

int64_t sglang_read(const std::string& path, const std::function<void(R3Request&&)>& on_request,
                    std::vector<std::string>& notes, const std::function<void(int64_t)>& on_progress) {
  // Mapped, not read: the responses' text (1.9 GB for a Flash response of 32k tokens) stays in the page
  // cache, and the requests' base64 buffers are decoded from it where they stand.
  const std::unique_ptr<MappedFile> file = MappedFile::open(path, true);
  const std::string_view all = file->text();
  constexpr size_t npos = std::string_view::npos;
  const size_t first = skip_ws(all, 0);
  if (first >= all.size()) throw InputError(fmt::format("{}: empty file (no responses)", path));
  int64_t count = 0;
  auto handle = [&](json& response, const std::string& where, Lifted* lifted, int64_t progress) {
    on_request(request_from(response, R3Origin{where, "", count}, notes, lifted));
    ++count;
    if (on_progress) on_progress(progress);
  };

  if (all[first] == '[') {
    // The elements are taken one at a time (each parsed as its own text, its base64 fields lifted).
    // Anything unusual in the array's own syntax, or an element that does not parse, sends the file
    // through nlohmann's element-by-element parse (from the start, the elements already handled
    // skipped), so that errors read as they always have.
    const std::string_view s = all;
    size_t i = skip_ws(s, first + 1);
    bool fallback = false;
    if (i < s.size() && s[i] == ']') {
      i = skip_ws(s, i + 1);
      fallback = i != s.size();
    } else {
      for (;;) {
        const size_t e = skip_value(s, i);
        if (e == npos || s[i] != '{') {
          fallback = true;
          break;
        }
        Lifted lifted;
        json response;
        try {
          response = parse_response(s.substr(i, e - i), lifted, nullptr);
        } catch (const json::exception&) {
          fallback = true;
          break;
        }
        // The element's end decides what follows: the array's own syntax is checked before the element
        // is handled, as nlohmann's parse would reach it only after the element.
        size_t next = skip_ws(s, e);
        if (next >= s.size() || (s[next] != ',' && s[next] != ']')) {
          fallback = true;
          break;
        }
        const bool last = s[next] == ']';
        if (last && skip_ws(s, next + 1) != s.size()) {
          fallback = true;
          break;
        }
        handle(response, path, &lifted, int64_t(e));
        if (last) break;
        i = skip_ws(s, next + 1);
      }
    }
    if (!fallback) return count;
    // nlohmann's parse, element by element: each is handled once parsed and then dropped from the array.
    const int64_t done = count;
    int64_t element = 0;
    auto cb = [&](int depth, json::parse_event_t event, json& parsed) {
      if (depth != 1) return true;
      if (event == json::parse_event_t::value && !parsed.is_object())
        throw InputError(fmt::format("{}: element #{} is not a response object", path, element));
      if (event != json::parse_event_t::object_end) return true;
      if (element++ >= done) handle(parsed, path, nullptr, int64_t(all.size()));
      return false;
    };
    try {
      // The elements went to `handle`; what is left is an empty array.
      const json rest = json::parse(all.begin(), all.end(), cb);
    } catch (const json::exception& e) {
      throw InputError(fmt::format("{}: not JSON: {}", path, e.what()));
    }
    return count;
  }

  // A line that parses on its own starts a JSONL file; otherwise the file is one (pretty-printed) object.
  auto line_end = [&](size_t from) {
    const size_t e = all.find('\n', from);
    return e == npos ? all.size() : e;
  };
  // The response on the line at `at` (lifted), and the index of the line's end; a line that is not one
  // object on its own is parsed whole (json::exception names what is wrong with it).
  auto parse_line = [&](size_t at, Lifted& lifted, size_t& end) {
    lifted = Lifted{};
    if (auto j = parse_jsonl_object(all.substr(at), lifted, end)) {
      end += at;
      return std::move(*j);
    }
    end = line_end(at);
    lifted = Lifted{};
    return parse_response(all.substr(at, end - at), lifted, nullptr);
  };
  Lifted lifted;
  json response;
  size_t end = 0;
  bool jsonl = true;
  try {
    response = parse_line(first, lifted, end);
  } catch (const json::exception&) {
    jsonl = false;
  }
  if (jsonl) {
    int64_t lineno = 1;
    for (;;) {
      handle(response, fmt::format("{}:{}", path, lineno), &lifted, int64_t(std::min(end + 1, all.size())));
      response = json();
      // The next line that is not blank.
      size_t at = end;
      bool more = false;
      while (at < all.size()) {
        ++at;  // past the '\n'
        ++lineno;
        size_t p = at;
        while (p < all.size() && (all[p] == ' ' || all[p] == '\t' || all[p] == '\r')) ++p;
        if (p >= all.size()) break;  // blanks to the end
        if (all[p] != '\n') {
          more = true;
          break;
        }
        at = p;
      }
      if (!more) break;
      try {
        response = parse_line(at, lifted, end);
      } catch (const json::exception& e) {
        throw InputError(fmt::format("{}:{}: not JSON: {}", path, lineno, e.what()));
      }
    }
    return count;
  }
  lifted = Lifted{};
  try {
    response = parse_response(all, lifted, nullptr);
  } catch (const json::exception& e) {
    throw InputError(fmt::format("{}: not JSON: {}", path, e.what()));
  }
  handle(response, path, &lifted, int64_t(all.size()));
  return count;
}

json sglang_response(const std::string& id, const std::vector<int32_t>& tokens, int64_t prompt_length,
                     const R3EngineBuffers& b, int64_t routed_start) {
  const size_t P = prompt_length < 0 ? tokens.size() : std::min(tokens.size(), size_t(prompt_length));
  json r;
  r["input_ids"] = std::vector<int32_t>(tokens.begin(), tokens.begin() + int64_t(P));
  r["output_ids"] = std::vector<int32_t>(tokens.begin() + int64_t(P), tokens.end());
  if (routed_start > 0 && b.num_layers > 0) r["routed_experts_start_len"] = routed_start;
  json meta;
  meta["id"] = id;
  meta["prompt_tokens"] = P;
  meta["completion_tokens"] = tokens.size() - P;
  auto bytes = [](const std::vector<int32_t>& w) {
    return std::span<const uint8_t>(reinterpret_cast<const uint8_t*>(w.data()), w.size() * 4);
  };
  if (b.num_layers > 0) {
    const size_t skip = size_t(routed_start > 0 ? routed_start : 0) * size_t(b.num_layers * b.k);  // words
    meta["routed_experts"] = base64_encode(bytes(b.routed_experts).subspan(skip * 4));
  }
  if (b.indexer_num_layers > 0) {
    meta["indexer_topk"] = base64_encode(bytes(b.indexer_topk));
    meta["indexer_topk_num_layers"] = b.indexer_num_layers;
  }
  r["meta_info"] = std::move(meta);
  return r;
}

}  // namespace dsv4
