// The one background thread that owns trace reading and diff computation (DESIGN.md §7).
//
// The UI thread posts tagged requests to a TraceSession; the worker runs them one at a time in the
// order posted, and a request replaces any queued, not yet started request with the same tag (a new
// "load" also cancels the load in progress; a new "detail" for another cell replaces the one waiting).
// Results come back as typed, immutable values through queued signals, so every slot runs on the UI
// thread. A load reports in stages: summary (both traces' metadata and the shape of the data), then
// per sequence its tokens and digests, then per (sequence, layer) the decisions and every metric row,
// then (comparison) the DiffReport and the divergences built from it; progress and failure signals come
// alongside. Results of a load that was superseded or cancelled are dropped here and never reach the
// receivers.
#pragma once

#include <QImage>
#include <QObject>
#include <QString>
#include <QThread>
#include <atomic>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <variant>

#include "gui/models/dataset.h"
#include "gui/models/divergences.h"
#include "gui/models/metrics.h"

namespace dsv4::gui {

using DetailPtr = std::shared_ptr<const CellDetail>;

struct LoadRequest {
  QString path_a, path_b;  // path_b empty: single-trace mode
  int step_a = 0, step_b = 0;
  bool refresh = false;               // re-read the step lists of files already open (a trace being written)
  bool allow_model_mismatch = false;  // compare traces of different weights (DiffOptions)
};

struct DetailRequest {
  SummaryPtr summary;
  SeqPtr seq;
  ChunkPtr chunk;
  ReportPtr report;  // may be null
  int64_t token = 0;
};

struct ExportRequest {
  enum class Kind { Png, Json, Csv } kind = Kind::Png;
  QString path;      // file, or directory for Csv
  QImage image;      // Png
  ReportPtr report;  // Json, Csv
};

// What kind of problem stopped a load; the message names the file and the problem.
enum class LoadErrorKind { NotATrace, UnsupportedVersion, Incomplete, Corrupt, Mismatch, Other };
struct LoadError {
  LoadErrorKind kind = LoadErrorKind::Other;
  QString message;    // one or two sentences: the file, the problem, what to do
  QString details;    // the library's full message (HDF5's error stack for a damaged file)
  bool pair = false;  // the load was of two traces
};

class TraceWorker;

class TraceSession : public QObject {
  Q_OBJECT
 public:
  explicit TraceSession(QObject* parent = nullptr);
  ~TraceSession() override;  // cancels the load in progress and joins the thread

  // Each returns the request's id. Posting a load drops every result of earlier loads.
  quint64 load(const LoadRequest& r);
  quint64 requestDetail(const DetailRequest& r);
  quint64 requestExport(const ExportRequest& r);
  void cancel();  // the load in progress stops at its next stage boundary; canceled() follows

  quint64 currentLoad() const { return load_id_; }
  bool loading() const { return loading_; }

 signals:
  void summaryReady(dsv4::gui::SummaryPtr s);
  void seqReady(dsv4::gui::SeqPtr s);
  void chunkReady(dsv4::gui::ChunkPtr c);
  void reportReady(dsv4::gui::ReportPtr r);
  void divergencesReady(dsv4::gui::DivergencesPtr d);
  void progress(int done, int total, const QString& stage);
  void finished();
  void failed(const dsv4::gui::LoadError& e);
  void canceled();
  void detailReady(quint64 id, dsv4::gui::DetailPtr d);
  void detailFailed(quint64 id, const QString& message);
  void exportDone(const QString& path, const QString& error);  // error empty on success

 private:
  QThread thread_;
  TraceWorker* worker_;  // lives on thread_, deleted when it finishes
  quint64 next_id_ = 1;
  quint64 load_id_ = 0;
  quint64 detail_id_ = 0;
  bool loading_ = false;
};

// Runs on the session's thread. Public only so that the session can connect to it.
class TraceWorker : public QObject {
  Q_OBJECT
 public:
  struct Request {
    QString tag;
    quint64 id = 0;
    std::variant<LoadRequest, DetailRequest, ExportRequest> body;
  };
  TraceWorker();
  ~TraceWorker() override;

  // Thread-safe: queue r (replacing a queued request with r's tag) and wake the worker.
  void post(Request r);
  // Thread-safe: stop the running load and drop queued ones; true when a queued load was dropped.
  bool cancelLoad();

 signals:
  void summaryReady(quint64 id, dsv4::gui::SummaryPtr s);
  void seqReady(quint64 id, dsv4::gui::SeqPtr s);
  void chunkReady(quint64 id, dsv4::gui::ChunkPtr c);
  void reportReady(quint64 id, dsv4::gui::ReportPtr r);
  void divergencesReady(quint64 id, dsv4::gui::DivergencesPtr d);
  void progress(quint64 id, int done, int total, const QString& stage);
  void finished(quint64 id);
  void failed(quint64 id, const dsv4::gui::LoadError& e);
  void canceled(quint64 id);
  void detailReady(quint64 id, dsv4::gui::DetailPtr d);
  void detailFailed(quint64 id, const QString& message);
  void exportDone(const QString& path, const QString& error);

 private:
  void drain();
  void runLoad(quint64 id, const LoadRequest& r);
  void runDetail(quint64 id, const DetailRequest& r);
  void runExport(const ExportRequest& r);
  TraceReader& reader(const std::string& path, bool refresh);
  bool canceledNow() const { return cancel_.load(std::memory_order_relaxed); }

  std::mutex mutex_;
  std::deque<Request> queue_;
  std::atomic<bool> cancel_{false};
  std::map<std::string, std::unique_ptr<TraceReader>> readers_;  // worker thread only
  // The last full tensors read for a detail: (path, step, seq, layer, name) → tensor.
  std::map<std::string, std::shared_ptr<const TensorCopy>> tensor_cache_;
};

}  // namespace dsv4::gui

Q_DECLARE_METATYPE(dsv4::gui::SummaryPtr)
Q_DECLARE_METATYPE(dsv4::gui::SeqPtr)
Q_DECLARE_METATYPE(dsv4::gui::ChunkPtr)
Q_DECLARE_METATYPE(dsv4::gui::ReportPtr)
Q_DECLARE_METATYPE(dsv4::gui::DetailPtr)
Q_DECLARE_METATYPE(dsv4::gui::DivergencesPtr)
Q_DECLARE_METATYPE(dsv4::gui::LoadError)
