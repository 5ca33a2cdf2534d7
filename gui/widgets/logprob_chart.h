// Log-probs per token (Qt Charts): A (wide) and B (thin, see-through, so A stays visible under it) on the
// left axis, B − A on the right axis, and a marker at the selected token; in difference-only mode B − A
// alone. Hovering the plot shows the token's values; clicking it selects that token's column. With
// nothing open the chart shows no axes and no legend.
//
// The chart shows a range of tokens (setTokenRange; the main window keeps it equal to the heatmap's
// visible columns, so the two are zoomed and scrolled together). Dragging across the plot, Ctrl + wheel
// and a double click (everything) ask for another range (tokenRangeRequested); the heatmap follows and
// hands the range back. The range is drawn from one bucket per pixel column of the plot (at most
// kMaxPoints; each keeps its lowest log-prob and its largest difference), so the worst tokens stay
// visible at any zoom and a rebuild stays cheap.
#pragma once

#include <QChartView>

#include "gui/models/table_models.h"

class QLineSeries;
class QRubberBand;
class QValueAxis;

namespace dsv4::gui {

class LogprobChart : public QChartView {
  Q_OBJECT
 public:
  static constexpr int kMaxPoints = 2000;
  explicit LogprobChart(QWidget* parent = nullptr);
  void setModel(TokenModel* m);
  void setSelectedToken(int token);  // −1: none
  int pointsShown() const;
  void setDifferenceOnly(bool on);
  bool differenceOnly() const { return difference_only_; }
  // Tokens [first, last) in column units (token t spans [t, t + 1)); an empty range shows them all.
  // The points are rebuilt once the event loop turns, so a burst of scroll steps costs one rebuild.
  void setTokenRange(double first, double last);
  std::pair<double, double> tokenRange() const { return {first_, last_}; }
  // The token under a viewport position (−1 outside the plot) and what hovering it shows.
  int tokenAt(const QPoint& viewport_pos) const;
  QString valueText(int token) const;

 signals:
  void tokenClicked(int token);
  void tokenRangeRequested(double first, double last);

 protected:
  void mousePressEvent(QMouseEvent* e) override;
  void mouseMoveEvent(QMouseEvent* e) override;
  void mouseReleaseEvent(QMouseEvent* e) override;
  void mouseDoubleClickEvent(QMouseEvent* e) override;
  void wheelEvent(QWheelEvent* e) override;
  void resizeEvent(QResizeEvent* e) override;

 private:
  void scheduleRebuild();
  void rebuild();
  int tokens() const;                            // of the sequence shown; 0 when none
  double xAt(const QPoint& viewport_pos) const;  // the plot's x value under a position
  TokenModel* model_ = nullptr;
  QLineSeries *a_, *b_, *diff_, *marker_;
  QValueAxis *x_, *y_, *y_diff_;
  int selected_ = -1;
  bool difference_only_ = false;
  double first_ = 0, last_ = 0;  // the range asked for; empty: all
  bool rebuild_pending_ = false;
  QRubberBand* band_ = nullptr;
  QPoint press_pos_;
  bool pressed_ = false, dragging_ = false;
};

}  // namespace dsv4::gui
