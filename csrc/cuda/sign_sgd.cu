// sign_sgd_ on the GPU: the kernel and its host launches (body in sign_sgd.cuh).
#include "launch.cuh"
#include "sign_sgd.cuh"

namespace frugal {
namespace cuda {

namespace {

template <typename T>
__global__ void __launch_bounds__(kSignSgdThreads) sign_sgd_kernel(const SignSgdMeta meta,
                                                                   const SignSgdArgs args) {
  sign_sgd_thread<T>(meta, args, int(blockIdx.x), int(threadIdx.x), kSignSgdThreads);
}

}  // namespace

void sign_sgd(const TensorBatch& t, DType dtype, const SignSgdHyper& h, const DeviceScalars& d,
              uintptr_t stream) {
  if (h.found_inf != 0.0) return;  // a GradScaler skip known on the host: no launch
  const SignSgdArgs args = sign_sgd_args(h, d);
  dispatch_dtype(dtype, [&](auto tag) {
    using T = decltype(tag);
    plan_sign_sgd(t, [&](const SignSgdMeta& meta, int blocks) {
      sign_sgd_kernel<T><<<blocks, kSignSgdThreads, 0, as_stream(stream)>>>(meta, args);
      check_launch("sign_sgd_");
    });
  });
}

}  // namespace cuda
}  // namespace frugal
