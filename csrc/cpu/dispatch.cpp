// Runtime choice of the ISA level for the CPU kernels. The kernels are built
// once per level (never with -march=native), and the best level this CPU
// supports is picked on first use; select_isa_level overrides it (tests run
// every level this way).
#include <atomic>
#include <cstring>

#include "kernels.h"

namespace frugal {
namespace cpu {

namespace {

struct Level {
  const char* name;
  bool (*supported)();
  void (*adamw)(const TensorBatch&, DType, const AdamWScalars&, int);
  void (*adamw_int8)(const TensorBatch&, const Moments8Batch&, DType, const AdamWScalars&, int);
  void (*sign_sgd)(const TensorBatch&, DType, const SignScalars&, int);
  void (*sgd)(const TensorBatch&, DType, const SgdScalars&, int);
  void (*frugal_step)(const TensorBatch&, const SubsetBatch&, DType, const FrugalScalars&, int);
  void (*frugal_step_int8)(const TensorBatch&, const SubsetBatch&, const Moments8Batch&, DType,
                           const FrugalScalars&, int);
  void (*lowrank_step)(const TensorBatch&, const float* const*, const float* const*, DType,
                       const SignScalars&, StateFree, int);
  void (*lowrank_adamw_step)(const TensorBatch&, const LowrankBatch&, DType, const FrugalScalars&,
                             int);
  void (*dqt_update)(const TensorBatch&, const SubsetBatch&, const QuantBatch&, DType,
                     const FrugalScalars&, int, uint32_t, int);
  void (*dequantize)(const uint8_t*, const float*, int64_t, int64_t, int64_t, int, void*, DType,
                     int);
  double (*grad_norm)(const void* const*, const int64_t*, int64_t, DType, bool, int);
};

bool always() { return true; }

#if defined(FK_HAVE_X86_LEVELS)
bool has_avx2() {
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
         __builtin_cpu_supports("f16c");
}
bool has_avx512() {
  return has_avx2() && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl");
}
#endif

#define FK_LEVEL(ns, supported) \
  Level { #ns, supported, ns::adamw, ns::adamw_int8, ns::sign_sgd, ns::sgd, ns::frugal_step, ns::frugal_step_int8, ns::lowrank_step, \
        ns::lowrank_adamw_step, ns::dqt_update, ns::dequantize, ns::grad_norm }

const Level kLevels[] = {
#if defined(FK_HAVE_X86_LEVELS)
    FK_LEVEL(avx512, has_avx512),
    FK_LEVEL(avx2, has_avx2),
#endif
    FK_LEVEL(baseline, always),
};
#undef FK_LEVEL

constexpr int kNumLevels = int(sizeof(kLevels) / sizeof(kLevels[0]));

const Level* best_level() {
  for (const Level& l : kLevels) {
    if (l.supported()) return &l;
  }
  return &kLevels[kNumLevels - 1];
}

std::atomic<const Level*> g_active{nullptr};

const Level& active() {
  const Level* l = g_active.load(std::memory_order_acquire);
  if (l == nullptr) {
    l = best_level();
    g_active.store(l, std::memory_order_release);
  }
  return *l;
}

}  // namespace

const char* const* isa_levels_built(int* count) {
  static const char* names[kNumLevels];
  for (int i = 0; i < kNumLevels; ++i) names[i] = kLevels[i].name;
  *count = kNumLevels;
  return names;
}

const char* isa_level_active() { return active().name; }

bool select_isa_level(const char* name) {
  if (std::strcmp(name, "auto") == 0) {
    g_active.store(best_level(), std::memory_order_release);
    return true;
  }
  for (const Level& l : kLevels) {
    if (std::strcmp(l.name, name) == 0 && l.supported()) {
      g_active.store(&l, std::memory_order_release);
      return true;
    }
  }
  return false;
}

bool openmp_enabled() {
#if defined(_OPENMP)
  return true;
#else
  return false;
#endif
}

// Every entry point: a non-zero found_inf (GradScaler's) leaves everything untouched.

void adamw(const TensorBatch& t, DType dtype, const AdamWHyper& h, int num_threads) {
  if (h.found_inf != 0.0) return;
  active().adamw(t, dtype, adamw_scalars(h), num_threads);
}

void adamw_int8(const TensorBatch& t, const Moments8Batch& q, DType dtype, const AdamWHyper& h,
                int num_threads) {
  if (h.found_inf != 0.0) return;
  active().adamw_int8(t, q, dtype, adamw_scalars(h), num_threads);
}

void sign_sgd(const TensorBatch& t, DType dtype, const SignSgdHyper& h, int num_threads) {
  if (h.found_inf != 0.0) return;
  active().sign_sgd(t, dtype, sign_scalars(h.lr, h.weight_decay, h.scale, h.grad_scale),
                    num_threads);
}

void sgd(const TensorBatch& t, DType dtype, const SgdHyper& h, int num_threads) {
  if (h.found_inf != 0.0) return;
  active().sgd(t, dtype, sgd_scalars(h), num_threads);
}

void frugal_step(const TensorBatch& t, const SubsetBatch& sub, DType dtype, const FrugalHyper& h,
                 int num_threads) {
  if (h.adamw.found_inf != 0.0) return;
  active().frugal_step(t, sub, dtype, frugal_scalars(h), num_threads);
}

void frugal_step_int8(const TensorBatch& t, const SubsetBatch& sub, const Moments8Batch& q,
                      DType dtype, const FrugalHyper& h, int num_threads) {
  if (h.adamw.found_inf != 0.0) return;
  active().frugal_step_int8(t, sub, q, dtype, frugal_scalars(h), num_threads);
}

void lowrank_step(const TensorBatch& t, const float* const* up_updates, const float* const* up_grads,
                  DType dtype, const LowrankHyper& h, int num_threads) {
  if (h.found_inf != 0.0) return;
  active().lowrank_step(t, up_updates, up_grads, dtype,
                        sign_scalars(h.lr, h.weight_decay, h.state_free_scale, h.grad_scale),
                        h.state_free, num_threads);
}

void lowrank_adamw_step(const TensorBatch& t, const LowrankBatch& l, DType dtype,
                        const FrugalHyper& h, int num_threads) {
  if (h.adamw.found_inf != 0.0) return;
  active().lowrank_adamw_step(t, l, dtype, frugal_scalars(h), num_threads);
}

void dqt_update(const TensorBatch& t, const SubsetBatch& sub, const QuantBatch& q, DType grad_dtype,
                const DqtHyper& h, int num_threads) {
  if (h.frugal.adamw.found_inf != 0.0) return;
  active().dqt_update(t, sub, q, grad_dtype, frugal_scalars(h.frugal), h.bits, h.rng_step,
                      num_threads);
}

void dequantize(const uint8_t* codes, const float* scales, int64_t scale_count, int64_t rows,
                int64_t cols, int bits, void* out, DType dtype, int num_threads) {
  active().dequantize(codes, scales, scale_count, rows, cols, bits, out, dtype, num_threads);
}

double grad_norm(const void* const* grads, const int64_t* numel, int64_t count, DType dtype,
                 bool max_norm, int num_threads) {
  return active().grad_norm(grads, numel, count, dtype, max_norm, num_threads);
}

}  // namespace cpu
}  // namespace frugal
