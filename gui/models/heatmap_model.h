// The overview: a layer × token (or layer × expert) table of one metric for one sequence, with the
// colour scale, the threshold highlight, the near-tie flags and the |Δ log-prob| strip. The view
// paints from the per-cell levels and flags kept here (level: 0 = ideal … kLevelMax = worst on the
// metric's scale), so painting never formats or converts values.
#pragma once

#include <QAbstractTableModel>
#include <QColor>
#include <QString>
#include <cstdint>
#include <optional>
#include <vector>

#include "gui/models/colour_scale.h"
#include "gui/models/trace_document.h"

namespace dsv4::gui {

constexpr uint16_t kLevelMax = 65534;
constexpr uint16_t kLevelNoData = 65535;
enum CellFlag : uint8_t { kBeyondThreshold = 1, kNearTie = 2, kNotLoaded = 4 };

// Colours of the overview (shared by the view and its legend).
QRgb level_color(uint16_t level, uint8_t flags, bool threshold_on);
QRgb heat_color(double t);  // t in [0, 1]: 0 ideal, 1 worst

class HeatmapModel : public QAbstractTableModel {
  Q_OBJECT
 public:
  enum Role {
    ValueRole = Qt::UserRole + 1,  // double; invalid where the cell has no data
    LevelRole,                     // int: 0 … kLevelMax, kLevelNoData
    BeyondThresholdRole,           // bool
    NearTieRole,                   // bool
  };
  explicit HeatmapModel(TraceDocument* doc, QObject* parent = nullptr);

  int rowCount(const QModelIndex& parent = {}) const override;
  int columnCount(const QModelIndex& parent = {}) const override;
  QVariant data(const QModelIndex& index, int role = Qt::DisplayRole) const override;
  QVariant headerData(int section, Qt::Orientation o, int role = Qt::DisplayRole) const override;

  // The metrics the open dataset offers (comparison or single-trace ones).
  std::vector<Metric> availableMetrics() const;
  void setMetric(Metric m);  // resets the model; the threshold becomes the metric's default
  Metric metric() const { return metric_; }
  const MetricInfo& info() const { return metric_info(metric_); }
  void setSeq(int seq);
  int seq() const { return seq_; }
  void setThreshold(double t);
  double threshold() const { return threshold_; }
  void setThresholdEnabled(bool on);
  bool thresholdEnabled() const { return threshold_on_; }

  // Fast access for painting.
  float value(int row, int col) const;  // NaN: no data
  uint16_t level(int row, int col) const { return levels_[size_t(row) * cols_ + col]; }
  uint8_t flags(int row, int col) const { return flags_[size_t(row) * cols_ + col]; }
  struct Aggregate {
    uint16_t level = kLevelNoData;  // the worst level in the range (kLevelNoData when none has data)
    uint8_t flags = 0;              // union of the flags
  };
  // The worst cell of row over columns [col0, col1): what one pixel shows when zoomed out, so that a
  // single divergent token never disappears.
  Aggregate aggregate(int row, int col0, int col1) const;
  QRgb color(const Aggregate& a) const { return level_color(a.level, a.flags, threshold_on_); }

  // The colour scale: the values at level 0 and kLevelMax, and the text for a value.
  double scaleIdeal() const { return lo_is_ideal() ? lo_ : hi_; }
  double scaleWorst() const { return lo_is_ideal() ? hi_ : lo_; }
  // Log scales (gui/models/colour_scale.h): some values lie beyond the ideal end and take its colour.
  bool scaleClipped() const { return clipped_; }
  QString formatValue(double v) const;
  QString cellToolTip(int row, int col) const;
  QString rowLabel(int row) const;  // "3 C4"
  bool isTokenAxis() const { return info().axis == MetricAxis::Tokens; }
  // The first generated column of the sequence shown (a generation step on the token axis), or -1.
  int promptBoundary() const;
  // A per-column value shown above the heatmap: |Δ log-prob| (comparison) or −log-prob (single).
  float stripValue(int col) const { return col >= 0 && col < int(strip_.size()) ? strip_[col] : kNoValue; }
  float stripMax() const { return strip_max_; }
  float stripMin() const { return strip_min_; }    // the bars' baseline: 0, or the minimum of −log-prob
  float stripAggregate(int col0, int col1) const;  // max over [col0, col1)
  QString stripLabel() const;

  // The cell with the worst level (the first one on ties); (−1, −1) when nothing has data.
  std::pair<int, int> worstCell() const;

  // Bumped on every change of what the view paints.
  quint64 revision() const { return revision_; }

 private:
  bool lo_is_ideal() const { return !info().lower_is_worse; }
  void rebuild();       // everything for (seq, metric)
  void countRow(int row);  // row_counts_[row] from the row's values (log scales)
  void rebuildRange();     // the colour scale from the loaded rows
  void rebuildLevels(int row);
  void rebuildFlags(int row);
  void rebuildStrip();
  double tieThreshold(int row) const;
  double levelOf(float v) const;  // 0 … 1

  TraceDocument* doc_;
  Metric metric_ = Metric::MhcDifference;
  std::optional<bool> mode_;  // comparison mode of the dataset shown
  int seq_ = 0;
  double threshold_ = 0;
  bool threshold_on_ = false;
  int rows_ = 0, cols_ = 0;
  double lo_ = 0, hi_ = 1;
  bool clipped_ = false;
  std::vector<LogScaleCounts> row_counts_;  // per row, for the log scales
  std::vector<uint16_t> levels_;
  std::vector<uint8_t> flags_;
  std::vector<float> strip_;
  float strip_max_ = 0, strip_min_ = 0;
  quint64 revision_ = 0;
};

}  // namespace dsv4::gui
