// A read-only mapping of a whole file (safetensors weights, an import's JSON dumps), unmapped on
// destruction. Mapping rather than reading keeps a large file's bytes in the page cache only: no copy,
// and no fresh anonymous memory to fault in (which costs more than the read on virtual machines).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>

namespace dsv4 {

class MappedFile {
 public:
  // Throws InputError "PATH: cannot open|stat|map: <reason>". An empty file maps to size() 0.
  // `populate`: fault every page in now (one call instead of a fault per 4 KiB page; for files read
  // through once), and read ahead sequentially.
  static std::unique_ptr<MappedFile> open(const std::string& path, bool populate = false);
  ~MappedFile();
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;

  const std::string& path() const { return path_; }
  const uint8_t* data() const { return data_; }
  size_t size() const { return size_; }
  std::string_view text() const { return {reinterpret_cast<const char*>(data_), size_}; }

 private:
  MappedFile() = default;
  std::string path_;
  const uint8_t* data_ = nullptr;
  size_t size_ = 0;
};

}  // namespace dsv4
