// Portable building blocks shared by the CPU and CUDA kernels: the host/device
// qualifier, the storage types a parameter may have, and their conversions to
// and from fp32. Nothing here knows about torch.
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define FK_HOST_DEVICE __host__ __device__ __forceinline__
#define FK_DEVICE __device__ __forceinline__
#else
#define FK_HOST_DEVICE inline
#define FK_DEVICE inline
#endif

namespace frugal {

// Codes used across the binding; the Python side maps torch dtypes to these.
enum class DType : int { kFloat32 = 0, kBFloat16 = 1, kFloat16 = 2 };

// 16-bit storage types. They carry raw bits only: every update rule converts
// to fp32, does its math there and rounds back once, as torch does for
// reduced-precision parameters.
struct bf16 { uint16_t bits; };
struct fp16 { uint16_t bits; };

FK_HOST_DEVICE uint32_t float_bits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  return u;
#endif
}

FK_HOST_DEVICE float bits_float(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
#endif
}

FK_HOST_DEVICE float to_float(float x) { return x; }
FK_HOST_DEVICE float to_float(bf16 x) { return bits_float(uint32_t(x.bits) << 16); }

// IEEE binary16 -> binary32, exact for every input (subnormals, inf, nan).
FK_HOST_DEVICE float to_float(fp16 x) {
  const uint32_t h = x.bits;
  const uint32_t sign = (h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu;
  const uint32_t man = h & 0x3ffu;
  if (exp == 0x1fu) return bits_float(sign | 0x7f800000u | (man << 13));
  if (exp != 0) return bits_float(sign | ((exp + 112u) << 23) | (man << 13));
  // Subnormal (or zero): the value is man * 2^-24, which fp32 holds exactly.
  const float mag = float(man) * 5.9604644775390625e-08f;
  return sign ? -mag : mag;
}

// Run fn(T{}) with T the storage type of `dtype` (host code: kernel launches
// and CPU loops pick their template instance here).
template <typename Fn>
void dispatch_dtype(DType dtype, Fn&& fn) {
  switch (dtype) {
    case DType::kFloat32: fn(float{}); break;
    case DType::kBFloat16: fn(bf16{}); break;
    case DType::kFloat16: fn(fp16{}); break;
  }
}

template <typename T> FK_HOST_DEVICE T from_float(float x);

template <> FK_HOST_DEVICE float from_float<float>(float x) { return x; }

// Round to nearest even, NaN kept quiet: the same bits as torch's c10::BFloat16.
template <> FK_HOST_DEVICE bf16 from_float<bf16>(float x) {
  const uint32_t u = float_bits(x);
  if ((u & 0x7fffffffu) > 0x7f800000u) return bf16{uint16_t(0x7fc0u)};
  const uint32_t rounded = u + 0x7fffu + ((u >> 16) & 1u);
  return bf16{uint16_t(rounded >> 16)};
}

// Round to nearest even, with subnormals, overflow to inf and quiet NaN: the
// same bits as torch's c10::Half.
template <> FK_HOST_DEVICE fp16 from_float<fp16>(float x) {
  const uint32_t u = float_bits(x);
  const uint16_t sign = uint16_t((u >> 16) & 0x8000u);
  const uint32_t abs = u & 0x7fffffffu;
  if (abs > 0x7f800000u) return fp16{uint16_t(sign | 0x7e00u)};
  if (abs >= 0x477ff000u) return fp16{uint16_t(sign | 0x7c00u)};  // rounds to inf
  if (abs < 0x38800000u) {
    // Result is subnormal: adding 0.5 (2^-1) aligns the fp16 subnormal grid
    // (step 2^-24) with the last mantissa bit of fp32, so the fp32 addition
    // itself performs the round-to-nearest-even.
    const float shifted = bits_float(abs) + 0.5f;
    return fp16{uint16_t(sign | uint16_t(float_bits(shifted) - 0x3f000000u))};
  }
  const uint32_t odd = (abs >> 13) & 1u;
  const uint32_t rebiased = abs - (112u << 23) + 0xfffu + odd;
  return fp16{uint16_t(sign | uint16_t(rebiased >> 13))};
}

}  // namespace frugal
