// The CPU block of adamw_int8_ (csrc/cpu/moments8_block.h) timed without Python:
// ns per coordinate, one thread, beside adamw_'s fp32 loop over the same number of
// coordinates. Compiled twice by compare_int8_blocks.sh (a git revision's csrc and the
// working tree's, each in its own FK_CPU_ISA namespace) so that both run in one
// process, interleaved, best of 30 each: this machine's noise moves absolute times by
// 30% between runs. Cases: 0 adamw_'s loop, 1 the fp32 block, 2 the bf16 block, 3 the
// fp32 block in blocks of 200 (the tails), each over 32K coordinates (in cache), and
// 4-7 the same over 4M (from memory).
#include <algorithm>
#include <chrono>
#include <random>
#include <vector>

#include "cpu/moments8_block.h"

using namespace frugal;
using namespace frugal::cpu;
using namespace frugal::cpu::FK_CPU_ISA;

namespace {

template <typename Fn>
double best_ns(int64_t n, int reps, int calls, Fn&& fn) {
  double best = 1e30;
  for (int rep = 0; rep < reps; ++rep) {
    const auto t0 = std::chrono::steady_clock::now();
    for (int it = 0; it < calls; ++it) fn();
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    best = std::min(best, s / calls);
  }
  return best / double(n) * 1e9;
}

// Four gradients taken in turn, so that the moments keep moving as in training.
double case_ns(int which) {
  const int64_t n = which >= 4 ? (int64_t(1) << 22) : 64 * 512;
  const int reps = which >= 4 ? 5 : 30, calls = which >= 4 ? 2 : 10;
  which %= 4;
  const int64_t block = which == 3 ? 200 : kMomentBlock;
  std::mt19937 rng(1);
  std::normal_distribution<float> normal;
  std::vector<float> p(n), m(n, 0.f), v(n, 0.f);
  std::vector<bf16> pb(n);
  std::vector<std::vector<float>> gs(4, std::vector<float>(n));
  std::vector<std::vector<bf16>> gb(4, std::vector<bf16>(n));
  for (int64_t i = 0; i < n; ++i) {
    p[i] = normal(rng);
    pb[i] = from_float<bf16>(p[i]);
    for (int k = 0; k < 4; ++k) {
      gs[k][i] = 1e-3f * normal(rng);
      gb[k][i] = from_float<bf16>(gs[k][i]);
    }
  }
  std::vector<int8_t> mc(n, 0);
  std::vector<uint8_t> vc(n, 0);
  std::vector<float> ms(n / block + 1, 0.f), vs(n / block + 1, 0.f);
  const AdamWScalars s =
      adamw_scalars(AdamWHyper{1e-3, 0.9, 0.999, 1e-8, 0.01, 10, false, 1.0, 0.0});
  int turn = 0;
  auto blocks = [&](auto* pp, const auto* g) {
    for (int64_t a = 0, b = 0; a < n; a += block, ++b) {
      adamw_int8_block(pp + a, g + a, mc.data() + a, &ms[b], vc.data() + a, &vs[b],
                       std::min(block, n - a), s);
    }
  };
  if (which == 0) {
    return best_ns(n, reps, calls, [&] {
      adamw_range<float>(p.data(), gs[turn++ & 3].data(), m.data(), v.data(), n, s);
    });
  }
  if (which == 2) return best_ns(n, reps, calls, [&] { blocks(pb.data(), gb[turn++ & 3].data()); });
  return best_ns(n, reps, calls, [&] { blocks(p.data(), gs[turn++ & 3].data()); });
}

}  // namespace

#define FK_CAT2(a, b) a##b
#define FK_CAT(a, b) FK_CAT2(a, b)

extern "C" double FK_CAT(int8_ns_, FK_CPU_ISA)(int which) { return case_ns(which); }
