// frugal_step_ on the CPU: the fused FRUGAL update in one pass over memory.
//
// Each chunk is walked in blocks small enough to stay in L1. In a block the
// state-full members (found with two binary searches, frugal_tile.h) get
// AdamW and the rest get the state-free rule; every coordinate of p and g is
// read once from memory and p is written once.
#include "kernels.h"
#include "loops.h"
#include "parallel.h"

namespace frugal {
namespace cpu {
namespace FK_CPU_ISA {

namespace {

constexpr int64_t kBlock = 2048;

// Gathers and scatters of the gathered path stay scalar: on current x86
// cores vector gather and scatter instructions are slower than one load or
// store per element.
template <typename T>
FK_NOVECTOR void gather(const T* __restrict__ p, const T* __restrict__ g,
                        const int32_t* __restrict__ pos, int64_t n, float* __restrict__ bp,
                        float* __restrict__ bg) {
  for (int64_t i = 0; i < n; ++i) {
    bp[i] = to_float(p[pos[i]]);
    bg[i] = to_float(g[pos[i]]);
  }
}

template <typename T>
FK_NOVECTOR void scatter(T* __restrict__ p, const int32_t* __restrict__ pos, int64_t n,
                         const float* __restrict__ values) {
  for (int64_t i = 0; i < n; ++i) p[pos[i]] = from_float<T>(values[i]);
}

template <typename T, typename Index, StateFree Mode>
struct Block {
  T* p;
  const T* g;
  float* m;
  float* v;
  const Index* idx;
  SubsetShape shape;
  FrugalScalars s;

  // Process [a, b); returns where the next block's search should start.
  int64_t operator()(int64_t a, int64_t b, int64_t guess) const {
    const TileMembers tm = tile_members(shape, idx, a, b, guess);
    if (tm.q_begin == tm.q_end) {
      state_free_range<T, Mode>(p + a, g + a, b - a, s.state_free);
    } else if (shape.kind == SubsetKind::kRows && shape.cols > 1) {
      rows_in_place(tm, a, b);
    } else {
      gathered(tm, a, b);
    }
    // The next block's first member row is at or after this block's.
    return tm.outer_base;
  }

  // Member rows are contiguous runs of p and of the state: alternate the two
  // rules over the block without any gather.
  void rows_in_place(const TileMembers& tm, int64_t a, int64_t b) const {
    const int64_t C = shape.cols;
    int64_t cursor = a;
    for (int64_t q = tm.q_begin; q < tm.q_end;) {
      const int64_t outer = q / C;
      const int64_t c = q - outer * C;
      const int64_t run = std::min(tm.q_end, (outer + 1) * C) - q;
      const int64_t j = tm.outer_base + outer;
      const int64_t pos = int64_t(idx[j]) * C + c;
      state_free_range<T, Mode>(p + cursor, g + cursor, pos - cursor, s.state_free);
      adamw_range(p + pos, g + pos, m + j * C + c, v + j * C + c, run, s.adamw);
      cursor = pos + run;
      q += run;
    }
    state_free_range<T, Mode>(p + cursor, g + cursor, b - cursor, s.state_free);
  }

  // Members scattered over the block (columns, flat coordinates): AdamW them
  // in fp32 buffers, run the state-free rule over the whole block, then store
  // the AdamW results over it. All passes but the first touch only L1.
  void gathered(const TileMembers& tm, int64_t a, int64_t b) const {
    int32_t pos[kBlock];
    float bp[kBlock], bg[kBlock];
    const int64_t n = tm.q_end - tm.q_begin;
    member_positions(tm, a, pos);
    const int64_t slot = tm.slot_base + tm.q_begin;
    gather(p + a, g + a, pos, n, bp, bg);
    adamw_range(bp, bg, m + slot, v + slot, n, s.adamw);
    state_free_range<T, Mode>(p + a, g + a, b - a, s.state_free);
    scatter(p + a, pos, n, bp);
  }

  // Positions, relative to a, of the members of a gathered block (columns, or
  // rows of length 1), in member order.
  void member_positions(const TileMembers& tm, int64_t a, int32_t* pos) const {
    if (shape.kind == SubsetKind::kRows) {
      const Index* ids = idx + tm.outer_base + tm.q_begin;
      for (int64_t i = 0; i < tm.q_end - tm.q_begin; ++i) pos[i] = int32_t(int64_t(ids[i]) - a);
      return;
    }
    const int64_t k = shape.k;
    for (int64_t q = tm.q_begin; q < tm.q_end;) {
      const int64_t outer = q / k;
      const int64_t j = q - outer * k;
      const int64_t run = std::min(tm.q_end, (outer + 1) * k) - q;
      const int64_t base = (tm.outer_base + outer) * shape.cols - a;
      for (int64_t i = 0; i < run; ++i) pos[i] = int32_t(base + int64_t(idx[j + i]));
      pos += run;
      q += run;
    }
  }
};

template <typename T, typename Index, StateFree Mode>
void run_batch(const TensorBatch& t, const SubsetBatch& sub, const FrugalScalars& s, int num_threads) {
  for_each_chunk(t.count, t.numel, kChunk, num_threads, [&](int64_t i, int64_t b, int64_t e) {
    const Block<T, Index, Mode> block{
        typed<T>(t.params[i]), typed<T>(t.grads[i]), t.exp_avgs[i], t.exp_avg_sqs[i],
        static_cast<const Index*>(sub.indices[i]),
        SubsetShape{sub.kind, sub.rows[i], sub.cols[i], sub.k[i]}, s};
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
