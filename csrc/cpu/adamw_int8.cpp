// adamw_int8_ on the CPU: one pass per block of 8-bit moments (dequantize, AdamW,
// quantize), blocks of a tensor shared out over the threads in runs.
#include <algorithm>
#include <vector>

#include "frugal/moments8.h"
#include "kernels.h"
#include "parallel.h"

namespace frugal {
namespace cpu {
namespace FK_CPU_ISA {

namespace {

// One block of adamw_int8_ (on a GPU a block would be shared by threads, with a
// reduction for its maxima): n <= kMomentBlock coordinates of p and g with their
// codes, and their two scales. The moments are dequantized, every coordinate
// takes adamw_update, and the updated fp32 moments are quantized again.
template <typename T>
void adamw_int8_block(T* p, const T* g, int8_t* m_codes, float* m_scale, uint8_t* v_codes,
                      float* v_scale, int64_t n, const AdamWScalars& s) {
  float m[kMomentBlock];
  float w[kMomentBlock];
  const float ms = *m_scale, vs = *v_scale;
  for (int64_t i = 0; i < n; ++i) {
    float mi = first_moment(m_codes[i], ms);
    float vi = second_moment(v_codes[i], vs);
    p[i] = from_float<T>(adamw_update(to_float(p[i]), to_float(g[i]), mi, vi, s));
    m[i] = mi;
    w[i] = sqrtf(sqrtf(vi));
  }
  float m_max = 0.f, w_max = 0.f;
  for (int64_t i = 0; i < n; ++i) {
    m_max = sticky_max(m_max, fabsf(m[i]));
    w_max = sticky_max(w_max, fabsf(w[i]));
  }
  const float new_ms = m_max / 127.f, new_vs = w_max / 255.f;
  for (int64_t i = 0; i < n; ++i) {
    m_codes[i] = int8_t(moment_code(m[i], new_ms, -127.f, 127.f));
    v_codes[i] = uint8_t(moment_code(w[i], new_vs, 0.f, 255.f));
  }
  *m_scale = new_ms;
  *v_scale = new_vs;
}

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
