// The OpenMP thread count of a run (RunOptions::threads and its kin): set for the lifetime of a scope
// and restored afterwards, also when the run throws. Results never depend on it.
#pragma once

#include <omp.h>

namespace dsv4 {

class OmpThreadScope {
 public:
  // n > 0: run with n threads; n <= 0: leave the count as it is.
  explicit OmpThreadScope(int n) : saved_(omp_get_max_threads()) {
    if (n > 0) omp_set_num_threads(n);
  }
  ~OmpThreadScope() { omp_set_num_threads(saved_); }
  OmpThreadScope(const OmpThreadScope&) = delete;
  OmpThreadScope& operator=(const OmpThreadScope&) = delete;

 private:
  int saved_;
};

}  // namespace dsv4
