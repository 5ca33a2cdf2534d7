#include "capture/digest.h"

#include <fmt/format.h>
#include <xxhash.h>

#include <algorithm>
#include <bit>
#include <cstring>
#include <fstream>
#include <map>

#include "kernels/numerics/numerics.h"
#include "model/error.h"

namespace dsv4 {

// The trace stores and hashes little-endian bytes; on a little-endian host the in-memory float32 and
// int32 values already are those bytes and are hashed in place.
static_assert(std::endian::native == std::endian::little, "digests assume a little-endian host");

namespace {

// bf16 patterns of bf16-exact fp32 values (exact: the rounding in bf16_bits is a no-op on them).
void to_bf16(const float* src, int64_t n, uint16_t* dst) {
  for (int64_t i = 0; i < n; ++i) dst[i] = num::bf16_bits(src[i]);
}

constexpr int64_t kParallelBytes = int64_t(1) << 20;  // below this, threads cost more than they save

}  // namespace

uint64_t xxh3_64(const void* data, size_t bytes) {
  return XXH3_64bits(data, bytes);
}

std::vector<uint64_t> digest_rows(const TensorRecord& t) {
  const int64_t rows = t.rows(), elems = t.row_elems();
  std::vector<uint64_t> out(static_cast<size_t>(std::max<int64_t>(rows, 0)));
  if (rows <= 0) return out;
  if (t.row_digests) {  // computed by the backend where the tensor lives
    std::copy(t.row_digests, t.row_digests + rows, out.begin());
    return out;
  }
  const int64_t total_bytes = rows * elems * (t.dtype == DType::bf16 ? 2 : 4);
  if (t.dtype == DType::bf16) {
    const float* src = static_cast<const float*>(t.data());
#pragma omp parallel if (total_bytes > kParallelBytes)
    {
      std::vector<uint16_t> row(static_cast<size_t>(elems));
#pragma omp for schedule(static)
      for (int64_t r = 0; r < rows; ++r) {
        to_bf16(src + r * elems, elems, row.data());
        out[size_t(r)] = XXH3_64bits(row.data(), size_t(elems) * 2);
      }
    }
  } else {
    const uint8_t* src = static_cast<const uint8_t*>(t.data());
    const size_t row_bytes = size_t(elems) * 4;
#pragma omp parallel for schedule(static) if (total_bytes > kParallelBytes)
    for (int64_t r = 0; r < rows; ++r) out[size_t(r)] = XXH3_64bits(src + size_t(r) * row_bytes, row_bytes);
  }
  return out;
}

std::vector<uint8_t> storage_bytes(const TensorRecord& t) {
  const int64_t n = std::max<int64_t>(t.rows(), 0) * t.row_elems();
  if (t.dtype == DType::bf16) {
    std::vector<uint8_t> out(size_t(n) * 2);
    std::vector<uint16_t> bits(static_cast<size_t>(n));
    to_bf16(static_cast<const float*>(t.data()), n, bits.data());
    if (n > 0) std::memcpy(out.data(), bits.data(), out.size());
    return out;
  }
  std::vector<uint8_t> out(size_t(n) * 4);
  if (n > 0) std::memcpy(out.data(), t.data(), out.size());
  return out;
}

ModelDigest model_digest(const Weights& w) {
  ModelDigest d;
  // Every tensor by name: the loaded ones hashed here, those a process left out (Weights::absent) with
  // the digest taken when they were dropped.
  std::map<std::string, const WeightTensor*> by_name;
  for (const auto& [name, t] : w.tensors()) by_name.emplace(name, &t);
  for (const auto& [name, t] : w.absent()) by_name.emplace(name, nullptr);
  std::vector<const WeightTensor*> ts;
  for (const auto& [name, t] : by_name) {
    d.names.push_back(name);
    d.digests.push_back(t ? 0 : w.absent().at(name).digest);
    ts.push_back(t);
  }
#pragma omp parallel for schedule(dynamic)
  for (size_t i = 0; i < ts.size(); ++i)
    if (ts[i]) d.digests[i] = tensor_digest(*ts[i]);

  std::vector<uint8_t> all;
  for (size_t i = 0; i < d.names.size(); ++i) {
    all.insert(all.end(), d.names[i].begin(), d.names[i].end());
    all.push_back(0);
    uint8_t le[8];
    std::memcpy(le, &d.digests[i], 8);
    all.insert(all.end(), le, le + 8);
  }
  d.whole = XXH3_64bits(all.data(), all.size());
  return d;
}

std::string hex16(uint64_t v) {
  return fmt::format("{:016x}", v);
}

uint64_t file_digest(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  if (!f) throw InputError(fmt::format("{}: cannot read", path));
  XXH3_state_t* st = XXH3_createState();
  XXH3_64bits_reset(st);
  std::vector<char> buf(size_t(1) << 20);
  while (f) {
    f.read(buf.data(), std::streamsize(buf.size()));
    if (f.gcount() > 0) XXH3_64bits_update(st, buf.data(), size_t(f.gcount()));
  }
  const uint64_t h = XXH3_64bits_digest(st);
  XXH3_freeState(st);
  return h;
}

}  // namespace dsv4
