// TraceWriter: the bounded queue, the writer thread and the public API. What the writer thread
// writes, and the SWMR rules it follows, are in capture/step_layout.cpp.
#include "capture/trace_writer.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <ctime>
#include <deque>
#include <filesystem>
#include <functional>
#include <mutex>
#include <thread>

#include "capture/errors.h"
#include "capture/h5.h"
#include "capture/layout.h"
#include "capture/step_layout.h"
#include "capture/trace_reader.h"
#include "capture/trace_seal.h"

namespace dsv4 {
namespace {

using namespace trace_layout;  // the format's names

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

void fsync_path(const std::string& path, bool directory) {
  const int fd = ::open(path.c_str(), O_RDONLY | (directory ? O_DIRECTORY : 0));
  if (fd < 0) throw Error(fmt::format("{}: cannot open to sync: {}", path, std::strerror(errno)));
  const int r = ::fsync(fd);
  const int err = errno;
  ::close(fd);
  if (r != 0) throw Error(fmt::format("{}: fsync failed: {}", path, std::strerror(err)));
}

// What the compute side hands to the writer thread: a record of the step, or a call.
struct Msg : StepRecord {
  bool call = false;
  int64_t id = 0;
  int64_t cost = 0;  // bytes counted against Options::queue_bytes
  std::function<void()> fn;
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
        layout(this->writing_path, c) {
    thread = std::thread([this] { writer_loop(); });
  }
  ~Impl() { stop(true); }

  const std::string final_path, writing_path;
  const ModelConfig cfg;
  const Options opt;
  const bool appending;
  StepLayout layout;  // used on the writer thread only

  // Caller-side state.
  int next_step = 0;
  int completed = 0;
  bool step_open = false;
  bool closed = false;
  std::unique_ptr<StepObserver> observer;
  KernelRecords kernels;                       // of the open step (set_kernel_records)
  std::optional<GenerationRecord> generation;  // of the open step (set_generation)
  std::optional<TrainingRecord> training;      // of the open step (set_training)
  std::string kind;                            // of the open step
  std::vector<int64_t> seq_lengths;            // of the open step

  // The queue.
  mutable std::mutex mu;
  std::condition_variable cv_work, cv_space, cv_done;
  std::deque<Msg> queue;
  int64_t in_flight = 0, pushed = 0, done = 0;
  bool stopping = false, abandon = false;
  std::exception_ptr error;
  WriterStats st;
  std::thread thread;

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

  // Runs `fn` on the writer thread after everything queued before it; returns at once.
  int64_t queue_call(std::function<void()> fn) {
    Msg m;
    m.call = true;
    m.fn = std::move(fn);
    return push(std::move(m));
  }
  // Waits until message `id` and everything before it are written (or the writer failed).
  void wait_for(int64_t id) {
    std::unique_lock lk(mu);
    cv_done.wait(lk, [&] { return done >= id; });
    rethrow_locked();
  }
  // Runs `fn` on the writer thread after everything queued before it, and waits for it.
  void run_on_writer(std::function<void()> fn) { wait_for(queue_call(std::move(fn))); }

  // Takes a call, or the records queued one after another (at most kBatchBytes of them), and writes
  // them: a batch's chunks are encoded together on the encoder threads (StepLayout::write_records).
  void writer_loop() {
    constexpr int64_t kBatchBytes = int64_t(64) << 20;
    h5::quiet();
    while (true) {
      std::vector<Msg> batch;
      {
        std::unique_lock lk(mu);
        cv_work.wait(lk, [&] { return stopping || !queue.empty(); });
        if (queue.empty()) break;
        int64_t bytes = 0;
        do {
          bytes += queue.front().cost;
          batch.push_back(std::move(queue.front()));
          queue.pop_front();
        } while (!batch.front().call && !queue.empty() && !queue.front().call && bytes < kBatchBytes);
      }
      bool skip;
      {
        std::lock_guard lk(mu);
        skip = error != nullptr || abandon;
      }
      if (!skip) {
        const auto t0 = Clock::now();
        double parts[3] = {};  // staging, encoding, storing
        try {
          handle(batch, parts);
        } catch (...) {
          std::lock_guard lk(mu);
          if (!error) error = std::current_exception();
        }
        const double seconds = std::chrono::duration<double>(Clock::now() - t0).count();
        std::lock_guard lk(mu);
        st.seconds_writing += seconds;
        if (batch.front().call) {
          st.seconds_steps += seconds;
        } else {
          st.seconds_staging += parts[0];
          st.seconds_encoding += parts[1];
          st.seconds_storing += parts[2];
          st.records += int64_t(batch.size());
          ++st.batches;
        }
      }
      {
        std::lock_guard lk(mu);
        for (const Msg& m : batch) in_flight -= m.cost;
        done = batch.back().id;
      }
      cv_space.notify_all();
      cv_done.notify_all();
    }
    // Whatever is still open (a step abandoned mid-way) is closed here, on the thread that owns it.
    layout.close_file();
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

  void handle(std::vector<Msg>& batch, double* seconds) {
    if (batch.front().call) return batch.front().fn();
    std::vector<const StepRecord*> records;
    for (const Msg& m : batch) records.push_back(&m);
    layout.write_records(records, seconds);
  }
};

// The Observer of one step: digests are computed here, on the compute thread, so the writer thread
// only moves bytes into HDF5.
class StepObserver : public Observer {
 public:
  StepObserver(TraceWriter::Impl& w, CapturePolicy policy) : w_(w), policy_(std::move(policy)) {}

  void on_tensor(const TensorRecord& t) override {
    Msg m;
    m.kind = StepRecord::Kind::tensor;
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
    m.kind = StepRecord::Kind::indexer;
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
    m.kind = StepRecord::Kind::routing;
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
    m.kind = StepRecord::Kind::mhc;
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
  // Reports are queued for the writer thread anyway: they may come late, and only the tensors the
  // policy stores need their values.
  bool deferrable() const override { return true; }
  bool wants_values(std::string_view name, int layer) const override { return policy_.wants_tensor(name, layer); }

 private:
  TraceWriter::Impl& w_;
  CapturePolicy policy_;
};

TraceWriter::TraceWriter(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

TraceWriter::~TraceWriter() {
  if (!impl_) return;
  // Without close() the file keeps its .incomplete name, as a crash leaves it; what was queued is
  // written first, so every step the caller ended is complete in it (an open step stays status 0).
  impl_->stop(false);
}

std::unique_ptr<TraceWriter> TraceWriter::create(const std::string& path, const ModelConfig& c,
                                                 const TraceHeader& h, Options opt) {
  if (path.size() < 4 || path.compare(path.size() - 3, 3, ".h5") != 0)
    throw InputError(fmt::format("{}: a trace's file name must end in .h5", path));
  if (fs::exists(path))
    throw InputError(
        fmt::format("{}: exists; refusing to overwrite it (choose another name, or append to it)", path));
  opt.policy.check_matches(c);
  // A leftover NAME.h5.incomplete (a recorder that died) is replaced.
  auto impl = std::make_unique<Impl>(path, path + ".incomplete", c, std::move(opt), false);
  impl->run_on_writer([&] { impl->layout.write_header(h); });
  return std::unique_ptr<TraceWriter>(new TraceWriter(std::move(impl)));
}

std::unique_ptr<TraceWriter> TraceWriter::append(const std::string& path, const ModelConfig& c,
                                                 const TraceHeader& h, Options opt) {
  if (!fs::exists(path)) throw InputError(fmt::format("{}: no such trace to append to", path));
  opt.policy.check_matches(c);
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
    // From here until close() the file is being changed: readers must not trust its old seal.
    mark_trace_open(path);
  });
  return std::unique_ptr<TraceWriter>(new TraceWriter(std::move(impl)));
}

Observer& TraceWriter::begin_step(const StepSpec& s) {
  Impl& w = *impl_;
  if (w.closed) throw Error("begin_step() on a closed trace writer");
  if (w.step_open)
    throw Error(fmt::format("begin_step(): step {} is still open; call end_step() first", w.next_step));
  if (!is_step_kind(s.kind))
    throw InputError(fmt::format("step kind '{}': expected {}", s.kind, step_kinds_text()));
  if (s.seqs.empty() && !s.allow_empty) throw InputError("begin_step(): the batch has no sequences");
  for (size_t i = 0; i < s.seqs.size(); ++i)
    if (s.seqs[i].empty()) throw InputError(fmt::format("begin_step(): sequence {} is empty", i));
  // Queued, not waited for: the step's groups are laid out while the model starts computing.
  w.queue_call([&w, index = w.next_step, spec = std::make_shared<const StepSpec>(s)] {
    w.layout.create_step(index, *spec, w.opt.policy);
  });
  w.kernels = KernelRecords{};
  w.kernels.reason = "not recorded";
  w.kind = s.kind;
  w.seq_lengths.clear();
  for (const auto& q : s.seqs) w.seq_lengths.push_back(int64_t(q.size()));
  w.step_open = true;
  w.observer = std::make_unique<StepObserver>(w, w.opt.policy);
  return *w.observer;
}

void TraceWriter::set_generation(GenerationRecord g) {
  Impl& w = *impl_;
  if (!w.step_open) throw Error("set_generation() without begin_step()");
  w.generation = std::move(g);
}

void TraceWriter::set_training(TrainingRecord t) {
  Impl& w = *impl_;
  if (!w.step_open) throw Error("set_training() without begin_step()");
  if (w.kind != kKindTrainStep)
    throw Error(
        fmt::format("set_training(): step {} is of kind '{}'; a training record belongs to a '{}' step",
                    w.next_step, w.kind, kKindTrainStep));
  if (const std::string why = training_record_problem(t, w.seq_lengths); !why.empty())
    throw Error(fmt::format("set_training(): step {}: {}", w.next_step, why));
  w.training = std::move(t);
}

void TraceWriter::set_kernel_records(KernelRecords k) {
  Impl& w = *impl_;
  if (!w.step_open) throw Error("set_kernel_records() without begin_step()");
  w.kernels = std::move(k);
}

void TraceWriter::end_step(const ForwardResult& r) {
  Impl& w = *impl_;
  if (!w.step_open) throw Error("end_step() without begin_step()");
  if (w.kind == kKindTrainStep && !w.training)
    throw Error(fmt::format("end_step(): step {} is a '{}' step without its training record (set_training)",
                            w.next_step, kKindTrainStep));
  // Queued, not waited for: the next step computes while this one is finished and flushed. Its
  // records move to the writer thread with the call.
  struct Finish {
    ForwardResult result;
    KernelRecords kernels;
    std::optional<GenerationRecord> generation;
    std::optional<TrainingRecord> training;
  };
  auto f = std::make_shared<Finish>(Finish{r, std::move(w.kernels), std::move(w.generation), std::move(w.training)});
  w.generation.reset();
  w.training.reset();
  w.queue_call([&w, f] {
    w.layout.finish_step(f->result, f->kernels, f->generation ? &*f->generation : nullptr,
                         f->training ? &*f->training : nullptr);
  });
  w.kernels = KernelRecords{};
  w.kernels.reason = "not recorded";
  w.step_open = false;
  ++w.next_step;
  ++w.completed;
}

void TraceWriter::flush() {
  Impl& w = *impl_;
  if (w.closed) return;
  w.run_on_writer([] {});
}

void TraceWriter::close() {
  Impl& w = *impl_;
  if (w.closed) return;
  if (w.step_open)
    throw Error(fmt::format("close(): step {} is still open; call end_step() first", w.next_step));
  using Clock = std::chrono::steady_clock;
  const auto t0 = Clock::now();
  w.stop(false);
  {
    std::lock_guard lk(w.mu);
    w.rethrow_locked();
  }
  const auto t1 = Clock::now();
  // The writer thread has ended: the layout's hasher is this thread's now.
  const SealTimes seal = publish_trace(w.writing_path, w.final_path, &w.layout.written());
  const double publish = std::chrono::duration<double>(Clock::now() - t1).count();
  w.closed = true;
  std::lock_guard lk(w.mu);
  w.st.seconds_close_file = std::chrono::duration<double>(t1 - t0).count();
  w.st.seconds_seal_hash = seal.hash_seconds;
  w.st.seconds_seal_sync = seal.sync_seconds;
  w.st.seconds_rename = std::max(0.0, publish - seal.hash_seconds - seal.sync_seconds);
  w.st.seal_bytes_read = int64_t(seal.bytes_read);
}

SealTimes publish_trace(const std::string& writing_path, const std::string& final_path, SealHasher* written) {
  const SealTimes t = seal_trace(writing_path, written);  // digest of the finished file, then fsync
  if (writing_path != final_path) {
    std::error_code ec;
    fs::rename(writing_path, final_path, ec);
    if (ec) throw Error(fmt::format("{}: cannot rename to {}: {}", writing_path, final_path, ec.message()));
    const fs::path dir = fs::absolute(final_path).parent_path();
    fsync_path(dir.string(), true);
  }
  return t;
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
int TraceWriter::next_step() const {
  return impl_->next_step;
}
WriterStats TraceWriter::stats() const {
  std::lock_guard lk(impl_->mu);
  return impl_->st;
}

void set_trace_weights_path(const std::string& path, const std::string& weights_path) {
  mark_trace_open(path);
  h5::Object f = h5::open_file(path, H5F_ACC_RDWR, H5P_DEFAULT);
  {
    const h5::Object model = h5::open(f, kMetaModel);
    h5::write_attr(model, kWeightsPathRecorded, h5::read_attr_string(model, kWeightsPath));
    h5::write_attr(model, kWeightsPath, weights_path);
  }
  h5::close_file(f);
  seal_trace(path);
}

}  // namespace dsv4
