// The overview heatmap: layer × token (or × expert) cells of a HeatmapModel, the per-token strip
// above them, row labels, a token axis and the colour legend. Painting renders only the visible
// region into a cached QImage (one aggregate per pixel column and row, so zooming out to tens of
// thousands of tokens costs the same as a screenful); the cache is reused until the model's revision,
// the scroll position, the zoom or the size changes. Selection is an overlay on the cached image.
#pragma once

#include <QAbstractScrollArea>
#include <QElapsedTimer>
#include <QImage>
#include <vector>

#include "gui/models/heatmap_model.h"

namespace dsv4::gui {

class HeatmapView : public QAbstractScrollArea {
  Q_OBJECT
 public:
  explicit HeatmapView(QWidget* parent = nullptr);
  void setModel(HeatmapModel* m);
  HeatmapModel* model() const { return model_; }

  // Zoom: pixels per column (below 1 when zoomed out). fitToWidth shows every column.
  double pixelsPerColumn() const { return ppc_; }
  void setPixelsPerColumn(double ppc, int anchor_x = -1);
  // Zoom by a factor about the selected column when it is in view (it stays where it is), else
  // about the centre, bringing the selection into view.
  void zoomBy(double factor);
  void zoomIn() { zoomBy(1.5); }
  void zoomOut() { zoomBy(1 / 1.5); }
  void fitToWidth();
  // The columns in view, [first, last) in column units (fractional at the edges).
  std::pair<double, double> visibleColumns() const;
  // Zoom and scroll so that columns [first, last) fill the width, within the zoom limits (the whole
  // sequence at most; a few columns at least, centred on the range asked for).
  void showColumns(double first, double last);

  // Selection: (row, column) or (−1, −1). select() scrolls it into view and emits cellSelected.
  void select(int row, int col);
  void clearSelection();
  int selectedRow() const { return sel_row_; }
  int selectedColumn() const { return sel_col_; }
  // A cell marked apart from the selection (the first divergence): a ring and a flag above its
  // column, on the token axis only; (−1, −1) for none.
  void setMarkedCell(int row, int col);
  std::pair<int, int> markedCell() const { return {mark_row_, mark_col_}; }
  // The cell under a viewport position, (−1, −1) outside the cells.
  std::pair<int, int> cellAt(const QPoint& viewport_pos) const;
  // The cell area in viewport coordinates.
  QRect cellRect() const;
  // What the empty view says (no trace open, or a load in progress).
  QString emptyText() const;
  // Statistics of the last rendering of the cached image (for the frame-time measurement).
  double lastRenderMs() const { return last_render_ms_; }
  int renders() const { return renders_; }

 signals:
  void cellSelected(int row, int col);
  void framePainted(double ms);  // after each paint event, its duration
  // The columns in view changed (scroll, zoom, resize, another sequence or metric).
  void visibleColumnsChanged(double first, double last);

 protected:
  void paintEvent(QPaintEvent* e) override;
  void resizeEvent(QResizeEvent* e) override;
  void scrollContentsBy(int dx, int dy) override;
  void mousePressEvent(QMouseEvent* e) override;
  void wheelEvent(QWheelEvent* e) override;
  void keyPressEvent(QKeyEvent* e) override;
  bool viewportEvent(QEvent* e) override;
  QSize sizeHint() const override { return {900, 320}; }

 private:
  void updateScrollBars();
  void noteVisibleColumns();  // emits visibleColumnsChanged when they differ from the last emitted
  void updateLabelWidth();    // fits the row labels
  // Everything the view shows (cells, strip, axis, row labels, legend; or the empty state).
  void render(QPainter& p, const QSize& size);
  bool renderCache();    // into cache_; false (and allocateCache queued) when its memory is missing
  void allocateCache();  // the memory of a viewport-sized image
  void renderCells(QPainter& p, const QRect& area);
  void renderStrip(QPainter& p, const QRect& area);
  void renderAxis(QPainter& p, const QRect& area);
  void renderLegend(QPainter& p, const QRect& area);
  int rowHeight() const;
  double columnX(int col) const;  // viewport x of a column's left edge
  // The viewport rectangle around a cell, grown by `grow` pixels on each side (at least 3 px wide).
  QRect cellFrame(int row, int col, int grow) const;
  void ensureVisible(int row, int col);

  HeatmapModel* model_ = nullptr;
  double ppc_ = 1;
  int label_w_ = 64;
  bool fit_pending_ = true;
  int sel_row_ = -1, sel_col_ = -1;
  int mark_row_ = -1, mark_col_ = -1;
  QImage cache_;                 // over cache_mem_
  std::vector<QRgb> cache_mem_;  // only grows
  struct Key {
    quint64 revision = ~0ull;
    int sx = -1, sy = -1, w = -1, h = -1;
    double ppc = -1;
    bool operator==(const Key&) const = default;
  } key_;
  double last_render_ms_ = 0;
  int renders_ = 0;
  int last_cols_ = -1;
  std::pair<double, double> visible_{-1, -1};
};

}  // namespace dsv4::gui
