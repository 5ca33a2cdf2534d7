#include "gui/models/trace_session.h"

#include <QFile>
#include <algorithm>
#include <cmath>
#include <future>

#include "capture/errors.h"
#include "capture/h5.h"
#include "capture/trace_seal.h"

namespace dsv4::gui {

namespace {

void register_types() {
  static const bool once = [] {
    qRegisterMetaType<SummaryPtr>();
    qRegisterMetaType<SeqPtr>();
    qRegisterMetaType<ChunkPtr>();
    qRegisterMetaType<ReportPtr>();
    qRegisterMetaType<DetailPtr>();
    qRegisterMetaType<DivergencesPtr>();
    qRegisterMetaType<LoadError>();
    return true;
  }();
  (void)once;
}

// What each reader of a pair keeps of its reads for the diff report (TraceReader::keep_reads): a
// 20,000-token decisions pair keeps about 60 MB a side; beyond this a file is read a second time.
constexpr int64_t kKeepReadBytes = int64_t(512) << 20;

// A message that names the file even when the library's message does not.
QString with_path(const std::string& path, const char* what) {
  const QString msg = QString::fromStdString(what);
  return msg.contains(QString::fromStdString(path)) ? msg : QString::fromStdString(path) + ": " + msg;
}

// A damaged file: the library's sentence without HDF5's error stack (kept for the details), and the
// command that recovers the complete steps.
QString damaged_message(const std::string& path, const char* what) {
  QString msg = with_path(path, what);
  const int stack = msg.indexOf(QStringLiteral(" (HDF5: "));
  if (stack >= 0) msg.truncate(stack);
  return msg + QStringLiteral(
                   ".\nThe file is damaged or was cut short; `dsv4 trace salvage %1 --out NEW.h5` copies its "
                   "complete steps into a new trace.")
                   .arg(QString::fromStdString(path));
}

std::string lengths_text(const std::vector<int64_t>& v) {
  std::string s;
  for (size_t i = 0; i < v.size(); ++i) s += (i ? ", " : "") + std::to_string(v[i]);
  return "[" + s + "]";
}

TraceInfo trace_info(const TraceReader& r, int step) {
  TraceInfo i;
  i.path = r.path();
  i.format_version = r.format_version();
  i.producer = r.producer();
  i.created = r.created();
  i.seal = seal_summary(r.seal());
  i.env = r.env();
  const TraceModelMeta m = r.model();
  i.model_digest = m.model_digest;
  i.weights_path = m.weights_path;
  i.config = r.config();
  i.steps = r.steps();
  i.step = step;
  i.file_bytes = r.file_bytes();
  const auto it =
      std::find_if(i.steps.begin(), i.steps.end(), [&](const TraceStepInfo& s) { return s.index == step; });
  if (it == i.steps.end())
    throw InputError(r.path() + ": no step " + std::to_string(step) + " (the trace has " +
                     std::to_string(i.steps.size()) + ")");
  if (!it->complete)
    throw TraceIncomplete(r.path() + ": step " + std::to_string(step) +
                          " is incomplete (still being written, or its writer stopped); reload later or pick "
                          "another step");
  i.kernels = r.kernels(step);
  return i;
}

const TraceStepInfo& step_of(const TraceInfo& i) {
  return *std::find_if(i.steps.begin(), i.steps.end(),
                       [&](const TraceStepInfo& s) { return s.index == i.step; });
}

LayerRecords read_records(const TraceReader& r, int step, int seq, int layer) {
  LayerRecords rec;
  rec.indexer = r.indexer(step, seq, layer);
  rec.routing = r.routing(step, seq, layer);
  rec.mhc[0] = r.mhc(step, seq, layer, Sublayer::attn);
  rec.mhc[1] = r.mhc(step, seq, layer, Sublayer::ffn);
  return rec;
}

// The row of a full tensor that belongs to `token`; -1 when none does.
int64_t tensor_row_for(const ModelConfig& c, const std::string& name, int layer, int64_t rows, int64_t T,
                       int64_t token) {
  if (rows == T) return token;
  int ratio = 0;
  if (name == "attn.compressed_kv" && layer >= 0 && layer < int(c.compress_ratios.size()))
    ratio = c.compress_ratios[layer];
  if (name == "indexer.k") ratio = 4;
  if (ratio <= 0) return -1;
  const int64_t g = (token + 1) / ratio - 1;  // the last group complete at `token`
  return g >= 0 && g < rows ? g : -1;
}

std::vector<float> row_values(const TensorCopy& t, int64_t row) {
  int64_t n = 1;
  for (size_t i = 1; i < t.shape.size(); ++i) n *= t.shape[i];
  std::vector<float> v(static_cast<size_t>(n));
  for (int64_t j = 0; j < n; ++j) v[j] = t.dtype == DType::i32 ? float(t.i[row * n + j]) : t.f[row * n + j];
  return v;
}

}  // namespace

// ---- TraceSession ----------------------------------------------------------------------------

TraceSession::TraceSession(QObject* parent) : QObject(parent), worker_(new TraceWorker) {
  register_types();
  thread_.setObjectName(QStringLiteral("dsv4-trace-worker"));
  worker_->moveToThread(&thread_);
  connect(&thread_, &QThread::finished, worker_, &QObject::deleteLater);
  // Worker signals arrive queued on this (UI) thread; stale load ids are dropped here.
  connect(worker_, &TraceWorker::summaryReady, this, [this](quint64 id, SummaryPtr s) {
    if (id == load_id_) emit summaryReady(std::move(s));
  });
  connect(worker_, &TraceWorker::seqReady, this, [this](quint64 id, SeqPtr s) {
    if (id == load_id_) emit seqReady(std::move(s));
  });
  connect(worker_, &TraceWorker::chunkReady, this, [this](quint64 id, ChunkPtr c) {
    if (id == load_id_) emit chunkReady(std::move(c));
  });
  connect(worker_, &TraceWorker::reportReady, this, [this](quint64 id, ReportPtr r) {
    if (id == load_id_) emit reportReady(std::move(r));
  });
  connect(worker_, &TraceWorker::divergencesReady, this, [this](quint64 id, DivergencesPtr d) {
    if (id == load_id_) emit divergencesReady(std::move(d));
  });
  connect(worker_, &TraceWorker::progress, this,
          [this](quint64 id, int done, int total, const QString& stage) {
            if (id == load_id_) emit progress(done, total, stage);
          });
  connect(worker_, &TraceWorker::finished, this, [this](quint64 id) {
    if (id != load_id_) return;
    loading_ = false;
    emit finished();
  });
  connect(worker_, &TraceWorker::failed, this, [this](quint64 id, const LoadError& e) {
    if (id != load_id_) return;
    loading_ = false;
    emit failed(e);
  });
  connect(worker_, &TraceWorker::canceled, this, [this](quint64 id) {
    if (id != load_id_) return;
    loading_ = false;
    emit canceled();
  });
  connect(worker_, &TraceWorker::detailReady, this, [this](quint64 id, DetailPtr d) {
    if (id == detail_id_) emit detailReady(id, std::move(d));
  });
  connect(worker_, &TraceWorker::detailFailed, this, [this](quint64 id, const QString& m) {
    if (id == detail_id_) emit detailFailed(id, m);
  });
  connect(worker_, &TraceWorker::exportDone, this, &TraceSession::exportDone);
  // HDF5 sets itself up on its first call (a few ms): do that while the window is built, not when
  // the first trace is opened.
  connect(
      &thread_, &QThread::started, worker_, [] { h5::quiet(); }, Qt::DirectConnection);
  thread_.start();
}

TraceSession::~TraceSession() {
  worker_->cancelLoad();
  thread_.quit();
  thread_.wait();
}

quint64 TraceSession::load(const LoadRequest& r) {
  load_id_ = next_id_++;
  loading_ = true;
  worker_->post({QStringLiteral("load"), load_id_, r});
  return load_id_;
}

quint64 TraceSession::requestDetail(const DetailRequest& r) {
  detail_id_ = next_id_++;
  worker_->post({QStringLiteral("detail"), detail_id_, r});
  return detail_id_;
}

quint64 TraceSession::requestExport(const ExportRequest& r) {
  const quint64 id = next_id_++;
  worker_->post({QStringLiteral("export:") + r.path, id, r});
  return id;
}

void TraceSession::cancel() {
  if (!loading_) return;
  if (worker_->cancelLoad()) {
    // The current load had not started: nothing on the worker will answer for it.
    loading_ = false;
    load_id_ = next_id_++;
    emit canceled();
  }
}

// ---- TraceWorker -----------------------------------------------------------------------------

TraceWorker::TraceWorker() = default;
TraceWorker::~TraceWorker() = default;

void TraceWorker::post(Request r) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    std::erase_if(queue_, [&](const Request& q) { return q.tag == r.tag; });
    if (std::holds_alternative<LoadRequest>(r.body)) cancel_ = true;  // supersedes a running load
    queue_.push_back(std::move(r));
  }
  QMetaObject::invokeMethod(this, &TraceWorker::drain, Qt::QueuedConnection);
}

bool TraceWorker::cancelLoad() {
  std::lock_guard<std::mutex> lock(mutex_);
  const auto dropped =
      std::erase_if(queue_, [](const Request& q) { return std::holds_alternative<LoadRequest>(q.body); });
  cancel_ = true;
  return dropped > 0;
}

void TraceWorker::drain() {
  for (;;) {
    Request r;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (queue_.empty()) return;
      r = std::move(queue_.front());
      queue_.pop_front();
      if (std::holds_alternative<LoadRequest>(r.body)) cancel_ = false;
    }
    if (auto* l = std::get_if<LoadRequest>(&r.body)) runLoad(r.id, *l);
    if (auto* d = std::get_if<DetailRequest>(&r.body)) runDetail(r.id, *d);
    if (auto* e = std::get_if<ExportRequest>(&r.body)) runExport(*e);
  }
}

TraceReader& TraceWorker::reader(const std::string& path, bool refresh) {
  auto it = readers_.find(path);
  if (it != readers_.end()) {
    if (!refresh) return *it->second;
    try {
      it->second->refresh();
      return *it->second;
    } catch (const std::exception&) {
      readers_.erase(it);  // reopen below: the file may have been replaced
    }
  }
  auto r = std::make_unique<TraceReader>(TraceReader::open(path));
  return *readers_.emplace(path, std::move(r)).first->second;
}

void TraceWorker::runLoad(quint64 id, const LoadRequest& rq) {
  const std::string path_a = rq.path_a.toStdString(), path_b = rq.path_b.toStdString();
  std::string current = path_a;  // the file being read, for messages that do not name it
  auto fail = [&](LoadErrorKind kind, const QString& message, const char* what) {
    emit failed(id, {kind, message, QString::fromStdString(what), !path_b.empty()});
  };
  // Readers of other files go first: one left open on a file under its old name (a recording renamed
  // from NAME.h5.incomplete) would make HDF5 hand the new reader that file's cached, stale state.
  for (auto it = readers_.begin(); it != readers_.end();)
    it = it->first == path_a || it->first == path_b ? std::next(it) : readers_.erase(it);
  try {
    emit progress(id, 0, 0, QStringLiteral("opening %1").arg(rq.path_a));
    // A pair's two seal checks (each hashes its whole file) run side by side: B's on a thread of its
    // own while A is opened. check_seal keeps what it verified, so opening B finds B checked.
    std::future<void> seal_b;
    if (!path_b.empty() && path_b != path_a && !readers_.count(path_b))
      seal_b = std::async(std::launch::async, [path_b] {
        try {
          check_seal(path_b);
        } catch (const std::exception&) {  // opening B below reports it, naming B
        }
      });
    auto summary = std::make_shared<LoadSummary>();
    TraceReader* ra = &reader(path_a, rq.refresh);
    summary->a = trace_info(*ra, rq.step_a);
    TraceReader* rb = nullptr;
    if (!path_b.empty()) {
      current = path_b;
      if (seal_b.valid()) seal_b.get();
      rb = &reader(path_b, rq.refresh);
      summary->b = trace_info(*rb, rq.step_b);
    }
    // A pair's diff report reads what the views read: until the report is made the two readers keep
    // it (kKeepReadBytes each), so that each file is read and decoded once.
    struct KeepReads {
      TraceReader *a, *b;
      ~KeepReads() {
        for (TraceReader* r : {a, b})
          if (r) r->keep_reads(0);
      }
    } keep{rb ? ra : nullptr, rb};
    if (rb) {
      ra->keep_reads(kKeepReadBytes);
      rb->keep_reads(kKeepReadBytes);
    }
    const ModelConfig& cfg = summary->a.config;
    summary->layers = cfg.num_hidden_layers;
    summary->seq_lengths = step_of(summary->a).seq_lengths;
    if (rb) {
      const auto& lb = step_of(*summary->b).seq_lengths;
      if (lb != summary->seq_lengths)
        throw InputError("the traces hold different batches: A step " + std::to_string(rq.step_a) + " has " +
                         std::to_string(summary->seq_lengths.size()) + " sequence(s) of lengths " +
                         lengths_text(summary->seq_lengths) + ", B step " + std::to_string(rq.step_b) + " " +
                         std::to_string(lb.size()) + " of lengths " + lengths_text(lb) +
                         "; compare steps over the same tokens");
      if (summary->b->config.num_hidden_layers != cfg.num_hidden_layers)
        throw InputError("the traces are of models with different layer counts: A " +
                         std::to_string(cfg.num_hidden_layers) + ", B " +
                         std::to_string(summary->b->config.num_hidden_layers));
    }
    // A generation step (in A, else in B) names its requests and where their responses start.
    for (auto [r, step] : {std::pair{ra, rq.step_a}, std::pair{rb, rq.step_b}}) {
      if (!r || !summary->request_ids.empty()) continue;
      if (const auto g = r->generation(step))
        for (const auto& q : g->requests) {
          summary->request_ids.push_back(q.id);
          summary->prompt_lengths.push_back(q.prompt_length);
        }
    }
    if (canceledNow()) return emit canceled(id);
    const SummaryPtr sp = summary;
    emit summaryReady(id, sp);

    const int seqs = int(summary->seq_lengths.size());
    // Kept for the divergences, built once the report is there.
    std::vector<SeqPtr> all_seqs(static_cast<size_t>(seqs));
    std::vector<std::vector<ChunkPtr>> all_chunks(size_t(seqs),
                                                  std::vector<ChunkPtr>(size_t(summary->layers)));
    const int total = seqs * (1 + summary->layers) + (rb ? 1 : 0);
    int done = 0;
    const double tie_factor_a = recorded_tie_factor(step_of(summary->a), summary->a.path);
    const int sa = rq.step_a, sb = rq.step_b;
    for (int s = 0; s < seqs; ++s) {
      if (canceledNow()) return emit canceled(id);
      emit progress(id, done, total, QStringLiteral("sequence %1: tokens and digests").arg(s));
      auto seq = std::make_shared<SeqTokens>();
      seq->seq = s;
      seq->T = summary->seq_lengths[s];
      current = path_a;
      seq->tokens = ra->tokens(sa, s);
      // An external step (another engine's decisions) may hold no log-probs and holds no digests.
      if (ra->has_logprobs(sa, s)) seq->logprobs_a = ra->logprobs(sa, s);
      if (!step_of(summary->a).external()) seq->digests_a = ra->digests(sa, s);
      auto full = ra->full_tensors(sa, s);
      if (rb) {
        current = path_b;
        const auto tokens_b = rb->tokens(sb, s);
        if (tokens_b != seq->tokens) {
          size_t p = 0;
          while (p < tokens_b.size() && p < seq->tokens.size() && tokens_b[p] == seq->tokens[p]) ++p;
          throw InputError("the traces hold different tokens: sequence " + std::to_string(s) +
                           " differs at position " + std::to_string(p) +
                           "; a comparison needs two runs over the same tokens");
        }
        if (rb->has_logprobs(sb, s)) seq->logprobs_b = rb->logprobs(sb, s);
        if (!step_of(*summary->b).external()) seq->digests_b = rb->digests(sb, s);
        const auto full_b = rb->full_tensors(sb, s);
        std::erase_if(
            full, [&](const auto& f) { return std::find(full_b.begin(), full_b.end(), f) == full_b.end(); });
      }
      seq->full_tensors = full;
      const SeqPtr seq_ptr = seq;
      all_seqs[size_t(s)] = seq_ptr;
      emit seqReady(id, seq_ptr);
      ++done;

      for (int layer = 0; layer < summary->layers; ++layer) {
        if (canceledNow()) return emit canceled(id);
        emit progress(id, done, total, QStringLiteral("sequence %1: layer %2").arg(s).arg(layer));
        auto chunk = std::make_shared<LayerChunk>();
        chunk->seq = s;
        chunk->layer = layer;
        current = path_a;
        chunk->a = read_records(*ra, sa, s, layer);
        if (rb) {
          current = path_b;
          chunk->b = read_records(*rb, sb, s, layer);
        }
        const int64_t T = seq->T;
        auto& v = chunk->values;
        const std::vector<float> none(size_t(T), kNoValue);
        const LayerRecords &A = chunk->a, &B = chunk->b;
        if (A.indexer) {
          v[int(Metric::IndexerMargin)] =
              min_margin(A.indexer->margin, rb && B.indexer ? &B.indexer->margin : nullptr);
          chunk->indexer_tie_threshold = single_trace_tie_threshold(A.indexer->margin, tie_factor_a);
        } else {
          v[int(Metric::IndexerMargin)] = none;
        }
        if (A.routing) {
          v[int(Metric::RouterMargin)] =
              min_margin(A.routing->margin, rb && B.routing ? &B.routing->margin : nullptr);
          chunk->router_tie_threshold = single_trace_tie_threshold(A.routing->margin, tie_factor_a);
        } else {
          v[int(Metric::RouterMargin)] = none;
        }
        if (rb) {
          v[int(Metric::IndexerOverlap)] =
              A.indexer && B.indexer ? indexer_overlap(*A.indexer, *B.indexer) : none;
          v[int(Metric::RoutingAgreement)] =
              A.routing && B.routing ? routing_agreement(*A.routing, *B.routing) : none;
          v[int(Metric::MhcDifference)] = mhc_difference(A, B, T);
          v[int(Metric::TensorDigest)] = digest_difference(seq->digests_a, seq->digests_b, layer, T);
          std::vector<float> rel = none;
          std::vector<int16_t> argmax;
          for (const auto& [name, l] : seq->full_tensors) {
            if (l != layer) continue;
            current = path_a;
            const auto ta = ra->tensor(sa, s, layer, name);
            current = path_b;
            const auto tb = rb->tensor(sb, s, layer, name);
            if (!ta || !tb || ta->shape.empty() || ta->shape[0] != T || ta->shape != tb->shape) continue;
            const auto r = row_rel_l2(*ta, *tb);
            const auto k = int16_t(chunk->rel_l2_tensors.size());
            chunk->rel_l2_tensors.push_back(name);
            if (argmax.empty()) argmax.assign(size_t(T), -1);
            // A tie keeps the tensor read first.
            for (int64_t t = 0; t < T; ++t)
              if (std::isnan(rel[t]) || r[t] > rel[t]) rel[t] = r[t], argmax[t] = k;
          }
          v[int(Metric::TensorRelL2)] = std::move(rel);
          chunk->rel_l2_argmax = std::move(argmax);
          chunk->flips = decision_flips(A, B);
        } else {
          v[int(Metric::ExpertLoad)] = A.routing ? expert_load(*A.routing, cfg.n_routed_experts)
                                                 : std::vector<float>(size_t(cfg.n_routed_experts), kNoValue);
        }
        // Keep a padded row per metric so the view can index any token.
        for (int m = 0; m < kMetricCount; ++m) {
          const auto& info = metric_info(Metric(m));
          const bool offered = rb ? info.comparison : info.single;
          if (!offered) {
            v[m].clear();
            continue;
          }
          const size_t want = info.axis == MetricAxis::Tokens ? size_t(T) : size_t(cfg.n_routed_experts);
          v[m].resize(want, kNoValue);
        }
        const ChunkPtr cp = chunk;
        if (rb) all_chunks[size_t(s)][size_t(layer)] = cp;
        emit chunkReady(id, cp);
        ++done;
      }
    }
    if (rb) {
      if (canceledNow()) return emit canceled(id);
      emit progress(id, done, total, QStringLiteral("computing the diff report"));
      current = path_a;
      DiffOptions opt;
      opt.step_a = sa;
      opt.step_b = sb;
      opt.allow_model_mismatch = rq.allow_model_mismatch;
      auto report = std::make_shared<DiffReport>(diff_traces(*ra, *rb, opt));
      const ReportPtr rp = report;
      emit reportReady(id, rp);
      if (canceledNow()) return emit canceled(id);
      emit divergencesReady(id, std::make_shared<const DivergenceList>(
                                    build_divergences(*summary, all_seqs, all_chunks, *report)));
      ++done;
    }
    emit progress(id, total, total, QStringLiteral("loaded"));
    emit finished(id);
  } catch (const UnsupportedTraceVersion& e) {
    fail(LoadErrorKind::UnsupportedVersion, with_path(current, e.what()), e.what());
  } catch (const NotATrace& e) {
    fail(LoadErrorKind::NotATrace, with_path(current, e.what()), e.what());
  } catch (const TraceIncomplete& e) {
    fail(LoadErrorKind::Incomplete, with_path(current, e.what()), e.what());
  } catch (const TraceError& e) {
    fail(LoadErrorKind::Corrupt, damaged_message(current, e.what()), e.what());
  } catch (const InputError& e) {
    QString msg = QString::fromStdString(e.what());
    if (msg.contains(QStringLiteral("allow a model mismatch")))
      msg += QStringLiteral(" (File ▸ Allow model mismatch)");
    fail(LoadErrorKind::Mismatch, msg, e.what());
  } catch (const std::exception& e) {
    fail(LoadErrorKind::Other, with_path(current, e.what()), e.what());
  }
}

void TraceWorker::runDetail(quint64 id, const DetailRequest& rq) {
  try {
    if (!rq.summary || !rq.seq || !rq.chunk) throw InputError("nothing loaded");
    const LoadSummary& s = *rq.summary;
    const int seq = rq.chunk->seq, layer = rq.chunk->layer;
    std::vector<TensorRowPair> rows;
    auto cached = [&](const TraceInfo& info, const std::string& name) -> std::shared_ptr<const TensorCopy> {
      const std::string key = info.path + "|" + std::to_string(info.step) + "|" + std::to_string(seq) + "|" +
                              std::to_string(layer) + "|" + name;
      if (auto it = tensor_cache_.find(key); it != tensor_cache_.end()) return it->second;
      if (tensor_cache_.size() >= 4) tensor_cache_.clear();  // bounded: a full tensor can be large
      auto t = reader(info.path, false).tensor(info.step, seq, layer, name);
      auto p = t ? std::make_shared<const TensorCopy>(std::move(*t)) : nullptr;
      tensor_cache_[key] = p;
      return p;
    };
    for (const auto& [name, l] : rq.seq->full_tensors) {
      if (l != layer) continue;
      const auto ta = cached(s.a, name);
      if (!ta || ta->shape.empty()) continue;
      const int64_t row = tensor_row_for(s.a.config, name, layer, ta->shape[0], rq.seq->T, rq.token);
      if (row < 0) continue;
      TensorRowPair p;
      p.name = name;
      p.dtype = ta->dtype;
      p.row = row;
      p.a = row_values(*ta, row);
      if (s.b) {
        const auto tb = cached(*s.b, name);
        if (!tb || tb->shape != ta->shape) continue;
        p.b = row_values(*tb, row);
      }
      rows.push_back(std::move(p));
    }
    auto d =
        std::make_shared<CellDetail>(cell_detail(s, *rq.seq, *rq.chunk, rq.report.get(), rq.token, rows));
    emit detailReady(id, DetailPtr(std::move(d)));
  } catch (const std::exception& e) {
    emit detailFailed(id, QString::fromStdString(e.what()));
  }
}

void TraceWorker::runExport(const ExportRequest& r) {
  QString error;
  try {
    switch (r.kind) {
      case ExportRequest::Kind::Png:
        if (!r.image.save(r.path, "PNG")) error = QStringLiteral("cannot write %1").arg(r.path);
        break;
      case ExportRequest::Kind::Json: {
        if (!r.report) throw InputError("no diff report (open two traces)");
        QFile f(r.path);
        if (!f.open(QIODevice::WriteOnly | QIODevice::Truncate)) {
          error = QStringLiteral("cannot write %1: %2").arg(r.path, f.errorString());
          break;
        }
        const std::string json = diff_to_json(*r.report);
        if (f.write(json.data(), qint64(json.size())) != qint64(json.size()))
          error = QStringLiteral("cannot write %1: %2").arg(r.path, f.errorString());
        break;
      }
      case ExportRequest::Kind::Csv:
        if (!r.report) throw InputError("no diff report (open two traces)");
        diff_to_csv(*r.report, r.path.toStdString());
        break;
    }
  } catch (const std::exception& e) {
    error = QString::fromStdString(e.what());
  }
  emit exportDone(r.path, error);
}

}  // namespace dsv4::gui
