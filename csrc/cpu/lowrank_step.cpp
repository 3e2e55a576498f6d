// lowrank_step_ on the CPU: the epilogue of a low-rank FRUGAL step in one pass
// (read p, g and the two back-projections, write p).
#include "kernels.h"
#include "loops.h"
#include "parallel.h"

namespace frugal {
namespace cpu {
namespace FK_CPU_ISA {

namespace {

template <typename T, StateFree Mode>
void lowrank_loop(T* __restrict__ p, const T* __restrict__ g, const float* __restrict__ up_update,
                  const float* __restrict__ up_grad, int64_t n, const SignScalars s) {
  for (int64_t i = 0; i < n; ++i) {
    p[i] = from_float<T>(
        lowrank_update<Mode>(to_float(p[i]), to_float(g[i]), up_update[i], up_grad[i], s));
  }
}

template <typename T, StateFree Mode>
void lowrank_range(T* p, const T* g, const float* up_update, const float* up_grad, int64_t n,
                   const SignScalars s) {
  over_fp32(p, g, n, [&](auto* tp, const auto* tg, int64_t a, int64_t len) {
    lowrank_loop<std::remove_pointer_t<decltype(tp)>, Mode>(tp, tg, up_update + a, up_grad + a,
                                                            len, s);
  });
}

template <typename T, StateFree Mode>
void run(const TensorBatch& t, const float* const* up_updates, const float* const* up_grads,
         const SignScalars& s, int num_threads) {
  for_each_chunk(t.count, t.numel, kChunk, num_threads, [&](int64_t i, int64_t b, int64_t e) {
    lowrank_range<T, Mode>(typed<T>(t.params[i]) + b, typed<T>(t.grads[i]) + b,
                           up_updates[i] + b, up_grads[i] + b, e - b, s);
  });
}

}  // namespace

void lowrank_step(const TensorBatch& t, const float* const* up_updates, const float* const* up_grads,
                  DType dtype, const SignScalars& s, StateFree mode, int num_threads) {
  dispatch_dtype(dtype, [&](auto tag) {
    using T = decltype(tag);
    switch (mode) {
      case StateFree::kSign: run<T, StateFree::kSign>(t, up_updates, up_grads, s, num_threads); break;
      case StateFree::kSgd: run<T, StateFree::kSgd>(t, up_updates, up_grads, s, num_threads); break;
      case StateFree::kNone: run<T, StateFree::kNone>(t, up_updates, up_grads, s, num_threads); break;
    }
  });
}

}  // namespace FK_CPU_ISA
}  // namespace cpu
}  // namespace frugal
