// grad_norm on the GPU: the kernels and their host launches (bodies in
// grad_norm.cuh).
#include "grad_norm.cuh"
#include "launch.cuh"

namespace frugal {
namespace cuda {

namespace {

template <typename T, bool Max>
__global__ void __launch_bounds__(kGradNormThreads) grad_norm_kernel(const GradNormMeta meta) {
  __shared__ GradNormShared sh;
  grad_norm_block<T, Max>(meta, int(blockIdx.x), sh, kGradNormThreads, [&](auto&& phase) {
    phase(int(threadIdx.x));
    __syncthreads();
  });
}

template <bool Max>
__global__ void __launch_bounds__(kGradNormThreads) grad_norm_finish_kernel(
    const GradNormFinish f) {
  __shared__ GradNormShared sh;
  grad_norm_finish_block<Max>(f, sh, kGradNormThreads, [&](auto&& phase) {
    phase(int(threadIdx.x));
    __syncthreads();
  });
}

}  // namespace

void grad_norm(const void* const* grads, const int64_t* numel, int64_t count, DType dtype,
               bool max_norm, double* partials, int64_t capacity, uintptr_t stream) {
  grad_norm_partials(numel, count, capacity);
  dispatch_dtype(dtype, [&](auto tag) {
    using T = decltype(tag);
    with_norm_kind(max_norm, [&](auto max_tag) {
      plan_grad_norm(grads, numel, count, partials, [&](const GradNormMeta& meta, int blocks) {
        grad_norm_kernel<T, decltype(max_tag)::value>
            <<<blocks, kGradNormThreads, 0, as_stream(stream)>>>(meta);
        check_launch("grad_norm");
      });
    });
  });
}

void grad_norm_finish(const double* partials, int64_t count, bool max_norm, float* norm,
                      float* found_inf, uintptr_t stream) {
  const GradNormFinish f{partials, count, norm, found_inf};
  with_norm_kind(max_norm, [&](auto max_tag) {
    grad_norm_finish_kernel<decltype(max_tag)::value>
        <<<1, kGradNormThreads, 0, as_stream(stream)>>>(f);
    check_launch("grad_norm");
  });
}

}  // namespace cuda
}  // namespace frugal
