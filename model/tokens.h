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

namespace dsv4 {
// A batch file: one sequence per line, either a JSON array of ids or {"tokens": [...]}; blank lines
// are skipped. Errors name the file and line.
std::vector<std::vector<int32_t>> parse_batch_jsonl(const std::string& path);
}  // namespace dsv4
