// SGLang responses (the /generate JSON of a request sent with return_routed_experts and/or
// return_indexer_topk) → R3Request (adapters/r3.h), and back. Fields read (docs/ADAPTERS.md):
//
//   input_ids                               the prompt's token ids (the ids the client sent; SGLang
//                                           does not echo them, so a dump must add them)
//   output_ids                              the generated ids; else the ids of
//                                           meta_info.output_token_logprobs ([logprob, id, ...])
//   meta_info.id                            the request id (named in messages)
//   meta_info.prompt_tokens, .completion_tokens   checked against the token lists when present
//   meta_info.routed_experts                base64 of int32 [len(tokens) − 1, num_layers, k]
//   meta_info.indexer_topk                  base64 of int32 [len(tokens) − 1, n_C4_layers, width]
//   meta_info.indexer_topk_num_layers       n_C4_layers
//   meta_info.input_token_logprobs, .output_token_logprobs   log-probs (kept when they cover every position)
//   routed_experts_start_len                the request's start row of an incremental routed_experts
//                                           (or meta_info.routed_experts_start_len); 0 when absent
#pragma once

#include <nlohmann/json.hpp>

#include <cstdint>
#include <functional>
#include <string>
#include <string_view>
#include <vector>

#include "adapters/r3.h"

namespace dsv4 {

// One response object → R3Request (base64 decoded). Moves the large strings out of `response` as it
// decodes them, so the JSON text and the decoded buffers are not both held at full size. Throws
// InputError naming the origin and the field.
R3Request sglang_request(nlohmann::json& response, R3Origin origin, std::vector<std::string>& notes);

// Time spent in sglang_parse's phases (added to): decoding the base64 fields where they stand in the
// text, and parsing the rest of the JSON.
struct SglangTimes {
  double decode_s = 0, parse_s = 0;
};

// One response's JSON text → R3Request, as sglang_read reads each response: the base64 fields are
// decoded where they stand in the text and the rest is parsed (see sglang.cpp). Text that is not JSON
// throws InputError "<origin>: not JSON: ...".
R3Request sglang_parse(std::string_view text, R3Origin origin, std::vector<std::string>& notes,
                       SglangTimes* times = nullptr);

// Reads the responses of `path` one at a time and hands each to `on_request`: a JSON file holding one
// response object or an array of them, or JSONL (one object per line). Memory: one response, except
// for an array, whose document is held whole while its elements are taken one at a time. Returns the number
// of responses. `on_progress` (optional) is called after each with the bytes of the file read so far.
int64_t sglang_read(const std::string& path, const std::function<void(R3Request&&)>& on_request,
                    std::vector<std::string>& notes,
                    const std::function<void(int64_t bytes_read)>& on_progress = nullptr);

// The response object of one sequence in SGLang's layout (for `dsv4 export sglang`): input_ids (the
// first prompt_length tokens, or all of them when the prompt length is unknown), output_ids (the rest),
// meta_info {id, prompt_tokens, completion_tokens, routed_experts, indexer_topk,
// indexer_topk_num_layers}; the buffers a trace does not hold are left out. With `routed_start` > 0
// (an incremental export) routed_experts holds rows [routed_start, len(tokens) − 1) only and the object
// carries "routed_experts_start_len", as a dump stores the request's field.
nlohmann::json sglang_response(const std::string& id, const std::vector<int32_t>& tokens,
                               int64_t prompt_length, const R3EngineBuffers& b, int64_t routed_start = 0);

}  // namespace dsv4
