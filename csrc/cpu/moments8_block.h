// The per-block math of the 8-bit moments on the CPU (dequantize, AdamW, quantize),
// shared by adamw_int8_ and frugal_step_int8_: one copy, so that both ops write the
// codes of frugal_kernels/reference.py's quantize_moment. Included by the per-ISA
// kernel files.
#pragma once

#include <algorithm>
#include <type_traits>

#include "frugal/moments8.h"
#include "kernels.h"
#include "loops.h"

#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace frugal {
namespace cpu {
namespace FK_CPU_ISA {

#if defined(__AVX2__)
// moment_code of 8 lanes of a block whose scale is > 0, as int32: the product rounded
// half to even (rintf's default mode), a NaN to 0, then clamped; the same values as the
// scalar code, where the compiler's version of it (a select per step and a truncating
// int8 conversion, a mask and a permute per 8 lanes) was half the op's time.
inline __m256i code_lanes(__m256 x, __m256 inverse, __m256 low, __m256 top) {
  __m256 q = _mm256_round_ps(_mm256_mul_ps(x, inverse),
                             _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  q = _mm256_and_ps(q, _mm256_cmp_ps(q, q, _CMP_ORD_Q));
  q = _mm256_min_ps(_mm256_max_ps(q, low), top);
  return _mm256_cvtps_epi32(q);
}

// The codes of 32 consecutive values, packed to bytes with saturation (exact: they are
// in range) and put back in order (the packs work within 128-bit halves).
inline __m256i codes32(const float* x, __m256 inverse, __m256 low, __m256 top, bool is_signed) {
  const __m256i a = code_lanes(_mm256_loadu_ps(x), inverse, low, top);
  const __m256i b = code_lanes(_mm256_loadu_ps(x + 8), inverse, low, top);
  const __m256i c = code_lanes(_mm256_loadu_ps(x + 16), inverse, low, top);
  const __m256i d = code_lanes(_mm256_loadu_ps(x + 24), inverse, low, top);
  const __m256i ab = _mm256_packs_epi32(a, b), cd = _mm256_packs_epi32(c, d);
  const __m256i bytes = is_signed ? _mm256_packs_epi16(ab, cd) : _mm256_packus_epi16(ab, cd);
  return _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}
#endif

// One block of adamw_int8_ (on a GPU a block would be shared by threads, with a
// reduction for its maxima): n <= kMomentBlock coordinates of p and g with their
// codes, and their two scales. The moments are dequantized, every coordinate
// takes adamw_update, and the updated fp32 moments are quantized again.
template <typename T>
inline void adamw_int8_block(T* __restrict__ p, const T* __restrict__ g, int8_t* __restrict__ m_codes,
                      float* m_scale, uint8_t* __restrict__ v_codes, float* v_scale, int64_t n,
                      const AdamWScalars& scalars) {
#if defined(__F16C__)
  if constexpr (std::is_same_v<T, fp16>) {
    // fp16 through the fp32 block with F16C's conversions (loops.h, as adamw_ does):
    // common.h's portable ones are scalar and branchy (an fp16 call took 4x a bf16 one).
    alignas(64) float pf[kMomentBlock];
    alignas(64) float gf[kMomentBlock];
    half_to_float(p, pf, n);
    half_to_float(g, gf, n);
    adamw_int8_block<float>(pf, gf, m_codes, m_scale, v_codes, v_scale, n, scalars);
    float_to_half(pf, p, n);
    return;
  }
#endif
  // A copy: through the reference, every store to p might change the scalars, and the
  // loop would not be vectorised.
  const AdamWScalars s = scalars;
  alignas(64) float m[kMomentBlock];
  alignas(64) float w[kMomentBlock];
  alignas(64) float out[kMomentBlock];
  const float ms = *m_scale, vs = *v_scale;
  for (int64_t i = 0; i < n; ++i) {
    float mi = first_moment(m_codes[i], ms);
    float vi = second_moment(v_codes[i], vs);
    float root_v;
    out[i] = adamw_update(to_float(p[i]), to_float(g[i]), mi, vi, s, root_v);
    m[i] = mi;
    w[i] = sqrtf(root_v);
  }
  // Rounded to 16 bits in a loop of its own: with from_float's NaN branch inside it, the
  // update's loop above was not vectorised (a bf16 call took 3.3x an fp32 one).
  for (int64_t i = 0; i < n; ++i) p[i] = from_float<T>(out[i]);
  // The maxima of |m| and w as the largest bit patterns: a non-negative float orders as
  // its bits do, and a NaN's bits lie above every number's, so the max is NaN once a
  // NaN is in the block (sticky_max's result, up to the NaN's payload) and the loop is
  // an integer max, which vectorises where the float select does not.
  uint32_t m_bits = 0, w_bits = 0;
  for (int64_t i = 0; i < n; ++i) {
    m_bits = std::max(m_bits, float_bits(fabsf(m[i])));
    w_bits = std::max(w_bits, float_bits(fabsf(w[i])));
  }
  const float new_ms = bits_float(m_bits) / 127.f, new_vs = bits_float(w_bits) / 255.f;
  // A product by the inverse, not a quotient per element: the block's two divisions
  // by an element's cost about a third of the op's time on the CPU.
  const float m_inv = 1.f / new_ms, v_inv = 1.f / new_vs;
  int64_t i = 0;
#if defined(__AVX2__)
  if (new_ms > 0.f && new_vs > 0.f) {
    const __m256 mi = _mm256_set1_ps(m_inv), vi = _mm256_set1_ps(v_inv);
    const __m256 m_low = _mm256_set1_ps(-127.f), m_top = _mm256_set1_ps(127.f);
    const __m256 v_low = _mm256_setzero_ps(), v_top = _mm256_set1_ps(255.f);
    for (; i + 32 <= n; i += 32) {
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(m_codes + i),
                          codes32(m + i, mi, m_low, m_top, true));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(v_codes + i),
                          codes32(w + i, vi, v_low, v_top, false));
    }
  }
#endif
  for (; i < n; ++i) {
    m_codes[i] = int8_t(moment_code(m[i], new_ms, m_inv, -127.f, 127.f));
    v_codes[i] = uint8_t(moment_code(w[i], new_vs, v_inv, 0.f, 255.f));
  }
  *m_scale = new_ms;
  *v_scale = new_vs;
}

// Every block of one row of a moment matrix (cols elements, `scales` the row's
// scales): p and g hold the row's coordinates in moment order.
template <typename T>
inline void adamw_int8_row(T* p, const T* g, int8_t* m_codes, float* m_scales, uint8_t* v_codes,
                           float* v_scales, int64_t cols, const AdamWScalars& s) {
  for (int64_t c0 = 0, b = 0; c0 < cols; c0 += kMomentBlock, ++b) {
    adamw_int8_block(p + c0, g + c0, m_codes + c0, m_scales + b, v_codes + c0, v_scales + b,
                     std::min(kMomentBlock, cols - c0), s);
  }
}

}  // namespace FK_CPU_ISA
}  // namespace cpu
}  // namespace frugal
