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

#include "kernels.h"
#include "loops.h"
#include "parallel.h"

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace frugal {
namespace cpu {
namespace FK_CPU_ISA {

constexpr int64_t kBlock = 2048;

// Gathers and scatters of the gathered path stay scalar: on current x86
// cores vector gather and scatter instructions are slower than one load or
// store per element.
template <typename T>
FK_NOVECTOR inline void gather(const T* __restrict__ p, const T* __restrict__ g,
                        const int32_t* __restrict__ pos, int64_t n, float* __restrict__ bp,
                        float* __restrict__ bg) {
  for (int64_t i = 0; i < n; ++i) {
    bp[i] = to_float(p[pos[i]]);
    bg[i] = to_float(g[pos[i]]);
  }
}

template <typename T>
FK_NOVECTOR inline void scatter(T* __restrict__ p, const int32_t* __restrict__ pos, int64_t n,
                         const float* __restrict__ values) {
  for (int64_t i = 0; i < n; ++i) p[pos[i]] = from_float<T>(values[i]);
}

#if defined(__AVX512F__)
// With AVX-512 the members of a block move by compress and expand under a
// lane mask, 16 lanes at a time, instead of one scalar load or store each:
// the compact moments and the AdamW buffers are in member order, which is the
// order compress and expand pack lanes in. The masks come from a bitmap of the
// member columns (built once per chunk: every row has the same members) or
// straight from the flat ids, so no member costs more than a bit. Compress
// and expand act on registers, with plain full-width stores and loads: their
// memory forms are microcoded and slow on Intel cores.
constexpr int64_t kLanes = 16;

inline __mmask16 head_lanes(int64_t left) {
  return left >= kLanes ? __mmask16(0xffff) : __mmask16((1u << left) - 1);
}

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

// 16 values of storage type T from p (the first `valid` of them), as fp32.
inline __m512 load_lanes(const float* p, __mmask16 valid) { return _mm512_maskz_loadu_ps(valid, p); }
inline __m512 load_lanes(const bf16* p, __mmask16 valid) {
  const __m256i h = _mm256_maskz_loadu_epi16(valid, p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
inline __m512 load_lanes(const fp16* p, __mmask16 valid) {
  return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(valid, p));
}

// The member values of p and g, in member order, into bp and bg (fp32; each
// buffer has kLanes spare entries for the last full-width store).
template <typename T>
inline void compress(const T* p, const T* g, const uint16_t* lanes, int64_t len, float* bp, float* bg) {
  for (int64_t a = 0; a < len; a += kLanes) {
    const __mmask16 valid = head_lanes(len - a);
    const __mmask16 members = __mmask16(lanes[a / kLanes]) & valid;
    _mm512_storeu_ps(bp, _mm512_maskz_compress_ps(members, load_lanes(p + a, valid)));
    _mm512_storeu_ps(bg, _mm512_maskz_compress_ps(members, load_lanes(g + a, valid)));
    const int count = __builtin_popcount(unsigned(members));
    bp += count;
    bg += count;
  }
}

// The AdamW results of bp (member order) over the member positions of p.
inline void expand(float* p, const uint16_t* lanes, int64_t len, int64_t, const float* bp) {
  for (int64_t a = 0; a < len; a += kLanes) {
    const __mmask16 members = __mmask16(lanes[a / kLanes]) & head_lanes(len - a);
    _mm512_mask_storeu_ps(p + a, members, _mm512_maskz_expand_ps(members, _mm512_loadu_ps(bp)));
    bp += __builtin_popcount(unsigned(members));
  }
}

// 16-bit storage: the n results are rounded to T first (a contiguous loop that
// vectorises), then expanded as 32-bit lanes and narrowed on the store.
template <typename T>
inline void expand(T* p, const uint16_t* lanes, int64_t len, int64_t n, const float* bp) {
  uint32_t bits[kBlock + kLanes];
  for (int64_t i = 0; i < n; ++i) bits[i] = from_float<T>(bp[i]).bits;
  const uint32_t* src = bits;
  for (int64_t a = 0; a < len; a += kLanes) {
    const __mmask16 members = __mmask16(lanes[a / kLanes]) & head_lanes(len - a);
    const __m512i wide = _mm512_maskz_expand_epi32(
        members, _mm512_loadu_si512(static_cast<const void*>(src)));
    _mm256_mask_storeu_epi16(p + a, members, _mm512_cvtepi32_epi16(wide));
    src += __builtin_popcount(unsigned(members));
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
  const uint64_t* columns;  // bitmap of the member columns (kColumns with AVX-512), else null
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
    uint16_t lanes[kBlock / kLanes];
    if (shape.kind == SubsetKind::kColumns) {
      column_lanes(columns, shape.cols, a, b - a, lanes);
    } else {
      flat_lanes(idx + tm.outer_base + tm.q_begin, n, a, b - a, lanes);
    }
    compress(p_at(a), g_at(a), lanes, b - a, bp, bg);
    adamw_range(bp, bg, m + slot, v + slot, n, s.adamw);
    state_free_range<T, Mode>(p_at(a), g_at(a), b - a, s.state_free);
    expand(p_at(a), lanes, b - a, n, bp);
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
