// The CPU block walk of frugal_step_ timed without Python: ns per position of
// a tensor that stays in cache (64 x 512), one thread, rho = 0.25, sign rule,
// for rows, columns and flat (randk) subsets in fp32, bf16 and fp16, and the
// state-free and AdamW loops alone. Compiled twice by compare_blocks.sh (a
// git revision's csrc and the working tree's, each in its own FK_CPU_ISA
// namespace) so that both run in one process, interleaved, best of 7 each:
// this machine's noise moves absolute times by 30% between runs.
#include <algorithm>
#include <chrono>
#include <random>
#include <vector>

#include "cpu/frugal_block.h"

using namespace frugal;
using namespace frugal::cpu;
using namespace frugal::cpu::FK_CPU_ISA;

namespace {

constexpr int64_t kRows = 64, kCols = 512, kN = kRows * kCols;

template <typename Fn>
double best_ns_per_position(Fn&& fn) {
  double best = 1e30;
  for (int rep = 0; rep < 30; ++rep) {
    const auto t0 = std::chrono::steady_clock::now();
    for (int it = 0; it < 10; ++it) fn();
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    best = std::min(best, s / 10);
  }
  return best / double(kN) * 1e9;
}

template <typename T>
std::vector<T> random_values(std::mt19937& rng) {
  std::normal_distribution<float> normal;
  std::vector<T> out(kN);
  for (auto& x : out) x = from_float<T>(normal(rng));
  return out;
}

const AdamWScalars kAdamW{1.f, 0.9f, 0.1f, 0.99f, 0.01f, 1e-4f, 0.1f, 1e-8f, 1.f, false};
const SignScalars kSign{1.f, 1e-4f, 1.f};

// kind: 0 rows, 1 columns, 2 flat.
template <typename T>
double block_time(int kind) {
  std::mt19937 rng(1);
  std::vector<T> p = random_values<T>(rng), g = random_values<T>(rng);
  const bool flat = kind == 2;
  const SubsetKind subset = kind == 1 ? SubsetKind::kColumns : SubsetKind::kRows;
  const int64_t dim = flat ? kN : (kind == 0 ? kRows : kCols);
  std::vector<int32_t> ids(static_cast<size_t>(dim));
  for (int64_t i = 0; i < dim; ++i) ids[size_t(i)] = int32_t(i);
  std::shuffle(ids.begin(), ids.end(), rng);
  const int64_t k = dim / 4;
  ids.resize(size_t(k));
  std::sort(ids.begin(), ids.end());
  const SubsetShape shape = flat ? SubsetShape{SubsetKind::kRows, kN, 1, k}
                                 : SubsetShape{subset, kRows, kCols, k};
  const int64_t moments = flat ? k : (kind == 0 ? k * kCols : kRows * k);
  std::vector<float> m(static_cast<size_t>(moments), 0.f), v(static_cast<size_t>(moments), 0.f);
  const FrugalScalars s{kAdamW, kSign, StateFree::kSign};
  ColumnLanes lanes;
  if (kind == 1) lanes = ColumnLanes(ids.data(), k, kCols);
  const Block<T, int32_t, StateFree::kSign> block{p.data(), g.data(), m.data(), v.data(),
                                                  ids.data(), shape, s, &lanes};
  return best_ns_per_position([&] {
    int64_t guess = 0;
    for (int64_t a = 0; a < kN; a += kBlock) guess = block(a, std::min(kN, a + kBlock), guess);
  });
}

template <typename T>
double loop_time(bool adamw) {
  std::mt19937 rng(1);
  std::vector<T> p = random_values<T>(rng), g = random_values<T>(rng);
  std::vector<float> m(kN, 0.f), v(kN, 0.f);
  return best_ns_per_position([&] {
    for (int64_t a = 0; a < kN; a += kBlock) {
      if (adamw) {
        adamw_range<T>(p.data() + a, g.data() + a, m.data() + a, v.data() + a, kBlock, kAdamW);
      } else {
        state_free_range<T, StateFree::kSign>(p.data() + a, g.data() + a, kBlock, kSign);
      }
    }
  });
}

template <typename T>
double case_time(int which) {
  return which < 3 ? block_time<T>(which) : loop_time<T>(which == 4);
}

}  // namespace

#define FK_CAT2(a, b) a##b
#define FK_CAT(a, b) FK_CAT2(a, b)

// dtype: 0 fp32, 1 bf16, 2 fp16; which: 0-2 the block kinds, 3 state-free, 4 AdamW.
extern "C" double FK_CAT(block_ns_, FK_CPU_ISA)(int dtype, int which) {
  if (dtype == 0) return case_time<float>(which);
  if (dtype == 1) return case_time<bf16>(which);
  return case_time<fp16>(which);
}
