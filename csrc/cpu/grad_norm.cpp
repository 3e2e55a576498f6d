// grad_norm on the CPU: one read of every gradient, giving the sum of squares
// (2-norm) or the largest magnitude (max norm) of all of them, in double.
//
// The sum runs in double so that no finite fp32 gradient can overflow it (the
// largest square is 1.2e77): the result is then non-finite exactly when an
// element is NaN or infinite, which makes it the step's non-finite flag too.
// Each chunk is summed over kLanes independent accumulators (the compiler
// vectorises across them without reassociating anything) and the chunks'
// sums are added in chunk order, so the bits do not depend on the thread
// count or the ISA level.
#include <cmath>
#include <vector>

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
  if constexpr (Max) {
    // NaN must win: a plain max would drop it (x > NaN is false).
    const double a = std::fabs(x);
    acc = (a > acc || a != a) ? a : acc;
  } else {
    acc = acc + x * x;
  }
}

template <bool Max>
double reduce_fp32(const float* __restrict__ g, int64_t n) {
  double acc[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    for (int j = 0; j < kLanes; ++j) accumulate<Max>(acc[j], double(g[i + j]));
  }
  for (int j = 0; i < n; ++i, ++j) accumulate<Max>(acc[j], double(g[i]));
  if constexpr (Max) {
    double m = 0.0;
    for (int j = 0; j < kLanes; ++j) accumulate<true>(m, acc[j]);
    return m;
  } else {
    return fold(acc);
  }
}

// 16-bit gradients: converted to fp32 in L1 tiles (F16C for fp16 where the
// level has it), then reduced as fp32. Each tile's lanes are continued by
// the next tile, as if the chunk were one fp32 run.
template <bool Max, typename T>
double reduce(const T* __restrict__ g, int64_t n) {
  if constexpr (std::is_same_v<T, float>) {
    return reduce_fp32<Max>(g, n);
  } else {
    constexpr int64_t kTile = 512;  // a multiple of kLanes: lanes stay aligned across tiles
    static_assert(kTile % kLanes == 0, "tiles must keep the lanes aligned");
    float tile[kTile];
    double acc[kLanes] = {};
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
      int64_t i = 0;
      for (; i + kLanes <= len; i += kLanes) {
        for (int j = 0; j < kLanes; ++j) accumulate<Max>(acc[j], double(tile[i + j]));
      }
      for (int j = 0; i < len; ++i, ++j) accumulate<Max>(acc[j], double(tile[i]));
    }
    if constexpr (Max) {
      double m = 0.0;
      for (int j = 0; j < kLanes; ++j) accumulate<true>(m, acc[j]);
      return m;
    } else {
      return fold(acc);
    }
  }
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
    if (max_norm) {
      accumulate<true>(total, x);  // magnitudes already; a NaN stays
    } else {
      total = total + x;
    }
  }
  return total;
}

}  // namespace FK_CPU_ISA
}  // namespace cpu
}  // namespace frugal
