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

// The base of the table models below: each describes its columns (the headers of the columns shown,
// which may depend on single or comparison mode) and its row count; the base answers rowCount,
// columnCount and the horizontal header from them, so the three never disagree.
class ColumnTableModel : public QAbstractTableModel {
  Q_OBJECT
 public:
  using QAbstractTableModel::QAbstractTableModel;
  int rowCount(const QModelIndex& parent = {}) const final;
  int columnCount(const QModelIndex& parent = {}) const final;
  QVariant headerData(int section, Qt::Orientation o, int role = Qt::DisplayRole) const final;

  virtual int rows() const = 0;
  virtual QStringList columns() const = 0;  // the header of each column shown
};

// One row per log-prob row t of the current sequence (the prediction of token t + 1).
class TokenModel : public ColumnTableModel {
  Q_OBJECT
 public:
  enum Column { Position, NextToken, LogprobA, LogprobB, AbsDiff, Ratio };
  explicit TokenModel(TraceDocument* doc, QObject* parent = nullptr);
  QVariant data(const QModelIndex& index, int role = Qt::DisplayRole) const override;
  int rows() const override;
  QStringList columns() const override;
  void setSeq(int seq);
  int seq() const { return seq_; }
  const SeqTokens* tokens() const;
  bool comparison() const { return doc_->data().comparison(); }

 private:
  TraceDocument* doc_;
  int seq_ = 0;
};

// Key/value lines of the diff report (comparison) or of the trace (single mode).
class SummaryModel : public ColumnTableModel {
  Q_OBJECT
 public:
  explicit SummaryModel(TraceDocument* doc, QObject* parent = nullptr);
  QVariant data(const QModelIndex& index, int role = Qt::DisplayRole) const override;
  int rows() const override;
  QStringList columns() const override;
  // The value of the line named `key`, empty when absent (for tests and copy-paste).
  QString value(const QString& key) const;

 private:
  void rebuild();
  TraceDocument* doc_;
  std::vector<std::pair<QString, QString>> lines_;
};

// A table over the diff report: reset when the dataset or the report changes.
class ReportTableModel : public ColumnTableModel {
  Q_OBJECT
 public:
  explicit ReportTableModel(TraceDocument* doc, QObject* parent = nullptr);

 protected:
  const DiffReport* report() const;  // nullptr until the report is loaded
  TraceDocument* doc_;
};

// DiffReport::layers, one row per layer.
class LayerDiffModel : public ReportTableModel {
  Q_OBJECT
 public:
  using ReportTableModel::ReportTableModel;
  QVariant data(const QModelIndex& index, int role = Qt::DisplayRole) const override;
  int rows() const override;
  QStringList columns() const override;
};

// DiffReport::tensors, one row per (tensor, layer) in execution order.
class TensorDiffModel : public ReportTableModel {
  Q_OBJECT
 public:
  using ReportTableModel::ReportTableModel;
  int rows() const override;
  QStringList columns() const override;
  QVariant data(const QModelIndex& index, int role = Qt::DisplayRole) const override;
};

// A table rebuilt from the document's dataset whenever the dataset is reset; rows whose values differ
// between A and B carry DiffersRole = true.
class DatasetTableModel : public ColumnTableModel {
  Q_OBJECT
 public:
  enum Role { DiffersRole = Qt::UserRole + 1 };
  explicit DatasetTableModel(TraceDocument* doc, QObject* parent = nullptr);

 protected:
  virtual void rebuild() = 0;
  TraceDocument* doc_;
};

// Both environments side by side: the /meta/env keys, then trace and step attributes. Rows whose
// values differ carry DiffersRole = true and a highlighted background.
class EnvModel : public DatasetTableModel {
  Q_OBJECT
 public:
  using DatasetTableModel::DatasetTableModel;
  QVariant data(const QModelIndex& index, int role = Qt::DisplayRole) const override;
  int rows() const override;
  QStringList columns() const override;
  int differingRows() const;

 private:
  struct Row {
    QString key, a, b;
    bool differs = false;
  };
  void rebuild() override;
  std::vector<Row> rows_;
};

// The GPU kernel launches of the step shown (CUPTI records): one row per launch. Comparing two
// traces, the launches side by side in launch order with the first difference in name, grid, block or
// shared memory marked (what `dsv4 replay --device cuda` compares); rows past the shorter sequence
// are differences too. Without records a single row says why.
class KernelModel : public DatasetTableModel {
  Q_OBJECT
 public:
  using DatasetTableModel::DatasetTableModel;
  QVariant data(const QModelIndex& index, int role = Qt::DisplayRole) const override;
  int rows() const override;
  QStringList columns() const override;
  // Launch index of the first difference (comparison mode), -1 when none or not comparable.
  int firstDifference() const { return first_difference_; }
  int launches() const { return launches_; }

 private:
  struct Row {
    QStringList cells;
    bool differs = false;
  };
  void rebuild() override;
  std::vector<Row> rows_;
  int first_difference_ = -1, launches_ = 0;
};

// The tables of one cell's sets (indexer groups, experts): SideRole gives a row's int(SetSide).
class SetTableModel : public ColumnTableModel {
  Q_OBJECT
 public:
  enum Role { SideRole = Qt::UserRole + 1 };  // int(SetSide)
  explicit SetTableModel(QObject* parent = nullptr);
  void setDetail(DetailPtr d);

 protected:
  virtual void detail_changed() {}  // inside the model reset of setDetail
  DetailPtr detail_;
};

// The indexer sets of one cell: one row per group selected by A or B.
class IndexerSetModel : public SetTableModel {
  Q_OBJECT
 public:
  using SetTableModel::SetTableModel;
  QVariant data(const QModelIndex& index, int role = Qt::DisplayRole) const override;
  int rows() const override;
  QStringList columns() const override;

 private:
  void detail_changed() override;
  std::vector<std::pair<int32_t, SetSide>> rows_;
};

// The experts of one cell: the union of A's and B's, with their weights.
class ExpertModel : public SetTableModel {
  Q_OBJECT
 public:
  using SetTableModel::SetTableModel;
  QVariant data(const QModelIndex& index, int role = Qt::DisplayRole) const override;
  int rows() const override;
  QStringList columns() const override;
};

// The largest element differences of one full tensor's row (CellDetail::tensors[tensor]).
class WorstElementsModel : public ColumnTableModel {
  Q_OBJECT
 public:
  explicit WorstElementsModel(QObject* parent = nullptr);
  void setDetail(DetailPtr d, int tensor);
  QVariant data(const QModelIndex& index, int role = Qt::DisplayRole) const override;
  int rows() const override;
  QStringList columns() const override;

 private:
  const TensorDetail* tensor() const;
  DetailPtr detail_;
  int tensor_ = -1;
};

}  // namespace dsv4::gui
