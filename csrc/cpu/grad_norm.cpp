// grad_norm on the CPU: one read of every gradient, giving the sum of squares
// (2-norm) or the largest magnitude (max norm) of all of them, in double, with
// the arithmetic of frugal/norm.h (shared with the CUDA kernel).
//
// Each chunk is summed over kLanes independent accumulators (the compiler
// vectorises across them without reassociating anything) and the chunks'
// sums are added in chunk order, so the bits do not depend on the thread
// count or the ISA level.
#include <cmath>
#include <vector>

#include "frugal/norm.h"
#include "kernels.h"
#include "loops.h"
#include "parallel.h"

namespace frugal {
namespace cpu {
namespace FK_CPU_ISA {

namespace {

constexpr int kLanes = 16;

// The lanes of a chunk added pairwise in a fixed order.
inline double fold(const double* acc) {
  double level[kLanes];
  for (int j = 0; j < kLanes; ++j) level[j] = acc[j];
  for (int width = kLanes / 2; width > 0; width /= 2) {
    for (int j = 0; j < width; ++j) level[j] = level[j] + level[j + width];
  }
  return level[0];
}

template <bool Max>
inline void accumulate(double& acc, double x) {
  acc = norm_accumulate<Max>(acc, x);
}

// Adds the n values of x into the lanes of acc, value i into lane i % kLanes: a chunk's
// values go through here in order, in one run or in tiles of a multiple of kLanes.
template <bool Max>
inline void add_run(double* __restrict__ acc, const float* __restrict__ x, int64_t n) {
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    for (int j = 0; j < kLanes; ++j) accumulate<Max>(acc[j], double(x[i + j]));
  }
  for (int j = 0; i < n; ++i, ++j) accumulate<Max>(acc[j], double(x[i]));
}

template <bool Max>
inline double finish(const double* acc) {
  if constexpr (Max) {
    double m = 0.0;
    for (int j = 0; j < kLanes; ++j) m = norm_combine<true>(m, acc[j]);
    return m;
  } else {
    return fold(acc);
  }
}

// 16-bit gradients are converted to fp32 in L1 tiles (F16C for fp16 where the level has
// it) and added as fp32 runs.
template <bool Max, typename T>
double reduce(const T* __restrict__ g, int64_t n) {
  double acc[kLanes] = {};
  if constexpr (std::is_same_v<T, float>) {
    add_run<Max>(acc, g, n);
  } else {
    constexpr int64_t kTile = 512;
    static_assert(kTile % kLanes == 0, "tiles must keep the lanes aligned");
    float tile[kTile];
    for (int64_t a = 0; a < n; a += kTile) {
      const int64_t len = std::min(kTile, n - a);
#if defined(__F16C__)
      if constexpr (std::is_same_v<T, fp16>) {
        half_to_float(g + a, tile, len);
      } else
#endif
      {
        for (int64_t i = 0; i < len; ++i) tile[i] = to_float(g[a + i]);
      }
      add_run<Max>(acc, tile, len);
    }
  }
  return finish<Max>(acc);
}

}  // namespace

double grad_norm(const void* const* grads, const int64_t* numel, int64_t count, DType dtype,
                 bool max_norm, int num_threads) {
  // The chunks of for_each_chunk, in its order: one partial result each.
  int64_t chunks = 0;
  for (int64_t t = 0; t < count; ++t) chunks += (numel[t] + kChunk - 1) / kChunk;
  std::vector<double> partial(size_t(chunks), 0.0);
  std::vector<int64_t> first(size_t(count) + 1, 0);
  for (int64_t t = 0; t < count; ++t) first[t + 1] = first[t] + (numel[t] + kChunk - 1) / kChunk;
  dispatch_dtype(dtype, [&](auto tag) {
    using T = decltype(tag);
    for_each_chunk(count, numel, kChunk, num_threads, [&](int64_t t, int64_t b, int64_t e) {
      const T* g = typed<T>(grads[t]) + b;
      partial[size_t(first[t] + b / kChunk)] =
          max_norm ? reduce<true>(g, e - b) : reduce<false>(g, e - b);
    });
  });
  double total = 0.0;
  for (double x : partial) {
    total = max_norm ? norm_combine<true>(total, x) : norm_combine<false>(total, x);
  }
  return total;
}

}  // namespace FK_CPU_ISA
}  // namespace cpu
}  // namespace frugal
