// lowrank_adamw_step_ on the CPU: a whole low-rank FRUGAL step of each tensor in one call:
// project the gradient (P^T g), AdamW on the compact moments, back-project the update and
// the projected gradient, the state-free rule on the residual and the weight decay.
//
// The GEMMs are plain loops over contiguous rows. The op is for many small matrices (the
// optimizers send it those only; large ones take torch's GEMMs and lowrank_step_): there
// a step of LLaMA-130M's 84 low-rank tensors spent its time in ~5 calls per tensor into
// torch (about 8 ms of host time at 1 thread, against 2 ms for fused AdamW's whole step),
// and the arithmetic of a 6x16 matrix at rank 2 is a few hundred FMAs.
#include <algorithm>
#include <vector>

#include "kernels.h"
#include "parallel.h"

namespace frugal {
namespace cpu {
namespace FK_CPU_ISA {

namespace {

// The projected gradient low = P^T g (the gradient as stored, then unscaled: the order of
// the two-call path, which projects the stored gradient and multiplies the result).
template <typename T>
void project_down(const T* g, const float* P, int64_t rows, int64_t cols, int64_t rank, bool right,
                  float inv_grad_scale, float* low, float* row) {
  if (right) {
    // P [rank, cols]: low[i, k] = <g[i, :], P[k, :]>.
    for (int64_t i = 0; i < rows; ++i) {
      for (int64_t j = 0; j < cols; ++j) row[j] = to_float(g[i * cols + j]);
      for (int64_t k = 0; k < rank; ++k) {
        const float* pk = P + k * cols;
        float acc = 0.f;
        for (int64_t j = 0; j < cols; ++j) acc += row[j] * pk[j];
        low[i * rank + k] = acc * inv_grad_scale;
      }
    }
    return;
  }
  // P [rows, rank]: low[k, :] = sum_i P[i, k] g[i, :].
  std::fill(low, low + rank * cols, 0.f);
  for (int64_t i = 0; i < rows; ++i) {
    for (int64_t j = 0; j < cols; ++j) row[j] = to_float(g[i * cols + j]);
    for (int64_t k = 0; k < rank; ++k) {
      const float w = P[i * rank + k];
      float* lk = low + k * cols;
      for (int64_t j = 0; j < cols; ++j) lk[j] += w * row[j];
    }
  }
  for (int64_t e = 0; e < rank * cols; ++e) low[e] *= inv_grad_scale;
}

template <typename T, StateFree Mode>
void step_tensor(T* p, const T* g, float* m, float* v, const float* P, int64_t rows, int64_t cols,
                 int64_t rank, bool right, const FrugalScalars& s) {
  const int64_t compact = right ? rows * rank : rank * cols;
  std::vector<float> low(compact), update(compact), scratch(3 * cols);
  float* row = scratch.data();
  float* up_update = row + cols;
  float* up_grad = up_update + cols;
  project_down(g, P, rows, cols, rank, right, s.state_free.inv_grad_scale, low.data(), row);
  // AdamW on a zero "parameter" without decay leaves exactly the update, as the two-call
  // path's adamw_ on zeros does; the projected gradient is unscaled already.
  AdamWScalars a = s.adamw;
  a.decay = 1.f;
  a.inv_grad_scale = 1.f;
  for (int64_t e = 0; e < compact; ++e) {
    float me = m[e], ve = v[e];
    update[e] = adamw_update(0.f, low[e], me, ve, a);
    m[e] = me;
    v[e] = ve;
  }
  // Row by row: the back-projections of the row (P's rows weighted by the row's compact
  // values, or the compact rows weighted by P's row), then the weight update.
  for (int64_t i = 0; i < rows; ++i) {
    std::fill(up_update, up_update + 2 * cols, 0.f);
    for (int64_t k = 0; k < rank; ++k) {
      const float* src_u = right ? P + k * cols : update.data() + k * cols;
      const float* src_g = right ? P + k * cols : low.data() + k * cols;
      const float wu = right ? update[i * rank + k] : P[i * rank + k];
      const float wg = right ? low[i * rank + k] : wu;
      for (int64_t j = 0; j < cols; ++j) {
        up_update[j] += wu * src_u[j];
        up_grad[j] += wg * src_g[j];
      }
    }
    T* pi = p + i * cols;
    const T* gi = g + i * cols;
    for (int64_t j = 0; j < cols; ++j) {
      pi[j] = from_float<T>(lowrank_update<Mode>(to_float(pi[j]), to_float(gi[j]), up_update[j],
                                                 up_grad[j], s.state_free));
    }
  }
}

template <typename T, StateFree Mode>
void run(const TensorBatch& t, const LowrankBatch& l, const FrugalScalars& s, int num_threads) {
  int64_t total = 0;
  for (int64_t i = 0; i < t.count; ++i) total += t.numel[i];
  const int threads = total < kMinParallelElements ? 1 : std::max(1, num_threads);
#if defined(_OPENMP)
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads) if (threads > 1)
#endif
  for (int64_t i = 0; i < t.count; ++i) {
    step_tensor<T, Mode>(typed<T>(t.params[i]), typed<T>(t.grads[i]), t.exp_avgs[i],
                         t.exp_avg_sqs[i], l.projections[i], l.rows[i], l.cols[i], l.rank[i],
                         l.sides[i] == 0, s);
  }
  (void)threads;
}

}  // namespace

void lowrank_adamw_step(const TensorBatch& t, const LowrankBatch& l, DType dtype,
                        const FrugalScalars& s, int num_threads) {
  dispatch_dtype(dtype, [&](auto tag) {
    using T = decltype(tag);
    switch (s.mode) {
      case StateFree::kSign: run<T, StateFree::kSign>(t, l, s, num_threads); break;
      case StateFree::kSgd: run<T, StateFree::kSgd>(t, l, s, num_threads); break;
      case StateFree::kNone: run<T, StateFree::kNone>(t, l, s, num_threads); break;
    }
  });
}

}  // namespace FK_CPU_ISA
}  // namespace cpu
}  // namespace frugal
