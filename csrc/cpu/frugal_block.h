// The block walk of a FRUGAL step on the CPU, shared by frugal_step_ and
// dqt_update_ (which runs it on a dequantized row segment in an fp32 buffer).
//
// A block [a, b) of flat positions (at most kBlock long) is processed from
// L1: its state-full members (found with two binary searches, frugal_tile.h)
// get AdamW and the rest get the state-free rule; every coordinate of p and g
// is read once and p is written once. Included by the per-ISA kernel files.
#pragma once

#include <algorithm>
#include <cstring>
#include <vector>

#include "kernels.h"
#include "loops.h"
#include "parallel.h"

#if defined(__AVX512F__) || defined(__F16C__)
#include <immintrin.h>
#endif

namespace frugal {
namespace cpu {
namespace FK_CPU_ISA {

constexpr int64_t kBlock = 2048;

// One member's value as fp32, and its AdamW result rounded to T: to_float and
// from_float, but with F16C for fp16 (where there is F16C): the portable fp16
// conversions are exact but branchy, and a gathered fp16 block (columns, flat)
// spent half its time in them (1.66 against 0.79 ns per position in cache on
// one thread of a Zen 3). F16C gives the same values but for a NaN result,
// which takes from_float's quiet NaN as before.
inline float member_value(float x) { return x; }
inline float member_value(bf16 x) { return to_float(x); }
template <typename T>
inline T member_result(float x) { return from_float<T>(x); }
#if defined(__F16C__)
inline float member_value(fp16 x) { return _cvtsh_ss(x.bits); }
template <>
inline fp16 member_result<fp16>(float x) {
  if (x != x) return from_float<fp16>(x);
  return fp16{uint16_t(_cvtss_sh(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC))};
}
#else
inline float member_value(fp16 x) { return to_float(x); }
#endif

// Gathers and scatters of the gathered path stay scalar: on current x86
// cores vector gather and scatter instructions are slower than one load or
// store per element (and AVX2's permutes by a table, tried as compress and
// expand, cost more than the scalar moves at rho 0.25: an fp32 columns block
// 1.22x and a flat one 1.68x the time).
template <typename T>
FK_NOVECTOR inline void gather(const T* __restrict__ p, const T* __restrict__ g,
                        const int32_t* __restrict__ pos, int64_t n, float* __restrict__ bp,
                        float* __restrict__ bg) {
  for (int64_t i = 0; i < n; ++i) {
    bp[i] = member_value(p[pos[i]]);
    bg[i] = member_value(g[pos[i]]);
  }
}

template <typename T>
FK_NOVECTOR inline void scatter(T* __restrict__ p, const int32_t* __restrict__ pos, int64_t n,
                         const float* __restrict__ values) {
  for (int64_t i = 0; i < n; ++i) p[pos[i]] = member_result<T>(values[i]);
}

// The member lanes of a block: bit i of word w says whether position 16 w + i
// of the block is state-full. Read by the AVX-512 blocks only.
constexpr int64_t kLanes = 16;

// Bit c of a bitmap (64-bit words, one spare word at the end) and the 16 from c.
inline uint32_t bits16(const uint64_t* bitmap, int64_t c) {
  const int64_t w = c >> 6, off = c & 63;
  const uint64_t v = off ? (bitmap[w] >> off) | (bitmap[w + 1] << (64 - off)) : bitmap[w];
  return uint32_t(v & 0xffffu);
}

// The member lanes of the block [a, a + len) of a [R, C] tensor whose member
// columns are the bits of `columns`.
inline void column_lanes(const uint64_t* columns, int64_t C, int64_t a, int64_t len,
                         uint16_t* lanes) {
  int64_t c = a % C;
  for (int64_t w = 0; w * kLanes < len; ++w) {
    uint32_t word = 0;
    for (int64_t filled = 0; filled < kLanes;) {
      const int64_t take = std::min(kLanes - filled, C - c);
      word |= (bits16(columns, c) & ((1u << take) - 1)) << filled;
      filled += take;
      c += take;
      if (c == C) c = 0;
    }
    lanes[w] = uint16_t(word);
  }
}

// The member lanes of the blocks of a [R, C] tensor whose member columns are
// idx[0..k), built once per tensor (every row has the same members). When C is
// a multiple of 16, the 16 lanes from any position that is one too are a
// 16-bit word of the row's bitmap, so the lanes of such a block are a window
// of the row's words repeated, with no work per block; shifting them out of
// the bitmap per block took 20% of a columns step in fp32.
class ColumnLanes {
 public:
  ColumnLanes() = default;
  template <typename Index>
  ColumnLanes(const Index* idx, int64_t k, int64_t C) : C_(C), bitmap_(size_t(C / 64 + 2), 0) {
    for (int64_t j = 0; j < k; ++j) bitmap_[size_t(idx[j] >> 6)] |= uint64_t(1) << (idx[j] & 63);
    if (C % kLanes != 0) return;
    const int64_t row_words = C / kLanes;
    words_.resize(size_t(row_words + kBlock / kLanes));
    for (size_t i = 0; i < words_.size(); ++i) {
      words_[i] = uint16_t(bits16(bitmap_.data(), int64_t(i) % row_words * kLanes));
    }
  }

  // The lanes of the block [a, a + len) (len <= kBlock): a window of the
  // table, or `scratch` filled.
  const uint16_t* operator()(int64_t a, int64_t len, uint16_t* scratch) const {
    const int64_t c = a % C_;
    if (!words_.empty() && c % kLanes == 0) return words_.data() + c / kLanes;
    column_lanes(bitmap_.data(), C_, a, len, scratch);
    return scratch;
  }

 private:
  int64_t C_ = 1;
  std::vector<uint64_t> bitmap_;  // one spare word at the end, for bits16
  std::vector<uint16_t> words_;   // C % 16 == 0: the row's words, then kBlock / 16 more
};

#if defined(__AVX512F__)
// With AVX-512 the members of a block move by compress and expand under a
// lane mask, 16 lanes at a time, instead of one scalar load or store each:
// the compact moments and the AdamW buffers are in member order, which is the
// order compress and expand pack lanes in. The masks come from the member
// columns (ColumnLanes) or straight from the flat ids, so no member costs more
// than a bit.
inline __mmask16 head_lanes(int64_t left) {
  return left >= kLanes ? __mmask16(0xffff) : __mmask16((1u << left) - 1);
}

// The member lanes of a block [a, a + len) from the ids of its n flat members:
// a byte per position first, then 64 bytes to 64 bits with one test. Or-ing
// each member's bit into a word in memory instead chains the members of a
// word through store-to-load forwarding (9 cycles per member at density 1),
// and building words in a register mispredicts a branch per word.
template <typename Index>
inline void flat_lanes(const Index* ids, int64_t n, int64_t a, int64_t len, uint16_t* lanes) {
  alignas(64) uint8_t member[kBlock];
  const int64_t padded = (len + 63) & ~int64_t(63);
  std::memset(member, 0, size_t(padded));
  for (int64_t i = 0; i < n; ++i) member[int64_t(ids[i]) - a] = 1;
  for (int64_t x = 0; x < padded; x += 64) {
    const __m512i bytes = _mm512_load_si512(static_cast<const void*>(member + x));
    const uint64_t bits = _mm512_test_epi8_mask(bytes, bytes);
    std::memcpy(lanes + x / kLanes, &bits, std::min<int64_t>(8, (len - x + 15) / kLanes * 2));
  }
}

// 16 values of storage type T from p (the first `valid` of them), as fp32:
// the values to_float gives (fp16 through F16C, as loops.h converts it).
inline __m512 load_lanes(const float* p, __mmask16 valid) { return _mm512_maskz_loadu_ps(valid, p); }
inline __m512 load_lanes(const bf16* p, __mmask16 valid) {
  const __m256i h = _mm256_maskz_loadu_epi16(valid, p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
inline __m512 load_lanes(const fp16* p, __mmask16 valid) {
  return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(valid, p));
}

// from_float<bf16> on 16 lanes, the bits in the low half of 32-bit lanes:
// round to nearest even, NaN to 0x7fc0.
inline __m512i bf16_lanes(__m512 x) {
  const __m512i u = _mm512_castps_si512(x);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  const __m512i rounded = _mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), odd);
  const __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
  return _mm512_mask_mov_epi32(_mm512_srli_epi32(rounded, 16), nan, _mm512_set1_epi32(0x7fc0));
}

// The two fp16 roundings of the scalar code, on 16 lanes. Both are F16C's
// round to nearest even, which equals from_float<fp16> on every non-NaN value
// (tests/ops/test_half_conversion.py); they differ in the NaN they give:
// F16C keeps the payload (the state-free loops of loops.h convert so), while
// from_float<fp16> gives sign | 0x7e00 (the AdamW results of a gathered
// block have always been rounded so).
inline __m256i f16c_bits(__m512 x) {
  return _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}
inline __m256i fp16_bits(__m512 x) {
  const __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
  const __m512i sign = _mm512_and_si512(_mm512_srli_epi32(_mm512_castps_si512(x), 16),
                                        _mm512_set1_epi32(0x8000));
  const __m256i quiet = _mm512_cvtepi32_epi16(_mm512_or_si512(sign, _mm512_set1_epi32(0x7e00)));
  return _mm256_mask_blend_epi16(nan, f16c_bits(x), quiet);
}

// The low halves of 16 32-bit lanes into the `lanes` of p. Kept apart from the
// store: the compiler folds them into a masked vpmovdw to memory, microcoded on
// Intel cores and the hottest instruction of a bf16 block in a profile on Zen 4.
template <typename T>
inline void narrow_store(T* p, __mmask16 lanes, __m512i x) {
  __m256i narrow = _mm512_cvtepi32_epi16(x);
  asm("" : "+v"(narrow));
  _mm256_mask_storeu_epi16(p, lanes, narrow);
}

// The `lanes` of x into p, rounded as the state-free loops round (F16C for fp16).
inline void store_state_free(float* p, __mmask16 lanes, __m512 x) { _mm512_mask_storeu_ps(p, lanes, x); }
inline void store_state_free(bf16* p, __mmask16 lanes, __m512 x) {
  narrow_store(p, lanes, bf16_lanes(x));
}
inline void store_state_free(fp16* p, __mmask16 lanes, __m512 x) {
  _mm256_mask_storeu_epi16(p, lanes, f16c_bits(x));
}

// 16 AdamW results as the bits from_float<T> gives them, in 32-bit lanes.
inline __m512i adamw_lanes(__m512 x, bf16) { return bf16_lanes(x); }
inline __m512i adamw_lanes(__m512 x, fp16) { return _mm512_cvtepu16_epi32(fp16_bits(x)); }

// state_free_update<Mode> (update_rules.h) on 16 lanes: the same operations
// in the same order, so the same bits.
template <StateFree Mode>
inline __m512 state_free_lanes(__m512 p, __m512 g, const SignScalars& s) {
  g = _mm512_mul_ps(g, _mm512_set1_ps(s.inv_grad_scale));
  p = _mm512_mul_ps(p, _mm512_set1_ps(s.decay));
  if constexpr (Mode == StateFree::kSign) {
    const __m512 zero = _mm512_setzero_ps();
    const __mmask16 positive = _mm512_cmp_ps_mask(g, zero, _CMP_GT_OQ);
    const __mmask16 negative = _mm512_cmp_ps_mask(g, zero, _CMP_LT_OQ);
    const __m512 sign = _mm512_mask_blend_ps(
        positive, _mm512_mask_blend_ps(negative, zero, _mm512_set1_ps(-1.f)), _mm512_set1_ps(1.f));
    return _mm512_sub_ps(p, _mm512_mul_ps(_mm512_set1_ps(s.step), sign));
  } else if constexpr (Mode == StateFree::kSgd) {
    return _mm512_sub_ps(p, _mm512_mul_ps(_mm512_set1_ps(s.step), g));
  } else {
    return p;
  }
}

// The cache line a block further on than x, into L2. This pass is a block's
// only touch of memory (the AdamW and merge passes work in L1), so without it
// the loads of a block wait while the previous one computes; one block ahead
// into L1 evicted the block in use and was slower. Prefetches never fault, so
// past the end of a tensor one is only a wasted request (hence the address
// arithmetic on integers).
template <typename T>
inline void prefetch_next_block(const T* x) {
  _mm_prefetch(reinterpret_cast<const char*>(reinterpret_cast<uintptr_t>(x) + kBlock * sizeof(T)),
               _MM_HINT_T1);
}

// One pass over the block that reads p and g once from memory: the member
// values go to bp and bg in member order (fp32; each buffer has kLanes spare
// entries for the last full-width store) and the others get the state-free
// rule. One pass where there were two (a compress, then the state-free loop
// over the whole block, which also computed the members' state-free values
// only for the expand to overwrite them).
template <typename T, StateFree Mode>
inline void split(T* p, const T* g, const uint16_t* lanes, int64_t len, const SignScalars& s,
                  float* bp, float* bg) {
  for (int64_t a = 0; a < len; a += kLanes) {
    const __mmask16 valid = head_lanes(len - a);
    const __mmask16 members = __mmask16(lanes[a / kLanes]) & valid;
    if (a % (64 / int64_t(sizeof(T))) == 0) {
      prefetch_next_block(p + a);
      prefetch_next_block(g + a);
    }
    const __m512 vp = load_lanes(p + a, valid);
    const __m512 vg = load_lanes(g + a, valid);
    _mm512_storeu_ps(bp, _mm512_maskz_compress_ps(members, vp));
    _mm512_storeu_ps(bg, _mm512_maskz_compress_ps(members, vg));
    const int count = __builtin_popcount(unsigned(members));
    bp += count;
    bg += count;
    store_state_free(p + a, __mmask16(valid & ~members), state_free_lanes<Mode>(vp, vg, s));
  }
}

// Compress and expand act on registers, with plain full-width stores and
// loads: their memory forms are microcoded on Intel cores, and the folded
// vexpandps was the hottest instruction of the merge in a profile on Zen 4.
// The compiler folds a load into the expand unless it is kept apart.
inline __m512i packed_lanes(const void* src) {
  __m512i packed = _mm512_loadu_si512(src);
  asm("" : "+v"(packed));
  return packed;
}

// The AdamW results of bp (member order) over the member positions of p.
inline void merge(float* p, const uint16_t* lanes, int64_t len, int64_t, float* bp) {
  for (int64_t a = 0; a < len; a += kLanes) {
    const __mmask16 members = __mmask16(lanes[a / kLanes]) & head_lanes(len - a);
    _mm512_mask_storeu_ps(p + a, members,
                          _mm512_maskz_expand_ps(members, _mm512_castsi512_ps(packed_lanes(bp))));
    bp += __builtin_popcount(unsigned(members));
  }
}

// 16-bit storage: the n results are rounded to T in place first (n / 16
// conversions instead of one per 16 positions), then expanded as 32-bit lanes
// and narrowed on the store.
template <typename T>
inline void merge(T* p, const uint16_t* lanes, int64_t len, int64_t n, float* bp) {
  for (int64_t i = 0; i < n; i += kLanes) {
    _mm512_storeu_si512(bp + i, adamw_lanes(_mm512_loadu_ps(bp + i), T{}));
  }
  for (int64_t a = 0; a < len; a += kLanes) {
    const __mmask16 members = __mmask16(lanes[a / kLanes]) & head_lanes(len - a);
    narrow_store(p + a, members, _mm512_maskz_expand_epi32(members, packed_lanes(bp)));
    bp += __builtin_popcount(unsigned(members));
  }
}
#endif

template <typename T, typename Index, StateFree Mode>
struct Block {
  T* p;
  const T* g;
  float* m;
  float* v;
  const Index* idx;
  SubsetShape shape;
  FrugalScalars s;
  const ColumnLanes* columns;  // kColumns with AVX-512, else null
  // The flat position that p[0] and g[0] hold: 0 when they are the whole
  // tensor, the segment's first position when they are buffers of a segment.
  int64_t origin = 0;

  T* p_at(int64_t x) const { return p + (x - origin); }
  const T* g_at(int64_t x) const { return g + (x - origin); }

  // Process [a, b); returns where the next block's search should start.
  int64_t operator()(int64_t a, int64_t b, int64_t guess) const {
    const TileMembers tm = tile_members(shape, idx, a, b, guess);
    if (tm.q_begin == tm.q_end) {
      state_free_range<T, Mode>(p_at(a), g_at(a), b - a, s.state_free);
    } else if (shape.kind == SubsetKind::kRows && shape.cols > 1) {
      rows_in_place(tm, a, b);
    } else {
      gathered(tm, a, b);
    }
    // The next block's first member row is at or after this block's.
    return tm.outer_base;
  }

  // Member rows are contiguous runs of p and of the state: alternate the two
  // rules over the block without any gather.
  void rows_in_place(const TileMembers& tm, int64_t a, int64_t b) const {
    const int64_t C = shape.cols;
    int64_t cursor = a;
    for (int64_t q = tm.q_begin; q < tm.q_end;) {
      const int64_t outer = q / C;
      const int64_t c = q - outer * C;
      const int64_t run = std::min(tm.q_end, (outer + 1) * C) - q;
      const int64_t j = tm.outer_base + outer;
      const int64_t pos = int64_t(idx[j]) * C + c;
      state_free_range<T, Mode>(p_at(cursor), g_at(cursor), pos - cursor, s.state_free);
      adamw_range(p_at(pos), g_at(pos), m + j * C + c, v + j * C + c, run, s.adamw);
      cursor = pos + run;
      q += run;
    }
    state_free_range<T, Mode>(p_at(cursor), g_at(cursor), b - cursor, s.state_free);
  }

  // Members scattered over the block (columns, flat coordinates): AdamW them
  // in fp32 buffers, run the state-free rule over the whole block, then store
  // the AdamW results over it. All passes but the first touch only L1.
  void gathered(const TileMembers& tm, int64_t a, int64_t b) const {
    const int64_t n = tm.q_end - tm.q_begin;
    const int64_t slot = tm.slot_base + tm.q_begin;
#if defined(__AVX512F__)
    float bp[kBlock + kLanes], bg[kBlock + kLanes];
    uint16_t scratch[kBlock / kLanes];
    const uint16_t* lanes = scratch;
    if (shape.kind == SubsetKind::kColumns) {
      lanes = (*columns)(a, b - a, scratch);
    } else {
      flat_lanes(idx + tm.outer_base + tm.q_begin, n, a, b - a, scratch);
    }
    split<T, Mode>(p_at(a), g_at(a), lanes, b - a, s.state_free, bp, bg);
    adamw_range(bp, bg, m + slot, v + slot, n, s.adamw);
    merge(p_at(a), lanes, b - a, n, bp);
#else
    int32_t pos[kBlock];
    float bp[kBlock], bg[kBlock];
    member_positions(tm, a, pos);
    gather(p_at(a), g_at(a), pos, n, bp, bg);
    adamw_range(bp, bg, m + slot, v + slot, n, s.adamw);
    state_free_range<T, Mode>(p_at(a), g_at(a), b - a, s.state_free);
    scatter(p_at(a), pos, n, bp);
#endif
  }

  // Positions, relative to a, of the members of a gathered block (columns, or
  // rows of length 1), in member order.
  void member_positions(const TileMembers& tm, int64_t a, int32_t* pos) const {
    if (shape.kind == SubsetKind::kRows) {
      const Index* ids = idx + tm.outer_base + tm.q_begin;
      for (int64_t i = 0; i < tm.q_end - tm.q_begin; ++i) pos[i] = int32_t(int64_t(ids[i]) - a);
      return;
    }
    const int64_t k = shape.k;
    for (int64_t q = tm.q_begin; q < tm.q_end;) {
      const int64_t outer = q / k;
      const int64_t j = q - outer * k;
      const int64_t run = std::min(tm.q_end, (outer + 1) * k) - q;
      const int64_t base = (tm.outer_base + outer) * shape.cols - a;
      for (int64_t i = 0; i < run; ++i) pos[i] = int32_t(base + int64_t(idx[j + i]));
      pos += run;
      q += run;
    }
  }
};

}  // namespace FK_CPU_ISA
}  // namespace cpu
}  // namespace frugal
