// The 8-bit moments of AdamW, for the CPU and CUDA kernels: bit for bit the
// definitions of frugal_kernels/reference.py (quantize_moment, dequantize_moment),
// whose comment is the specification. A tensor is seen as rows ([shape[0], rest],
// one row for a 1-D tensor) cut into blocks of kMomentBlock elements that never
// straddle two rows; each block has one fp32 scale per moment: the first moment
// as signed linear codes (s = max|m| / 127), the second as unsigned linear codes
// of its fourth root (s = max v^(1/4) / 255), x * (1 / s) rounded half to even. A block's max
// is NaN once a NaN is in it (as torch's amax), and its codes are then 0.
#pragma once

#include <cmath>
#include <cstdint>

#include "frugal/common.h"
#include "frugal/update_rules.h"

namespace frugal {

constexpr int64_t kMomentBlock = 256;  // frugal_kernels._layout.MOMENT_BLOCK

// The 8-bit moments of one adamw_int8_ call, one entry per tensor of its batch:
// codes of the tensor's shape, scales [rows, ceil(cols / kMomentBlock)].
struct Moments8Batch {
  int8_t* const* exp_avgs;
  float* const* exp_avg_scales;
  uint8_t* const* exp_avg_sqs;
  float* const* exp_avg_sq_scales;
  const int64_t* rows;
  const int64_t* cols;
};

// x times `inverse` (1 / the block's scale, rounded to fp32 once), rounded half to
// even into [low, top]; 0 where the scale is not > 0 (a block of zeros, or of a
// NaN) or the product is NaN.
FK_HOST_DEVICE float moment_code(float x, float scale, float inverse, float low, float top) {
  if (!(scale > 0.f)) return 0.f;
  float q = rintf(x * inverse);
  q = q < low ? low : q;
  q = q > top ? top : q;
  return q == q ? q : 0.f;
}

FK_HOST_DEVICE float first_moment(int8_t code, float scale) { return float(code) * scale; }

FK_HOST_DEVICE float second_moment(uint8_t code, float scale) {
  const float t = float(code) * scale;
  const float u = t * t;
  return u * u;
}

}  // namespace frugal
