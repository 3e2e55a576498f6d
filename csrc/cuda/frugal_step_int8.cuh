// frugal_step_int8_ on the GPU: the launch parameters, the bodies and the host
// planning, shared by frugal_step_int8.cu and the emulator.
//
// Two launches of one call, on one stream, over disjoint coordinates:
//   1. frugal_step_'s blocks (frugal_step.cuh) with Members = false: every
//      coordinate outside the subset takes the state-free rule, the members keep
//      their params (written back as read);
//   2. the members, one warp per block of their 8-bit moments, the warp program
//      of adamw_int8_ (adamw_int8.cuh) over the compact state cut into moment
//      blocks along its rows. A block of a rows subset of a tensor of two dims or
//      more is one run of a member row (its params move 16 bytes at a time where
//      the addresses allow); any other block's params are gathered and scattered
//      one coordinate at a time.
// The members' params and gradients are read twice, by launch 1 and by launch 2
// (a quarter more bytes at rho 0.25); one launch that found each tile's moment
// blocks would read them once.
#pragma once

#include <cstdint>
#include <vector>

#include "adamw_int8.cuh"
#include "frugal_step.cuh"

namespace frugal {
namespace cuda {

// Moment blocks a thread block of launch 2 owns, as adamw_int8_'s.
constexpr int64_t kFrugalInt8Chunk = kAdamWInt8Chunk;

// 24 tensors x 88 bytes + 320 blocks x 5 bytes: about 3.7 KB. numel counts
// moment blocks of the compact state.
struct FrugalInt8Meta : LaunchMap<24, 320> {
  void* params[kMaxTensors];
  const void* grads[kMaxTensors];
  const void* indices[kMaxTensors];
  int8_t* exp_avgs[kMaxTensors];
  float* exp_avg_scales[kMaxTensors];
  uint8_t* exp_avg_sqs[kMaxTensors];
  float* exp_avg_sq_scales[kMaxTensors];
  int64_t state_cols[kMaxTensors];  // the compact state's row length (MomentBlocks' cols)
  int64_t cols[kMaxTensors];        // C of the tensor's [R, C]
  int64_t k[kMaxTensors];
};

static_assert(sizeof(FrugalInt8Meta) + sizeof(FrugalArgs) <= kMaxParamBytes,
              "frugal_step_int8_ kernel parameters exceed 4 KB");

// q / d for the non-negative int64 operands of an index, in 32 bits when both
// fit: a 64-bit division is a long software sequence on the GPU.
FK_HOST_DEVICE int64_t index_quotient(int64_t q, int64_t d) {
  if (((q | d) >> 31) == 0) return int64_t(uint32_t(q) / uint32_t(d));
  return q / d;
}

// A moment block whose params are spread over the tensor: element e of the
// compact state (row-major) is the member coordinate
//   rows:    (idx[e / C], e % C)      (C = 1: the flat position idx[e])
//   columns: (e / k, idx[e % k])
// of the tensor's [R, C]. The fragments take the strided layout, one scalar
// access per coordinate.
template <typename T, typename Index>
struct GatheredBlock8 {
  T* p;
  const T* g;
  const Index* idx;
  SubsetKind kind;
  int64_t cols;
  int64_t k;
  int64_t first;  // the block's first element of the compact state
  int8_t* m;
  uint8_t* v;
  float* m_scale;
  float* v_scale;
  int64_t n;
  bool aligned;

  FK_HOST_DEVICE int64_t position(int64_t e) const {
    if (kind == SubsetKind::kRows) {
      const int64_t j = index_quotient(e, cols);
      return int64_t(idx[j]) * cols + (e - j * cols);
    }
    const int64_t r = index_quotient(e, k);
    return r * cols + int64_t(idx[e - r * k]);
  }

  FK_HOST_DEVICE void load_pg(const Fragment& f, float (&fp)[kIlp], float (&fg)[kIlp]) const {
    FK_UNROLL
    for (int j = 0; j < kIlp; ++j) {
      if (j < f.count) {
        const int64_t at = position(first + f.offset + j * f.stride);
        fp[j] = to_float(p[at]);
        fg[j] = to_float(g[at]);
      }
    }
  }

  FK_HOST_DEVICE void store_p(const Fragment& f, const float (&fp)[kIlp]) const {
    FK_UNROLL
    for (int j = 0; j < kIlp; ++j) {
      if (j < f.count) p[position(first + f.offset + j * f.stride)] = from_float<T>(fp[j]);
    }
  }
};

template <typename T, typename Index>
struct FrugalInt8Warp {
  T* p;
  const T* g;
  const Index* idx;
  int8_t* m;
  float* m_scales;
  uint8_t* v;
  float* v_scales;
  int64_t state_cols;
  int64_t cols;
  int64_t k;
  SubsetKind kind;
  bool member_rows;  // the compact state's rows are member rows of p
  int64_t begin;     // the thread block's moment blocks in its tensor
  int64_t end;
  int warp;
  bool skip;
  AdamWScalars s;

  FK_HOST_DEVICE FrugalInt8Warp(const FrugalInt8Meta& meta, const FrugalArgs& args, int block,
                                int warp_)
      : warp(warp_) {
    const BlockRange r = meta.range(block, kFrugalInt8Chunk);
    p = static_cast<T*>(meta.params[r.slot]);
    g = static_cast<const T*>(meta.grads[r.slot]);
    idx = static_cast<const Index*>(meta.indices[r.slot]);
    m = meta.exp_avgs[r.slot];
    m_scales = meta.exp_avg_scales[r.slot];
    v = meta.exp_avg_sqs[r.slot];
    v_scales = meta.exp_avg_sq_scales[r.slot];
    state_cols = meta.state_cols[r.slot];
    cols = meta.cols[r.slot];
    k = meta.k[r.slot];
    kind = args.kind;
    // As the CPU kernel's in-place walk: a rows subset whose state rows are C long
    // (every tensor of two dims or more; a 1-D one has one state row of k).
    member_rows = kind == SubsetKind::kRows && state_cols == cols;
    begin = r.begin;
    end = r.end;
    skip = skipped(args.device);
    s = resolve(args).adamw;
  }

  template <typename Run>
  FK_HOST_DEVICE void run_phases(Int8WarpShared& sh, Run&& run) const {
    if (skip) return;
    // One branch per thread block: the lanes of a warp never diverge on it.
    if (member_rows) {
      moments8_warp(sh, begin, end, warp, s, [&](int64_t b) {
        const BlockPlace at = block_place(state_cols, b);
        const int64_t row = index_quotient(at.first, cols);
        const int64_t from = int64_t(idx[row]) * cols + (at.first - row * cols);
        return MomentBlock8<T>(p + from, g + from, m + at.first, v + at.first, m_scales + b,
                               v_scales + b, at.n);
      }, run);
      return;
    }
    moments8_warp(sh, begin, end, warp, s, [&](int64_t b) {
      const BlockPlace at = block_place(state_cols, b);
      return GatheredBlock8<T, Index>{p, g, idx, kind, cols, k, at.first, m + at.first,
                                      v + at.first, m_scales + b, v_scales + b, at.n, false};
    }, run);
  }
};

// Host: plans launch 2 of one call; launch(meta, num_blocks). `blocks` is
// moment_blocks(q, t.count).
template <typename Launch>
int64_t plan_frugal_int8_members(const TensorBatch& t, const SubsetBatch& sub,
                                 const Moments8Batch& q, const int64_t* blocks, Launch&& launch) {
  return plan_launches<FrugalInt8Meta>(
      t.count, blocks, kFrugalInt8Chunk,
      [&](FrugalInt8Meta& meta, int slot, int64_t i) {
        meta.params[slot] = t.params[i];
        meta.grads[slot] = t.grads[i];
        meta.indices[slot] = sub.indices[i];
        meta.exp_avgs[slot] = q.exp_avgs[i];
        meta.exp_avg_scales[slot] = q.exp_avg_scales[i];
        meta.exp_avg_sqs[slot] = q.exp_avg_sqs[i];
        meta.exp_avg_sq_scales[slot] = q.exp_avg_sq_scales[i];
        meta.state_cols[slot] = q.cols[i];
        meta.cols[slot] = sub.cols[i];
        meta.k[slot] = sub.k[i];
      },
      launch);
}

// The batch of launch 1: t without moments (frugal_step_'s planner copies their
// pointers, which Members = false never reads). `none` outlives the batch.
inline TensorBatch without_moments(const TensorBatch& t, std::vector<float*>& none) {
  none.assign(static_cast<size_t>(t.count), nullptr);
  return TensorBatch{t.count, t.params, t.grads, none.data(), none.data(), t.numel};
}

}  // namespace cuda
}  // namespace frugal
