// grad_norm on the GPU: the launch parameters, the block bodies and the host
// planning, shared by grad_norm.cu and the emulator.
//
// Two kernels, both reading only: the first gives every chunk of every
// gradient one double partial result (the arithmetic of frugal/norm.h), written
// to a buffer the caller owns at the block's place in the whole call; the
// second, one block, combines the buffer into the norm and the non-finite flag.
// Every sum runs in an order fixed by the block decomposition alone (a thread's
// elements in order, then a tree over the threads, then the partials in order),
// so the result has the same bits on every run, and nothing waits on the host.
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>
#include <type_traits>

#include "fragment.cuh"
#include "frugal/norm.h"
#include "multi_tensor.h"

namespace frugal {
namespace cuda {

constexpr int kGradNormThreads = 256;
// A read-only pass: larger chunks than the update kernels', fewer partials.
constexpr int64_t kGradNormChunk = 32768;

// 64 tensors x 16 bytes + 320 blocks x 5 bytes + the buffer: about 2.7 KB.
struct GradNormMeta : LaunchMap<64, 320> {
  const void* grads[kMaxTensors];
  double* partials;       // where this launch's block 0 writes
};

static_assert(sizeof(GradNormMeta) <= kMaxParamBytes, "grad_norm kernel parameters exceed 4 KB");

struct GradNormShared {
  double acc[kGradNormThreads];
};

// The tree over the threads' results: each level a phase (a barrier on the GPU).
template <bool Max, typename Run>
FK_HOST_DEVICE void reduce_threads(GradNormShared& sh, int nthreads, Run&& run) {
  for (int width = nthreads / 2; width > 0; width /= 2) {
    run([&](int tid) {
      if (tid < width) sh.acc[tid] = norm_combine<Max>(sh.acc[tid], sh.acc[tid + width]);
    });
  }
}

// One chunk of one gradient to one partial result.
template <typename T, bool Max, typename Run>
FK_HOST_DEVICE void grad_norm_block(const GradNormMeta& meta, int block, GradNormShared& sh,
                                    int nthreads, Run&& run) {
  const BlockRange r = meta.range(block, kGradNormChunk);
  const int64_t n = r.end - r.begin;
  const T* g = static_cast<const T*>(meta.grads[r.slot]) + r.begin;
  const bool aligned = aligned16(g);
  run([&](int tid) {
    double acc = 0.0;
    for (int64_t round = 0; round < n; round += round_size(nthreads)) {
      const Fragment f = fragment(round, n, aligned, tid, nthreads);
      float x[kIlp] = {};
      load(g, f, x);
      FK_UNROLL
      for (int j = 0; j < kIlp; ++j) {
        if (j < f.count) acc = norm_accumulate<Max>(acc, double(x[j]));
      }
    }
    sh.acc[tid] = acc;
  });
  reduce_threads<Max>(sh, nthreads, run);
  run([&](int tid) {
    if (tid == 0) meta.partials[block] = sh.acc[0];
  });
}

// The partials [0, count) to the norm (0-dim float32) and GradScaler's
// found_inf (float32), in one block.
struct GradNormFinish {
  const double* partials;
  int64_t count;
  float* norm;
  float* found_inf;
};

template <bool Max, typename Run>
FK_HOST_DEVICE void grad_norm_finish_block(const GradNormFinish& f, GradNormShared& sh,
                                           int nthreads, Run&& run) {
  run([&](int tid) {
    double acc = 0.0;
    for (int64_t i = tid; i < f.count; i += nthreads) acc = norm_combine<Max>(acc, f.partials[i]);
    sh.acc[tid] = acc;
  });
  reduce_threads<Max>(sh, nthreads, run);
  run([&](int tid) {
    if (tid != 0) return;
    const double norm = norm_of_total(sh.acc[0], Max);
    *f.norm = float(norm);
    *f.found_inf = norm_found_inf(norm);
  });
}

// The partial results a call over tensors of these sizes writes, refused when
// the caller's buffer holds fewer.
inline int64_t grad_norm_partials(const int64_t* numel, int64_t count, int64_t capacity) {
  int64_t blocks = 0;
  for (int64_t i = 0; i < count; ++i) blocks += (numel[i] + kGradNormChunk - 1) / kGradNormChunk;
  if (blocks > capacity) {
    throw std::invalid_argument("grad_norm: " + std::to_string(blocks) +
                                " partial results for a buffer of " + std::to_string(capacity));
  }
  return blocks;
}

// Plans the launches of one dtype's gradients; launch(meta, blocks) runs one,
// with meta.partials already at its first block's place in `partials`.
template <typename Launch>
int64_t plan_grad_norm(const void* const* grads, const int64_t* numel, int64_t count,
                       double* partials, Launch&& launch) {
  int64_t written = 0;
  return plan_launches<GradNormMeta>(
      count, numel, kGradNormChunk,
      [&](GradNormMeta& meta, int slot, int64_t i) { meta.grads[slot] = grads[i]; },
      [&](GradNormMeta& meta, int blocks) {
        meta.partials = partials + written;
        launch(static_cast<const GradNormMeta&>(meta), blocks);
        written += blocks;
      });
}

template <typename Fn>
void with_norm_kind(bool max_norm, Fn&& fn) {
  if (max_norm) {
    fn(std::true_type{});
  } else {
    fn(std::false_type{});
  }
}

}  // namespace cuda
}  // namespace frugal
