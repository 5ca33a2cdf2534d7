// The dump directory read by bench/torch_layer.py and bench/torch_train_layer.py: raw little-endian
// float32 / int32 files, one per tensor, and manifest.json {"attrs": {...}, "tensors": [{"name",
// "file", "dtype", "shape"}]}. Written by bench_gpu --dump and bench_train_layer.
#pragma once

#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

namespace dsv4::bench {

struct Dumper {
  std::string dir;
  std::vector<std::string> tensors, attrs;
  explicit Dumper(std::string d) : dir(std::move(d)) { std::filesystem::create_directories(dir); }
  void attr(const std::string& name, double v) {
    char buf[128];
    std::snprintf(buf, sizeof buf, "\"%s\": %.9g", name.c_str(), v);
    attrs.emplace_back(buf);
  }
  template <typename T>
  void put(const std::string& name, const std::vector<T>& h, const std::vector<int64_t>& shape) {
    static_assert(sizeof(T) == 4, "float32 or int32 only");
    int64_t n = 1;
    for (int64_t e : shape) n *= e;
    if (n != int64_t(h.size()))
      throw std::runtime_error("dump " + name + ": " + std::to_string(h.size()) + " values for shape of " +
                               std::to_string(n));
    const std::string file = name + ".bin";
    FILE* f = std::fopen((dir + "/" + file).c_str(), "wb");
    if (!f) throw std::runtime_error("cannot write " + dir + "/" + file);
    const size_t wrote = n > 0 ? std::fwrite(h.data(), sizeof(T), size_t(n), f) : 0;
    std::fclose(f);
    if (wrote != size_t(n)) throw std::runtime_error("short write to " + dir + "/" + file);
    std::string sh;
    for (int64_t e : shape) sh += (sh.empty() ? "" : ", ") + std::to_string(e);
    tensors.push_back("{\"name\": \"" + name + "\", \"file\": \"" + file + "\", \"dtype\": \"" +
                      (std::is_same_v<T, float> ? "float32" : "int32") + "\", \"shape\": [" + sh + "]}");
  }
  void finish() {
    FILE* f = std::fopen((dir + "/manifest.json").c_str(), "w");
    if (!f) throw std::runtime_error("cannot write " + dir + "/manifest.json");
    std::fprintf(f, "{\n  \"attrs\": {");
    for (size_t i = 0; i < attrs.size(); ++i) std::fprintf(f, "%s%s", i ? ", " : "", attrs[i].c_str());
    std::fprintf(f, "},\n  \"tensors\": [\n");
    for (size_t i = 0; i < tensors.size(); ++i)
      std::fprintf(f, "    %s%s\n", tensors[i].c_str(), i + 1 < tensors.size() ? "," : "");
    std::fprintf(f, "  ]\n}\n");
    std::fclose(f);
  }
};

}  // namespace dsv4::bench
