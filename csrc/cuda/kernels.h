// Entry points of the CUDA kernels, and of their emulation on the host.
//
// The block-level logic of every kernel lives in a header (*.cuh) of plain
// C++ with FK_HOST_DEVICE functions. The real kernels (*.cu, built by nvcc
// when it is found) and the emulator (emulate.cpp, always built by the host
// compiler) include the same headers and use the same launch planner, so the
// index and chunking logic is tested on the CPU over an emulated grid.
#pragma once

#include <cstdint>

#include "frugal/batch.h"
#include "frugal/common.h"
#include "frugal/frugal_tile.h"
#include "frugal/moments8.h"
#include "frugal/quant.h"
#include "frugal/update_rules.h"

namespace frugal {
namespace cuda {

// Hyper-parameters that may live on the device (a 0-dim float32 tensor each,
// as torch's capturable optimizers keep lr and step, and GradScaler its scale
// and found_inf); null means "use the value in the hyper-parameter struct".
struct DeviceScalars {
  const float* lr = nullptr;
  const float* step = nullptr;
  const float* grad_scale = nullptr;
  const float* found_inf = nullptr;
};

// The functions below throw std::runtime_error on a CUDA error.
void adamw(const TensorBatch& t, DType dtype, const AdamWHyper& h, const DeviceScalars& d,
           uintptr_t stream);
// The 8-bit moments in `q` (the batch's own moment pointers are unread), as cpu::adamw_int8.
void adamw_int8(const TensorBatch& t, const Moments8Batch& q, DType dtype, const AdamWHyper& h,
                const DeviceScalars& d, uintptr_t stream);
void sign_sgd(const TensorBatch& t, DType dtype, const SignSgdHyper& h, const DeviceScalars& d,
              uintptr_t stream);
void frugal_step(const TensorBatch& t, const SubsetBatch& sub, DType dtype, const FrugalHyper& h,
                 const DeviceScalars& d, uintptr_t stream);
// The subset's 8-bit moments in `q`, as cpu::frugal_step_int8 (rows and columns subsets).
void frugal_step_int8(const TensorBatch& t, const SubsetBatch& sub, const Moments8Batch& q,
                      DType dtype, const FrugalHyper& h, const DeviceScalars& d,
                      uintptr_t stream);
// The batch's params are the packed codes and its dtype the gradients' (as cpu::dqt_update).
void dqt_update(const TensorBatch& t, const SubsetBatch& sub, const QuantBatch& q, DType grad_dtype,
                const DqtHyper& h, const DeviceScalars& d, uintptr_t stream);
// grad_norm of gradients of one dtype: one double partial result per chunk of
// kGradNormChunk elements, written to partials[0, n) (device memory of
// `capacity` doubles; fewer throws) in the planner's order. grad_norm_finish
// combines partials[0, count), of one or more such calls, into *norm and
// *found_inf (device float32).
void grad_norm(const void* const* grads, const int64_t* numel, int64_t count, DType dtype,
                  bool max_norm, double* partials, int64_t capacity, uintptr_t stream);
void grad_norm_finish(const double* partials, int64_t count, bool max_norm, float* norm,
                      float* found_inf, uintptr_t stream);
// nvcc version and the architectures compiled in, e.g. "80;90;90-ptx".
const char* nvcc_version();
const char* archs();

// The launch constants of one kernel (from its *.cuh), in every build, CUDA
// or not: the emulator runs with them, and tests size their cases around them.
struct LaunchLimits {
  int threads;      // per block
  int64_t chunk;    // elements (frugal_step_: positions; dqt_update_: padded positions;
                    // adamw_int8_: moment blocks) a block owns
  int64_t tile;     // positions a frugal_step_ / dqt_update_ tile holds; 0 for kernels without tiles
  int max_tensors;  // tensors one launch carries
  int max_blocks;   // blocks one launch carries
};
LaunchLimits adamw_limits();
LaunchLimits adamw_int8_limits();
LaunchLimits sign_sgd_limits();
LaunchLimits frugal_step_limits();
// frugal_step_int8_'s second launch (the members' moment blocks); its first is
// frugal_step_'s.
LaunchLimits frugal_step_int8_limits();
LaunchLimits dqt_update_limits();
LaunchLimits grad_norm_limits();

}  // namespace cuda

// The same kernels run block by block, thread by thread, on host memory (the
// DeviceScalars are host addresses here). Each returns the number of launches
// the call made, so that tests can tell which limits of the planner they hit.
namespace cuda_emulated {

int64_t adamw(const TensorBatch& t, DType dtype, const AdamWHyper& h, const cuda::DeviceScalars& d);
int64_t adamw_int8(const TensorBatch& t, const Moments8Batch& q, DType dtype, const AdamWHyper& h,
                   const cuda::DeviceScalars& d);
int64_t sign_sgd(const TensorBatch& t, DType dtype, const SignSgdHyper& h,
                 const cuda::DeviceScalars& d);
int64_t frugal_step(const TensorBatch& t, const SubsetBatch& sub, DType dtype, const FrugalHyper& h,
                    const cuda::DeviceScalars& d);
int64_t frugal_step_int8(const TensorBatch& t, const SubsetBatch& sub, const Moments8Batch& q,
                         DType dtype, const FrugalHyper& h, const cuda::DeviceScalars& d);
int64_t dqt_update(const TensorBatch& t, const SubsetBatch& sub, const QuantBatch& q,
                   DType grad_dtype, const DqtHyper& h, const cuda::DeviceScalars& d);
// Host memory in place of device memory; the launches of grad_norm are returned,
// grad_norm_finish makes one.
int64_t grad_norm(const void* const* grads, const int64_t* numel, int64_t count, DType dtype,
                  bool max_norm, double* partials, int64_t capacity);
void grad_norm_finish(const double* partials, int64_t count, bool max_norm, float* norm,
                      float* found_inf);

}  // namespace cuda_emulated
}  // namespace frugal
