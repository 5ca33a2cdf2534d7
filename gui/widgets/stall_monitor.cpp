#include "gui/widgets/stall_monitor.h"

#include <algorithm>

namespace dsv4::gui {

namespace {
constexpr double kFrameBudgetMs = 16;
}

StallMonitor::StallMonitor(QObject* parent) : QObject(parent) {
  timer_.setTimerType(Qt::PreciseTimer);
  timer_.setInterval(kIntervalMs);
  connect(&timer_, &QTimer::timeout, this, &StallMonitor::tick);
}

void StallMonitor::start() {
  max_ms_ = 0;
  over_budget_ = 0;
  clock_.start();
  last_ns_ = 0;
  timer_.start();
}

void StallMonitor::stop() {
  if (!timer_.isActive()) return;
  tick();  // a stall that ends the measurement counts too
  timer_.stop();
}

void StallMonitor::tick() {
  const qint64 now = clock_.nsecsElapsed();
  const double stall = std::max(0.0, (now - last_ns_) / 1e6 - kIntervalMs);
  last_ns_ = now;
  max_ms_ = std::max(max_ms_, stall);
  if (stall > kFrameBudgetMs) ++over_budget_;
}

}  // namespace dsv4::gui
