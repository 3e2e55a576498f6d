// The contiguous inner loops of the CPU kernels. Written as plain loops over
// restrict pointers so that the compiler vectorises them for the ISA level the
// including file is compiled for.
#pragma once

#include <algorithm>
#include <cstdint>
#include <type_traits>

#if defined(__F16C__)
#include <immintrin.h>
#endif

#include "frugal/update_rules.h"

namespace frugal {
namespace cpu {
namespace FK_CPU_ISA {

// The loops over storage type T, with the math in fp32.
template <typename T>
void adamw_loop(T* __restrict__ p, const T* __restrict__ g, float* __restrict__ m,
                float* __restrict__ v, int64_t n, const AdamWScalars s) {
  for (int64_t i = 0; i < n; ++i) {
    float mi = m[i];
    float vi = v[i];
    p[i] = from_float<T>(adamw_update(to_float(p[i]), to_float(g[i]), mi, vi, s));
    m[i] = mi;
    v[i] = vi;
  }
}

template <typename T, StateFree Mode>
void state_free_loop(T* __restrict__ p, const T* __restrict__ g, int64_t n, const SignScalars s) {
  for (int64_t i = 0; i < n; ++i) {
    p[i] = from_float<T>(state_free_update<Mode>(to_float(p[i]), to_float(g[i]), s));
  }
}

// Without momentum there is no buffer: `buf` is null and never read.
template <typename T>
void sgd_loop(T* __restrict__ p, const T* __restrict__ g, float* __restrict__ buf, int64_t n,
              const SgdScalars s) {
  if (s.use_momentum) {
    for (int64_t i = 0; i < n; ++i) {
      float bi = buf[i];
      p[i] = from_float<T>(sgd_update(to_float(p[i]), to_float(g[i]), bi, s));
      buf[i] = bi;
    }
  } else {
    for (int64_t i = 0; i < n; ++i) {
      float unused = 0.f;
      p[i] = from_float<T>(sgd_update(to_float(p[i]), to_float(g[i]), unused, s));
    }
  }
}

#if defined(__F16C__)
// The portable fp16 conversions of common.h are exact but branchy, and the
// compiler keeps them scalar: an fp16 adamw_ ran at 12% of the in-place
// roofline (fp32: 100%). F16C converts 8 values per instruction with the same
// round-to-nearest-even, so fp16 data runs the fp32 loops over tiles
// converted in L1 (bit-identical results for every non-NaN value; a NaN stays
// a NaN, with the payload the hardware gives it).
constexpr int64_t kHalfTile = 512;

inline void half_to_float(const fp16* __restrict__ src, float* __restrict__ dst, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i));
    _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(h));
  }
  for (; i < n; ++i) dst[i] = to_float(src[i]);
}

inline void float_to_half(const float* __restrict__ src, fp16* __restrict__ dst, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m128i h = _mm256_cvtps_ph(_mm256_loadu_ps(src + i),
                                      _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i), h);
  }
  for (; i < n; ++i) dst[i] = from_float<fp16>(src[i]);
}
#endif

// Run body(p', g', offset, length) over [0, n) with p' and g' pointers the
// fp32 loops can use: p and g themselves, or for fp16 (with F16C) tiles
// converted to fp32 and p's tile converted back after the body.
template <typename T, typename Body>
inline void over_fp32(T* p, const T* g, int64_t n, Body&& body) {
#if defined(__F16C__)
  if constexpr (std::is_same_v<T, fp16>) {
    float bp[kHalfTile], bg[kHalfTile];
    for (int64_t a = 0; a < n; a += kHalfTile) {
      const int64_t len = std::min(kHalfTile, n - a);
      half_to_float(p + a, bp, len);
      half_to_float(g + a, bg, len);
      body(bp, static_cast<const float*>(bg), a, len);
      float_to_half(bp, p + a, len);
    }
    return;
  }
#endif
  body(p, g, int64_t(0), n);
}

template <typename T>
void adamw_range(T* p, const T* g, float* m, float* v, int64_t n, const AdamWScalars s) {
  over_fp32(p, g, n, [&](auto* tp, const auto* tg, int64_t a, int64_t len) {
    adamw_loop(tp, tg, m + a, v + a, len, s);
  });
}

template <typename T, StateFree Mode>
void state_free_range(T* p, const T* g, int64_t n, const SignScalars s) {
  over_fp32(p, g, n, [&](auto* tp, const auto* tg, int64_t, int64_t len) {
    state_free_loop<std::remove_const_t<std::remove_pointer_t<decltype(tp)>>, Mode>(tp, tg, len,
                                                                                     s);
  });
}

template <typename T>
void sgd_range(T* p, const T* g, float* buf, int64_t n, const SgdScalars s) {
  over_fp32(p, g, n, [&](auto* tp, const auto* tg, int64_t a, int64_t len) {
    sgd_loop(tp, tg, s.use_momentum ? buf + a : buf, len, s);
  });
}

}  // namespace FK_CPU_ISA
}  // namespace cpu
}  // namespace frugal
