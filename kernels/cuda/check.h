// Error handling of the CUDA backend: every CUDA runtime call goes through CUDA_CHECK, every launch
// is followed by CUDA_CHECK(cudaGetLastError()), and a kernel whose parameters cannot run throws
// before anything is launched. Host-only (usable from .cpp and .cu files).
#pragma once

#include <cuda_runtime_api.h>

#include <string>

#include "kernels/error.h"

namespace dsv4::cuda {

// A failed CUDA runtime call: the message holds file:line, the call and cudaGetErrorString.
struct CudaError : Error {
  using Error::Error;
};

[[noreturn]] inline void throw_cuda_error(cudaError_t e, const char* expr, const char* file, int line) {
  throw CudaError(std::string("CUDA error at ") + file + ":" + std::to_string(line) + ": " + expr + ": " +
                  cudaGetErrorString(e) + " (" + cudaGetErrorName(e) + ")");
}

// `why` from a *_check function: nullptr (can run) or the reason, which names the bad field.
inline void require(const char* why, const char* op) {
  if (why) throw Error(std::string("cuda ") + op + " cannot run: " + why);
}

}  // namespace dsv4::cuda

#define CUDA_CHECK(expr)                                                         \
  do {                                                                           \
    const cudaError_t dsv4_cuda_err_ = (expr);                                   \
    if (dsv4_cuda_err_ != cudaSuccess)                                           \
      ::dsv4::cuda::throw_cuda_error(dsv4_cuda_err_, #expr, __FILE__, __LINE__); \
  } while (0)
