// frugal_step_int8_ on the GPU: the kernels and their host launches (bodies in
// frugal_step_int8.cuh and frugal_step.cuh).
#include "frugal_step_int8.cuh"
#include "launch.cuh"

namespace frugal {
namespace cuda {

namespace {

// Launch 1: frugal_step_'s kernel with the members left alone (as frugal_step.cu's,
// 64 registers).
template <typename T, typename Index, StateFree Mode>
__global__ void __launch_bounds__(kFrugalThreads, 4) frugal_int8_state_free_kernel(
    const FrugalMeta meta, const FrugalArgs args) {
  __shared__ FrugalShared sh;
  const FrugalBlock<T, Index, Mode, false> block(meta, args, int(blockIdx.x));
  block.run_phases(sh, kFrugalThreads, [&](auto&& phase) {
    phase(int(threadIdx.x));
    __syncthreads();
  });
}

// Launch 2: the members' moment blocks, a warp each.
template <typename T, typename Index>
__global__ void __launch_bounds__(kMoments8Threads) frugal_int8_members_kernel(
    const FrugalInt8Meta meta, const FrugalArgs args) {
  __shared__ Moments8Shared sh;
  const int warp = int(threadIdx.x) / kWarp, lane = int(threadIdx.x) % kWarp;
  const FrugalInt8Warp<T, Index> body(meta, args, int(blockIdx.x), warp);
  Int8Lane regs;
  body.run_phases(sh.warp[warp], [&](auto&& phase) {
    phase(lane, regs);
    __syncwarp();
  });
}

}  // namespace

void frugal_step_int8(const TensorBatch& t, const SubsetBatch& sub, const Moments8Batch& q,
                      DType dtype, const FrugalHyper& h, const DeviceScalars& d,
                      uintptr_t stream) {
  if (h.adamw.found_inf != 0.0) return;  // a GradScaler skip known on the host: no launch
  const FrugalArgs args = frugal_args(sub, h, d);
  std::vector<float*> none;
  const TensorBatch plain = without_moments(t, none);
  const std::vector<int64_t> blocks = moment_blocks(q, t.count);
  with_frugal_types(dtype, sub.index_is_int32, h.state_free, [&](auto tag, auto index,
                                                                 auto mode_tag) {
    using T = decltype(tag);
    using Index = decltype(index);
    plan_frugal_step(plain, sub, [&](const FrugalMeta& meta, int num_blocks) {
      frugal_int8_state_free_kernel<T, Index, decltype(mode_tag)::value>
          <<<num_blocks, kFrugalThreads, 0, as_stream(stream)>>>(meta, args);
      check_launch("frugal_step_int8_");
    });
    plan_frugal_int8_members(t, sub, q, blocks.data(),
                             [&](const FrugalInt8Meta& meta, int num_blocks) {
      frugal_int8_members_kernel<T, Index>
          <<<num_blocks, kMoments8Threads, 0, as_stream(stream)>>>(meta, args);
      check_launch("frugal_step_int8_");
    });
  });
}

}  // namespace cuda
}  // namespace frugal
