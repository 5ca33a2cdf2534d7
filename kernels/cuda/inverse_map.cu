// The inverse of an index table on the GPU (kernels/cuda/grad_common.cuh inverse_map), the CSR of
// kernels/cpu/inverse_map.h without atomics: every flat slot s gets the 64-bit key (row << 32) | s
// (holes and values outside [0, rows): row 0xffffffff), padded with all-ones keys to a power of two,
// and the keys are sorted with a bitonic network (a fixed compare-exchange sequence: tiles of 2048
// keys in shared memory, the longer strides in global memory). The keys are distinct, so the sorted
// order is the unique one: for each row its slots in increasing order, the CPU's CSR order.
// begin[r] = the first key of row r (binary search, one thread per row).
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/grad_common.cuh"

namespace dsv4::cuda::detail {

namespace {

constexpr int kSortTile = 2048, kSortThreads = kSortTile / 2;
constexpr uint64_t kHoleRow = 0xffffffffull;

// ---- the inverse map: keys, bitonic sort, row starts -------------------------------------------------

// keys[e] = (row << 32) | e for the flat slots e < TK (holes and rows outside [0, N): kHoleRow),
// all ones for the padding up to n.
__global__ void keys_kernel(const int32_t* idx, int64_t TK, int64_t N, uint64_t* keys, int64_t n) {
  for (int64_t e = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; e < n;
       e += int64_t(gridDim.x) * blockDim.x) {
    uint64_t key = ~uint64_t(0);
    if (e < TK) {
      const int32_t r = idx[e];
      key = ((r >= 0 && r < N) ? uint64_t(r) : kHoleRow) << 32 | uint64_t(e);
    }
    keys[e] = key;
  }
}

// The compare-exchange of the bitonic network for stage k (block size of the merge) on the pair with
// index q at distance j: lo = (q / j) * 2j + q % j, hi = lo + j (global indices); ascending where
// (lo & k) == 0.
__device__ __forceinline__ void bitonic_pair(uint64_t* v, int64_t base, int64_t q, int64_t j, int64_t k) {
  const int64_t lo = (q / j) * 2 * j + q % j, hi = lo + j;
  const uint64_t a = v[lo], b = v[hi];
  const bool up = ((base + lo) & k) == 0;
  if ((a > b) == up) {
    v[lo] = b;
    v[hi] = a;
  }
}

// Every stage k = 2 .. min(n, kSortTile) on tiles of kSortTile keys in shared memory (n a power of two).
__global__ void __launch_bounds__(kSortThreads) sort_tiles_kernel(uint64_t* keys, int64_t n) {
  __shared__ uint64_t s[kSortTile];
  const int64_t len = n < kSortTile ? n : kSortTile, base = int64_t(blockIdx.x) * kSortTile;
  for (int64_t i = threadIdx.x; i < len; i += blockDim.x) s[i] = keys[base + i];
  __syncthreads();
  for (int64_t k = 2; k <= len; k <<= 1)
    for (int64_t j = k >> 1; j > 0; j >>= 1) {
      for (int64_t q = threadIdx.x; q < len / 2; q += blockDim.x) bitonic_pair(s, base, q, j, k);
      __syncthreads();
    }
  for (int64_t i = threadIdx.x; i < len; i += blockDim.x) keys[base + i] = s[i];
}

// One step (k, j) with j >= kSortTile over the whole array, one thread per pair.
__global__ void sort_step_kernel(uint64_t* keys, int64_t n, int64_t j, int64_t k) {
  for (int64_t q = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; q < n / 2;
       q += int64_t(gridDim.x) * blockDim.x)
    bitonic_pair(keys, 0, q, j, k);
}

// The steps j = kSortTile / 2 .. 1 of stage k (> kSortTile) on tiles in shared memory.
__global__ void __launch_bounds__(kSortThreads) sort_merge_tiles_kernel(uint64_t* keys, int64_t k) {
  __shared__ uint64_t s[kSortTile];
  const int64_t base = int64_t(blockIdx.x) * kSortTile;
  for (int64_t i = threadIdx.x; i < kSortTile; i += blockDim.x) s[i] = keys[base + i];
  __syncthreads();
  for (int64_t j = kSortTile / 2; j > 0; j >>= 1) {
    for (int64_t q = threadIdx.x; q < kSortTile / 2; q += blockDim.x) bitonic_pair(s, base, q, j, k);
    __syncthreads();
  }
  for (int64_t i = threadIdx.x; i < kSortTile; i += blockDim.x) keys[base + i] = s[i];
}

// Sorts keys [n] ascending (n a power of two), the fixed sequence of the bitonic network.
void bitonic_sort(uint64_t* keys, int64_t n, cudaStream_t stream) {
  const int64_t tiles = n < kSortTile ? 1 : n / kSortTile;
  sort_tiles_kernel<<<unsigned(tiles), kSortThreads, 0, stream>>>(keys, n);
  DSV4_LAUNCH_CHECK();
  for (int64_t k = 2 * int64_t(kSortTile); k <= n; k <<= 1) {
    for (int64_t j = k >> 1; j >= kSortTile; j >>= 1) {
      sort_step_kernel<<<grid_for(n / 2, 256), 256, 0, stream>>>(keys, n, j, k);
      DSV4_LAUNCH_CHECK();
    }
    sort_merge_tiles_kernel<<<unsigned(tiles), kSortThreads, 0, stream>>>(keys, k);
    DSV4_LAUNCH_CHECK();
  }
}

// begin[r] = the number of keys below (r << 32), r = 0..N (binary search over the sorted keys [n]): the
// slots of row r are keys[begin[r] .. begin[r + 1]).
__global__ void row_begin_kernel(const uint64_t* keys, int64_t n, int64_t N, int64_t* begin) {
  for (int64_t r = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; r <= N;
       r += int64_t(gridDim.x) * blockDim.x) {
    const uint64_t target = uint64_t(r) << 32;
    int64_t lo = 0, hi = n;
    while (lo < hi) {
      const int64_t mid = lo + (hi - lo) / 2;
      if (keys[mid] < target)
        lo = mid + 1;
      else
        hi = mid;
    }
    begin[r] = lo;
  }
}

// slots[s] = the slot of sorted key s.
__global__ void slots_kernel(const uint64_t* keys, int64_t n, int64_t* slots) {
  for (int64_t s = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; s < n; s += int64_t(gridDim.x) * blockDim.x)
    slots[s] = int64_t(keys[s] & 0xffffffffull);
}

}  // namespace

int64_t inverse_map_size(int64_t n) {
  int64_t m = 1;
  while (m < n) m <<= 1;
  return m;
}

void inverse_map(const int32_t* table, int64_t n, int64_t rows, uint64_t* keys, int64_t* begin, cudaStream_t stream) {
  const int64_t m = inverse_map_size(n);
  keys_kernel<<<grid_for(m, 256), 256, 0, stream>>>(table, n, rows, keys, m);
  DSV4_LAUNCH_CHECK();
  bitonic_sort(keys, m, stream);
  row_begin_kernel<<<grid_for(rows + 1, 256), 256, 0, stream>>>(keys, m, rows, begin);
  DSV4_LAUNCH_CHECK();
}

void inverse_map_slots(const uint64_t* keys, int64_t n, int64_t* slots, cudaStream_t stream) {
  slots_kernel<<<grid_for(n, 256), 256, 0, stream>>>(keys, n, slots);
  DSV4_LAUNCH_CHECK();
}

}  // namespace dsv4::cuda::detail
