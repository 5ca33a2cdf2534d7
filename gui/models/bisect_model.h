// The ranking of a `dsv4 bisect` report (replay/bisect.h, docs/PROFILES.md "Bisect") as a table: the
// sites ranked by the share of the log-prob mismatch each explains, then the halving's groups, then
// the whole switch.
#pragma once

#include <optional>

#include "gui/models/table_models.h"
#include "replay/bisect.h"

namespace dsv4::gui {

class BisectModel : public ColumnTableModel {
  Q_OBJECT
 public:
  enum Column { Sites, Kind, Explained, MeanAbs, MaxAbs, Kl, IndexerFlips, RoutingFlips };
  using ColumnTableModel::ColumnTableModel;
  // Reads a report file; returns the error message (empty on success). The table keeps the previous
  // report when the file cannot be read.
  QString load(const QString& path);
  void setReport(BisectReport r);
  const std::optional<BisectReport>& report() const { return report_; }
  // One line: the two profiles, the sites, tokens and runs.
  QString caption() const;

  QVariant data(const QModelIndex& index, int role = Qt::DisplayRole) const override;
  int rows() const override;
  QStringList columns() const override;
  const BisectEntry* entry(int row) const;  // singles (ranked), groups, then the whole switch

 private:
  std::optional<BisectReport> report_;
};

}  // namespace dsv4::gui
