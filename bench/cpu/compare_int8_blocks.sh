#!/usr/bin/env bash
# Side by side, in one process: adamw_int8_'s CPU block of a git revision (default
# HEAD) against the working tree's, at one ISA level (default avx2), beside adamw_'s
# fp32 loop. Prints ns per coordinate and new/old per case.
#   bash bench/cpu/compare_int8_blocks.sh [REV] [avx2|avx512|baseline]
set -euo pipefail
cd "$(dirname "$0")/../.."
REV=${1:-HEAD}
LEVEL=${2:-avx2}
source bench/cpu/two_trees.sh int8_block_harness.cpp
cat > "$WORK/main.cpp" <<'CPP'
#include <algorithm>
#include <cstdio>
extern "C" double int8_ns_old_tree(int);
extern "C" double int8_ns_new_tree(int);
int main() {
  const char* cases[] = {"adamw_ fp32 loop", "int8 block fp32", "int8 block bf16",
                         "int8 blocks of 200"};
  std::printf("| case | size | old ns | new ns | new/old |\n|---|---|---|---|---|\n");
  for (int c = 0; c < 8; ++c) {
    double o = 1e30, n = 1e30;
    for (int r = 0; r < 3; ++r) {
      o = std::min(o, int8_ns_old_tree(c));
      n = std::min(n, int8_ns_new_tree(c));
    }
    std::printf("| %s | %s | %.3f | %.3f | %.2f |\n", cases[c % 4], c < 4 ? "32K" : "4M", o, n,
                n / o);
  }
}
CPP
g++ -O2 "$WORK/main.cpp" "$WORK/old.o" "$WORK/new.o" -o "$WORK/compare"
echo "old: $REV, new: working tree, level $LEVEL, one thread, ns per coordinate"
"$WORK/compare"
