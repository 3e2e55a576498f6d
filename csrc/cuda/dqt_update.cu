// dqt_update_ on the GPU: the kernel and its host launches (body in
// dqt_update.cuh).
#include "dqt_update.cuh"
#include "launch.cuh"

namespace frugal {
namespace cuda {

namespace {

// Not tuned on hardware yet (written without a GPU at hand): the bounds of
// frugal_step_'s kernel, whose block program this one follows, 4 blocks of
// 256 threads an SM. ptxas (nvcc 13, sm_90) fits them in 55-64 registers
// without spills.
template <typename T, typename Index, StateFree Mode>
__global__ void __launch_bounds__(kDqtThreads, 4) dqt_update_kernel(const DqtMeta meta,
                                                                     const DqtArgs args) {
  __shared__ DqtShared sh;
  const DqtBlock<T, Index, Mode> block(meta, args, int(blockIdx.x));
  block.run_phases(sh, kDqtThreads, [&](auto&& phase) {
    phase(int(threadIdx.x));
    __syncthreads();
  });
}

}  // namespace

void dqt_update(const TensorBatch& t, const SubsetBatch& sub, const QuantBatch& q,
                DType grad_dtype, const DqtHyper& h, const DeviceScalars& d, uintptr_t stream) {
  if (h.frugal.adamw.found_inf != 0.0) return;  // a GradScaler skip known on the host: no launch
  const DqtArgs args = dqt_args(sub, h, d);
  const std::vector<int64_t> padded = dqt_padded_numels(q, t.count);
  with_frugal_types(grad_dtype, sub.index_is_int32, h.frugal.state_free,
                    [&](auto tag, auto index, auto mode_tag) {
    using T = decltype(tag);
    using Index = decltype(index);
    plan_dqt_update(t, sub, q, padded.data(), [&](const DqtMeta& meta, int blocks) {
      dqt_update_kernel<T, Index, decltype(mode_tag)::value>
          <<<blocks, kDqtThreads, 0, as_stream(stream)>>>(meta, args);
      check_launch("dqt_update_");
    });
  });
}

}  // namespace cuda
}  // namespace frugal
