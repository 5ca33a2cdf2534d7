// The detail of one selected cell: the indexer sets of A and B side by side over the compressed
// groups, the experts and their weights, the mHC comb matrices and their difference, and for the
// layer's full tensors a histogram of the row's differences with its worst elements. Shows a
// CellDetail computed by the models library; paints, computes nothing.
#pragma once

#include <QWidget>

#include "gui/models/table_models.h"

class QComboBox;
class QLabel;
class QTableView;
class QGroupBox;

namespace dsv4::gui {

// The selected compressed groups of A (top row) and B (bottom row), coloured common / only A /
// only B, over every group the row could select from.
class IndexerSetsWidget : public QWidget {
  Q_OBJECT
 public:
  explicit IndexerSetsWidget(QWidget* parent = nullptr);
  void setDetail(DetailPtr d);
  QSize sizeHint() const override { return {360, 64}; }

 protected:
  void paintEvent(QPaintEvent*) override;

 private:
  DetailPtr detail_;
};

// The mHC comb matrices (A, B and B − A) of both sublayers; a tooltip gives a cell's three values.
class MhcWidget : public QWidget {
  Q_OBJECT
 public:
  explicit MhcWidget(QWidget* parent = nullptr);
  void setDetail(DetailPtr d);
  QSize sizeHint() const override { return {360, 200}; }

 protected:
  void paintEvent(QPaintEvent*) override;
  bool event(QEvent* e) override;

 private:
  struct Layout {
    int hc = 0, mats = 0, label_w = 34, gap = 10, title_h = 14, cell_w = 0, cell_h = 0;
  };
  Layout layout() const;
  DetailPtr detail_;
};

// A histogram of one TensorDetail (differences, or values in single-trace mode).
class HistogramWidget : public QWidget {
  Q_OBJECT
 public:
  explicit HistogramWidget(QWidget* parent = nullptr);
  void setTensor(DetailPtr d, int tensor);
  QSize sizeHint() const override { return {360, 120}; }

 protected:
  void paintEvent(QPaintEvent*) override;

 private:
  DetailPtr detail_;
  int tensor_ = -1;
};

class DetailPanel : public QWidget {
  Q_OBJECT
 public:
  explicit DetailPanel(QWidget* parent = nullptr);
  void setDetail(DetailPtr d);  // null: nothing selected
  void setMessage(const QString& text);
  DetailPtr detail() const { return detail_; }
  IndexerSetModel* indexerModel() const { return indexer_model_; }
  ExpertModel* expertModel() const { return expert_model_; }
  WorstElementsModel* worstModel() const { return worst_model_; }
  QString headline() const;

 private:
  void showTensor(int i);

  DetailPtr detail_;
  QLabel* title_;
  QGroupBox* indexer_box_;
  IndexerSetsWidget* indexer_sets_;
  QLabel* indexer_text_;
  QTableView* indexer_table_;
  IndexerSetModel* indexer_model_;
  QGroupBox* routing_box_;
  QLabel* routing_text_;
  QTableView* expert_table_;
  ExpertModel* expert_model_;
  QGroupBox* mhc_box_;
  MhcWidget* mhc_;
  QGroupBox* tensor_box_;
  QComboBox* tensor_combo_;
  QLabel* tensor_text_;
  HistogramWidget* histogram_;
  QTableView* worst_table_;
  WorstElementsModel* worst_model_;
  QLabel* digest_text_;
};

}  // namespace dsv4::gui
