// miles' per-sample R3 arrays (MODEL.md §6.3: Sample.rollout_routed_experts / rollout_indexer_topk,
// int32 [T − 1, L, K]) with the sample's tokens, saved with numpy: one .npz per sample, or a directory
// of .npy files per sample. Members read (docs/ADAPTERS.md):
//
//   tokens                    [T] int32 (or int64)   prompt + response
//   rollout_routed_experts    [T − 1, num_layers, k] int32          (optional)
//   rollout_indexer_topk      [T − 1, n_C4_layers, width] int32     (optional; one of the two required)
//   response_length           () integer            (optional) → prompt length T − response_length
//   rollout_log_probs         [response_length] float32 (optional; response only: noted, not stored)
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "adapters/npy.h"
#include "adapters/r3.h"

namespace dsv4 {

// The samples named by `inputs`: an .npz file is a sample, a directory holding tokens.npy is a sample,
// any other directory contributes its .npz files and sample directories in name order. InputError for
// a path that is none of these.
std::vector<std::string> miles_sample_paths(const std::vector<std::string>& inputs);

// Reads one sample (its arrays as the R3 buffers with their shapes). `index` is its position in the
// import, for messages.
R3Request miles_sample(const std::string& path, int64_t index, std::vector<std::string>& notes);

// The rule both readers share: a sample's members (by name, those above that are there; the .npy
// files of an .npz or a directory, or the fields of a Sample dict from a .pt dump, python/dsv4) →
// R3Request. `what(member)` names a member in messages.
R3Request miles_request(std::map<std::string, NpyArray> arrays, R3Origin origin,
                        const std::function<std::string(const char*)>& what, std::vector<std::string>& notes);

// Writes one sample as an uncompressed .npz (numpy.load reads it): tokens (int32), response_length
// (int64, when prompt_length >= 0), rollout_routed_experts and rollout_indexer_topk (the buffers the
// trace holds). Refuses to overwrite.
void miles_write_npz(const std::string& path, const std::vector<int32_t>& tokens, int64_t prompt_length,
                     const R3EngineBuffers& b);

}  // namespace dsv4
