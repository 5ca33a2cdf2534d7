// The shared rules of the JSONL input files; see model/jsonl.h.
#include "model/jsonl.h"

#include <fmt/format.h>

#include <cmath>
#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>

#include "model/error.h"

namespace dsv4 {

using nlohmann::json;

std::string json_type_of(const json& v) {
  if (v.is_number_integer()) return "an integer";
  if (v.is_number_float()) return "a number with a fraction or exponent";
  if (v.is_boolean()) return "a boolean";
  if (v.is_array()) return "an array";
  if (v.is_object()) return "an object";
  return std::string("a ") + v.type_name();  // "a string", "a null"
}

JsonLineReader::JsonLineReader(const std::string& path, int line)
    : where_(fmt::format("{} line {}", path, line)), line_(line) {}

void JsonLineReader::fail(const std::string& msg) const {
  throw InputError(fmt::format("{}: {}", where_, msg));
}

void JsonLineReader::only_fields(const json& j, const std::vector<const char*>& known,
                                 const std::string& known_list) const {
  for (const auto& [key, value] : j.items()) {
    bool found = false;
    for (const char* f : known) found = found || key == f;
    if (!found) fail(fmt::format("unknown field '{}' ({})", key, known_list));
  }
}

std::vector<int32_t> JsonLineReader::token_ids(const json& v, const std::string& field, int64_t vocab_size,
                                               Empty empty) const {
  if (!v.is_array())
    fail(fmt::format("field '{}' must be an array of token ids, found {}", field, json_type_of(v)));
  if (empty == Empty::kRefused && v.empty())
    fail(fmt::format("field '{}' is empty (at least one token id is needed)", field));
  std::vector<int32_t> ids;
  ids.reserve(v.size());
  for (size_t i = 0; i < v.size(); ++i) {
    const json& x = v[i];
    if (!x.is_number_integer())
      fail(fmt::format("field '{}', index {}: a token id must be an integer, found {}", field, i,
                       json_type_of(x)));
    const bool negative = !x.is_number_unsigned() && x.get<int64_t>() < 0;
    if (negative || x.get<uint64_t>() >= uint64_t(vocab_size))
      fail(fmt::format("field '{}', index {}: token id {} is outside the vocabulary [0, {})", field, i,
                       x.dump(), vocab_size));
    ids.push_back(x.get<int32_t>());
  }
  return ids;
}

int64_t JsonLineReader::integer(const json& v, const std::string& field, int64_t lo, int64_t hi) const {
  if (!v.is_number_integer())
    fail(fmt::format("field '{}' must be an integer, found {}", field, json_type_of(v)));
  // nlohmann stores non-negative literals as unsigned; values above INT64_MAX are out of any range here.
  const bool fits =
      !v.is_number_unsigned() || v.get<uint64_t>() <= uint64_t(std::numeric_limits<int64_t>::max());
  const int64_t x = fits ? v.get<int64_t>() : 0;
  if (!fits || x < lo || x > hi)
    fail(fmt::format("field '{}' must be in [{}, {}], found {}", field, lo, hi, v.dump()));
  return x;
}

double JsonLineReader::number(const json& v, const std::string& field) const {
  if (!v.is_number()) fail(fmt::format("field '{}' must be a number, found {}", field, json_type_of(v)));
  const double x = v.get<double>();
  if (!std::isfinite(x)) fail(fmt::format("field '{}' must be finite, found {}", field, v.dump()));
  return x;
}

std::string JsonLineReader::id(const json& v) const {
  if (v.is_string()) {
    if (v.get<std::string>().empty()) fail("field 'id' must not be empty");
    return v.get<std::string>();
  }
  if (v.is_number_integer()) return v.dump();
  fail(fmt::format("field 'id' must be a string or an integer, found {}", json_type_of(v)));
}

std::string JsonLineReader::id_or_index(const json& j, size_t index) const {
  return j.contains("id") ? id(j.at("id")) : std::to_string(index);
}

void JsonLineIds::claim(const std::string& id, const JsonLineReader& r) {
  const auto [it, inserted] = line_of_id_.emplace(id, r.line());
  if (!inserted) r.fail(fmt::format("field 'id': '{}' is already the id of line {}", id, it->second));
}

void for_each_json_line(const std::string& path, const std::string& file, const std::string& items,
                        const std::function<void(const json&, const JsonLineReader&)>& fn) {
  std::ifstream f(path);
  if (!f) throw InputError(fmt::format("{}: cannot open the {}", path, file));
  std::string text;
  int lineno = 0;
  bool any = false;
  while (std::getline(f, text)) {
    ++lineno;
    if (text.find_first_not_of(" \t\r") == std::string::npos) continue;
    const JsonLineReader r(path, lineno);
    json j;
    try {
      j = json::parse(text);
    } catch (const json::parse_error& e) {
      r.fail(fmt::format("not valid JSON (error at byte {})", e.byte));
    } catch (const json::out_of_range&) {
      r.fail("not valid JSON (a number is too large for fp64)");
    }
    if (!j.is_object()) r.fail(fmt::format("expected a JSON object, found {}", json_type_of(j)));
    any = true;
    fn(j, r);
  }
  if (f.bad()) throw InputError(fmt::format("{}: read error after line {}", path, lineno));
  if (!any)
    throw InputError(fmt::format("{}: no {} (the file is empty or holds only blank lines)", path, items));
}

}  // namespace dsv4
