#include "adapters/npy.h"

#include <fmt/core.h>
#include <fmt/ranges.h>

#include <cstring>
#include <limits>

#include "model/error.h"

namespace dsv4 {

namespace {

constexpr char kMagic[] = "\x93NUMPY";
constexpr size_t kMagicLen = 6;

// The value of `key` in the header dict literal, as its raw text (up to the next ',' at depth 0 or '}').
std::string dict_value(const std::string& h, const std::string& key, const std::string& what) {
  size_t at = h.find("'" + key + "'");
  if (at == std::string::npos) at = h.find("\"" + key + "\"");
  if (at == std::string::npos) throw InputError(fmt::format("{}: .npy header has no '{}': {}", what, key, h));
  at = h.find(':', at + key.size() + 2);
  if (at == std::string::npos) throw InputError(fmt::format("{}: .npy header is malformed: {}", what, h));
  ++at;
  while (at < h.size() && h[at] == ' ') ++at;
  size_t end = at;
  int depth = 0;
  for (; end < h.size(); ++end) {
    const char ch = h[end];
    if (ch == '(') ++depth;
    if (ch == ')') --depth;
    if (depth == 0 && (ch == ',' || ch == '}')) break;
  }
  std::string v = h.substr(at, end - at);
  while (!v.empty() && v.back() == ' ') v.pop_back();
  return v;
}

std::vector<int64_t> parse_shape(const std::string& v, const std::string& what) {
  if (v.size() < 2 || v.front() != '(' || v.back() != ')')
    throw InputError(fmt::format("{}: .npy shape {} is not a tuple", what, v));
  std::vector<int64_t> shape;
  size_t i = 1;
  while (i < v.size() - 1) {
    while (i < v.size() - 1 && (v[i] == ' ' || v[i] == ',')) ++i;
    if (i >= v.size() - 1) break;
    int64_t x = 0;
    size_t digits = 0;
    while (i < v.size() - 1 && v[i] >= '0' && v[i] <= '9') {
      if (x > (int64_t(1) << 50)) throw InputError(fmt::format("{}: .npy shape {} is too large", what, v));
      x = x * 10 + (v[i] - '0');
      ++i;
      ++digits;
    }
    while (i < v.size() - 1 && (v[i] == 'L' || v[i] == ' ')) ++i;  // Python 2 longs
    if (digits == 0 || (i < v.size() - 1 && v[i] != ','))
      throw InputError(fmt::format("{}: .npy shape {} is not a tuple of integers", what, v));
    shape.push_back(x);
  }
  return shape;
}

std::vector<uint8_t> encode(const char* descr, const void* values, size_t bytes,
                            const std::vector<int64_t>& shape) {
  std::string dims;
  for (int64_t d : shape) dims += fmt::format("{}, ", d);
  if (shape.size() > 1) dims.resize(dims.size() - 2);  // (3,) for one dimension, (2, 3) for more
  if (shape.size() == 1) dims.resize(dims.size() - 1);
  std::string header = fmt::format("{{'descr': '{}', 'fortran_order': False, 'shape': ({}), }}", descr, dims);
  // The data starts on a 64-byte boundary; the header ends with '\n' (NEP 1).
  const bool v2 = kMagicLen + 2 + 2 + header.size() + 1 > 65535;
  const size_t prefix = kMagicLen + 2 + (v2 ? 4 : 2);
  header.append((64 - (prefix + header.size() + 1) % 64) % 64, ' ');
  header += '\n';
  std::vector<uint8_t> out(prefix + header.size() + bytes);
  std::memcpy(out.data(), kMagic, kMagicLen);
  out[6] = v2 ? 2 : 1;
  out[7] = 0;
  const uint32_t hl = uint32_t(header.size());
  out[8] = uint8_t(hl);
  out[9] = uint8_t(hl >> 8);
  if (v2) {
    out[10] = uint8_t(hl >> 16);
    out[11] = uint8_t(hl >> 24);
  }
  std::memcpy(out.data() + prefix, header.data(), header.size());
  if (bytes) std::memcpy(out.data() + prefix + header.size(), values, bytes);
  return out;
}

}  // namespace

int64_t NpyArray::count() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

NpyArray npy_parse(std::span<const uint8_t> file, const std::string& what) {
  if (file.size() < 10 || std::memcmp(file.data(), kMagic, kMagicLen) != 0)
    throw InputError(fmt::format("{}: not a .npy array (no \\x93NUMPY magic)", what));
  const int major = file[6];
  if (major < 1 || major > 3)
    throw InputError(fmt::format("{}: .npy format version {}.{} is not supported (1.0, 2.0, 3.0 are)", what,
                                 major, int(file[7])));
  size_t prefix = 10, hl = size_t(file[8]) | size_t(file[9]) << 8;
  if (major >= 2) {
    if (file.size() < 12) throw InputError(fmt::format("{}: truncated .npy header", what));
    hl |= size_t(file[10]) << 16 | size_t(file[11]) << 24;
    prefix = 12;
  }
  if (file.size() < prefix + hl) throw InputError(fmt::format("{}: truncated .npy header", what));
  const std::string h(reinterpret_cast<const char*>(file.data() + prefix), hl);

  NpyArray a;
  std::string descr = dict_value(h, "descr", what);
  if (descr.size() < 2 || (descr.front() != '\'' && descr.front() != '"'))
    throw InputError(fmt::format(
        "{}: .npy descr {} is not a simple dtype (structured arrays are not supported)", what, descr));
  a.descr = descr.substr(1, descr.size() - 2);
  // '|' or '=' byte order only for one-byte types; here every accepted type is little-endian.
  if (a.descr.size() >= 1 && a.descr[0] == '>')
    throw InputError(fmt::format("{}: dtype '{}' is big-endian; save it little-endian (arr.astype('<i4'))",
                                 what, a.descr));
  if (a.descr != "<i4" && a.descr != "<i8" && a.descr != "<f4")
    throw InputError(fmt::format(
        "{}: dtype '{}' is not supported (int32 '<i4', int64 '<i8' or float32 '<f4')", what, a.descr));
  const std::string fortran = dict_value(h, "fortran_order", what);
  if (fortran == "True")
    throw InputError(fmt::format("{}: Fortran-order array; save it in C order (np.ascontiguousarray)", what));
  if (fortran != "False")
    throw InputError(fmt::format("{}: .npy fortran_order {} is not a boolean", what, fortran));
  a.shape = parse_shape(dict_value(h, "shape", what), what);
  const size_t elem = a.descr == "<i8" ? 8 : 4;
  const size_t need = size_t(a.count()) * elem;
  if (file.size() - prefix - hl != need)
    throw InputError(fmt::format("{}: shape ({}) of '{}' needs {} data bytes, the file has {}", what,
                                 fmt::join(a.shape, ", "), a.descr, need, file.size() - prefix - hl));
  a.data.assign(file.begin() + int64_t(prefix + hl), file.end());
  return a;
}

std::vector<int32_t> npy_int32(const NpyArray& a, const std::string& what, bool widen_i8) {
  std::vector<int32_t> out(size_t(a.count()));
  if (a.descr == "<i4") {
    if (!out.empty()) std::memcpy(out.data(), a.data.data(), out.size() * 4);
    return out;
  }
  if (a.descr == "<i8" && widen_i8) {
    for (size_t i = 0; i < out.size(); ++i) {
      int64_t v;
      std::memcpy(&v, a.data.data() + i * 8, 8);
      if (v < std::numeric_limits<int32_t>::min() || v > std::numeric_limits<int32_t>::max())
        throw InputError(fmt::format("{}: value {} at index {} does not fit int32", what, v, i));
      out[i] = int32_t(v);
    }
    return out;
  }
  throw InputError(fmt::format("{}: dtype '{}', expected int32 ('<i4'{})", what, a.descr,
                               widen_i8 ? " or int64 '<i8'" : ""));
}

std::vector<float> npy_float32(const NpyArray& a, const std::string& what) {
  if (a.descr != "<f4")
    throw InputError(fmt::format("{}: dtype '{}', expected float32 ('<f4')", what, a.descr));
  std::vector<float> out(size_t(a.count()));
  if (!out.empty()) std::memcpy(out.data(), a.data.data(), out.size() * 4);
  return out;
}

int64_t npy_scalar_int(const NpyArray& a, const std::string& what) {
  if (a.count() != 1)
    throw InputError(fmt::format("{}: expected one integer, found {} values", what, a.count()));
  if (a.descr == "<i4") {
    int32_t v;
    std::memcpy(&v, a.data.data(), 4);
    return v;
  }
  if (a.descr == "<i8") {
    int64_t v;
    std::memcpy(&v, a.data.data(), 8);
    return v;
  }
  throw InputError(fmt::format("{}: dtype '{}', expected an integer", what, a.descr));
}

std::vector<uint8_t> npy_encode_int32(std::span<const int32_t> values, const std::vector<int64_t>& shape) {
  return encode("<i4", values.data(), values.size() * 4, shape);
}
std::vector<uint8_t> npy_encode_int64(std::span<const int64_t> values, const std::vector<int64_t>& shape) {
  return encode("<i8", values.data(), values.size() * 8, shape);
}

}  // namespace dsv4
