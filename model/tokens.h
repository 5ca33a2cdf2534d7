// Token-list input for the CLI and tools: "1,2,3" (commas and/or whitespace) or "@path" to read the
// same syntax from a file. Errors name the file (or the argument) and the offending item.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace dsv4 {

std::vector<int32_t> parse_tokens(const std::string& spec);
// n seeded pseudo-random token ids in [0, vocab) (deterministic on every machine).
std::vector<int32_t> random_tokens(int64_t n, int vocab, uint64_t seed);

}  // namespace dsv4
