#include "model/checkpoint.h"

#include <fmt/format.h>

#include <filesystem>

#include "model/error.h"

namespace dsv4 {

ModelConfig checkpoint_config(const std::string& path) {
  namespace fs = std::filesystem;
  std::error_code ec;
  if (!fs::exists(path, ec)) throw InputError(fmt::format("{}: no such file or directory", path));
  const fs::path dir = fs::is_directory(path, ec) ? fs::path(path) : fs::path(path).parent_path();
  const fs::path cfg = dir / "config.json";
  if (!fs::exists(cfg, ec))
    throw InputError(
        fmt::format("{}: no config.json beside the weights (looked for {})", path, cfg.string()));
  return config_from_file(cfg.string());
}

Weights open_checkpoint(const std::string& path, const WeightFilter& keep) {
  return Weights::load(checkpoint_config(path), path, keep);
}

Weights open_preset(const std::string& preset_name, uint64_t seed) {
  return Weights::init(preset(preset_name), seed);
}

}  // namespace dsv4
