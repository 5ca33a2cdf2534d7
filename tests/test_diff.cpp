// The trace diff (replay/diff.h): a trace against itself is perfect agreement; train vs rollout
// traces of the same tokens match an independent computation made here straight from the HDF5
// datasets (decoding traces/FORMAT.md by hand, not through TraceReader); bad pairs are refused; the
// JSON and CSV outputs carry the documented fields.
#include <gtest/gtest.h>
#include <hdf5.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "capture/policy.h"
#include "capture/trace_reader.h"
#include "capture/trace_writer.h"
#include "model/decision_sets.h"
#include "model/error.h"
#include "model/forward.h"
#include "model/profile.h"
#include "model/tokens.h"
#include "model/weights.h"
#include "replay/diff.h"
#include "tiny_model.h"

namespace dsv4 {
namespace {

namespace fs = std::filesystem;

using test::tiny;

// Two sequences: one long enough for several compressed groups of the C4 layers and one C128 group,
// and a short one (batch composition must not matter).
std::vector<std::vector<int32_t>> batch() {
  return {random_tokens(150, 512, 21), random_tokens(60, 512, 22)};
}

// A directory of this test process, removed when the process exits.
struct ScratchDir {
  fs::path path;
  ScratchDir() : path(fs::path(::testing::TempDir()) / ("dsv4_diff_" + std::to_string(::getpid()))) {
    fs::remove_all(path);
    fs::create_directories(path);
  }
  ~ScratchDir() {
    std::error_code ec;
    fs::remove_all(path, ec);
  }
};

std::string dir() {
  static const ScratchDir d;
  return d.path.string();
}

void record(const std::string& path, const Weights& w, const std::string& profile, const std::string& policy,
            const std::vector<std::vector<int32_t>>& seqs) {
  TraceWriter::Options o;
  o.policy = CapturePolicy::parse(policy);
  auto tw = TraceWriter::create(path, w.config(), make_trace_header(w), o);
  StepSpec s;
  s.kind = profile;
  s.profile = profile;
  s.seqs = seqs;
  RunOptions ro;
  ro.profile = profile_by_name(profile);
  ro.threads = 1;  // results do not depend on it; one thread keeps a loaded machine from oversubscribing
  ro.observer = &tw->begin_step(s);
  tw->end_step(forward(w, seqs, ro));
  tw->close();
}

// Traces are recorded on first use, once per test process (ctest runs each test in its own).
std::string trace(const std::string& name) {
  static std::map<std::string, std::string> made;
  if (auto it = made.find(name); it != made.end()) return it->second;
  const std::string path = dir() + "/" + name + ".h5";
  if (name == "train_full") {
    record(path, tiny(), "train", "full", batch());
  } else if (name == "rollout_full") {
    record(path, tiny(), "rollout", "full", batch());
  } else if (name == "train_dec") {
    record(path, tiny(), "train", "decisions", batch());
  } else if (name == "rollout_dec") {
    record(path, tiny(), "rollout", "decisions", batch());
  } else if (name == "other_tokens") {
    auto b = batch();
    b[1][17] = (b[1][17] + 1) % 512;
    record(path, tiny(), "train", "decisions", b);
  } else if (name == "other_model") {
    record(path, Weights::init(preset("tiny"), 8), "train", "decisions", batch());
  } else {
    ADD_FAILURE() << "unknown trace " << name;
  }
  made[name] = path;
  return path;
}

// ---- raw HDF5 access (the independent side) --------------------------------------------------------

struct File {
  hid_t id = -1;
  explicit File(const std::string& path) : id(H5Fopen(path.c_str(), H5F_ACC_RDONLY, H5P_DEFAULT)) {
    if (id < 0) throw std::runtime_error("cannot open " + path);
  }
  ~File() {
    if (id >= 0) H5Fclose(id);
  }
  File(const File&) = delete;
  File& operator=(const File&) = delete;

  bool exists(const std::string& path) const {
    std::string prefix;
    size_t pos = 1;
    while (pos <= path.size()) {
      const size_t next = path.find('/', pos);
      prefix = path.substr(0, next);
      if (H5Lexists(id, prefix.c_str(), H5P_DEFAULT) <= 0) return false;
      if (next == std::string::npos) break;
      pos = next + 1;
    }
    return true;
  }

  // Reads a whole dataset converted by HDF5 to the memory type of T.
  template <typename T>
  std::vector<T> read(const std::string& path, hid_t mem) const {
    const hid_t d = H5Dopen2(id, path.c_str(), H5P_DEFAULT);
    if (d < 0) throw std::runtime_error("no dataset " + path);
    const hid_t sp = H5Dget_space(d);
    std::vector<T> v(size_t(H5Sget_simple_extent_npoints(sp)));
    herr_t rc = 0;
    if (!v.empty()) rc = H5Dread(d, mem, H5S_ALL, H5S_ALL, H5P_DEFAULT, v.data());
    H5Sclose(sp);
    H5Dclose(d);
    if (rc < 0) throw std::runtime_error("cannot read " + path);
    return v;
  }
  std::vector<uint32_t> u32(const std::string& p) const { return read<uint32_t>(p, H5T_NATIVE_UINT32); }
  std::vector<int32_t> i32(const std::string& p) const { return read<int32_t>(p, H5T_NATIVE_INT32); }
  std::vector<int64_t> i64(const std::string& p) const { return read<int64_t>(p, H5T_NATIVE_INT64); }
  std::vector<uint64_t> u64(const std::string& p) const { return read<uint64_t>(p, H5T_NATIVE_UINT64); }
  std::vector<float> f32(const std::string& p) const { return read<float>(p, H5T_NATIVE_FLOAT); }

  std::vector<std::string> strings(const std::string& path) const {
    const hid_t d = H5Dopen2(id, path.c_str(), H5P_DEFAULT);
    const hid_t sp = H5Dget_space(d);
    const hid_t t = H5Tcopy(H5T_C_S1);
    H5Tset_size(t, H5T_VARIABLE);
    H5Tset_cset(t, H5T_CSET_UTF8);
    std::vector<char*> raw(size_t(H5Sget_simple_extent_npoints(sp)));
    H5Dread(d, t, H5S_ALL, H5S_ALL, H5P_DEFAULT, raw.data());
    std::vector<std::string> out(raw.begin(), raw.end());
    H5Dvlen_reclaim(t, sp, H5P_DEFAULT, raw.data());
    H5Tclose(t);
    H5Sclose(sp);
    H5Dclose(d);
    return out;
  }

  uint8_t attr_u8(const std::string& obj, const std::string& name) const {
    uint8_t v = 0;
    const hid_t a = H5Aopen_by_name(id, obj.c_str(), name.c_str(), H5P_DEFAULT, H5P_DEFAULT);
    H5Aread(a, H5T_NATIVE_UINT8, &v);
    H5Aclose(a);
    return v;
  }
};

std::string seq_path(int s) {
  char b[64];
  std::snprintf(b, sizeof b, "/steps/000000/seq_%03d", s);
  return b;
}
std::string layer_dir(int layer) {
  char b[32];
  std::snprintf(b, sizeof b, "layer_%03d", layer);
  return b;
}

// FORMAT.md "Compact encoding": per row, ids = cumsum(gap + 1) − 1.
std::vector<std::vector<int64_t>> decode_indexer(const std::vector<uint32_t>& count,
                                                 const std::vector<uint32_t>& gaps) {
  std::vector<std::vector<int64_t>> rows;
  size_t at = 0;
  for (uint32_t n : count) {
    std::vector<int64_t> ids;
    int64_t prev = -1;
    for (uint32_t j = 0; j < n; ++j) {
      prev = prev + int64_t(gaps.at(at++)) + 1;
      ids.push_back(prev);
    }
    rows.push_back(ids);
  }
  EXPECT_EQ(at, gaps.size()) << "indexer_gaps holds more ids than the counts";
  return rows;
}

size_t common(const std::vector<int64_t>& a, const std::vector<int64_t>& b) {
  std::set<int64_t> sb(b.begin(), b.end());
  size_t n = 0;
  for (int64_t x : a) n += sb.count(x);
  return n;
}

double median_abs_finite(const std::vector<float>& a, const std::vector<float>& b) {
  std::vector<double> m;
  for (const auto* v : {&a, &b})
    for (float x : *v)
      if (std::isfinite(x)) m.push_back(std::fabs(double(x)));
  if (m.empty()) return 0;
  std::sort(m.begin(), m.end());
  return m[m.size() / 2];
}

float bf16_to_float(uint16_t u) {
  const uint32_t bits = uint32_t(u) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// What the diff must report for one layer, computed from the raw datasets of both files.
struct Expected {
  bool has_indexer = false;
  double overlap_mean = 0, overlap_min = 1;
  int64_t idx_differ = 0, idx_tie = 0, idx_conf = 0;
  double exact = 0, jaccard = 0;
  int64_t rt_differ = 0, rt_tie = 0, rt_conf = 0;
  bool hashed = false;
  double pre = 0, post = 0, comb = 0;
  int64_t out_differ = 0;
  double share = 0;
};

// Digest records of one sequence as (layer, name) → (first, rows), plus the execution order.
struct RawDigests {
  std::vector<std::pair<int, std::string>> order;
  std::map<std::pair<int, std::string>, std::pair<int64_t, int64_t>> where;
  std::vector<uint64_t> value;
};
RawDigests raw_digests(const File& f, int s) {
  const auto names = f.strings("/meta/tensor_names");
  const std::string g = seq_path(s) + "/digests/";
  const auto tensor = f.i32(g + "tensor");
  const auto layer = f.i32(g + "layer");
  const auto rows = f.i64(g + "rows");
  RawDigests d;
  d.value = f.u64(g + "value");
  int64_t first = 0;
  for (size_t i = 0; i < tensor.size(); ++i) {
    const std::pair<int, std::string> key{layer[i], names.at(size_t(tensor[i]))};
    d.order.push_back(key);
    d.where[key] = {first, rows[i]};
    first += rows[i];
  }
  EXPECT_EQ(size_t(first), d.value.size());
  return d;
}

Expected expected_layer(const File& fa, const File& fb, int layer, int seqs, double factor, bool use_full) {
  Expected e;
  std::vector<std::vector<int64_t>> ia, ib, ra, rb;
  std::vector<float> ima, imb, rma, rmb;
  std::vector<std::pair<int, int64_t>> iw, rw;
  std::vector<std::vector<char>> agree(static_cast<size_t>(seqs));
  for (int s = 0; s < seqs; ++s) {
    const std::string d = seq_path(s) + "/decisions/" + layer_dir(layer) + "/";
    const int64_t T = int64_t(fa.i32(seq_path(s) + "/tokens").size());
    agree[size_t(s)].assign(size_t(T), 1);
    if (fa.exists(d + "indexer_count")) {
      e.has_indexer = true;
      for (const File* f : {&fa, &fb}) {
        auto rows = decode_indexer(f->u32(d + "indexer_count"), f->u32(d + "indexer_gaps"));
        auto m = f->f32(d + "indexer_margin");
        auto& dst = f == &fa ? ia : ib;
        auto& md = f == &fa ? ima : imb;
        dst.insert(dst.end(), rows.begin(), rows.end());
        md.insert(md.end(), m.begin(), m.end());
      }
      for (int64_t t = 0; t < T; ++t) iw.emplace_back(s, t);
    }
    const int ke = preset("tiny").num_experts_per_tok;
    for (const File* f : {&fa, &fb}) {
      const auto ex = f->i32(d + "experts");
      auto& dst = f == &fa ? ra : rb;
      for (int64_t t = 0; t < T; ++t) dst.emplace_back(ex.begin() + t * ke, ex.begin() + (t + 1) * ke);
      auto m = f->f32(d + "router_margin");
      auto& md = f == &fa ? rma : rmb;
      md.insert(md.end(), m.begin(), m.end());
    }
    for (int64_t t = 0; t < T; ++t) rw.emplace_back(s, t);
    e.hashed = fa.attr_u8(d.substr(0, d.size() - 1), "hashed") != 0;
    for (const char* sub : {"attn", "ffn"}) {
      for (const char* part : {"pre", "post", "comb"}) {
        const auto a = fa.f32(d + "mhc_" + sub + "_" + part);
        const auto b = fb.f32(d + "mhc_" + sub + "_" + part);
        double& m = part[0] == 'c' ? e.comb : (part[1] == 'r' ? e.pre : e.post);
        for (size_t i = 0; i < a.size(); ++i) m = std::max(m, std::fabs(double(a[i]) - double(b[i])));
      }
    }
  }
  if (e.has_indexer) {
    const double thr = factor * median_abs_finite(ima, imb);
    double sum = 0;
    for (size_t i = 0; i < ia.size(); ++i) {
      const double ov = (ia[i].empty() && ib[i].empty())
                            ? 1.0
                            : double(common(ia[i], ib[i])) / double(std::max<size_t>(ia[i].size(), 1));
      sum += ov;
      e.overlap_min = std::min(e.overlap_min, ov);
      if (ia[i] != ib[i]) {
        ++e.idx_differ;
        agree[size_t(iw[i].first)][size_t(iw[i].second)] = 0;
        ++((ima[i] < thr || imb[i] < thr) ? e.idx_tie : e.idx_conf);
      }
    }
    e.overlap_mean = sum / double(ia.size());
  }
  const double thr = factor * median_abs_finite(rma, rmb);
  double jac = 0;
  int64_t exact = 0;
  for (size_t i = 0; i < ra.size(); ++i) {
    std::set<int64_t> u(ra[i].begin(), ra[i].end());
    u.insert(rb[i].begin(), rb[i].end());
    jac += double(common(ra[i], rb[i])) / double(u.size());
    if (ra[i] == rb[i]) {
      ++exact;
      continue;
    }
    ++e.rt_differ;
    agree[size_t(rw[i].first)][size_t(rw[i].second)] = 0;
    ++((rma[i] < thr || rmb[i] < thr) ? e.rt_tie : e.rt_conf);
  }
  e.exact = double(exact) / double(ra.size());
  e.jaccard = jac / double(ra.size());

  double total = 0, same = 0;
  for (int s = 0; s < seqs; ++s) {
    const RawDigests da = raw_digests(fa, s), db = raw_digests(fb, s);
    const std::pair<int, std::string> key{layer, "ffn.hc_post"};
    const auto [first_a, rows] = da.where.at(key);
    const int64_t first_b = db.where.at(key).first;
    std::vector<float> a, b;
    int64_t width = 0;
    if (use_full) {
      const std::string t = seq_path(s) + "/tensors/ffn.hc_post/" + layer_dir(layer);
      for (uint32_t u : fa.u32(t)) a.push_back(bf16_to_float(uint16_t(u)));
      for (uint32_t u : fb.u32(t)) b.push_back(bf16_to_float(uint16_t(u)));
      width = int64_t(a.size()) / rows;
    }
    for (int64_t r = 0; r < rows; ++r) {
      const bool differs = da.value[size_t(first_a + r)] != db.value[size_t(first_b + r)];
      e.out_differ += differs;
      double w = differs ? 1.0 : 0.0;
      if (use_full) {
        w = 0;
        for (int64_t j = 0; j < width; ++j) {
          const double d = double(b[size_t(r * width + j)]) - double(a[size_t(r * width + j)]);
          w += d * d;
        }
      }
      total += w;
      if (agree[size_t(s)][size_t(r)]) same += w;
    }
  }
  e.share = total > 0 ? same / total : 0.0;
  return e;
}

void expect_perfect(const DiffReport& r) {
  ASSERT_EQ(r.layers.size(), size_t(preset("tiny").num_hidden_layers));
  for (const LayerDiff& L : r.layers) {
    SCOPED_TRACE("layer " + std::to_string(L.layer));
    EXPECT_EQ(L.has_indexer, L.compress_ratio == 4);
    EXPECT_EQ(L.indexer_overlap_mean, 1.0);
    EXPECT_EQ(L.indexer_overlap_min, 1.0);
    EXPECT_EQ(L.indexer_rows_differing, 0);
    EXPECT_EQ(L.indexer_tie_flips + L.indexer_confident_flips, 0);
    EXPECT_EQ(L.routing_exact, 1.0);
    EXPECT_EQ(L.routing_jaccard, 1.0);
    EXPECT_EQ(L.routing_rows_differing, 0);
    EXPECT_EQ(L.routing_tie_flips + L.routing_confident_flips, 0);
    EXPECT_FALSE(L.hash_disagreement);
    EXPECT_EQ(L.mhc_pre_max_abs, 0.0);
    EXPECT_EQ(L.mhc_post_max_abs, 0.0);
    EXPECT_EQ(L.mhc_comb_max_abs, 0.0);
    EXPECT_EQ(L.rows_out_differing, 0);
    EXPECT_EQ(L.rows, 210);
  }
  EXPECT_FALSE(r.tensors.empty());
  for (const TensorDiff& t : r.tensors) {
    EXPECT_EQ(t.rows_differing, 0) << t.name;
    EXPECT_EQ(t.first_digest_row, -1) << t.name;
    EXPECT_EQ(t.max_abs, 0.0) << t.name;
    EXPECT_EQ(t.rel_l2, 0.0) << t.name;
    EXPECT_EQ(t.max_ulp, 0) << t.name;
    EXPECT_EQ(t.nonfinite_differing, 0) << t.name;
  }
  EXPECT_EQ(r.tokens.size(), size_t(149 + 59));
  EXPECT_EQ(r.k1, 0.0);
  EXPECT_EQ(r.k3, 0.0);
  EXPECT_EQ(r.ratio_mean, 1.0);
  EXPECT_EQ(r.ratio_max, 1.0);
  EXPECT_EQ(r.ratio_outside, 0.0);
  EXPECT_EQ(r.logprob_abs_max, 0.0);
  EXPECT_FALSE(r.first_divergence.has_value());
  EXPECT_TRUE(r.unmatched.empty()) << r.unmatched.front();
  EXPECT_FALSE(r.model_mismatch);
}

TEST(Diff, SelfFullIsPerfect) {
  const DiffReport r = diff_traces(trace("train_full"), trace("train_full"), {});
  expect_perfect(r);
  EXPECT_EQ(r.seq_count, 2);
  // Every tensor was compared element by element.
  for (const TensorDiff& t : r.tensors) EXPECT_TRUE(t.full) << t.name << " layer " << t.layer;
}

TEST(Diff, SelfDecisionsIsPerfect) {
  const DiffReport r = diff_traces(trace("rollout_dec"), trace("rollout_dec"), {});
  expect_perfect(r);
  for (const TensorDiff& t : r.tensors) EXPECT_FALSE(t.full) << t.name;
  EXPECT_EQ(r.tie_rule, "relative");
  EXPECT_EQ(r.tie_threshold, 0.0625);  // rollout simulates FP8
}

// Train vs rollout: every per-layer number, the token statistics, the tensor digest counts and the
// first divergence against the raw datasets.
void check_against_raw(const std::string& a, const std::string& b, bool full) {
  const DiffReport r = diff_traces(a, b, {});
  const File fa(a), fb(b);
  EXPECT_EQ(r.tie_rule, "relative");
  EXPECT_EQ(r.tie_threshold, 0.0625);
  EXPECT_TRUE(r.unmatched.empty()) << r.unmatched.front();
  const int seqs = 2;

  ASSERT_EQ(r.layers.size(), 6u);
  int64_t out_total = 0, flips = 0;
  for (const LayerDiff& L : r.layers) {
    SCOPED_TRACE("layer " + std::to_string(L.layer));
    const Expected e = expected_layer(fa, fb, L.layer, seqs, 0.0625, full);
    ASSERT_EQ(L.has_indexer, e.has_indexer);
    if (e.has_indexer) {
      EXPECT_NEAR(L.indexer_overlap_mean, e.overlap_mean, 1e-12);
      EXPECT_NEAR(L.indexer_overlap_min, e.overlap_min, 1e-12);
      EXPECT_EQ(L.indexer_rows_differing, e.idx_differ);
      EXPECT_EQ(L.indexer_tie_flips, e.idx_tie);
      EXPECT_EQ(L.indexer_confident_flips, e.idx_conf);
    }
    EXPECT_EQ(L.hashed, e.hashed);
    EXPECT_NEAR(L.routing_exact, e.exact, 1e-12);
    EXPECT_NEAR(L.routing_jaccard, e.jaccard, 1e-12);
    EXPECT_EQ(L.routing_rows_differing, e.rt_differ);
    EXPECT_EQ(L.routing_tie_flips, e.rt_tie);
    EXPECT_EQ(L.routing_confident_flips, e.rt_conf);
    EXPECT_EQ(L.mhc_pre_max_abs, e.pre);
    EXPECT_EQ(L.mhc_post_max_abs, e.post);
    EXPECT_EQ(L.mhc_comb_max_abs, e.comb);
    EXPECT_EQ(L.rows_out_differing, e.out_differ);
    EXPECT_NEAR(L.same_selection_share, e.share, 1e-9);
    out_total += L.rows_out_differing;
    flips += L.indexer_rows_differing + L.routing_rows_differing;
    if (L.layer < preset("tiny").num_hash_layers) {
      // Hash routing depends on the token only: it must agree everywhere.
      EXPECT_TRUE(L.hashed);
      EXPECT_EQ(L.routing_exact, 1.0);
      EXPECT_FALSE(L.hash_disagreement);
    }
  }
  // The seeded tiny model flips some selections between the two profiles, so the comparisons above
  // are not vacuous.
  EXPECT_GT(out_total, 0);
  EXPECT_GT(flips, 0);

  // Tokens: |Δ log-prob|, k1, k3 from the raw log-probs.
  double sum_abs = 0, k1 = 0, k3 = 0;
  size_t n = 0;
  for (int s = 0; s < seqs; ++s) {
    const auto la = fa.f32(seq_path(s) + "/logprobs");
    const auto lb = fb.f32(seq_path(s) + "/logprobs");
    ASSERT_EQ(la.size(), lb.size());
    for (size_t t = 0; t < la.size(); ++t, ++n) {
      const double lr = double(lb[t]) - double(la[t]);
      const TokenDiff& tk = r.tokens.at(n);
      EXPECT_EQ(tk.seq, s);
      EXPECT_EQ(tk.position, int64_t(t));
      EXPECT_EQ(tk.abs_diff, std::fabs(lr));
      sum_abs += std::fabs(lr);
      k1 += -lr;
      k3 += std::exp(lr) - 1.0 - lr;
    }
  }
  ASSERT_EQ(r.tokens.size(), n);
  EXPECT_NEAR(r.logprob_abs_mean, sum_abs / double(n), 1e-12);
  EXPECT_NEAR(r.k1, k1 / double(n), 1e-12);
  EXPECT_NEAR(r.k3, k3 / double(n), 1e-12);
  EXPECT_GT(r.logprob_abs_mean, 0.0);
  EXPECT_GE(r.k3, 0.0);

  // Tensor digest counts and the first divergence: scan both digest tables in execution order.
  std::map<std::pair<int, std::string>, int64_t> differing;
  std::optional<DiffReport::First> first;
  for (int s = 0; s < seqs; ++s) {
    const RawDigests da = raw_digests(fa, s), db = raw_digests(fb, s);
    ASSERT_EQ(da.order, db.order);
    for (const auto& key : da.order) {
      const auto [fa0, rows] = da.where.at(key);
      const int64_t fb0 = db.where.at(key).first;
      for (int64_t row = 0; row < rows; ++row) {
        if (da.value[size_t(fa0 + row)] == db.value[size_t(fb0 + row)]) continue;
        ++differing[key];
        if (!first) first = DiffReport::First{s, key.first, key.second, row};
      }
    }
  }
  for (const TensorDiff& t : r.tensors) {
    const std::pair<int, std::string> key{t.layer, t.name};
    EXPECT_EQ(t.rows_differing, differing[key]) << t.name;
  }
  ASSERT_TRUE(first.has_value());
  ASSERT_TRUE(r.first_divergence.has_value());
  EXPECT_EQ(r.first_divergence->seq, first->seq);
  EXPECT_EQ(r.first_divergence->layer, first->layer);
  EXPECT_EQ(r.first_divergence->tensor, first->tensor);
  EXPECT_EQ(r.first_divergence->row, first->row);

  if (full) {
    // One tensor's element metrics by hand: ffn.hc_post of the last layer, both sequences.
    const int last = 5;
    double sa = 0, sd = 0, mx = 0;
    for (int s = 0; s < seqs; ++s) {
      const std::string t = seq_path(s) + "/tensors/ffn.hc_post/" + layer_dir(last);
      const auto ua = fa.u32(t), ub = fb.u32(t);
      for (size_t i = 0; i < ua.size(); ++i) {
        const double x = bf16_to_float(uint16_t(ua[i])), y = bf16_to_float(uint16_t(ub[i]));
        sa += x * x;
        sd += (y - x) * (y - x);
        mx = std::max(mx, std::fabs(y - x));
      }
    }
    const auto it = std::find_if(r.tensors.begin(), r.tensors.end(), [&](const TensorDiff& t) {
      return t.name == "ffn.hc_post" && t.layer == last;
    });
    ASSERT_NE(it, r.tensors.end());
    EXPECT_TRUE(it->full);
    EXPECT_NEAR(it->rel_l2, std::sqrt(sd) / std::sqrt(sa), 1e-12);
    EXPECT_EQ(it->max_abs, mx);
    EXPECT_GT(it->max_ulp, 0);
  }
}

TEST(Diff, TrainVsRolloutDecisionsMatchesRawDatasets) {
  check_against_raw(trace("train_dec"), trace("rollout_dec"), false);
}

TEST(Diff, TrainVsRolloutFullMatchesRawDatasets) {
  check_against_raw(trace("train_full"), trace("rollout_full"), true);
}

template <class T>
bool same_bytes(const std::vector<T>& a, const std::vector<T>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0;
}

// The viewer's diff: over readers that already read every record for their views and kept them
// (TraceReader::keep_reads). It must be the report of two fresh files, byte for byte, and every kept
// read must equal a fresh read.
TEST(Diff, OverReadersThatKeptTheirReadsIsTheDiffOfTheFiles) {
  for (const bool full : {false, true}) {
    const std::string a = trace(full ? "train_full" : "train_dec"), b = trace(full ? "rollout_full" : "rollout_dec");
    const std::string want = diff_to_json(diff_traces(a, b, {}));
    TraceReader ra = TraceReader::open(a), rb = TraceReader::open(b);
    ra.keep_reads(int64_t(1) << 30);
    rb.keep_reads(int64_t(1) << 30);
    EXPECT_EQ(diff_to_json(diff_traces(ra, rb, {})), want) << "first pass, full " << full;
    const int64_t kept = ra.kept_bytes();
    EXPECT_GT(kept, 0);
    EXPECT_EQ(diff_to_json(diff_traces(ra, rb, {})), want) << "from what was kept, full " << full;
    EXPECT_EQ(ra.kept_bytes(), kept) << "a second pass keeps nothing new";
    const TraceReader fresh = TraceReader::open(a);
    for (int s = 0; s < 2; ++s) {
      EXPECT_EQ(ra.tokens(0, s), fresh.tokens(0, s));
      EXPECT_EQ(ra.logprobs(0, s), fresh.logprobs(0, s));
      EXPECT_EQ(ra.digests(0, s).values, fresh.digests(0, s).values);
      for (int layer = 0; layer < ra.config().num_hidden_layers; ++layer) {
        const auto ki = ra.indexer(0, s, layer), fi = fresh.indexer(0, s, layer);
        ASSERT_EQ(ki.has_value(), fi.has_value());
        if (ki) {
          EXPECT_EQ(ki->ids, fi->ids);
          EXPECT_EQ(ki->margin, fi->margin);
        }
        const auto kr = ra.routing(0, s, layer), fr = fresh.routing(0, s, layer);
        ASSERT_EQ(kr.has_value(), fr.has_value());
        if (kr) {
          EXPECT_EQ(kr->ids, fr->ids);
          EXPECT_EQ(kr->weights, fr->weights);
        }
      }
      for (const auto& [name, layer] : fresh.full_tensors(0, s))
        EXPECT_TRUE(same_bytes(ra.tensor(0, s, layer, name)->f, fresh.tensor(0, s, layer, name)->f))
            << name << " " << layer;  // bytes: masked scores are NaN
    }
  }
}

TEST(Diff, KeptReadsStayWithinTheirBudget) {
  TraceReader r = TraceReader::open(trace("train_full"));
  EXPECT_EQ(r.kept_bytes(), 0);
  (void)r.indexer(0, 0, 0);
  EXPECT_EQ(r.kept_bytes(), 0) << "nothing is kept by default";
  const int64_t one = int64_t(r.tokens(0, 0).size() * sizeof(int32_t));
  r.keep_reads(one);
  (void)r.tokens(0, 0);
  EXPECT_EQ(r.kept_bytes(), one);
  (void)r.tokens(0, 1);  // past the budget: read, not kept
  (void)r.logprobs(0, 0);
  EXPECT_EQ(r.kept_bytes(), one);
  EXPECT_EQ(r.tokens(0, 1), TraceReader::open(trace("train_full")).tokens(0, 1));
  r.refresh();
  EXPECT_EQ(r.kept_bytes(), 0) << "refresh drops what was kept";
  (void)r.tokens(0, 0);
  EXPECT_EQ(r.kept_bytes(), one);
  r.keep_reads(0);
  EXPECT_EQ(r.kept_bytes(), 0);
}

TEST(Diff, AbsoluteThresholdIsUsedEverywhere) {
  DiffOptions o;
  o.tie_threshold = 1e30;  // every flip is a tie
  const DiffReport r = diff_traces(trace("train_dec"), trace("rollout_dec"), o);
  EXPECT_EQ(r.tie_rule, "absolute");
  EXPECT_EQ(r.tie_threshold, 1e30);
  for (const LayerDiff& L : r.layers) {
    EXPECT_EQ(L.indexer_confident_flips + L.routing_confident_flips, 0);
    EXPECT_EQ(L.indexer_tie_flips, L.indexer_rows_differing);
    EXPECT_EQ(L.routing_tie_flips, L.routing_rows_differing);
    EXPECT_EQ(L.routing_tie_threshold, 1e30);
  }
}

TEST(Diff, RefusesDifferentTokens) {
  try {
    diff_traces(trace("train_dec"), trace("other_tokens"), {});
    FAIL() << "expected InputError";
  } catch (const InputError& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("sequence 1"), std::string::npos) << m;
    EXPECT_NE(m.find("position 17"), std::string::npos) << m;
  }
}

TEST(Diff, RefusesDifferentModelsUnlessAllowed) {
  EXPECT_THROW(diff_traces(trace("train_dec"), trace("other_model"), {}), InputError);
  DiffOptions o;
  o.allow_model_mismatch = true;
  const DiffReport r = diff_traces(trace("train_dec"), trace("other_model"), o);
  EXPECT_TRUE(r.model_mismatch);
  EXPECT_NE(r.model_digest_a, r.model_digest_b);
  EXPECT_TRUE(r.first_divergence.has_value());
}

TEST(Diff, RefusesAStepOutOfRange) {
  DiffOptions o;
  o.step_b = 3;
  EXPECT_THROW(diff_traces(trace("train_dec"), trace("rollout_dec"), o), InputError);
}

TEST(Diff, JsonTableAndCsv) {
  const DiffReport r = diff_traces(trace("train_dec"), trace("rollout_dec"), {});
  const auto j = nlohmann::json::parse(diff_to_json(r));
  for (const char* k : {"format", "version", "trace_a", "trace_b", "seq_count", "model_mismatch", "tie",
                        "first_divergence", "logprobs", "layers", "tensors", "tokens", "unmatched"})
    EXPECT_TRUE(j.contains(k)) << k;
  EXPECT_EQ(j["format"], "dsv4-diff");
  EXPECT_EQ(j["version"], 1);
  for (const char* k : {"path", "step", "profile", "model_digest"})
    EXPECT_TRUE(j["trace_a"].contains(k)) << k;
  EXPECT_EQ(j["trace_b"]["profile"], "rollout");
  for (const char* k : {"rule", "threshold"}) EXPECT_TRUE(j["tie"].contains(k)) << k;
  for (const char* k : {"seq", "layer", "tensor", "row"}) EXPECT_TRUE(j["first_divergence"].contains(k)) << k;
  for (const char* k :
       {"tokens", "abs_mean", "abs_max", "k1", "k3", "ratio_mean", "ratio_min", "ratio_max", "ratio_outside"})
    EXPECT_TRUE(j["logprobs"].contains(k)) << k;
  EXPECT_DOUBLE_EQ(j["logprobs"]["k3"].get<double>(), r.k3);
  ASSERT_EQ(j["layers"].size(), r.layers.size());
  for (size_t i = 0; i < r.layers.size(); ++i) {
    const auto& l = j["layers"][i];
    for (const char* k : {"layer", "compress_ratio", "rows", "indexer", "routing", "mhc", "attribution"})
      EXPECT_TRUE(l.contains(k)) << k;
    EXPECT_EQ(l["indexer"].is_null(), !r.layers[i].has_indexer);
    if (r.layers[i].has_indexer) {
      for (const char* k :
           {"overlap_mean", "overlap_min", "rows_differing", "tie_flips", "confident_flips", "tie_threshold"})
        EXPECT_TRUE(l["indexer"].contains(k)) << k;
    }
    for (const char* k : {"hashed", "exact", "jaccard", "rows_differing", "tie_flips", "confident_flips",
                          "tie_threshold", "hash_disagreement"})
      EXPECT_TRUE(l["routing"].contains(k)) << k;
    for (const char* k : {"pre_max_abs", "post_max_abs", "comb_max_abs"})
      EXPECT_TRUE(l["mhc"].contains(k)) << k;
    for (const char* k : {"rows_out_differing", "same_selection_share"})
      EXPECT_TRUE(l["attribution"].contains(k)) << k;
    EXPECT_EQ(l["routing"]["rows_differing"].get<int64_t>(), r.layers[i].routing_rows_differing);
  }
  ASSERT_EQ(j["tensors"].size(), r.tensors.size());
  for (const char* k : {"name", "layer", "rows", "rows_differing", "first_digest_seq", "first_digest_row",
                        "full", "rel_l2", "max_abs", "max_ulp", "nonfinite_differing"})
    EXPECT_TRUE(j["tensors"][0].contains(k)) << k;
  ASSERT_EQ(j["tokens"].size(), r.tokens.size());
  for (const char* k : {"seq", "position", "logprob_a", "logprob_b", "abs_diff", "ratio"})
    EXPECT_TRUE(j["tokens"][0].contains(k)) << k;

  const std::string table = diff_to_table(r);
  EXPECT_NE(table.find("first divergence: seq"), std::string::npos) << table;
  EXPECT_NE(table.find("k1"), std::string::npos) << table;

  const std::string out = dir() + "/csv";
  diff_to_csv(r, out);
  const std::vector<std::pair<std::string, size_t>> files = {
      {"layers.csv", r.layers.size()}, {"tensors.csv", r.tensors.size()}, {"tokens.csv", r.tokens.size()}};
  for (const auto& [name, rows] : files) {
    std::ifstream f(out + "/" + name);
    ASSERT_TRUE(f) << name;
    std::string header, line;
    std::getline(f, header);
    size_t n = 0;
    while (std::getline(f, line)) ++n;
    EXPECT_EQ(n, rows) << name;
    EXPECT_NE(header.find(name == "tokens.csv" ? "logprob_a" : "layer"), std::string::npos) << header;
  }
}

}  // namespace
}  // namespace dsv4

namespace dsv4 {
namespace {

TEST(DecisionSets, RowsOverlapJaccardAndTieRule) {
  const std::vector<int32_t> table{5, -1, 2, 3, 1, -1};
  EXPECT_EQ(valid_ids(table, 3, 0), (std::vector<int32_t>{2, 5}));
  EXPECT_EQ(valid_ids(table, 3, 1), (std::vector<int32_t>{1, 3}));
  EXPECT_TRUE(valid_ids(table, 3, 2).empty());
  EXPECT_DOUBLE_EQ(set_overlap({1, 2, 3, 4}, {2, 4, 6, 8}), 0.5);
  EXPECT_DOUBLE_EQ(set_overlap({}, {}), 1.0);
  EXPECT_DOUBLE_EQ(set_jaccard({1, 2, 3}, {2, 3, 4}), 0.5);
  EXPECT_DOUBLE_EQ(set_jaccard({}, {}), 1.0);
  // FP8 from the profile's flags; an unknown profile gets the coarser factor.
  EXPECT_EQ(tie_factor("train"), 0.0078125);
  EXPECT_EQ(tie_factor("rollout"), 0.0625);
  EXPECT_EQ(tie_factor("from-a-newer-producer"), 0.0625);
  EXPECT_EQ(tie_factor("train", "rollout"), 0.0625);
  // The median is the element of rank n/2 of the finite |margin| of every list.
  const std::vector<float> a{1, -3, INFINITY}, b{2, 4};
  EXPECT_EQ(relative_tie_threshold({&a, &b}, 0.5), 1.5);
  EXPECT_EQ(relative_tie_threshold({&a}, 1.0), 3.0);
  const std::vector<float> none{INFINITY, NAN};
  EXPECT_FALSE(relative_tie_threshold({&none}, 1.0).has_value());
  EXPECT_TRUE(is_tie_flip(0.1f, 5.0f, 0.2));
  EXPECT_FALSE(is_tie_flip(0.3f, 5.0f, 0.2));
  EXPECT_FALSE(is_tie_flip(0.1f, 0.1f, NAN));
}

}  // namespace
}  // namespace dsv4
