// Reading JSONL input files (one JSON object per line): the rules every such file of the CLI shares,
// and the field readers whose messages name "<path> line <n>: field '<name>'". Used by the prompts of
// `dsv4 generate` (rollout/prompts.h) and the training data of `dsv4 train-step` (train/samples.h).
//
// The shared rules: a file that cannot be opened or read throws; blank lines (only spaces, tabs and
// CRs) are skipped; a line that is not JSON, holds a number too large for fp64, or is not an object
// throws; a file without a single non-blank line throws. Every error is an InputError.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <nlohmann/json_fwd.hpp>
#include <string>
#include <vector>

namespace dsv4 {

// JSON's name for the type of v, for "expected X, found Y" messages ("an integer", "a string", ...).
std::string json_type_of(const nlohmann::json& v);

// Reads the fields of one line; every message is prefixed with "<path> line <n>: ".
class JsonLineReader {
 public:
  JsonLineReader(const std::string& path, int line);

  [[noreturn]] void fail(const std::string& msg) const;
  // "<path> line <n>"
  const std::string& where() const { return where_; }
  // 1-based
  int line() const { return line_; }

  // Fails with "unknown field '<key>' (<known_list>)" on a key of the object j that is not in `known`.
  void only_fields(const nlohmann::json& j, const std::vector<const char*>& known,
                   const std::string& known_list) const;

  enum class Empty { kAllowed, kRefused };
  // An array of token ids in [0, vocab_size); `field` names it in messages.
  std::vector<int32_t> token_ids(const nlohmann::json& v, const std::string& field, int64_t vocab_size,
                                 Empty empty) const;
  // An integer in [lo, hi].
  int64_t integer(const nlohmann::json& v, const std::string& field, int64_t lo, int64_t hi) const;
  // A finite number (fp64).
  double number(const nlohmann::json& v, const std::string& field) const;
  // Field 'id': a non-empty string, or an integer (as its decimal text).
  std::string id(const nlohmann::json& v) const;
  // Field 'id' of the object j if it has one, else `index` as text.
  std::string id_or_index(const nlohmann::json& j, size_t index) const;

 private:
  std::string where_;
  int line_;
};

// The ids of the lines read so far: claim() fails on an id that an earlier line already has.
class JsonLineIds {
 public:
  void claim(const std::string& id, const JsonLineReader& r);

 private:
  std::map<std::string, int> line_of_id_;
};

// Calls fn(object, reader) for each non-blank line of the JSONL file at path, in order, under the
// rules above. `file` names the file in messages ("cannot open the <file>"), `items` what its lines
// are ("no <items> (the file is empty ...)").
void for_each_json_line(const std::string& path, const std::string& file, const std::string& items,
                        const std::function<void(const nlohmann::json&, const JsonLineReader&)>& fn);

}  // namespace dsv4
