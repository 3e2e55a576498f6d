// What the block bodies of the CUDA kernels share: how a thread's elements of
// a range are laid out, their loads and stores (16-byte vectors where the
// pointers allow), and hyper-parameters read on the device. Plain C++ with
// FK_HOST_DEVICE functions: the kernels and the host emulator both run it.
#pragma once

#include <cstdint>
#include <cstring>
#if !defined(__CUDA_ARCH__)
#include <stdexcept>
#endif

#include "frugal/common.h"
#include "frugal/update_rules.h"
#include "kernels.h"

namespace frugal {
namespace cuda {

// Elements a thread handles per round. All of a round's loads are issued
// before any math, so a thread keeps up to 128 bytes in flight (fp32 p, g, m,
// v); at 1024 threads per SM that is about 17 MB on a 132-SM H100/H200,
// several times what its bandwidth times its memory latency asks for.
constexpr int kIlp = 8;

// The kIlp elements a thread handles in one round of a range of n elements:
// element j is at offset + j * stride (j < count). Aligned ranges give each
// thread kIlp consecutive elements, moved as 16-byte vectors when all kIlp
// are in range; otherwise thread t takes t, t + nthreads, ... so that each
// scalar load or store of a warp still covers consecutive addresses.
struct Fragment {
  int64_t offset;
  int64_t stride;
  int count;
  bool vector;
};

FK_HOST_DEVICE Fragment fragment(int64_t round, int64_t n, bool aligned, int tid, int nthreads) {
  Fragment f;
  if (aligned) {
    f.offset = round + int64_t(tid) * kIlp;
    f.stride = 1;
    const int64_t left = n - f.offset;
    f.count = left <= 0 ? 0 : (left < kIlp ? int(left) : kIlp);
    f.vector = f.count == kIlp;
    return f;
  }
  f.offset = round + tid;
  f.stride = nthreads;
  const int64_t left = n - f.offset;
  const int64_t count = left <= 0 ? 0 : (left + nthreads - 1) / nthreads;
  f.count = count < kIlp ? int(count) : kIlp;
  f.vector = false;
  return f;
}

// A range's elements are consumed in rounds of this many.
FK_HOST_DEVICE int64_t round_size(int nthreads) { return int64_t(nthreads) * kIlp; }

FK_HOST_DEVICE bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

struct alignas(16) Bytes16 {
  uint32_t word[4];
};

// One 16-byte access. On the device an aligned 16-byte struct is one 128-bit
// instruction; on the host the emulator insists on the alignment the GPU
// would fault without.
FK_HOST_DEVICE Bytes16 load16(const void* p) {
#if defined(__CUDA_ARCH__)
  return *static_cast<const Bytes16*>(p);
#else
  if (!aligned16(p)) {
    throw std::logic_error("emulated CUDA kernel: 16-byte load from a misaligned address");
  }
  Bytes16 b;
  std::memcpy(&b, p, sizeof(b));
  return b;
#endif
}

FK_HOST_DEVICE void store16(void* p, const Bytes16& b) {
#if defined(__CUDA_ARCH__)
  *static_cast<Bytes16*>(p) = b;
#else
  if (!aligned16(p)) {
    throw std::logic_error("emulated CUDA kernel: 16-byte store to a misaligned address");
  }
  std::memcpy(p, &b, sizeof(b));
#endif
}

// Element i of a 16-byte vector of T, as fp32, and its inverse (which sets
// the elements in order: an even one starts its word). Both index with
// constants once unrolled, so a vector lives in registers.
template <typename T>
FK_HOST_DEVICE float element(const Bytes16& b, int i) {
  return to_float(T{uint16_t(b.word[i >> 1] >> (16 * (i & 1)))});
}
template <>
FK_HOST_DEVICE float element<float>(const Bytes16& b, int i) { return bits_float(b.word[i]); }

template <typename T>
FK_HOST_DEVICE void set_element(Bytes16& b, int i, float x) {
  const uint32_t bits = from_float<T>(x).bits;
  b.word[i >> 1] = (i & 1) ? (b.word[i >> 1] | (bits << 16)) : bits;
}
template <>
FK_HOST_DEVICE void set_element<float>(Bytes16& b, int i, float x) { b.word[i] = float_bits(x); }

#if defined(__CUDACC__)
#define FK_UNROLL _Pragma("unroll")
#else
#define FK_UNROLL
#endif

// Loads the fragment's elements of `base` (the range's first element) as fp32.
template <typename T>
FK_HOST_DEVICE void load(const T* base, const Fragment& f, float (&out)[kIlp]) {
  constexpr int kPer = int(sizeof(Bytes16) / sizeof(T));
  if (f.vector) {
    FK_UNROLL
    for (int v = 0; v < kIlp / kPer; ++v) {
      const Bytes16 b = load16(base + f.offset + v * kPer);
      FK_UNROLL
      for (int i = 0; i < kPer; ++i) out[v * kPer + i] = element<T>(b, i);
    }
    return;
  }
  FK_UNROLL
  for (int j = 0; j < kIlp; ++j) {
    if (j < f.count) out[j] = to_float(base[f.offset + j * f.stride]);
  }
}

template <typename T>
FK_HOST_DEVICE void store(T* base, const Fragment& f, const float (&in)[kIlp]) {
  constexpr int kPer = int(sizeof(Bytes16) / sizeof(T));
  if (f.vector) {
    FK_UNROLL
    for (int v = 0; v < kIlp / kPer; ++v) {
      Bytes16 b;
      FK_UNROLL
      for (int i = 0; i < kPer; ++i) set_element<T>(b, i, in[v * kPer + i]);
      store16(base + f.offset + v * kPer, b);
    }
    return;
  }
  FK_UNROLL
  for (int j = 0; j < kIlp; ++j) {
    if (j < f.count) base[f.offset + j * f.stride] = from_float<T>(in[j]);
  }
}

// The scalars of an AdamW update: derived on the host once per call, or, when
// lr or step live on the device, by every thread from the device values with
// the same double-precision formula: no host sync, for a few hundred cycles
// per thread against tens of elements moved per thread. CUDA's double pow is
// within 2 ulp of the host's, which almost never moves the fp32 result.
struct AdamWArgs {
  AdamWScalars scalars;
  AdamWHyper hyper;
  DeviceScalars device;
};

inline AdamWArgs adamw_args(const AdamWHyper& h, const DeviceScalars& d) {
  return AdamWArgs{adamw_scalars(h), h, d};
}

FK_HOST_DEVICE bool on_device(const DeviceScalars& d) {
  return d.lr != nullptr || d.step != nullptr || d.grad_scale != nullptr;
}

FK_HOST_DEVICE AdamWHyper resolve_hyper(AdamWHyper h, const DeviceScalars& d) {
  if (d.lr != nullptr) h.lr = double(*d.lr);
  if (d.step != nullptr) h.step = double(*d.step);
  if (d.grad_scale != nullptr) h.grad_scale = double(*d.grad_scale);
  return h;
}

// A GradScaler found an inf or NaN: every thread of the launch leaves its
// elements as they are, decided on the device. (A found_inf on the host that is
// non-zero never launches.)
FK_HOST_DEVICE bool skipped(const DeviceScalars& d) {
  return d.found_inf != nullptr && *d.found_inf != 0.f;
}

FK_HOST_DEVICE AdamWScalars resolve(const AdamWArgs& a) {
  return on_device(a.device) ? adamw_scalars(resolve_hyper(a.hyper, a.device)) : a.scalars;
}

}  // namespace cuda
}  // namespace frugal
