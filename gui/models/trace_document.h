// The UI-thread side of a view: the Dataset of what is open, filled stage by stage from the
// TraceSession's results, plus the request that produced it (for reload). Models observe it.
#pragma once

#include <QObject>
#include <QString>
#include <QTimer>

#include "gui/models/dataset.h"
#include "gui/models/trace_session.h"

namespace dsv4::gui {

class TraceDocument : public QObject {
  Q_OBJECT
 public:
  explicit TraceDocument(QObject* parent = nullptr);

  // Starts loading; the current dataset stays until the new one's summary arrives. A load that fails
  // after its summary arrived leaves an empty dataset (datasetReset with no summary), never a
  // half-loaded one.
  void open(const QString& a, const QString& b = {}, int step_a = 0, int step_b = 0);
  // The same files again, re-reading their step lists (a trace being written). A file opened as
  // NAME.h5.incomplete whose recorder has since finished (renamed it to NAME.h5) is followed.
  void reload();
  // Following a recording: while on, the open files are looked at every `interval_ms` (their size and
  // modification time, and whether NAME.h5.incomplete became NAME.h5); when they changed since the
  // last load started and no load is running, filesChanged() is emitted (the window reloads, keeping
  // the selected cell). A closed trace never changes, so this costs one stat per file and tick.
  void setFollow(bool on, int interval_ms = 1000);
  bool follow() const { return follow_.isActive(); }
  // Compare traces of different weights (DiffOptions::allow_model_mismatch); applies to later loads.
  void setAllowModelMismatch(bool on) { allow_model_mismatch_ = on; }
  bool allowModelMismatch() const { return allow_model_mismatch_; }
  void cancel();
  bool loading() const { return session_.loading(); }
  const LoadRequest& lastRequest() const { return request_; }

  const Dataset& data() const { return data_; }
  // Shows a dataset built elsewhere (synthetic data for benchmarks and tests): replaces the current
  // one and emits the signals of a load (datasetReset, seqLoaded, chunkLoaded, reportLoaded,
  // loadFinished). Detail requests for it need its files, so only the overview and tables work.
  void adopt(Dataset d);

  // Asks the worker for the detail of (seq, layer, token); detailReady follows, unless a newer
  // request supersedes this one. False when that cell is not loaded yet.
  bool requestDetail(int seq, int layer, int64_t token);
  // Saves through the worker thread; exportDone follows.
  void exportImage(const QImage& image, const QString& path);
  void exportReport(const QString& path, ExportRequest::Kind kind);

  TraceSession& session() { return session_; }

 signals:
  void datasetReset();  // a new summary replaced everything (or a failed load emptied it)
  void pathsChanged();  // reload followed a finished recording to its new name (lastRequest())
  void seqLoaded(int seq);
  void chunkLoaded(int seq, int layer);
  void reportLoaded();
  void divergencesLoaded();  // data().divergences is set (comparison mode)
  void loadProgress(int done, int total, const QString& stage);
  void loadFinished();
  void loadFailed(const dsv4::gui::LoadError& e);
  void loadCanceled();
  void detailReady(dsv4::gui::DetailPtr d);
  void detailFailed(const QString& message);
  void exportDone(const QString& path, const QString& error);
  void filesChanged();  // following: the open files changed on disk (setFollow)

 private:
  QString stamp() const;  // what the files on disk look like now (paths, sizes, times)
  TraceSession session_;
  LoadRequest request_;
  Dataset data_;
  bool allow_model_mismatch_ = false;
  QTimer follow_;
  QString loaded_stamp_;  // stamp() when the last load started
};

}  // namespace dsv4::gui
