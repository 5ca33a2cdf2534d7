// How long the UI thread goes without returning to its event loop: a precise timer of a short
// interval notes the gap between its ticks; a gap longer than the interval is time the thread spent in
// one piece of work, during which no frame could be drawn and no input answered. `dsv4-view --timing`
// reports the longest such stall while a load is in progress (the frame budget is 16 ms).
#pragma once

#include <QElapsedTimer>
#include <QObject>
#include <QTimer>

namespace dsv4::gui {

class StallMonitor : public QObject {
  Q_OBJECT
 public:
  static constexpr int kIntervalMs = 2;
  explicit StallMonitor(QObject* parent = nullptr);
  void start();  // forgets what was measured
  void stop();
  bool running() const { return timer_.isActive(); }
  // The longest time between two turns of the event loop, less the timer's interval; 0 before start.
  double maxStallMs() const { return max_ms_; }
  // Stalls longer than the 16 ms frame budget.
  int stallsOverBudget() const { return over_budget_; }

 private:
  void tick();
  QTimer timer_;
  QElapsedTimer clock_;
  qint64 last_ns_ = 0;
  double max_ms_ = 0;
  int over_budget_ = 0;
};

}  // namespace dsv4::gui
