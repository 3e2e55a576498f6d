// sign_sgd_ on the CPU: read p and g, write p, nothing more.
#include "kernels.h"
#include "loops.h"
#include "parallel.h"

namespace frugal {
namespace cpu {
namespace FK_CPU_ISA {

void sign_sgd(const TensorBatch& t, DType dtype, const SignScalars& s, int num_threads) {
  dispatch_dtype(dtype, [&](auto tag) {
    using T = decltype(tag);
    for_each_chunk(t.count, t.numel, kChunk, num_threads, [&](int64_t i, int64_t b, int64_t e) {
      state_free_range<T, StateFree::kSign>(typed<T>(t.params[i]) + b, typed<T>(t.grads[i]) + b, e - b, s);
    });
  });
}

}  // namespace FK_CPU_ISA
}  // namespace cpu
}  // namespace frugal
