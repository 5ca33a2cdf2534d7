#include "parallel/mpi_communicator.h"

#include <fmt/format.h>
#include <mpi.h>

#include <climits>
#include <cstdio>
#include <cstdlib>

#include "model/error.h"

namespace dsv4 {

namespace {

void finalize_at_exit() {
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (!finalized) MPI_Finalize();
}

class MpiCommunicator final : public Communicator {
 public:
  MpiCommunicator() {
    MPI_Comm_rank(MPI_COMM_WORLD, &rank_);
    MPI_Comm_size(MPI_COMM_WORLD, &size_);
  }
  int rank() const override { return rank_; }
  int size() const override { return size_; }
  std::string transport() const override { return "MPI"; }
  int64_t bytes_received() const override { return received_; }

  // MPI counts are int: a rank's part travels in pieces of at most 1 GiB, every rank running the same
  // sequence of Allgatherv calls.
  void all_gather_v(const void* mine, void* all, const std::vector<int64_t>& bytes) override {
    if (int(bytes.size()) != size_)
      abort(fmt::format("all_gather_v: {} sizes for {} ranks", bytes.size(), size_), 2);
    constexpr int64_t kPiece = int64_t(1) << 30;
    for (int r = 0; r < size_; ++r)
      if (r != rank_) received_ += bytes[size_t(r)];
    std::vector<int64_t> offset(static_cast<size_t>(size_), 0);
    for (int r = 1; r < size_; ++r) offset[size_t(r)] = offset[size_t(r - 1)] + bytes[size_t(r - 1)];
    std::vector<int> counts(static_cast<size_t>(size_)), displs(static_cast<size_t>(size_));
    auto* out = static_cast<char*>(all);
    for (int64_t done = 0;; done += kPiece) {
      bool any = false;
      for (int r = 0; r < size_; ++r) {
        const int64_t left = bytes[size_t(r)] - done;
        counts[size_t(r)] = int(left <= 0 ? 0 : (left < kPiece ? left : kPiece));
        any = any || counts[size_t(r)] > 0;
      }
      if (!any) break;
      // Each piece lands at its place: displacements relative to `out`, which fit an int only for
      // small totals; so every rank receives into a staging buffer and copies.
      int64_t total = 0;
      for (int r = 0; r < size_; ++r) {
        displs[size_t(r)] = int(total);
        total += counts[size_t(r)];
      }
      if (total > INT_MAX) abort("all_gather_v: a piece over 2 GiB", 2);
      std::vector<char> stage(static_cast<size_t>(total));
      const int64_t my_left = bytes[size_t(rank_)] - done;
      const char* src = static_cast<const char*>(mine) + (my_left > 0 ? done : 0);
      MPI_Allgatherv(src, counts[size_t(rank_)], MPI_BYTE, stage.data(), counts.data(), displs.data(), MPI_BYTE,
                     MPI_COMM_WORLD);
      for (int r = 0; r < size_; ++r)
        if (counts[size_t(r)] > 0)
          std::copy(stage.begin() + displs[size_t(r)], stage.begin() + displs[size_t(r)] + counts[size_t(r)],
                    out + offset[size_t(r)] + done);
    }
  }

  [[noreturn]] void abort(const std::string& message, int code) override {
    std::fprintf(stderr, "dsv4: rank %d of %d: %s\n", rank_, size_, message.c_str());
    std::fflush(stderr);
    MPI_Abort(MPI_COMM_WORLD, code);
    std::_Exit(code);
  }

 private:
  int rank_ = 0, size_ = 1;
  int64_t received_ = 0;
};

}  // namespace

bool launched_by_mpi() {
  for (const char* v : {"OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK"})
    if (std::getenv(v)) return true;
  return false;
}

std::unique_ptr<Communicator> mpi_world(int expected) {
  int initialized = 0;
  MPI_Initialized(&initialized);
  if (!initialized) {
    if (!launched_by_mpi())
      throw InputError(fmt::format("--ep {} needs {} processes: start it with `mpirun -np {} dsv4 ...`", expected,
                                   expected, expected));
    int provided = 0;
    MPI_Init_thread(nullptr, nullptr, MPI_THREAD_FUNNELED, &provided);
    std::atexit(finalize_at_exit);
  }
  auto c = std::make_unique<MpiCommunicator>();
  if (c->size() != expected)
    c->abort(fmt::format("--ep {} but the job has {} processes (mpirun -np {})", expected, c->size(), expected), 2);
  return c;
}

}  // namespace dsv4
