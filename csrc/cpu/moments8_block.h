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

namespace frugal {
namespace cpu {
namespace FK_CPU_ISA {

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
  for (int64_t i = 0; i < n; ++i) {
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
