// The writer's own chunk encoding (capture/chunk_codec.h) against HDF5 as the oracle: datasets written
// through h5::write (chunks encoded on several threads, stored with H5Dwrite_chunk) read back
// through HDF5's own filters (unshuffle, inflate, fletcher32 verification) equal what was written,
// for every storage type, both filter pipelines, partial last chunks, compressible and incompressible
// data (deflate skipped through the filter mask). Plus the filters on their own:
// shuffle against a hand-worked example and Fletcher-32 against a straightforward long-hand version.
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "capture/chunk_codec.h"
#include "capture/errors.h"
#include "capture/h5.h"
#include "test_util.h"

namespace dsv4::h5 {
namespace {

namespace fs = std::filesystem;

// Files in this process's directory, removed at its exit.
std::string temp_path(const std::string& name) {
  static const test::TempDir dir;
  return dir / name;
}

TEST(ChunkCodec, ShuffleIsHdf5sByteTranspose) {
  const std::vector<uint8_t> in = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13};  // 3 x 4-byte + 1 byte
  std::vector<uint8_t> out(in.size());
  shuffle_bytes(in.data(), in.size(), 4, out.data());
  EXPECT_EQ(out, (std::vector<uint8_t>{1, 5, 9, 2, 6, 10, 3, 7, 11, 4, 8, 12, 13}));
  shuffle_bytes(in.data(), in.size(), 1, out.data());
  EXPECT_EQ(out, in);
}

// Fletcher-32 the long way: 16-bit big-endian words (a last odd byte is the high byte of a word),
// sums modulo 65535 with 64-bit arithmetic, where 0xffff and 0 are the same residue; HDF5's batched
// folding leaves 0xffff where the modulo gives 0, so compare residues.
uint32_t fletcher32_reference(const std::vector<uint8_t>& d) {
  uint64_t s1 = 0, s2 = 0;
  for (size_t i = 0; i < d.size(); i += 2) {
    const uint64_t w = (uint64_t(d[i]) << 8) | (i + 1 < d.size() ? d[i + 1] : 0);
    s1 = (s1 + w) % 65535;
    s2 = (s2 + s1) % 65535;
  }
  return uint32_t(s2 << 16 | s1);
}

TEST(ChunkCodec, Fletcher32MatchesTheDefinition) {
  std::mt19937 rng(5);
  for (size_t n : {0, 1, 2, 3, 719, 720, 721, 1000, 65536, 65537}) {
    for (int fill : {-1, 0, 255}) {
      std::vector<uint8_t> d(n);
      for (auto& b : d) b = fill < 0 ? uint8_t(rng()) : uint8_t(fill);
      const uint32_t got = fletcher32(d.data(), d.size()), want = fletcher32_reference(d);
      EXPECT_EQ((got & 0xffff) % 65535, want & 0xffff) << n << " " << fill;
      EXPECT_EQ((got >> 16) % 65535, want >> 16) << n << " " << fill;
    }
  }
}

template <typename T>
std::vector<T> values(size_t n, bool compressible, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<T> v(n);
  for (size_t i = 0; i < n; ++i) {
    const uint64_t r = compressible ? (i / 7) % 13 : rng();
    if constexpr (std::is_same_v<T, float>)
      v[i] = compressible ? float(r) * 0.25f : float(int64_t(r >> 11)) * 1e-12f;
    else
      v[i] = T(r);
  }
  return v;
}

template <typename T>
void round_trip(Type t, std::vector<hsize_t> dims, Compress compress, bool compressible) {
  size_t n = 1;
  for (hsize_t d : dims) n *= d;
  const auto v = values<T>(n, compressible, n);
  const std::string direct = temp_path("direct.h5"), plain = temp_path("plain.h5");
  {
    Id fapl = file_access(true, false);
    Object f = create_file(direct, fapl.get());
    Object ds = create_dataset(f, "x", t, dims, false, 0, compress);
    write(ds, v);  // large enough for the encoded-chunk path
    ds = Object{};
    close_file(f);
  }
  {
    Id fapl = file_access(true, false);
    Object f = open_file(direct, H5F_ACC_RDONLY, fapl.get());
    const std::vector<T> back = read<T>(open(f, "x"));
    ASSERT_EQ(back.size(), v.size());
    EXPECT_TRUE(back == v) << "type size " << sizeof(T) << ", rows " << dims[0]
                           << (compress == Compress::yes ? ", deflate" : ", fletcher32 only");
  }
}

TEST(ChunkCodec, DatasetsReadBackThroughHdf5sFilters) {
  ASSERT_TRUE(chunk_codec_available()) << "built without zlib: the encoded-chunk path is not compiled";
  for (Compress c : {Compress::yes, Compress::no}) {
    for (bool compressible : {true, false}) {
      round_trip<uint8_t>(Type::u8, {300001}, c, compressible);
      round_trip<uint16_t>(Type::u16, {4097, 37}, c, compressible);
      round_trip<uint32_t>(Type::u32, {70001}, c, compressible);
      round_trip<uint64_t>(Type::u64, {65537}, c, compressible);
      round_trip<int32_t>(Type::i32, {1025, 3, 7}, c, compressible);
      round_trip<float>(Type::f32, {999, 257}, c, compressible);
    }
  }
}

// StagedWrites::add_rows: a dataset stored a few whole chunks at a time, in shuffled order and over
// several stores, reads back as the values of one whole write; a part that does not start and end on
// chunk boundaries (or the dataset's end) is refused, naming the rows.
TEST(ChunkCodec, RowsStoredInPartsReadBackAsOneWrite) {
  for (Compress c : {Compress::yes, Compress::no}) {
    for (const std::vector<hsize_t>& dims : {std::vector<hsize_t>{70001}, std::vector<hsize_t>{4097, 37}}) {
      const size_t n = size_t(dims[0]) * (dims.size() > 1 ? size_t(dims[1]) : 1);
      const auto v = values<uint32_t>(n, c == Compress::yes, n + dims.size());
      const std::string path = temp_path("parts.h5");
      {
        Id fapl = file_access(true, false);
        Object f = create_file(path, fapl.get());
        const Object ds = create_dataset(f, "x", Type::u32, dims, false, 0, c);
        const hsize_t per = chunk_rows(ds), rows = dims[0];
        ASSERT_LT(per, rows / 3) << "a few chunks at least";
        std::vector<std::pair<hsize_t, hsize_t>> parts;
        std::mt19937_64 rng(rows);
        for (hsize_t at = 0; at < rows;) {
          const hsize_t end = std::min(rows, at + per * (1 + rng() % 3));
          parts.emplace_back(at, end);
          at = end;
        }
        std::shuffle(parts.begin(), parts.end(), rng);
        for (size_t i = 0; i < parts.size(); i += 2) {
          StagedWrites w;
          for (size_t j = i; j < std::min(parts.size(), i + 2); ++j)
            w.add_rows(ds, Type::u32, v.data(), n, parts[j].first, parts[j].second);
          w.store();
        }
        StagedWrites bad;
        try {
          bad.add_rows(ds, Type::u32, v.data(), n, 1, per);
          ADD_FAILURE() << "rows [1, " << per << ") were accepted";
        } catch (const dsv4::TraceError& e) {
          EXPECT_NE(std::string(e.what()).find(fmt::format("rows [1, {}) of {}", per, rows)),
                    std::string::npos)
              << e.what();
        }
        EXPECT_THROW(bad.add_rows(ds, Type::u32, v.data(), n, 0, per + 1), dsv4::TraceError);
        close_file(f);
      }
      Id fapl = file_access(true, false);
      Object f = open_file(path, H5F_ACC_RDONLY, fapl.get());
      EXPECT_TRUE(read<uint32_t>(open(f, "x")) == v)
          << "rows " << dims[0] << (c == Compress::yes ? ", deflate" : ", fletcher32 only");
    }
  }
}

// A corrupted byte in a chunk written this way is caught by HDF5's fletcher32 on read.
TEST(ChunkCodec, CorruptionIsDetected) {
  const auto v = values<uint32_t>(200000, false, 9);
  const std::string path = temp_path("corrupt.h5");
  {
    Id fapl = file_access(true, false);
    Object f = create_file(path, fapl.get());
    Object ds = create_dataset(f, "x", Type::u32, {200000}, false, 0, Compress::no);
    write(ds, v);
    ds = Object{};
    close_file(f);
  }
  // Flip a byte in the middle of the file (inside the raw data: 800 KB of it in a ~800 KB file).
  {
    std::FILE* fp = std::fopen(path.c_str(), "r+b");
    ASSERT_NE(fp, nullptr);
    std::fseek(fp, 400000, SEEK_SET);
    const int b = std::fgetc(fp);
    std::fseek(fp, 400000, SEEK_SET);
    std::fputc(b ^ 0x5a, fp);
    std::fclose(fp);
  }
  Id fapl = file_access(true, false);
  Object f = open_file(path, H5F_ACC_RDONLY, fapl.get());
  EXPECT_ANY_THROW(read<uint32_t>(open(f, "x")));
}

// ChunkStream (values gathered into shuffled chunks and encoded as they fill) read back through HDF5's
// own filters, at lengths around the chunk size, held in memory and stored, or streamed from two
// threads into a ChunkFile and linked; and the bytes of a ChunkFile's file do not depend on which
// thread put which chunk first.
template <typename T>
void stream_round_trip(Type t) {
  const size_t P = size_t(65536 / sizeof(T));
  for (size_t n : {size_t(0), size_t(1), P - 1, P, P + 1, 3 * P + 5}) {
    const auto v = values<T>(n, n % 2 == 0, n + 1);
    const std::string path = temp_path("stream.h5");
    {
      Id fapl = file_access(true, false);
      Object f = create_file(path, fapl.get());
      ChunkStream held(t);
      for (size_t i = 0; i < n; i += 1000) held.append(v.data() + i, std::min<size_t>(1000, n - i));
      EXPECT_EQ(held.size(), n);
      held.store(f, "held");
      auto file = std::make_shared<ChunkFile>(f, t, 2);
      ChunkStream a(t, file, 0), b(t, file, 1);
      std::thread other([&] {
        for (size_t i = 0; i < n; i += 777) b.append(v.data() + i, std::min<size_t>(777, n - i));
        b.finish();
      });
      for (size_t i = 0; i < n; i += 333) a.append(v.data() + i, std::min<size_t>(333, n - i));
      a.finish();
      other.join();
      a.store(f, "a");
      b.store(f, "b");
      close_file(f);
    }
    Id fapl = file_access(true, false);
    Object f = open_file(path, H5F_ACC_RDONLY, fapl.get());
    for (const char* name : {"held", "a", "b"}) {
      const std::vector<T> back = read<T>(open(f, name));
      EXPECT_TRUE(back == v) << name << ": " << sizeof(T) << "-byte values, " << n;
    }
  }
}

TEST(ChunkCodec, StreamedDatasetsReadBackThroughHdf5sFilters) {
  ASSERT_TRUE(chunk_codec_available());
  stream_round_trip<uint8_t>(Type::u8);
  stream_round_trip<uint16_t>(Type::u16);
  stream_round_trip<uint32_t>(Type::u32);
  stream_round_trip<uint64_t>(Type::u64);
}

}  // namespace
}  // namespace dsv4::h5
