#include "parallel/mpi_communicator.h"

#include <fmt/format.h>
#include <mpi.h>

#include <algorithm>
#include <climits>
#include <cstring>
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

  // MPI_Alltoallv with byte counts and displacements as int: one call when every rank's whole send
  // and receive buffers fit an int (the sizes agreed with one Allreduce), else rounds in which each
  // pair of ranks moves at most 1 GiB through staging buffers, every rank running the same rounds.
  void all_to_all_v(const void* send, const std::vector<int64_t>& send_bytes, void* recv,
                    const std::vector<int64_t>& recv_bytes) override {
    if (int(send_bytes.size()) != size_ || int(recv_bytes.size()) != size_)
      abort(fmt::format("all_to_all_v: {} and {} sizes for {} ranks", send_bytes.size(), recv_bytes.size(), size_),
            2);
    int64_t local[2] = {0, 0};  // largest buffer, largest part
    int64_t send_total = 0, recv_total = 0;
    for (int r = 0; r < size_; ++r) {
      send_total += send_bytes[size_t(r)];
      recv_total += recv_bytes[size_t(r)];
      local[1] = std::max({local[1], send_bytes[size_t(r)], recv_bytes[size_t(r)]});
      if (r != rank_) received_ += recv_bytes[size_t(r)];
    }
    local[0] = std::max(send_total, recv_total);
    int64_t global[2] = {0, 0};
    MPI_Allreduce(local, global, 2, MPI_INT64_T, MPI_MAX, MPI_COMM_WORLD);
    const auto offsets = [&](const std::vector<int64_t>& b) {
      std::vector<int64_t> at(static_cast<size_t>(size_) + 1, 0);
      for (int r = 0; r < size_; ++r) at[size_t(r) + 1] = at[size_t(r)] + b[size_t(r)];
      return at;
    };
    const std::vector<int64_t> send_at = offsets(send_bytes), recv_at = offsets(recv_bytes);
    std::vector<int> sc(size_t(size_), 0), sd(size_t(size_), 0), rc(size_t(size_), 0), rd(size_t(size_), 0);
    if (global[0] <= INT_MAX) {
      for (int r = 0; r < size_; ++r) {
        sc[size_t(r)] = int(send_bytes[size_t(r)]), sd[size_t(r)] = int(send_at[size_t(r)]);
        rc[size_t(r)] = int(recv_bytes[size_t(r)]), rd[size_t(r)] = int(recv_at[size_t(r)]);
      }
      MPI_Alltoallv(send, sc.data(), sd.data(), MPI_BYTE, recv, rc.data(), rd.data(), MPI_BYTE, MPI_COMM_WORLD);
      return;
    }
    constexpr int64_t kPiece = int64_t(1) << 30;
    const auto piece = [&](int64_t bytes, int64_t done) {
      const int64_t left = bytes - done;
      return int(left <= 0 ? 0 : std::min(left, kPiece));
    };
    for (int64_t done = 0; done < global[1]; done += kPiece) {
      int64_t st = 0, rt = 0;
      for (int r = 0; r < size_; ++r) {
        sc[size_t(r)] = piece(send_bytes[size_t(r)], done), sd[size_t(r)] = int(st), st += sc[size_t(r)];
        rc[size_t(r)] = piece(recv_bytes[size_t(r)], done), rd[size_t(r)] = int(rt), rt += rc[size_t(r)];
      }
      if (st > INT_MAX || rt > INT_MAX) abort("all_to_all_v: a round over 2 GiB", 2);
      std::vector<char> out(static_cast<size_t>(st)), in(static_cast<size_t>(rt));
      for (int r = 0; r < size_; ++r)
        std::memcpy(out.data() + sd[size_t(r)], static_cast<const char*>(send) + send_at[size_t(r)] + done,
                    size_t(sc[size_t(r)]));
      MPI_Alltoallv(out.data(), sc.data(), sd.data(), MPI_BYTE, in.data(), rc.data(), rd.data(), MPI_BYTE,
                    MPI_COMM_WORLD);
      for (int r = 0; r < size_; ++r)
        std::memcpy(static_cast<char*>(recv) + recv_at[size_t(r)] + done, in.data() + rd[size_t(r)],
                    size_t(rc[size_t(r)]));
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
