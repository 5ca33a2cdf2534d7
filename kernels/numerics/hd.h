// Host/device qualifiers so one source serves the CPU reference and the CUDA kernels.
#pragma once

#if defined(__CUDACC__)
#define DSV4_HD __host__ __device__ __forceinline__
#else
#define DSV4_HD inline
#endif
