// ExternalTraceWriter (capture/external.h). Writes on the caller's thread, without SWMR: an external
// step is written by an importer or a Python engine hook, not alongside a forward that a reader
// follows. Every sequence is checked whole before its group is created, so a rejected sequence leaves
// nothing behind in the step.
#include "capture/external.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <exception>
#include <filesystem>
#include <set>

#include "capture/digest.h"
#include "capture/env.h"
#include "capture/errors.h"
#include "capture/h5.h"
#include "capture/h5_tracked.h"
#include "capture/indexer_sets.h"
#include "capture/layout.h"
#include "capture/step_layout.h"
#include "capture/trace_seal.h"
#include "capture/trace_writer.h"
#include "capture/version.h"
#include "model/manifest.h"

namespace dsv4 {
namespace {

using namespace trace_layout;
namespace fs = std::filesystem;

std::vector<hsize_t> dims(std::initializer_list<int64_t> d) {
  std::vector<hsize_t> v;
  for (int64_t x : d) v.push_back(hsize_t(x));
  return v;
}

// "sequence 3 (request 'abc')" — how errors name a sequence.
std::string seq_label(int index, const std::string& id) {
  return id.empty() ? fmt::format("sequence {}", index)
                    : fmt::format("sequence {} (request '{}')", index, id);
}

// A checked indexer layer: its rows encoded at the runtime's width.
struct IndexerLayer {
  int layer = 0;
  std::shared_ptr<IndexerSetEncoder> enc;
};

// A checked routing layer: rows sorted ascending, weights permuted alongside.
struct RoutingLayer {
  int layer = 0;
  int64_t rows = 0;
  std::vector<uint32_t> ids;
  std::vector<float> weights;
};

}  // namespace

struct ExternalTraceWriter::Impl {
  std::string final_path, writing_path;
  ExternalModel model;
  ModelConfig cfg;
  SealHasher written;  // told of this writer's writes, for the seal at close(); outlives `file`
  h5::Object file;
  bool step_open = false, closed = false;
  int step = 0;  // the open step's index (= steps written so far)
  int completed = 0;
  std::vector<int32_t> seq_lengths;
  ExternalStepSpec spec;

  std::string where() const { return fmt::format("{}: step {}", final_path, step); }

  IndexerLayer check_indexer(const ExternalIndexer& x, int64_t T, const std::string& who) const;
  RoutingLayer check_routing(const ExternalRouting& x, int64_t T, const std::string& who) const;
  void check_tensor(const ExternalTensor& t, const std::string& who) const;
};

ExternalTraceWriter::ExternalTraceWriter(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

ExternalTraceWriter::~ExternalTraceWriter() {
  // Without close() the file keeps its .incomplete name (and an open step its status 0): what a crash
  // leaves behind.
  try {
    if (impl_->file.id.valid()) h5::close_file(impl_->file);
  } catch (...) {
  }
}

std::unique_ptr<ExternalTraceWriter> ExternalTraceWriter::create(const std::string& path,
                                                                 const ExternalModel& m) {
  if (path.size() < 4 || path.compare(path.size() - 3, 3, ".h5") != 0)
    throw InputError(fmt::format("{}: a trace's file name must end in .h5", path));
  if (fs::exists(path)) throw InputError(fmt::format("{}: exists; refusing to overwrite it", path));
  auto impl = std::make_unique<Impl>();
  impl->final_path = path;
  impl->writing_path = path + ".incomplete";
  impl->model = m;
  impl->cfg = config_from_json(m.config_json, path + " (model config)");
  if (!m.model_digest.empty() && m.model_digest.size() != 16)
    throw InputError(fmt::format("{}: model digest '{}' is not 16 hex digits", path, m.model_digest));
  if (m.tensor_names.size() != m.tensor_digests.size())
    throw InputError(fmt::format("{}: {} weight names but {} digests", path, m.tensor_names.size(),
                                 m.tensor_digests.size()));

  // The runtime's header (environment, model, the named tensors) with what is known of the weights.
  TraceHeader h;
  h.env = environment_fingerprint();
  h.config_json = m.config_json;
  h.weights_path = m.weights_path;
  h.model.names = m.tensor_names;
  h.model.digests = m.tensor_digests;
  if (!m.model_digest.empty()) {
    size_t used = 0;
    try {
      h.model.whole = std::stoull(m.model_digest, &used, 16);
    } catch (const std::exception&) {
    }
    if (used != 16)
      throw InputError(fmt::format("{}: model digest '{}' is not 16 hex digits", path, m.model_digest));
  }
  fs::remove(impl->writing_path);  // a leftover of a writer that died is replaced
  StepLayout(impl->writing_path, impl->cfg).write_header(h);
  {
    h5::Id fapl = h5::writing_access(&impl->written);
    h5::Object f = h5::open_file(impl->writing_path, H5F_ACC_RDWR, fapl.get());
    h5::write_attr(f, kFormatVersion, int32_t(kExternalFormatVersion));
    if (m.model_digest.empty())
      h5::write_attr(h5::open(f, kMetaModel), kModelDigest, std::string(kUnknownDigest));
    h5::close_file(f);
  }
  return std::unique_ptr<ExternalTraceWriter>(new ExternalTraceWriter(std::move(impl)));
}

const ModelConfig& ExternalTraceWriter::config() const {
  return impl_->cfg;
}
const std::string& ExternalTraceWriter::final_path() const {
  return impl_->final_path;
}
int ExternalTraceWriter::steps_written() const {
  return impl_->completed;
}

void ExternalTraceWriter::begin_step(const ExternalStepSpec& s) {
  Impl& w = *impl_;
  if (w.closed) throw Error("begin_step() on a closed trace writer");
  if (w.step_open) throw Error(fmt::format("{}: begin_step() while the step is open", w.where()));
  if (s.kind != "rollout" && s.kind != "train")
    throw InputError(
        fmt::format("{}: an external step's kind is 'rollout' or 'train', not '{}'", w.final_path, s.kind));
  if (s.engine.empty()) throw InputError(fmt::format("{}: an external step names its engine", w.final_path));
  h5::Id fapl = h5::writing_access(&w.written);
  w.file = h5::open_file(w.writing_path, H5F_ACC_RDWR, fapl.get());
  w.step = w.completed;
  h5::Object g = h5::create_group(h5::open(w.file, kSteps), step_name(w.step));
  h5::write_attr(g, kKind, s.kind);
  h5::write_attr(g, kProfile, s.profile.empty() ? std::string("unknown") : s.profile);
  h5::write_attr(g, kSeed, uint64_t(0));
  h5::write_attr(g, kThreads, int32_t(0));
  h5::write_attr(g, kCapture, std::string(kExternalCapture));
  h5::write_attr(g, kEngine, s.engine);
  h5::write_attr(g, kSource, s.source);
  h5::write_attr(g, kNSeqs, int32_t(0));
  h5::Object status = h5::create_dataset(g, kStatus, h5::Type::u8, {1});
  h5::write(status, std::vector<uint8_t>{0});
  // Grows with every sequence, so a step whose writer died reads as incomplete with what it holds.
  h5::create_dataset(g, kSeqLengths, h5::Type::i32, {0}, true);
  w.seq_lengths.clear();
  w.spec = s;
  w.step_open = true;
}

IndexerLayer ExternalTraceWriter::Impl::check_indexer(const ExternalIndexer& x, int64_t T,
                                                      const std::string& who) const {
  const std::string at = fmt::format("{}, layer {}", who, x.layer);
  if (x.layer < 0 || x.layer >= cfg.num_hidden_layers)
    throw InputError(fmt::format("{}: indexer of layer {}, the model has layers 0..{}", who, x.layer,
                                 cfg.num_hidden_layers - 1));
  if (cfg.ratio(x.layer) != 4)
    throw InputError(fmt::format("{}: layer {} has compress ratio {}; only C4 layers have an indexer", who,
                                 x.layer, cfg.ratio(x.layer)));
  if (x.rows != T && x.rows != T - 1)
    throw InputError(
        fmt::format("{} indexer: {} rows for {} tokens (expected {} or {})", at, x.rows, T, T, T - 1));
  const int width = cfg.indexer_width(T);
  if (x.width < width)
    throw InputError(
        fmt::format("{} indexer: width {}, the runtime selects min(index_topk {}, {}/4) = {} "
                    "groups for {} tokens",
                    at, x.width, cfg.index_topk, T, width, T));
  IndexerLayer out;
  out.layer = x.layer;
  if (x.encoded) {  // checked and encoded by the caller against the same rules
    const IndexerSetEncoder& e = *x.encoded;
    if (!x.ids.empty() || e.rows() != x.rows || e.T() != T || e.width() != width)
      throw Error(fmt::format("{} indexer: encoded rows of {} rows at width {} for {} tokens do not match it",
                              at, e.rows(), e.width(), e.T()));
    out.enc = x.encoded;
    return out;
  }
  if (int64_t(x.ids.size()) != x.rows * x.width)
    throw InputError(
        fmt::format("{} indexer: {} ids for [{} rows, width {}]", at, x.ids.size(), x.rows, x.width));
  out.enc = std::make_shared<IndexerSetEncoder>(T, width, false);
  for (int64_t t = 0; t < x.rows; ++t) {
    const int32_t* row = x.ids.data() + t * x.width;
    const IndexerRowFault f = out.enc->add_row(row, x.width);
    switch (f.kind) {
      case IndexerRowFault::none:
        continue;
      case IndexerRowFault::negative:
        throw InputError(fmt::format("{} row {}: slot {} holds {} (ids are groups >= 0, or -1 for empty)", at,
                                     t, f.slot, f.id));
      case IndexerRowFault::future:
        throw InputError(fmt::format("{} row {}: group {} is a future position (token {} sees groups 0..{})",
                                     at, t, f.id, t, (t + 1) / 4 - 1));
      case IndexerRowFault::duplicate:
        throw InputError(fmt::format("{} row {}: group {} appears twice", at, t, f.id));
      case IndexerRowFault::too_many:
      case IndexerRowFault::beyond_width:
        throw InputError(
            fmt::format("{} row {}: {} valid ids, the runtime selects at most {} for {} tokens", at, t,
                        std::count_if(row, row + x.width, [](int32_t g) { return g != -1; }), width, T));
    }
  }
  return out;
}

RoutingLayer ExternalTraceWriter::Impl::check_routing(const ExternalRouting& x, int64_t T,
                                                      const std::string& who) const {
  const std::string at = fmt::format("{}, layer {}", who, x.layer);
  if (x.layer < 0 || x.layer >= cfg.num_hidden_layers)
    throw InputError(fmt::format("{}: routing of layer {}, the model has layers 0..{}", who, x.layer,
                                 cfg.num_hidden_layers - 1));
  if (x.rows != T && x.rows != T - 1)
    throw InputError(
        fmt::format("{} routing: {} rows for {} tokens (expected {} or {})", at, x.rows, T, T, T - 1));
  const int k = cfg.num_experts_per_tok;
  if (x.k != k)
    throw InputError(fmt::format("{} routing: {} experts per token, the model routes to {}", at, x.k, k));
  if (int64_t(x.ids.size()) != x.rows * k)
    throw InputError(fmt::format("{} routing: {} ids for [{} rows, {}]", at, x.ids.size(), x.rows, k));
  if (!x.weights.empty() && x.weights.size() != x.ids.size())
    throw InputError(fmt::format("{} routing: {} weights for {} ids", at, x.weights.size(), x.ids.size()));
  RoutingLayer out;
  out.layer = x.layer;
  out.rows = x.rows;
  out.ids.resize(x.ids.size());
  if (!x.weights.empty()) out.weights.resize(x.weights.size());
  std::vector<int> order(static_cast<size_t>(k));
  for (int64_t t = 0; t < x.rows; ++t) {
    const int32_t* ids = x.ids.data() + t * k;
    for (int j = 0; j < k; ++j) {
      if (ids[j] < 0 || ids[j] >= cfg.n_routed_experts)
        throw InputError(
            fmt::format("{} row {}: expert id {} outside [0, {})", at, t, ids[j], cfg.n_routed_experts));
      if (!x.weights.empty() && !std::isfinite(x.weights[size_t(t * k + j)]))
        throw InputError(
            fmt::format("{} row {}: routing weight {} is not finite", at, t, x.weights[size_t(t * k + j)]));
      order[size_t(j)] = j;
    }
    // Ascending already (an export's rows, sorted on the way out): copied as they stand.
    bool ascending = true;
    for (int j = 1; j < k && ascending; ++j) ascending = ids[j - 1] < ids[j];
    if (ascending) {
      for (int j = 0; j < k; ++j) out.ids[size_t(t * k + j)] = uint32_t(ids[j]);
      if (!x.weights.empty())
        std::copy(x.weights.begin() + t * k, x.weights.begin() + (t + 1) * k, out.weights.begin() + t * k);
      continue;
    }
    std::sort(order.begin(), order.end(), [&](int a, int b) { return ids[a] < ids[b]; });
    for (int j = 0; j < k; ++j) {
      if (j > 0 && ids[order[size_t(j)]] == ids[order[size_t(j - 1)]])
        throw InputError(fmt::format("{} row {}: expert {} appears twice", at, t, ids[order[size_t(j)]]));
      out.ids[size_t(t * k + j)] = uint32_t(ids[order[size_t(j)]]);
      if (!x.weights.empty()) out.weights[size_t(t * k + j)] = x.weights[size_t(t * k + order[size_t(j)])];
    }
  }
  return out;
}

void ExternalTraceWriter::Impl::check_tensor(const ExternalTensor& t, const std::string& who) const {
  const std::string at = fmt::format("{}, tensor '{}' layer {}", who, t.name, t.layer);
  if (t.name.empty() || t.name.find('/') != std::string::npos || t.name == "." || t.name == "..")
    throw InputError(fmt::format("{}: tensor name '{}' is empty or holds '/'", who, t.name));
  if (t.layer < -1 || t.layer >= cfg.num_hidden_layers)
    throw InputError(fmt::format("{}: layer {} outside -1..{}", at, t.layer, cfg.num_hidden_layers - 1));
  if (t.shape.empty()) throw InputError(fmt::format("{}: no shape", at));
  int64_t n = 1;
  for (int64_t d : t.shape) {
    if (d < 0) throw InputError(fmt::format("{}: negative dimension in its shape", at));
    n *= d;
  }
  const size_t have = t.dtype == DType::i32 ? t.i.size() : t.f.size();
  if (int64_t(have) != n)
    throw InputError(fmt::format("{}: {} values for a shape of {} elements", at, have, n));
  if (t.dtype == DType::bf16)
    for (size_t e = 0; e < t.f.size(); ++e) {
      uint32_t u;
      std::memcpy(&u, &t.f[e], 4);
      if (u & 0xffffu)
        throw InputError(
            fmt::format("{}: element {} ({}) is not a bf16 value; round it to bf16 first", at, e, t.f[e]));
    }
}

void ExternalTraceWriter::add_sequence(const ExternalSequence& s) {
  Impl& w = *impl_;
  if (!w.step_open)
    throw Error(fmt::format("{}: add_sequence() outside begin_step()/end_step()", w.final_path));
  const int si = int(w.seq_lengths.size());
  const std::string who = fmt::format("{}: step {} {}", w.final_path, w.step, seq_label(si, s.id));
  const ModelConfig& c = w.cfg;
  const int64_t T = int64_t(s.tokens.size());
  if (T == 0) throw InputError(fmt::format("{}: no tokens", who));
  if (T > c.max_position_embeddings)
    throw InputError(
        fmt::format("{}: {} tokens, the model reaches {} positions", who, T, c.max_position_embeddings));
  for (int64_t t = 0; t < T; ++t)
    if (s.tokens[size_t(t)] < 0 || s.tokens[size_t(t)] >= c.vocab_size)
      throw InputError(fmt::format("{}: token {} at position {} is outside the vocabulary [0, {})", who,
                                   s.tokens[size_t(t)], t, c.vocab_size));
  if (s.prompt_length < -1 || s.prompt_length > T)
    throw InputError(fmt::format("{}: prompt length {} for {} tokens", who, s.prompt_length, T));
  if (!s.logprobs.empty() && int64_t(s.logprobs.size()) != T - 1)
    throw InputError(fmt::format("{}: {} log-probs for {} tokens (expected {}: one per predicted token)", who,
                                 s.logprobs.size(), T, T - 1));

  // Everything is checked before the sequence's group exists.
  std::vector<IndexerLayer> idx;
  std::vector<RoutingLayer> rt;
  std::set<int> seen_idx, seen_rt;
  // The layers are checked on several threads; their errors are raised in the order of the lists (a
  // layer given twice where the sequential check would have met it), whatever the thread count.
  {
    const int64_t ni = int64_t(s.indexer.size()), nr = int64_t(s.routing.size());
    idx.resize(size_t(ni));
    rt.resize(size_t(nr));
    std::vector<std::exception_ptr> failed(size_t(ni + nr));
#pragma omp parallel for schedule(dynamic, 1)
    for (int64_t i = 0; i < ni + nr; ++i) {
      try {
        if (i < ni)
          idx[size_t(i)] = w.check_indexer(s.indexer[size_t(i)], T, who);
        else
          rt[size_t(i - ni)] = w.check_routing(s.routing[size_t(i - ni)], T, who);
      } catch (...) {
        failed[size_t(i)] = std::current_exception();
      }
    }
    for (int64_t i = 0; i < ni; ++i) {
      const ExternalIndexer& x = s.indexer[size_t(i)];
      if (!seen_idx.insert(x.layer).second)
        throw InputError(fmt::format("{}: indexer of layer {} given twice", who, x.layer));
      if (failed[size_t(i)]) std::rethrow_exception(failed[size_t(i)]);
    }
    for (int64_t i = 0; i < nr; ++i) {
      const ExternalRouting& x = s.routing[size_t(i)];
      if (!seen_rt.insert(x.layer).second)
        throw InputError(fmt::format("{}: routing of layer {} given twice", who, x.layer));
      if (failed[size_t(ni + i)]) std::rethrow_exception(failed[size_t(ni + i)]);
    }
  }
  std::set<std::pair<std::string, int>> seen_t;
  for (const ExternalTensor& t : s.tensors) {
    if (!seen_t.insert({t.name, t.layer}).second)
      throw InputError(fmt::format("{}: tensor '{}' layer {} given twice", who, t.name, t.layer));
    w.check_tensor(t, who);
  }

  h5::Object g = h5::create_group(h5::open(w.file, step_path(w.step).substr(1)), seq_name(si));
  h5::write_attr(g, kRequestId, s.id);
  h5::write_attr(g, kPromptLength, int64_t(s.prompt_length));
  h5::write(h5::create_dataset(g, kTokens, h5::Type::i32, dims({T})), s.tokens);
  if (!s.logprobs.empty())
    h5::write(h5::create_dataset(g, kLogprobs, h5::Type::f32, dims({T - 1})), s.logprobs);

  std::set<int> layers(seen_idx);
  layers.insert(seen_rt.begin(), seen_rt.end());
  if (!layers.empty()) {
    h5::Object dec = h5::create_group(g, kDecisions);
    for (int layer : layers) {
      h5::Object d = h5::create_group(dec, layer_name(layer));
      h5::write_attr(d, kHashed, uint8_t(c.is_hash_layer(layer) ? 1 : 0));
    }
  }
  for (const IndexerLayer& x : idx) {
    h5::Object d = h5::open(g, decisions_path(x.layer));
    h5::write_attr(d, kIndexerWidth, int32_t(x.enc->width()));
    x.enc->store(d);
  }
  const h5::Type expert_type = unsigned_for(uint64_t(std::max(c.n_routed_experts - 1, 0)));
  for (const RoutingLayer& x : rt) {
    h5::Object d = h5::open(g, decisions_path(x.layer));
    const int64_t k = c.num_experts_per_tok;
    write_narrowed(h5::create_dataset(d, kExperts, expert_type, dims({x.rows, k})), expert_type, x.ids);
    if (!x.weights.empty())
      h5::write(h5::create_dataset(d, kExpertWeights, h5::Type::f32, dims({x.rows, k})), x.weights);
  }
  if (!s.tensors.empty()) {
    h5::Object tg = h5::create_group(g, kTensors);
    for (const ExternalTensor& t : s.tensors) {
      if (!h5::exists(tg, t.name)) h5::create_group(tg, t.name);
      std::vector<hsize_t> shape(t.shape.begin(), t.shape.end());
      h5::Object ds =
          h5::create_dataset(h5::open(tg, t.name), layer_name(t.layer), storage_type(t.dtype), shape);
      h5::write_attr(ds, kDtype, std::string(dtype_attr(t.dtype)));
      if (t.dtype == DType::i32) {
        h5::write(ds, t.i);
      } else if (t.dtype == DType::f32) {
        h5::write(ds, t.f);
      } else {
        std::vector<uint16_t> u(t.f.size());
        for (size_t e = 0; e < u.size(); ++e) {
          uint32_t bits;
          std::memcpy(&bits, &t.f[e], 4);
          u[e] = uint16_t(bits >> 16);
        }
        h5::write(ds, u);
      }
    }
  }
  w.seq_lengths.push_back(int32_t(T));
  h5::Object lengths = h5::open(w.file, step_path(w.step).substr(1) + "/" + kSeqLengths);
  h5::set_extent(lengths, {hsize_t(w.seq_lengths.size())});
  h5::write_range(lengths, h5::Type::i32, &w.seq_lengths.back(), hsize_t(si), 1);
}

std::vector<std::shared_ptr<IndexerSetEncoder>> ExternalTraceWriter::stream_indexer_layers(
    int64_t T, int n, bool strict_columns) {
  Impl& w = *impl_;
  if (!w.step_open)
    throw Error(fmt::format("{}: stream_indexer_layers() outside begin_step()/end_step()", w.final_path));
  if (T < 1) throw InputError(fmt::format("{}: a sequence of {} tokens", w.final_path, T));
  auto file = std::make_shared<h5::ChunkFile>(w.file, unsigned_for(uint64_t(T / 4)), n);
  std::vector<std::shared_ptr<IndexerSetEncoder>> out;
  for (int i = 0; i < n; ++i)
    out.push_back(std::make_shared<IndexerSetEncoder>(T, w.cfg.indexer_width(T), strict_columns, file, i));
  return out;
}

void ExternalTraceWriter::end_step() {
  Impl& w = *impl_;
  if (!w.step_open) throw Error(fmt::format("{}: end_step() without begin_step()", w.final_path));
  if (w.seq_lengths.empty())
    throw InputError(
        fmt::format("{}: step {} holds no sequence; add one before ending it", w.final_path, w.step));
  h5::Object g = h5::open(w.file, step_path(w.step).substr(1));
  h5::write_attr(g, kNSeqs, int32_t(w.seq_lengths.size()));
  h5::write(h5::open(g, kStatus), std::vector<uint8_t>{1});
  g = h5::Object{};
  if (H5Fflush(w.file.get(), H5F_SCOPE_GLOBAL) < 0) w.file.fail("cannot flush");
  h5::close_file(w.file);
  w.file = h5::Object{};
  w.step_open = false;
  ++w.completed;
}

void ExternalTraceWriter::close() {
  Impl& w = *impl_;
  if (w.closed) return;
  if (w.step_open)
    throw Error(
        fmt::format("{}: close(): step {} is still open; call end_step() first", w.final_path, w.step));
  publish_trace(w.writing_path, w.final_path, &w.written);
  w.closed = true;
}

}  // namespace dsv4
