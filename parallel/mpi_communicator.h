// The Communicator (model/communicator.h) over MPI (Open MPI from Debian): the CPU transport of a
// parallel run, launched with `mpirun -np N dsv4 ... --ep N` (docs/PARALLEL.md). MPI is initialised
// once per process by the first MpiCommunicator and finalised at exit. Errors of MPI calls are fatal
// to the job (MPI_ERRORS_ARE_FATAL), and abort() ends every rank through MPI_Abort, so a failing rank
// never leaves the others waiting.
#pragma once

#include <memory>
#include <string>

#include "model/communicator.h"

namespace dsv4 {

// The world communicator of this process's MPI job; throws InputError when the process was not
// started by an MPI launcher with `expected` ranks (naming both counts).
std::unique_ptr<Communicator> mpi_world(int expected);

// Whether this process runs under an MPI launcher (its environment says so), without initialising MPI.
bool launched_by_mpi();

}  // namespace dsv4
