// Log-probs per token (Qt Charts): A (wide) and B (thin, see-through, so A stays visible under it) on the
// left axis, B − A on the right axis, and a marker at the selected token; in difference-only mode B − A
// alone. Hovering the plot shows the token's values; clicking it selects that token's column. With
// nothing open the chart shows no axes and no legend. Long sequences are drawn
// from at most kMaxPoints buckets (each keeps its lowest log-prob and its largest difference), so
// the worst tokens stay visible.
#pragma once

#include <QChartView>

#include "gui/models/table_models.h"

class QLineSeries;
class QValueAxis;

namespace dsv4::gui {

class LogprobChart : public QChartView {
  Q_OBJECT
 public:
  static constexpr int kMaxPoints = 4000;
  explicit LogprobChart(QWidget* parent = nullptr);
  void setModel(TokenModel* m);
  void setSelectedToken(int token);  // −1: none
  int pointsShown() const;
  void setDifferenceOnly(bool on);
  bool differenceOnly() const { return difference_only_; }
  // The token under a viewport position (−1 outside the plot) and what hovering it shows.
  int tokenAt(const QPoint& viewport_pos) const;
  QString valueText(int token) const;

 signals:
  void tokenClicked(int token);

 protected:
  void mousePressEvent(QMouseEvent* e) override;
  void mouseMoveEvent(QMouseEvent* e) override;

 private:
  void rebuild();
  TokenModel* model_ = nullptr;
  QLineSeries *a_, *b_, *diff_, *marker_;
  QValueAxis *x_, *y_, *y_diff_;
  int selected_ = -1;
  bool difference_only_ = false;
};

}  // namespace dsv4::gui
