// Host-side helpers of the real launches (*.cu only: needs the CUDA runtime).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <stdexcept>
#include <string>

namespace frugal {
namespace cuda {

inline cudaStream_t as_stream(uintptr_t stream) { return reinterpret_cast<cudaStream_t>(stream); }

// Launch errors (no device, no kernel image for this GPU, bad configuration)
// surface here; errors of the kernel itself surface at the caller's next sync.
inline void check_launch(const char* op) {
  const cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) {
    throw std::runtime_error(std::string("frugal_kernels: launching the CUDA kernel of ") + op +
                             " failed: " + cudaGetErrorName(e) + ": " + cudaGetErrorString(e));
  }
}

}  // namespace cuda
}  // namespace frugal
