// Ranks as threads of the test process, for testing what the runtime does between ranks without
// launching MPI: ThreadRanks::run(n, body) runs body(comm) on n threads, each with a Communicator of
// its rank whose collectives copy through shared memory between barriers. A test double only: the
// runtime's transports are MPI and NCCL (parallel/).
#pragma once

#include <barrier>
#include <cstring>
#include <functional>
#include <stdexcept>
#include <thread>
#include <vector>

#include "model/communicator.h"

namespace dsv4::test {

class ThreadRanks {
 public:
  // Runs body on n ranks and joins them; the first exception a rank throws is rethrown.
  static void run(int n, const std::function<void(Communicator&)>& body) {
    ThreadRanks shared(n);
    std::vector<std::exception_ptr> errors(static_cast<size_t>(n));
    std::vector<std::thread> threads;
    for (int r = 0; r < n; ++r)
      threads.emplace_back([&, r] {
        Rank comm(shared, r);
        try {
          body(comm);
        } catch (...) {
          errors[size_t(r)] = std::current_exception();
        }
      });
    for (auto& t : threads) t.join();
    for (const auto& e : errors)
      if (e) std::rethrow_exception(e);
  }

 private:
  explicit ThreadRanks(int n) : n_(n), sync_(n), posted_(size_t(n)) {}

  struct Posted {
    const void* data = nullptr;
    const std::vector<int64_t>* bytes = nullptr;
  };

  class Rank final : public Communicator {
   public:
    Rank(ThreadRanks& s, int r) : s_(s), r_(r) {}
    int rank() const override { return r_; }
    int size() const override { return s_.n_; }
    std::string transport() const override { return "thread"; }
    int64_t bytes_received() const override { return received_; }
    void all_gather_v(const void* mine, void* all, const std::vector<int64_t>& bytes) override {
      s_.posted_[size_t(r_)] = {mine, &bytes};
      s_.sync_.arrive_and_wait();
      int64_t at = 0;
      for (int q = 0; q < s_.n_; ++q) {
        const int64_t b = bytes[size_t(q)];
        if (b > 0) std::memcpy(static_cast<char*>(all) + at, s_.posted_[size_t(q)].data, size_t(b));
        if (q != r_) received_ += b;
        at += b;
      }
      s_.sync_.arrive_and_wait();
    }
    void all_to_all_v(const void* send, const std::vector<int64_t>& send_bytes, void* recv,
                      const std::vector<int64_t>& recv_bytes) override {
      s_.posted_[size_t(r_)] = {send, &send_bytes};
      s_.sync_.arrive_and_wait();
      int64_t at = 0;
      for (int q = 0; q < s_.n_; ++q) {
        const std::vector<int64_t>& theirs = *s_.posted_[size_t(q)].bytes;
        int64_t from = 0;
        for (int x = 0; x < r_; ++x) from += theirs[size_t(x)];
        if (theirs[size_t(r_)] != recv_bytes[size_t(q)])
          throw std::logic_error("all_to_all_v: sizes do not match between ranks");
        if (recv_bytes[size_t(q)] > 0)
          std::memcpy(static_cast<char*>(recv) + at, static_cast<const char*>(s_.posted_[size_t(q)].data) + from,
                      size_t(recv_bytes[size_t(q)]));
        if (q != r_) received_ += recv_bytes[size_t(q)];
        at += recv_bytes[size_t(q)];
      }
      s_.sync_.arrive_and_wait();
    }
    [[noreturn]] void abort(const std::string& message, int) override { throw std::runtime_error(message); }

   private:
    ThreadRanks& s_;
    int r_;
    int64_t received_ = 0;
  };

  int n_;
  std::barrier<> sync_;
  std::vector<Posted> posted_;
};

}  // namespace dsv4::test
