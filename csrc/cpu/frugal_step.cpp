// frugal_step_ on the CPU: the fused FRUGAL update in one pass over memory.
//
// Each chunk is walked in blocks small enough to stay in L1. In a block the
// state-full members (found with two binary searches, frugal_tile.h) get
// AdamW and the rest get the state-free rule; every coordinate of p and g is
// read once from memory and p is written once.
#include <vector>

#include "frugal_block.h"

namespace frugal {
namespace cpu {
namespace FK_CPU_ISA {

namespace {

template <typename T, typename Index, StateFree Mode>
void run_batch(const TensorBatch& t, const SubsetBatch& sub, const FrugalScalars& s, int num_threads) {
  // The member lanes of each columns tensor, built once before the chunks
  // (every row, so every chunk, has the same members).
  std::vector<ColumnLanes> columns;
#if defined(__AVX512F__)
  if (sub.kind == SubsetKind::kColumns) {
    for (int64_t i = 0; i < t.count; ++i) {
      columns.emplace_back(static_cast<const Index*>(sub.indices[i]), sub.k[i], sub.cols[i]);
    }
  }
#endif
  for_each_chunk(t.count, t.numel, kChunk, num_threads, [&](int64_t i, int64_t b, int64_t e) {
    const Index* idx = static_cast<const Index*>(sub.indices[i]);
    const SubsetShape shape{sub.kind, sub.rows[i], sub.cols[i], sub.k[i]};
    const Block<T, Index, Mode> block{typed<T>(t.params[i]), typed<T>(t.grads[i]), t.exp_avgs[i],
                                      t.exp_avg_sqs[i], idx, shape, s,
                                      columns.empty() ? nullptr : &columns[size_t(i)]};
    int64_t guess = uniform_guess(block.shape, b / block.shape.cols);
    for (int64_t a = b; a < e; a += kBlock) guess = block(a, std::min(e, a + kBlock), guess);
  });
}

template <typename T, typename Index>
void run_mode(const TensorBatch& t, const SubsetBatch& sub, const FrugalScalars& s, int num_threads) {
  switch (s.mode) {
    case StateFree::kSign: run_batch<T, Index, StateFree::kSign>(t, sub, s, num_threads); break;
    case StateFree::kSgd: run_batch<T, Index, StateFree::kSgd>(t, sub, s, num_threads); break;
    case StateFree::kNone: run_batch<T, Index, StateFree::kNone>(t, sub, s, num_threads); break;
  }
}

}  // namespace

void frugal_step(const TensorBatch& t, const SubsetBatch& sub, DType dtype, const FrugalScalars& s,
                 int num_threads) {
  dispatch_dtype(dtype, [&](auto tag) {
    using T = decltype(tag);
    if (sub.index_is_int32) {
      run_mode<T, int32_t>(t, sub, s, num_threads);
    } else {
      run_mode<T, int64_t>(t, sub, s, num_threads);
    }
  });
}

}  // namespace FK_CPU_ISA
}  // namespace cpu
}  // namespace frugal
