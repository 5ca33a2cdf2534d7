// TraceWriter: the layout of traces/FORMAT.md, written by one thread.
//
// HDF5 1.10's SWMR mode allows writing raw data and extending datasets but not creating objects, so a
// step is written in two phases: begin_step() opens the file read-write (not SWMR), creates every
// group and dataset the step will receive, closes them and switches to SWMR writing; from then on a
// reader in another process can follow the step while the forward streams into it. end_step() writes
// the last raw data, closes the SWMR file and reopens it read-write without SWMR to create the step's
// `kernels` group (its size is known only once the step ran), then marks the step complete
// (status = 1), flushes and closes the file, so between steps the file on disk is whole and closed.
//
// The writer opens files without POSIX locks: a reader following the trace in SWMR mode holds a
// shared lock that would otherwise make the next begin_step() fail. Concurrent access is governed by
// SWMR and by HDF5's superblock flags instead (an open for writing is refused while another writer
// has the file open).
#include "capture/trace_writer.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <unistd.h>

#include <chrono>
#include <condition_variable>
#include <cstring>
#include <ctime>
#include <deque>
#include <filesystem>
#include <functional>
#include <map>
#include <mutex>
#include <set>
#include <thread>

#include "capture/errors.h"
#include "capture/h5.h"
#include "capture/layout.h"
#include "capture/trace_reader.h"
#include "capture/version.h"
#include "model/manifest.h"

namespace dsv4 {
namespace {

using namespace trace_layout;  // the format's names

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

// The smallest unsigned storage type that holds `max`.
h5::Type unsigned_for(uint64_t max) {
  if (max <= 0xff) return h5::Type::u8;
  if (max <= 0xffff) return h5::Type::u16;
  return h5::Type::u32;
}

h5::Type storage_type(DType t) {
  switch (t) {
    case DType::bf16:
      return h5::Type::u16;
    case DType::f32:
      return h5::Type::f32;
    case DType::i32:
      return h5::Type::i32;
  }
  return h5::Type::f32;
}

const char* dtype_attr(DType t) {
  switch (t) {
    case DType::bf16:
      return "bfloat16";
    case DType::f32:
      return "float32";
    case DType::i32:
      return "int32";
  }
  return "?";
}

std::vector<hsize_t> dims(std::initializer_list<int64_t> d) {
  std::vector<hsize_t> v;
  for (int64_t x : d) v.push_back(hsize_t(x));
  return v;
}

// Writes integer ids in the storage width chosen at creation (ranges were checked by the caller).
void write_narrowed(const h5::Object& ds, h5::Type t, const std::vector<uint32_t>& v) {
  switch (t) {
    case h5::Type::u8:
      h5::write(ds, std::vector<uint8_t>(v.begin(), v.end()));
      break;
    case h5::Type::u16:
      h5::write(ds, std::vector<uint16_t>(v.begin(), v.end()));
      break;
    default:
      h5::write(ds, v);
      break;
  }
}

void fsync_path(const std::string& path, bool directory) {
  const int fd = ::open(path.c_str(), O_RDONLY | (directory ? O_DIRECTORY : 0));
  if (fd < 0) throw Error(fmt::format("{}: cannot open to sync: {}", path, std::strerror(errno)));
  const int r = ::fsync(fd);
  const int err = errno;
  ::close(fd);
  if (r != 0) throw Error(fmt::format("{}: fsync failed: {}", path, std::strerror(err)));
}

// What the compute side hands to the writer thread.
struct Msg {
  enum class Kind { call, tensor, indexer, routing, mhc };
  Kind kind = Kind::call;
  int64_t id = 0;
  int64_t cost = 0;  // bytes counted against Options::queue_bytes
  std::function<void()> fn;
  int seq = 0, layer = -1;
  std::string name;
  DType dtype = DType::f32;
  Sublayer sub = Sublayer::attn;
  int64_t T = 0;
  int k = 0;  // indexer, routing: ids per row; mhc: hc
  bool hashed = false;
  bool store = false;  // tensor: write `bytes` to tensors/<name>/<layer>
  std::vector<uint64_t> digests;
  std::vector<uint8_t> bytes;
  std::vector<int32_t> ids;            // indexer, routing
  std::vector<float> margin;           // indexer, routing
  std::vector<float> weights;          // routing
  std::vector<float> pre, post, comb;  // mhc
};

// What the writer thread knows about one sequence of the open step.
struct SeqLayout {
  int64_t T = 0;
  std::string group;  // "/steps/000000/seq_000"
  std::vector<TensorSpecT> manifest;
  std::map<std::pair<int, std::string>, size_t> index;  // (layer, name) -> manifest record
  std::vector<int64_t> first;                           // record -> offset into digests
  std::vector<uint64_t> digests;
  std::vector<char> got;
  std::set<std::string> pending;  // decisions not yet received: "layer_001/indexer", ...
  int width = 0;                  // indexer_width
  h5::Type gap_type = h5::Type::u8;
};

}  // namespace

TraceHeader make_trace_header(const Weights& w) {
  TraceHeader h;
  h.env = environment_fingerprint();
  h.config_json = config_to_json(w.config());
  h.weights_path = w.source();
  h.model = model_digest(w);
  return h;
}

class StepObserver;

struct TraceWriter::Impl {
  Impl(std::string final_path, std::string writing_path, const ModelConfig& c, Options o, bool appending)
      : final_path(std::move(final_path)),
        writing_path(std::move(writing_path)),
        cfg(c),
        opt(std::move(o)),
        appending(appending),
        names(tensor_names(c)) {
    for (size_t i = 0; i < names.size(); ++i) name_index[names[i]] = int32_t(i);
    thread = std::thread([this] { writer_loop(); });
  }
  ~Impl() { stop(true); }

  const std::string final_path, writing_path;
  const ModelConfig cfg;
  const Options opt;
  const bool appending;
  const std::vector<std::string> names;  // /meta/tensor_names
  std::map<std::string, int32_t> name_index;

  // Caller-side state.
  int next_step = 0;
  int completed = 0;
  bool step_open = false;
  bool closed = false;
  std::unique_ptr<StepObserver> observer;
  KernelRecords kernels;                       // of the open step (set_kernel_records)
  std::optional<GenerationRecord> generation;  // of the open step (set_generation)

  // The queue.
  mutable std::mutex mu;
  std::condition_variable cv_work, cv_space, cv_done;
  std::deque<Msg> queue;
  int64_t in_flight = 0, pushed = 0, done = 0;
  bool stopping = false, abandon = false;
  std::exception_ptr error;
  WriterStats st;
  std::thread thread;

  // Writer-thread state.
  h5::Object file;
  int step_index = -1;
  std::string step_group;
  std::vector<SeqLayout> seqs;

  void rethrow_locked() {
    if (error) std::rethrow_exception(error);
  }

  // Enqueues `m`; blocks while the queue holds queue_bytes (a message larger than the queue is let
  // through when the queue is empty, so every message fits eventually).
  int64_t push(Msg m) {
    std::unique_lock lk(mu);
    rethrow_locked();
    if (stopping) throw Error("the trace writer is closed");
    if (in_flight > 0 && in_flight + m.cost > opt.queue_bytes) {
      const auto t0 = Clock::now();
      cv_space.wait(lk, [&] { return error || in_flight == 0 || in_flight + m.cost <= opt.queue_bytes; });
      st.seconds_blocked += std::chrono::duration<double>(Clock::now() - t0).count();
      rethrow_locked();
    }
    m.id = ++pushed;
    in_flight += m.cost;
    st.bytes_queued += m.cost;
    st.queue_high_water = std::max(st.queue_high_water, in_flight);
    const int64_t id = m.id;
    queue.push_back(std::move(m));
    cv_work.notify_one();
    return id;
  }

  // Runs `fn` on the writer thread after everything queued before it, and waits for it.
  void run_on_writer(std::function<void()> fn) {
    Msg m;
    m.kind = Msg::Kind::call;
    m.fn = std::move(fn);
    const int64_t id = push(std::move(m));
    std::unique_lock lk(mu);
    cv_done.wait(lk, [&] { return done >= id; });
    rethrow_locked();
  }

  void writer_loop() {
    h5::quiet();
    while (true) {
      Msg m;
      {
        std::unique_lock lk(mu);
        cv_work.wait(lk, [&] { return stopping || !queue.empty(); });
        if (queue.empty()) break;
        m = std::move(queue.front());
        queue.pop_front();
      }
      bool skip;
      {
        std::lock_guard lk(mu);
        skip = error != nullptr || abandon;
      }
      if (!skip) {
        const auto t0 = Clock::now();
        try {
          handle(m);
        } catch (...) {
          std::lock_guard lk(mu);
          if (!error) error = std::current_exception();
        }
        std::lock_guard lk(mu);
        st.seconds_writing += std::chrono::duration<double>(Clock::now() - t0).count();
      }
      {
        std::lock_guard lk(mu);
        in_flight -= m.cost;
        done = m.id;
      }
      cv_space.notify_all();
      cv_done.notify_all();
    }
    // Whatever is still open (a step abandoned mid-way) is closed here, on the thread that owns it.
    try {
      h5::close_file(file);
    } catch (...) {
    }
    file = h5::Object{};
  }

  // abandon: drop queued messages (destructor without close()); otherwise write them first.
  void stop(bool abandon_queue) {
    {
      std::lock_guard lk(mu);
      if (!thread.joinable()) return;
      stopping = true;
      abandon = abandon || abandon_queue;
    }
    cv_work.notify_all();
    thread.join();
  }

  void handle(Msg& m) {
    switch (m.kind) {
      case Msg::Kind::call:
        m.fn();
        break;
      case Msg::Kind::tensor:
        write_tensor(m);
        break;
      case Msg::Kind::indexer:
        write_indexer(m);
        break;
      case Msg::Kind::routing:
        write_routing(m);
        break;
      case Msg::Kind::mhc:
        write_mhc(m);
        break;
    }
  }

  // ---- writer thread: file header ---------------------------------------------------------------

  void write_header(const TraceHeader& h) {
    h5::Id fapl = h5::file_access(true, false);
    h5::Object f = h5::create_file(writing_path, fapl.get());
    {
      h5::write_attr(f, kFormat, std::string(kFormatValue));
      h5::write_attr(f, kFormatVersion, int32_t(kPrefillFormatVersion));
      h5::write_attr(f, kProducer, std::string("dsv4 ") + version());
      h5::write_attr(f, kCreated, utc_now_iso8601());
      h5::Object meta = h5::create_group(f, kMeta);
      h5::Object env = h5::create_group(meta, kEnv);
      for (const auto& [k, v] : h.env) h5::write_attr(env, k, v);
      h5::Object model = h5::create_group(meta, kModel);
      h5::write_attr(model, kConfigJson, h.config_json);
      h5::write_attr(model, kWeightsPath, h.weights_path);
      h5::write_attr(model, kModelDigest, hex16(h.model.whole));
      if (h.model.names.size() != h.model.digests.size())
        throw Error("TraceHeader: model digest lists differ in length");
      h5::Object tn =
          h5::create_dataset(model, kTensorNames, h5::Type::str, dims({int64_t(h.model.names.size())}));
      h5::write_strings(tn, h.model.names);
      h5::Object td =
          h5::create_dataset(model, kTensorDigests, h5::Type::u64, dims({int64_t(h.model.digests.size())}));
      h5::write(td, h.model.digests);
      h5::Object n = h5::create_dataset(meta, kTensorNames, h5::Type::str, dims({int64_t(names.size())}));
      h5::write_strings(n, names);
      h5::create_group(f, kSteps);
    }
    h5::close_file(f);
  }

  // ---- writer thread: step layout -----------------------------------------------------------------

  void create_step(const StepSpec& s, const CapturePolicy& policy) {
    h5::Id fapl = h5::file_access(true, false);
    file = h5::open_file(writing_path, H5F_ACC_RDWR, fapl.get());
    step_index = next_step;
    step_group = step_path(step_index);
    seqs.clear();
    seqs.resize(s.seqs.size());
    {
      h5::Object steps = h5::open(file, kSteps);
      if (h5::exists(steps, step_name(step_index)))
        steps.fail(fmt::format("step {} exists already", step_name(step_index)));
      h5::Object g = h5::create_group(steps, step_name(step_index));
      // A generation step needs format version 2; a trace of prefill steps stays version 1.
      if (s.kind == kKindGenerate) h5::write_attr(file, kFormatVersion, int32_t(kTraceFormatVersion));
      h5::write_attr(g, kKind, s.kind);
      h5::write_attr(g, kProfile, s.profile);
      h5::write_attr(g, kSeed, uint64_t(s.seed));
      h5::write_attr(g, kThreads, int32_t(s.threads));
      h5::write_attr(g, kCapture, policy.text());
      h5::write_attr(g, kNSeqs, int32_t(s.seqs.size()));
      h5::Object status = h5::create_dataset(g, kStatus, h5::Type::u8, {1});
      h5::write(status, std::vector<uint8_t>{0});
      std::vector<int32_t> lengths;
      for (const auto& q : s.seqs) lengths.push_back(int32_t(q.size()));
      h5::Object sl = h5::create_dataset(g, kSeqLengths, h5::Type::i32, dims({int64_t(lengths.size())}));
      h5::write(sl, lengths);
      for (size_t i = 0; i < s.seqs.size(); ++i) create_seq(g, int(i), s.seqs[i], policy);
    }
    // SWMR writing needs every object closed; from here on only raw data is written. A reader in
    // this process that kept the file open across steps keeps HDF5's shared file (and its SWMR
    // mode) alive: the file is then in SWMR mode already.
    unsigned intent = 0;
    if (H5Fget_intent(file.get(), &intent) < 0) file.fail("cannot read the file's access mode");
    if (!(intent & H5F_ACC_SWMR_WRITE) && H5Fstart_swmr_write(file.get()) < 0)
      file.fail("cannot switch to SWMR writing");
  }

  void create_seq(const h5::Object& step, int si, const std::vector<int32_t>& tokens,
                  const CapturePolicy& policy) {
    SeqLayout& L = seqs[size_t(si)];
    const int64_t T = int64_t(tokens.size());
    L.T = T;
    L.group = step.child(seq_name(si));
    L.manifest = tensor_manifest(cfg, T);
    L.got.assign(L.manifest.size(), 0);
    int64_t R = 0;
    for (size_t r = 0; r < L.manifest.size(); ++r) {
      const auto& spec = L.manifest[r];
      if (!L.index.emplace(std::make_pair(spec.layer, spec.name), r).second)
        throw Error(fmt::format("tensor manifest lists '{}' layer {} twice", spec.name, spec.layer));
      L.first.push_back(R);
      R += spec.rows();
    }
    L.digests.assign(size_t(R), 0);
    const int64_t groups = T / 4;
    L.width = cfg.indexer_width(T);
    L.gap_type = unsigned_for(uint64_t(groups));

    h5::Object g = h5::create_group(step, seq_name(si));
    h5::Object tok = h5::create_dataset(g, kTokens, h5::Type::i32, dims({T}));
    h5::write(tok, tokens);
    h5::create_dataset(g, kLogprobs, h5::Type::f32, dims({T - 1}));

    const int64_t hc = cfg.hc_mult, ke = cfg.num_experts_per_tok;
    const h5::Type expert_type = unsigned_for(uint64_t(std::max(cfg.n_routed_experts - 1, 0)));
    h5::Object dec = h5::create_group(g, kDecisions);
    for (int layer = 0; layer < cfg.num_hidden_layers; ++layer) {
      const std::string ln = layer_name(layer);
      h5::Object d = h5::create_group(dec, ln);
      h5::write_attr(d, kHashed, uint8_t(cfg.is_hash_layer(layer) ? 1 : 0));
      if (cfg.ratio(layer) == 4) {
        h5::write_attr(d, kIndexerWidth, int32_t(L.width));
        h5::create_dataset(d, kIndexerCount, h5::Type::u16, dims({T}));
        // At most T * width ids (fewer where fewer groups are visible).
        h5::create_dataset(d, kIndexerGaps, L.gap_type, {0}, true, hsize_t(T * L.width));
        h5::create_dataset(d, kIndexerMargin, h5::Type::f32, dims({T}));
        L.pending.insert(ln + "/indexer");
      }
      h5::create_dataset(d, kExperts, expert_type, dims({T, ke}));
      h5::create_dataset(d, kExpertWeights, h5::Type::f32, dims({T, ke}));
      h5::create_dataset(d, kRouterMargin, h5::Type::f32, dims({T}));
      L.pending.insert(ln + "/routing");
      for (const char* sub : {"attn", "ffn"}) {
        h5::create_dataset(d, mhc_name(sub, "pre"), h5::Type::f32, dims({T, hc}));
        h5::create_dataset(d, mhc_name(sub, "post"), h5::Type::f32, dims({T, hc}));
        h5::create_dataset(d, mhc_name(sub, "comb"), h5::Type::f32, dims({T, hc, hc}));
        L.pending.insert(ln + "/" + mhc_name(sub));
      }
    }

    h5::Object dg = h5::create_group(g, kDigests);
    const int64_t M = int64_t(L.manifest.size());
    std::vector<int32_t> tensor(static_cast<size_t>(M)), layer(static_cast<size_t>(M));
    std::vector<int64_t> rows(static_cast<size_t>(M));
    for (int64_t r = 0; r < M; ++r) {
      const auto& spec = L.manifest[size_t(r)];
      auto it = name_index.find(spec.name);
      if (it == name_index.end())
        throw Error(fmt::format("tensor '{}' of the manifest is missing from tensor_names()", spec.name));
      tensor[size_t(r)] = it->second;
      layer[size_t(r)] = spec.layer;
      rows[size_t(r)] = spec.rows();
    }
    h5::create_dataset(dg, kDigestValue, h5::Type::u64, dims({R}), false, 0, h5::Compress::no);
    h5::Object dt = h5::create_dataset(dg, kDigestTensor, h5::Type::i32, dims({M}));
    h5::write(dt, tensor);
    h5::Object dl = h5::create_dataset(dg, kDigestLayer, h5::Type::i32, dims({M}));
    h5::write(dl, layer);
    h5::Object dr = h5::create_dataset(dg, kDigestRows, h5::Type::i64, dims({M}));
    h5::write(dr, rows);

    std::optional<h5::Object> tensors;
    for (const auto& spec : L.manifest) {
      if (!policy.wants_tensor(spec.name, spec.layer)) continue;
      if (!tensors) tensors = h5::create_group(g, kTensors);
      if (!h5::exists(*tensors, spec.name)) h5::create_group(*tensors, spec.name);
      h5::Object parent = h5::open(*tensors, spec.name);
      std::vector<hsize_t> shape(spec.shape.begin(), spec.shape.end());
      h5::Object ds = h5::create_dataset(parent, layer_name(spec.layer), storage_type(spec.dtype), shape);
      h5::write_attr(ds, kDtype, std::string(dtype_attr(spec.dtype)));
    }
  }

  // ---- writer thread: streamed data ---------------------------------------------------------------

  SeqLayout& seq_of(const Msg& m) {
    if (step_index < 0) throw Error("data reported outside begin_step()/end_step()");
    if (m.seq < 0 || size_t(m.seq) >= seqs.size())
      throw Error(fmt::format("step {}: data reported for sequence {} of a batch of {}", step_index, m.seq,
                              seqs.size()));
    return seqs[size_t(m.seq)];
  }

  h5::Object open_in_seq(const SeqLayout& L, const std::string& rel) {
    return h5::open(file, L.group.substr(1) + "/" + rel);
  }

  void done_decision(SeqLayout& L, const Msg& m, const std::string& what) {
    const std::string key = layer_name(m.layer) + "/" + what;
    if (!L.pending.erase(key))
      throw Error(fmt::format("step {} seq {}: unexpected or repeated decision {}", step_index, m.seq, key));
  }

  void write_tensor(const Msg& m) {
    SeqLayout& L = seq_of(m);
    auto it = L.index.find({m.layer, m.name});
    if (it == L.index.end())
      throw Error(
          fmt::format("step {} seq {}: the forward reported tensor '{}' layer {}, which the tensor "
                      "manifest (model/manifest.h) does not list for T={}",
                      step_index, m.seq, m.name, m.layer, L.T));
    const size_t r = it->second;
    const TensorSpecT& spec = L.manifest[r];
    if (L.got[r])
      throw Error(fmt::format("step {} seq {}: tensor '{}' layer {} reported twice", step_index, m.seq,
                              m.name, m.layer));
    if (int64_t(m.digests.size()) != spec.rows() || m.dtype != spec.dtype)
      throw Error(
          fmt::format("step {} seq {}: tensor '{}' layer {} reported as {} rows of {}, the manifest says {} "
                      "rows of {}",
                      step_index, m.seq, m.name, m.layer, m.digests.size(), to_string(m.dtype), spec.rows(),
                      to_string(spec.dtype)));
    std::copy(m.digests.begin(), m.digests.end(), L.digests.begin() + L.first[r]);
    L.got[r] = 1;
    if (m.store) {
      h5::Object ds = open_in_seq(L, tensor_path(m.name, m.layer));
      h5::write_le_bytes(ds, storage_type(m.dtype), m.bytes);
    }
  }

  void write_indexer(const Msg& m) {
    SeqLayout& L = seq_of(m);
    const std::string d = decisions_path(m.layer) + "/";
    if (m.layer < 0 || m.layer >= cfg.num_hidden_layers || cfg.ratio(m.layer) != 4)
      throw Error(fmt::format("step {} seq {}: indexer decision for layer {}, which is not a C4 layer",
                              step_index, m.seq, m.layer));
    if (m.T != L.T || m.k != L.width)
      throw Error(fmt::format("step {} seq {} layer {}: indexer ids [{}, {}], expected [{}, {}]", step_index,
                              m.seq, m.layer, m.T, m.k, L.T, L.width));
    const int64_t groups = L.T / 4;
    std::vector<uint16_t> count(size_t(L.T));
    std::vector<uint32_t> gaps;
    gaps.reserve(m.ids.size());
    for (int64_t p = 0; p < L.T; ++p) {
      int64_t prev = -1;
      int n = 0;
      for (int j = 0; j < m.k; ++j) {
        const int32_t g = m.ids[size_t(p * m.k + j)];
        if (g == -1) continue;
        // The encoding assumes ids ascending, valid ones first, and bounded by the group count.
        if (n != j || g <= prev || g >= groups)
          throw Error(
              fmt::format("step {} seq {} layer {} token {}: indexer ids are not an ascending, -1-tailed "
                          "list of groups < {} (slot {} holds {})",
                          step_index, m.seq, m.layer, p, groups, j, g));
        gaps.push_back(uint32_t(g - prev - 1));
        prev = g;
        ++n;
      }
      count[size_t(p)] = uint16_t(n);
    }
    h5::write(open_in_seq(L, d + kIndexerCount), count);
    h5::Object ds = open_in_seq(L, d + kIndexerGaps);
    h5::set_extent(ds, {hsize_t(gaps.size())});
    write_narrowed(ds, L.gap_type, gaps);
    h5::write(open_in_seq(L, d + kIndexerMargin), m.margin);
    done_decision(L, m, "indexer");
  }

  void write_routing(const Msg& m) {
    SeqLayout& L = seq_of(m);
    const std::string d = decisions_path(m.layer) + "/";
    if (m.layer < 0 || m.layer >= cfg.num_hidden_layers)
      throw Error(fmt::format("step {} seq {}: routing decision for layer {}", step_index, m.seq, m.layer));
    if (m.T != L.T || m.k != cfg.num_experts_per_tok || m.hashed != cfg.is_hash_layer(m.layer))
      throw Error(fmt::format(
          "step {} seq {} layer {}: routing [{}, {}] hashed={}, expected [{}, {}] hashed={}", step_index,
          m.seq, m.layer, m.T, m.k, m.hashed, L.T, cfg.num_experts_per_tok, cfg.is_hash_layer(m.layer)));
    std::vector<uint32_t> ids(m.ids.size());
    for (size_t i = 0; i < ids.size(); ++i) {
      if (m.ids[i] < 0 || m.ids[i] >= cfg.n_routed_experts)
        throw Error(fmt::format("step {} seq {} layer {}: expert id {} outside [0, {})", step_index, m.seq,
                                m.layer, m.ids[i], cfg.n_routed_experts));
      ids[i] = uint32_t(m.ids[i]);
    }
    h5::Object ex = open_in_seq(L, d + kExperts);
    write_narrowed(ex, unsigned_for(uint64_t(std::max(cfg.n_routed_experts - 1, 0))), ids);
    const h5::Object wts = open_in_seq(L, d + kExpertWeights), margin = open_in_seq(L, d + kRouterMargin);
    h5::write_all({{&wts, h5::Type::f32, m.weights.data(), m.weights.size()},
                   {&margin, h5::Type::f32, m.margin.data(), m.margin.size()}});
    done_decision(L, m, "routing");
  }

  void write_mhc(const Msg& m) {
    SeqLayout& L = seq_of(m);
    const std::string sub = to_string(m.sub);
    const std::string d = decisions_path(m.layer) + "/";
    if (m.layer < 0 || m.layer >= cfg.num_hidden_layers || m.T != L.T || m.k != cfg.hc_mult)
      throw Error(fmt::format("step {} seq {} layer {}: mHC {} decision of [{}, {}], expected [{}, {}]",
                              step_index, m.seq, m.layer, sub, m.T, m.k, L.T, cfg.hc_mult));
    const h5::Object pre = open_in_seq(L, d + mhc_name(sub, "pre")),
                     post = open_in_seq(L, d + mhc_name(sub, "post")),
                     comb = open_in_seq(L, d + mhc_name(sub, "comb"));
    h5::write_all({{&pre, h5::Type::f32, m.pre.data(), m.pre.size()},
                   {&post, h5::Type::f32, m.post.data(), m.post.size()},
                   {&comb, h5::Type::f32, m.comb.data(), m.comb.size()}});
    done_decision(L, m, mhc_name(sub));
  }

  // Creates /steps/NNNNNN/kernels (traces/FORMAT.md) in `f`, which must be open without SWMR.
  void write_kernels(const h5::Object& f, const KernelRecords& k) {
    h5::Object g = h5::create_group(h5::open(f, step_group.substr(1)), kKernels);
    h5::write_attr(g, kAvailable, uint8_t(k.available ? 1 : 0));
    h5::write_attr(g, kReason, k.available ? std::string() : k.reason);
    const int64_t n = k.available ? int64_t(k.kernels.size()) : 0;
    std::vector<std::string> names;
    std::vector<int32_t> grid, block, regs;
    std::vector<int64_t> shared, stream, start, end, corr;
    for (int64_t i = 0; i < n; ++i) {
      const KernelRecord& r = k.kernels[size_t(i)];
      names.push_back(r.name);
      grid.insert(grid.end(), r.grid.begin(), r.grid.end());
      block.insert(block.end(), r.block.begin(), r.block.end());
      shared.push_back(r.shared_bytes);
      regs.push_back(r.registers);
      stream.push_back(r.stream);
      start.push_back(r.start_ns);
      end.push_back(r.end_ns);
      corr.push_back(r.correlation);
    }
    h5::Object ds = h5::create_dataset(g, kKernelName, h5::Type::str, dims({n}));
    if (n > 0) h5::write_strings(ds, names);
    const auto put = [&](const char* name, h5::Type t, const std::vector<hsize_t>& shape, const auto& v) {
      h5::Object d = h5::create_dataset(g, name, t, shape);
      if (n > 0) h5::write(d, v);
    };
    put(kGrid, h5::Type::i32, dims({n, 3}), grid);
    put(kBlock, h5::Type::i32, dims({n, 3}), block);
    put(kSharedBytes, h5::Type::i64, dims({n}), shared);
    put(kRegisters, h5::Type::i32, dims({n}), regs);
    put(kStream, h5::Type::i64, dims({n}), stream);
    put(kStartNs, h5::Type::i64, dims({n}), start);
    put(kEndNs, h5::Type::i64, dims({n}), end);
    put(kCorrelation, h5::Type::i64, dims({n}), corr);
  }

  void finish_step(const ForwardResult& r, const KernelRecords& k) {
    if (r.seqs.size() != seqs.size())
      throw Error(
          fmt::format("end_step: the result has {} sequences, the step {}", r.seqs.size(), seqs.size()));
    for (size_t s = 0; s < seqs.size(); ++s) {
      SeqLayout& L = seqs[s];
      // The manifest is the contract that laid out this step: a tensor it lists but the forward did not
      // report means the two disagree, which is a bug in the model or the manifest, not in the input.
      for (size_t i = 0; i < L.manifest.size(); ++i)
        if (!L.got[i])
          throw Error(
              fmt::format("step {} seq {}: the forward did not report tensor '{}' layer {}, which the tensor "
                          "manifest (model/manifest.h) lists for T={}",
                          step_index, s, L.manifest[i].name, L.manifest[i].layer, L.T));
      if (!L.pending.empty())
        throw Error(fmt::format("step {} seq {}: the forward did not report decision {}", step_index, s,
                                *L.pending.begin()));
      if (int64_t(r.seqs[s].logprobs.size()) != std::max<int64_t>(L.T - 1, 0))
        throw Error(fmt::format("end_step: sequence {} has {} log-probs for {} tokens", s,
                                r.seqs[s].logprobs.size(), L.T));
      h5::write(open_in_seq(L, std::string(kDigests) + "/" + kDigestValue), L.digests);
      h5::write(open_in_seq(L, kLogprobs), r.seqs[s].logprobs);
    }
    // HDF5 1.10 creates no objects in SWMR mode: close the SWMR file and reopen it without SWMR for the
    // kernels group. Until status = 1 below the step stays incomplete, so a crash in between loses
    // only this step, as anywhere else in it.
    if (H5Fflush(file.get(), H5F_SCOPE_GLOBAL) < 0) file.fail("cannot flush");
    h5::close_file(file);
    file = h5::Object{};
    {
      h5::Id fapl = h5::file_access(true, false);
      file = h5::open_file(writing_path, H5F_ACC_RDWR, fapl.get());
    }
    write_kernels(file, k);
    if (generation) {
      std::vector<std::string> seq_groups;
      for (size_t i = 0; i < seqs.size(); ++i) seq_groups.push_back(seq_name(int(i)));
      write_generation(h5::open(file, step_group.substr(1)), seq_groups, *generation);
      generation.reset();
    }
    h5::Object status = h5::open(file, step_group.substr(1) + "/" + kStatus);
    h5::write(status, std::vector<uint8_t>{1});
    status = h5::Object{};
    if (H5Fflush(file.get(), H5F_SCOPE_GLOBAL) < 0) file.fail("cannot flush");
    h5::close_file(file);
    file = h5::Object{};
    seqs.clear();
    step_index = -1;
  }
};

// The Observer of one step: digests are computed here, on the compute thread, so the writer thread
// only moves bytes into HDF5.
class StepObserver : public Observer {
 public:
  StepObserver(TraceWriter::Impl& w, CapturePolicy policy) : w_(w), policy_(std::move(policy)) {}

  void on_tensor(const TensorRecord& t) override {
    Msg m;
    m.kind = Msg::Kind::tensor;
    m.seq = t.seq;
    m.layer = t.layer;
    m.name = std::string(t.name);
    m.dtype = t.dtype;
    m.digests = digest_rows(t);
    m.store = policy_.wants_tensor(t.name, t.layer);
    if (m.store) m.bytes = storage_bytes(t);
    m.cost = int64_t(m.digests.size() * 8 + m.bytes.size()) + 64;
    w_.push(std::move(m));
  }

  void on_indexer(const IndexerDecision& d) override {
    Msg m;
    m.kind = Msg::Kind::indexer;
    m.seq = d.seq;
    m.layer = d.layer;
    m.T = d.T;
    m.k = d.k;
    m.ids.assign(d.ids, d.ids + d.T * d.k);
    m.margin.assign(d.margin, d.margin + d.T);
    m.cost = int64_t(m.ids.size() * 4 + m.margin.size() * 4) + 64;
    w_.push(std::move(m));
  }

  void on_routing(const RoutingDecision& d) override {
    Msg m;
    m.kind = Msg::Kind::routing;
    m.seq = d.seq;
    m.layer = d.layer;
    m.T = d.T;
    m.k = d.k;
    m.hashed = d.hashed;
    m.ids.assign(d.ids, d.ids + d.T * d.k);
    m.weights.assign(d.weights, d.weights + d.T * d.k);
    m.margin.assign(d.margin, d.margin + d.T);
    m.cost = int64_t((m.ids.size() + m.weights.size() + m.margin.size()) * 4) + 64;
    w_.push(std::move(m));
  }

  void on_mhc(const MhcDecision& d) override {
    Msg m;
    m.kind = Msg::Kind::mhc;
    m.seq = d.seq;
    m.layer = d.layer;
    m.sub = d.sublayer;
    m.T = d.T;
    m.k = d.hc;
    m.pre.assign(d.pre, d.pre + d.T * d.hc);
    m.post.assign(d.post, d.post + d.T * d.hc);
    m.comb.assign(d.comb, d.comb + d.T * d.hc * d.hc);
    m.cost = int64_t((m.pre.size() + m.post.size() + m.comb.size()) * 4) + 64;
    w_.push(std::move(m));
  }

  bool wants_tensors() const override { return true; }  // digests cover every tensor

 private:
  TraceWriter::Impl& w_;
  CapturePolicy policy_;
};

TraceWriter::TraceWriter(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

TraceWriter::~TraceWriter() {
  if (!impl_) return;
  // Without close() the file keeps its .incomplete name: exactly what a crash leaves behind.
  impl_->stop(!impl_->closed);
}

std::unique_ptr<TraceWriter> TraceWriter::create(const std::string& path, const ModelConfig& c,
                                                 const TraceHeader& h, Options opt) {
  if (path.size() < 4 || path.compare(path.size() - 3, 3, ".h5") != 0)
    throw InputError(fmt::format("{}: a trace's file name must end in .h5", path));
  if (fs::exists(path))
    throw InputError(
        fmt::format("{}: exists; refusing to overwrite it (choose another name, or append to it)", path));
  // A leftover NAME.h5.incomplete (a recorder that died) is replaced.
  auto impl = std::make_unique<Impl>(path, path + ".incomplete", c, std::move(opt), false);
  impl->run_on_writer([&] { impl->write_header(h); });
  return std::unique_ptr<TraceWriter>(new TraceWriter(std::move(impl)));
}

std::unique_ptr<TraceWriter> TraceWriter::append(const std::string& path, const ModelConfig& c,
                                                 const TraceHeader& h, Options opt) {
  if (!fs::exists(path)) throw InputError(fmt::format("{}: no such trace to append to", path));
  auto impl = std::make_unique<Impl>(path, path, c, std::move(opt), true);
  impl->run_on_writer([&] {
    const TraceReader r = TraceReader::open(path);  // format and version checks
    const TraceModelMeta meta = r.model();
    const std::string ours = hex16(h.model.whole);
    if (meta.model_digest != ours) {
      // The first tensor (by name) that is missing on one side or differs.
      std::string first = "(none: the per-tensor lists are equal)";
      size_t i = 0, j = 0;
      const auto& a = meta.tensor_names;
      const auto& b = h.model.names;
      while (i < a.size() || j < b.size()) {
        if (j == b.size() || (i < a.size() && a[i] < b[j])) {
          first = fmt::format("'{}' (only in the trace)", a[i]);
          break;
        }
        if (i == a.size() || b[j] < a[i]) {
          first = fmt::format("'{}' (only in these weights)", b[j]);
          break;
        }
        if (i >= meta.tensor_digests.size() || meta.tensor_digests[i] != h.model.digests[j]) {
          first = fmt::format("'{}' ({} in the trace, {} here)", a[i],
                              i < meta.tensor_digests.size() ? hex16(meta.tensor_digests[i]) : "?",
                              hex16(h.model.digests[j]));
          break;
        }
        ++i, ++j;
      }
      throw InputError(
          fmt::format("{}: the trace was recorded with model digest {} ({}), these weights ({}) have "
                      "digest {}; first differing tensor: {}",
                      path, meta.model_digest, meta.weights_path, h.weights_path, ours, first));
    }
    const std::string recorded = config_to_json(config_from_json(meta.config_json, path + " /meta/model"));
    if (recorded != config_to_json(c))
      throw InputError(
          fmt::format("{}: the model config differs from the one the trace was recorded with", path));
    int next = 0;
    for (const auto& s : r.steps()) next = std::max(next, s.index + 1);
    impl->next_step = next;
  });
  return std::unique_ptr<TraceWriter>(new TraceWriter(std::move(impl)));
}

Observer& TraceWriter::begin_step(const StepSpec& s) {
  Impl& w = *impl_;
  if (w.closed) throw Error("begin_step() on a closed trace writer");
  if (w.step_open)
    throw Error(fmt::format("begin_step(): step {} is still open; call end_step() first", w.next_step));
  if (s.kind != "train" && s.kind != "rollout" && s.kind != kKindGenerate)
    throw InputError(fmt::format("step kind '{}': expected 'train', 'rollout' or 'generate'", s.kind));
  if (s.seqs.empty()) throw InputError("begin_step(): the batch has no sequences");
  for (size_t i = 0; i < s.seqs.size(); ++i)
    if (s.seqs[i].empty()) throw InputError(fmt::format("begin_step(): sequence {} is empty", i));
  w.run_on_writer([&] { w.create_step(s, w.opt.policy); });
  w.kernels = KernelRecords{};
  w.kernels.reason = "not recorded";
  w.step_open = true;
  w.observer = std::make_unique<StepObserver>(w, w.opt.policy);
  return *w.observer;
}

void TraceWriter::set_generation(GenerationRecord g) {
  Impl& w = *impl_;
  if (!w.step_open) throw Error("set_generation() without begin_step()");
  w.generation = std::move(g);
}

void TraceWriter::set_kernel_records(KernelRecords k) {
  Impl& w = *impl_;
  if (!w.step_open) throw Error("set_kernel_records() without begin_step()");
  w.kernels = std::move(k);
}

void TraceWriter::end_step(const ForwardResult& r) {
  Impl& w = *impl_;
  if (!w.step_open) throw Error("end_step() without begin_step()");
  w.run_on_writer([&] { w.finish_step(r, w.kernels); });
  w.kernels = KernelRecords{};
  w.kernels.reason = "not recorded";
  w.step_open = false;
  ++w.next_step;
  ++w.completed;
}

void TraceWriter::close() {
  Impl& w = *impl_;
  if (w.closed) return;
  if (w.step_open)
    throw Error(fmt::format("close(): step {} is still open; call end_step() first", w.next_step));
  w.stop(false);
  {
    std::lock_guard lk(w.mu);
    w.rethrow_locked();
  }
  fsync_path(w.writing_path, false);
  if (w.writing_path != w.final_path) {
    std::error_code ec;
    fs::rename(w.writing_path, w.final_path, ec);
    if (ec)
      throw Error(fmt::format("{}: cannot rename to {}: {}", w.writing_path, w.final_path, ec.message()));
    const fs::path dir = fs::absolute(w.final_path).parent_path();
    fsync_path(dir.string(), true);
  }
  w.closed = true;
}

const std::string& TraceWriter::final_path() const {
  return impl_->final_path;
}
const std::string& TraceWriter::writing_path() const {
  return impl_->writing_path;
}
int TraceWriter::steps_written() const {
  return impl_->completed;
}
WriterStats TraceWriter::stats() const {
  std::lock_guard lk(impl_->mu);
  return impl_->st;
}

void set_trace_weights_path(const std::string& path, const std::string& weights_path) {
  h5::Object f = h5::open_file(path, H5F_ACC_RDWR, H5P_DEFAULT);
  {
    const h5::Object model = h5::open(f, kMetaModel);
    h5::write_attr(model, kWeightsPathRecorded, h5::read_attr_string(model, kWeightsPath));
    h5::write_attr(model, kWeightsPath, weights_path);
  }
  h5::close_file(f);
}

}  // namespace dsv4
