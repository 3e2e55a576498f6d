// frugal_step_ on the GPU: the kernel and its host launches (body in
// frugal_step.cuh).
#include "frugal_step.cuh"
#include "launch.cuh"

namespace frugal {
namespace cuda {

namespace {

// At most 64 registers, so that 4 blocks (1024 threads) fit an SM: ptxas
// would otherwise take 88-98 (nvcc 13, sm_90) and fit 2, halving the bytes
// in flight. The price is a 4-byte spill in a few instantiations.
template <typename T, typename Index, StateFree Mode>
__global__ void __launch_bounds__(kFrugalThreads, 4) frugal_step_kernel(const FrugalMeta meta,
                                                                        const FrugalArgs args) {
  __shared__ FrugalShared sh;
  const FrugalBlock<T, Index, Mode> block(meta, args, int(blockIdx.x));
  block.run_phases(sh, kFrugalThreads, [&](auto&& phase) {
    phase(int(threadIdx.x));
    __syncthreads();
  });
}

}  // namespace

void frugal_step(const TensorBatch& t, const SubsetBatch& sub, DType dtype, const FrugalHyper& h,
                 const DeviceScalars& d, uintptr_t stream) {
  if (h.adamw.found_inf != 0.0) return;  // a GradScaler skip known on the host: no launch
  const FrugalArgs args = frugal_args(sub, h, d);
  with_frugal_types(dtype, sub.index_is_int32, h.state_free, [&](auto tag, auto index, auto mode_tag) {
    using T = decltype(tag);
    using Index = decltype(index);
    plan_frugal_step(t, sub, [&](const FrugalMeta& meta, int blocks) {
      frugal_step_kernel<T, Index, decltype(mode_tag)::value>
          <<<blocks, kFrugalThreads, 0, as_stream(stream)>>>(meta, args);
      check_launch("frugal_step_");
    });
  });
}

}  // namespace cuda
}  // namespace frugal
