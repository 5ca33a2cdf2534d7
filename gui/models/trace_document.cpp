#include "gui/models/trace_document.h"

#include <QDateTime>
#include <QFileInfo>

namespace dsv4::gui {

namespace {

// NAME.h5.incomplete that is gone while NAME.h5 exists: the recorder closed it (DESIGN.md §5, the
// rename on clean close); the path itself otherwise.
QString finished_path(const QString& path) {
  static const QString suffix = QStringLiteral(".incomplete");
  if (!path.endsWith(suffix) || QFileInfo::exists(path)) return path;
  const QString done = path.chopped(suffix.size());
  return QFileInfo::exists(done) ? done : path;
}

}  // namespace

TraceDocument::TraceDocument(QObject* parent) : QObject(parent) {
  connect(&session_, &TraceSession::summaryReady, this, [this](SummaryPtr s) {
    data_ = Dataset{};
    data_.summary = std::move(s);
    const int seqs = data_.seq_count();
    data_.seqs.assign(size_t(seqs), nullptr);
    data_.chunks.assign(size_t(seqs), std::vector<ChunkPtr>(size_t(data_.layers())));
    emit datasetReset();
  });
  connect(&session_, &TraceSession::seqReady, this, [this](SeqPtr s) {
    const int seq = s->seq;
    if (seq < 0 || seq >= int(data_.seqs.size())) return;
    data_.seqs[seq] = std::move(s);
    emit seqLoaded(seq);
  });
  connect(&session_, &TraceSession::chunkReady, this, [this](ChunkPtr c) {
    const int seq = c->seq, layer = c->layer;
    if (seq < 0 || seq >= int(data_.chunks.size()) || layer < 0 || layer >= int(data_.chunks[seq].size()))
      return;
    data_.chunks[seq][layer] = std::move(c);
    emit chunkLoaded(seq, layer);
  });
  connect(&session_, &TraceSession::reportReady, this, [this](ReportPtr r) {
    data_.report = std::move(r);
    emit reportLoaded();
  });
  connect(&session_, &TraceSession::divergencesReady, this, [this](DivergencesPtr d) {
    data_.divergences = std::move(d);
    emit divergencesLoaded();
  });
  connect(&session_, &TraceSession::progress, this, &TraceDocument::loadProgress);
  connect(&session_, &TraceSession::finished, this, [this] {
    data_.complete = true;
    emit loadFinished();
  });
  connect(&session_, &TraceSession::failed, this, [this](const LoadError& e) {
    // Never leave a half-loaded dataset: what arrived of the failed load goes.
    if (data_.summary && !data_.complete) {
      data_ = Dataset{};
      emit datasetReset();
    }
    emit loadFailed(e);
  });
  connect(&session_, &TraceSession::canceled, this, &TraceDocument::loadCanceled);
  connect(&session_, &TraceSession::detailReady, this,
          [this](quint64, DetailPtr d) { emit detailReady(std::move(d)); });
  connect(&session_, &TraceSession::detailFailed, this,
          [this](quint64, const QString& m) { emit detailFailed(m); });
  connect(&session_, &TraceSession::exportDone, this, &TraceDocument::exportDone);
  connect(&follow_, &QTimer::timeout, this, [this] {
    if (request_.path_a.isEmpty() || session_.loading()) return;
    if (stamp() != loaded_stamp_) emit filesChanged();
  });
}

void TraceDocument::setFollow(bool on, int interval_ms) {
  if (!on) return follow_.stop();
  follow_.start(interval_ms);
}

QString TraceDocument::stamp() const {
  QString s;
  for (const QString& p : {request_.path_a, request_.path_b}) {
    if (p.isEmpty()) continue;
    const QFileInfo f(finished_path(p));
    s += QStringLiteral("%1|%2|%3|%4;")
             .arg(f.filePath())
             .arg(f.exists() ? f.size() : -1)
             .arg(f.exists() ? f.lastModified().toMSecsSinceEpoch() : 0)
             .arg(f.exists() ? f.metadataChangeTime().toMSecsSinceEpoch() : 0);
  }
  return s;
}

void TraceDocument::open(const QString& a, const QString& b, int step_a, int step_b) {
  request_ = LoadRequest{a, b, step_a, step_b, false, allow_model_mismatch_};
  loaded_stamp_ = stamp();
  session_.load(request_);
}

void TraceDocument::reload() {
  if (request_.path_a.isEmpty()) return;
  const QString a = finished_path(request_.path_a);
  const QString b = request_.path_b.isEmpty() ? request_.path_b : finished_path(request_.path_b);
  request_.allow_model_mismatch = allow_model_mismatch_;
  if (a != request_.path_a || b != request_.path_b) {
    request_.path_a = a;
    request_.path_b = b;
    emit pathsChanged();
  }
  LoadRequest r = request_;
  r.refresh = true;
  loaded_stamp_ = stamp();
  session_.load(r);
}

void TraceDocument::adopt(Dataset d) {
  session_.cancel();
  data_ = Dataset{};
  data_.summary = d.summary;
  const int seqs = data_.seq_count();
  data_.seqs.assign(size_t(seqs), nullptr);
  data_.chunks.assign(size_t(seqs), std::vector<ChunkPtr>(size_t(data_.layers())));
  emit datasetReset();
  for (int s = 0; s < seqs && s < int(d.seqs.size()); ++s) {
    data_.seqs[s] = d.seqs[s];
    if (data_.seqs[s]) emit seqLoaded(s);
    for (int l = 0; l < data_.layers() && s < int(d.chunks.size()) && l < int(d.chunks[s].size()); ++l) {
      data_.chunks[s][l] = d.chunks[s][l];
      if (data_.chunks[s][l]) emit chunkLoaded(s, l);
    }
  }
  if (d.report) {
    data_.report = d.report;
    emit reportLoaded();
    data_.divergences = d.divergences ? d.divergences
                                      : std::make_shared<const DivergenceList>(build_divergences(
                                            *data_.summary, data_.seqs, data_.chunks, *data_.report));
    emit divergencesLoaded();
  }
  data_.complete = true;
  emit loadFinished();
}

void TraceDocument::cancel() {
  session_.cancel();
}

bool TraceDocument::requestDetail(int seq, int layer, int64_t token) {
  const LayerChunk* c = data_.chunk(seq, layer);
  const SeqTokens* s = data_.seq_tokens(seq);
  if (!c || !s || token < 0 || token >= s->T) return false;
  DetailRequest r;
  r.summary = data_.summary;
  r.seq = data_.seqs[seq];
  r.chunk = data_.chunks[seq][layer];
  r.report = data_.report;
  r.token = token;
  session_.requestDetail(r);
  return true;
}

void TraceDocument::exportImage(const QImage& image, const QString& path) {
  ExportRequest r;
  r.kind = ExportRequest::Kind::Png;
  r.path = path;
  r.image = image;
  session_.requestExport(r);
}

void TraceDocument::exportReport(const QString& path, ExportRequest::Kind kind) {
  ExportRequest r;
  r.kind = kind;
  r.path = path;
  r.report = data_.report;
  session_.requestExport(r);
}

}  // namespace dsv4::gui
