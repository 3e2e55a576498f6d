// Entry points of the CPU kernels. Each is compiled once per ISA level (see
// CMakeLists.txt) into its own namespace; dispatch.cpp picks one at run time.
#pragma once

#include <cstdint>

#include "frugal/batch.h"
#include "frugal/common.h"
#include "frugal/frugal_tile.h"
#include "frugal/moments8.h"
#include "frugal/quant.h"
#include "frugal/update_rules.h"

namespace frugal {
namespace cpu {

#define FK_DECLARE_CPU_KERNELS(ns)                                                            \
  namespace ns {                                                                              \
  void adamw(const TensorBatch& t, DType dtype, const AdamWScalars& s, int num_threads);      \
  void adamw_int8(const TensorBatch& t, const Moments8Batch& q, DType dtype,                \
                  const AdamWScalars& s, int num_threads);                                    \
  void sign_sgd(const TensorBatch& t, DType dtype, const SignScalars& s, int num_threads);    \
  void sgd(const TensorBatch& t, DType dtype, const SgdScalars& s, int num_threads);          \
  void frugal_step(const TensorBatch& t, const SubsetBatch& sub, DType dtype,                 \
                   const FrugalScalars& s, int num_threads);                                  \
  void frugal_step_int8(const TensorBatch& t, const SubsetBatch& sub, const Moments8Batch& q,   \
                        DType dtype, const FrugalScalars& s, int num_threads);                \
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
// AdamW on 8-bit moments (frugal/moments8.h): the batch's params and grads, with the
// codes and scales in `q` (the batch's own moment pointers are unread).
void adamw_int8(const TensorBatch& t, const Moments8Batch& q, DType dtype, const AdamWHyper& h,
                int num_threads);
void sign_sgd(const TensorBatch& t, DType dtype, const SignSgdHyper& h, int num_threads);
// SGD with momentum: the momentum buffers travel in t.exp_avgs (unread when
// h.momentum is 0, and then may be absent).
void sgd(const TensorBatch& t, DType dtype, const SgdHyper& h, int num_threads);
void frugal_step(const TensorBatch& t, const SubsetBatch& sub, DType dtype, const FrugalHyper& h,
                 int num_threads);
// frugal_step with the subset's moments as 8-bit codes (frugal/moments8.h): `q` holds
// them, each seen as the [rows, cols] of its compact state's shape (the batch's own
// moment pointers are unread).
void frugal_step_int8(const TensorBatch& t, const SubsetBatch& sub, const Moments8Batch& q,
                      DType dtype, const FrugalHyper& h, int num_threads);
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
