// The divergence navigator: the step's divergences (gui/models/divergences.h) as a table, in severity
// order unless sorted by a column, filtered by layer, kind and sequence, with a current row that
// next() and previous() move through the rows shown. Empty until the divergences of a compared pair
// are loaded; one trace has none.
#pragma once

#include <QStringList>
#include <vector>

#include "gui/models/table_models.h"

namespace dsv4::gui {

class NavigatorModel : public ColumnTableModel {
  Q_OBJECT
 public:
  enum Column { Kind, Seq, Layer, Token, What, Severity };
  enum Role { KindRole = Qt::UserRole + 1 };  // int(DivergenceKind)
  explicit NavigatorModel(TraceDocument* doc, QObject* parent = nullptr);

  int rows() const override;
  QStringList columns() const override;
  QVariant data(const QModelIndex& index, int role = Qt::DisplayRole) const override;
  // Sorting by Severity (either order) is the severity order; other columns sort by their value,
  // equal values in severity order.
  void sort(int column, Qt::SortOrder order = Qt::AscendingOrder) override;

  // Filters; −1 shows all. A layer filter hides the log-prob tokens (they belong to no layer).
  void setLayerFilter(int layer);
  void setKindFilter(int kind);  // int(DivergenceKind)
  void setSeqFilter(int seq);
  int layerFilter() const { return layer_; }
  int kindFilter() const { return kind_; }
  int seqFilter() const { return seq_; }

  const Divergence* item(int row) const;  // null when out of range
  int current() const { return current_; }
  // Makes `row` current (−1: none) and emits currentChanged.
  void setCurrent(int row);
  // Move the current row one down / up among the rows shown and return the new current item; null
  // (current unchanged) at the end / start or when nothing is shown.
  const Divergence* next();
  const Divergence* previous();

  // One line for the banner: the first divergence, the flip counts, the worst tokens; empty
  // without divergences.
  QString banner() const;
  const DivergenceList* list() const { return list_.get(); }

 signals:
  void currentChanged(int row);

 private:
  void rebuild();
  TraceDocument* doc_;
  DivergencesPtr list_;
  std::vector<int> shown_;  // indices into list_->items, in display order
  int layer_ = -1, kind_ = -1, seq_ = -1;
  int sort_column_ = Severity;
  Qt::SortOrder sort_order_ = Qt::AscendingOrder;
  int current_ = -1;
};

}  // namespace dsv4::gui
