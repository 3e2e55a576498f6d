// The argument (batch) structs of the kernels, shared by the CPU and CUDA layers: the
// tensors of one call as raw pointers and sizes, and the scalars of a FRUGAL split.
#pragma once

#include <cstdint>

#include "frugal/common.h"
#include "frugal/frugal_tile.h"
#include "frugal/update_rules.h"

namespace frugal {

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

}  // namespace frugal
