// Opening a model the way the CLI and tools name it: a checkpoint directory (config.json + weights)
// or a built-in preset with seeded weights.
#pragma once

#include <cstdint>
#include <string>

#include "model/weights.h"

namespace dsv4 {

// dir: a directory with config.json and model.safetensors (or an index + shards), or the path of a
// .safetensors file whose directory holds config.json.
// With `keep`, only the tensors it accepts are loaded (Weights::load).
Weights open_checkpoint(const std::string& path, const WeightFilter& keep = {});
Weights open_preset(const std::string& preset_name, uint64_t seed);
// The config.json beside a checkpoint (as open_checkpoint finds it).
ModelConfig checkpoint_config(const std::string& path);

}  // namespace dsv4
