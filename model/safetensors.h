// safetensors reader (memory-mapped) and writer. Format: 8-byte little-endian header length N, a JSON
// header of N bytes {"name": {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}},
// then the raw little-endian data; offsets are relative to the end of the header.
// Sharded checkpoints: model.safetensors.index.json {"weight_map": {"name": "file"}}.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

namespace dsv4 {

enum class StDType { BF16, F16, F32, I32, I64, F8_E4M3 };
const char* to_string(StDType t);
int dtype_size(StDType t);

struct StTensorInfo {
  std::string name;
  StDType dtype;
  std::vector<int64_t> shape;
  std::string file;               // the file holding it
  const uint8_t* data = nullptr;  // into the mapping
  int64_t nbytes = 0;
  int64_t numel() const;
};

// A read-only view of one checkpoint: a single .safetensors file, or a directory holding
// model.safetensors or model.safetensors.index.json + shards. Files are memory-mapped.
// Every structural problem (truncated file, header length beyond the file, bad JSON, unknown dtype,
// offsets out of range or overlapping, shape/size mismatch, missing shard) throws WeightsError naming
// the file (and tensor).
class SafetensorsReader {
 public:
  static SafetensorsReader open(const std::string& path);  // file or directory
  SafetensorsReader(SafetensorsReader&&) noexcept;
  SafetensorsReader& operator=(SafetensorsReader&&) noexcept;
  ~SafetensorsReader();

  bool contains(const std::string& name) const;
  const StTensorInfo& info(const std::string& name) const;  // throws WeightsError if absent
  std::vector<std::string> names() const;                   // sorted
  // Converted copy as fp32 (BF16, F16, F32, F8_E4M3 exact widening). Throws for integer dtypes.
  std::vector<float> read_f32(const std::string& name) const;
  // Converted copy as int32 (I32, or I64 with a range check).
  std::vector<int32_t> read_i32(const std::string& name) const;
  std::map<std::string, std::string> metadata() const;

 private:
  SafetensorsReader();
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// Writer: collects tensors, then writes one file (header sorted by name, 8-byte aligned data).
class SafetensorsWriter {
 public:
  void add(const std::string& name, StDType dtype, std::vector<int64_t> shape, std::vector<uint8_t> bytes);
  void add_bf16(const std::string& name, std::vector<int64_t> shape,
                const std::vector<float>& values);  // rounds RNE
  void add_f32(const std::string& name, std::vector<int64_t> shape, const std::vector<float>& values);
  void add_i32(const std::string& name, std::vector<int64_t> shape, const std::vector<int32_t>& values);
  void set_metadata(const std::string& key, const std::string& value);
  void write(const std::string& path) const;  // throws Error with the path on I/O failure
  // Sharded: writes dir/model-0000i-of-0000n.safetensors with at most max_shard_bytes each, plus
  // dir/model.safetensors.index.json.
  void write_sharded(const std::string& dir, int64_t max_shard_bytes) const;

 private:
  struct Entry {
    std::string name;
    StDType dtype;
    std::vector<int64_t> shape;
    std::vector<uint8_t> bytes;
  };
  std::vector<Entry> entries_;
  std::map<std::string, std::string> meta_;
};

}  // namespace dsv4
