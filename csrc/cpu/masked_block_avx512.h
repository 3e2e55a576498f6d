// The gathered blocks of frugal_step_ with AVX-512 masks, for fp32 params.
//
// Members of a block are marked in a byte map (one independent store per
// member: a bitmap's read-modify-write of shared words would chain them
// through store forwarding), read back as one 16-bit mask per vector of 16
// coordinates. Each vector then gets the state-free rule on all lanes and
// AdamW on its member lanes, whose moments are consecutive in the compact
// state: they are loaded with one masked load and spread to the member lanes
// with vexpandps, and put back with vcompressps. This replaces the scalar
// gather and scatter of the generic path with a few instructions per 16
// coordinates. The arithmetic is update_rules.h's, operation for operation, so
// the results are bit-identical to the other ISA levels.
#pragma once

#if defined(__AVX512F__)

#include <immintrin.h>

#include <cstdint>
#include <cstring>

#include "frugal/update_rules.h"

namespace frugal {
namespace cpu {
namespace FK_CPU_ISA {

template <StateFree Mode>
inline __m512 state_free_lanes(__m512 p, __m512 g, __m512 decay, __m512 step) {
  const __m512 decayed = _mm512_mul_ps(p, decay);
  if (Mode == StateFree::kNone) return decayed;
  if (Mode == StateFree::kSgd) return _mm512_sub_ps(decayed, _mm512_mul_ps(step, g));
  const __m512 zero = _mm512_setzero_ps();
  __m512 sign = _mm512_mask_mov_ps(zero, _mm512_cmp_ps_mask(g, zero, _CMP_GT_OQ),
                                   _mm512_set1_ps(1.f));
  sign = _mm512_mask_mov_ps(sign, _mm512_cmp_ps_mask(g, zero, _CMP_LT_OQ), _mm512_set1_ps(-1.f));
  return _mm512_sub_ps(decayed, _mm512_mul_ps(step, sign));
}

// Block of n coordinates at p, g whose members sit at positions pos[0..count)
// (increasing) and keep their moments at m[0..count), v[0..count).
template <StateFree Mode>
void masked_block_avx512(float* __restrict__ p, const float* __restrict__ g, float* __restrict__ m,
                         float* __restrict__ v, const int32_t* __restrict__ pos, int64_t count,
                         int64_t n, const AdamWScalars& a, const SignScalars& sf) {
  constexpr int64_t kMaxBlock = 4096;
  alignas(64) uint8_t flags[kMaxBlock + 16];
  const int64_t n_words = (n + 15) / 16;
  std::memset(flags, 0, size_t(n_words * 16));
  for (int64_t i = 0; i < count; ++i) flags[pos[i]] = 1;

  const __m512 decay = _mm512_set1_ps(sf.decay), step = _mm512_set1_ps(sf.step);
  const __m512 adecay = _mm512_set1_ps(a.decay), omb1 = _mm512_set1_ps(a.one_minus_beta1);
  const __m512 beta2 = _mm512_set1_ps(a.beta2), omb2 = _mm512_set1_ps(a.one_minus_beta2);
  const __m512 bc2 = _mm512_set1_ps(a.bc2_sqrt), eps = _mm512_set1_ps(a.eps);
  const __m512 step_size = _mm512_set1_ps(a.step_size);
  // Read the moments from copies: the loop stores each vector's updated
  // moments with masked stores right before the next vector's loads of the
  // neighbouring floats, and a load the core cannot prove independent of a
  // pending masked store waits for it, serialising the vectors.
  alignas(64) float m_in[kMaxBlock], v_in[kMaxBlock];
  std::memcpy(m_in, m, sizeof(float) * size_t(count));
  std::memcpy(v_in, v, sizeof(float) * size_t(count));
  int64_t cursor = 0;
  for (int64_t w = 0; w < n_words; ++w) {
    const int64_t i = w * 16;
    const __mmask16 lanes = n - i >= 16 ? __mmask16(0xffff) : __mmask16((1u << (n - i)) - 1);
    const __m512 pv = _mm512_maskz_loadu_ps(lanes, p + i);
    const __m512 gv = _mm512_maskz_loadu_ps(lanes, g + i);
    __m512 out = state_free_lanes<Mode>(pv, gv, decay, step);
    const __mmask16 members = _mm_test_epi8_mask(
        _mm_load_si128(reinterpret_cast<const __m128i*>(flags + i)), _mm_set1_epi8(1));
    if (members) {
      const int count_here = __builtin_popcount(unsigned(members));
      const __mmask16 packed = __mmask16((1u << count_here) - 1);
      __m512 mv = _mm512_maskz_expand_ps(members, _mm512_maskz_loadu_ps(packed, m_in + cursor));
      __m512 vv = _mm512_maskz_expand_ps(members, _mm512_maskz_loadu_ps(packed, v_in + cursor));
      const __m512 g_adam = a.maximize ? _mm512_sub_ps(_mm512_setzero_ps(), gv) : gv;
      mv = _mm512_add_ps(mv, _mm512_mul_ps(omb1, _mm512_sub_ps(g_adam, mv)));
      vv = _mm512_add_ps(_mm512_mul_ps(vv, beta2), _mm512_mul_ps(omb2, _mm512_mul_ps(g_adam, g_adam)));
      const __m512 denom = _mm512_add_ps(_mm512_div_ps(_mm512_sqrt_ps(vv), bc2), eps);
      const __m512 adam = _mm512_sub_ps(_mm512_mul_ps(pv, adecay),
                                        _mm512_mul_ps(step_size, _mm512_div_ps(mv, denom)));
      out = _mm512_mask_mov_ps(out, members, adam);
      _mm512_mask_storeu_ps(m + cursor, packed, _mm512_maskz_compress_ps(members, mv));
      _mm512_mask_storeu_ps(v + cursor, packed, _mm512_maskz_compress_ps(members, vv));
      cursor += count_here;
    }
    _mm512_mask_storeu_ps(p + i, lanes, out);
  }
}

}  // namespace FK_CPU_ISA
}  // namespace cpu
}  // namespace frugal

#endif  // __AVX512F__
