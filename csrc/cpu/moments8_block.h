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
// Whether the block's codes may skip moment_code's clamp and NaN test: with a scale in
// [2^-126, 2^126] its inverse is a normal number within half an ulp of 1 / scale, so
// for |x| <= the block's max, |x * inverse| <= qmax * (1 + 2^-24)^3 < qmax + 0.5 (no
// clamp), and a finite x gives a finite product (no NaN: a NaN in the block makes the
// scale NaN). cvtps rounds half to even, as rintf does in the default mode.
inline bool plain_codes(float scale) { return scale >= 0x1p-126f && scale <= 0x1p126f; }

// The codes of 32 consecutive values, packed to bytes with saturation (exact: they are
// in range) and put back in order (the packs work within 128-bit halves). Root: the
// codes are of the values' square roots (the second moment's fourth root, from the
// square root that AdamW took).
template <bool Signed, bool Root>
inline __m256i codes32(const float* x, __m256 inverse) {
  __m256i q[4];
  for (int k = 0; k < 4; ++k) {
    __m256 v = _mm256_loadu_ps(x + 8 * k);
    if constexpr (Root) v = _mm256_sqrt_ps(v);
    q[k] = _mm256_cvtps_epi32(_mm256_mul_ps(v, inverse));
  }
  const __m256i ab = _mm256_packs_epi32(q[0], q[1]), cd = _mm256_packs_epi32(q[2], q[3]);
  const __m256i bytes = Signed ? _mm256_packs_epi16(ab, cd) : _mm256_packus_epi16(ab, cd);
  return _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

// adamw_int8_block for fp32 params with AVX2, 8 coordinates at a time: the same
// operations in the same order as the scalar code (dequantize, adamw_update), so the
// same bits. GCC's version of the scalar block ran at 0.40x the speed of adamw_'s
// loop in cache (one thread of a Zen 3; this one at 0.56-0.58x): it unpacked the codes
// lane by lane, kept the maxima in a loop of their own, and took the fourth root of
// every coordinate before the codes needed it. Here the maxima are taken in the
// update's loop, and the fourth root's maximum is the root of the square roots'
// maximum (a root is monotone, so the two are the same float; a NaN's bits stay the
// largest and sqrt keeps them).
inline void adamw_int8_block_avx2(float* __restrict__ p, const float* __restrict__ g,
                                  int8_t* __restrict__ m_codes, float* m_scale,
                                  uint8_t* __restrict__ v_codes, float* v_scale, int64_t n,
                                  const AdamWScalars& scalars) {
  const AdamWScalars s = scalars;
  alignas(64) float m[kMomentBlock];
  alignas(64) float r[kMomentBlock];  // sqrt(v); the codes are of its square root
  const float ms = *m_scale, vs = *v_scale;
  const __m256 m_scale8 = _mm256_set1_ps(ms), v_scale8 = _mm256_set1_ps(vs);
  const __m256 inv_grad_scale = _mm256_set1_ps(s.inv_grad_scale);
  const __m256 negate = _mm256_set1_ps(s.maximize ? -0.f : 0.f);
  const __m256 decay = _mm256_set1_ps(s.decay);
  const __m256 one_minus_beta1 = _mm256_set1_ps(s.one_minus_beta1);
  const __m256 beta2 = _mm256_set1_ps(s.beta2), one_minus_beta2 = _mm256_set1_ps(s.one_minus_beta2);
  const __m256 bc2_sqrt = _mm256_set1_ps(s.bc2_sqrt), eps = _mm256_set1_ps(s.eps);
  const __m256 step_size = _mm256_set1_ps(s.step_size);
  const __m256i magnitude = _mm256_set1_epi32(0x7fffffff);
  __m256i m_max = _mm256_setzero_si256(), r_max = _mm256_setzero_si256();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m128i mc = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(m_codes + i));
    const __m128i vc = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(v_codes + i));
    __m256 mi = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(mc)), m_scale8);
    const __m256 t = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(vc)), v_scale8);
    const __m256 u = _mm256_mul_ps(t, t);
    __m256 vi = _mm256_mul_ps(u, u);
    const __m256 gi = _mm256_xor_ps(_mm256_mul_ps(_mm256_loadu_ps(g + i), inv_grad_scale), negate);
    const __m256 pi = _mm256_mul_ps(_mm256_loadu_ps(p + i), decay);
    mi = _mm256_add_ps(mi, _mm256_mul_ps(one_minus_beta1, _mm256_sub_ps(gi, mi)));
    vi = _mm256_add_ps(_mm256_mul_ps(vi, beta2),
                       _mm256_mul_ps(one_minus_beta2, _mm256_mul_ps(gi, gi)));
    const __m256 root_v = _mm256_sqrt_ps(vi);
    const __m256 denom = _mm256_add_ps(_mm256_div_ps(root_v, bc2_sqrt), eps);
    _mm256_storeu_ps(p + i, _mm256_sub_ps(pi, _mm256_mul_ps(step_size, _mm256_div_ps(mi, denom))));
    _mm256_store_ps(m + i, mi);
    _mm256_store_ps(r + i, root_v);
    m_max = _mm256_max_epu32(m_max, _mm256_and_si256(_mm256_castps_si256(mi), magnitude));
    r_max = _mm256_max_epu32(r_max, _mm256_and_si256(_mm256_castps_si256(root_v), magnitude));
  }
  alignas(32) uint32_t lanes[16];
  _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), m_max);
  _mm256_store_si256(reinterpret_cast<__m256i*>(lanes + 8), r_max);
  uint32_t m_bits = 0, r_bits = 0;
  for (int k = 0; k < 8; ++k) {
    m_bits = std::max(m_bits, lanes[k]);
    r_bits = std::max(r_bits, lanes[8 + k]);
  }
  for (; i < n; ++i) {
    float mi = first_moment(m_codes[i], ms);
    float vi = second_moment(v_codes[i], vs);
    p[i] = adamw_update(p[i], g[i], mi, vi, s, r[i]);
    m[i] = mi;
    m_bits = std::max(m_bits, float_bits(fabsf(mi)));
    r_bits = std::max(r_bits, float_bits(fabsf(r[i])));
  }
  const float new_ms = bits_float(m_bits) / 127.f, new_vs = sqrtf(bits_float(r_bits)) / 255.f;
  const float m_inv = 1.f / new_ms, v_inv = 1.f / new_vs;
  i = 0;
  if (plain_codes(new_ms) && plain_codes(new_vs)) {
    const __m256 mi = _mm256_set1_ps(m_inv), vi = _mm256_set1_ps(v_inv);
    for (; i + 32 <= n; i += 32) {
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(m_codes + i), codes32<true, false>(m + i, mi));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(v_codes + i), codes32<false, true>(r + i, vi));
    }
  }
  for (; i < n; ++i) {
    m_codes[i] = int8_t(moment_code(m[i], new_ms, m_inv, -127.f, 127.f));
    v_codes[i] = uint8_t(moment_code(sqrtf(r[i]), new_vs, v_inv, 0.f, 255.f));
  }
  *m_scale = new_ms;
  *v_scale = new_vs;
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
#if defined(__AVX2__)
  if constexpr (std::is_same_v<T, float>) {
    adamw_int8_block_avx2(p, g, m_codes, m_scale, v_codes, v_scale, n, scalars);
    return;
  } else if constexpr (std::is_same_v<T, bf16>) {
    // bf16 through the fp32 block too (the conversion to fp32 is exact).
    alignas(64) float pf[kMomentBlock];
    alignas(64) float gf[kMomentBlock];
    for (int64_t i = 0; i < n; ++i) pf[i] = to_float(p[i]);
    for (int64_t i = 0; i < n; ++i) gf[i] = to_float(g[i]);
    adamw_int8_block_avx2(pf, gf, m_codes, m_scale, v_codes, v_scale, n, scalars);
    for (int64_t i = 0; i < n; ++i) p[i] = from_float<bf16>(pf[i]);
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
#if defined(__AVX2__)
  int64_t i = 0;
  if (plain_codes(new_ms) && plain_codes(new_vs)) {
    const __m256 mi = _mm256_set1_ps(m_inv), vi = _mm256_set1_ps(v_inv);
    for (; i + 32 <= n; i += 32) {
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(m_codes + i), codes32<true, false>(m + i, mi));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(v_codes + i),
                          codes32<false, false>(w + i, vi));
    }
  }
#else
  int64_t i = 0;
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
