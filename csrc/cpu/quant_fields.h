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

// The fields (q + qmax) of the n codes whose packed bits start at `bytes`
// (a segment start, so on a byte boundary). Eight fields fill `bits` whole
// bytes; a short last group is read through a zero-padded copy, never past
// the row. Entries past n are unspecified.
inline void unpack_fields(const uint8_t* bytes, int bits, int64_t n, uint8_t* fields) {
  if (bits == 8) {
    std::memcpy(fields, bytes, size_t(n));
    return;
  }
  const uint64_t mask = (uint64_t(1) << bits) - 1;
  const int64_t full = n / 8;
  for (int64_t grp = 0; grp < full; ++grp) {
    uint64_t word = 0;
    std::memcpy(&word, bytes + grp * bits, size_t(bits));
    for (int j = 0; j < 8; ++j) fields[grp * 8 + j] = uint8_t((word >> (j * bits)) & mask);
  }
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
  const int64_t full = n / 8;
  for (int64_t grp = 0; grp < full; ++grp) {
    uint64_t word = 0;
    for (int j = 0; j < 8; ++j) word |= uint64_t(fields[grp * 8 + j]) << (j * bits);
    std::memcpy(bytes + grp * bits, &word, size_t(bits));
  }
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
