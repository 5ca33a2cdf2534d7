#include "gui/widgets/detail_panel.h"

#include <QComboBox>
#include <QGroupBox>
#include <QHBoxLayout>
#include <QHeaderView>
#include <QHelpEvent>
#include <QLabel>
#include <QPainter>
#include <QScrollArea>
#include <QSplitter>
#include <QTableView>
#include <QToolTip>
#include <QVBoxLayout>
#include <algorithm>
#include <array>
#include <cmath>

namespace dsv4::gui {

namespace {

QString num(double v, int precision = 4) {
  if (std::isnan(v)) return QStringLiteral("—");
  if (std::isinf(v)) return v > 0 ? QStringLiteral("+∞") : QStringLiteral("−∞");
  return QString::number(v, 'g', precision);
}

QString swatch(SetSide s, const QString& text) {
  return QStringLiteral("<span style='color:%1'>■</span> %2").arg(set_color(s).name(), text.toHtmlEscaped());
}

QString ids(const std::vector<int32_t>& v) {
  QStringList s;
  for (int32_t x : v) s << QString::number(x);
  return s.isEmpty() ? QStringLiteral("∅") : s.join(' ');
}

QString flip_text(bool differs, bool tie, double threshold) {
  if (!differs) return QStringLiteral("sets equal");
  if (tie) return QStringLiteral("<b>tie flip</b> (a margin below %1)").arg(num(threshold, 3));
  return QStringLiteral("<b style='color:#b00'>confident flip</b> (both margins ≥ %1)")
      .arg(num(threshold, 3));
}

QTableView* small_table(QAbstractItemModel* m) {
  auto* t = new QTableView;
  t->setModel(m);
  t->verticalHeader()->hide();
  t->horizontalHeader()->setStretchLastSection(true);
  t->horizontalHeader()->setSectionResizeMode(QHeaderView::ResizeToContents);
  t->setSelectionMode(QAbstractItemView::NoSelection);
  t->setEditTriggers(QAbstractItemView::NoEditTriggers);
  t->verticalHeader()->setDefaultSectionSize(t->fontMetrics().height() + 4);
  t->setMinimumHeight(90);
  t->setMaximumHeight(160);
  return t;
}

// A group box whose check box folds it to its title.
void make_collapsible(QGroupBox* box) {
  box->setCheckable(true);
  box->setChecked(true);
  box->setToolTip(QStringLiteral("Untick to fold this section"));
  QObject::connect(box, &QGroupBox::toggled, box, [box](bool on) {
    for (QWidget* w : box->findChildren<QWidget*>(QString(), Qt::FindDirectChildrenOnly)) w->setVisible(on);
  });
}

}  // namespace

// ---- IndexerSetsWidget -----------------------------------------------------------------------

IndexerSetsWidget::IndexerSetsWidget(QWidget* parent) : QWidget(parent) {
  setMinimumHeight(64);
}

void IndexerSetsWidget::setDetail(DetailPtr d) {
  detail_ = std::move(d);
  update();
}

void IndexerSetsWidget::paintEvent(QPaintEvent*) {
  QPainter p(this);
  p.fillRect(rect(), palette().window());
  if (!detail_ || !detail_->has_indexer) return;
  const CellDetail& d = *detail_;
  const int64_t n = std::max<int64_t>(d.groups_visible, 1);
  const int left = 22, top = 4, row_h = 18;
  const double cw = double(width() - left - 6) / n;
  const QColor empty(0xe6, 0xe6, 0xea);
  QFont f = font();
  f.setPointSizeF(f.pointSizeF() * 0.85);
  p.setFont(f);
  auto side_of = [&](int32_t g) {
    if (std::binary_search(d.indexer_only_a.begin(), d.indexer_only_a.end(), g)) return SetSide::OnlyA;
    if (std::binary_search(d.indexer_only_b.begin(), d.indexer_only_b.end(), g)) return SetSide::OnlyB;
    return SetSide::Common;
  };
  auto draw_row = [&](int y, const std::vector<int32_t>& set, const QString& label) {
    p.setPen(palette().color(QPalette::WindowText));
    p.drawText(QRect(0, y, left - 4, row_h), Qt::AlignRight | Qt::AlignVCenter, label);
    p.fillRect(QRectF(left, y, cw * n, row_h), empty);
    if (cw >= 4)
      for (int64_t g = 0; g < n; ++g)
        p.fillRect(QRectF(left + g * cw + cw - 1, y, 1, row_h), palette().window());
    for (int32_t g : set) {
      const double x = left + g * cw;
      p.fillRect(QRectF(x, y, std::max(cw - (cw >= 4 ? 1 : 0), 2.0), row_h), set_color(side_of(g)));
    }
  };
  draw_row(top, d.indexer_a, d.comparison ? QStringLiteral("A") : QString());
  if (d.comparison) draw_row(top + row_h + 4, d.indexer_b, QStringLiteral("B"));
  const int axis_y = top + (d.comparison ? 2 : 1) * (row_h + 4);
  p.setPen(palette().color(QPalette::PlaceholderText));
  p.drawText(QRect(left, axis_y, 80, 14), Qt::AlignLeft | Qt::AlignTop, QStringLiteral("group 0"));
  p.drawText(QRect(width() - 126, axis_y, 120, 14), Qt::AlignRight | Qt::AlignTop,
             QStringLiteral("%1 visible").arg(d.groups_visible));
}

// ---- MhcWidget -------------------------------------------------------------------------------

MhcWidget::MhcWidget(QWidget* parent) : QWidget(parent) {
  setMinimumHeight(120);
}

void MhcWidget::setDetail(DetailPtr d) {
  detail_ = std::move(d);
  update();
}

MhcWidget::Layout MhcWidget::layout() const {
  Layout l;
  if (!detail_ || detail_->hc == 0) return l;
  l.hc = detail_->hc;
  l.mats = detail_->comparison ? 3 : 1;
  if (detail_->comparison) l.title_h = 28;  // B − A's scale on a second line, never cut
  l.cell_w = std::clamp((width() - l.label_w - l.gap * l.mats) / (l.mats * l.hc), 10, 46);
  l.cell_h = std::clamp((height() - 2 * l.title_h - 8) / (2 * l.hc), 8, 18);
  return l;
}

bool MhcWidget::event(QEvent* e) {
  if (e->type() != QEvent::ToolTip || !detail_ || detail_->hc == 0) return QWidget::event(e);
  const QPoint p = static_cast<QHelpEvent*>(e)->pos();
  const Layout l = layout();
  const CellDetail& d = *detail_;
  int y = 0;
  for (int s = 0; s < 2; ++s) {
    if (d.comb_a[s].empty()) continue;
    const int j = (p.y() - y - l.title_h) / l.cell_h;
    if (p.y() >= y + l.title_h && j < l.hc) {
      for (int m = 0; m < l.mats; ++m) {
        const int x0 = l.label_w + m * (l.hc * l.cell_w + l.gap);
        const int k = (p.x() - x0) / l.cell_w;
        if (p.x() < x0 || k >= l.hc) continue;
        const size_t i = size_t(j) * l.hc + k;
        QString text = QStringLiteral("%1 comb[%2][%3]\nA %4")
                           .arg(s ? "ffn" : "attn")
                           .arg(j)
                           .arg(k)
                           .arg(d.comb_a[s][i], 0, 'g', 8);
        if (d.comparison && i < d.comb_b[s].size())
          text += QStringLiteral("\nB %1\nB − A %2")
                      .arg(d.comb_b[s][i], 0, 'g', 8)
                      .arg(d.comb_diff[s][i], 0, 'g', 4);
        QToolTip::showText(static_cast<QHelpEvent*>(e)->globalPos(), text, this);
        return true;
      }
    }
    y += l.title_h + l.hc * l.cell_h + 8;
  }
  QToolTip::hideText();
  return true;
}

void MhcWidget::paintEvent(QPaintEvent*) {
  QPainter p(this);
  p.fillRect(rect(), palette().window());
  if (!detail_ || detail_->hc == 0) return;
  const CellDetail& d = *detail_;
  const Layout l = layout();
  const int hc = l.hc, mats = l.mats, label_w = l.label_w, gap = l.gap, title_h = l.title_h;
  const int cell_w = l.cell_w, cell_h = l.cell_h;
  // Each B − A matrix has its own colour scale (its largest |value|), so a sublayer whose
  // differences are 1e-9 is not drawn white next to one whose differences are 1e-3.
  std::array<double, 2> max_diff{0, 0};
  for (int s = 0; s < 2; ++s)
    for (float x : d.comb_diff[s])
      if (std::isfinite(x)) max_diff[s] = std::max(max_diff[s], double(std::fabs(x)));
  QFont f = font();
  f.setPointSizeF(std::max(6.0, f.pointSizeF() * 0.75));
  p.setFont(f);
  // Numbers in the cells where they fit: A and B with 2 decimals, B − A with 1 significant digit.
  const QFontMetrics fm(f);
  const bool fits_h = cell_h >= fm.height() - 2;
  const bool numbers_ab = fits_h && cell_w >= fm.horizontalAdvance(QStringLiteral("0.00")) + 2;
  const bool numbers_diff = fits_h && cell_w >= fm.horizontalAdvance(QStringLiteral("-5e-07")) + 2;
  int y = 0;
  static const char* sub[] = {"attn", "ffn"};
  static const char* names[] = {"A", "B", "B − A"};
  for (int s = 0; s < 2; ++s) {
    if (d.comb_a[s].empty()) continue;
    p.setPen(palette().color(QPalette::WindowText));
    p.drawText(QRect(0, y + title_h, label_w - 4, hc * cell_h), Qt::AlignRight | Qt::AlignVCenter,
               QString::fromUtf8(sub[s]));
    for (int m = 0; m < mats; ++m) {
      const std::vector<float>& v = m == 0 ? d.comb_a[s] : m == 1 ? d.comb_b[s] : d.comb_diff[s];
      const int x0 = label_w + m * (hc * cell_w + gap);
      p.setPen(palette().color(QPalette::WindowText));
      QString title = QString::fromUtf8(names[m]);
      if (m == 2) title += QStringLiteral("\n±%1").arg(num(max_diff[s], 2));
      p.drawText(QRect(x0, y, hc * cell_w + gap, title_h), Qt::AlignLeft | Qt::AlignBottom, title);
      if (v.size() < size_t(hc) * hc) continue;
      for (int j = 0; j < hc; ++j) {
        for (int k = 0; k < hc; ++k) {
          const double x = v[size_t(j) * hc + k];
          QColor c;
          if (m < 2) {
            const double t = std::clamp(x, 0.0, 1.0);
            c = QColor::fromRgbF(float(1 - 0.55 * t), float(1 - 0.25 * t), float(1 - 0.55 * t));
          } else {
            const double t = max_diff[s] > 0 ? std::clamp(x / max_diff[s], -1.0, 1.0) : 0.0;
            c = t >= 0 ? QColor::fromRgbF(1.f, float(1 - 0.8 * t), float(1 - 0.8 * t))
                       : QColor::fromRgbF(float(1 + 0.8 * t), float(1 + 0.5 * t), 1.f);
          }
          const QRect r(x0 + k * cell_w, y + title_h + j * cell_h, cell_w - 1, cell_h - 1);
          p.fillRect(r, c);
          if (m < 2 ? numbers_ab : numbers_diff) {
            p.setPen(QColor(0x20, 0x20, 0x20));
            p.drawText(r, Qt::AlignCenter,
                       m < 2    ? QString::number(x, 'f', 2)
                       : x == 0 ? QStringLiteral("0")
                                : QString::number(x, 'e', 0));
          }
        }
      }
    }
    y += title_h + hc * cell_h + 8;
  }
}

// ---- HistogramWidget -------------------------------------------------------------------------

HistogramWidget::HistogramWidget(QWidget* parent) : QWidget(parent) {
  setMinimumHeight(110);
}

void HistogramWidget::setTensor(DetailPtr d, int tensor) {
  detail_ = std::move(d);
  tensor_ = tensor;
  update();
}

void HistogramWidget::paintEvent(QPaintEvent*) {
  QPainter p(this);
  p.fillRect(rect(), QColor(0xff, 0xff, 0xff));
  if (!detail_ || tensor_ < 0 || tensor_ >= int(detail_->tensors.size())) return;
  const TensorDetail& t = detail_->tensors[tensor_];
  const Histogram& h = t.histogram;
  QFont f = font();
  f.setPointSizeF(f.pointSizeF() * 0.8);
  p.setFont(f);
  const QRect plot = rect().adjusted(8, 16, -8, -16);
  int64_t mx = 0;
  for (auto c : h.counts) mx = std::max(mx, c);
  p.setPen(QColor(0x44, 0x44, 0x44));
  const QString what = t.comparison
                           ? QStringLiteral("B − A over %1 elements: %2 equal").arg(t.elems).arg(h.zeros)
                           : QStringLiteral("values over %1 elements").arg(t.elems);
  p.drawText(QRect(plot.left(), 0, plot.width(), 15), Qt::AlignLeft | Qt::AlignVCenter,
             what + (h.nonfinite ? QStringLiteral(", %1 non-finite").arg(h.nonfinite) : QString()) +
                 QStringLiteral(" (log counts)"));
  if (mx == 0 || h.counts.empty()) {
    p.drawText(plot, Qt::AlignCenter,
               t.comparison ? QStringLiteral("no differences") : QStringLiteral("no values"));
    return;
  }
  const double bw = double(plot.width()) / h.counts.size();
  const double lmx = std::log1p(double(mx));
  for (size_t i = 0; i < h.counts.size(); ++i) {
    if (h.counts[i] == 0) continue;
    const double bh = std::log1p(double(h.counts[i])) / lmx * plot.height();
    p.fillRect(QRectF(plot.left() + i * bw, plot.bottom() - bh, std::max(bw - 1, 1.0), bh),
               QColor(0xd9, 0x5f, 0x0e));
  }
  p.setPen(QColor(0x88, 0x88, 0x88));
  p.drawLine(plot.bottomLeft(), plot.bottomRight());
  p.setPen(QColor(0x44, 0x44, 0x44));
  p.drawText(QRect(plot.left(), plot.bottom() + 2, 120, 14), Qt::AlignLeft | Qt::AlignTop, num(h.lo, 3));
  p.drawText(QRect(plot.right() - 120, plot.bottom() + 2, 120, 14), Qt::AlignRight | Qt::AlignTop,
             num(h.hi, 3));
  if (t.comparison)
    p.drawText(QRect(plot.center().x() - 20, plot.bottom() + 2, 40, 14), Qt::AlignHCenter | Qt::AlignTop,
               QStringLiteral("0"));
}

// ---- DetailPanel -----------------------------------------------------------------------------

DetailPanel::DetailPanel(QWidget* parent) : QWidget(parent) {
  auto* outer = new QVBoxLayout(this);
  outer->setContentsMargins(0, 0, 0, 0);
  auto* scroll = new QScrollArea;
  scroll->setWidgetResizable(true);
  scroll->setFrameShape(QFrame::NoFrame);
  outer->addWidget(scroll);
  auto* content = new QWidget;
  scroll->setWidget(content);
  // Two columns (decisions | numbers) that a splitter resizes; a hidden section leaves no gap, and
  // each section folds to its title (its check box).
  auto* outer_layout = new QVBoxLayout(content);
  outer_layout->setContentsMargins(6, 6, 6, 6);
  auto* columns = new QSplitter(Qt::Horizontal);
  columns->setChildrenCollapsible(true);
  auto* left_w = new QWidget;
  auto* right_w = new QWidget;
  auto* left = new QVBoxLayout(left_w);
  auto* right = new QVBoxLayout(right_w);
  left->setContentsMargins(0, 0, 3, 0);
  right->setContentsMargins(3, 0, 0, 0);
  columns->addWidget(left_w);
  columns->addWidget(right_w);

  title_ = new QLabel(QStringLiteral("Select a cell of the heatmap."));
  title_->setTextFormat(Qt::RichText);
  title_->setWordWrap(true);
  outer_layout->addWidget(title_);

  indexer_box_ = new QGroupBox(QStringLiteral("Indexer selection (compressed groups)"));
  auto* il = new QVBoxLayout(indexer_box_);
  indexer_sets_ = new IndexerSetsWidget;
  indexer_text_ = new QLabel;
  indexer_text_->setTextFormat(Qt::RichText);
  indexer_text_->setWordWrap(true);
  indexer_text_->setTextInteractionFlags(Qt::TextSelectableByMouse);
  indexer_model_ = new IndexerSetModel(this);
  indexer_table_ = small_table(indexer_model_);
  il->addWidget(indexer_sets_);
  il->addWidget(indexer_text_);
  il->addWidget(indexer_table_);
  il->addStretch(1);
  left->addWidget(indexer_box_);

  routing_box_ = new QGroupBox(QStringLiteral("Experts"));
  auto* rl = new QVBoxLayout(routing_box_);
  routing_text_ = new QLabel;
  routing_text_->setTextFormat(Qt::RichText);
  routing_text_->setWordWrap(true);
  expert_model_ = new ExpertModel(this);
  expert_table_ = small_table(expert_model_);
  rl->addWidget(routing_text_);
  rl->addWidget(expert_table_);
  rl->addStretch(1);
  left->addWidget(routing_box_);

  mhc_box_ = new QGroupBox(QStringLiteral("mHC comb matrices"));
  auto* ml = new QVBoxLayout(mhc_box_);
  mhc_ = new MhcWidget;
  ml->addWidget(mhc_);
  ml->addStretch(1);
  right->addWidget(mhc_box_);

  tensor_box_ = new QGroupBox(QStringLiteral("Full tensors"));
  auto* tl = new QVBoxLayout(tensor_box_);
  tensor_combo_ = new QComboBox;
  tensor_text_ = new QLabel;
  tensor_text_->setWordWrap(true);
  histogram_ = new HistogramWidget;
  worst_model_ = new WorstElementsModel(this);
  worst_table_ = small_table(worst_model_);
  tl->addWidget(tensor_combo_);
  tl->addWidget(tensor_text_);
  tl->addWidget(histogram_);
  tl->addWidget(worst_table_);
  tl->addStretch(1);
  right->addWidget(tensor_box_);

  digest_text_ = new QLabel;
  digest_text_->setWordWrap(true);
  digest_text_->setTextInteractionFlags(Qt::TextSelectableByMouse);
  left->addStretch(1);
  right->addStretch(1);
  outer_layout->addWidget(digest_text_);
  outer_layout->addWidget(columns, 1);
  for (QGroupBox* box : {indexer_box_, routing_box_, mhc_box_, tensor_box_}) make_collapsible(box);
  // Unfolded, the tensor section shows again only what its mode has (no worst elements of one trace).
  connect(tensor_box_, &QGroupBox::toggled, this, [this] { showTensor(tensor_combo_->currentIndex()); });

  connect(tensor_combo_, &QComboBox::currentIndexChanged, this, &DetailPanel::showTensor);
  setDetail(nullptr);
}

void DetailPanel::setMessage(const QString& text) {
  title_->setText(text.toHtmlEscaped());
}

QString DetailPanel::headline() const {
  return title_->text();
}

void DetailPanel::setDetail(DetailPtr d) {
  detail_ = std::move(d);
  indexer_sets_->setDetail(detail_);
  indexer_model_->setDetail(detail_);
  expert_model_->setDetail(detail_);
  mhc_->setDetail(detail_);
  const CellDetail* c = detail_.get();
  indexer_box_->setVisible(c && c->has_indexer);
  routing_box_->setVisible(c && c->has_routing);
  mhc_box_->setVisible(c && c->hc > 0);
  tensor_box_->setVisible(c && !c->tensors.empty());
  digest_text_->setVisible(c && c->comparison);
  if (!c) {
    title_->setText(QStringLiteral("Select a cell of the heatmap."));
    worst_model_->setDetail(nullptr, -1);
    histogram_->setTensor(nullptr, -1);
    return;
  }
  const QString kind = c->compress_ratio == 0 ? QStringLiteral("sliding window only")
                                              : QStringLiteral("compress ratio %1").arg(c->compress_ratio);
  title_->setText(QStringLiteral("<b>layer %1</b> (%2) · <b>token %3</b> (id %4) · sequence %5")
                      .arg(c->layer)
                      .arg(kind)
                      .arg(c->token)
                      .arg(c->token_id)
                      .arg(c->seq));
  if (c->has_indexer) {
    QString t;
    if (c->comparison) {
      t = swatch(SetSide::Common, QStringLiteral("common: %1").arg(c->indexer_common.size())) + " &nbsp; " +
          swatch(SetSide::OnlyA, QStringLiteral("only A: %1").arg(c->indexer_only_a.size())) + " &nbsp; " +
          swatch(SetSide::OnlyB, QStringLiteral("only B: %1").arg(c->indexer_only_b.size())) + "<br>";
      t += QStringLiteral("A: %1<br>B: %2<br>").arg(ids(c->indexer_a), ids(c->indexer_b));
      t += QStringLiteral("margin A %1 · B %2 · ").arg(num(c->indexer_margin_a), num(c->indexer_margin_b));
      t += flip_text(c->indexer_differs, c->indexer_tie_flip, c->indexer_tie_threshold);
    } else {
      t = QStringLiteral("selected: %1<br>margin %2 (near-tie threshold %3)%4")
              .arg(ids(c->indexer_a), num(c->indexer_margin_a), num(c->indexer_tie_threshold, 3),
                   c->indexer_margin_a < c->indexer_tie_threshold ? QStringLiteral(" · <b>near tie</b>")
                                                                  : QString());
    }
    indexer_text_->setText(t);
  }
  if (c->has_routing) {
    QString t = c->hashed ? QStringLiteral("hash-routed layer (ids from the token)<br>") : QString();
    if (c->comparison) {
      t += QStringLiteral("router margin A %1 · B %2 · ")
               .arg(num(c->router_margin_a), num(c->router_margin_b));
      t += flip_text(c->routing_differs, c->routing_tie_flip, c->router_tie_threshold);
    } else {
      t += QStringLiteral("router margin %1 (near-tie threshold %2)%3")
               .arg(num(c->router_margin_a), num(c->router_tie_threshold, 3),
                    c->router_margin_a < c->router_tie_threshold ? QStringLiteral(" · <b>near tie</b>")
                                                                 : QString());
    }
    routing_text_->setText(t);
  }
  {
    const QSignalBlocker block(tensor_combo_);
    tensor_combo_->clear();
    // Execution order, each with its error; the first differing one is shown.
    for (const auto& t : c->tensors)
      tensor_combo_->addItem(
          t.comparison ? QStringLiteral("%1 (row %2) · rel-L2 %3")
                             .arg(QString::fromStdString(t.name))
                             .arg(t.row)
                             .arg(num(t.rel_l2, 3))
                       : QStringLiteral("%1 (row %2)").arg(QString::fromStdString(t.name)).arg(t.row));
    tensor_combo_->setCurrentIndex(c->first_differing_tensor >= 0 ? c->first_differing_tensor
                                   : c->tensors.empty()           ? -1
                                                                  : 0);
  }
  showTensor(tensor_combo_->currentIndex());
  if (c->comparison) {
    QStringList names;
    for (const auto& n : c->digest_differing) names << QString::fromStdString(n);
    digest_text_->setText(
        names.isEmpty() ? QStringLiteral("Digests: every tensor of this layer is bit-equal at this token.")
                        : QStringLiteral("Digests differ at this token: %1").arg(names.join(", ")));
  }
}

void DetailPanel::showTensor(int i) {
  worst_model_->setDetail(detail_, i);
  histogram_->setTensor(detail_, i);
  worst_table_->setVisible(detail_ && detail_->comparison && tensor_box_->isChecked());  // folded: stays so
  if (!detail_ || i < 0 || i >= int(detail_->tensors.size())) {
    tensor_text_->clear();
    return;
  }
  const TensorDetail& t = detail_->tensors[i];
  tensor_text_->setText(t.comparison ? QStringLiteral("%1 elements · rel-L2 %2 · max |B − A| %3")
                                           .arg(t.elems)
                                           .arg(num(t.rel_l2), num(t.max_abs))
                                     : QStringLiteral("%1 elements").arg(t.elems));
}

}  // namespace dsv4::gui
