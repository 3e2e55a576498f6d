// Entry points of the CPU kernels. Each is compiled once per ISA level (see
// CMakeLists.txt) into its own namespace; dispatch.cpp picks one at run time.
#pragma once

#include <cstdint>

#include "frugal/common.h"
#include "frugal/frugal_tile.h"
#include "frugal/quant.h"
#include "frugal/update_rules.h"

namespace frugal {
namespace cpu {

// A batch of same-dtype tensors given as raw pointers; `numel[i]` elements each.
struct TensorBatch {
  int64_t count;
  void* const* params;
  const void* const* grads;
  float* const* exp_avgs;
  float* const* exp_avg_sqs;
  const int64_t* numel;
};

// The state-full subsets of a FRUGAL step, one per tensor of the batch.
struct SubsetBatch {
  SubsetKind kind;
  bool index_is_int32;
  const void* const* indices;
  const int64_t* rows;
  const int64_t* cols;
  const int64_t* k;
};

// The quantization of the weights of a dqt_update_ call, one entry per tensor
// of its batch; the batch's params are then the packed codes (uint8, format
// of frugal/quant.h) and its dtype is the gradients'.
struct QuantBatch {
  const float* const* scales;
  const int64_t* scale_count;  // 1 (one scale per tensor) or rows (one per row)
  const int64_t* rows;
  const int64_t* cols;
  const uint32_t* seeds;
};

// The projections of a lowrank_adamw_step_ call, one per tensor of its batch: the tensor
// seen as a row-major matrix [rows, cols], its projection P [rank, cols] (side 0, right:
// orthonormal rows) or [rows, rank] (side 1, left: orthonormal columns), and its moments
// [rows, rank] or [rank, cols] in the batch's exp_avgs / exp_avg_sqs.
struct LowrankBatch {
  const float* const* projections;
  const int64_t* rows;
  const int64_t* cols;
  const int64_t* rank;
  const int64_t* sides;
};

struct FrugalScalars {
  AdamWScalars adamw;
  SignScalars state_free;
  StateFree mode;
};

FK_HOST_DEVICE FrugalScalars frugal_scalars(const FrugalHyper& h) {
  return FrugalScalars{adamw_scalars(h.adamw),
                       sign_scalars(h.adamw.lr, h.adamw.weight_decay, h.state_free_scale,
                                    h.adamw.grad_scale),
                       h.state_free};
}

#define FK_DECLARE_CPU_KERNELS(ns)                                                            \
  namespace ns {                                                                              \
  void adamw(const TensorBatch& t, DType dtype, const AdamWScalars& s, int num_threads);      \
  void sign_sgd(const TensorBatch& t, DType dtype, const SignScalars& s, int num_threads);    \
  void sgd(const TensorBatch& t, DType dtype, const SgdScalars& s, int num_threads);          \
  void frugal_step(const TensorBatch& t, const SubsetBatch& sub, DType dtype,                 \
                   const FrugalScalars& s, int num_threads);                                  \
  void lowrank_step(const TensorBatch& t, const float* const* up_updates,                     \
                    const float* const* up_grads, DType dtype, const SignScalars& s,          \
                    StateFree mode, int num_threads);                                         \
  void lowrank_adamw_step(const TensorBatch& t, const LowrankBatch& l, DType dtype,           \
                          const FrugalScalars& s, int num_threads);                           \
  void dqt_update(const TensorBatch& t, const SubsetBatch& sub, const QuantBatch& q,           \
                  DType grad_dtype, const FrugalScalars& s, int bits, uint32_t rng_step,      \
                  int num_threads);                                                           \
  void dequantize(const uint8_t* codes, const float* scales, int64_t scale_count, int64_t rows, \
                  int64_t cols, int bits, void* out, DType dtype, int num_threads);           \
  double grad_norm(const void* const* grads, const int64_t* numel, int64_t count, DType dtype, \
                   bool max_norm, int num_threads);                                           \
  }

FK_DECLARE_CPU_KERNELS(baseline)
#if defined(FK_HAVE_X86_LEVELS)
FK_DECLARE_CPU_KERNELS(avx2)
FK_DECLARE_CPU_KERNELS(avx512)
#endif

#undef FK_DECLARE_CPU_KERNELS

// The ISA levels compiled into this build, best first, and the one in use.
const char* const* isa_levels_built(int* count);
const char* isa_level_active();
// Select an ISA level by name ("auto" for the best the CPU supports). Returns
// false (and changes nothing) when it was not built or the CPU lacks it.
bool select_isa_level(const char* name);
bool openmp_enabled();

void adamw(const TensorBatch& t, DType dtype, const AdamWHyper& h, int num_threads);
void sign_sgd(const TensorBatch& t, DType dtype, const SignSgdHyper& h, int num_threads);
// SGD with momentum: the momentum buffers travel in t.exp_avgs (unread when
// h.momentum is 0, and then may be absent).
void sgd(const TensorBatch& t, DType dtype, const SgdHyper& h, int num_threads);
void frugal_step(const TensorBatch& t, const SubsetBatch& sub, DType dtype, const FrugalHyper& h,
                 int num_threads);
// The elementwise part of a low-rank FRUGAL step (the GEMMs run in torch):
// p = (p * decay - lr * scale * rule(g - up_grad)) + up_update, fp32 buffers.
void lowrank_step(const TensorBatch& t, const float* const* up_updates, const float* const* up_grads,
                  DType dtype, const LowrankHyper& h, int num_threads);
// A whole low-rank FRUGAL step (projection, AdamW on the compact moments, back-projection,
// the state-free rule on the residual), its GEMMs as plain loops: for small matrices.
void lowrank_adamw_step(const TensorBatch& t, const LowrankBatch& l, DType dtype,
                        const FrugalHyper& h, int num_threads);

// DQT's step on packed INT-n weights: dequantize, frugal_step (AdamW on the
// subset, the state-free rule elsewhere), round stochastically, pack.
void dqt_update(const TensorBatch& t, const SubsetBatch& sub, const QuantBatch& q, DType grad_dtype,
                const DqtHyper& h, int num_threads);

// Packed INT-n codes [rows, packed cols] with their scales (scale_count 1 or
// rows) to the weight W = s * q [rows, cols], written to `out` in `dtype`.
void dequantize(const uint8_t* codes, const float* scales, int64_t scale_count, int64_t rows,
                int64_t cols, int bits, void* out, DType dtype, int num_threads);

// The sum of squares (max_norm false) or the largest magnitude (true) of every element
// of `count` gradients of one dtype, in double: non-finite exactly when an element is.
double grad_norm(const void* const* grads, const int64_t* numel, int64_t count, DType dtype,
                 bool max_norm, int num_threads);

}  // namespace cpu
}  // namespace frugal
