// dqt_update_ on the CPU: DQT's step on packed INT-n weights in one pass.
//
// Each row is walked in segments of at most kBlock columns. A segment's codes
// are unpacked and dequantized into an fp32 buffer in L1, the FRUGAL block
// walk of frugal_step_ updates that buffer (AdamW on the state-full members,
// the state-free rule on the rest), and the result is rounded stochastically
// and packed back over the same bytes. No float copy of a weight outlives its
// segment: memory sees the codes (bits/8 bytes per weight, read and written),
// the gradient, and the moments of the state-full part.
#include <vector>

#include "frugal/quant.h"
#include "frugal_block.h"
#include "quant_fields.h"

namespace frugal {
namespace cpu {
namespace FK_CPU_ISA {

namespace {

// Stochastic rounding of w / scale with the uniforms of positions a .. a + n.
inline void quantize(const float* w, int64_t n, int qmax, float scale, uint32_t key, int64_t a,
                     uint8_t* fields) {
  for (int64_t i = 0; i < n; ++i) {
    fields[i] = round_to_field(w[i] / scale, rng_uniform(key, uint32_t(a + i)), qmax);
  }
}

template <typename G>
inline const float* as_fp32(const G* g, int64_t n, float* buffer) {
  if constexpr (std::is_same_v<G, float>) {
    return g;
  } else {
#if defined(__F16C__)
    if constexpr (std::is_same_v<G, fp16>) {
      half_to_float(g, buffer, n);
      return buffer;
    }
#endif
    for (int64_t i = 0; i < n; ++i) buffer[i] = to_float(g[i]);
    return buffer;
  }
}

// Whole rows [r0, r1) of tensor `tensor`: the unit of work of one thread
// (rows are packed independently, so threads never share a byte).
struct RowRun {
  int64_t tensor;
  int64_t r0;
  int64_t r1;
};

template <typename G, typename Index, StateFree Mode>
void run_rows(const TensorBatch& t, const SubsetBatch& sub, const QuantBatch& q,
              const FrugalScalars& s, int bits, uint32_t rng_step, const RowRun& run) {
  const int64_t i = run.tensor;
  const int64_t C = q.cols[i];
  const int qmax = quant_qmax(bits);
  const uint32_t key = rng_key(q.seeds[i], rng_step);
  uint8_t* codes = static_cast<uint8_t*>(t.params[i]);
  const G* grad = static_cast<const G*>(t.grads[i]);
  const Index* idx = static_cast<const Index*>(sub.indices[i]);
  const SubsetShape shape{sub.kind, sub.rows[i], sub.cols[i], sub.k[i]};
  ColumnLanes columns;
#if defined(__AVX512F__)
  if (shape.kind == SubsetKind::kColumns) columns = ColumnLanes(idx, shape.k, shape.cols);
#endif
  alignas(64) float w[kBlock];
  alignas(64) float gbuf[kBlock];
  alignas(64) uint8_t fields[kFieldRoom];
  const int64_t row_bytes = quant_packed_cols(C, bits);
  int64_t guess = uniform_guess(shape, run.r0 * C / shape.cols);
  for (int64_t r = run.r0; r < run.r1; ++r) {
    const float scale = q.scales[i][q.scale_count[i] == 1 ? 0 : r];
    for (int64_t c0 = 0; c0 < C; c0 += kBlock) {
      const int64_t n = std::min(kBlock, C - c0);
      const int64_t a = r * C + c0;
      // kBlock is a multiple of 8, so every segment starts on a byte.
      uint8_t* bytes = codes + r * row_bytes + c0 * bits / 8;
      unpack_fields(bytes, bits, n, fields);
      dequantize_fields(fields, n, qmax, scale, w);
      const float* g = as_fp32(grad + a, n, gbuf);
      const Block<float, Index, Mode> block{w, g, t.exp_avgs[i], t.exp_avg_sqs[i], idx, shape, s,
                                            &columns, a};
      guess = block(a, a + n, guess);
      quantize(w, n, qmax, scale, key, a, fields);
      pack_fields(fields, bits, n, bytes);
    }
  }
}

template <typename G, typename Index, StateFree Mode>
void run_batch(const TensorBatch& t, const SubsetBatch& sub, const QuantBatch& q,
               const FrugalScalars& s, int bits, uint32_t rng_step, int num_threads) {
  static_assert(kBlock % 8 == 0, "segments must start on a byte of every code width");
  std::vector<RowRun> runs;
  int64_t total = 0;
  for (int64_t i = 0; i < t.count; ++i) {
    const int64_t C = q.cols[i];
    if (q.rows[i] == 0 || C == 0) continue;
    const int64_t per_run = std::max<int64_t>(1, kChunk / C);
    for (int64_t r = 0; r < q.rows[i]; r += per_run) runs.push_back({i, r, std::min(q.rows[i], r + per_run)});
    total += q.rows[i] * C;
  }
  const int64_t n = int64_t(runs.size());
  const int threads = total < kMinParallelElements ? 1 : std::max(1, num_threads);
#if defined(_OPENMP)
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
#endif
  for (int64_t j = 0; j < n; ++j) run_rows<G, Index, Mode>(t, sub, q, s, bits, rng_step, runs[j]);
  (void)threads;
}

template <typename G, typename Index>
void run_mode(const TensorBatch& t, const SubsetBatch& sub, const QuantBatch& q,
              const FrugalScalars& s, int bits, uint32_t rng_step, int num_threads) {
  switch (s.mode) {
    case StateFree::kSign: run_batch<G, Index, StateFree::kSign>(t, sub, q, s, bits, rng_step, num_threads); break;
    case StateFree::kSgd: run_batch<G, Index, StateFree::kSgd>(t, sub, q, s, bits, rng_step, num_threads); break;
    case StateFree::kNone: run_batch<G, Index, StateFree::kNone>(t, sub, q, s, bits, rng_step, num_threads); break;
  }
}

}  // namespace

void dqt_update(const TensorBatch& t, const SubsetBatch& sub, const QuantBatch& q, DType grad_dtype,
                const FrugalScalars& s, int bits, uint32_t rng_step, int num_threads) {
  dispatch_dtype(grad_dtype, [&](auto tag) {
    using G = decltype(tag);
    if (sub.index_is_int32) {
      run_mode<G, int32_t>(t, sub, q, s, bits, rng_step, num_threads);
    } else {
      run_mode<G, int64_t>(t, sub, q, s, bits, rng_step, num_threads);
    }
  });
}

}  // namespace FK_CPU_ISA
}  // namespace cpu
}  // namespace frugal
