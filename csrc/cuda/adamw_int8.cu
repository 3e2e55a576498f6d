// adamw_int8_ on the GPU: the kernel and its host launches (body in adamw_int8.cuh).
#include "adamw_int8.cuh"
#include "launch.cuh"

namespace frugal {
namespace cuda {

namespace {

template <typename T>
__global__ void __launch_bounds__(kMoments8Threads) adamw_int8_kernel(const AdamWInt8Meta meta,
                                                                       const AdamWArgs args) {
  __shared__ Moments8Shared sh;
  const int warp = int(threadIdx.x) / kWarp, lane = int(threadIdx.x) % kWarp;
  const AdamWInt8Warp<T> body(meta, args, int(blockIdx.x), warp);
  Int8Lane regs;
  body.run_phases(sh.warp[warp], [&](auto&& phase) {
    phase(lane, regs);
    __syncwarp();
  });
}

}  // namespace

void adamw_int8(const TensorBatch& t, const Moments8Batch& q, DType dtype, const AdamWHyper& h,
                const DeviceScalars& d, uintptr_t stream) {
  if (h.found_inf != 0.0) return;  // a GradScaler skip known on the host: no launch
  const AdamWArgs args = adamw_args(h, d);
  const std::vector<int64_t> blocks = moment_blocks(q, t.count);
  dispatch_dtype(dtype, [&](auto tag) {
    using T = decltype(tag);
    plan_adamw_int8(t, q, blocks.data(), [&](const AdamWInt8Meta& meta, int num_blocks) {
      adamw_int8_kernel<T><<<num_blocks, kMoments8Threads, 0, as_stream(stream)>>>(meta, args);
      check_launch("adamw_int8_");
    });
  });
}

}  // namespace cuda
}  // namespace frugal
