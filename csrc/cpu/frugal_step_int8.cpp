// frugal_step_int8_ on the CPU: FRUGAL's split step with the state-full subset's
// moments as 8-bit codes (frugal/moments8.h), in one pass over each tensor.
//
// The moments of a subset are a matrix of their own (the compact state of
// frugal_step_, in the order of the indices) cut into blocks along its rows as
// adamw_int8_ cuts a tensor, and each block takes adamw_int8_'s block math
// (moments8_block.h). Two walks:
//   - rows of a tensor of two dims or more: a moment row is a member row of the
//     param, contiguous, so its blocks update p in place; the rows between the
//     members take the state-free rule;
//   - columns (and rows of a 1-D tensor): a moment row's coordinates are spread
//     over whole param rows, so they are gathered into fp32 buffers, updated there,
//     the param rows take the state-free rule, and the AdamW results are scattered
//     over it.
#include <algorithm>
#include <vector>

#include "frugal_block.h"
#include "moments8_block.h"

namespace frugal {
namespace cpu {
namespace FK_CPU_ISA {

namespace {

// Units [u0, u1) of tensor i: param rows (in-place walk) or moment rows (gathered).
struct Run {
  int64_t tensor;
  int64_t u0;
  int64_t u1;
};

// Whether tensor i's member rows are its moment rows, contiguous in p.
inline bool in_place(const SubsetBatch& sub, const Moments8Batch& q, int64_t i) {
  return sub.kind == SubsetKind::kRows && q.rows[i] == sub.k[i] && q.cols[i] == sub.cols[i];
}

template <typename T, typename Index, StateFree Mode>
void rows_in_place(const TensorBatch& t, const SubsetBatch& sub, const Moments8Batch& q,
                   const FrugalScalars& s, const Run& run) {
  const int64_t i = run.tensor, C = sub.cols[i], k = sub.k[i];
  const int64_t per_row = (C + kMomentBlock - 1) / kMomentBlock;
  const Index* idx = static_cast<const Index*>(sub.indices[i]);
  T* p = typed<T>(t.params[i]);
  const T* g = typed<T>(t.grads[i]);
  int64_t j = lower_bound_near(idx, k, run.u0, uniform_guess({sub.kind, sub.rows[i], C, k}, run.u0));
  int64_t r = run.u0;
  while (r < run.u1) {
    const int64_t next = j < k ? std::min(run.u1, int64_t(idx[j])) : run.u1;
    if (next > r) {
      state_free_range<T, Mode>(p + r * C, g + r * C, (next - r) * C, s.state_free);
      r = next;
      continue;
    }
    adamw_int8_row(p + r * C, g + r * C, q.exp_avgs[i] + j * C, q.exp_avg_scales[i] + j * per_row,
                   q.exp_avg_sqs[i] + j * C, q.exp_avg_sq_scales[i] + j * per_row, C, s.adamw);
    ++j;
    ++r;
  }
}

// The flat positions in p of moment row r's slots (the subset's enumeration), without
// a division per slot (two int64 divisions per member: without them a columns step took
// 0.90x (fp32) and 0.81x (bf16) the CPU time):
// columns: the row's `cols / k` param rows, each with the member columns idx[0..k);
// rows of a 1-D tensor (C = 1, one moment row): the ids themselves.
template <typename Index>
inline void slot_positions(const SubsetBatch& sub, const Index* idx, int64_t i, int64_t r,
                           int64_t cols, int64_t* pos) {
  if (sub.kind == SubsetKind::kRows) {
    for (int64_t c = 0; c < cols; ++c) pos[c] = int64_t(idx[c]);
    return;
  }
  const int64_t C = sub.cols[i], k = sub.k[i], per = cols / k;
  for (int64_t t = 0; t < per; ++t) {
    const int64_t base = (r * per + t) * C;
    for (int64_t j = 0; j < k; ++j) pos[t * k + j] = base + int64_t(idx[j]);
  }
}

template <typename T, typename Index, StateFree Mode>
void gathered(const TensorBatch& t, const SubsetBatch& sub, const Moments8Batch& q,
              const FrugalScalars& s, const Run& run) {
  const int64_t i = run.tensor, cols = q.cols[i];
  const int64_t per_row = (cols + kMomentBlock - 1) / kMomentBlock;
  // The param coordinates of one moment row: whole param rows (columns), or the
  // whole tensor (rows of a 1-D tensor, whose moments are one row).
  const int64_t span = sub.rows[i] * sub.cols[i] / q.rows[i];
  const Index* idx = static_cast<const Index*>(sub.indices[i]);
  T* p = typed<T>(t.params[i]);
  const T* g = typed<T>(t.grads[i]);
  std::vector<int64_t> pos(static_cast<size_t>(cols));
  std::vector<float> bp(static_cast<size_t>(cols)), bg(static_cast<size_t>(cols));
  for (int64_t r = run.u0; r < run.u1; ++r) {
    slot_positions(sub, idx, i, r, cols, pos.data());
    for (int64_t c = 0; c < cols; ++c) {
      bp[size_t(c)] = member_value(p[pos[size_t(c)]]);
      bg[size_t(c)] = member_value(g[pos[size_t(c)]]);
    }
    adamw_int8_row(bp.data(), static_cast<const float*>(bg.data()), q.exp_avgs[i] + r * cols,
                   q.exp_avg_scales[i] + r * per_row, q.exp_avg_sqs[i] + r * cols,
                   q.exp_avg_sq_scales[i] + r * per_row, cols, s.adamw);
    state_free_range<T, Mode>(p + r * span, g + r * span, span, s.state_free);
    for (int64_t c = 0; c < cols; ++c) p[pos[size_t(c)]] = member_result<T>(bp[size_t(c)]);
  }
}

template <typename T, typename Index, StateFree Mode>
void run_batch(const TensorBatch& t, const SubsetBatch& sub, const Moments8Batch& q,
               const FrugalScalars& s, int num_threads) {
  // Runs of about kChunk coordinates of p: whole units, so no block is split.
  std::vector<Run> runs;
  int64_t total = 0;
  for (int64_t i = 0; i < t.count; ++i) {
    total += t.numel[i];
    if (t.numel[i] == 0) continue;
    const bool rows = in_place(sub, q, i) || sub.k[i] == 0;
    const int64_t units = rows ? sub.rows[i] : q.rows[i];
    const int64_t unit_size = t.numel[i] / units;
    const int64_t per_run = std::max<int64_t>(1, kChunk / std::max<int64_t>(1, unit_size));
    for (int64_t u = 0; u < units; u += per_run) runs.push_back({i, u, std::min(units, u + per_run)});
  }
  const int64_t n = int64_t(runs.size());
  const int threads = total < kMinParallelElements ? 1 : std::max(1, num_threads);
#if defined(_OPENMP)
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
#endif
  for (int64_t j = 0; j < n; ++j) {
    const Run& run = runs[size_t(j)];
    if (in_place(sub, q, run.tensor) || sub.k[run.tensor] == 0) {
      rows_in_place<T, Index, Mode>(t, sub, q, s, run);
    } else {
      gathered<T, Index, Mode>(t, sub, q, s, run);
    }
  }
  (void)threads;
}

template <typename T, typename Index>
void run_mode(const TensorBatch& t, const SubsetBatch& sub, const Moments8Batch& q,
              const FrugalScalars& s, int num_threads) {
  switch (s.mode) {
    case StateFree::kSign: run_batch<T, Index, StateFree::kSign>(t, sub, q, s, num_threads); break;
    case StateFree::kSgd: run_batch<T, Index, StateFree::kSgd>(t, sub, q, s, num_threads); break;
    case StateFree::kNone: run_batch<T, Index, StateFree::kNone>(t, sub, q, s, num_threads); break;
  }
}

}  // namespace

void frugal_step_int8(const TensorBatch& t, const SubsetBatch& sub, const Moments8Batch& q,
                      DType dtype, const FrugalScalars& s, int num_threads) {
  dispatch_dtype(dtype, [&](auto tag) {
    using T = decltype(tag);
    if (sub.index_is_int32) {
      run_mode<T, int32_t>(t, sub, q, s, num_threads);
    } else {
      run_mode<T, int64_t>(t, sub, q, s, num_threads);
    }
  });
}

}  // namespace FK_CPU_ISA
}  // namespace cpu
}  // namespace frugal
