// sign_sgd_ on the GPU: the launch parameter, the per-thread body and the
// host planning, shared by sign_sgd.cu and the emulator.
#pragma once

#include <cstdint>

#include "fragment.cuh"
#include "multi_tensor.h"

namespace frugal {
namespace cuda {

constexpr int kSignSgdThreads = 256;
constexpr int64_t kSignSgdChunk = 16384;

// 64 tensors x 24 bytes + 320 blocks x 5 bytes: about 3 KB.
struct SignSgdMeta : LaunchMap<64, 320> {
  void* params[kMaxTensors];
  const void* grads[kMaxTensors];
};

struct SignSgdArgs {
  SignScalars scalars;
  double weight_decay;
  double scale;
  const float* lr;  // on the device, or null: use `scalars`
};

static_assert(sizeof(SignSgdMeta) + sizeof(SignSgdArgs) <= kMaxParamBytes,
              "sign_sgd_ kernel parameters exceed 4 KB");

inline SignSgdArgs sign_sgd_args(const SignSgdHyper& h, const DeviceScalars& d) {
  return SignSgdArgs{sign_scalars(h.lr, h.weight_decay, h.scale), h.weight_decay, h.scale, d.lr};
}

template <typename T>
FK_HOST_DEVICE void sign_sgd_thread(const SignSgdMeta& meta, const SignSgdArgs& args, int block,
                                    int tid, int nthreads) {
  const BlockRange r = meta.range(block, kSignSgdChunk);
  const int64_t n = r.end - r.begin;
  T* p = static_cast<T*>(meta.params[r.slot]) + r.begin;
  const T* g = static_cast<const T*>(meta.grads[r.slot]) + r.begin;
  const bool aligned = aligned16(meta.params[r.slot]) && aligned16(meta.grads[r.slot]);
  const SignScalars s = args.lr != nullptr
                            ? sign_scalars(double(*args.lr), args.weight_decay, args.scale)
                            : args.scalars;
  for (int64_t round = 0; round < n; round += round_size(nthreads)) {
    const Fragment f = fragment(round, n, aligned, tid, nthreads);
    float fp[kIlp] = {}, fg[kIlp] = {};
    load(p, f, fp);
    load(g, f, fg);
    FK_UNROLL
    for (int j = 0; j < kIlp; ++j) fp[j] = state_free_update<StateFree::kSign>(fp[j], fg[j], s);
    store(p, f, fp);
  }
}

template <typename Launch>
int64_t plan_sign_sgd(const TensorBatch& t, Launch&& launch) {
  return plan_launches<SignSgdMeta>(
      t.count, t.numel, kSignSgdChunk,
      [&](SignSgdMeta& meta, int slot, int64_t i) {
        meta.params[slot] = t.params[i];
        meta.grads[slot] = t.grads[i];
      },
      launch);
}

}  // namespace cuda
}  // namespace frugal
