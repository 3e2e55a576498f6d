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
  SignSgdHyper hyper;
  DeviceScalars device;  // lr and grad_scale on the device, or null: use `scalars`
};

static_assert(sizeof(SignSgdMeta) + sizeof(SignSgdArgs) <= kMaxParamBytes,
              "sign_sgd_ kernel parameters exceed 4 KB");

inline SignSgdArgs sign_sgd_args(const SignSgdHyper& h, const DeviceScalars& d) {
  return SignSgdArgs{sign_scalars(h.lr, h.weight_decay, h.scale, h.grad_scale), h, d};
}

FK_HOST_DEVICE SignScalars resolve(const SignSgdArgs& a) {
  if (a.device.lr == nullptr && a.device.grad_scale == nullptr) return a.scalars;
  const double lr = a.device.lr != nullptr ? double(*a.device.lr) : a.hyper.lr;
  const double grad_scale =
      a.device.grad_scale != nullptr ? double(*a.device.grad_scale) : a.hyper.grad_scale;
  return sign_scalars(lr, a.hyper.weight_decay, a.hyper.scale, grad_scale);
}

template <typename T>
FK_HOST_DEVICE void sign_sgd_thread(const SignSgdMeta& meta, const SignSgdArgs& args, int block,
                                    int tid, int nthreads) {
  if (skipped(args.device)) return;
  const BlockRange r = meta.range(block, kSignSgdChunk);
  const int64_t n = r.end - r.begin;
  T* p = static_cast<T*>(meta.params[r.slot]) + r.begin;
  const T* g = static_cast<const T*>(meta.grads[r.slot]) + r.begin;
  const bool aligned = aligned16(meta.params[r.slot]) && aligned16(meta.grads[r.slot]);
  const SignScalars s = resolve(args);
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
