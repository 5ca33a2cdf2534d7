#include "gui/models/gradient_model.h"

#include <QBrush>
#include <QColor>
#include <QStringList>
#include <algorithm>
#include <cmath>

#include "gui/models/colour_scale.h"
#include "gui/models/heatmap_model.h"

namespace dsv4::gui {

namespace {

// As in the overview: a cell that differs at all is drawn at least this far up the scale.
constexpr double kDifferenceFloor = 0.12;

QString num(double v, int precision = 3) {
  if (std::isnan(v)) return QStringLiteral("?");
  if (std::isinf(v)) return v > 0 ? QStringLiteral("+∞") : QStringLiteral("−∞");
  return QString::number(v, 'g', precision);
}

}  // namespace

GradientDiffModel::GradientDiffModel(TraceDocument* doc, QObject* parent)
    : QAbstractTableModel(parent), doc_(doc) {
  auto reset = [this] {
    beginResetModel();
    rebuild();
    endResetModel();
  };
  connect(doc_, &TraceDocument::datasetReset, this, reset);
  connect(doc_, &TraceDocument::reportLoaded, this, reset);
}

const TrainingDiff* GradientDiffModel::training() const {
  const auto& r = doc_->data().report;
  return r && r->training ? &*r->training : nullptr;
}

void GradientDiffModel::rebuild() {
  rows_ = cols_ = 0;
  cell_.clear();
  lo_ = hi_ = 0;
  const TrainingDiff* t = training();
  if (!t) return;
  int layers = doc_->data().layers();
  for (const GradAggregate& c : t->cells) layers = std::max(layers, c.layer + 1);
  rows_ = int(t->kinds.size());
  cols_ = 1 + layers;
  cell_.assign(size_t(rows_) * size_t(cols_), -1);
  LogScaleCounts counts;
  for (size_t i = 0; i < t->cells.size(); ++i) {
    const GradAggregate& c = t->cells[i];
    const auto row = std::find(t->kinds.begin(), t->kinds.end(), c.kind);
    if (row == t->kinds.end()) continue;
    cell_[size_t(row - t->kinds.begin()) * size_t(cols_) + size_t(c.layer + 1)] = int(i);
    counts.add(float(c.rel_l2));
  }
  if (counts.count() > 0) {
    const LogScaleCounts::Range r = counts.range(false);
    lo_ = r.lo;
    hi_ = r.hi;
  }
}

int GradientDiffModel::rowCount(const QModelIndex& parent) const {
  return parent.isValid() ? 0 : rows_;
}
int GradientDiffModel::columnCount(const QModelIndex& parent) const {
  return parent.isValid() ? 0 : cols_;
}

const GradAggregate* GradientDiffModel::cell(int row, int column) const {
  if (row < 0 || row >= rows_ || column < 0 || column >= cols_) return nullptr;
  const int i = cell_[size_t(row) * size_t(cols_) + size_t(column)];
  return i < 0 ? nullptr : &training()->cells[size_t(i)];
}

double GradientDiffModel::level(double v) const {
  if (v == 0) return 0;
  if (std::isinf(v) || hi_ <= lo_) return 1;
  const double t = std::clamp((std::log(v) - std::log(lo_)) / (std::log(hi_) - std::log(lo_)), 0.0, 1.0);
  return kDifferenceFloor + (1 - kDifferenceFloor) * t;
}

QString GradientDiffModel::cellToolTip(int row, int column) const {
  const GradAggregate* c = cell(row, column);
  if (!c) return {};
  const QString where =
      c->layer < 0 ? QStringLiteral("model-level") : QStringLiteral("layer %1").arg(c->layer);
  QString s = QStringLiteral("%1, %2\n").arg(QString::fromStdString(c->kind), where);
  s += QStringLiteral("rel-L2 ‖gB − gA‖ / ‖gA‖: %1\ncosine: %2\nmax |gB − gA|: %3\n")
           .arg(num(c->rel_l2, 6), num(c->cosine, 9), num(c->max_abs, 6));
  s += QStringLiteral("rows differing: %1 of %2 (%3 of %4 parameters)\n")
           .arg(c->rows_differing)
           .arg(c->rows)
           .arg(c->params_differing)
           .arg(c->params);
  if (c->full_params == c->params)
    s += QStringLiteral("full gradients: all %1 parameters").arg(c->params);
  else
    s += QStringLiteral("full gradients: %1 of %2 parameters (record with --capture-params for the numbers)")
             .arg(c->full_params)
             .arg(c->params);
  if (c->nonfinite_differing > 0)
    s += QStringLiteral("\nnon-finite differing elements: %1").arg(c->nonfinite_differing);
  return s;
}

QVariant GradientDiffModel::data(const QModelIndex& index, int role) const {
  if (!index.isValid()) return {};
  const GradAggregate* c = cell(index.row(), index.column());
  if (!c) return role == Qt::BackgroundRole ? QVariant(QBrush(QColor(0xee, 0xee, 0xf2))) : QVariant();
  const double lv = std::isnan(c->rel_l2) ? -1 : level(c->rel_l2);
  switch (role) {
    case Qt::DisplayRole:
      return c->rel_l2 == 0 ? QStringLiteral("0") : num(c->rel_l2, 2);
    case Qt::ToolTipRole:
      return cellToolTip(index.row(), index.column());
    case Qt::TextAlignmentRole:
      return QVariant::fromValue(Qt::Alignment(Qt::AlignCenter));
    case Qt::BackgroundRole:
      // Unknown (digests differ, no full gradients): hatched.
      if (lv < 0) return QBrush(QColor(0x9e, 0x9e, 0x9e), Qt::BDiagPattern);
      return QBrush(QColor(heat_color(lv)));
    case Qt::ForegroundRole:
      return lv > 0.6 ? QColor(Qt::white) : QColor(Qt::black);
    case ValueRole:
      return c->rel_l2;
    case CosineRole:
      return c->cosine;
    case RowsDifferingRole:
      return qint64(c->rows_differing);
    case LevelRole:
      return lv < 0 ? QVariant() : QVariant(lv);
    default:
      return {};
  }
}

QVariant GradientDiffModel::headerData(int section, Qt::Orientation o, int role) const {
  if (role != Qt::DisplayRole && role != Qt::ToolTipRole)
    return QAbstractTableModel::headerData(section, o, role);
  if (o == Qt::Horizontal) {
    if (section < 0 || section >= cols_) return {};
    return section == 0 ? QStringLiteral("model") : QString::number(layerOf(section));
  }
  const TrainingDiff* t = training();
  if (!t || section < 0 || section >= rows_) return {};
  return QString::fromStdString(t->kinds[size_t(section)]);
}

QString GradientDiffModel::caption() const {
  const TrainingDiff* t = training();
  if (!t) {
    const auto& r = doc_->data().report;
    return r && !r->training_note.empty()
               ? QString::fromStdString(r->training_note)
               : QStringLiteral("Open two training steps (dsv4 train-step --record).");
  }
  QString s = QStringLiteral(
                  "Gradient rel-L2 of B against A per parameter kind and layer: %1 of %2 parameters "
                  "differ (%3 held in full)")
                  .arg(t->params_differing)
                  .arg(t->params_trained)
                  .arg(t->params_full);
  if (hi_ > 0) s += QStringLiteral("; colour scale (log) %1 … %2").arg(num(lo_), num(hi_));
  QStringList settings;
  for (const SettingDiff& d : t->settings)
    settings << QStringLiteral("%1 %2 → %3")
                    .arg(QString::fromStdString(d.key), QString::fromStdString(d.a),
                         QString::fromStdString(d.b));
  if (!settings.isEmpty()) s += QStringLiteral(". Settings: ") + settings.join(QStringLiteral(", "));
  return s + QStringLiteral(". Hatched: rows differ, no full gradients.");
}

}  // namespace dsv4::gui
