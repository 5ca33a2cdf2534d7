#include "gui/widgets/logprob_chart.h"

#include <QChart>
#include <QLegendMarker>
#include <QLineSeries>
#include <QMouseEvent>
#include <QToolTip>
#include <QValueAxis>
#include <algorithm>
#include <cmath>

namespace dsv4::gui {

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
}

void LogprobChart::setDifferenceOnly(bool on) {
  difference_only_ = on;
  rebuild();
}

int LogprobChart::tokenAt(const QPoint& viewport_pos) const {
  const SeqTokens* s = model_ ? model_->tokens() : nullptr;
  const QPointF in_chart = chart()->mapFromScene(mapToScene(viewport_pos));
  if (!s || s->logprobs_a.empty() || !chart()->plotArea().contains(in_chart)) return -1;
  const QPointF v = chart()->mapToValue(in_chart, a_);
  return std::clamp(int(std::lround(v.x())), 0, int(s->logprobs_a.size()) - 1);
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

void LogprobChart::mouseMoveEvent(QMouseEvent* e) {
  const int t = tokenAt(e->position().toPoint());
  if (t >= 0)
    QToolTip::showText(e->globalPosition().toPoint(), valueText(t), this);
  else
    QToolTip::hideText();
  QChartView::mouseMoveEvent(e);
}

void LogprobChart::setModel(TokenModel* m) {
  model_ = m;
  connect(model_, &QAbstractItemModel::modelReset, this, &LogprobChart::rebuild);
  rebuild();
}

int LogprobChart::pointsShown() const {
  return int(a_->count());
}

void LogprobChart::rebuild() {
  const SeqTokens* s = model_ ? model_->tokens() : nullptr;
  const bool cmp = model_ && model_->comparison();
  QList<QPointF> pa, pb, pd;
  double lo = 0, hi = 0, dmax = 0;
  if (s) {
    const int n = int(s->logprobs_a.size());
    const int bucket = std::max(1, (n + kMaxPoints - 1) / kMaxPoints);
    lo = INFINITY;
    hi = -INFINITY;
    for (int i0 = 0; i0 < n; i0 += bucket) {
      const int i1 = std::min(n, i0 + bucket);
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
    x_->setRange(0, std::max(1, n - 1));
    const double raw = std::max(1.0, n / 8.0);
    const double p10 = std::pow(10.0, std::floor(std::log10(raw)));
    const double step = raw <= p10 ? p10 : raw <= 2 * p10 ? 2 * p10 : raw <= 5 * p10 ? 5 * p10 : 10 * p10;
    x_->setTickType(QValueAxis::TicksDynamic);
    x_->setTickAnchor(0);
    x_->setTickInterval(step);
  } else {
    lo = -1;
    hi = 0;
    x_->setRange(0, 1);
  }
  a_->replace(pa);
  b_->replace(pb);
  diff_->replace(pd);
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
  setSelectedToken(selected_);
}

void LogprobChart::setSelectedToken(int token) {
  selected_ = token;
  QList<QPointF> pts;
  if (token >= 0) pts = {QPointF(token, y_->min()), QPointF(token, y_->max())};
  marker_->replace(pts);
}

void LogprobChart::mousePressEvent(QMouseEvent* e) {
  const int t = tokenAt(e->position().toPoint());
  if (e->button() == Qt::LeftButton && t >= 0) {
    emit tokenClicked(t);
    e->accept();
    return;
  }
  QChartView::mousePressEvent(e);
}

}  // namespace dsv4::gui
