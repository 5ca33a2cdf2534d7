// Units of the capture side that need no trace file: the capture policy, row digests against
// libxxhash on hand-built little-endian bytes, the model digest, the environment fingerprint.
#include <xxhash.h>

#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <limits>

#include <unistd.h>

#include "capture/digest.h"
#include "capture/env.h"
#include "capture/policy.h"
#include "kernels/reduce.h"
#include "model/config.h"
#include "model/error.h"
#include "model/forward.h"
#include "model/tokens.h"
#include "model/weights.h"
#include "test_util.h"

namespace dsv4 {
namespace {

// ---- capture policy ---------------------------------------------------------------------------

TEST(CapturePolicy, DecisionsKeepsNoTensor) {
  const CapturePolicy p = CapturePolicy::parse("decisions");
  EXPECT_EQ(p.text(), "decisions");
  EXPECT_FALSE(p.full());
  for (const char* name : {"embed", "attn.q", "moe.out", "logits"})
    for (int layer : {-1, 0, 3}) EXPECT_FALSE(p.wants_tensor(name, layer)) << name << " " << layer;
}

TEST(CapturePolicy, DefaultIsDecisions) {
  const CapturePolicy p;
  EXPECT_EQ(p.text(), "decisions");
  EXPECT_FALSE(p.full());
  EXPECT_FALSE(p.wants_tensor("attn.q", 0));
}

TEST(CapturePolicy, FullKeepsEveryTensor) {
  const CapturePolicy p = CapturePolicy::parse("full");
  EXPECT_TRUE(p.full());
  for (const char* name : {"embed", "attn.q", "moe.out", "logits", "anything"})
    for (int layer : {-1, 0, 5}) EXPECT_TRUE(p.wants_tensor(name, layer)) << name << " " << layer;
}

TEST(CapturePolicy, PatternsAndRanges) {
  const CapturePolicy p = CapturePolicy::parse("attn.*@3-5,moe.out");
  EXPECT_FALSE(p.full());
  EXPECT_EQ(p.text(), "attn.*@3-5,moe.out");
  EXPECT_FALSE(p.wants_tensor("attn.q", 2));
  EXPECT_TRUE(p.wants_tensor("attn.q", 3));
  EXPECT_TRUE(p.wants_tensor("attn.compressed_kv", 4));
  EXPECT_TRUE(p.wants_tensor("attn.hc_post", 5));
  EXPECT_FALSE(p.wants_tensor("attn.q", 6));
  EXPECT_FALSE(p.wants_tensor("ffn.norm", 4));
  EXPECT_FALSE(p.wants_tensor("indexer.q", 4));
  // No range: every layer.
  for (int layer : {0, 1, 7, 60}) EXPECT_TRUE(p.wants_tensor("moe.out", layer));
  EXPECT_FALSE(p.wants_tensor("moe.router_logits", 1));
}

TEST(CapturePolicy, WildcardsMatchAnyRun) {
  const CapturePolicy p = CapturePolicy::parse("*.hc_*,indexer.*e*");
  EXPECT_TRUE(p.wants_tensor("attn.hc_pre", 0));
  EXPECT_TRUE(p.wants_tensor("ffn.hc_post", 2));
  EXPECT_FALSE(p.wants_tensor("head.hc", -1));  // no "_" after "hc"
  EXPECT_TRUE(p.wants_tensor("indexer.weights", 1));
  EXPECT_TRUE(p.wants_tensor("indexer.score", 1));
  EXPECT_FALSE(p.wants_tensor("indexer.q", 1));
  EXPECT_FALSE(p.wants_tensor("indexer.k", 1));
  const CapturePolicy star = CapturePolicy::parse("*");
  EXPECT_FALSE(star.full());
  EXPECT_TRUE(star.wants_tensor("logits", -1));
  EXPECT_TRUE(star.wants_tensor("attn.q", 4));
}

TEST(CapturePolicy, ModelLevelTensorsOnlyWithoutRange) {
  const CapturePolicy no_range = CapturePolicy::parse("logits,embed");
  EXPECT_TRUE(no_range.wants_tensor("logits", -1));
  EXPECT_TRUE(no_range.wants_tensor("embed", -1));
  EXPECT_FALSE(no_range.wants_tensor("head.norm", -1));
  const CapturePolicy ranged = CapturePolicy::parse("*@0-100");
  EXPECT_TRUE(ranged.wants_tensor("attn.q", 0));
  EXPECT_TRUE(ranged.wants_tensor("attn.q", 100));
  EXPECT_FALSE(ranged.wants_tensor("attn.q", 101));
  EXPECT_FALSE(ranged.wants_tensor("logits", -1));
  EXPECT_FALSE(ranged.wants_tensor("embed", -1));
  const CapturePolicy single = CapturePolicy::parse("attn.q@2");
  EXPECT_TRUE(single.wants_tensor("attn.q", 2));
  EXPECT_FALSE(single.wants_tensor("attn.q", 1));
  EXPECT_FALSE(single.wants_tensor("attn.q", 3));
  EXPECT_FALSE(single.wants_tensor("attn.q", -1));
}

TEST(CapturePolicy, KeywordsCombineWithItems) {
  const CapturePolicy p = CapturePolicy::parse("decisions, moe.out@1");
  EXPECT_FALSE(p.full());
  EXPECT_TRUE(p.wants_tensor("moe.out", 1));
  EXPECT_FALSE(p.wants_tensor("moe.out", 0));
}

// The message of the InputError that parse(text) throws ("" if it does not throw).
std::string parse_error(const std::string& text) {
  try {
    CapturePolicy::parse(text);
  } catch (const InputError& e) {
    return e.what();
  }
  return "";
}

TEST(CapturePolicy, Errors) {
  EXPECT_EQ(parse_error("attn.*@5-3"), "capture policy 'attn.*@5-3': layer range 5-3 is empty");
  EXPECT_EQ(parse_error("attn.q,,moe.out"), "capture policy 'attn.q,,moe.out': unknown item ''");
  EXPECT_EQ(parse_error(""), "capture policy '': unknown item ''");
  EXPECT_EQ(parse_error("attn.q,"), "capture policy 'attn.q,': unknown item ''");
  for (const char* bad :
       {"attn.q@x", "attn.q@1-", "attn.q@-1", "attn.q@", "attn.q@1-2-3", "attn.q@a-b", "attn.q@+2"}) {
    const std::string msg = parse_error(bad);
    EXPECT_NE(msg.find(std::string("capture policy '") + bad + "'"), std::string::npos) << bad << ": " << msg;
    EXPECT_NE(msg.find("layer range"), std::string::npos) << bad << ": " << msg;
  }
  const std::string unknown = parse_error("atn.q@1");
  EXPECT_NE(unknown.find("unknown item 'atn.q@1'"), std::string::npos) << unknown;
  EXPECT_NE(unknown.find("attn.q"), std::string::npos) << "lists the known names: " << unknown;
  EXPECT_NE(parse_error("attn q").find("unknown item 'attn q'"), std::string::npos);
  EXPECT_NE(parse_error("@3").find("no tensor name"), std::string::npos);
  EXPECT_NE(parse_error("decision").find("unknown item 'decision'"), std::string::npos);
}

// ---- row digests ------------------------------------------------------------------------------

// Little-endian bytes built by shifts, independent of the host's byte order and of the code under test.
void put_le(std::vector<uint8_t>& out, uint32_t v, int bytes) {
  for (int b = 0; b < bytes; ++b) out.push_back(uint8_t(v >> (8 * b)));
}
uint32_t bits_of(float x) {
  uint32_t u;
  std::memcpy(&u, &x, 4);
  return u;
}

// Expected row digests: XXH3_64bits over the hand-built bytes of each row.
std::vector<uint64_t> expected_rows(const std::vector<uint8_t>& bytes, int64_t rows) {
  std::vector<uint64_t> out;
  const size_t row_bytes = rows ? bytes.size() / size_t(rows) : 0;
  for (int64_t r = 0; r < rows; ++r)
    out.push_back(XXH3_64bits(bytes.data() + size_t(r) * row_bytes, row_bytes));
  return out;
}

TEST(Digest, Xxh3MatchesLibrary) {
  const std::string s = "dsv4-trace";
  EXPECT_EQ(xxh3_64(s.data(), s.size()), XXH3_64bits(s.data(), s.size()));
  EXPECT_EQ(xxh3_64(nullptr, 0), XXH3_64bits(nullptr, 0));
}

TEST(Digest, Bf16RowsAreTwoBytePatterns) {
  auto g = test::rng_for("Digest.Bf16Rows");
  for (int64_t elems : {1, 2, 3, 7, 8, 15, 16, 17, 31, 63, 64, 65, 127, 129, 240, 257}) {
    for (int offset : {0, 1, 3}) {  // odd starting addresses of the data
      const int64_t rows = 5;
      std::vector<float> buf = test::randn_bf16(g, size_t(offset + rows * elems));
      buf[size_t(offset)] = -0.0f;
      if (rows * elems > 2) buf[size_t(offset + 2)] = std::numeric_limits<float>::infinity();
      TensorRecord t;
      t.dtype = DType::bf16;
      t.shape = {rows, elems};
      t.host = buf.data() + offset;
      std::vector<uint8_t> bytes;
      for (int64_t i = 0; i < rows * elems; ++i) put_le(bytes, bits_of(buf[size_t(offset + i)]) >> 16, 2);
      EXPECT_EQ(storage_bytes(t), bytes) << elems << " " << offset;
      EXPECT_EQ(digest_rows(t), expected_rows(bytes, rows)) << elems << " " << offset;
    }
  }
}

TEST(Digest, F32AndI32RowsAreFourByteValues) {
  auto g = test::rng_for("Digest.F32I32Rows");
  std::uniform_int_distribution<int32_t> di(INT32_MIN, INT32_MAX);
  std::normal_distribution<float> df(0.0f, 3.0f);
  for (int64_t elems : {1, 2, 3, 5, 8, 13, 16, 33, 64, 100, 255, 1000}) {
    for (int offset : {0, 1, 2, 3}) {
      const int64_t rows = 4;
      std::vector<float> f(size_t(offset + rows * elems));
      std::vector<int32_t> i(f.size());
      for (auto& x : f) x = df(g);  // not bf16-exact: f32 rows are hashed as they are
      for (auto& x : i) x = di(g);
      TensorRecord tf;
      tf.dtype = DType::f32;
      tf.shape = {rows, elems};
      tf.host = f.data() + offset;
      TensorRecord ti = tf;
      ti.dtype = DType::i32;
      ti.host = i.data() + offset;
      std::vector<uint8_t> bf, bi;
      for (int64_t k = 0; k < rows * elems; ++k) {
        put_le(bf, bits_of(f[size_t(offset + k)]), 4);
        put_le(bi, uint32_t(i[size_t(offset + k)]), 4);
      }
      EXPECT_EQ(storage_bytes(tf), bf);
      EXPECT_EQ(storage_bytes(ti), bi);
      EXPECT_EQ(digest_rows(tf), expected_rows(bf, rows)) << elems << " " << offset;
      EXPECT_EQ(digest_rows(ti), expected_rows(bi, rows)) << elems << " " << offset;
    }
  }
}

TEST(Digest, RowShapes) {
  // Higher-rank tensors: a row is shape[1:]; rank 1: a row is one value; rank 0: one row of one value.
  auto g = test::rng_for("Digest.RowShapes");
  std::vector<float> v = test::randn_bf16(g, 2 * 3 * 4);
  TensorRecord t;
  t.dtype = DType::f32;
  t.host = v.data();
  std::vector<uint8_t> bytes;
  for (float x : v) put_le(bytes, bits_of(x), 4);
  t.shape = {2, 3, 4};
  EXPECT_EQ(digest_rows(t), expected_rows(bytes, 2));
  t.shape = {24};
  EXPECT_EQ(digest_rows(t), expected_rows(bytes, 24));
  t.shape = {};
  EXPECT_EQ(digest_rows(t), std::vector<uint64_t>{XXH3_64bits(bytes.data(), 4)});
  t.shape = {0, 7};
  EXPECT_TRUE(digest_rows(t).empty());
  EXPECT_TRUE(storage_bytes(t).empty());
}

TEST(Digest, LargeTensorsMatchRowByRow) {
  // Big enough for the parallel path (several MiB).
  auto g = test::rng_for("Digest.Large");
  const int64_t rows = 700, elems = 2048 + 3;
  std::vector<float> v = test::randn_bf16(g, size_t(rows * elems));
  for (DType dt : {DType::bf16, DType::f32}) {
    TensorRecord t;
    t.dtype = dt;
    t.shape = {rows, elems};
    t.host = v.data();
    std::vector<uint8_t> bytes;
    for (float x : v)
      put_le(bytes, dt == DType::bf16 ? bits_of(x) >> 16 : bits_of(x), dt == DType::bf16 ? 2 : 4);
    EXPECT_EQ(digest_rows(t), expected_rows(bytes, rows)) << to_string(dt);
  }
}

// A tensor left in device memory: the values arrive through TensorRecord::fetch, on the first call of
// data() only; backend-computed row digests are taken as they are, without fetching anything.
class CountingFetch : public TensorFetch {
 public:
  explicit CountingFetch(const std::vector<float>& v) : v_(v) {}
  const void* fetch() override {
    ++calls;
    if (copy_.empty()) copy_ = v_;  // the "download"
    return copy_.data();
  }
  int calls = 0;

 private:
  const std::vector<float>& v_;
  std::vector<float> copy_;
};

TEST(Digest, DeviceTensorsAreFetchedOnlyWhenNeeded) {
  auto g = test::rng_for("Digest.Device");
  std::vector<float> v = test::randn_bf16(g, 5 * 33);
  TensorRecord host;
  host.dtype = DType::bf16;
  host.shape = {5, 33};
  host.host = v.data();
  const std::vector<uint64_t> want = digest_rows(host);

  CountingFetch fetch(v);
  TensorRecord dev = host;
  dev.host = nullptr;
  dev.fetch = &fetch;
  EXPECT_EQ(digest_rows(dev), want);  // no backend digests: hashed from the fetched values
  EXPECT_EQ(storage_bytes(dev), storage_bytes(host));
  EXPECT_GE(fetch.calls, 1);

  CountingFetch untouched(v);
  std::vector<uint64_t> backend = want;
  backend[2] ^= 1;  // recognisably the backend's, not recomputed
  dev.fetch = &untouched;
  dev.row_digests = backend.data();
  EXPECT_EQ(digest_rows(dev), backend);
  EXPECT_EQ(untouched.calls, 0);
}

TEST(Digest, Hex16) {
  EXPECT_EQ(hex16(0), "0000000000000000");
  EXPECT_EQ(hex16(0x1234abcdULL), "000000001234abcd");
  EXPECT_EQ(hex16(~0ULL), "ffffffffffffffff");
}

// ---- model digest -----------------------------------------------------------------------------

TEST(ModelDigest, SortedNamesAndStorageDtypes) {
  const Weights w = Weights::init(preset("tiny"), 7);
  const ModelDigest d = model_digest(w);
  ASSERT_EQ(d.names.size(), w.tensors().size());
  ASSERT_EQ(d.digests.size(), d.names.size());
  EXPECT_TRUE(std::is_sorted(d.names.begin(), d.names.end()));
  bool saw_bf16 = false, saw_f32 = false, saw_i32 = false;
  std::vector<uint8_t> whole;
  for (size_t k = 0; k < d.names.size(); ++k) {
    const WeightTensor& t = w.get(d.names[k]);
    std::vector<uint8_t> bytes;
    if (t.dtype == StDType::BF16) {
      saw_bf16 = true;
      for (float x : t.f) put_le(bytes, bits_of(x) >> 16, 2);
    } else if (t.dtype == StDType::F32) {
      saw_f32 = true;
      for (float x : t.f) put_le(bytes, bits_of(x), 4);
    } else {
      saw_i32 = true;
      for (int32_t x : t.i) put_le(bytes, uint32_t(x), 4);
    }
    EXPECT_EQ(d.digests[k], XXH3_64bits(bytes.data(), bytes.size())) << d.names[k];
    whole.insert(whole.end(), d.names[k].begin(), d.names[k].end());
    whole.push_back(0);
    for (int b = 0; b < 8; ++b) whole.push_back(uint8_t(d.digests[k] >> (8 * b)));
  }
  EXPECT_TRUE(saw_bf16 && saw_f32 && saw_i32);
  EXPECT_EQ(d.whole, XXH3_64bits(whole.data(), whole.size()));
  EXPECT_EQ(model_digest(Weights::init(preset("tiny"), 7)).whole, d.whole);
  EXPECT_NE(model_digest(Weights::init(preset("tiny"), 8)).whole, d.whole);
}

TEST(ModelDigest, SameAfterSaveAndLoad) {
  const Weights w = Weights::init(preset("tiny"), 7);
  const auto dir = std::filesystem::temp_directory_path() / ("dsv4_digest_" + std::to_string(::getpid()));
  w.save(dir.string());
  const Weights back = Weights::load(preset("tiny"), dir.string());
  std::filesystem::remove_all(dir);
  const ModelDigest a = model_digest(w), b = model_digest(back);
  EXPECT_EQ(a.names, b.names);
  EXPECT_EQ(a.digests, b.digests);
  EXPECT_EQ(a.whole, b.whole);
}

// A rank of expert parallelism loads its own experts only (model/weights.h only_experts): from a
// checkpoint (each left-out tensor checked, digested and dropped) and from a preset (keep_only), the
// model digest and every per-tensor digest stay the whole model's; the left-out tensors are named when
// asked for, and a single-device MoE refuses weights that lack experts, naming the layer.
TEST(ModelDigest, OwnExpertsOnlyKeepTheWholeModelsDigest) {
  const ModelConfig c = preset("tiny-b");
  const Weights w = Weights::init(c, 7);
  const auto dir = std::filesystem::temp_directory_path() / ("dsv4_own_" + std::to_string(::getpid()));
  w.save(dir.string());
  const ModelDigest whole = model_digest(w);
  const WeightFilter own = only_experts(2, 4);
  Weights preset_part = Weights::init(c, 7);
  preset_part.keep_only(own);
  const Weights loaded_part = Weights::load(c, dir.string(), own);
  std::filesystem::remove_all(dir);
  for (const Weights* part : std::vector<const Weights*>{&preset_part, &loaded_part}) {
    const ModelDigest d = model_digest(*part);
    EXPECT_EQ(d.names, whole.names);
    EXPECT_EQ(d.digests, whole.digests);
    EXPECT_EQ(d.whole, whole.whole);
    EXPECT_LT(part->loaded_bytes(), w.loaded_bytes());
    int kept = 0;
    for (const auto& [name, t] : w.tensors()) {
      const ParamSite s = param_site(name);
      const bool mine = s.expert < 0 || (s.expert >= 2 && s.expert < 4);
      EXPECT_EQ(part->has(name), mine) << name;
      EXPECT_EQ(part->absent().count(name) == 1, !mine) << name;
      kept += mine;
    }
    EXPECT_EQ(int(part->tensors().size()), kept);
    try {
      part->get("model.layers.0.mlp.experts.5.down_proj.weight");
      ADD_FAILURE() << "a left-out expert was returned";
    } catch (const WeightsError& e) {
      EXPECT_NE(std::string(e.what()).find("'model.layers.0.mlp.experts.5.down_proj.weight' was not loaded by this "
                                           "process"),
                std::string::npos)
          << e.what();
    }
  }
  try {
    forward(loaded_part, {random_tokens(12, c.vocab_size, 1)}, RunOptions{});
    ADD_FAILURE() << "a forward ran without every expert";
  } catch (const InputError& e) {
    EXPECT_NE(std::string(e.what()).find("layer 0: the MoE needs experts 0..5 but this process loaded experts 2..3 only"),
              std::string::npos)
        << e.what();
  }
}

TEST(ModelDigest, OneUlpChangesOneTensor) {
  Weights w = Weights::init(preset("tiny"), 7);
  const ModelDigest before = model_digest(w);
  // The weights expose no mutable access; `w` itself is not const, so modifying it through the map
  // is well-defined.
  auto& tensors = const_cast<std::map<std::string, WeightTensor>&>(w.tensors());
  const std::string bf16_name = "model.embed_tokens.weight";
  ASSERT_EQ(tensors.at(bf16_name).dtype, StDType::BF16);
  {
    float& x = tensors.at(bf16_name).f[17];
    x = num::bf16_to_f32(uint16_t(num::bf16_bits(x) + 1));  // next bf16 value
  }
  const ModelDigest after = model_digest(w);
  EXPECT_NE(after.whole, before.whole);
  for (size_t k = 0; k < before.names.size(); ++k) {
    if (before.names[k] == bf16_name)
      EXPECT_NE(after.digests[k], before.digests[k]);
    else
      EXPECT_EQ(after.digests[k], before.digests[k]) << before.names[k];
  }
  // An fp32 tensor by one fp32 ulp.
  std::string f32_name;
  for (auto& [name, t] : tensors)
    if (t.dtype == StDType::F32 && f32_name.empty()) f32_name = name;
  ASSERT_FALSE(f32_name.empty());
  float& y = tensors.at(f32_name).f[0];
  y = std::nextafter(y, std::numeric_limits<float>::infinity());
  const ModelDigest after2 = model_digest(w);
  EXPECT_NE(after2.whole, after.whole);
  size_t changed = 0;
  for (size_t k = 0; k < after.names.size(); ++k) changed += after2.digests[k] != after.digests[k];
  EXPECT_EQ(changed, 1u);
}

// ---- environment ------------------------------------------------------------------------------

TEST(Env, EveryKeyOfTheFormat) {
  const EnvFingerprint e = environment_fingerprint();
  for (const char* key : {"host", "os", "machine", "isa", "cpu_model", "cpu_flags", "compiler",
                          "compile_flags", "build_id", "gpu", "gpu_arch", "tensor_core_revision",
                          "gpu_driver", "cuda", "cupti", "nccl", "hdf5", "deflate", "threads"}) {
    ASSERT_TRUE(e.count(key)) << key;
    EXPECT_FALSE(e.at(key).empty()) << key;
  }
  EXPECT_EQ(e.size(), 19u);
  // Every build records its tensor-core kernels' revision, a CPU build too (it names the bits such a
  // build's GPU kernels compute; a trace of it holds no fast step).
  EXPECT_EQ(e.at("tensor_core_revision"), std::to_string(kTensorCoreRevision));
  EXPECT_TRUE(e.at("gpu_arch") == "none" || e.at("gpu_arch").rfind("sm_", 0) == 0) << e.at("gpu_arch");
  EXPECT_EQ(e.at("gpu_arch"), gpu_arch());
  // The build's instruction set, as the compiler targets it (the default build is x86-64-v3).
#if defined(__x86_64__) && defined(__AVX2__) && defined(__FMA__) && defined(__BMI2__)
  EXPECT_EQ(e.at("isa"), "x86-64-v3");
#elif defined(__x86_64__)
  EXPECT_EQ(e.at("isa"), "x86-64");
#elif defined(__aarch64__)
  EXPECT_EQ(e.at("isa"), "aarch64");
#endif
  EXPECT_NE(e.at("machine"), "none");
  const std::string where = machine_summary(e);
  EXPECT_EQ(where.rfind(e.at("isa") + " build on " + e.at("machine"), 0), 0u) << where;
  EXPECT_EQ(machine_summary({}), "an unrecorded machine");  // a trace written before these keys
  EXPECT_TRUE(e.at("deflate") == "isa-l igzip level 1" || e.at("deflate") == "zlib level 4" ||
              e.at("deflate") == "none")
      << e.at("deflate");
  EXPECT_EQ(e.at("hdf5").rfind("1.", 0), 0u) << e.at("hdf5");
  EXPECT_GE(std::atoi(e.at("threads").c_str()), 1);
  EXPECT_EQ(e.at("threads"), std::to_string(std::atoi(e.at("threads").c_str())));
  EXPECT_NE(e.at("os"), "none");
  EXPECT_EQ(environment_fingerprint(), e);  // stable within a process
}

}  // namespace
}  // namespace dsv4
