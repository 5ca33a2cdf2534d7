// Log-probs per token (Qt Charts): A and B on the left axis, B − A on the right axis, and a marker
// at the selected token. Clicking the plot selects that token's column. Long sequences are drawn
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

 signals:
  void tokenClicked(int token);

 protected:
  void mousePressEvent(QMouseEvent* e) override;

 private:
  void rebuild();
  TokenModel* model_ = nullptr;
  QLineSeries *a_, *b_, *diff_, *marker_;
  QValueAxis *x_, *y_, *y_diff_;
  int selected_ = -1;
};

}  // namespace dsv4::gui
