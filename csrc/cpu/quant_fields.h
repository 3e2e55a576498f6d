// The packed INT-n codes of frugal/quant.h read and written on the CPU, a
// segment of one row at a time: shared by dqt_update_ (unpack, update, pack)
// and dequantize (unpack to floats).
#pragma once

#include <cstdint>
#include <cstring>

#include "frugal_block.h"

#if !defined(__BYTE_ORDER__) || __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "the packed codes are read as little-endian words"
#endif

namespace frugal {
namespace cpu {
namespace FK_CPU_ISA {

// Room for one segment's fields, rounded up to whole groups of eight.
constexpr int64_t kFieldRoom = kBlock + 8;

// Widths that fill whole bytes (2 and 4 bits), a byte at a time: loops the
// compiler vectorises, where the 64-bit word of the general path stays scalar
// (a 4-bit dqt_update_ spent two thirds of its time there: 46 ms against 14 ms
// at 8 bits for 4M weights on one thread of this Xeon).
template <int Bits>
inline void unpack_bytes(const uint8_t* __restrict__ bytes, int64_t n,
                         uint8_t* __restrict__ fields) {
  constexpr int per = 8 / Bits;
  constexpr unsigned mask = (1u << Bits) - 1;
  const int64_t whole = n / per;
  for (int64_t j = 0; j < whole; ++j) {
    const unsigned b = bytes[j];
    for (int f = 0; f < per; ++f) fields[j * per + f] = uint8_t((b >> (f * Bits)) & mask);
  }
  for (int64_t c = whole * per; c < n; ++c) {
    fields[c] = uint8_t((unsigned(bytes[whole]) >> ((c - whole * per) * Bits)) & mask);
  }
}

template <int Bits>
inline void pack_bytes(const uint8_t* __restrict__ fields, int64_t n, uint8_t* __restrict__ bytes) {
  constexpr int per = 8 / Bits;
  const int64_t whole = n / per;
  for (int64_t j = 0; j < whole; ++j) {
    unsigned b = 0;
    for (int f = 0; f < per; ++f) b |= unsigned(fields[j * per + f]) << (f * Bits);
    bytes[j] = uint8_t(b);
  }
  if (n % per != 0) {
    unsigned b = 0;  // the padding bits of a row's last byte stay zero
    for (int64_t c = whole * per; c < n; ++c) b |= unsigned(fields[c]) << ((c - whole * per) * Bits);
    bytes[whole] = uint8_t(b);
  }
}

// 3 bits: eight fields in three bytes, with the width a constant so that the
// shifts unroll (the general path's run-time width kept them in a loop).
inline void unpack_3(const uint8_t* __restrict__ bytes, int64_t groups, uint8_t* __restrict__ fields) {
  for (int64_t g = 0; g < groups; ++g) {
    const uint32_t w = uint32_t(bytes[3 * g]) | uint32_t(bytes[3 * g + 1]) << 8 |
                       uint32_t(bytes[3 * g + 2]) << 16;
    for (int f = 0; f < 8; ++f) fields[8 * g + f] = uint8_t((w >> (3 * f)) & 7u);
  }
}

inline void pack_3(const uint8_t* __restrict__ fields, int64_t groups, uint8_t* __restrict__ bytes) {
  for (int64_t g = 0; g < groups; ++g) {
    uint32_t w = 0;
    for (int f = 0; f < 8; ++f) w |= uint32_t(fields[8 * g + f]) << (3 * f);
    bytes[3 * g] = uint8_t(w);
    bytes[3 * g + 1] = uint8_t(w >> 8);
    bytes[3 * g + 2] = uint8_t(w >> 16);
  }
}

// The fields (q + qmax) of the n codes whose packed bits start at `bytes`
// (a segment start, so on a byte boundary). Eight fields fill `bits` whole
// bytes; a short last group is read through a zero-padded copy, never past
// the row. Entries past n are unspecified.
inline void unpack_fields(const uint8_t* bytes, int bits, int64_t n, uint8_t* fields) {
  if (bits == 8) {
    std::memcpy(fields, bytes, size_t(n));
    return;
  }
  if (bits == 4) return unpack_bytes<4>(bytes, n, fields);
  if (bits == 2) return unpack_bytes<2>(bytes, n, fields);
  const uint64_t mask = (uint64_t(1) << bits) - 1;
  const int64_t full = n / 8;
  unpack_3(bytes, full, fields);  // 3 is the one width left
  if (n % 8 != 0) {
    uint64_t word = 0;
    std::memcpy(&word, bytes + full * bits, size_t(((n % 8) * bits + 7) / 8));
    for (int j = 0; j < 8; ++j) fields[full * 8 + j] = uint8_t((word >> (j * bits)) & mask);
  }
}

// The inverse: the n fields into their packed bytes, the padding bits after
// the last field zero (they are the end of a row when n is not a whole group).
inline void pack_fields(const uint8_t* fields, int bits, int64_t n, uint8_t* bytes) {
  if (bits == 8) {
    std::memcpy(bytes, fields, size_t(n));
    return;
  }
  if (bits == 4) return pack_bytes<4>(fields, n, bytes);
  if (bits == 2) return pack_bytes<2>(fields, n, bytes);
  const int64_t full = n / 8;
  pack_3(fields, full, bytes);  // 3 is the one width left
  if (n % 8 != 0) {
    uint64_t word = 0;
    for (int j = 0; j < n % 8; ++j) word |= uint64_t(fields[full * 8 + j]) << (j * bits);
    std::memcpy(bytes + full * bits, &word, size_t(((n % 8) * bits + 7) / 8));
  }
}

inline void dequantize_fields(const uint8_t* fields, int64_t n, int qmax, float scale, float* w) {
  for (int64_t i = 0; i < n; ++i) w[i] = scale * float(int(fields[i]) - qmax);
}

}  // namespace FK_CPU_ISA
}  // namespace cpu
}  // namespace frugal
