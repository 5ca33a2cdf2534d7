// The "Gradients" view of two training steps: a parameter kind × layer heat map of how B's gradients
// differ from A's (DiffReport::training, replay/training_diff.h). One row per kind in the report's
// order (TrainingDiff::kinds), one column for the model-level weights and one per layer; a cell is the
// aggregate of that (kind, layer): every routed expert of a layer's kind together.
#pragma once

#include <QAbstractTableModel>
#include <QString>
#include <vector>

#include "gui/models/trace_document.h"

namespace dsv4::gui {

class GradientDiffModel : public QAbstractTableModel {
  Q_OBJECT
 public:
  enum Role {
    ValueRole = Qt::UserRole + 1,  // double rel-L2 (NaN: unknown without full gradients); invalid: no cell
    CosineRole,                    // double
    RowsDifferingRole,             // qint64 gradient digest rows that differ
    LevelRole,                     // double 0 (equal) … 1 (the largest rel-L2); invalid when no colour
  };
  explicit GradientDiffModel(TraceDocument* doc, QObject* parent = nullptr);

  int rowCount(const QModelIndex& parent = {}) const override;
  int columnCount(const QModelIndex& parent = {}) const override;
  QVariant data(const QModelIndex& index, int role = Qt::DisplayRole) const override;
  QVariant headerData(int section, Qt::Orientation o, int role = Qt::DisplayRole) const override;

  // Both steps are training steps and the report is there.
  bool available() const { return training() != nullptr; }
  const TrainingDiff* training() const;
  // The layer of a column (−1: the model-level weights) and the cell there (nullptr when none).
  static int layerOf(int column) { return column - 1; }
  const GradAggregate* cell(int row, int column) const;
  QString cellToolTip(int row, int column) const;
  // The colour scale (log) over the cells' rel-L2, by the rule of gui/models/colour_scale.h.
  double scaleMin() const { return lo_; }
  double scaleMax() const { return hi_; }
  // One line on the two steps: parameters compared, differing, and the settings that differ.
  QString caption() const;

 private:
  void rebuild();
  double level(double rel_l2) const;

  TraceDocument* doc_;
  int rows_ = 0, cols_ = 0;
  std::vector<int> cell_;  // [row * cols_ + column]: index into TrainingDiff::cells, −1 for none
  double lo_ = 0, hi_ = 0;
};

}  // namespace dsv4::gui
