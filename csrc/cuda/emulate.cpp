// The CUDA kernels run on the host: the same planner, the same launch
// parameters and the same block bodies as the real launches, over an
// emulated grid. Built by the host compiler into every build, so the index,
// chunking and vector-path logic of the kernels is tested without a GPU.
//
// Threads run one after another. A kernel with barriers is a sequence of
// phases; each phase runs for every thread of the block before the next one
// starts, which is what a barrier guarantees on the GPU and nothing more.
#include "kernels.h"

#include <limits>
#include <vector>

#include "adamw.cuh"
#include "adamw_int8.cuh"
#include "dqt_update.cuh"
#include "frugal_step.cuh"
#include "frugal_step_int8.cuh"
#include "grad_norm.cuh"
#include "sign_sgd.cuh"

namespace frugal {
namespace cuda_emulated {

namespace {

// Runs phase(tid) for the threads of a block last to first: the GPU keeps no
// order either, and the reverse of the natural one exposes a phase that reads
// what a lower thread writes in that same phase.
template <typename Phase>
void each_thread(int threads, Phase&& phase) {
  for (int tid = threads - 1; tid >= 0; --tid) phase(tid);
}

// Runs the warps of a block of a kernel on 8-bit moments, body(warp) giving a
// warp's program. The warps share nothing and never wait for one another, so
// each runs its whole program alone, last warp first; its barriers are the
// warp's own (__syncwarp on the GPU).
template <typename Body>
void each_warp(Body&& body) {
  for (int warp = cuda::kMoments8Warps - 1; warp >= 0; --warp) {
    // Undefined on the GPU: a maximum a lane did not write, or a register read
    // before it is set, poisons the block with a NaN the tests see.
    cuda::Int8WarpShared sh;
    for (uint32_t& x : sh.m_bits) x = 0x7fc00000u;
    for (uint32_t& x : sh.w_bits) x = 0x7fc00000u;
    cuda::Int8Lane regs[cuda::kWarp];
    for (cuda::Int8Lane& r : regs) {
      for (float& x : r.m) x = std::numeric_limits<float>::quiet_NaN();
      for (float& x : r.w) x = std::numeric_limits<float>::quiet_NaN();
    }
    body(warp).run_phases(sh, [&](auto&& phase) {
      each_thread(cuda::kWarp, [&](int lane) { phase(lane, regs[lane]); });
    });
  }
}

}  // namespace

int64_t adamw(const TensorBatch& t, DType dtype, const AdamWHyper& h,
              const cuda::DeviceScalars& d) {
  if (h.found_inf != 0.0) return 0;  // as the real launcher: no launch
  const cuda::AdamWArgs args = cuda::adamw_args(h, d);
  int64_t launches = 0;
  dispatch_dtype(dtype, [&](auto tag) {
    using T = decltype(tag);
    launches = cuda::plan_adamw(t, [&](const cuda::AdamWMeta& meta, int blocks) {
      for (int b = 0; b < blocks; ++b) {
        each_thread(cuda::kAdamWThreads, [&](int tid) {
          cuda::adamw_thread<T>(meta, args, b, tid, cuda::kAdamWThreads);
        });
      }
    });
  });
  return launches;
}

int64_t adamw_int8(const TensorBatch& t, const Moments8Batch& q, DType dtype, const AdamWHyper& h,
                   const cuda::DeviceScalars& d) {
  if (h.found_inf != 0.0) return 0;
  const cuda::AdamWArgs args = cuda::adamw_args(h, d);
  const std::vector<int64_t> units = cuda::moment_blocks(q, t.count);
  int64_t launches = 0;
  dispatch_dtype(dtype, [&](auto tag) {
    using T = decltype(tag);
    launches = cuda::plan_adamw_int8(t, q, units.data(),
                                     [&](const cuda::AdamWInt8Meta& meta, int blocks) {
      for (int b = 0; b < blocks; ++b) {
        each_warp([&](int warp) { return cuda::AdamWInt8Warp<T>(meta, args, b, warp); });
      }
    });
  });
  return launches;
}

int64_t sign_sgd(const TensorBatch& t, DType dtype, const SignSgdHyper& h,
                 const cuda::DeviceScalars& d) {
  if (h.found_inf != 0.0) return 0;
  const cuda::SignSgdArgs args = cuda::sign_sgd_args(h, d);
  int64_t launches = 0;
  dispatch_dtype(dtype, [&](auto tag) {
    using T = decltype(tag);
    launches = cuda::plan_sign_sgd(t, [&](const cuda::SignSgdMeta& meta, int blocks) {
      for (int b = 0; b < blocks; ++b) {
        each_thread(cuda::kSignSgdThreads, [&](int tid) {
          cuda::sign_sgd_thread<T>(meta, args, b, tid, cuda::kSignSgdThreads);
        });
      }
    });
  });
  return launches;
}

int64_t frugal_step(const TensorBatch& t, const SubsetBatch& sub, DType dtype, const FrugalHyper& h,
                    const cuda::DeviceScalars& d) {
  if (h.adamw.found_inf != 0.0) return 0;
  const cuda::FrugalArgs args = cuda::frugal_args(sub, h, d);
  int64_t launches = 0;
  const auto run = [&](auto tag, auto index, auto mode_tag) {
    using Block = cuda::FrugalBlock<decltype(tag), decltype(index), decltype(mode_tag)::value>;
    launches = cuda::plan_frugal_step(t, sub, [&](const cuda::FrugalMeta& meta, int blocks) {
      for (int b = 0; b < blocks; ++b) {
        const Block block(meta, args, b);
        // Shared memory starts undefined on the GPU. Zeros make a block that
        // skipped clearing its table treat every position as member 0, which
        // the tests see.
        cuda::FrugalShared sh{};
        block.run_phases(sh, cuda::kFrugalThreads,
                         [&](auto&& phase) { each_thread(cuda::kFrugalThreads, phase); });
      }
    });
  };
  cuda::with_frugal_types(dtype, sub.index_is_int32, h.state_free, run);
  return launches;
}

int64_t frugal_step_int8(const TensorBatch& t, const SubsetBatch& sub, const Moments8Batch& q,
                         DType dtype, const FrugalHyper& h, const cuda::DeviceScalars& d) {
  if (h.adamw.found_inf != 0.0) return 0;
  const cuda::FrugalArgs args = cuda::frugal_args(sub, h, d);
  std::vector<float*> none;
  const TensorBatch plain = cuda::without_moments(t, none);
  const std::vector<int64_t> units = cuda::moment_blocks(q, t.count);
  int64_t launches = 0;
  const auto run = [&](auto tag, auto index, auto mode_tag) {
    using T = decltype(tag);
    using Index = decltype(index);
    using Block = cuda::FrugalBlock<T, Index, decltype(mode_tag)::value, false>;
    launches += cuda::plan_frugal_step(plain, sub, [&](const cuda::FrugalMeta& meta, int blocks) {
      for (int b = 0; b < blocks; ++b) {
        const Block block(meta, args, b);
        cuda::FrugalShared sh{};  // zeros, as for frugal_step
        block.run_phases(sh, cuda::kFrugalThreads,
                         [&](auto&& phase) { each_thread(cuda::kFrugalThreads, phase); });
      }
    });
    launches += cuda::plan_frugal_int8_members(t, sub, q, units.data(),
                                               [&](const cuda::FrugalInt8Meta& meta, int blocks) {
      for (int b = 0; b < blocks; ++b) {
        each_warp([&](int warp) { return cuda::FrugalInt8Warp<T, Index>(meta, args, b, warp); });
      }
    });
  };
  cuda::with_frugal_types(dtype, sub.index_is_int32, h.state_free, run);
  return launches;
}

int64_t dqt_update(const TensorBatch& t, const SubsetBatch& sub, const QuantBatch& q,
                   DType grad_dtype, const DqtHyper& h, const cuda::DeviceScalars& d) {
  if (h.frugal.adamw.found_inf != 0.0) return 0;
  const cuda::DqtArgs args = cuda::dqt_args(sub, h, d);
  const std::vector<int64_t> padded = cuda::dqt_padded_numels(q, t.count);
  int64_t launches = 0;
  const auto run = [&](auto tag, auto index, auto mode_tag) {
    using Block = cuda::DqtBlock<decltype(tag), decltype(index), decltype(mode_tag)::value>;
    launches = cuda::plan_dqt_update(t, sub, q, padded.data(),
                                     [&](const cuda::DqtMeta& meta, int blocks) {
      for (int b = 0; b < blocks; ++b) {
        const Block block(meta, args, b);
        // Zeros, not the GPU's undefined contents, as for frugal_step.
        cuda::DqtShared sh{};
        block.run_phases(sh, cuda::kDqtThreads,
                         [&](auto&& phase) { each_thread(cuda::kDqtThreads, phase); });
      }
    });
  };
  cuda::with_frugal_types(grad_dtype, sub.index_is_int32, h.frugal.state_free, run);
  return launches;
}

int64_t grad_norm(const void* const* grads, const int64_t* numel, int64_t count, DType dtype,
                  bool max_norm, double* partials, int64_t capacity) {
  cuda::grad_norm_partials(numel, count, capacity);
  int64_t launches = 0;
  dispatch_dtype(dtype, [&](auto tag) {
    using T = decltype(tag);
    cuda::with_norm_kind(max_norm, [&](auto max_tag) {
      launches = cuda::plan_grad_norm(grads, numel, count, partials,
                                      [&](const cuda::GradNormMeta& meta, int blocks) {
        for (int b = 0; b < blocks; ++b) {
          // NaNs, not the GPU's undefined contents: a thread's result that the
          // tree skipped would poison the partial.
          cuda::GradNormShared sh;
          for (double& x : sh.acc) x = std::numeric_limits<double>::quiet_NaN();
          cuda::grad_norm_block<T, decltype(max_tag)::value>(
              meta, b, sh, cuda::kGradNormThreads,
              [&](auto&& phase) { each_thread(cuda::kGradNormThreads, phase); });
        }
      });
    });
  });
  return launches;
}

void grad_norm_finish(const double* partials, int64_t count, bool max_norm, float* norm,
                      float* found_inf) {
  const cuda::GradNormFinish f{partials, count, norm, found_inf};
  cuda::with_norm_kind(max_norm, [&](auto max_tag) {
    cuda::GradNormShared sh;
    for (double& x : sh.acc) x = std::numeric_limits<double>::quiet_NaN();
    cuda::grad_norm_finish_block<decltype(max_tag)::value>(
        f, sh, cuda::kGradNormThreads,
        [&](auto&& phase) { each_thread(cuda::kGradNormThreads, phase); });
  });
}

}  // namespace cuda_emulated
}  // namespace frugal
