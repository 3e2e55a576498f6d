// adamw_ on the GPU: the launch parameter, the per-thread body and the host
// planning, shared by adamw.cu and the emulator.
#pragma once

#include <cstdint>

#include "fragment.cuh"
#include "multi_tensor.h"

namespace frugal {
namespace cuda {

// 256 threads x kIlp elements = 2048 elements per round, 8 rounds a block.
constexpr int kAdamWThreads = 256;
constexpr int64_t kAdamWChunk = 16384;

// 36 tensors x 40 bytes + 320 blocks x 5 bytes: about 3 KB.
struct AdamWMeta : LaunchMap<36, 320> {
  void* params[kMaxTensors];
  const void* grads[kMaxTensors];
  float* exp_avgs[kMaxTensors];
  float* exp_avg_sqs[kMaxTensors];
};

static_assert(sizeof(AdamWMeta) + sizeof(AdamWArgs) <= kMaxParamBytes,
              "adamw_ kernel parameters exceed 4 KB");

// Thread `tid` of block `block`: its share of that block's chunk.
template <typename T>
FK_HOST_DEVICE void adamw_thread(const AdamWMeta& meta, const AdamWArgs& args, int block, int tid,
                                 int nthreads) {
  if (skipped(args.device)) return;
  const BlockRange r = meta.range(block, kAdamWChunk);
  const int64_t n = r.end - r.begin;
  T* p = static_cast<T*>(meta.params[r.slot]) + r.begin;
  const T* g = static_cast<const T*>(meta.grads[r.slot]) + r.begin;
  float* m = meta.exp_avgs[r.slot] + r.begin;
  float* v = meta.exp_avg_sqs[r.slot] + r.begin;
  const bool aligned = aligned16(meta.params[r.slot]) && aligned16(meta.grads[r.slot]) &&
                       aligned16(meta.exp_avgs[r.slot]) && aligned16(meta.exp_avg_sqs[r.slot]);
  const AdamWScalars s = resolve(args);
  for (int64_t round = 0; round < n; round += round_size(nthreads)) {
    const Fragment f = fragment(round, n, aligned, tid, nthreads);
    float fp[kIlp] = {}, fg[kIlp] = {}, fm[kIlp] = {}, fv[kIlp] = {};
    load(p, f, fp);
    load(g, f, fg);
    load(m, f, fm);
    load(v, f, fv);
    FK_UNROLL
    for (int j = 0; j < kIlp; ++j) fp[j] = adamw_update(fp[j], fg[j], fm[j], fv[j], s);
    store(p, f, fp);
    store(m, f, fm);
    store(v, f, fv);
  }
}

// Host: plans the launches of one call; launch(meta, num_blocks).
template <typename Launch>
int64_t plan_adamw(const TensorBatch& t, Launch&& launch) {
  return plan_launches<AdamWMeta>(
      t.count, t.numel, kAdamWChunk,
      [&](AdamWMeta& meta, int slot, int64_t i) {
        meta.params[slot] = t.params[i];
        meta.grads[slot] = t.grads[i];
        meta.exp_avgs[slot] = t.exp_avgs[i];
        meta.exp_avg_sqs[slot] = t.exp_avg_sqs[i];
      },
      launch);
}

}  // namespace cuda
}  // namespace frugal
