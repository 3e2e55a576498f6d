// What the CUDA part of this build was compiled with (set by CMakeLists.txt).
#include "kernels.h"

namespace frugal {
namespace cuda {

const char* nvcc_version() { return FK_NVCC_VERSION; }
const char* archs() { return FK_CUDA_ARCHS; }

}  // namespace cuda
}  // namespace frugal
