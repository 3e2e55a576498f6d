#!/usr/bin/env bash
# Side by side, in one process: the CPU block walk of a git revision (default
# HEAD) against the working tree's, at one ISA level (default avx2; avx512
# needs a CPU with it). Prints ns per position and new/old per case.
#   bash bench/cpu/compare_blocks.sh [REV] [avx2|avx512|baseline]
set -euo pipefail
cd "$(dirname "$0")/../.."
REV=${1:-HEAD}
LEVEL=${2:-avx2}
source bench/cpu/two_trees.sh block_harness.cpp
cat > "$WORK/main.cpp" <<'CPP'
#include <algorithm>
#include <cstdio>
extern "C" double block_ns_old_tree(int, int);
extern "C" double block_ns_new_tree(int, int);
int main() {
  const char* dtypes[] = {"fp32", "bf16", "fp16"};
  const char* cases[] = {"rows", "columns", "flat", "state-free", "adamw"};
  std::printf("| dtype | case | old ns/pos | new ns/pos | new/old |\n|---|---|---|---|---|\n");
  for (int d = 0; d < 3; ++d) {
    for (int c = 0; c < 5; ++c) {
      double o = 1e30, n = 1e30;
      for (int r = 0; r < 7; ++r) {
        o = std::min(o, block_ns_old_tree(d, c));
        n = std::min(n, block_ns_new_tree(d, c));
      }
      std::printf("| %s | %s | %.3f | %.3f | %.2f |\n", dtypes[d], cases[c], o, n, n / o);
    }
  }
}
CPP
g++ -O2 "$WORK/main.cpp" "$WORK/old.o" "$WORK/new.o" -o "$WORK/compare"
echo "old: $REV, new: working tree, level $LEVEL, one thread, a 64 x 512 tensor in cache, rho 0.25"
"$WORK/compare"
