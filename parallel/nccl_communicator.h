// The Communicator (model/communicator.h) over NCCL: the GPU transport of expert parallelism, launched
// like the CPU one with `mpirun -np N dsv4 ... --ep N --device cuda` (docs/PARALLEL.md). all_gather_v
// takes device buffers and runs as one group of ncclSend/ncclRecv per peer on a stream of its own.
//
// Bootstrap: rank 0 makes the NCCL unique id and the other ranks receive it over `bootstrap` (the MPI
// world: an all_gather_v of host memory in which rank 0 alone sends). Each rank uses the GPU numbered
// by its local rank on the host (OMPI_COMM_WORLD_LOCAL_RANK, else its rank) modulo the GPUs it sees.
//
// Failures never hang: a collective that has not finished after DSV4_COLLECTIVE_TIMEOUT_S seconds
// (default 300), or an asynchronous NCCL error (a peer gone), aborts the NCCL communicator and ends
// the job through the bootstrap's abort with a message naming this rank and the collective.
#pragma once

#include <memory>

#include "model/communicator.h"

namespace dsv4 {

// `bootstrap` may be null for a job of one rank (no MPI needed then). Throws InputError when no GPU is
// usable or NCCL fails to start (naming the rank and NCCL's reason).
std::unique_ptr<Communicator> nccl_world(Communicator* bootstrap);

}  // namespace dsv4
