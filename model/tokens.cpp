#include "model/tokens.h"

#include <fmt/format.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <sstream>

#include "kernels/numerics/rng.h"
#include "model/error.h"

namespace dsv4 {

std::vector<int32_t> parse_tokens(const std::string& spec) {
  std::string text = spec, origin = "--tokens";
  if (!spec.empty() && spec[0] == '@') {
    origin = spec.substr(1);
    std::ifstream f(origin, std::ios::binary);
    if (!f) throw InputError(fmt::format("{}: cannot open token file", origin));
    // Read in pieces, at most kMaxBytes: a device such as /dev/zero never ends.
    constexpr size_t kMaxBytes = size_t(256) << 20;
    text.clear();
    char buf[1 << 16];
    while (f.read(buf, sizeof buf) || f.gcount() > 0) {
      const size_t n = size_t(f.gcount());
      if (const void* nul = std::memchr(buf, '\0', n))
        throw InputError(fmt::format("{}: not a text file (a NUL byte at offset {})", origin,
                                     text.size() + size_t(static_cast<const char*>(nul) - buf)));
      if (text.size() + n > kMaxBytes)
        throw InputError(fmt::format("{}: a token file of more than {} MiB", origin, kMaxBytes >> 20));
      text.append(buf, n);
    }
  }
  std::vector<int32_t> out;
  size_t i = 0;
  while (i < text.size()) {
    const char ch = text[i];
    if (ch == ',' || ch == ' ' || ch == '\n' || ch == '\t' || ch == '\r') {
      ++i;
      continue;
    }
    size_t j = i;
    while (j < text.size() && text[j] != ',' && text[j] != ' ' && text[j] != '\n' && text[j] != '\t' &&
           text[j] != '\r')
      ++j;
    const std::string item = text.substr(i, j - i);
    errno = 0;
    char* end = nullptr;
    const long long v = std::strtoll(item.c_str(), &end, 10);
    if (end != item.c_str() + item.size() || errno != 0 || v < 0 || v > INT32_MAX)
      throw InputError(fmt::format("{}: item {} ('{}') is not a token id (a non-negative integer)", origin,
                                   out.size(), item));
    out.push_back(int32_t(v));
    i = j;
  }
  if (out.empty()) throw InputError(fmt::format("{}: no token ids given", origin));
  return out;
}

std::vector<int32_t> random_tokens(int64_t n, int vocab, uint64_t seed) {
  num::Rng rng(seed, 0x70CE115ull);
  std::vector<int32_t> out(static_cast<size_t>(n));
  for (auto& t : out) t = int32_t(rng.below(uint32_t(vocab)));
  return out;
}

}  // namespace dsv4

#include <nlohmann/json.hpp>

namespace dsv4 {

std::vector<std::vector<int32_t>> parse_batch_jsonl(const std::string& path) {
  std::ifstream f(path);
  if (!f) throw InputError(fmt::format("{}: cannot open batch file", path));
  std::vector<std::vector<int32_t>> out;
  std::string line;
  int lineno = 0;
  while (std::getline(f, line)) {
    ++lineno;
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    try {
      const auto j = nlohmann::json::parse(line);
      // [ids], {"tokens": [ids]}, or a sample of `dsv4 generate` ({"prompt": [ids], "response": [ids]}:
      // the sequence is prompt + response, what a trainer recomputes).
      std::vector<const nlohmann::json*> parts;
      if (!j.is_object())
        parts = {&j};
      else if (j.contains("prompt") && j.contains("response"))
        parts = {&j.at("prompt"), &j.at("response")};
      else
        parts = {&j.at("tokens")};
      std::vector<int32_t> seq;
      for (const nlohmann::json* arr : parts) {
        if (!arr->is_array()) throw InputError("expected an array of token ids");
        for (const auto& v : *arr) {
          if (!v.is_number_integer() || v.get<int64_t>() < 0 || v.get<int64_t>() > INT32_MAX)
            throw InputError(fmt::format("item {} is not a token id", seq.size()));
          seq.push_back(v.get<int32_t>());
        }
      }
      if (seq.empty()) throw InputError("expected a non-empty array of token ids");
      out.push_back(std::move(seq));
    } catch (const std::exception& e) {
      throw InputError(fmt::format("{}:{}: {}", path, lineno, e.what()));
    }
  }
  if (out.empty()) throw InputError(fmt::format("{}: no sequences", path));
  return out;
}

}  // namespace dsv4
