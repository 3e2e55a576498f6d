// The INT-n weight format of DQT and its counter-based random numbers, for the
// CPU and CUDA kernels: bit for bit the definitions of frugal_kernels/_quant.py,
// whose docstring is the specification (codes -qmax..qmax stored as the
// unsigned fields q + qmax of a little-endian bit stream per row; W = s * q in
// fp32; stochastic rounding with uniforms that are a pure function of
// (seed, step, element index)).
#pragma once

#include <cmath>
#include <cstdint>

#include "frugal/common.h"
#include "frugal/update_rules.h"

namespace frugal {

constexpr uint32_t kGolden = 0x9E3779B9u;

FK_HOST_DEVICE int quant_qmax(int bits) { return (1 << (bits - 1)) - 1; }

FK_HOST_DEVICE int64_t quant_packed_cols(int64_t cols, int bits) { return (cols * bits + 7) / 8; }

// The lowbias32 integer hash (constants from Chris Wellons' hash-prospector).
FK_HOST_DEVICE uint32_t mix32(uint32_t x) {
  x ^= x >> 16;
  x *= 0x7FEB352Du;
  x ^= x >> 15;
  x *= 0x846CA68Bu;
  x ^= x >> 16;
  return x;
}

// The key of one tensor at one step; every element's uniform derives from it.
FK_HOST_DEVICE uint32_t rng_key(uint32_t seed, uint32_t step) {
  return mix32(step + mix32(seed + kGolden));
}

// The uniform in [0, 1) of the element at unpacked position `index`: 24 bits,
// so that the float holds it exactly.
FK_HOST_DEVICE float rng_uniform(uint32_t key, uint32_t index) {
  return float(mix32(index + key) >> 8) * (1.0f / 16777216.0f);
}

// x (in units of the scale) to the unsigned field q + qmax of its code: up
// with probability x - floor(x), then clamped to the code range. A NaN goes
// to the code 0, as in the reference; +-inf clamp to +-qmax.
FK_HOST_DEVICE uint8_t round_to_field(float x, float u, int qmax) {
  const float f = floorf(x);
  float q = f + (u < x - f ? 1.f : 0.f);
  q = q < float(-qmax) ? float(-qmax) : q;
  q = q > float(qmax) ? float(qmax) : q;
  if (!(q == q)) q = 0.f;
  return uint8_t(int(q) + qmax);
}

// Hyper-parameters of one dqt_update_ call: the FRUGAL step applied to the
// dequantized weights (all rows state-full: AdamW; none: SignSGD), the code
// width, and the step of the random numbers (their counter, not Adam's).
struct DqtHyper {
  FrugalHyper frugal;
  int bits;
  uint32_t rng_step;
};

}  // namespace frugal
