// safetensors reader/writer: bitwise round trips of every dtype, sharding, metadata, and every kind of
// malformed input (each must throw WeightsError naming the file and, where there is one, the tensor).
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <limits>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <string>
#include <vector>

#include "model/error.h"
#include "model/safetensors.h"
#include "test_util.h"

namespace dsv4 {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;

// A fresh, empty directory per test in this process's directory, removed at its exit.
std::string fresh_dir(const std::string& name) {
  static const test::TempDir root;
  const fs::path d = root.dir / name;
  fs::remove_all(d);
  fs::create_directories(d);
  return d.string();
}

std::vector<uint8_t> read_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::vector<uint8_t>(std::istreambuf_iterator<char>(in), {});
}

void write_bytes(const std::string& path, const std::vector<uint8_t>& b) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(reinterpret_cast<const char*>(b.data()), std::streamsize(b.size()));
}

// A raw file: 8-byte length (or `claimed_len` when given), header text, then `data_bytes` zero bytes.
void write_raw(const std::string& path, const std::string& header, size_t data_bytes,
               int64_t claimed_len = -1) {
  const uint64_t n = claimed_len < 0 ? header.size() : uint64_t(claimed_len);
  std::vector<uint8_t> b(8);
  for (int i = 0; i < 8; ++i) b[size_t(i)] = uint8_t(n >> (8 * i));
  b.insert(b.end(), header.begin(), header.end());
  b.resize(b.size() + data_bytes, 0);
  write_bytes(path, b);
}

template <typename T>
std::vector<uint8_t> as_bytes(const std::vector<T>& v) {
  std::vector<uint8_t> b(v.size() * sizeof(T));
  if (!v.empty()) std::memcpy(b.data(), v.data(), b.size());
  return b;
}

// Runs `f`, expecting a WeightsError whose message contains every part.
void expect_weights_error(const std::function<void()>& f, const std::vector<std::string>& parts) {
  try {
    f();
    ADD_FAILURE() << "expected WeightsError containing '" << parts.front() << "'";
  } catch (const WeightsError& e) {
    const std::string msg = e.what();
    for (const auto& p : parts) EXPECT_NE(msg.find(p), std::string::npos) << "'" << p << "' not in: " << msg;
  }
}

void expect_open_error(const std::string& path, const std::vector<std::string>& parts) {
  std::vector<std::string> all = parts;
  all.insert(all.begin(), fs::path(path).filename().string());
  expect_weights_error([&] { SafetensorsReader::open(path); }, all);
}

// ---- round trips --------------------------------------------------------------------------------

TEST(Safetensors, EveryDTypeRoundTripsBitwise) {
  const std::string dir = fresh_dir("dtypes");
  auto g = test::rng_for("EveryDTypeRoundTripsBitwise");
  std::map<std::string, std::pair<StDType, std::vector<uint8_t>>> want;
  SafetensorsWriter w;
  const std::vector<int64_t> shape = {3, 5};  // odd sizes: exercises the alignment padding
  for (StDType t :
       {StDType::BF16, StDType::F16, StDType::F32, StDType::I32, StDType::I64, StDType::F8_E4M3}) {
    std::vector<uint8_t> bytes(size_t(15 * dtype_size(t)));
    for (auto& b : bytes) b = uint8_t(g());
    const std::string name = std::string("t.") + to_string(t);
    want[name] = {t, bytes};
    w.add(name, t, shape, bytes);
  }
  w.add("empty", StDType::F32, {0, 4}, {});
  w.add("scalar", StDType::F32, {}, as_bytes(std::vector<float>{3.5f}));
  const std::string path = dir + "/x.safetensors";
  w.write(path);
  EXPECT_FALSE(fs::exists(path + ".tmp"));

  SafetensorsReader r = SafetensorsReader::open(path);
  EXPECT_EQ(r.names().size(), want.size() + 2);
  for (const auto& [name, tb] : want) {
    SCOPED_TRACE(name);
    const StTensorInfo& info = r.info(name);
    EXPECT_EQ(info.dtype, tb.first);
    EXPECT_EQ(info.shape, shape);
    EXPECT_EQ(info.numel(), 15);
    EXPECT_EQ(info.file, path);
    ASSERT_EQ(info.nbytes, int64_t(tb.second.size()));
    EXPECT_EQ(reinterpret_cast<uintptr_t>(info.data) % uintptr_t(dtype_size(info.dtype)), 0u)
        << "data not aligned to its element size";
    EXPECT_TRUE(test::bitwise_equal(std::vector<uint8_t>(info.data, info.data + info.nbytes), tb.second));
  }
  EXPECT_EQ(r.info("empty").numel(), 0);
  EXPECT_TRUE(r.read_f32("empty").empty());
  EXPECT_EQ(r.read_f32("scalar"), std::vector<float>{3.5f});
}

TEST(Safetensors, TypedAddAndReadConvert) {
  const std::string dir = fresh_dir("typed");
  auto g = test::rng_for("TypedAddAndReadConvert");
  std::vector<float> vals = test::randn_bf16(g, 64);
  std::vector<float> raw(64);
  std::normal_distribution<float> nd;
  for (auto& x : raw) x = nd(g);
  std::vector<int32_t> ids(12);
  for (size_t i = 0; i < ids.size(); ++i) ids[i] = int32_t(i * 37) - 100;

  SafetensorsWriter w;
  w.add_f32("f32", {8, 8}, raw);
  w.add_bf16("bf16", {64}, raw);  // rounds RNE
  w.add_bf16("bf16_exact", {4, 16}, vals);
  w.add_i32("ids", {3, 4}, ids);
  // F16: 1, -2, 65504, 2^-24 (smallest subnormal).
  w.add("f16", StDType::F16, {4}, as_bytes(std::vector<uint16_t>{0x3C00, 0xC000, 0x7BFF, 0x0001}));
  // E4M3: 1, 448, -1, 2^-9 (smallest subnormal).
  w.add("e4m3", StDType::F8_E4M3, {4}, {0x38, 0x7E, 0xB8, 0x01});
  w.add("i64", StDType::I64, {3}, as_bytes(std::vector<int64_t>{-5, 0, int64_t(INT32_MAX)}));
  w.add("i64_big", StDType::I64, {2}, as_bytes(std::vector<int64_t>{1, int64_t(INT32_MAX) + 1}));
  const std::string path = dir + "/model.safetensors";
  w.write(path);

  SafetensorsReader r = SafetensorsReader::open(dir);  // directory with model.safetensors
  EXPECT_TRUE(test::bitwise_equal(r.read_f32("f32"), raw));
  std::vector<float> rounded(raw.size());
  for (size_t i = 0; i < raw.size(); ++i) rounded[i] = num::bf16_round(raw[i]);
  EXPECT_TRUE(test::bitwise_equal(r.read_f32("bf16"), rounded));
  EXPECT_TRUE(test::bitwise_equal(r.read_f32("bf16_exact"), vals));
  EXPECT_EQ(r.read_i32("ids"), ids);
  EXPECT_EQ(r.read_f32("f16"), (std::vector<float>{1.0f, -2.0f, 65504.0f, std::ldexp(1.0f, -24)}));
  EXPECT_EQ(r.read_f32("e4m3"), (std::vector<float>{1.0f, 448.0f, -1.0f, std::ldexp(1.0f, -9)}));
  EXPECT_EQ(r.read_i32("i64"), (std::vector<int32_t>{-5, 0, INT32_MAX}));
  expect_weights_error([&] { r.read_i32("i64_big"); }, {"model.safetensors", "'i64_big'", "2147483648"});
  expect_weights_error([&] { r.read_f32("ids"); }, {"model.safetensors", "'ids'", "I32"});
  expect_weights_error([&] { r.read_i32("f32"); }, {"model.safetensors", "'f32'", "F32"});
}

TEST(Safetensors, HeaderIsSortedPaddedAndHasMetadata) {
  const std::string dir = fresh_dir("header");
  SafetensorsWriter w;
  w.add_f32("zeta", {3}, {1, 2, 3});
  w.add_f32("alpha", {1}, {4});
  w.add_bf16("mid", {3}, {1, 2, 3});
  w.set_metadata("format", "pt");
  w.set_metadata("seed", "42");
  const std::string path = dir + "/m.safetensors";
  w.write(path);

  std::vector<uint8_t> b = read_bytes(path);
  uint64_t n = 0;
  for (int i = 0; i < 8; ++i) n |= uint64_t(b[size_t(i)]) << (8 * i);
  EXPECT_EQ((8 + n) % 8, 0u);
  const std::string header(b.begin() + 8, b.begin() + 8 + long(n));
  EXPECT_LT(header.find("\"alpha\""), header.find("\"mid\""));
  EXPECT_LT(header.find("\"mid\""), header.find("\"zeta\""));
  json h = json::parse(header);
  EXPECT_EQ(h["__metadata__"]["seed"], "42");
  const SafetensorsReader r0 = SafetensorsReader::open(path);
  for (const char* t : {"alpha", "mid", "zeta"})
    EXPECT_EQ(h[t]["data_offsets"][0].get<uint64_t>() % uint64_t(dtype_size(r0.info(t).dtype)), 0u);

  SafetensorsReader r = SafetensorsReader::open(path);
  EXPECT_EQ(r.metadata(), (std::map<std::string, std::string>{{"format", "pt"}, {"seed", "42"}}));
  EXPECT_EQ(r.names(), (std::vector<std::string>{"alpha", "mid", "zeta"}));
}

TEST(Safetensors, ShardedRoundTrip) {
  const std::string dir = fresh_dir("sharded");
  SafetensorsWriter w;
  std::map<std::string, std::vector<float>> want;
  auto g = test::rng_for("ShardedRoundTrip");
  for (int i = 0; i < 7; ++i) {
    const std::string name = "layers." + std::to_string(i) + ".w";
    want[name] = test::randn_bf16(g, size_t(10 + i));
    w.add_f32(name, {int64_t(10 + i)}, want[name]);
  }
  w.add_i32("big", {100}, std::vector<int32_t>(100, 7));  // larger than a shard: stored alone
  w.set_metadata("format", "pt");
  w.write_sharded(dir, 128);

  SafetensorsReader r = SafetensorsReader::open(dir);
  json idx = json::parse(std::ifstream(dir + "/model.safetensors.index.json"));
  std::set<std::string> shards;
  for (auto it = idx["weight_map"].begin(); it != idx["weight_map"].end(); ++it) {
    shards.insert(it.value().get<std::string>());
    EXPECT_EQ(fs::path(r.info(it.key()).file).filename().string(), it.value().get<std::string>());
  }
  EXPECT_GT(shards.size(), 2u);
  const std::string n = std::to_string(shards.size());
  EXPECT_TRUE(shards.count("model-00001-of-0000" + n + ".safetensors"));
  // Each shard holds at most 128 bytes of tensor data, or a single tensor that alone exceeds it.
  std::map<std::string, std::pair<int64_t, int>> per_shard;  // file -> (bytes, tensors)
  for (const auto& name : r.names()) {
    auto& [bytes, count] = per_shard[r.info(name).file];
    bytes += r.info(name).nbytes;
    ++count;
  }
  EXPECT_EQ(per_shard.size(), shards.size());
  for (const auto& [file, bc] : per_shard) EXPECT_TRUE(bc.first <= 128 || bc.second == 1) << file;
  for (const auto& [name, v] : want) EXPECT_TRUE(test::bitwise_equal(r.read_f32(name), v)) << name;
  EXPECT_EQ(r.read_i32("big"), std::vector<int32_t>(100, 7));
  EXPECT_EQ(r.metadata().at("format"), "pt");
  EXPECT_EQ(r.names().size(), 8u);

  // The index file can be opened directly too.
  EXPECT_EQ(SafetensorsReader::open(dir + "/model.safetensors.index.json").names().size(), 8u);
}

TEST(Safetensors, DirectoryWithSingleOtherFile) {
  const std::string dir = fresh_dir("single");
  SafetensorsWriter w;
  w.add_f32("a", {2}, {1, 2});
  w.write(dir + "/weights.safetensors");
  EXPECT_TRUE(SafetensorsReader::open(dir).contains("a"));
  w.write(dir + "/other.safetensors");
  expect_open_error(dir, {"2 *.safetensors files", "other.safetensors", "weights.safetensors"});
}

TEST(Safetensors, MoveKeepsMappingsAlive) {
  const std::string dir = fresh_dir("move");
  SafetensorsWriter w;
  w.add_f32("a", {2}, {1, 2});
  w.write(dir + "/a.safetensors");
  SafetensorsReader r = SafetensorsReader::open(dir + "/a.safetensors");
  SafetensorsReader r2 = std::move(r);
  EXPECT_EQ(r2.read_f32("a"), (std::vector<float>{1, 2}));
}

// ---- lookups ------------------------------------------------------------------------------------

TEST(SafetensorsErrors, MissingTensorLookup) {
  const std::string dir = fresh_dir("lookup");
  SafetensorsWriter w;
  w.add_f32("a", {2}, {1, 2});
  w.write(dir + "/ckpt.safetensors");
  SafetensorsReader r = SafetensorsReader::open(dir + "/ckpt.safetensors");
  EXPECT_FALSE(r.contains("b"));
  expect_weights_error([&] { r.info("b"); }, {"ckpt.safetensors", "'b'"});
  expect_weights_error([&] { r.read_f32("b"); }, {"ckpt.safetensors", "'b'"});
  expect_weights_error([&] { r.read_i32("b"); }, {"ckpt.safetensors", "'b'"});
}

TEST(SafetensorsErrors, NothingToOpen) {
  const std::string dir = fresh_dir("nothing");
  expect_weights_error([&] { SafetensorsReader::open(dir); },
                       {dir, "model.safetensors.index.json", "model.safetensors", "*.safetensors"});
  expect_weights_error([&] { SafetensorsReader::open(dir + "/nope.safetensors"); }, {"nope.safetensors"});
}

// ---- malformed files ----------------------------------------------------------------------------

TEST(SafetensorsErrors, TruncatedAtSeveralCutPoints) {
  const std::string dir = fresh_dir("trunc");
  SafetensorsWriter w;
  w.add_f32("weight", {16}, std::vector<float>(16, 1.0f));
  const std::string good = dir + "/good.safetensors";
  w.write(good);
  const std::vector<uint8_t> b = read_bytes(good);
  uint64_t n = 0;
  for (int i = 0; i < 8; ++i) n |= uint64_t(b[size_t(i)]) << (8 * i);
  ASSERT_EQ(b.size(), 8 + n + 64);

  const std::string cut = dir + "/cut.safetensors";
  // Inside the length.
  for (size_t at : {size_t(0), size_t(3), size_t(7)}) {
    SCOPED_TRACE(at);
    write_bytes(cut, std::vector<uint8_t>(b.begin(), b.begin() + long(at)));
    expect_open_error(cut, {"truncated", std::to_string(at) + " bytes"});
  }
  // Inside the header.
  for (size_t at : {size_t(8), size_t(9), size_t(8 + n / 2), size_t(8 + n - 1)}) {
    SCOPED_TRACE(at);
    write_bytes(cut, std::vector<uint8_t>(b.begin(), b.begin() + long(at)));
    expect_open_error(cut,
                      {"truncated: header says " + std::to_string(n) + " bytes of JSON but the file has " +
                       std::to_string(at - 8) + " bytes after the length"});
  }
  // Inside the data (and right at its start).
  for (size_t at : {size_t(8 + n), size_t(8 + n + 1), size_t(8 + n + 63)}) {
    SCOPED_TRACE(at);
    write_bytes(cut, std::vector<uint8_t>(b.begin(), b.begin() + long(at)));
    expect_open_error(cut, {"tensor 'weight'", "data_offsets [0, 64]", "exceed"});
  }
}

TEST(SafetensorsErrors, HeaderLengthBeyondFile) {
  const std::string path = fresh_dir("hlen") + "/model.safetensors";
  write_raw(path, std::string(20, ' '), 0, 4096);
  expect_open_error(path, {"model.safetensors: truncated: header says 4096 bytes of JSON but the file has 20 "
                           "bytes after the length"});
  write_raw(path, "{}", 0, int64_t(std::numeric_limits<int64_t>::max()));
  expect_open_error(path, {"truncated"});
}

TEST(SafetensorsErrors, HeaderLengthOverLimit) {
  const std::string path = fresh_dir("hlimit") + "/big.safetensors";
  const uint64_t n = 150ull * 1000 * 1000;
  write_raw(path, "", 0, int64_t(n));
  fs::resize_file(path, 8 + n + 16);  // sparse: no real disk use
  expect_open_error(path, {"header length 150000000", "limit"});
  fs::remove(path);
}

TEST(SafetensorsErrors, BadHeaderJson) {
  const std::string dir = fresh_dir("badjson");
  write_raw(dir + "/a.safetensors", "{\"x\": {\"dtype\": \"F32\",", 0);
  expect_open_error(dir + "/a.safetensors", {"not valid JSON"});
  write_raw(dir + "/b.safetensors", "[1, 2, 3]", 0);
  expect_open_error(dir + "/b.safetensors", {"JSON object"});
  write_raw(dir + "/c.safetensors", R"({"__metadata__": {"k": 3}})", 0);
  expect_open_error(dir + "/c.safetensors", {"__metadata__", "'k'", "string"});
  write_raw(dir + "/d.safetensors", R"({"t": 5})", 0);
  expect_open_error(dir + "/d.safetensors", {"tensor 't'", "object"});
}

TEST(SafetensorsErrors, BadTensorEntries) {
  const std::string dir = fresh_dir("entries");
  struct Case {
    const char* header;
    size_t data;
    std::vector<std::string> parts;
  };
  const std::vector<Case> cases = {
      {R"({"w": {"dtype": "F64", "shape": [2], "data_offsets": [0, 16]}})",
       16,
       {"tensor 'w'", "unsupported dtype 'F64'", "BF16"}},
      {R"({"w": {"shape": [2], "data_offsets": [0, 8]}})", 8, {"tensor 'w'", "'dtype' is missing"}},
      {R"({"w": {"dtype": 4, "shape": [2], "data_offsets": [0, 8]}})", 8, {"tensor 'w'", "'dtype'"}},
      {R"({"w": {"dtype": "F32", "shape": [-2], "data_offsets": [0, 8]}})", 8, {"tensor 'w'", "'shape'"}},
      {R"({"w": {"dtype": "F32", "shape": [2.5], "data_offsets": [0, 8]}})", 8, {"tensor 'w'", "'shape'"}},
      {R"({"w": {"dtype": "F32", "shape": 2, "data_offsets": [0, 8]}})", 8, {"tensor 'w'", "'shape'"}},
      {R"({"w": {"dtype": "F32", "data_offsets": [0, 8]}})", 8, {"tensor 'w'", "'shape' is missing"}},
      {R"({"w": {"dtype": "F32", "shape": [2]}})", 8, {"tensor 'w'", "'data_offsets' is missing"}},
      {R"({"w": {"dtype": "F32", "shape": [2], "data_offsets": [0]}})", 8, {"tensor 'w'", "'data_offsets'"}},
      {R"({"w": {"dtype": "F32", "shape": [2], "data_offsets": [-1, 7]}})",
       8,
       {"tensor 'w'", "'data_offsets'"}},
      {R"({"w": {"dtype": "F32", "shape": [2], "data_offsets": [8, 0]}})", 8, {"tensor 'w'", "[8, 0]"}},
      {R"({"w": {"dtype": "F32", "shape": [2], "data_offsets": [8, 16]}})",
       8,
       {"tensor 'w'", "data_offsets [8, 16] exceed the 8 bytes"}},
      {R"({"lm_head.weight": {"dtype": "BF16", "shape": [512, 256], "data_offsets": [0, 100]}})",
       100,
       {"tensor 'lm_head.weight': data_offsets [0, 100] hold 100 bytes but shape [512, 256] of BF16 needs "
        "262144"}},
      {R"({"w": {"dtype": "F32", "shape": [4611686018427387904, 4], "data_offsets": [0, 8]}})",
       8,
       {"tensor 'w'", "too large"}},
      {R"({"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]},
           "b": {"dtype": "F32", "shape": [2], "data_offsets": [8, 16]}})",
       16,
       {"tensor 'b'", "overlap tensor 'a'"}},
  };
  for (size_t i = 0; i < cases.size(); ++i) {
    SCOPED_TRACE(cases[i].header);
    const std::string path = dir + "/case" + std::to_string(i) + ".safetensors";
    write_raw(path, cases[i].header, cases[i].data);
    expect_open_error(path, cases[i].parts);
  }
  // Gaps between tensors and zero-size tensors sharing an offset are fine.
  write_raw(dir + "/ok.safetensors",
            R"({"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]},
                "e": {"dtype": "F32", "shape": [0], "data_offsets": [4, 4]},
                "f": {"dtype": "F32", "shape": [0], "data_offsets": [4, 4]},
                "b": {"dtype": "F32", "shape": [1], "data_offsets": [8, 12]}})",
            12);
  EXPECT_EQ(SafetensorsReader::open(dir + "/ok.safetensors").names().size(), 4u);
}

// ---- sharded checkpoints ------------------------------------------------------------------------

TEST(SafetensorsErrors, MissingShard) {
  const std::string dir = fresh_dir("missing_shard");
  SafetensorsWriter w;
  w.add_f32("a", {4}, {1, 2, 3, 4});
  w.add_f32("b", {4}, {1, 2, 3, 4});
  w.write_sharded(dir, 16);
  fs::remove(dir + "/model-00002-of-00002.safetensors");
  expect_weights_error([&] { SafetensorsReader::open(dir); }, {"model-00002-of-00002.safetensors", "'b'"});
}

TEST(SafetensorsErrors, IndexedTensorAbsentFromShard) {
  const std::string dir = fresh_dir("absent");
  SafetensorsWriter w;
  w.add_f32("a", {4}, {1, 2, 3, 4});
  w.write_sharded(dir, 1 << 20);
  json idx = json::parse(std::ifstream(dir + "/model.safetensors.index.json"));
  idx["weight_map"]["ghost"] = "model-00001-of-00001.safetensors";
  std::ofstream(dir + "/model.safetensors.index.json") << idx.dump();
  expect_weights_error([&] { SafetensorsReader::open(dir); },
                       {"model-00001-of-00001.safetensors", "'ghost'"});
}

TEST(SafetensorsErrors, BadIndexFile) {
  const std::string dir = fresh_dir("badindex");
  std::ofstream(dir + "/model.safetensors.index.json") << "{\"weight_map\": ";
  expect_weights_error([&] { SafetensorsReader::open(dir); }, {"model.safetensors.index.json", "JSON"});
  std::ofstream(dir + "/model.safetensors.index.json") << "{\"metadata\": {}}";
  expect_weights_error([&] { SafetensorsReader::open(dir); }, {"model.safetensors.index.json", "weight_map"});
}

TEST(SafetensorsWriterErrors, SizeMismatchAndDuplicates) {
  SafetensorsWriter w;
  expect_weights_error([&] { w.add("x", StDType::F32, {3}, std::vector<uint8_t>(8)); }, {"'x'", "needs 12"});
  expect_weights_error([&] { w.add_bf16("y", {2, 2}, {1, 2, 3}); }, {"'y'", "3 values"});
  w.add_f32("z", {1}, {1});
  expect_weights_error([&] { w.add_f32("z", {1}, {1}); }, {"'z'", "twice"});
  EXPECT_THROW(w.write("/nonexistent-dir-for-test/x.safetensors"), Error);
}

}  // namespace
}  // namespace dsv4

namespace {
// Files we write must be readable by other safetensors implementations, which require the data of
// the tensors to be contiguous (no gaps) and to cover the whole data section.
TEST(SafetensorsLayout, WrittenDataIsContiguous) {
  const dsv4::test::TempDir tmp;
  const std::string path = tmp / "contig.safetensors";
  dsv4::SafetensorsWriter w;
  w.add_bf16("b", {3}, {1, 2, 3});
  w.add_f32("a", {1}, {1});
  w.add_i32("c", {3}, {1, 2, 3});
  w.add("d", dsv4::StDType::F8_E4M3, {5}, std::vector<uint8_t>(5, 0x38));
  w.add("e", dsv4::StDType::I64, {1}, std::vector<uint8_t>(8, 0));
  w.write(path);
  std::ifstream f(path, std::ios::binary);
  uint64_t n = 0;
  f.read(reinterpret_cast<char*>(&n), 8);
  EXPECT_EQ((8 + n) % 8, 0u);
  std::string header(n, ' ');
  f.read(header.data(), std::streamsize(n));
  const auto h = nlohmann::json::parse(header);
  std::vector<std::pair<uint64_t, uint64_t>> ranges;
  for (const auto& [name, v] : h.items())
    if (name != "__metadata__") ranges.push_back({v["data_offsets"][0], v["data_offsets"][1]});
  std::sort(ranges.begin(), ranges.end());
  uint64_t at = 0;
  for (const auto& [b, e] : ranges) {
    EXPECT_EQ(b, at);
    at = e;
  }
  f.seekg(0, std::ios::end);
  EXPECT_EQ(uint64_t(f.tellg()), 8 + n + at);
  const auto r = dsv4::SafetensorsReader::open(path);
  EXPECT_EQ(r.read_f32("b"), (std::vector<float>{1, 2, 3}));
}
}  // namespace
