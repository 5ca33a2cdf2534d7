// safetensors reading (read-only POSIX mappings, fully validated headers) and writing.
#include "model/safetensors.h"

#include <fmt/format.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>

#include "kernels/numerics/numerics.h"
#include "model/error.h"
#include "model/mapped_file.h"

namespace dsv4 {

namespace fs = std::filesystem;
using json = nlohmann::json;

namespace {

constexpr uint64_t kMaxHeaderBytes = 100ull * 1000 * 1000;  // the limit the reference library uses
constexpr const char* kIndexName = "model.safetensors.index.json";
constexpr const char* kSingleName = "model.safetensors";

const StDType kAllDTypes[] = {StDType::BF16, StDType::F16, StDType::F32,
                              StDType::I32,  StDType::I64, StDType::F8_E4M3};

bool parse_dtype(const std::string& s, StDType& out) {
  for (StDType t : kAllDTypes)
    if (s == to_string(t)) {
      out = t;
      return true;
    }
  return false;
}

std::string known_dtypes() {
  std::string s;
  for (StDType t : kAllDTypes) s += std::string(s.empty() ? "" : ", ") + to_string(t);
  return s;
}

std::string shape_str(const std::vector<int64_t>& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) s += fmt::format("{}{}", i ? ", " : "", shape[i]);
  return s + "]";
}

// numel of a shape; false on int64 overflow.
bool checked_numel(const std::vector<int64_t>& shape, int64_t& out) {
  int64_t n = 1;
  for (int64_t d : shape)
    if (__builtin_mul_overflow(n, d, &n)) return false;
  out = n;
  return true;
}

// The file mapped (MappedFile), with the errors a weights file gets: WeightsError, and "truncated" below
// the 8-byte header length.
std::unique_ptr<MappedFile> map_file(const std::string& path) {
  std::unique_ptr<MappedFile> m;
  try {
    m = MappedFile::open(path);
  } catch (const InputError& e) {
    throw WeightsError(e.what());
  }
  if (m->size() < 8)
    throw WeightsError(fmt::format(
        "{}: truncated: the file has {} bytes, fewer than the 8-byte header length", path, m->size()));
  return m;
}

std::string read_text_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw WeightsError(fmt::format("{}: cannot open: {}", path, std::strerror(errno)));
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// Writes `bytes` to path + ".tmp", then renames it over `path`, so readers never see a partial file.
void write_file_atomic(const std::string& path, const std::vector<std::pair<const uint8_t*, size_t>>& parts) {
  const std::string tmp = path + ".tmp";
  FILE* f = std::fopen(tmp.c_str(), "wb");
  if (!f) throw Error(fmt::format("{}: cannot create: {}", tmp, std::strerror(errno)));
  for (const auto& [p, n] : parts) {
    if (n && std::fwrite(p, 1, n, f) != n) {
      int e = errno;
      std::fclose(f);
      std::remove(tmp.c_str());
      throw Error(fmt::format("{}: write failed: {}", tmp, std::strerror(e)));
    }
  }
  if (std::fflush(f) != 0 || fsync(fileno(f)) != 0) {
    int e = errno;
    std::fclose(f);
    std::remove(tmp.c_str());
    throw Error(fmt::format("{}: write failed: {}", tmp, std::strerror(e)));
  }
  if (std::fclose(f) != 0) {
    int e = errno;
    std::remove(tmp.c_str());
    throw Error(fmt::format("{}: write failed: {}", tmp, std::strerror(e)));
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    int e = errno;
    std::remove(tmp.c_str());
    throw Error(fmt::format("{}: cannot rename {} into place: {}", path, tmp, std::strerror(e)));
  }
}

void write_text_atomic(const std::string& path, const std::string& text) {
  write_file_atomic(path, {{reinterpret_cast<const uint8_t*>(text.data()), text.size()}});
}

}  // namespace

// ---- dtypes -------------------------------------------------------------------------------------

const char* to_string(StDType t) {
  switch (t) {
    case StDType::BF16:
      return "BF16";
    case StDType::F16:
      return "F16";
    case StDType::F32:
      return "F32";
    case StDType::I32:
      return "I32";
    case StDType::I64:
      return "I64";
    case StDType::F8_E4M3:
      return "F8_E4M3";
  }
  return "?";
}

int dtype_size(StDType t) {
  switch (t) {
    case StDType::BF16:
    case StDType::F16:
      return 2;
    case StDType::F32:
    case StDType::I32:
      return 4;
    case StDType::I64:
      return 8;
    case StDType::F8_E4M3:
      return 1;
  }
  return 0;
}

int64_t StTensorInfo::numel() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

// ---- reader -------------------------------------------------------------------------------------

struct SafetensorsReader::Impl {
  std::string origin;  // what was opened (file or directory), for lookup errors
  std::vector<std::unique_ptr<MappedFile>> maps;
  std::map<std::string, StTensorInfo> tensors;
  std::map<std::string, std::string> meta;

  // Maps one file and adds its tensors; returns the names it holds.
  std::vector<std::string> add_file(const std::string& path);
};

std::vector<std::string> SafetensorsReader::Impl::add_file(const std::string& path) {
  maps.push_back(map_file(path));
  const MappedFile& m = *maps.back();

  uint64_t n = 0;
  for (int i = 0; i < 8; ++i) n |= uint64_t(m.data()[i]) << (8 * i);
  const uint64_t after_len = m.size() - 8;
  if (n > after_len)
    throw WeightsError(
        fmt::format("{}: truncated: header says {} bytes of JSON but the file has {} bytes after "
                    "the length",
                    path, n, after_len));
  if (n > kMaxHeaderBytes)
    throw WeightsError(fmt::format("{}: header length {} exceeds the {} byte limit (not a safetensors file?)",
                                   path, n, kMaxHeaderBytes));

  const char* htext = reinterpret_cast<const char*>(m.data() + 8);
  json h;
  try {
    h = json::parse(htext, htext + n);
  } catch (const json::parse_error& e) {
    throw WeightsError(
        fmt::format("{}: header is not valid JSON (at byte {} of {}): {}", path, e.byte, n, e.what()));
  } catch (const json::exception& e) {  // a number that overflows, ...
    throw WeightsError(fmt::format("{}: header is not usable JSON: {}", path, e.what()));
  }
  if (!h.is_object())
    throw WeightsError(fmt::format("{}: header must be a JSON object, found {}", path, h.type_name()));

  const uint8_t* data = m.data() + 8 + n;
  const uint64_t data_size = after_len - n;
  struct Span {
    uint64_t b, e;
    std::string name;
  };
  std::vector<Span> spans;
  std::vector<std::string> names;

  for (auto it = h.begin(); it != h.end(); ++it) {
    const std::string& name = it.key();
    const json& v = it.value();
    if (name == "__metadata__") {
      if (!v.is_object())
        throw WeightsError(fmt::format("{}: __metadata__ must be an object, found {}", path, v.type_name()));
      for (auto mi = v.begin(); mi != v.end(); ++mi) {
        if (!mi.value().is_string())
          throw WeightsError(fmt::format("{}: __metadata__ entry '{}' must be a string, found {}", path,
                                         mi.key(), mi.value().type_name()));
        meta.emplace(mi.key(), mi.value().get<std::string>());
      }
      continue;
    }
    auto bad = [&](const std::string& what) {
      return WeightsError(fmt::format("{}: tensor '{}': {}", path, name, what));
    };
    if (!v.is_object()) throw bad(fmt::format("entry must be an object, found {}", v.type_name()));

    auto dt = v.find("dtype");
    if (dt == v.end()) throw bad("'dtype' is missing");
    if (!dt->is_string()) throw bad(fmt::format("'dtype' must be a string, found {}", dt->type_name()));
    StTensorInfo info;
    info.name = name;
    info.file = path;
    const std::string dts = dt->get<std::string>();
    if (!parse_dtype(dts, info.dtype))
      throw bad(fmt::format("unsupported dtype '{}' (supported: {})", dts, known_dtypes()));

    auto sh = v.find("shape");
    if (sh == v.end()) throw bad("'shape' is missing");
    if (!sh->is_array()) throw bad(fmt::format("'shape' must be an array, found {}", sh->type_name()));
    for (const json& d : *sh) {
      if (d.is_number_unsigned() && d.get<uint64_t>() <= uint64_t(std::numeric_limits<int64_t>::max()))
        info.shape.push_back(d.get<int64_t>());
      else
        throw bad(fmt::format("'shape' {} must hold non-negative integers", sh->dump()));
    }

    auto off = v.find("data_offsets");
    if (off == v.end()) throw bad("'data_offsets' is missing");
    if (!off->is_array() || off->size() != 2 || !(*off)[0].is_number_unsigned() ||
        !(*off)[1].is_number_unsigned())
      throw bad(
          fmt::format("'data_offsets' {} must be [begin, end] with non-negative integers", off->dump()));
    const uint64_t b = (*off)[0].get<uint64_t>(), e = (*off)[1].get<uint64_t>();
    if (b > e) throw bad(fmt::format("data_offsets [{}, {}] end before they begin", b, e));
    if (e > data_size)
      throw bad(
          fmt::format("data_offsets [{}, {}] exceed the {} bytes of data after the header (truncated "
                      "file?)",
                      b, e, data_size));

    int64_t numel = 0, need = 0;
    if (!checked_numel(info.shape, numel) ||
        __builtin_mul_overflow(numel, int64_t(dtype_size(info.dtype)), &need))
      throw bad(fmt::format("shape {} is too large", shape_str(info.shape)));
    if (uint64_t(need) != e - b)
      throw bad(fmt::format("data_offsets [{}, {}] hold {} bytes but shape {} of {} needs {}", b, e, e - b,
                            shape_str(info.shape), dts, need));

    info.data = data + b;
    info.nbytes = need;
    if (tensors.count(name))
      throw bad(fmt::format("also present in {} (each tensor must be stored once)", tensors.at(name).file));
    if (e > b) spans.push_back({b, e, name});
    names.push_back(name);
    tensors.emplace(name, std::move(info));
  }

  // Tensors must not share bytes (gaps, e.g. alignment padding, are allowed).
  std::sort(spans.begin(), spans.end(), [](const Span& x, const Span& y) { return x.b < y.b; });
  for (size_t i = 1; i < spans.size(); ++i)
    if (spans[i].b < spans[i - 1].e)
      throw WeightsError(fmt::format("{}: tensor '{}': data_offsets [{}, {}] overlap tensor '{}' at [{}, {}]",
                                     path, spans[i].name, spans[i].b, spans[i].e, spans[i - 1].name,
                                     spans[i - 1].b, spans[i - 1].e));
  return names;
}

SafetensorsReader::SafetensorsReader() : impl_(std::make_unique<Impl>()) {}
SafetensorsReader::SafetensorsReader(SafetensorsReader&&) noexcept = default;
SafetensorsReader& SafetensorsReader::operator=(SafetensorsReader&&) noexcept = default;
SafetensorsReader::~SafetensorsReader() = default;

SafetensorsReader SafetensorsReader::open(const std::string& path) {
  SafetensorsReader r;
  Impl& im = *r.impl_;
  im.origin = path;

  std::error_code ec;
  const fs::path p(path);
  if (!fs::exists(p, ec)) throw WeightsError(fmt::format("{}: no such file or directory", path));

  // An index file: shards relative to its directory.
  auto open_index = [&](const fs::path& index) {
    const std::string ipath = index.string();
    json j;
    try {
      j = json::parse(read_text_file(ipath));
    } catch (const json::parse_error& e) {
      throw WeightsError(fmt::format("{}: not valid JSON (at byte {}): {}", ipath, e.byte, e.what()));
    } catch (const json::exception& e) {  // a number that overflows, ...
      throw WeightsError(fmt::format("{}: not usable JSON: {}", ipath, e.what()));
    }
    if (!j.is_object() || !j.contains("weight_map") || !j["weight_map"].is_object())
      throw WeightsError(fmt::format("{}: expected an object with a 'weight_map' object", ipath));
    const json& wm = j["weight_map"];
    std::map<std::string, std::vector<std::string>> by_shard;  // shard -> tensors it must hold
    for (auto it = wm.begin(); it != wm.end(); ++it) {
      if (!it.value().is_string())
        throw WeightsError(fmt::format("{}: weight_map entry '{}' must be a file name, found {}", ipath,
                                       it.key(), it.value().type_name()));
      by_shard[it.value().get<std::string>()].push_back(it.key());
    }
    const fs::path dir = index.parent_path();
    for (const auto& [shard, wanted] : by_shard) {
      const fs::path sp = dir / shard;
      if (!fs::is_regular_file(sp, ec))
        throw WeightsError(fmt::format("{}: shard '{}' named in {} (needed by tensor '{}') does not exist",
                                       sp.string(), shard, ipath, wanted.front()));
      im.add_file(sp.string());
      for (const std::string& t : wanted) {
        auto f = im.tensors.find(t);
        if (f == im.tensors.end() || f->second.file != sp.string())
          throw WeightsError(fmt::format("{}: tensor '{}' is listed in {} but not stored in this shard",
                                         sp.string(), t, ipath));
      }
    }
  };

  if (fs::is_directory(p, ec)) {
    if (fs::exists(p / kIndexName, ec)) {
      open_index(p / kIndexName);
    } else if (fs::exists(p / kSingleName, ec)) {
      im.add_file((p / kSingleName).string());
    } else {
      std::vector<std::string> found;
      for (const auto& de : fs::directory_iterator(p, ec))
        if (de.is_regular_file() && de.path().extension() == ".safetensors")
          found.push_back(de.path().string());
      std::sort(found.begin(), found.end());
      if (found.size() == 1) {
        im.add_file(found.front());
      } else if (found.empty()) {
        throw WeightsError(
            fmt::format("{}: no checkpoint found (looked for {}, {}, or a single *.safetensors "
                        "file)",
                        path, kIndexName, kSingleName));
      } else {
        std::string list;
        for (const auto& f : found) list += (list.empty() ? "" : ", ") + fs::path(f).filename().string();
        throw WeightsError(fmt::format("{}: {} *.safetensors files but no {} to say which to use ({})", path,
                                       found.size(), kIndexName, list));
      }
    }
  } else if (path.size() >= 11 && path.compare(path.size() - 11, 11, ".index.json") == 0) {
    open_index(p);
  } else {
    im.add_file(path);
  }
  return r;
}

bool SafetensorsReader::contains(const std::string& name) const {
  return impl_->tensors.count(name) != 0;
}

const StTensorInfo& SafetensorsReader::info(const std::string& name) const {
  auto it = impl_->tensors.find(name);
  if (it == impl_->tensors.end())
    throw WeightsError(fmt::format("{}: no tensor named '{}' ({} tensors in the checkpoint)", impl_->origin,
                                   name, impl_->tensors.size()));
  return it->second;
}

std::vector<std::string> SafetensorsReader::names() const {
  std::vector<std::string> v;
  v.reserve(impl_->tensors.size());
  for (const auto& [n, _] : impl_->tensors) v.push_back(n);
  return v;
}

std::vector<float> SafetensorsReader::read_f32(const std::string& name) const {
  const StTensorInfo& t = info(name);
  const size_t n = size_t(t.numel());
  std::vector<float> out(n);
  const uint8_t* p = t.data;  // no alignment assumed: elements are copied byte-wise
  switch (t.dtype) {
    case StDType::F32:
      if (n) std::memcpy(out.data(), p, n * 4);
      break;
    case StDType::BF16:
      for (size_t i = 0; i < n; ++i) {
        uint16_t b;
        std::memcpy(&b, p + 2 * i, 2);
        out[i] = num::bf16_to_f32(b);
      }
      break;
    case StDType::F16:
      for (size_t i = 0; i < n; ++i) {
        uint16_t b;
        std::memcpy(&b, p + 2 * i, 2);
        out[i] = num::f16_to_f32(b);
      }
      break;
    case StDType::F8_E4M3:
      for (size_t i = 0; i < n; ++i) out[i] = num::e4m3_to_f32(p[i]);
      break;
    case StDType::I32:
    case StDType::I64:
      throw WeightsError(
          fmt::format("{}: tensor '{}': dtype {} is an integer type, expected a float type "
                      "(BF16, F16, F32, F8_E4M3)",
                      t.file, name, to_string(t.dtype)));
  }
  return out;
}

std::vector<int32_t> SafetensorsReader::read_i32(const std::string& name) const {
  const StTensorInfo& t = info(name);
  const size_t n = size_t(t.numel());
  std::vector<int32_t> out(n);
  if (t.dtype == StDType::I32) {
    if (n) std::memcpy(out.data(), t.data, n * 4);
  } else if (t.dtype == StDType::I64) {
    for (size_t i = 0; i < n; ++i) {
      int64_t v;
      std::memcpy(&v, t.data + 8 * i, 8);
      if (v < std::numeric_limits<int32_t>::min() || v > std::numeric_limits<int32_t>::max())
        throw WeightsError(fmt::format("{}: tensor '{}': I64 value {} at index {} does not fit in int32",
                                       t.file, name, v, i));
      out[i] = int32_t(v);
    }
  } else {
    throw WeightsError(fmt::format("{}: tensor '{}': dtype {} is not an integer type (expected I32 or I64)",
                                   t.file, name, to_string(t.dtype)));
  }
  return out;
}

std::map<std::string, std::string> SafetensorsReader::metadata() const {
  return impl_->meta;
}

// ---- writer -------------------------------------------------------------------------------------

void SafetensorsWriter::add(const std::string& name, StDType dtype, std::vector<int64_t> shape,
                            std::vector<uint8_t> bytes) {
  if (name.empty() || name == "__metadata__")
    throw WeightsError(fmt::format("safetensors writer: invalid tensor name '{}'", name));
  for (const Entry& e : entries_)
    if (e.name == name) throw WeightsError(fmt::format("safetensors writer: tensor '{}' added twice", name));
  int64_t numel = 0, need = 0;
  for (int64_t d : shape)
    if (d < 0)
      throw WeightsError(fmt::format("safetensors writer: tensor '{}': negative dimension in shape {}", name,
                                     shape_str(shape)));
  if (!checked_numel(shape, numel) || __builtin_mul_overflow(numel, int64_t(dtype_size(dtype)), &need) ||
      uint64_t(need) != bytes.size())
    throw WeightsError(
        fmt::format("safetensors writer: tensor '{}': {} bytes given but shape {} of {} needs {}", name,
                    bytes.size(), shape_str(shape), to_string(dtype), need));
  entries_.push_back({name, dtype, std::move(shape), std::move(bytes)});
}

namespace {
size_t checked_count(const std::string& name, const std::vector<int64_t>& shape, size_t given) {
  int64_t n = 0;
  if (!checked_numel(shape, n) || n < 0 || uint64_t(n) != given)
    throw WeightsError(fmt::format("safetensors writer: tensor '{}': {} values given but shape {} holds {}",
                                   name, given, shape_str(shape), n));
  return given;
}
}  // namespace

void SafetensorsWriter::add_bf16(const std::string& name, std::vector<int64_t> shape,
                                 const std::vector<float>& values) {
  const size_t n = checked_count(name, shape, values.size());
  std::vector<uint8_t> bytes(n * 2);
  for (size_t i = 0; i < n; ++i) {
    uint16_t b = num::bf16_bits(values[i]);
    std::memcpy(bytes.data() + 2 * i, &b, 2);
  }
  add(name, StDType::BF16, std::move(shape), std::move(bytes));
}

void SafetensorsWriter::add_f32(const std::string& name, std::vector<int64_t> shape,
                                const std::vector<float>& values) {
  const size_t n = checked_count(name, shape, values.size());
  std::vector<uint8_t> bytes(n * 4);
  if (n) std::memcpy(bytes.data(), values.data(), n * 4);
  add(name, StDType::F32, std::move(shape), std::move(bytes));
}

void SafetensorsWriter::add_i32(const std::string& name, std::vector<int64_t> shape,
                                const std::vector<int32_t>& values) {
  const size_t n = checked_count(name, shape, values.size());
  std::vector<uint8_t> bytes(n * 4);
  if (n) std::memcpy(bytes.data(), values.data(), n * 4);
  add(name, StDType::I32, std::move(shape), std::move(bytes));
}

void SafetensorsWriter::set_metadata(const std::string& key, const std::string& value) {
  meta_[key] = value;
}

namespace {

// Writes the given entries as one file. The data of the tensors is contiguous (no gaps: the HF
// safetensors library rejects files with gaps), ordered by element size (largest first) and then by
// name, so every tensor starts at a multiple of its own element size; the header is padded with
// spaces so the data starts at a multiple of 8 from the file start.
template <typename EntryT>
void write_one(const std::string& path, std::vector<const EntryT*> entries,
               const std::map<std::string, std::string>& meta) {
  std::sort(entries.begin(), entries.end(), [](const EntryT* a, const EntryT* b) {
    const int sa = dtype_size(a->dtype), sb = dtype_size(b->dtype);
    return sa != sb ? sa > sb : a->name < b->name;
  });
  json h = json::object();
  uint64_t pos = 0;
  for (const EntryT* e : entries) {
    h[e->name] = {
        {"dtype", to_string(e->dtype)}, {"shape", e->shape}, {"data_offsets", {pos, pos + e->bytes.size()}}};
    pos += e->bytes.size();
  }
  if (!meta.empty()) h["__metadata__"] = meta;
  std::string header = h.dump();
  header.append((8 - (8 + header.size()) % 8) % 8, ' ');

  std::vector<uint8_t> prefix(8);
  for (int i = 0; i < 8; ++i) prefix[size_t(i)] = uint8_t(uint64_t(header.size()) >> (8 * i));
  std::vector<std::pair<const uint8_t*, size_t>> parts;
  parts.push_back({prefix.data(), 8});
  parts.push_back({reinterpret_cast<const uint8_t*>(header.data()), header.size()});
  for (const EntryT* e : entries) parts.push_back({e->bytes.data(), e->bytes.size()});
  write_file_atomic(path, parts);
}

}  // namespace

void SafetensorsWriter::write(const std::string& path) const {
  std::vector<const Entry*> all;
  for (const Entry& e : entries_) all.push_back(&e);
  write_one(path, all, meta_);
}

void SafetensorsWriter::write_sharded(const std::string& dir, int64_t max_shard_bytes) const {
  if (max_shard_bytes <= 0)
    throw Error(fmt::format("{}: max_shard_bytes must be positive, got {}", dir, max_shard_bytes));
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) throw Error(fmt::format("{}: cannot create directory: {}", dir, ec.message()));

  std::vector<const Entry*> sorted;
  for (const Entry& e : entries_) sorted.push_back(&e);
  std::sort(sorted.begin(), sorted.end(), [](const Entry* a, const Entry* b) { return a->name < b->name; });

  // Greedy in name order; a tensor larger than the limit gets a shard of its own.
  std::vector<std::vector<const Entry*>> shards(1);
  int64_t cur = 0, total = 0;
  for (const Entry* e : sorted) {
    const int64_t sz = int64_t(e->bytes.size());
    if (!shards.back().empty() && cur + sz > max_shard_bytes) {
      shards.emplace_back();
      cur = 0;
    }
    shards.back().push_back(e);
    cur += sz;
    total += sz;
  }

  const size_t n = shards.size();
  json wm = json::object();
  for (size_t i = 0; i < n; ++i) {
    const std::string fname = fmt::format("model-{:05d}-of-{:05d}.safetensors", i + 1, n);
    write_one((fs::path(dir) / fname).string(), shards[i], meta_);
    for (const Entry* e : shards[i]) wm[e->name] = fname;
  }
  json index = {{"metadata", {{"total_size", total}}}, {"weight_map", wm}};
  write_text_atomic((fs::path(dir) / kIndexName).string(), index.dump(2) + "\n");
}

}  // namespace dsv4
