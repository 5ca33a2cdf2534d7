#include "gui/widgets/logprob_chart.h"

#include <QChart>
#include <QLegendMarker>
#include <QLineSeries>
#include <QMouseEvent>
#include <QRubberBand>
#include <QTimer>
#include <QToolTip>
#include <QValueAxis>
#include <QWheelEvent>
#include <algorithm>
#include <cmath>
#include <limits>

namespace dsv4::gui {

namespace {
constexpr int kDragPixels = 5;  // a press that moves less is a click
}

LogprobChart::LogprobChart(QWidget* parent) : QChartView(parent) {
  auto* chart = new QChart;
  chart->setMargins(QMargins(4, 4, 4, 4));
  chart->legend()->setAlignment(Qt::AlignTop);
  a_ = new QLineSeries;
  a_->setName(QStringLiteral("log p A"));
  a_->setPen(QPen(QColor(0x2c, 0x6f, 0xbb), 2.2));
  b_ = new QLineSeries;
  b_->setName(QStringLiteral("log p B"));
  b_->setPen(QPen(QColor(0xd9, 0x5f, 0x0e, 0xb0), 1.0));  // thin, see-through: A (wider) shows under it
  diff_ = new QLineSeries;
  diff_->setName(QStringLiteral("B − A"));
  diff_->setPen(QPen(QColor(0x9e, 0x1b, 0x32), 1.0));
  marker_ = new QLineSeries;
  marker_->setName(QStringLiteral("selected"));
  marker_->setPen(QPen(QColor(0x10, 0x10, 0x10), 1.0, Qt::DashLine));
  for (auto* s : {a_, b_, diff_, marker_}) chart->addSeries(s);
  x_ = new QValueAxis;
  x_->setTitleText(QStringLiteral("token"));
  x_->setLabelFormat(QStringLiteral("%d"));
  y_ = new QValueAxis;
  y_->setTitleText(QStringLiteral("log-prob"));
  y_diff_ = new QValueAxis;
  y_diff_->setTitleText(QStringLiteral("B − A"));
  chart->addAxis(x_, Qt::AlignBottom);
  chart->addAxis(y_, Qt::AlignLeft);
  chart->addAxis(y_diff_, Qt::AlignRight);
  for (auto* s : {a_, b_, marker_}) {
    s->attachAxis(x_);
    s->attachAxis(y_);
  }
  diff_->attachAxis(x_);
  diff_->attachAxis(y_diff_);
  setChart(chart);
  for (auto* m : chart->legend()->markers(marker_)) m->setVisible(false);
  setRenderHint(QPainter::Antialiasing, false);
  setMinimumHeight(180);
  setMouseTracking(true);
  band_ = new QRubberBand(QRubberBand::Rectangle, viewport());
}

void LogprobChart::setDifferenceOnly(bool on) {
  difference_only_ = on;
  rebuild();
}

int LogprobChart::tokens() const {
  const SeqTokens* s = model_ ? model_->tokens() : nullptr;
  return s ? int(s->logprobs_a.size()) : 0;
}

double LogprobChart::xAt(const QPoint& viewport_pos) const {
  return chart()->mapToValue(chart()->mapFromScene(mapToScene(viewport_pos)), a_).x();
}

int LogprobChart::tokenAt(const QPoint& viewport_pos) const {
  const int n = tokens();
  const QPointF in_chart = chart()->mapFromScene(mapToScene(viewport_pos));
  if (n == 0 || !chart()->plotArea().contains(in_chart)) return -1;
  return std::clamp(int(std::lround(xAt(viewport_pos))), 0, n - 1);
}

QString LogprobChart::valueText(int token) const {
  const SeqTokens* s = model_ ? model_->tokens() : nullptr;
  if (!s || token < 0 || token >= int(s->logprobs_a.size())) return {};
  const double a = s->logprobs_a[size_t(token)];
  if (s->logprobs_b.size() != s->logprobs_a.size())
    return QStringLiteral("token %1 → %2: log p %3").arg(token).arg(token + 1).arg(a, 0, 'g', 6);
  const double b = s->logprobs_b[size_t(token)];
  return QStringLiteral("token %1 → %2\nlog p A %3\nlog p B %4\nB − A %5")
      .arg(token)
      .arg(token + 1)
      .arg(a, 0, 'g', 6)
      .arg(b, 0, 'g', 6)
      .arg(b - a, 0, 'g', 3);
}

void LogprobChart::setModel(TokenModel* m) {
  model_ = m;
  connect(model_, &QAbstractItemModel::modelReset, this, &LogprobChart::rebuild);
  rebuild();
}

int LogprobChart::pointsShown() const {
  return int(a_->count());
}

void LogprobChart::setTokenRange(double first, double last) {
  if (first == first_ && last == last_) return;
  first_ = first;
  last_ = last;
  scheduleRebuild();
}

void LogprobChart::scheduleRebuild() {
  if (rebuild_pending_) return;
  rebuild_pending_ = true;
  QTimer::singleShot(0, this, [this] {
    if (rebuild_pending_) rebuild();
  });
}

void LogprobChart::resizeEvent(QResizeEvent* e) {
  QChartView::resizeEvent(e);
  scheduleRebuild();  // one bucket per pixel column
}

void LogprobChart::rebuild() {
  rebuild_pending_ = false;
  const SeqTokens* s = model_ ? model_->tokens() : nullptr;
  const bool cmp = model_ && model_->comparison();
  QList<QPointF> pa, pb, pd;
  double lo = -1, hi = 0, dmax = 0;
  const int n = tokens();
  // The range shown, in token units: columns [first, last) put token t at x = t.
  double x0 = -0.5, x1 = std::max(n, 1) - 0.5;
  if (last_ > first_ && n > 0) {
    x0 = std::max(first_, 0.0) - 0.5;
    x1 = std::min(last_, double(n)) - 0.5;
    if (x1 <= x0) x0 = -0.5, x1 = n - 0.5;
  }
  if (s && n > 0) {
    const int t0 = std::clamp(int(std::ceil(x0)), 0, n - 1);
    const int t1 = std::clamp(int(std::floor(x1)) + 1, t0 + 1, n);  // tokens [t0, t1)
    const int width =
        std::max(100, int(chart()->plotArea().width() > 0 ? chart()->plotArea().width() : this->width()));
    const int buckets = std::min(kMaxPoints, width);
    const int bucket = std::max(1, (t1 - t0 + buckets - 1) / buckets);
    lo = INFINITY;
    hi = -INFINITY;
    pa.reserve((t1 - t0) / bucket + 1);
    for (int i0 = t0; i0 < t1; i0 += bucket) {
      const int i1 = std::min(t1, i0 + bucket);
      int ia = i0, id = i0;
      for (int i = i0; i < i1; ++i) {
        if (s->logprobs_a[i] < s->logprobs_a[ia]) ia = i;
        if (cmp &&
            std::fabs(s->logprobs_b[i] - s->logprobs_a[i]) > std::fabs(s->logprobs_b[id] - s->logprobs_a[id]))
          id = i;
      }
      pa.append(QPointF(ia, s->logprobs_a[ia]));
      lo = std::min(lo, double(s->logprobs_a[ia]));
      hi = std::max(hi, double(s->logprobs_a[ia]));
      if (cmp) {
        pb.append(QPointF(ia, s->logprobs_b[ia]));
        lo = std::min(lo, double(s->logprobs_b[ia]));
        hi = std::max(hi, double(s->logprobs_b[ia]));
        const double d = s->logprobs_b[id] - s->logprobs_a[id];
        pd.append(QPointF(id, d));
        dmax = std::max(dmax, std::fabs(d));
      }
    }
    if (!std::isfinite(lo)) lo = -1, hi = 0;
  }
  // Axes first, with the series empty: Qt Charts lays every point out again on each axis change.
  for (auto* x : {a_, b_, diff_, marker_}) x->clear();
  x_->setRange(x0, x1);
  if (s) {
    const double raw = std::max(1.0, (x1 - x0) / 8.0);
    const double p10 = std::pow(10.0, std::floor(std::log10(raw)));
    const double step = raw <= p10 ? p10 : raw <= 2 * p10 ? 2 * p10 : raw <= 5 * p10 ? 5 * p10 : 10 * p10;
    x_->setTickType(QValueAxis::TicksDynamic);
    x_->setTickAnchor(0);
    x_->setTickInterval(step);
  }
  const bool only_diff = cmp && difference_only_;
  a_->setVisible(s && !only_diff);
  b_->setVisible(cmp && !only_diff);
  diff_->setVisible(cmp);
  y_diff_->setVisible(cmp);
  y_->setVisible(s && !only_diff);
  x_->setVisible(s != nullptr);
  chart()->legend()->setVisible(s != nullptr);
  const double pad = std::max(1e-3, (hi - lo) * 0.05);
  y_->setRange(lo - pad, std::min(hi + pad, 0.0 + pad));
  const double dpad = dmax > 0 ? dmax * 1.1 : 1e-6;
  y_diff_->setRange(-dpad, dpad);
  a_->replace(pa);
  b_->replace(pb);
  diff_->replace(pd);
  setSelectedToken(selected_);
}

void LogprobChart::setSelectedToken(int token) {
  selected_ = token;
  QList<QPointF> pts;
  if (token >= 0) pts = {QPointF(token, y_->min()), QPointF(token, y_->max())};
  marker_->replace(pts);
}

void LogprobChart::mousePressEvent(QMouseEvent* e) {
  if (e->button() == Qt::LeftButton && tokenAt(e->position().toPoint()) >= 0) {
    pressed_ = true;
    dragging_ = false;
    press_pos_ = e->position().toPoint();
    e->accept();
    return;
  }
  QChartView::mousePressEvent(e);
}

void LogprobChart::mouseMoveEvent(QMouseEvent* e) {
  const QPoint pos = e->position().toPoint();
  if (pressed_ && (dragging_ || std::abs(pos.x() - press_pos_.x()) >= kDragPixels)) {
    dragging_ = true;
    const QRectF plot = chart()->mapToScene(chart()->plotArea()).boundingRect();
    const QRect p = mapFromScene(plot).boundingRect();
    band_->setGeometry(QRect(QPoint(std::min(pos.x(), press_pos_.x()), p.top()),
                             QPoint(std::max(pos.x(), press_pos_.x()), p.bottom())));
    band_->show();
    QToolTip::hideText();
    e->accept();
    return;
  }
  const int t = tokenAt(pos);
  if (t >= 0)
    QToolTip::showText(e->globalPosition().toPoint(), valueText(t), this);
  else
    QToolTip::hideText();
  QChartView::mouseMoveEvent(e);
}

void LogprobChart::mouseReleaseEvent(QMouseEvent* e) {
  if (!pressed_ || e->button() != Qt::LeftButton) return QChartView::mouseReleaseEvent(e);
  pressed_ = false;
  band_->hide();
  const QPoint pos = e->position().toPoint();
  if (dragging_) {
    dragging_ = false;
    const double xa = xAt(press_pos_), xb = xAt(pos);
    // Tokens whose column [t, t + 1) the drag covered, at least one.
    const double first = std::floor(std::min(xa, xb) + 0.5), last = std::floor(std::max(xa, xb) + 0.5) + 1;
    emit tokenRangeRequested(std::max(first, 0.0), std::min(last, double(tokens())));
  } else if (const int t = tokenAt(press_pos_); t >= 0) {
    emit tokenClicked(t);
  }
  e->accept();
}

void LogprobChart::mouseDoubleClickEvent(QMouseEvent* e) {
  // Everything: the heatmap clamps the end to its last column (the chart has no point for the last
  // token, which predicts nothing).
  if (tokens() > 0) emit tokenRangeRequested(0, std::numeric_limits<double>::infinity());
  e->accept();
}

void LogprobChart::wheelEvent(QWheelEvent* e) {
  const int n = tokens();
  if (!(e->modifiers() & Qt::ControlModifier) || n == 0 || e->angleDelta().y() == 0)
    return QChartView::wheelEvent(e);
  // Zoom about the token under the pointer, which stays where it is.
  const double at = std::clamp(xAt(e->position().toPoint()) + 0.5, 0.0, double(n));
  const double f = e->angleDelta().y() > 0 ? 1 / 1.5 : 1.5;
  const double x0 = x_->min() + 0.5, x1 = x_->max() + 0.5;
  emit tokenRangeRequested(at - (at - x0) * f, at + (x1 - at) * f);
  e->accept();
}

}  // namespace dsv4::gui
