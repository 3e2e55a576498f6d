// sgd_ on the CPU: one pass over p, g and (with momentum) the buffer per element.
#include "kernels.h"
#include "loops.h"
#include "parallel.h"

namespace frugal {
namespace cpu {
namespace FK_CPU_ISA {

void sgd(const TensorBatch& t, DType dtype, const SgdScalars& s, int num_threads) {
  dispatch_dtype(dtype, [&](auto tag) {
    using T = decltype(tag);
    for_each_chunk(t.count, t.numel, kChunk, num_threads, [&](int64_t i, int64_t b, int64_t e) {
      float* buf = s.use_momentum ? t.exp_avgs[i] + b : nullptr;
      sgd_range(typed<T>(t.params[i]) + b, typed<T>(t.grads[i]) + b, buf, e - b, s);
    });
  });
}

}  // namespace FK_CPU_ISA
}  // namespace cpu
}  // namespace frugal
