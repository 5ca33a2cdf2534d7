#include "parallel/nccl_communicator.h"

#include <cuda_runtime_api.h>
#include <fmt/format.h>
#include <nccl.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <thread>
#include <vector>

#include "model/error.h"

namespace dsv4 {

namespace {

double collective_timeout_s() {
  const char* v = std::getenv("DSV4_COLLECTIVE_TIMEOUT_S");
  if (!v || !*v) return 300;
  char* end = nullptr;
  const double s = std::strtod(v, &end);
  if (end == v || *end || !(s > 0))
    throw InputError(fmt::format("DSV4_COLLECTIVE_TIMEOUT_S='{}': give a number of seconds > 0", v));
  return s;
}

int local_rank(int rank) {
  for (const char* v : {"OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "SLURM_LOCALID"})
    if (const char* s = std::getenv(v)) return std::atoi(s);
  return rank;
}

class NcclCommunicator final : public Communicator {
 public:
  NcclCommunicator(Communicator* bootstrap, int rank, int size, const ncclUniqueId& id, int device)
      : bootstrap_(bootstrap), rank_(rank), size_(size), device_(device), timeout_s_(collective_timeout_s()) {
    if (const cudaError_t e = cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking); e != cudaSuccess)
      throw InputError(fmt::format("NCCL rank {} of {}: no stream on GPU {}: {}", rank, size, device,
                                   cudaGetErrorString(e)));
    // Non-blocking init so that a peer that never arrives ends in the timeout, not a hang.
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 0;
    ncclResult_t r = ncclCommInitRankConfig(&comm_, size, id, rank, &config);
    if (r != ncclSuccess && r != ncclInProgress)
      throw InputError(fmt::format("NCCL rank {} of {}: ncclCommInitRank failed: {}", rank, size,
                                   ncclGetErrorString(r)));
    wait_ready("ncclCommInitRank");
  }
  ~NcclCommunicator() override {
    if (comm_) ncclCommDestroy(comm_);
    if (stream_) cudaStreamDestroy(stream_);
  }

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  std::string transport() const override { return "NCCL"; }
  bool device_memory() const override { return true; }
  int64_t bytes_received() const override { return received_; }

  void all_gather_v(const void* mine, void* all, const std::vector<int64_t>& bytes) override {
    if (int(bytes.size()) != size_) abort(fmt::format("all_gather_v: {} sizes for {} ranks", bytes.size(), size_), 2);
    // The producer's kernels ran on the caller's stream: finish them before the peers read `mine`.
    check_cuda(cudaDeviceSynchronize(), "all_gather_v: the kernels before it");
    auto* out = static_cast<char*>(all);
    int64_t offset = 0;
    std::vector<int64_t> at(static_cast<size_t>(size_));
    for (int r = 0; r < size_; ++r) {
      at[size_t(r)] = offset;
      offset += bytes[size_t(r)];
      if (r != rank_) received_ += bytes[size_t(r)];
    }
    if (bytes[size_t(rank_)] > 0)
      check_cuda(cudaMemcpyAsync(out + at[size_t(rank_)], mine, size_t(bytes[size_t(rank_)]), cudaMemcpyDeviceToDevice,
                                 stream_),
                 "all_gather_v: own part");
    check_nccl(ncclGroupStart(), "ncclGroupStart");
    for (int r = 0; r < size_; ++r) {
      if (r == rank_) continue;
      if (bytes[size_t(rank_)] > 0) check_nccl(ncclSend(mine, size_t(bytes[size_t(rank_)]), ncclChar, r, comm_, stream_), "ncclSend");
      if (bytes[size_t(r)] > 0)
        check_nccl(ncclRecv(out + at[size_t(r)], size_t(bytes[size_t(r)]), ncclChar, r, comm_, stream_), "ncclRecv");
    }
    check_nccl(ncclGroupEnd(), "ncclGroupEnd");
    wait_stream("all_gather_v");
  }

  // One NCCL group of a send and a receive per peer on the communicator's stream; this rank's own part
  // is a device copy.
  void all_to_all_v(const void* send, const std::vector<int64_t>& send_bytes, void* recv,
                    const std::vector<int64_t>& recv_bytes) override {
    if (int(send_bytes.size()) != size_ || int(recv_bytes.size()) != size_)
      abort(fmt::format("all_to_all_v: {} and {} sizes for {} ranks", send_bytes.size(), recv_bytes.size(), size_),
            2);
    check_cuda(cudaDeviceSynchronize(), "all_to_all_v: the kernels before it");
    const auto* in = static_cast<const char*>(send);
    auto* out = static_cast<char*>(recv);
    std::vector<int64_t> send_at(static_cast<size_t>(size_), 0), recv_at(static_cast<size_t>(size_), 0);
    for (int r = 1; r < size_; ++r) {
      send_at[size_t(r)] = send_at[size_t(r - 1)] + send_bytes[size_t(r - 1)];
      recv_at[size_t(r)] = recv_at[size_t(r - 1)] + recv_bytes[size_t(r - 1)];
    }
    for (int r = 0; r < size_; ++r)
      if (r != rank_) received_ += recv_bytes[size_t(r)];
    if (recv_bytes[size_t(rank_)] != send_bytes[size_t(rank_)])
      abort(fmt::format("all_to_all_v: {} bytes to itself but {} expected", send_bytes[size_t(rank_)],
                        recv_bytes[size_t(rank_)]),
            2);
    if (send_bytes[size_t(rank_)] > 0)
      check_cuda(cudaMemcpyAsync(out + recv_at[size_t(rank_)], in + send_at[size_t(rank_)],
                                 size_t(send_bytes[size_t(rank_)]), cudaMemcpyDeviceToDevice, stream_),
                 "all_to_all_v: own part");
    check_nccl(ncclGroupStart(), "ncclGroupStart");
    for (int r = 0; r < size_; ++r) {
      if (r == rank_) continue;
      if (send_bytes[size_t(r)] > 0)
        check_nccl(ncclSend(in + send_at[size_t(r)], size_t(send_bytes[size_t(r)]), ncclChar, r, comm_, stream_),
                   "ncclSend");
      if (recv_bytes[size_t(r)] > 0)
        check_nccl(ncclRecv(out + recv_at[size_t(r)], size_t(recv_bytes[size_t(r)]), ncclChar, r, comm_, stream_),
                   "ncclRecv");
    }
    check_nccl(ncclGroupEnd(), "ncclGroupEnd");
    wait_stream("all_to_all_v");
  }

  [[noreturn]] void abort(const std::string& message, int code) override {
    if (comm_) {
      ncclCommAbort(comm_);
      comm_ = nullptr;
    }
    if (bootstrap_) bootstrap_->abort(message, code);
    std::fprintf(stderr, "dsv4: rank %d of %d (NCCL): %s\n", rank_, size_, message.c_str());
    std::fflush(stderr);
    std::_Exit(code);
  }

 private:
  void check_cuda(cudaError_t e, const char* what) {
    if (e != cudaSuccess) abort(fmt::format("{} on GPU {}: {}", what, device_, cudaGetErrorString(e)), 1);
  }
  void check_nccl(ncclResult_t r, const char* what) {
    if (r != ncclSuccess && r != ncclInProgress) abort(fmt::format("{}: {}", what, ncclGetErrorString(r)), 1);
  }
  // Polls the communicator (and the stream) until the operation is done, an asynchronous error
  // arrives, or the timeout passes.
  template <class Done>
  void poll(const char* what, Done done) {
    const auto start = std::chrono::steady_clock::now();
    for (int spins = 0;; ++spins) {
      ncclResult_t async = ncclSuccess;
      ncclCommGetAsyncError(comm_, &async);
      if (async != ncclSuccess && async != ncclInProgress)
        abort(fmt::format("{}: NCCL reports {} (a peer may have ended)", what, ncclGetErrorString(async)), 1);
      if (async == ncclSuccess && done()) return;
      const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      if (s > timeout_s_)
        abort(fmt::format("{}: not finished after {:.0f} s (DSV4_COLLECTIVE_TIMEOUT_S); a peer is gone or stuck",
                          what, timeout_s_),
              1);
      if (spins > 1000) std::this_thread::sleep_for(std::chrono::microseconds(200));
    }
  }
  void wait_ready(const char* what) {
    poll(what, [] { return true; });
  }
  void wait_stream(const char* what) {
    poll(what, [&] {
      const cudaError_t e = cudaStreamQuery(stream_);
      if (e == cudaErrorNotReady) return false;
      check_cuda(e, what);
      return true;
    });
  }

  Communicator* bootstrap_;
  int rank_, size_, device_;
  double timeout_s_;
  cudaStream_t stream_ = nullptr;
  ncclComm_t comm_ = nullptr;
  int64_t received_ = 0;
};

}  // namespace

std::unique_ptr<Communicator> nccl_world(Communicator* bootstrap) {
  const int rank = bootstrap ? bootstrap->rank() : 0, size = bootstrap ? bootstrap->size() : 1;
  int devices = 0;
  if (const cudaError_t e = cudaGetDeviceCount(&devices); e != cudaSuccess || devices == 0)
    throw InputError(fmt::format("NCCL rank {} of {}: no usable GPU ({})", rank, size,
                                 e != cudaSuccess ? cudaGetErrorString(e) : "none visible"));
  const int device = local_rank(rank) % devices;
  if (const cudaError_t e = cudaSetDevice(device); e != cudaSuccess)
    throw InputError(fmt::format("NCCL rank {} of {}: cannot use GPU {}: {}", rank, size, device, cudaGetErrorString(e)));
  ncclUniqueId id{};
  if (rank == 0)
    if (const ncclResult_t r = ncclGetUniqueId(&id); r != ncclSuccess)
      throw InputError(fmt::format("NCCL rank 0 of {}: ncclGetUniqueId failed: {}", size, ncclGetErrorString(r)));
  if (bootstrap && size > 1) {
    std::vector<int64_t> bytes(size_t(size), 0);
    bytes[0] = int64_t(sizeof(id));
    ncclUniqueId got{};
    bootstrap->all_gather_v(rank == 0 ? &id : nullptr, &got, bytes);
    id = got;
  }
  return std::make_unique<NcclCommunicator>(bootstrap, rank, size, id, device);
}

}  // namespace dsv4
