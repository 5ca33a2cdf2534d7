// The communicator of a parallel run (issue "expert parallelism"; docs/PARALLEL.md): the collective
// operations the runtime needs, with one implementation per transport — MPI on CPUs
// (parallel/mpi_communicator.h) and, on GPUs, NCCL. Every rank calls every collective in the same
// order with consistent sizes; a failing rank ends the whole job (abort) with a message naming it,
// so no rank waits forever for a peer that is gone.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace dsv4 {

class Communicator {
 public:
  virtual ~Communicator() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  // Every rank's `mine` (bytes[rank()] bytes) concatenated in rank order into `all` (the sum of
  // `bytes`); every rank passes the same `bytes`.
  virtual void all_gather_v(const void* mine, void* all, const std::vector<int64_t>& bytes) = 0;
  // Ends every rank of the job with `message` (naming this rank) and exit code `code`.
  [[noreturn]] virtual void abort(const std::string& message, int code) = 0;
  // "MPI" / "NCCL".
  virtual std::string transport() const = 0;
  // Whether all_gather_v's buffers are GPU memory (NCCL) rather than host memory (MPI).
  virtual bool device_memory() const { return false; }
  // Bytes this rank received from the other ranks so far (its own part not counted).
  virtual int64_t bytes_received() const = 0;
};

// The layout of a run in words, as traces record it (env key "parallel") and replay reports it:
// "expert parallel over 2 MPI ranks".
inline std::string parallel_layout(const Communicator& c) {
  return "expert parallel over " + std::to_string(c.size()) + " " + c.transport() + " ranks";
}

// The contiguous block of experts rank r of n owns among E (the first E % n ranks one more):
// [first, last).
struct ExpertRange {
  int first = 0, last = 0;
};
inline ExpertRange expert_range(int E, int r, int n) {
  const int base = E / n, extra = E % n;
  const int first = r * base + (r < extra ? r : extra);
  return {first, first + base + (r < extra ? 1 : 0)};
}

}  // namespace dsv4
