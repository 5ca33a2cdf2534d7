#include "gui/models/bisect_model.h"

#include <QFile>

#include "model/error.h"

namespace dsv4::gui {

namespace {
QString sci(double v) {
  return QString::number(v, 'e', 3);
}
QString flips(int64_t all, int64_t tie) {
  return QStringLiteral("%1 (%2 tie)").arg(all).arg(tie);
}
}  // namespace

QString BisectModel::load(const QString& path) {
  QFile f(path);
  if (!f.open(QIODevice::ReadOnly)) return QStringLiteral("%1: cannot open: %2").arg(path, f.errorString());
  try {
    setReport(bisect_from_json(f.readAll().toStdString(), path.toStdString()));
  } catch (const InputError& e) {
    return QString::fromUtf8(e.what());
  }
  return {};
}

void BisectModel::setReport(BisectReport r) {
  beginResetModel();
  report_ = std::move(r);
  endResetModel();
}

QString BisectModel::caption() const {
  if (!report_) return {};
  const BisectReport& r = *report_;
  return QStringLiteral(
             "%1 → %2: %3 sites differ; %4 sequence(s), %5 log-probs; %6 forwards. The singles "
             "explain %7% together%8.")
      .arg(QString::fromStdString(r.profile_a), QString::fromStdString(r.profile_b))
      .arg(r.sites.size())
      .arg(r.seqs)
      .arg(r.tokens)
      .arg(r.runs)
      .arg(100.0 * r.sum_single_explained, 0, 'f', 1)
      .arg(std::abs(r.sum_single_explained - 1.0) > 0.25 ? QStringLiteral(" (the sites interact)")
                                                         : QString());
}

const BisectEntry* BisectModel::entry(int row) const {
  if (!report_ || row < 0) return nullptr;
  const BisectReport& r = *report_;
  if (row < int(r.single.size())) return &r.single[size_t(row)];
  row -= int(r.single.size());
  if (row < int(r.groups.size())) return &r.groups[size_t(row)];
  return row == int(r.groups.size()) ? &r.all : nullptr;
}

int BisectModel::rows() const {
  return report_ ? int(report_->single.size() + report_->groups.size() + 1) : 0;
}

QStringList BisectModel::columns() const {
  return {QStringLiteral("switched to B"),    QStringLiteral("run"),
          QStringLiteral("explained"),        QStringLiteral("|Δ log-prob| mean"),
          QStringLiteral("|Δ log-prob| max"), QStringLiteral("KL (k3)"),
          QStringLiteral("indexer flips"),    QStringLiteral("routing flips")};
}

QVariant BisectModel::data(const QModelIndex& index, int role) const {
  const BisectEntry* e = index.isValid() ? entry(index.row()) : nullptr;
  if (!e) return {};
  if (role == Qt::TextAlignmentRole && index.column() >= Explained)
    return int(Qt::AlignRight | Qt::AlignVCenter);
  if (role != Qt::DisplayRole && role != Qt::ToolTipRole) return {};
  const BisectMetrics& m = e->m;
  switch (index.column()) {
    case Sites: {
      QStringList parts;
      for (const std::string& key : e->sites) {
        QString v;
        for (const auto& d : report_->sites)
          if (d.key == key) v = QString::fromStdString(d.b);
        parts << QStringLiteral("%1 = %2").arg(QString::fromStdString(key), v);
      }
      return parts.join(QStringLiteral(", "));
    }
    case Kind:
      return QString::fromStdString(e->kind);
    case Explained:
      return QStringLiteral("%1%").arg(100.0 * e->explained, 0, 'f', 1);
    case MeanAbs:
      return sci(m.mean_abs_dlogp);
    case MaxAbs:
      return sci(m.max_abs_dlogp);
    case Kl:
      return sci(m.kl_k3);
    case IndexerFlips:
      return flips(m.indexer_flips, m.indexer_tie_flips);
    case RoutingFlips:
      return flips(m.routing_flips, m.routing_tie_flips);
    default:
      return {};
  }
}

}  // namespace dsv4::gui
