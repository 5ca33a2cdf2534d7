// The prompts file of `dsv4 generate`: JSONL, one request per line (docs/SAMPLING.md).
//
//   {"id": "q1", "prompt": [1, 2, 3], "max_new_tokens": 32, "temperature": 0.7, "top_p": 0.9,
//    "top_k": 50, "seed": 7, "stop": [2]}
//
// Fields:
//   prompt          required; a non-empty array of token ids in [0, vocab_size)
//   id              string or integer (integers become their decimal text); default: the 0-based
//                   index of the request in the file (blank lines do not count), as text. Ids must
//                   be unique within the file.
//   max_new_tokens  integer >= 1 (a request that may generate nothing is a mistake, not a no-op);
//                   prompt length + max_new_tokens must not exceed config.max_position_embeddings
//   temperature, top_p, top_k, seed
//                   the SamplingParams of rollout/sampler.h, checked by check_sampling; seed is an
//                   integer in [0, 2^64)
//   stop            array of token ids (may be empty); replaces the default stop ids
// Omitted fields take the GenerateDefaults. Blank lines are skipped. Unknown fields are errors (a
// misspelt "temprature" must not silently sample at the default).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "model/config.h"
#include "rollout/sampler.h"

namespace dsv4::rollout {

struct PromptRequest {
  std::string id;
  std::vector<int32_t> prompt;
  int max_new_tokens = 0;
  std::vector<int32_t> stop_ids;
  SamplingParams sampling;
  int line = 0;  // 1-based line of the file, for messages
};

struct GenerateDefaults {
  int max_new_tokens = 64;
  SamplingParams sampling;
  std::vector<int32_t> stop_ids;
};

// Reads and checks every line; returns the requests in file order. Throws InputError naming the file,
// the line and the field for: a file that cannot be read or holds no request, a line that is not JSON
// or not an object, a missing, empty or ill-typed prompt, a token id that is not an integer or is
// outside the vocabulary (naming its index), an ill-typed or out-of-range field, an unknown field, a
// duplicate id, a prompt too long for max_new_tokens (naming both numbers and the limit), and bad
// sampling parameters (check_sampling). Bad defaults throw too, naming "generate defaults".
std::vector<PromptRequest> read_prompts(const std::string& path, const ModelConfig& config,
                                        const GenerateDefaults& d);

}  // namespace dsv4::rollout
