// The arithmetic of grad_norm, written once for the CPU and CUDA kernels: how a
// value enters a partial result, how two partial results combine, and how the
// total becomes the norm and its non-finite flag.
//
// Partial results are doubles: a sum of squares (2-norm) or a largest magnitude
// (max norm). No finite fp32 gradient overflows a double sum of squares (the
// largest square is 1.2e77), so the total is non-finite exactly when an element
// is NaN or infinite, which makes it the step's non-finite flag too. The max
// must keep a NaN, which a plain comparison drops (x > NaN is false).
#pragma once

#include <cmath>

#include "frugal/common.h"

namespace frugal {

// Combines two partial results of the same kind.
template <bool Max>
FK_HOST_DEVICE double norm_combine(double acc, double part) {
  if constexpr (Max) {
    return (part > acc || part != part) ? part : acc;
  } else {
    return acc + part;
  }
}

// Adds one gradient value to a partial result.
template <bool Max>
FK_HOST_DEVICE double norm_accumulate(double acc, double x) {
  if constexpr (Max) {
    return norm_combine<true>(acc, fabs(x));
  } else {
    return acc + x * x;
  }
}

// The norm of a total: the square root of a sum of squares, or the largest
// magnitude as it is.
FK_HOST_DEVICE double norm_of_total(double total, bool max_norm) {
  return max_norm ? total : sqrt(total);
}

// GradScaler's found_inf convention: 1 when the norm is NaN or infinite.
FK_HOST_DEVICE float norm_found_inf(double norm) { return norm - norm == 0.0 ? 0.f : 1.f; }

}  // namespace frugal
