#include "gui/models/navigator_model.h"

#include <algorithm>
#include <cmath>

namespace dsv4::gui {

namespace {

QString num(double v, int prec = 3) {
  if (std::isnan(v)) return QStringLiteral("–");
  if (std::isinf(v)) return v > 0 ? QStringLiteral("∞") : QStringLiteral("−∞");
  return QString::number(v, 'g', prec);
}

QString severity_text(const Divergence& d) {
  switch (d.kind) {
    case DivergenceKind::ConfidentFlip:
    case DivergenceKind::TieFlip:
      return d.threshold > 0 ? QStringLiteral("margin %1× tie threshold").arg(num(d.value))
                             : QStringLiteral("margin %1").arg(num(d.value));
    case DivergenceKind::FirstTensor:
      return d.full ? QStringLiteral("rel-L2 %1").arg(num(d.value))
                    : QStringLiteral("%1% of rows differ").arg(num(100 * d.value));
    case DivergenceKind::WorstToken:
      return QStringLiteral("|Δ log p| %1").arg(num(d.value));
  }
  return {};
}

}  // namespace

NavigatorModel::NavigatorModel(TraceDocument* doc, QObject* parent) : ColumnTableModel(parent), doc_(doc) {
  connect(doc_, &TraceDocument::datasetReset, this, [this] {
    list_.reset();
    rebuild();
  });
  connect(doc_, &TraceDocument::divergencesLoaded, this, [this] {
    list_ = doc_->data().divergences;
    rebuild();
  });
}

int NavigatorModel::rows() const {
  return int(shown_.size());
}

QStringList NavigatorModel::columns() const {
  return {QStringLiteral("kind"),  QStringLiteral("seq"),  QStringLiteral("layer"),
          QStringLiteral("token"), QStringLiteral("what"), QStringLiteral("severity")};
}

const Divergence* NavigatorModel::item(int row) const {
  if (!list_ || row < 0 || row >= int(shown_.size())) return nullptr;
  return &list_->items[size_t(shown_[size_t(row)])];
}

QVariant NavigatorModel::data(const QModelIndex& index, int role) const {
  const Divergence* d = item(index.row());
  if (!d) return {};
  if (role == KindRole) return int(d->kind);
  if (role == Qt::TextAlignmentRole)
    return index.column() == Seq || index.column() == Layer || index.column() == Token
               ? QVariant(Qt::AlignRight | Qt::AlignVCenter)
               : QVariant();
  if (role == Qt::ToolTipRole) {
    QString t =
        QStringLiteral("%1 · sequence %2").arg(QString::fromUtf8(divergence_kind_name(d->kind))).arg(d->seq);
    if (d->layer >= 0) t += QStringLiteral(" · layer %1").arg(d->layer);
    t += QStringLiteral(" · token %1 · %2").arg(d->token).arg(QString::fromStdString(d->what));
    if (d->kind == DivergenceKind::ConfidentFlip || d->kind == DivergenceKind::TieFlip)
      t += QStringLiteral("\nmargins A %1, B %2; tie threshold %3")
               .arg(num(d->margin_a), num(d->margin_b), num(d->threshold));
    return t;
  }
  if (role != Qt::DisplayRole) return {};
  switch (index.column()) {
    case Kind:
      return QString::fromUtf8(divergence_kind_name(d->kind));
    case Seq:
      return d->seq;
    case Layer:
      return d->layer >= 0 ? QVariant(d->layer)
                           : QVariant(d->kind == DivergenceKind::FirstTensor ? QStringLiteral("model")
                                                                             : QStringLiteral("–"));
    case Token:
      return qlonglong(d->token);
    case What:
      return QString::fromStdString(d->what);
    case Severity:
      return severity_text(*d);
  }
  return {};
}

void NavigatorModel::sort(int column, Qt::SortOrder order) {
  sort_column_ = column;
  sort_order_ = order;
  rebuild();
}

void NavigatorModel::setLayerFilter(int layer) {
  layer_ = layer;
  rebuild();
}
void NavigatorModel::setKindFilter(int kind) {
  kind_ = kind;
  rebuild();
}
void NavigatorModel::setSeqFilter(int seq) {
  seq_ = seq;
  rebuild();
}

void NavigatorModel::rebuild() {
  // Keep the current item current when it is still shown.
  const int was = current_ >= 0 && current_ < int(shown_.size()) ? shown_[size_t(current_)] : -1;
  beginResetModel();
  shown_.clear();
  if (list_) {
    const auto& items = list_->items;
    for (size_t i = 0; i < items.size(); ++i) {
      const Divergence& d = items[i];
      if (layer_ >= 0 && d.layer != layer_) continue;
      if (kind_ >= 0 && int(d.kind) != kind_) continue;
      if (seq_ >= 0 && d.seq != seq_) continue;
      shown_.push_back(int(i));  // items are in severity order
    }
    if (sort_column_ != Severity) {
      auto key = [&](const Divergence& d) -> std::pair<QString, double> {
        switch (sort_column_) {
          case Kind:
            return {{}, double(d.kind)};
          case Seq:
            return {{}, double(d.seq)};
          case Layer:
            return {{}, double(d.layer)};
          case Token:
            return {{}, double(d.token)};
          case What:
            return {QString::fromStdString(d.what), 0};
        }
        return {{}, 0};
      };
      std::stable_sort(shown_.begin(), shown_.end(),
                       [&](int x, int y) { return key(items[size_t(x)]) < key(items[size_t(y)]); });
    }
    if (sort_order_ == Qt::DescendingOrder) std::reverse(shown_.begin(), shown_.end());
  }
  endResetModel();
  const auto it = std::find(shown_.begin(), shown_.end(), was);
  const int now = it == shown_.end() ? -1 : int(it - shown_.begin());
  if (now != current_ || was < 0) {
    current_ = now;
    emit currentChanged(current_);
  }
}

void NavigatorModel::setCurrent(int row) {
  current_ = row >= 0 && row < int(shown_.size()) ? row : -1;
  emit currentChanged(current_);
}

const Divergence* NavigatorModel::next() {
  if (shown_.empty() || current_ + 1 >= int(shown_.size())) return nullptr;
  setCurrent(current_ + 1);
  return item(current_);
}

const Divergence* NavigatorModel::previous() {
  if (shown_.empty() || current_ <= 0) return nullptr;
  setCurrent(current_ - 1);
  return item(current_);
}

QString NavigatorModel::banner() const {
  if (!list_) return {};
  const DivergenceList& l = *list_;
  QStringList parts;
  if (l.has_first_divergence) {
    parts << QStringLiteral("<b>First divergence</b>: seq %1, %2, <b>%3</b>, token %4")
                 .arg(l.first.seq)
                 .arg(l.first.layer >= 0 ? QStringLiteral("layer %1").arg(l.first.layer)
                                         : QStringLiteral("model"))
                 .arg(QString::fromStdString(l.first.tensor).toHtmlEscaped())
                 .arg(l.first_cell.token);
  } else if (!l.digests_compared) {
    parts << QStringLiteral("<b>Decisions only</b>: an external step holds no digests");
  } else {
    parts << QStringLiteral("<b>No divergence</b>: every digest is equal");
  }
  parts << QStringLiteral("<b>flips</b>: %1 confident, %2 tie (indexer %3, routing %4)")
               .arg(l.confident_flips)
               .arg(l.tie_flips)
               .arg(l.indexer_flips)
               .arg(l.routing_flips);
  QStringList worst;
  for (const Divergence& d : l.items) {
    if (d.kind != DivergenceKind::WorstToken) continue;
    worst << QStringLiteral("%1 (%2)").arg(d.token).arg(num(d.value, 2));
    if (worst.size() == 3) break;
  }
  if (!worst.isEmpty()) parts << QStringLiteral("<b>worst tokens</b>: ") + worst.join(QStringLiteral(", "));
  // A parallel recording says so: its layout is never a cause (every layout gives the same bits), but
  // the reader should know which run is which.
  if (const auto& s = doc_->data().summary; s && s->b) {
    const std::string la = recorded_layout(s->a.env), lb = recorded_layout(s->b->env);
    if (s->a.env.count(kEnvParallel) || s->b->env.count(kEnvParallel))
      parts << (la == lb
                    ? QStringLiteral("<b>layout</b>: both %1").arg(QString::fromStdString(la).toHtmlEscaped())
                    : QStringLiteral("<b>layouts</b>: A %1, B %2")
                          .arg(QString::fromStdString(la).toHtmlEscaped(),
                               QString::fromStdString(lb).toHtmlEscaped()));
  }
  return parts.join(QStringLiteral(" · "));
}

}  // namespace dsv4::gui
