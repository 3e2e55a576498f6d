// The launch constants of the CUDA kernels, for the binding (built by the host
// compiler into every build, like the emulator that runs with them).
#include "kernels.h"

#include "adamw.cuh"
#include "adamw_int8.cuh"
#include "dqt_update.cuh"
#include "frugal_step.cuh"
#include "frugal_step_int8.cuh"
#include "grad_norm.cuh"
#include "sign_sgd.cuh"

namespace frugal {
namespace cuda {

LaunchLimits adamw_limits() {
  return LaunchLimits{kAdamWThreads, kAdamWChunk, 0, AdamWMeta::kMaxTensors, AdamWMeta::kMaxBlocks};
}

LaunchLimits adamw_int8_limits() {
  return LaunchLimits{kMoments8Threads, kAdamWInt8Chunk, 0, AdamWInt8Meta::kMaxTensors,
                      AdamWInt8Meta::kMaxBlocks};
}

LaunchLimits sign_sgd_limits() {
  return LaunchLimits{kSignSgdThreads, kSignSgdChunk, 0, SignSgdMeta::kMaxTensors,
                      SignSgdMeta::kMaxBlocks};
}

LaunchLimits frugal_step_limits() {
  return LaunchLimits{kFrugalThreads, kFrugalChunk, kFrugalTile, FrugalMeta::kMaxTensors,
                      FrugalMeta::kMaxBlocks};
}

LaunchLimits frugal_step_int8_limits() {
  return LaunchLimits{kMoments8Threads, kFrugalInt8Chunk, 0, FrugalInt8Meta::kMaxTensors,
                      FrugalInt8Meta::kMaxBlocks};
}

LaunchLimits dqt_update_limits() {
  return LaunchLimits{kDqtThreads, kDqtChunk, kDqtTile, DqtMeta::kMaxTensors, DqtMeta::kMaxBlocks};
}

LaunchLimits grad_norm_limits() {
  return LaunchLimits{kGradNormThreads, kGradNormChunk, 0, GradNormMeta::kMaxTensors,
                      GradNormMeta::kMaxBlocks};
}

}  // namespace cuda
}  // namespace frugal
