// Large buffers filled once (an import's decoded R3 buffers, its per-layer copies): asking the kernel
// for transparent huge pages before the first touch replaces one page fault per 4 KiB with one per
// 2 MiB, which on virtual machines is most of the time spent filling them. A hint only: without
// THP (or with it set to "never") nothing changes.
#pragma once

#include <sys/mman.h>

#include <cstddef>
#include <cstdint>
#include <vector>

namespace dsv4 {

inline void advise_huge_pages(const void* p, size_t bytes) {
#ifdef MADV_HUGEPAGE
  constexpr uintptr_t kHuge = uintptr_t(2) << 20;
  if (bytes < 4 * kHuge) return;
  const uintptr_t from = (uintptr_t(p) + kHuge - 1) & ~(kHuge - 1);
  const uintptr_t to = (uintptr_t(p) + bytes) & ~(kHuge - 1);
  if (to > from) madvise(reinterpret_cast<void*>(from), to - from, MADV_HUGEPAGE);
#else
  (void)p;
  (void)bytes;
#endif
}

// v.reserve(n) with huge pages asked for the reserved (untouched) memory.
template <class T>
void reserve_huge(std::vector<T>& v, size_t n) {
  v.reserve(n);
  advise_huge_pages(v.data(), v.capacity() * sizeof(T));
}

}  // namespace dsv4
