// adamw_ on the CPU: one pass over p, g, m, v per element.
#include "kernels.h"
#include "loops.h"
#include "parallel.h"

namespace frugal {
namespace cpu {
namespace FK_CPU_ISA {

void adamw(const TensorBatch& t, DType dtype, const AdamWScalars& s, int num_threads) {
  dispatch_dtype(dtype, [&](auto tag) {
    using T = decltype(tag);
    for_each_chunk(t.count, t.numel, kChunk, num_threads, [&](int64_t i, int64_t b, int64_t e) {
      adamw_range(typed<T>(t.params[i]) + b, typed<T>(t.grads[i]) + b, t.exp_avgs[i] + b,
                  t.exp_avg_sqs[i] + b, e - b, s);
    });
  });
}

}  // namespace FK_CPU_ISA
}  // namespace cpu
}  // namespace frugal
