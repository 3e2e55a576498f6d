// Splitting a batch of tensors into chunks and running them on OpenMP threads.
// Included by the per-ISA kernel files only.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "frugal/common.h"

#ifndef FK_CPU_ISA
#error "FK_CPU_ISA must name the ISA namespace this file is compiled for"
#endif

namespace frugal {
namespace cpu {
namespace FK_CPU_ISA {

struct Chunk {
  int64_t tensor;
  int64_t begin;
  int64_t end;
};

// Elements per work item: large enough to amortise the bookkeeping, small
// enough that two threads get balanced shares of a mid-sized tensor.
constexpr int64_t kChunk = 1 << 15;

// Below this many elements the cost of waking threads outweighs the work.
constexpr int64_t kMinParallelElements = 1 << 16;

// Cut every tensor into chunks of at most `chunk` elements and run
// fn(tensor, begin, end) on each, statically split over the threads so that
// each thread streams through contiguous memory.
template <typename Fn>
void for_each_chunk(int64_t count, const int64_t* numel, int64_t chunk, int num_threads, Fn&& fn) {
  std::vector<Chunk> chunks;
  int64_t total = 0;
  for (int64_t t = 0; t < count; ++t) {
    for (int64_t b = 0; b < numel[t]; b += chunk) {
      chunks.push_back({t, b, std::min(numel[t], b + chunk)});
    }
    total += numel[t];
  }
  const int64_t n = int64_t(chunks.size());
  const int threads = total < kMinParallelElements ? 1 : std::max(1, num_threads);
#if defined(_OPENMP)
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
#endif
  for (int64_t i = 0; i < n; ++i) {
    fn(chunks[i].tensor, chunks[i].begin, chunks[i].end);
  }
  (void)threads;
}

// Keeps the compiler from vectorising a loop (GCC before 14 has no pragma for it).
#if defined(__GNUC__) && !defined(__clang__)
#define FK_NOVECTOR __attribute__((optimize("no-tree-vectorize")))
#else
#define FK_NOVECTOR
#endif

template <typename T>
inline T* typed(void* p) { return static_cast<T*>(p); }
template <typename T>
inline const T* typed(const void* p) { return static_cast<const T*>(p); }

}  // namespace FK_CPU_ISA
}  // namespace cpu
}  // namespace frugal
