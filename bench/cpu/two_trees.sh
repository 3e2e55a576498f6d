# Sourced by the compare_*.sh scripts: compiles a harness ($1, a .cpp under bench/cpu/)
# twice at one ISA level, against the csrc of git revision $REV (into $WORK/old.o, its
# namespace old_tree) and against the working tree's (into $WORK/new.o, new_tree), so
# that both builds link into one process. Needs REV and LEVEL set; sets WORK, removed
# on exit.
case $LEVEL in
  avx2) ISA_FLAGS="-mavx2 -mfma -mf16c" ;;
  avx512) ISA_FLAGS="-mavx512f -mavx512bw -mavx512dq -mavx512vl -mavx2 -mfma -mf16c -mprefer-vector-width=512" ;;
  baseline) ISA_FLAGS="" ;;
  *) echo "unknown level $LEVEL" >&2; exit 2 ;;
esac
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
git archive "$REV" csrc | tar -x -C "$WORK"
# The flags of CMakeLists.txt's CPU levels.
FLAGS="-std=c++17 -O3 -fno-math-errno -fno-trapping-math -ffp-contract=off $ISA_FLAGS"
g++ $FLAGS -DFK_CPU_ISA=old_tree -I"$WORK/csrc" -I"$WORK/csrc/include" \
    -c "bench/cpu/$1" -o "$WORK/old.o"
g++ $FLAGS -DFK_CPU_ISA=new_tree -Icsrc -Icsrc/include \
    -c "bench/cpu/$1" -o "$WORK/new.o"
