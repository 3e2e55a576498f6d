// adamw_int8_ on the CPU: one pass per block of 8-bit moments (dequantize, AdamW,
// quantize), blocks of a tensor shared out over the threads in runs.
#include <algorithm>
#include <type_traits>
#include <vector>

#include "moments8_block.h"
#include "parallel.h"

namespace frugal {
namespace cpu {
namespace FK_CPU_ISA {

namespace {

// Blocks [b0, b1) of tensor i, counted row by row.
struct BlockRun {
  int64_t tensor;
  int64_t b0;
  int64_t b1;
};

template <typename T>
void run_blocks(const TensorBatch& t, const Moments8Batch& q, const AdamWScalars& s,
                const BlockRun& run) {
  const int64_t i = run.tensor, C = q.cols[i];
  const int64_t per_row = (C + kMomentBlock - 1) / kMomentBlock;
  T* p = typed<T>(t.params[i]);
  const T* g = typed<T>(t.grads[i]);
  for (int64_t b = run.b0; b < run.b1; ++b) {
    const int64_t r = b / per_row, c0 = (b % per_row) * kMomentBlock;
    const int64_t a = r * C + c0;
    adamw_int8_block(p + a, g + a, q.exp_avgs[i] + a, q.exp_avg_scales[i] + b,
                     q.exp_avg_sqs[i] + a, q.exp_avg_sq_scales[i] + b,
                     std::min(kMomentBlock, C - c0), s);
  }
}

}  // namespace

void adamw_int8(const TensorBatch& t, const Moments8Batch& q, DType dtype, const AdamWScalars& s,
                int num_threads) {
  const int64_t per_run = kChunk / kMomentBlock;
  std::vector<BlockRun> runs;
  int64_t total = 0;
  for (int64_t i = 0; i < t.count; ++i) {
    const int64_t blocks = q.rows[i] * ((q.cols[i] + kMomentBlock - 1) / kMomentBlock);
    for (int64_t b = 0; b < blocks; b += per_run) {
      runs.push_back({i, b, std::min(blocks, b + per_run)});
    }
    total += t.numel[i];
  }
  const int64_t n = int64_t(runs.size());
  const int threads = total < kMinParallelElements ? 1 : std::max(1, num_threads);
  dispatch_dtype(dtype, [&](auto tag) {
    using T = decltype(tag);
#if defined(_OPENMP)
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
#endif
    for (int64_t j = 0; j < n; ++j) run_blocks<T>(t, q, s, runs[j]);
  });
  (void)threads;
}

}  // namespace FK_CPU_ISA
}  // namespace cpu
}  // namespace frugal
