// Opening a model the way the CLI and tools name it: a checkpoint directory (config.json + weights)
// or a built-in preset with seeded weights.
#pragma once

#include <cstdint>
#include <string>

#include "model/weights.h"

namespace dsv4 {

// dir: a directory with config.json and model.safetensors (or an index + shards), or the path of a
// .safetensors file whose directory holds config.json.
Weights open_checkpoint(const std::string& path);
Weights open_preset(const std::string& preset_name, uint64_t seed);

}  // namespace dsv4
