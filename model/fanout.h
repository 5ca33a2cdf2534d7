// An Observer that forwards every report to several observers, in order.
#pragma once

#include <vector>

#include "model/observer.h"

namespace dsv4 {

class FanoutObserver : public Observer {
 public:
  explicit FanoutObserver(std::vector<Observer*> targets) : targets_(std::move(targets)) {}
  void on_tensor(const TensorRecord& t) override {
    for (Observer* o : targets_)
      if (o->wants_tensors()) o->on_tensor(t);
  }
  void on_indexer(const IndexerDecision& d) override {
    for (Observer* o : targets_) o->on_indexer(d);
  }
  void on_routing(const RoutingDecision& d) override {
    for (Observer* o : targets_) o->on_routing(d);
  }
  void on_mhc(const MhcDecision& d) override {
    for (Observer* o : targets_) o->on_mhc(d);
  }
  bool wants_tensors() const override {
    for (Observer* o : targets_)
      if (o->wants_tensors()) return true;
    return false;
  }
  bool deferrable() const override {
    for (Observer* o : targets_)
      if (!o->deferrable()) return false;
    return true;
  }
  bool wants_values(std::string_view name, int layer) const override {
    for (Observer* o : targets_)
      if (o->wants_tensors() && o->wants_values(name, layer)) return true;
    return false;
  }

 private:
  std::vector<Observer*> targets_;
};

}  // namespace dsv4
