// Table models over the loaded data: per-token log-probs, the diff report (summary, layers, tensors),
// the two environments, and the tables of the detail panel (indexer sets, experts, worst elements).
#pragma once

#include <QAbstractTableModel>
#include <QColor>
#include <QStringList>
#include <vector>

#include "gui/models/trace_document.h"

namespace dsv4::gui {

// Where an id of the detail panel's sets belongs; shared colours of the detail views.
enum class SetSide { Common, OnlyA, OnlyB };
QColor set_color(SetSide s);
QString set_label(SetSide s, bool comparison);

// One row per log-prob row t of the current sequence (the prediction of token t + 1).
class TokenModel : public QAbstractTableModel {
  Q_OBJECT
 public:
  enum Column { Position, NextToken, LogprobA, LogprobB, AbsDiff, Ratio };
  explicit TokenModel(TraceDocument* doc, QObject* parent = nullptr);
  int rowCount(const QModelIndex& parent = {}) const override;
  int columnCount(const QModelIndex& parent = {}) const override;
  QVariant data(const QModelIndex& index, int role = Qt::DisplayRole) const override;
  QVariant headerData(int section, Qt::Orientation o, int role = Qt::DisplayRole) const override;
  void setSeq(int seq);
  int seq() const { return seq_; }
  const SeqTokens* tokens() const;
  bool comparison() const { return doc_->data().comparison(); }

 private:
  TraceDocument* doc_;
  int seq_ = 0;
};

// Key/value lines of the diff report (comparison) or of the trace (single mode).
class SummaryModel : public QAbstractTableModel {
  Q_OBJECT
 public:
  explicit SummaryModel(TraceDocument* doc, QObject* parent = nullptr);
  int rowCount(const QModelIndex& parent = {}) const override;
  int columnCount(const QModelIndex& parent = {}) const override;
  QVariant data(const QModelIndex& index, int role = Qt::DisplayRole) const override;
  QVariant headerData(int section, Qt::Orientation o, int role = Qt::DisplayRole) const override;
  // The value of the line named `key`, empty when absent (for tests and copy-paste).
  QString value(const QString& key) const;

 private:
  void rebuild();
  TraceDocument* doc_;
  std::vector<std::pair<QString, QString>> lines_;
};

// DiffReport::layers, one row per layer.
class LayerDiffModel : public QAbstractTableModel {
  Q_OBJECT
 public:
  explicit LayerDiffModel(TraceDocument* doc, QObject* parent = nullptr);
  int rowCount(const QModelIndex& parent = {}) const override;
  int columnCount(const QModelIndex& parent = {}) const override;
  QVariant data(const QModelIndex& index, int role = Qt::DisplayRole) const override;
  QVariant headerData(int section, Qt::Orientation o, int role = Qt::DisplayRole) const override;

 private:
  TraceDocument* doc_;
};

// DiffReport::tensors, one row per (tensor, layer) in execution order.
class TensorDiffModel : public QAbstractTableModel {
  Q_OBJECT
 public:
  explicit TensorDiffModel(TraceDocument* doc, QObject* parent = nullptr);
  int rowCount(const QModelIndex& parent = {}) const override;
  int columnCount(const QModelIndex& parent = {}) const override;
  QVariant data(const QModelIndex& index, int role = Qt::DisplayRole) const override;
  QVariant headerData(int section, Qt::Orientation o, int role = Qt::DisplayRole) const override;

 private:
  TraceDocument* doc_;
};

// Both environments side by side: the /meta/env keys, then trace and step attributes. Rows whose
// values differ carry DiffersRole = true and a highlighted background.
class EnvModel : public QAbstractTableModel {
  Q_OBJECT
 public:
  enum Role { DiffersRole = Qt::UserRole + 1 };
  explicit EnvModel(TraceDocument* doc, QObject* parent = nullptr);
  int rowCount(const QModelIndex& parent = {}) const override;
  int columnCount(const QModelIndex& parent = {}) const override;
  QVariant data(const QModelIndex& index, int role = Qt::DisplayRole) const override;
  QVariant headerData(int section, Qt::Orientation o, int role = Qt::DisplayRole) const override;
  int differingRows() const;

 private:
  struct Row {
    QString key, a, b;
    bool differs = false;
  };
  void rebuild();
  TraceDocument* doc_;
  std::vector<Row> rows_;
};

// The GPU kernel launches of the step shown (CUPTI records): one row per launch. Comparing two
// traces, the launches side by side in launch order with the first difference in name, grid, block or
// shared memory marked (what `dsv4 replay --device cuda` compares); rows past the shorter sequence
// are differences too. Without records a single row says why.
class KernelModel : public QAbstractTableModel {
  Q_OBJECT
 public:
  enum Role { DiffersRole = Qt::UserRole + 1 };
  explicit KernelModel(TraceDocument* doc, QObject* parent = nullptr);
  int rowCount(const QModelIndex& parent = {}) const override;
  int columnCount(const QModelIndex& parent = {}) const override;
  QVariant data(const QModelIndex& index, int role = Qt::DisplayRole) const override;
  QVariant headerData(int section, Qt::Orientation o, int role = Qt::DisplayRole) const override;
  // Launch index of the first difference (comparison mode), -1 when none or not comparable.
  int firstDifference() const { return first_difference_; }
  int launches() const { return launches_; }

 private:
  struct Row {
    QStringList cells;
    bool differs = false;
  };
  void rebuild();
  TraceDocument* doc_;
  std::vector<Row> rows_;
  int first_difference_ = -1, launches_ = 0;
};

// The indexer sets of one cell: one row per group selected by A or B.
class IndexerSetModel : public QAbstractTableModel {
  Q_OBJECT
 public:
  enum Role { SideRole = Qt::UserRole + 1 };  // int(SetSide)
  explicit IndexerSetModel(QObject* parent = nullptr);
  void setDetail(DetailPtr d);
  int rowCount(const QModelIndex& parent = {}) const override;
  int columnCount(const QModelIndex& parent = {}) const override;
  QVariant data(const QModelIndex& index, int role = Qt::DisplayRole) const override;
  QVariant headerData(int section, Qt::Orientation o, int role = Qt::DisplayRole) const override;

 private:
  DetailPtr detail_;
  std::vector<std::pair<int32_t, SetSide>> rows_;
};

// The experts of one cell: the union of A's and B's, with their weights.
class ExpertModel : public QAbstractTableModel {
  Q_OBJECT
 public:
  enum Role { SideRole = Qt::UserRole + 1 };
  explicit ExpertModel(QObject* parent = nullptr);
  void setDetail(DetailPtr d);
  int rowCount(const QModelIndex& parent = {}) const override;
  int columnCount(const QModelIndex& parent = {}) const override;
  QVariant data(const QModelIndex& index, int role = Qt::DisplayRole) const override;
  QVariant headerData(int section, Qt::Orientation o, int role = Qt::DisplayRole) const override;

 private:
  DetailPtr detail_;
};

// The largest element differences of one full tensor's row (CellDetail::tensors[tensor]).
class WorstElementsModel : public QAbstractTableModel {
  Q_OBJECT
 public:
  explicit WorstElementsModel(QObject* parent = nullptr);
  void setDetail(DetailPtr d, int tensor);
  int rowCount(const QModelIndex& parent = {}) const override;
  int columnCount(const QModelIndex& parent = {}) const override;
  QVariant data(const QModelIndex& index, int role = Qt::DisplayRole) const override;
  QVariant headerData(int section, Qt::Orientation o, int role = Qt::DisplayRole) const override;

 private:
  const TensorDetail* tensor() const;
  DetailPtr detail_;
  int tensor_ = -1;
};

}  // namespace dsv4::gui
