// Which coordinates of a tile of a tensor are state-full in a FRUGAL step, and
// where their compact AdamW state lives. Shared by the CPU and CUDA kernels
// (and mirrored by the Triton kernel) so that all of them walk the same sets.
//
// A projected tensor is viewed as a matrix [R, C] in row-major order. The
// state-full set is a sorted list `idx` of k unique ids:
//   kRows:    rows idx[0..k) are state-full; the state is [k, C] and
//             coordinate (idx[j], c) keeps its moments at j * C + c.
//             A flat coordinate list is kRows with C = 1.
//   kColumns: columns idx[0..k) are state-full; the state is [R, k] and
//             coordinate (r, idx[j]) keeps its moments at r * k + j.
//
// In both kinds the state-full coordinates of a tile [a, b) of flat positions
// form one range of a two-level enumeration q = outer * inner_len + inner:
//   kRows:    outer = member row j - lo, inner = column c        (inner_len C)
//   kColumns: outer = tile row r - r0,  inner = member column j  (inner_len k)
// In both, increasing q means increasing position, and member q keeps its
// state at slot_base + q: a tile's state is one contiguous range. A tile thus
// needs two binary searches to know all its members and where their state is.
#pragma once

#include <cstdint>

#include "frugal/common.h"

namespace frugal {

enum class SubsetKind : int { kRows = 0, kColumns = 1 };

// First j in [lo, hi) with idx[j] >= key (hi if none).
template <typename Index>
FK_HOST_DEVICE int64_t lower_bound(const Index* idx, int64_t lo, int64_t hi, int64_t key) {
  while (lo < hi) {
    const int64_t mid = (lo + hi) >> 1;
    if (int64_t(idx[mid]) < key) lo = mid + 1; else hi = mid;
  }
  return lo;
}

template <typename Index>
FK_HOST_DEVICE int64_t lower_bound(const Index* idx, int64_t n, int64_t key) {
  return lower_bound(idx, int64_t(0), n, key);
}

// lower_bound(idx, n, key) found by galloping out from `guess`: it touches
// O(log distance) entries next to the guess instead of O(log n) entries spread
// over the whole list, which matters when the list is far larger than cache
// and the guess is good (as when a thread walks a tensor in order).
template <typename Index>
FK_HOST_DEVICE int64_t lower_bound_near(const Index* idx, int64_t n, int64_t key, int64_t guess) {
  if (n == 0) return 0;
  guess = guess < 0 ? 0 : (guess >= n ? n - 1 : guess);
  int64_t step = 1;
  if (int64_t(idx[guess]) < key) {
    int64_t lo = guess + 1;
    while (lo + step - 1 < n && int64_t(idx[lo + step - 1]) < key) {
      lo += step;
      step <<= 1;
    }
    const int64_t hi = lo + step - 1 < n ? lo + step - 1 : n;
    return lower_bound(idx, lo, hi, key);
  }
  int64_t hi = guess;
  while (hi - step >= 0 && int64_t(idx[hi - step]) >= key) {
    hi -= step;
    step <<= 1;
  }
  const int64_t lo = hi - step + 1 > 0 ? hi - step + 1 : 0;
  return lower_bound(idx, lo, hi, key);
}

struct SubsetShape {
  SubsetKind kind;
  int64_t rows;  // R
  int64_t cols;  // C
  int64_t k;     // number of state-full rows (kRows) or columns (kColumns)
};

struct TileMembers {
  int64_t q_begin;    // first member, in the two-level enumeration
  int64_t q_end;      // one past the last member
  int64_t inner_len;  // C for kRows, k for kColumns
  int64_t outer_base; // lo (first member row's index in idx) or r0 (first tile row)
  int64_t slot_base;  // lo * C or r0 * k
};

// Members of the tile [a, b) of flat positions, 0 <= a < b <= R * C. For
// kRows, `guess` is where in idx the search for the tile's first member row
// starts (any value is correct; a close one is fast).
template <typename Index>
FK_HOST_DEVICE TileMembers tile_members(const SubsetShape& s, const Index* idx, int64_t a, int64_t b,
                                        int64_t guess) {
  const int64_t C = s.cols;
  const int64_t r0 = a / C;
  const int64_t r1 = (b - 1) / C;
  TileMembers t;
  if (s.kind == SubsetKind::kRows) {
    const int64_t lo = lower_bound_near(idx, s.k, r0, guess);
    const int64_t hi = lower_bound_near(idx, s.k, r1 + 1, lo);
    t.inner_len = C;
    t.outer_base = lo;
    t.slot_base = lo * C;
    if (lo == hi) {
      t.q_begin = t.q_end = 0;
      return t;
    }
    // Only the tile's first and last rows can be cut by the tile bounds.
    const int64_t head_cut = int64_t(idx[lo]) == r0 ? a - r0 * C : 0;
    const int64_t tail_cut = int64_t(idx[hi - 1]) == r1 ? (r1 + 1) * C - b : 0;
    t.q_begin = head_cut;
    t.q_end = (hi - lo) * C - tail_cut;
    return t;
  }
  const int64_t k = s.k;
  t.inner_len = k;
  t.outer_base = r0;
  t.slot_base = r0 * k;
  if (k == 0) {
    t.q_begin = t.q_end = 0;
    return t;
  }
  t.q_begin = lower_bound(idx, k, a - r0 * C);
  t.q_end = (r1 - r0) * k + lower_bound(idx, k, b - r1 * C);
  return t;
}

// Where a uniformly spread subset would have its first member row at or after
// row r: a good `guess` for tile_members when nothing better is known.
FK_HOST_DEVICE int64_t uniform_guess(const SubsetShape& s, int64_t r) {
  return s.rows > 0 ? int64_t(double(s.k) * double(r) / double(s.rows)) : 0;
}

// Flat position of the member q = outer * t.inner_len + inner of a tile. Split
// out of member_at for walks that step (outer, inner) without dividing.
template <typename Index>
FK_HOST_DEVICE int64_t member_position(const SubsetShape& s, const Index* idx, const TileMembers& t,
                                       int64_t outer, int64_t inner) {
  if (s.kind == SubsetKind::kRows) return int64_t(idx[t.outer_base + outer]) * s.cols + inner;
  return (t.outer_base + outer) * s.cols + int64_t(idx[inner]);
}

// Flat position and state slot of member q of a tile.
template <typename Index>
FK_HOST_DEVICE void member_at(const SubsetShape& s, const Index* idx, const TileMembers& t,
                              int64_t q, int64_t& position, int64_t& slot) {
  const int64_t outer = q / t.inner_len;
  position = member_position(s, idx, t, outer, q - outer * t.inner_len);
  slot = t.slot_base + q;
}

}  // namespace frugal
