#include "gui/widgets/heatmap_view.h"

#include <QKeyEvent>
#include <QMouseEvent>
#include <QPainter>
#include <QScrollBar>
#include <QTimer>
#include <QToolTip>
#include <QWheelEvent>
#include <algorithm>
#include <cmath>

namespace dsv4::gui {

namespace {

constexpr int kLegendW = 170;  // colour legend on the right
constexpr int kStripH = 46;    // per-token strip above the cells
constexpr int kGap = 4;
constexpr int kAxisH = 20;  // column axis below the cells
constexpr double kMaxPpc = 64;
const QRgb kBackground = qRgb(0xfa, 0xfa, 0xfa);
const QRgb kGrid = qRgb(0xff, 0xff, 0xff);

double nice_step(double raw) {
  const double p = std::pow(10.0, std::floor(std::log10(std::max(raw, 1.0))));
  for (double m : {1.0, 2.0, 5.0, 10.0})
    if (m * p >= raw) return m * p;
  return 10 * p;
}

}  // namespace

HeatmapView::HeatmapView(QWidget* parent) : QAbstractScrollArea(parent) {
  setFocusPolicy(Qt::StrongFocus);
  setHorizontalScrollBarPolicy(Qt::ScrollBarAlwaysOn);
  setVerticalScrollBarPolicy(Qt::ScrollBarAsNeeded);
  viewport()->setAttribute(Qt::WA_OpaquePaintEvent);
  viewport()->setMouseTracking(false);
  setMinimumHeight(160);
}

void HeatmapView::setModel(HeatmapModel* m) {
  if (model_) disconnect(model_, nullptr, this, nullptr);
  model_ = m;
  auto refresh = [this] {
    updateScrollBars();
    viewport()->update();
  };
  connect(model_, &QAbstractItemModel::modelReset, this, [this, refresh] {
    const int cols = model_->columnCount();
    if (cols != last_cols_) {
      last_cols_ = cols;
      fit_pending_ = true;
      sel_row_ = sel_col_ = -1;
    }
    if (sel_row_ >= model_->rowCount() || sel_col_ >= cols) sel_row_ = sel_col_ = -1;
    if (fit_pending_) fitToWidth();
    refresh();
  });
  connect(model_, &QAbstractItemModel::modelReset, this, &HeatmapView::updateLabelWidth);
  connect(model_, &QAbstractItemModel::dataChanged, viewport(), qOverload<>(&QWidget::update));
  connect(model_, &QAbstractItemModel::headerDataChanged, viewport(), qOverload<>(&QWidget::update));
  last_cols_ = model_->columnCount();
  updateLabelWidth();
  fitToWidth();
}

void HeatmapView::updateLabelWidth() {
  QFont f = font();
  f.setPointSizeF(f.pointSizeF() * 0.9);
  const QFontMetrics fm(f);
  int w = fm.horizontalAdvance(QStringLiteral("|Δ log-prob|")) / 2;
  for (int r = 0; model_ && r < model_->rowCount(); ++r)
    w = std::max(w, fm.horizontalAdvance(model_->rowLabel(r)));
  label_w_ = std::max(48, w + 14);
}

QRect HeatmapView::cellRect() const {
  const int w = std::max(0, viewport()->width() - label_w_ - kLegendW);
  const int top = kStripH + kGap;
  const int h = std::max(0, viewport()->height() - top - kAxisH);
  return {label_w_, top, w, h};
}

int HeatmapView::rowHeight() const {
  const int rows = model_ ? model_->rowCount() : 0;
  if (rows == 0) return 1;
  return std::clamp(cellRect().height() / rows, 3, 60);
}

double HeatmapView::columnX(int col) const {
  return cellRect().left() + col * ppc_ - horizontalScrollBar()->value();
}

void HeatmapView::fitToWidth() {
  const int cols = model_ ? model_->columnCount() : 0;
  const int w = cellRect().width();
  if (cols <= 0 || w <= 0) {
    fit_pending_ = true;
    return;
  }
  fit_pending_ = false;
  ppc_ = std::min(kMaxPpc, double(w) / cols);
  updateScrollBars();
  horizontalScrollBar()->setValue(0);
  viewport()->update();
}

void HeatmapView::setPixelsPerColumn(double ppc, int anchor_x) {
  const int cols = model_ ? model_->columnCount() : 0;
  const int w = cellRect().width();
  if (cols <= 0 || w <= 0) return;
  const double fit = double(w) / cols;
  ppc = std::clamp(ppc, std::min(fit, kMaxPpc), std::max(kMaxPpc, fit));
  if (anchor_x < 0) anchor_x = w / 2;
  const double col_at_anchor = (horizontalScrollBar()->value() + anchor_x) / ppc_;
  ppc_ = ppc;
  fit_pending_ = false;
  updateScrollBars();
  horizontalScrollBar()->setValue(int(std::lround(col_at_anchor * ppc_ - anchor_x)));
  noteVisibleColumns();
  viewport()->update();
}

QRect HeatmapView::cellFrame(int row, int col, int grow) const {
  const int rh = rowHeight();
  const double x = columnX(col);
  const int w = std::max(3, int(std::ceil(ppc_)));  // a zoomed-out column stays visible
  const int xi = int(std::floor(x)) - (ppc_ < 3 ? 1 : 0);
  const int y = cellRect().top() + row * rh - verticalScrollBar()->value();
  return QRect(xi - grow, y - grow, w + 2 * grow, rh + 2 * grow);
}

void HeatmapView::setMarkedCell(int row, int col) {
  if (row == mark_row_ && col == mark_col_) return;
  mark_row_ = row;
  mark_col_ = col;
  viewport()->update();
}

std::pair<double, double> HeatmapView::visibleColumns() const {
  const int cols = model_ ? model_->columnCount() : 0;
  const double first = horizontalScrollBar()->value() / ppc_;
  return {std::min(first, double(cols)), std::min(first + cellRect().width() / ppc_, double(cols))};
}

void HeatmapView::showColumns(double first, double last) {
  const int cols = model_ ? model_->columnCount() : 0;
  const int w = cellRect().width();
  if (cols <= 0 || w <= 0) return;
  first = std::clamp(first, 0.0, double(cols));
  last = std::clamp(last, first, double(cols));
  const double fit = double(w) / cols;
  const double ppc =
      std::clamp(w / std::max(last - first, 1e-9), std::min(fit, kMaxPpc), std::max(kMaxPpc, fit));
  const double centre = (first + last) / 2;
  ppc_ = ppc;
  fit_pending_ = false;
  updateScrollBars();
  // At the zoom limit the range asked for is narrower than the view: keep it centred.
  const double left = ppc * (last - first) >= w - 0.5 ? first * ppc : centre * ppc - w / 2.0;
  horizontalScrollBar()->setValue(int(std::lround(left)));
  noteVisibleColumns();
  viewport()->update();
}

void HeatmapView::noteVisibleColumns() {
  const auto v = visibleColumns();
  if (v == visible_) return;
  visible_ = v;
  emit visibleColumnsChanged(v.first, v.second);
}

void HeatmapView::zoomBy(double factor) {
  int anchor = -1;
  const QRect area = cellRect();
  if (sel_col_ >= 0) {
    const double x = columnX(sel_col_) + ppc_ / 2 - area.left();
    if (x >= 0 && x <= area.width()) anchor = int(std::lround(x));
  }
  setPixelsPerColumn(ppc_ * factor, anchor);
  if (sel_row_ >= 0 && sel_col_ >= 0 && anchor < 0) ensureVisible(sel_row_, sel_col_);
}

void HeatmapView::updateScrollBars() {
  const int cols = model_ ? model_->columnCount() : 0;
  const QRect area = cellRect();
  const int content_w = int(std::ceil(cols * ppc_));
  horizontalScrollBar()->setRange(0, std::max(0, content_w - area.width()));
  horizontalScrollBar()->setPageStep(std::max(1, area.width()));
  horizontalScrollBar()->setSingleStep(std::max(1, int(ppc_ * 4)));
  const int rows = model_ ? model_->rowCount() : 0;
  const int content_h = rows * rowHeight();
  verticalScrollBar()->setRange(0, std::max(0, content_h - area.height()));
  verticalScrollBar()->setPageStep(std::max(1, area.height()));
  verticalScrollBar()->setSingleStep(rowHeight());
  noteVisibleColumns();
}

void HeatmapView::resizeEvent(QResizeEvent* e) {
  QAbstractScrollArea::resizeEvent(e);
  if (fit_pending_) {
    fitToWidth();
  } else {
    // Keep "everything visible" when it was.
    const int cols = model_ ? model_->columnCount() : 0;
    if (cols > 0 && ppc_ * cols < cellRect().width())
      ppc_ = std::min(kMaxPpc, double(cellRect().width()) / cols);
    updateScrollBars();
  }
}

void HeatmapView::scrollContentsBy(int, int) {
  noteVisibleColumns();
  viewport()->update();
}

std::pair<int, int> HeatmapView::cellAt(const QPoint& p) const {
  if (!model_) return {-1, -1};
  const QRect area = cellRect();
  const int cols = model_->columnCount(), rows = model_->rowCount();
  const int col = int(std::floor((p.x() - area.left() + horizontalScrollBar()->value()) / ppc_));
  if (p.x() < area.left() || p.x() >= area.right() || col < 0 || col >= cols) return {-1, -1};
  if (p.y() < area.top() || p.y() >= area.bottom()) return {-1, col};  // the strip or the axis: column only
  const int row = (p.y() - area.top() + verticalScrollBar()->value()) / rowHeight();
  if (row < 0 || row >= rows) return {-1, col};
  return {row, col};
}

void HeatmapView::ensureVisible(int row, int col) {
  const QRect area = cellRect();
  const double x = col * ppc_;
  QScrollBar* h = horizontalScrollBar();
  if (x < h->value() || x + ppc_ > h->value() + area.width())
    h->setValue(int(x + ppc_ / 2 - area.width() / 2));
  const int y = row * rowHeight();
  QScrollBar* v = verticalScrollBar();
  if (y < v->value() || y + rowHeight() > v->value() + area.height())
    v->setValue(y + rowHeight() / 2 - area.height() / 2);
}

void HeatmapView::select(int row, int col) {
  if (!model_ || row < 0 || col < 0 || row >= model_->rowCount() || col >= model_->columnCount()) return;
  sel_row_ = row;
  sel_col_ = col;
  ensureVisible(row, col);
  viewport()->update();
  emit cellSelected(row, col);
}

void HeatmapView::clearSelection() {
  sel_row_ = sel_col_ = -1;
  viewport()->update();
}

void HeatmapView::mousePressEvent(QMouseEvent* e) {
  if (e->button() != Qt::LeftButton) return QAbstractScrollArea::mousePressEvent(e);
  auto [row, col] = cellAt(e->position().toPoint());
  if (col < 0) return;
  if (row < 0) row = sel_row_ >= 0 ? sel_row_ : 0;  // a click on the strip keeps the layer
  select(row, col);
}

void HeatmapView::wheelEvent(QWheelEvent* e) {
  const QPoint d = e->angleDelta();
  if (e->modifiers() & Qt::ControlModifier) {
    const double steps = d.y() / 120.0;
    setPixelsPerColumn(ppc_ * std::pow(1.25, steps), int(e->position().x()) - cellRect().left());
    e->accept();
    return;
  }
  if ((e->modifiers() & Qt::ShiftModifier) && verticalScrollBar()->maximum() > 0) {
    verticalScrollBar()->setValue(verticalScrollBar()->value() - d.y() / 2);
  } else {
    // The token axis is the long one: the plain wheel scrolls it.
    const int delta = d.x() != 0 ? d.x() : d.y();
    horizontalScrollBar()->setValue(horizontalScrollBar()->value() - delta);
  }
  e->accept();
}

void HeatmapView::keyPressEvent(QKeyEvent* e) {
  if (!model_ || model_->rowCount() == 0) return QAbstractScrollArea::keyPressEvent(e);
  const int r = std::max(sel_row_, 0), c = std::max(sel_col_, 0);
  switch (e->key()) {
    case Qt::Key_Left:
      return select(r, std::max(c - 1, 0));
    case Qt::Key_Right:
      return select(r, std::min(c + 1, model_->columnCount() - 1));
    case Qt::Key_Up:
      return select(std::max(r - 1, 0), c);
    case Qt::Key_Down:
      return select(std::min(r + 1, model_->rowCount() - 1), c);
    case Qt::Key_Home:
      return select(r, 0);
    case Qt::Key_End:
      return select(r, model_->columnCount() - 1);
    case Qt::Key_Plus:
    case Qt::Key_Equal:
      return zoomIn();
    case Qt::Key_Minus:
      return zoomOut();
    default:
      return QAbstractScrollArea::keyPressEvent(e);
  }
}

bool HeatmapView::viewportEvent(QEvent* e) {
  if (e->type() == QEvent::ToolTip && model_) {
    auto* he = static_cast<QHelpEvent*>(e);
    const auto [row, col] = cellAt(he->pos());
    QString text;
    if (row >= 0) {
      text = model_->cellToolTip(row, col);
    } else if (col >= 0 && he->pos().y() < kStripH && model_->isTokenAxis()) {
      text = QStringLiteral("token %1: %2 = %3")
                 .arg(col)
                 .arg(model_->stripLabel())
                 .arg(double(model_->stripValue(col)), 0, 'g', 5);
    }
    if (text.isEmpty()) {
      QToolTip::hideText();
    } else {
      QToolTip::showText(he->globalPos(), text, viewport());
    }
    return true;
  }
  return QAbstractScrollArea::viewportEvent(e);
}

void HeatmapView::renderCells(QPainter& p, const QRect& area) {
  QImage* img = p.device()->devType() == QInternal::Image ? static_cast<QImage*>(p.device()) : nullptr;
  const int rows = model_->rowCount(), cols = model_->columnCount();
  if (rows == 0 || cols == 0) return;
  const int rh = rowHeight();
  const int sx = horizontalScrollBar()->value(), sy = verticalScrollBar()->value();
  const bool col_gaps = ppc_ >= 5, row_gaps = rh >= 6;
  std::vector<QRgb> line(size_t(area.width()));
  std::vector<int> c0s(size_t(area.width())), c1s(size_t(area.width()));
  for (int x = 0; x < area.width(); ++x) {
    const double px = sx + x;
    int c0 = int(std::floor(px / ppc_)), c1 = int(std::floor((px + 1) / ppc_));
    if (c1 <= c0) c1 = c0 + 1;
    c0s[x] = c0;
    c1s[x] = std::min(c1, cols);
  }
  const int first_row = sy / rh, last_row = std::min(rows - 1, (sy + area.height()) / rh);
  for (int r = first_row; r <= last_row; ++r) {
    int prev0 = -1, prev1 = -1;
    QRgb prev = kBackground;
    for (int x = 0; x < area.width(); ++x) {
      const int c0 = c0s[x], c1 = c1s[x];
      if (c0 >= cols) {
        line[x] = kBackground;
        continue;
      }
      if (c0 != prev0 || c1 != prev1) {
        prev = model_->color(model_->aggregate(r, c0, c1));
        prev0 = c0, prev1 = c1;
      }
      // The last pixel of a wide column is a gap, so neighbouring columns stay apart.
      const bool gap = col_gaps && int(std::floor((sx + x + 1) / ppc_)) != c0;
      line[x] = gap ? kGrid : prev;
    }
    // The layer's pixel row, repeated rh times (the last one a grid line when rows are tall enough):
    // copied into the image's scan lines when drawing into the cache, else drawn as an image.
    const QImage row(reinterpret_cast<const uchar*>(line.data()), area.width(), 1,
                     qsizetype(area.width()) * qsizetype(sizeof(QRgb)), QImage::Format_RGB32);
    const int y0 = area.top() + r * rh - sy;
    for (int y = std::max(y0, area.top()); y < std::min(y0 + rh, area.top() + area.height()); ++y) {
      const bool grid = row_gaps && y == y0 + rh - 1;
      if (img) {
        auto* scan = reinterpret_cast<QRgb*>(img->scanLine(y)) + area.left();
        if (grid)
          std::fill(scan, scan + area.width(), kGrid);
        else
          std::copy(line.begin(), line.end(), scan);
      } else if (grid) {
        p.fillRect(area.left(), y, area.width(), 1, QColor(kGrid));
      } else {
        p.drawImage(area.left(), y, row);
      }
    }
  }
}

void HeatmapView::renderStrip(QPainter& p, const QRect& area) {
  p.setPen(QColor(0x55, 0x55, 0x55));
  QFont f = font();
  f.setPointSizeF(f.pointSizeF() * 0.85);
  p.setFont(f);
  const QRect strip(area.left(), 2, area.width(), kStripH - 4);
  p.fillRect(strip, QColor(0xff, 0xff, 0xff));
  p.drawText(QRect(2, 2, label_w_ - 6, kStripH - 4), Qt::AlignRight | Qt::AlignVCenter | Qt::TextWordWrap,
             model_->stripLabel());
  if (!model_->isTokenAxis()) return;
  const float mx = model_->stripMax(), mn = model_->stripMin();
  const int sx = horizontalScrollBar()->value();
  const int cols = model_->columnCount();
  if (mx > mn) {
    const QColor bar(0x8c, 0x2d, 0x04);
    for (int x = 0; x < area.width(); ++x) {
      const double px = sx + x;
      const int c0 = int(std::floor(px / ppc_));
      int c1 = int(std::floor((px + 1) / ppc_));
      if (c1 <= c0) c1 = c0 + 1;
      if (c0 >= cols) break;
      const float v = model_->stripAggregate(c0, c1);
      if (std::isnan(v) || v <= 0) continue;
      const double t = (double(v) - mn) / std::max(double(mx) - mn, 1e-30);
      const int h = std::max(1, int(std::lround(std::clamp(t, 0.0, 1.0) * (strip.height() - 14))));
      p.fillRect(area.left() + x, strip.bottom() - h + 1, 1, h, bar);
    }
  }
  p.setPen(QColor(0x77, 0x77, 0x77));
  p.drawText(strip.adjusted(4, 0, -4, 0), Qt::AlignRight | Qt::AlignTop,
             mn > 0 ? QStringLiteral("%1 … %2").arg(double(mn), 0, 'g', 3).arg(double(mx), 0, 'g', 3)
                    : QStringLiteral("max %1").arg(double(mx), 0, 'g', 3));
}

void HeatmapView::renderAxis(QPainter& p, const QRect& area) {
  const int cols = model_->columnCount();
  if (cols == 0) return;
  const int y = area.bottom() + 1;
  p.setPen(QColor(0x44, 0x44, 0x44));
  QFont f = font();
  f.setPointSizeF(f.pointSizeF() * 0.85);
  p.setFont(f);
  const double step = nice_step(80.0 / ppc_);
  const int sx = horizontalScrollBar()->value();
  const double first_col = std::ceil((sx / ppc_) / step) * step;
  for (double c = first_col; c < cols; c += step) {
    const int x = int(std::lround(area.left() + c * ppc_ - sx));
    if (x > area.right()) break;
    p.drawLine(x, y, x, y + 4);
    p.drawText(QRect(x - 40, y + 3, 80, kAxisH - 3), Qt::AlignHCenter | Qt::AlignTop,
               QString::number(qint64(c)));
  }
  p.drawText(QRect(2, y + 1, label_w_ - 6, kAxisH - 1), Qt::AlignRight | Qt::AlignTop,
             model_->isTokenAxis() ? QStringLiteral("token") : QStringLiteral("expert"));
}

void HeatmapView::renderLegend(QPainter& p, const QRect& area) {
  const MetricInfo& mi = model_->info();
  const int x = area.left() + 12;
  int y = area.top();
  QFont f = font();
  f.setBold(true);
  p.setFont(f);
  p.setPen(QColor(0x22, 0x22, 0x22));
  p.drawText(QRect(x, y, area.width() - 16, 18), Qt::AlignLeft | Qt::AlignVCenter,
             p.fontMetrics().elidedText(QString::fromUtf8(mi.label), Qt::ElideRight, area.width() - 16));
  f.setBold(false);
  f.setPointSizeF(f.pointSizeF() * 0.85);
  p.setFont(f);
  y += 18;
  p.drawText(QRect(x, y, area.width() - 16, 16), Qt::AlignLeft | Qt::AlignVCenter,
             p.fontMetrics().elidedText(QString::fromUtf8(mi.unit), Qt::ElideRight, area.width() - 16));
  y += 20;
  const int bar_h = std::max(40, std::min(area.height() - (y - area.top()) - 70, 200));
  for (int i = 0; i < bar_h; ++i) {
    const double t = 1.0 - double(i) / std::max(bar_h - 1, 1);  // worst at the top
    p.fillRect(x, y + i, 16, 1, QColor(heat_color(t)));
  }
  p.setPen(QColor(0x88, 0x88, 0x88));
  p.drawRect(x, y, 16, bar_h - 1);
  p.setPen(QColor(0x22, 0x22, 0x22));
  const QString worst = model_->formatValue(model_->scaleWorst());
  QString ideal = model_->formatValue(model_->scaleIdeal());
  // Values beyond the ideal end (below the 5th percentile) take its colour: the label says so.
  if (model_->scaleClipped())
    ideal = (mi.lower_is_worse ? QStringLiteral("≥ ") : QStringLiteral("≤ ")) + ideal;
  p.drawText(QRect(x + 22, y - 2, area.width() - 40, 16), Qt::AlignLeft | Qt::AlignTop,
             worst + (mi.log_scale ? QStringLiteral(" (log)") : QString()));
  p.drawText(QRect(x + 22, y + bar_h - 14, area.width() - 40, 16), Qt::AlignLeft | Qt::AlignBottom, ideal);
  y += bar_h + 8;
  auto swatch = [&](QRgb c, const QString& text) {
    if (y + 14 > area.bottom()) return;
    p.fillRect(x, y + 1, 16, 11, QColor(c));
    p.setPen(QColor(0x22, 0x22, 0x22));
    p.drawText(QRect(x + 22, y - 1, area.width() - 40, 16), Qt::AlignLeft | Qt::AlignVCenter, text);
    y += 16;
  };
  swatch(level_color(kLevelNoData, 0, false), QStringLiteral("no data"));
  if (model_->metric() == Metric::IndexerMargin || model_->metric() == Metric::RouterMargin)
    swatch(level_color(0, kNearTie, false), QStringLiteral("near tie"));
  if (model_->thresholdEnabled())
    swatch(level_color(kLevelMax / 2, 0, true),
           QStringLiteral("within %1").arg(model_->formatValue(model_->threshold())));
}

void HeatmapView::render(QPainter& p, const QSize& size) {
  p.fillRect(QRect(QPoint(0, 0), size), QColor(kBackground));
  if (!model_ || model_->rowCount() == 0) {
    // Nothing open (or nothing loaded yet): no axes, no legend, only what to do.
    p.setPen(QColor(0x66, 0x66, 0x66));
    p.drawText(QRect(QPoint(0, 0), size), Qt::AlignCenter | Qt::TextWordWrap, emptyText());
    return;
  }
  const QRect area = cellRect();
  renderCells(p, area);
  renderStrip(p, area);
  renderAxis(p, area);
  // Row labels.
  const int rh = rowHeight(), sy = verticalScrollBar()->value();
  QFont f = font();
  f.setPointSizeF(f.pointSizeF() * (rh < 14 ? 0.75 : 0.9));
  p.setFont(f);
  p.setPen(QColor(0x33, 0x33, 0x33));
  p.setClipRect(QRect(0, area.top(), label_w_, area.height()));
  const int label_every = std::max(1, int(std::ceil(12.0 / rh)));
  for (int r = 0; r < model_->rowCount(); ++r) {
    const int y = area.top() + r * rh - sy;
    if (y + rh < area.top() || y > area.bottom()) continue;
    if (r % label_every != 0) continue;
    p.drawText(QRect(2, y, label_w_ - 8, std::max(rh, 12)), Qt::AlignRight | Qt::AlignVCenter,
               model_->rowLabel(r));
  }
  p.setClipping(false);
  // A generation: the boundary between prompt and response, across the strip and the cells.
  if (const int b = model_->promptBoundary(); b >= 0) {
    const double x = columnX(b);
    if (x >= area.left() && x <= area.right()) {
      p.setPen(QPen(QColor(0x1a, 0x5f, 0xb4), 2));
      p.drawLine(QPointF(x, 2), QPointF(x, area.bottom()));
      p.setPen(QColor(0x1a, 0x5f, 0xb4));
      p.drawText(QRectF(x + 4, 2, 120, 14), Qt::AlignLeft | Qt::AlignTop, QStringLiteral("generated →"));
    }
  }
  renderLegend(p, QRect(area.right() + 1, area.top(), kLegendW, area.height()));
}

bool HeatmapView::renderCache() {
  const QSize size = viewport()->size();
  const size_t need = size_t(std::max(size.width(), 0)) * size_t(std::max(size.height(), 0));
  // Fresh pages cost more to fault in than the whole rendering (several ms for a screenful on a
  // virtual machine): without memory kept from earlier renders the frame is drawn straight into the
  // window, and the image's memory is taken after it (allocateCache), off the path of the first frame.
  if (need > cache_mem_.size()) {
    QTimer::singleShot(0, this, &HeatmapView::allocateCache);
    return false;
  }
  QElapsedTimer timer;
  timer.start();
  if (cache_.size() != size)
    cache_ = QImage(reinterpret_cast<uchar*>(cache_mem_.data()), size.width(), size.height(),
                    qsizetype(size.width()) * qsizetype(sizeof(QRgb)), QImage::Format_RGB32);
  QPainter p(&cache_);
  render(p, size);
  last_render_ms_ = timer.nsecsElapsed() / 1e6;
  ++renders_;
  return true;
}

void HeatmapView::allocateCache() {
  const QSize size = viewport()->size();
  const size_t need = size_t(std::max(size.width(), 0)) * size_t(std::max(size.height(), 0));
  if (need <= cache_mem_.size()) return;
  cache_ = QImage();
  cache_mem_ = std::vector<QRgb>(need, kBackground);
  key_ = Key{};
}

void HeatmapView::paintEvent(QPaintEvent*) {
  QElapsedTimer timer;
  timer.start();
  const Key k{model_ ? model_->revision() : 0,
              horizontalScrollBar()->value(),
              verticalScrollBar()->value(),
              viewport()->width(),
              viewport()->height(),
              ppc_};
  QPainter p(viewport());
  const bool has_data = model_ && model_->rowCount() > 0;
  if (!has_data) {
    render(p, viewport()->size());  // the empty state: a line of text, not worth an image
    key_ = Key{};
  } else if (k == key_ && !cache_.isNull()) {
    p.drawImage(0, 0, cache_);
  } else if (renderCache()) {
    key_ = k;
    p.drawImage(0, 0, cache_);
  } else {
    QElapsedTimer render_timer;
    render_timer.start();
    render(p, viewport()->size());
    last_render_ms_ = render_timer.nsecsElapsed() / 1e6;
    ++renders_;
  }
  if (model_ && mark_row_ >= 0 && mark_col_ >= 0 && mark_row_ < model_->rowCount() &&
      mark_col_ < model_->columnCount() && model_->isTokenAxis()) {
    // The first divergence: a blue ring and a flag above its column, drawn under the selection.
    const QRect area = cellRect();
    p.setClipRect(area.adjusted(-3, -kStripH - kGap, 3, 3));
    const QColor mark(0x1a, 0x5f, 0xb4);
    p.setPen(QPen(mark, 2));
    p.drawRect(cellFrame(mark_row_, mark_col_, 2));
    const double cx = columnX(mark_col_) + ppc_ / 2;
    const QPointF flag[3] = {{cx - 5, area.top() - 9.0}, {cx + 5, area.top() - 9.0}, {cx, area.top() - 2.0}};
    p.setPen(Qt::NoPen);
    p.setBrush(mark);
    p.drawPolygon(flag, 3);
    p.setBrush(Qt::NoBrush);
    p.setClipping(false);
  }
  if (model_ && sel_row_ >= 0 && sel_col_ >= 0) {
    const QRect area = cellRect();
    const double x = columnX(sel_col_);
    p.setClipRect(area.adjusted(-2, -kStripH - kGap, 2, 2));
    p.setPen(QPen(QColor(0x10, 0x10, 0x10), 2));
    p.drawRect(cellFrame(sel_row_, sel_col_, 1));
    p.setPen(QPen(QColor(0x10, 0x10, 0x10, 90), 1, Qt::DashLine));
    p.drawLine(QPointF(x + ppc_ / 2, 2), QPointF(x + ppc_ / 2, area.top()));
  }
  emit framePainted(timer.nsecsElapsed() / 1e6);
}

QString HeatmapView::emptyText() const {
  return QStringLiteral(
      "No trace open.\nFile ▸ Open (Ctrl+O) one trace, or two to compare (A = reference, "
      "usually the training step; B = candidate, usually the rollout),\nor drop one or two "
      ".h5 files here.");
}

}  // namespace dsv4::gui
