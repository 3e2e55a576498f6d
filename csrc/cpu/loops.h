// The contiguous inner loops of the CPU kernels. Written as plain loops over
// restrict pointers so that the compiler vectorises them for the ISA level the
// including file is compiled for.
#pragma once

#include <cstdint>

#include "frugal/update_rules.h"

namespace frugal {
namespace cpu {
namespace FK_CPU_ISA {

template <typename T>
void adamw_range(T* __restrict__ p, const T* __restrict__ g, float* __restrict__ m,
                 float* __restrict__ v, int64_t n, const AdamWScalars s) {
  for (int64_t i = 0; i < n; ++i) {
    float mi = m[i];
    float vi = v[i];
    p[i] = from_float<T>(adamw_update(to_float(p[i]), to_float(g[i]), mi, vi, s));
    m[i] = mi;
    v[i] = vi;
  }
}

template <typename T, StateFree Mode>
void state_free_range(T* __restrict__ p, const T* __restrict__ g, int64_t n, const SignScalars s) {
  for (int64_t i = 0; i < n; ++i) {
    p[i] = from_float<T>(state_free_update<Mode>(to_float(p[i]), to_float(g[i]), s));
  }
}

// Without momentum there is no buffer: `buf` is null and never read.
template <typename T>
void sgd_range(T* __restrict__ p, const T* __restrict__ g, float* __restrict__ buf, int64_t n,
               const SgdScalars s) {
  if (s.use_momentum) {
    for (int64_t i = 0; i < n; ++i) {
      float bi = buf[i];
      p[i] = from_float<T>(sgd_update(to_float(p[i]), to_float(g[i]), bi, s));
      buf[i] = bi;
    }
  } else {
    for (int64_t i = 0; i < n; ++i) {
      float unused = 0.f;
      p[i] = from_float<T>(sgd_update(to_float(p[i]), to_float(g[i]), unused, s));
    }
  }
}

}  // namespace FK_CPU_ISA
}  // namespace cpu
}  // namespace frugal
