// TraceReader: traces/FORMAT.md, read back. Every accessor opens what it needs by path and checks
// shapes against the step's sequence lengths, so a damaged or hand-edited trace fails with a
// TraceError naming the dataset rather than with wrong data.
#include "capture/trace_reader.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <chrono>
#include <climits>
#include <cstring>
#include <filesystem>
#include <thread>

#include "capture/errors.h"
#include "model/decision_sets.h"
#include "model/error.h"
#include "capture/generation.h"
#include "capture/h5.h"
#include "capture/layout.h"
#include "capture/trace_open.h"
#include "capture/training.h"

namespace dsv4 {
namespace {

using namespace trace_layout;  // the format's names

namespace fs = std::filesystem;

std::string shape_str(const std::vector<hsize_t>& s) {
  std::string out = "[";
  for (size_t i = 0; i < s.size(); ++i) out += (i ? ", " : "") + std::to_string(s[i]);
  return out + "]";
}

// Parses the digits of "000012" / "layer_012"; -1 if `s` is not `prefix` followed by digits.
int parse_index(const std::string& s, const std::string& prefix) {
  if (s.size() <= prefix.size() || s.compare(0, prefix.size(), prefix) != 0) return -1;
  int v = 0;
  for (size_t i = prefix.size(); i < s.size(); ++i) {
    if (s[i] < '0' || s[i] > '9' || v > 100000000) return -1;
    v = v * 10 + (s[i] - '0');
  }
  return v;
}

// Opens `path` read-only (capture/trace_open.h: SWMR only for a file marked open for SWMR writing,
// with bounded read attempts; a file a writer died holding outside SWMR mode is refused with the
// salvage sentence).
OpenedTrace open_hdf5(const std::string& path, SealPolicy seal) {
  return open_for_reading(path, false, seal);
}

bool is_dataset(const h5::Object& o) {
  return H5Iget_type(o.get()) == H5I_DATASET;
}
bool is_group(const h5::Object& o) {
  return H5Iget_type(o.get()) == H5I_GROUP;
}

void sum_sizes(const h5::Object& g, int64_t& stored, int64_t& logical) {
  for (const auto& name : h5::children(g)) {
    h5::Object o = h5::open(g, name);
    if (is_dataset(o)) {
      stored += h5::storage_bytes(o);
      logical += h5::logical_bytes(o);
    } else if (is_group(o)) {
      sum_sizes(o, stored, logical);
    }
  }
}

GroupSize group_size(const h5::Object& g) {
  GroupSize s;
  s.group = g.path;
  sum_sizes(g, s.stored_bytes, s.logical_bytes);
  return s;
}

}  // namespace

// The bytes of decoded values a kept read holds (TraceReader::keep_reads).
template <class T>
int64_t decoded_bytes(const std::vector<T>& v) {
  return int64_t(v.size() * sizeof(T));
}
int64_t decoded_bytes(const IndexerRecord& r) {
  return decoded_bytes(r.ids) + decoded_bytes(r.margin);
}
int64_t decoded_bytes(const RoutingRecord& r) {
  return decoded_bytes(r.ids) + decoded_bytes(r.weights) + decoded_bytes(r.margin);
}
int64_t decoded_bytes(const MhcRecord& r) {
  return decoded_bytes(r.pre) + decoded_bytes(r.post) + decoded_bytes(r.comb);
}
int64_t decoded_bytes(const TensorCopy& t) {
  return decoded_bytes(t.f) + decoded_bytes(t.i);
}
int64_t decoded_bytes(const DigestTable& d) {
  return decoded_bytes(d.values) + int64_t(d.records.size() * sizeof(DigestRecord));
}
template <class T>
int64_t decoded_bytes(const std::optional<T>& v) {
  return v ? decoded_bytes(*v) : 0;
}

struct TraceReader::Impl {
  std::string path;
  h5::Object file;
  SealPolicy seal_policy = SealPolicy::enforce;
  SealCheck seal;
  std::vector<TracePart> parts;
  int version = 0;
  std::string producer;
  std::vector<TraceStepInfo> steps;
  // keep_reads: what each call returned, by the call ("indexer 0 0 3"), within keep_budget bytes.
  int64_t keep_budget = 0, kept_bytes = 0;
  std::map<std::string, std::shared_ptr<const void>> kept;

  // read() once per key while the budget lasts; a copy of the kept value after.
  template <class Read>
  auto kept_or_read(const std::string& key, Read&& read) -> decltype(read()) {
    using T = decltype(read());
    if (keep_budget <= 0) return read();
    if (auto it = kept.find(key); it != kept.end()) return *static_cast<const T*>(it->second.get());
    T v = read();
    const int64_t bytes = decoded_bytes(v);
    if (kept_bytes + bytes <= keep_budget) {
      kept.emplace(key, std::make_shared<const T>(v));
      kept_bytes += bytes;
    }
    return v;
  }
  void drop_kept() {
    kept.clear();
    kept_bytes = 0;
  }

  const h5::Object& f() const {
    if (!file.id.valid())
      throw TraceError(fmt::format("{}: the trace could not be reopened; call refresh() again", path));
    return file;
  }

  void load_steps() {
    std::vector<TraceStepInfo> out;
    if (!h5::exists(f(), kSteps)) throw TraceError(fmt::format("{}: /steps: missing", path));
    h5::Object g = h5::open(f(), kSteps);
    for (const auto& name : h5::children(g)) {
      TraceStepInfo s;
      s.index = parse_index(name, "");
      if (s.index < 0 || name.size() != 6)
        throw TraceError(fmt::format("{}: /steps/{}: not a step name (NNNNNN)", path, name));
      s.group = step_path(s.index);
      // A step whose recorder died may lack parts; it is listed as incomplete with what it has.
      try {
        h5::Object sg = h5::open(g, name);
        s.kind = h5::read_attr_string(sg, kKind);
        s.profile = h5::read_attr_string(sg, kProfile);
        if (h5::has_attr(sg, kProfileText)) {
          s.profile_text = h5::read_attr_string(sg, kProfileText);
          s.profile_digest = h5::has_attr(sg, kProfileDigest) ? h5::read_attr_string(sg, kProfileDigest) : "";
        }
        s.capture = h5::read_attr_string(sg, kCapture);
        s.seed = h5::read_attr_u64(sg, kSeed);
        s.threads = int(h5::read_attr_int(sg, kThreads));
        if (h5::has_attr(sg, kEngine)) {
          s.engine = h5::read_attr_string(sg, kEngine);
          if (s.engine.empty())
            throw TraceCorrupt(fmt::format("{}: {}: the engine attribute is empty", path, s.group));
          if (h5::has_attr(sg, kSource)) s.source = h5::read_attr_string(sg, kSource);
        }
        s.seq_lengths = h5::read<int64_t>(h5::open(sg, kSeqLengths));
        for (size_t q = 0; q < s.seq_lengths.size(); ++q)
          if (s.seq_lengths[q] < 0)
            throw TraceCorrupt(fmt::format("{}: {}/{}: sequence {} has length {}", path, s.group, kSeqLengths, q,
                                           s.seq_lengths[q]));
        const auto status = h5::read<uint8_t>(h5::open(sg, kStatus));
        if (status.size() != 1)
          throw TraceCorrupt(fmt::format("{}: {}/{}: {} values, expected 1", path, s.group, kStatus, status.size()));
        if (status[0] > 1)
          throw TraceCorrupt(fmt::format("{}: {}/{}: {}, expected 0 or 1", path, s.group, kStatus, int(status[0])));
        s.complete = status[0] == 1;
      } catch (const TraceError& e) {
        s.complete = false;
        s.damage = e.what();
      }
      out.push_back(std::move(s));
    }
    steps = std::move(out);
  }

  const TraceStepInfo& step(int index) const {
    for (const auto& s : steps)
      if (s.index == index) return s;
    throw TraceError(fmt::format("{}: no step {} (the trace has {} steps)", path, index, steps.size()));
  }

  // The sequence group of a complete step, and its token count.
  // A complete step (TraceCorrupt for a damaged one, TraceIncomplete for one with status 0).
  const TraceStepInfo& complete_step(int step_index) const {
    const TraceStepInfo& st = step(step_index);
    if (!st.complete && !st.damage.empty())
      throw TraceCorrupt(fmt::format("{}: step {} is damaged ({}); `dsv4 trace salvage` copies the intact steps",
                                     path, step_index, st.damage));
    if (!st.complete)
      throw TraceIncomplete(fmt::format(
          "{}: step {} is incomplete (status 0): its recorder did not finish it", path, step_index));
    return st;
  }

  h5::Object seq(int step_index, int s, int64_t* T = nullptr) const {
    const TraceStepInfo& st = complete_step(step_index);
    if (s < 0 || size_t(s) >= st.seq_lengths.size())
      throw TraceError(fmt::format("{}: step {} has {} sequences, no sequence {}", path, step_index,
                                   st.seq_lengths.size(), s));
    if (T) *T = st.seq_lengths[size_t(s)];
    h5::Object g = h5::open(f(), st.group.substr(1) + "/" + seq_name(s));
    // A joined trace's sequence lives in a part: errors below it name the part's file and object.
    if (const auto link = h5::external_link(f(), st.group.substr(1) + "/" + seq_name(s))) {
      for (const TracePart& p : parts)
        if (p.name == link->file) {
          g.file = p.path;
          g.path = link->object;
        }
    }
    return g;
  }

  // Opens dataset `rel` of `g` and checks its shape.
  static h5::Object dataset(const h5::Object& g, const std::string& rel, const std::vector<hsize_t>& shape) {
    if (!h5::exists(g, rel)) throw TraceError(fmt::format("{}: {}: missing", g.file, g.child(rel)));
    h5::Object d = h5::open(g, rel);
    if (!is_dataset(d)) d.fail("not a dataset");
    const auto s = h5::shape(d);
    if (s != shape) d.fail(fmt::format("expected shape {}, found {}", shape_str(shape), shape_str(s)));
    return d;
  }
  // Opens dataset `rel` of `g`, of any shape with `rank` dimensions.
  static h5::Object dataset_any(const h5::Object& g, const std::string& rel, size_t rank) {
    if (!h5::exists(g, rel)) throw TraceError(fmt::format("{}: {}: missing", g.file, g.child(rel)));
    h5::Object d = h5::open(g, rel);
    if (!is_dataset(d)) d.fail("not a dataset");
    if (h5::shape(d).size() != rank)
      d.fail(fmt::format("expected {} dimensions, found {}", rank, h5::shape(d).size()));
    return d;
  }
};

std::string TraceStepInfo::why_not_complete() const {
  if (complete) return "";
  return damage.empty() ? "incomplete (status 0): its recorder stopped during the step" : "damaged: " + damage;
}

TraceReader::TraceReader(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
TraceReader::TraceReader(TraceReader&&) noexcept = default;
TraceReader& TraceReader::operator=(TraceReader&&) noexcept = default;
TraceReader::~TraceReader() = default;

TraceReader TraceReader::open(const std::string& path, SealPolicy seal) {
  h5::quiet();
  std::error_code ec;
  if (!fs::exists(path, ec)) throw TraceError(fmt::format("{}: no such file", path));
  if (fs::is_directory(path, ec)) throw NotATrace(fmt::format("{}: a directory, not a trace", path));
  auto impl = std::make_unique<Impl>();
  impl->path = path;
  impl->seal_policy = seal;
  OpenedTrace opened = open_hdf5(path, seal);  // not an HDF5 file: NotATrace
  impl->file = std::move(opened.file);
  impl->seal = opened.seal;
  impl->parts = std::move(opened.parts);
  const h5::Object& f = impl->file;
  const int v = trace_layout::check_trace_root(f, path, &impl->producer);
  if (v < 1) throw TraceError(fmt::format("{}: format_version {} is not a dsv4 trace version", path, v));
  // Versions 1 to kTraceFormatVersion share the layout of what they have in common (later versions
  // only add step kinds and their groups), so no accessor branches on the version.
  impl->version = v;
  impl->load_steps();
  return TraceReader(std::move(impl));
}

const std::string& TraceReader::path() const {
  return impl_->path;
}
const SealCheck& TraceReader::seal() const {
  return impl_->seal;
}
const std::vector<TracePart>& TraceReader::parts() const {
  return impl_->parts;
}
int TraceReader::format_version() const {
  return impl_->version;
}
std::string TraceReader::producer() const {
  return impl_->producer;
}
std::string TraceReader::created() const {
  return h5::read_attr_string(impl_->f(), kCreated);
}

EnvFingerprint TraceReader::env() const {
  EnvFingerprint e;
  h5::Object g = h5::open(impl_->f(), kMetaEnv);
  for (const auto& k : h5::attr_names(g)) e[k] = h5::read_attr_string(g, k);
  return e;
}

TraceModelMeta TraceReader::model() const {
  TraceModelMeta m;
  h5::Object g = h5::open(impl_->f(), kMetaModel);
  m.config_json = h5::read_attr_string(g, kConfigJson);
  m.weights_path = h5::read_attr_string(g, kWeightsPath);
  m.model_digest = h5::read_attr_string(g, kModelDigest);
  m.tensor_names = h5::read_strings(Impl::dataset_any(g, kTensorNames, 1));
  m.tensor_digests = h5::read<uint64_t>(Impl::dataset(g, kTensorDigests, {hsize_t(m.tensor_names.size())}));
  return m;
}

ModelConfig TraceReader::config() const {
  return config_from_json(h5::read_attr_string(h5::open(impl_->f(), kMetaModel), kConfigJson),
                          impl_->path + " /meta/model config_json");
}

std::vector<std::string> TraceReader::tensor_names() const {
  return h5::read_strings(Impl::dataset_any(impl_->f(), "meta/tensor_names", 1));
}

std::vector<TraceStepInfo> TraceReader::steps() const {
  return impl_->steps;
}

void TraceReader::keep_reads(int64_t max_bytes) {
  impl_->keep_budget = std::max<int64_t>(max_bytes, 0);
  impl_->drop_kept();
}

int64_t TraceReader::kept_bytes() const {
  return impl_->kept_bytes;
}

void TraceReader::refresh() {
  impl_->drop_kept();  // a step being written may have grown
  // Close first: while this process holds the file, HDF5 would hand back the same cached state.
  impl_->file = h5::Object{};
  // A writer holds the file (non-SWMR) for a moment while it lays out a step; retry briefly.
  for (int attempt = 0;; ++attempt) {
    try {
      OpenedTrace opened = open_hdf5(impl_->path, impl_->seal_policy);
      impl_->file = std::move(opened.file);
      impl_->seal = opened.seal;
      impl_->parts = std::move(opened.parts);
      break;
    } catch (const TraceError&) {
      if (attempt >= 20) throw;
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
  }
  impl_->load_steps();
}

std::vector<int32_t> TraceReader::tokens(int step, int seq) const {
  return impl_->kept_or_read(fmt::format("tokens {} {}", step, seq), [&] {
    int64_t T = 0;
    h5::Object g = impl_->seq(step, seq, &T);
    return h5::read<int32_t>(Impl::dataset(g, kTokens, {hsize_t(T)}));
  });
}

std::vector<float> TraceReader::logprobs(int step, int seq) const {
  return impl_->kept_or_read(fmt::format("logprobs {} {}", step, seq), [&] {
    int64_t T = 0;
    h5::Object g = impl_->seq(step, seq, &T);
    if (impl_->step(step).external() && !h5::exists(g, kLogprobs))
      throw TraceError(fmt::format("{}: step {} sequence {} holds no log-probs (engine '{}' did not report them)",
                                   impl_->path, step, seq, impl_->step(step).engine));
    return h5::read<float>(Impl::dataset(g, kLogprobs, {hsize_t(std::max<int64_t>(T - 1, 0))}));
  });
}

bool TraceReader::has_logprobs(int step, int seq) const {
  return h5::exists(impl_->seq(step, seq), kLogprobs);
}

std::string TraceReader::sequence_id(int step, int seq) const {
  h5::Object g = impl_->seq(step, seq);
  return h5::has_attr(g, kRequestId) ? h5::read_attr_string(g, kRequestId) : std::string();
}

int64_t TraceReader::prompt_length(int step, int seq) const {
  h5::Object g = impl_->seq(step, seq);
  return h5::has_attr(g, kPromptLength) ? h5::read_attr_int(g, kPromptLength) : -1;
}

std::optional<GenerationRecord> TraceReader::generation(int step) const {
  impl_->complete_step(step);
  const TraceStepInfo& st = impl_->step(step);
  if (st.kind != kKindGenerate) return std::nullopt;
  const h5::Object sg = h5::open(impl_->f(), st.group.substr(1));
  std::vector<std::string> seqs;
  for (size_t i = 0; i < st.seq_lengths.size(); ++i) seqs.push_back(seq_name(int(i)));
  return read_generation(sg, seqs, fmt::format("{} step {}", path(), step));
}

std::optional<TrainingRecord> TraceReader::training(int step) const {
  impl_->complete_step(step);
  const TraceStepInfo& st = impl_->step(step);
  if (st.kind != kKindTrainStep) return std::nullopt;
  const h5::Object sg = h5::open(impl_->f(), st.group.substr(1));
  return read_training(sg, fmt::format("{} step {}", path(), step));
}

KernelRecords TraceReader::kernels(int step) const {
  impl_->complete_step(step);
  const h5::Object sg = h5::open(impl_->f(), impl_->step(step).group.substr(1));
  KernelRecords k;
  if (!h5::exists(sg, kKernels)) {
    k.reason = "not recorded in this trace";
    return k;
  }
  const h5::Object g = h5::open(sg, kKernels);
  k.available = h5::read_attr_int(g, kAvailable) != 0;
  k.reason = h5::has_attr(g, kReason) ? h5::read_attr_string(g, kReason) : "";
  const std::vector<std::string> names = h5::read_strings(Impl::dataset_any(g, kKernelName, 1));
  const hsize_t n = names.size();
  const auto grid = h5::read<int32_t>(Impl::dataset(g, kGrid, {n, 3}));
  const auto block = h5::read<int32_t>(Impl::dataset(g, kBlock, {n, 3}));
  const auto shared = h5::read<int64_t>(Impl::dataset(g, kSharedBytes, {n}));
  const auto regs = h5::read<int32_t>(Impl::dataset(g, kRegisters, {n}));
  const auto stream = h5::read<int64_t>(Impl::dataset(g, kStream, {n}));
  const auto start = h5::read<int64_t>(Impl::dataset(g, kStartNs, {n}));
  const auto end = h5::read<int64_t>(Impl::dataset(g, kEndNs, {n}));
  const auto corr = h5::read<int64_t>(Impl::dataset(g, kCorrelation, {n}));
  for (size_t i = 0; i < n; ++i) {
    KernelRecord r;
    r.name = names[i];
    r.grid = {grid[3 * i], grid[3 * i + 1], grid[3 * i + 2]};
    r.block = {block[3 * i], block[3 * i + 1], block[3 * i + 2]};
    r.shared_bytes = shared[i];
    r.registers = regs[i];
    r.stream = stream[i];
    r.start_ns = start[i];
    r.end_ns = end[i];
    r.correlation = corr[i];
    k.kernels.push_back(std::move(r));
  }
  return k;
}

std::vector<int> TraceReader::decision_layers(int step, int seq) const {
  h5::Object g = impl_->seq(step, seq);
  std::vector<int> layers;
  if (!h5::exists(g, kDecisions)) return layers;
  for (const auto& name : h5::children(h5::open(g, kDecisions))) {
    const int L = parse_index(name, kLayerPrefix);
    if (L < 0)
      throw TraceError(fmt::format("{}: {}/decisions/{}: not a layer name", impl_->path, g.path, name));
    layers.push_back(L);
  }
  return layers;
}

namespace {

// The decision rows a layer may hold: a row per token, or (external steps, the engines' layout) none
// for the last token.
void check_decision_rows(const h5::Object& ds, hsize_t rows, int64_t T) {
  if (int64_t(rows) != T && int64_t(rows) != T - 1)
    ds.fail(fmt::format("{} rows for {} tokens (expected {}, or {} for an external step)", rows, T, T, T - 1));
}

// [r0, min(r1, rows)), or an error naming the dataset for r0 beyond it.
std::pair<hsize_t, hsize_t> row_range(const h5::Object& ds, hsize_t rows, int64_t r0, int64_t r1) {
  if (r0 < 0 || r0 > int64_t(rows) || r1 < r0)
    ds.fail(fmt::format("rows [{}, {}) asked of {} rows", r0, r1, rows));
  return {hsize_t(r0), std::min(hsize_t(r1), rows)};
}

}  // namespace

std::optional<IndexerRecord> TraceReader::indexer(int step, int seq, int layer) const {
  return impl_->kept_or_read(fmt::format("indexer {} {} {}", step, seq, layer), [&] {
    return indexer_rows(step, seq, layer, 0, INT64_MAX);
  });
}

std::optional<IndexerRecord> TraceReader::indexer_rows(int step, int seq, int layer, int64_t r0,
                                                       int64_t r1) const {
  int64_t T = 0;
  h5::Object g = impl_->seq(step, seq, &T);
  const std::string rel = decisions_path(layer);
  if (!h5::exists(g, rel + "/" + kIndexerCount)) return std::nullopt;
  h5::Object d = h5::open(g, rel);
  const int64_t width = h5::read_attr_int(d, kIndexerWidth);
  if (width < 0 || width > T) d.fail(fmt::format("indexer_width {} is out of range for {} tokens", width, T));
  h5::Object cd = Impl::dataset_any(d, kIndexerCount, 1);
  const hsize_t R = h5::shape(cd)[0];
  check_decision_rows(cd, R, T);
  const auto [a, b] = row_range(cd, R, r0, r1);
  // The counts up to the last row asked locate its gaps (2 bytes a row); only those gaps are read.
  const auto count = h5::read_rows<int64_t>(cd, 0, b);
  int64_t first = 0, n_gaps = 0;
  for (hsize_t p = 0; p < b; ++p) {
    if (count[p] < 0 || count[p] > width)
      d.fail(fmt::format("indexer_count[{}] = {} exceeds indexer_width {}", p, count[p], width));
    (p < a ? first : n_gaps) += count[p];
  }
  h5::Object gd = Impl::dataset_any(d, kIndexerGaps, 1);
  const hsize_t total = h5::shape(gd)[0];
  if (hsize_t(first + n_gaps) > total)
    gd.fail(fmt::format("holds {} gaps, indexer_count needs {} (to row {})", total, first + n_gaps, b));
  if (a == 0 && b == R && hsize_t(n_gaps) != total)
    gd.fail(fmt::format("holds {} gaps, indexer_count sums to {}", total, n_gaps));
  const auto gaps = h5::read_rows<int64_t>(gd, hsize_t(first), hsize_t(first + n_gaps));
  IndexerRecord r;
  r.T = int64_t(b - a);
  r.k = int(width);
  if (h5::exists(d, kIndexerMargin)) {
    h5::Object md = Impl::dataset(d, kIndexerMargin, {R});
    r.margin = h5::read_rows<float>(md, a, b);
  }
  r.ids.assign(size_t(r.T * width), -1);
  size_t at = 0;
  for (hsize_t p = a; p < b; ++p) {
    int64_t id = -1;
    for (int64_t j = 0; j < count[p]; ++j) {
      id += gaps[at++] + 1;
      if (id > INT32_MAX) gd.fail(fmt::format("decodes to id {} at token {}", id, p));
      r.ids[size_t(int64_t(p - a) * width + j)] = int32_t(id);
    }
  }
  return r;
}

std::optional<RoutingRecord> TraceReader::routing(int step, int seq, int layer) const {
  return impl_->kept_or_read(fmt::format("routing {} {} {}", step, seq, layer), [&] {
    return routing_rows(step, seq, layer, 0, INT64_MAX);
  });
}

std::optional<RoutingRecord> TraceReader::routing_rows(int step, int seq, int layer, int64_t r0,
                                                       int64_t r1) const {
  int64_t T = 0;
  h5::Object g = impl_->seq(step, seq, &T);
  const std::string rel = decisions_path(layer);
  if (!h5::exists(g, rel + "/" + kExperts)) return std::nullopt;
  h5::Object d = h5::open(g, rel);
  h5::Object ex = Impl::dataset_any(d, kExperts, 2);
  const auto shape = h5::shape(ex);
  check_decision_rows(ex, shape[0], T);
  const auto [a, b] = row_range(ex, shape[0], r0, r1);
  RoutingRecord r;
  r.T = int64_t(b - a);
  r.k = int(shape[1]);
  r.hashed = h5::read_attr_int(d, kHashed) != 0;
  r.ids = h5::read_rows<int32_t>(ex, a, b);
  // An external step may lack the weights and the margins; the runtime's steps hold both.
  if (h5::exists(d, kExpertWeights)) r.weights = h5::read_rows<float>(Impl::dataset(d, kExpertWeights, shape), a, b);
  if (h5::exists(d, kRouterMargin)) r.margin = h5::read_rows<float>(Impl::dataset(d, kRouterMargin, {shape[0]}), a, b);
  return r;
}

std::optional<MhcRecord> TraceReader::mhc(int step, int seq, int layer, Sublayer s) const {
  return impl_->kept_or_read(fmt::format("mhc {} {} {} {}", step, seq, layer, to_string(s)), [&]() -> std::optional<MhcRecord> {
    int64_t T = 0;
    h5::Object g = impl_->seq(step, seq, &T);
    const std::string rel = decisions_path(layer);
    const std::string sub = to_string(s);
    if (!h5::exists(g, rel + "/" + mhc_name(sub, "pre"))) return std::nullopt;
    h5::Object d = h5::open(g, rel);
    h5::Object pre = Impl::dataset_any(d, mhc_name(sub, "pre"), 2);
    const auto shape = h5::shape(pre);
    if (shape[0] != hsize_t(T)) pre.fail(fmt::format("expected {} rows, found {}", T, shape[0]));
    MhcRecord r;
    r.T = T;
    r.hc = int(shape[1]);
    r.pre = h5::read<float>(pre);
    r.post = h5::read<float>(Impl::dataset(d, mhc_name(sub, "post"), shape));
    r.comb = h5::read<float>(Impl::dataset(d, mhc_name(sub, "comb"), {shape[0], shape[1], shape[1]}));
    return r;
  });
}

DigestTable TraceReader::digests(int step, int seq) const {
  return impl_->kept_or_read(fmt::format("digests {} {}", step, seq), [&] {
    h5::Object g = impl_->seq(step, seq);
    if (!h5::exists(g, kDigests)) throw TraceError(fmt::format("{}: {}/digests: missing", impl_->path, g.path));
    h5::Object d = h5::open(g, kDigests);
    h5::Object t = Impl::dataset_any(d, kDigestTensor, 1);
    const auto M = h5::shape(t);
    const auto tensor = h5::read<int32_t>(t);
    const auto layer = h5::read<int32_t>(Impl::dataset(d, kDigestLayer, M));
    h5::Object rd = Impl::dataset(d, kDigestRows, M);
    const auto rows = h5::read<int64_t>(rd);
    const auto names = tensor_names();
    DigestTable out;
    out.values = h5::read<uint64_t>(Impl::dataset_any(d, kDigestValue, 1));
    int64_t first = 0;
    for (size_t i = 0; i < tensor.size(); ++i) {
      if (tensor[i] < 0 || size_t(tensor[i]) >= names.size())
        t.fail(fmt::format("record {} names tensor {}, /meta/tensor_names has {}", i, tensor[i], names.size()));
      if (rows[i] < 0) rd.fail(fmt::format("record {} has {} rows", i, rows[i]));
      out.records.push_back(DigestRecord{names[size_t(tensor[i])], layer[i], rows[i], first});
      first += rows[i];
    }
    if (first != int64_t(out.values.size()))
      rd.fail(fmt::format("the records cover {} rows, digests/value holds {}", first, out.values.size()));
    return out;
  });
}

std::vector<std::pair<std::string, int>> TraceReader::full_tensors(int step, int seq) const {
  h5::Object g = impl_->seq(step, seq);
  std::vector<std::pair<std::string, int>> out;
  if (!h5::exists(g, kTensors)) return out;
  h5::Object t = h5::open(g, kTensors);
  for (const auto& name : h5::children(t)) {
    for (const auto& ln : h5::children(h5::open(t, name))) {
      const int L = ln == kModel ? -1 : parse_index(ln, kLayerPrefix);
      if (ln != kModel && L < 0)
        throw TraceError(fmt::format("{}: {}/{}/{}: not a layer name", impl_->path, t.path, name, ln));
      out.emplace_back(name, L);
    }
  }
  return out;
}

std::optional<TensorCopy> TraceReader::tensor(int step, int seq, int layer, const std::string& name) const {
  return impl_->kept_or_read(fmt::format("tensor {} {} {} {}", step, seq, layer, name), [&] {
    return tensor_rows(step, seq, layer, name, 0, INT64_MAX);
  });
}

std::optional<TensorCopy> TraceReader::tensor_rows(int step, int seq, int layer, const std::string& name,
                                                   int64_t r0, int64_t r1) const {
  h5::Object g = impl_->seq(step, seq);
  const std::string rel = tensor_path(name, layer);
  if (!h5::exists(g, rel)) return std::nullopt;
  h5::Object d = h5::open(g, rel);
  if (!is_dataset(d)) d.fail("not a dataset");
  const std::string dtype = h5::read_attr_string(d, kDtype);
  TensorCopy c;
  const auto shape = h5::shape(d);
  if (shape.empty()) d.fail("has no row axis");
  for (hsize_t x : shape) c.shape.push_back(int64_t(x));
  const auto [a, b] = row_range(d, shape[0], r0, r1);
  c.shape[0] = int64_t(b - a);
  if (dtype == "bfloat16") {
    if (h5::stored_type(d) != h5::Type::u16) d.fail("dtype bfloat16 needs uint16 storage");
    c.dtype = DType::bf16;
    const auto u = h5::read_rows<uint16_t>(d, a, b);
    c.f.resize(u.size());
    for (size_t i = 0; i < u.size(); ++i) {
      const uint32_t bits = uint32_t(u[i]) << 16;
      std::memcpy(&c.f[i], &bits, 4);
    }
  } else if (dtype == "float32") {
    c.dtype = DType::f32;
    c.f = h5::read_rows<float>(d, a, b);
  } else if (dtype == "int32") {
    c.dtype = DType::i32;
    c.i = h5::read_rows<int32_t>(d, a, b);
  } else {
    d.fail(fmt::format("unknown dtype attribute '{}'", dtype));
  }
  return c;
}

std::vector<GroupSize> TraceReader::sizes() const {
  std::vector<GroupSize> out;
  const h5::Object& f = impl_->f();
  if (h5::exists(f, kMeta)) out.push_back(group_size(h5::open(f, kMeta)));
  for (const auto& st : impl_->steps) {
    h5::Object sg = h5::open(f, st.group.substr(1));
    out.push_back(group_size(sg));
    for (const auto& name : h5::children(sg)) {
      if (parse_index(name, kSeqPrefix) < 0) continue;
      h5::Object q = h5::open(sg, name);
      out.push_back(group_size(q));
      for (const auto& sub : h5::children(q)) {
        h5::Object o = h5::open(q, sub);
        if (is_group(o)) out.push_back(group_size(o));
      }
    }
  }
  return out;
}

int64_t TraceReader::file_bytes() const {
  std::error_code ec;
  const auto n = fs::file_size(impl_->path, ec);
  if (ec) throw TraceError(fmt::format("{}: cannot read the file size: {}", impl_->path, ec.message()));
  return int64_t(n);
}

NumericsProfile recorded_profile(const TraceStepInfo& s, const std::string& trace_path) {
  const std::string where = fmt::format("{} {}", trace_path, s.group);
  if (s.profile_text.empty()) {
    if (!is_builtin_profile(s.profile))
      throw InputError(fmt::format("{}: profile '{}' is not built into this build and the trace holds no profile "
                                   "text (built-ins: {})",
                                   where, s.profile, fmt::join(profile_names(), ", ")));
    return profile_by_name(s.profile);
  }
  if (s.profile_digest != profile_text_digest(s.profile_text))
    throw TraceCorrupt(fmt::format("{}: {}: digest {} does not match the stored profile text (digest {})", where,
                                   kProfileText, s.profile_digest.empty() ? "(missing)" : s.profile_digest,
                                   profile_text_digest(s.profile_text)));
  NumericsProfile p = parse_profile(s.profile_text, where + " " + kProfileText);
  if (p.name != s.profile)
    throw TraceCorrupt(
        fmt::format("{}: the step's profile is named '{}' but its stored text names '{}'", where, s.profile, p.name));
  return p;
}

std::optional<NumericsProfile> known_recorded_profile(const TraceStepInfo& s, const std::string& trace_path) {
  if (s.profile_text.empty() && !is_builtin_profile(s.profile)) return std::nullopt;
  return recorded_profile(s, trace_path);
}

double recorded_tie_factor(const TraceStepInfo& s, const std::string& trace_path) {
  const std::optional<NumericsProfile> p = known_recorded_profile(s, trace_path);
  return p ? tie_factor(*p) : tie_factor(s.profile);
}

}  // namespace dsv4
