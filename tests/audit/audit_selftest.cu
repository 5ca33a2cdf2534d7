// Kernels for the self-test of scripts/kernel-audit.py (tests/audit/test_kernel_audit.py). Compiled
// twice to PTX: with the exact-mode flags and DSV4_AUDIT_CLEAN_ONLY the audit must pass; with
// --fmad=true --use_fast_math it must name the contraction and every approximation below.

// A multiply and an add that the CPU rounds twice; --fmad=true contracts them into one fma.
__global__ void multiply_add(const float* a, const float* b, const float* c, float* out, int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) out[i] = a[i] * b[i] + c[i];
}

// An fma the source asks for: the same on the CPU (std::fma) and clean under both flag sets.
__global__ void explicit_fma(const float* a, const float* b, const float* c, float* out, int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) out[i] = fmaf(a[i], b[i], c[i]);
}

// IEEE division and square root: clean with the exact-mode flags; approximate with fast math.
__global__ void divide_and_root(const float* a, const float* b, float* out, int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) out[i] = a[i] / b[i] + sqrtf(b[i]);
}

#ifndef DSV4_AUDIT_CLEAN_ONLY
// Hardware approximations under any flags.
__global__ void approximations(const float* a, float* out, int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) out[i] = __expf(a[i]) + __logf(a[i]) + __sinf(a[i]) + rsqrtf(a[i]);
}
#endif
