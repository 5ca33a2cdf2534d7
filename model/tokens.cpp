#include "model/tokens.h"

#include <fmt/format.h>

#include <cerrno>
#include <cstdlib>
#include <fstream>
#include <sstream>

#include "kernels/numerics/rng.h"
#include "model/error.h"

namespace dsv4 {

std::vector<int32_t> parse_tokens(const std::string& spec) {
  std::string text = spec, origin = "--tokens";
  if (!spec.empty() && spec[0] == '@') {
    origin = spec.substr(1);
    std::ifstream f(origin);
    if (!f) throw InputError(fmt::format("{}: cannot open token file", origin));
    std::stringstream ss;
    ss << f.rdbuf();
    text = ss.str();
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
