// adamw_ on the GPU: the kernel and its host launches (body in adamw.cuh).
#include "adamw.cuh"
#include "launch.cuh"

namespace frugal {
namespace cuda {

namespace {

template <typename T>
__global__ void __launch_bounds__(kAdamWThreads) adamw_kernel(const AdamWMeta meta,
                                                              const AdamWArgs args) {
  adamw_thread<T>(meta, args, int(blockIdx.x), int(threadIdx.x), kAdamWThreads);
}

}  // namespace

void adamw(const TensorBatch& t, DType dtype, const AdamWHyper& h, const DeviceScalars& d,
           uintptr_t stream) {
  if (h.found_inf != 0.0) return;  // a GradScaler skip known on the host: no launch
  const AdamWArgs args = adamw_args(h, d);
  dispatch_dtype(dtype, [&](auto tag) {
    using T = decltype(tag);
    plan_adamw(t, [&](const AdamWMeta& meta, int blocks) {
      adamw_kernel<T><<<blocks, kAdamWThreads, 0, as_stream(stream)>>>(meta, args);
      check_launch("adamw_");
    });
  });
}

}  // namespace cuda
}  // namespace frugal
