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
  // Personalised exchange: `send` holds the parts for ranks 0, 1, ... in order (send_bytes[r] bytes for
  // rank r, the part for this rank included), `recv` receives the parts from ranks 0, 1, ... in order
  // (recv_bytes[r] from rank r). recv_bytes[r] on this rank equals send_bytes[this rank] on rank r.
  virtual void all_to_all_v(const void* send, const std::vector<int64_t>& send_bytes, void* recv,
                            const std::vector<int64_t>& recv_bytes) = 0;
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
// With `sequences_split` (data parallel: each rank runs its own sequences, sequence_range):
// "expert parallel over 2 MPI ranks, each running its own sequences".
inline std::string parallel_layout(const Communicator& c, bool sequences_split = false) {
  return "expert parallel over " + std::to_string(c.size()) + " " + c.transport() + " ranks" +
         (sequences_split ? ", each running its own sequences" : "");
}

// The contiguous block of `count` items rank r of n owns (the first count % n ranks one more):
// [first, last). The one rule for experts and for sequences.
struct BlockRange {
  int first = 0, last = 0;
  int size() const { return last - first; }
};
inline BlockRange block_range(int count, int r, int n) {
  const int base = count / n, extra = count % n;
  const int first = r * base + (r < extra ? r : extra);
  return {first, first + base + (r < extra ? 1 : 0)};
}
// The routed experts rank r of n owns among E.
using ExpertRange = BlockRange;
inline ExpertRange expert_range(int E, int r, int n) { return block_range(E, r, n); }
// The sequences of a batch of S that rank r of n runs when the sequences are split (data parallel).
inline BlockRange sequence_range(int S, int r, int n) { return block_range(S, r, n); }

}  // namespace dsv4
