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

#if defined(__AVX2__) && defined(__F16C__) && !defined(__AVX512F__)
// The state-free rule over 16-bit storage with the conversions in registers,
// 8 lanes at a time. GCC vectorises neither the bf16 loop (from_float's NaN
// branch) nor the fp16 one, which over_fp32 runs as three passes over L1
// tiles: in cache, the rule took 0.43 ns per bf16 position and 0.5-0.57 per
// fp16 one against 0.19 for fp32 (one thread of a Zen 3). The rounding is the
// loops' own: from_float for bf16, F16C for fp16 (its NaN), and the scalar
// code for the last n % 8 positions, as half_to_float and float_to_half leave
// them to it.
inline __m256 load8(const bf16* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
inline __m256 load8(const fp16* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

// from_float<bf16> on 8 lanes (round to nearest even, NaN to 0x7fc0) and F16C.
inline __m128i bits8(__m256 x, bf16) {
  const __m256i u = _mm256_castps_si256(x);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  const __m256i rounded = _mm256_srli_epi32(
      _mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7fff)), odd), 16);
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
  const __m256i bits = _mm256_blendv_epi8(rounded, _mm256_set1_epi32(0x7fc0), nan);
  // Each lane holds at most 0xffff: the saturating pack keeps it.
  return _mm_packus_epi32(_mm256_castsi256_si128(bits), _mm256_extracti128_si256(bits, 1));
}
inline __m128i bits8(__m256 x, fp16) {
  return _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}

// state_free_update<Mode> (update_rules.h) on 8 lanes: the same operations in
// the same order, so the same bits.
template <StateFree Mode>
inline __m256 state_free8(__m256 p, __m256 g, const SignScalars& s) {
  g = _mm256_mul_ps(g, _mm256_set1_ps(s.inv_grad_scale));
  p = _mm256_mul_ps(p, _mm256_set1_ps(s.decay));
  if constexpr (Mode == StateFree::kSign) {
    const __m256 zero = _mm256_setzero_ps();
    const __m256 sign = _mm256_or_ps(
        _mm256_and_ps(_mm256_cmp_ps(g, zero, _CMP_GT_OQ), _mm256_set1_ps(1.f)),
        _mm256_and_ps(_mm256_cmp_ps(g, zero, _CMP_LT_OQ), _mm256_set1_ps(-1.f)));
    return _mm256_sub_ps(p, _mm256_mul_ps(_mm256_set1_ps(s.step), sign));
  } else if constexpr (Mode == StateFree::kSgd) {
    return _mm256_sub_ps(p, _mm256_mul_ps(_mm256_set1_ps(s.step), g));
  } else {
    return p;
  }
}

template <typename T, StateFree Mode>
void state_free_half(T* __restrict__ p, const T* __restrict__ g, int64_t n, const SignScalars s) {
  const int64_t full = n & ~int64_t(7);
  for (int64_t i = 0; i < full; i += 8) {
    const __m128i out = bits8(state_free8<Mode>(load8(p + i), load8(g + i), s), T{});
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p + i), out);
  }
  for (int64_t i = full; i < n; ++i) {
    p[i] = from_float<T>(state_free_update<Mode>(to_float(p[i]), to_float(g[i]), s));
  }
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
#if defined(__AVX2__) && defined(__F16C__) && !defined(__AVX512F__)
  if constexpr (!std::is_same_v<T, float>) {
    state_free_half<T, Mode>(p, g, n, s);
    return;
  }
#endif
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
