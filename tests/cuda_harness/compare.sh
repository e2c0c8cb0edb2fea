#!/usr/bin/env bash
# Same-run kernel comparison of two source trees on the GPU machine: builds the forward and backward
# harnesses of BASE (a copy of an earlier tree's cc/ and tests/cuda_harness/, e.g. made here with
# `git archive REV cc tests/cuda_harness | tar -x -C .baseline`) and of this tree, all in parallel, then
# runs their benchmarks one after the other, so that clocks and neighbours are the same for both, and
# prints the median TFLOP/s ratio new / base (compare_summary.py).
#
#   tests/cuda_harness/compare.sh BASE [head_dim ...]      (default head dims: 64 128)
#
# Env: ARCHS (default 90a), REDUCED=1 (only head dims 64 and 128 compiled, default 1), FWD_ONLY=1 (no
# backward), BWD_ONLY=1 (no forward), SKIP_BUILD=1 (benchmark the binaries an earlier call built), FAMILIES="default sm80" (the sm80 family through TF_FLASH_CUDA_FAMILY too; default "default"),
# ROUNDS=N (default 2: base first in odd rounds, new first in even ones, since the order alone moved
# results by ~1% in round 9). Logs under $OUT.
set -uo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
base="$(cd "${1:?BASE tree}" && pwd)"; shift
dims="${*:-64 128}"
out="${OUT:-/tmp/out}"; mkdir -p "$out"
archs="${ARCHS:-90a}"
reduced=""; [ "${REDUCED:-1}" = 1 ] && reduced="-DTF_FLASH_CUDA_REDUCED"
directions="fwd"; [ "${FWD_ONLY:-0}" = 1 ] || directions="fwd bwd"
[ "${BWD_ONLY:-0}" = 1 ] && directions="bwd"
start=$(date +%s)
[ "${SKIP_BUILD:-0}" = 1 ] ||
for tree in base new; do
  src=$root; [ $tree = base ] && src=$base
  [ "${BWD_ONLY:-0}" = 1 ] ||
  (ARCHS="$archs" REDUCED="${REDUCED:-1}" VARIANTS=0 JOBS=8 "$src/tests/cuda_harness/build.sh" "/tmp/cmp_$tree/fwd" \
     > "$out/build_fwd_$tree.log" 2>&1 || echo "compare: forward build of $tree failed (see build_fwd_$tree.log)") &
  [ "${FWD_ONLY:-0}" = 1 ] ||
  (NVCC_ARCHS="$archs" EXTRA_FLAGS="$reduced" BWD_BUILD="/tmp/cmp_$tree/bwd" JOBS=8 BUILD_ONLY=1 \
     "$src/tests/cuda_harness/run_bwd_harness.sh" > "$out/build_bwd_$tree.log" 2>&1 ||
     echo "compare: backward build of $tree failed (see build_bwd_$tree.log)") &
done
wait
echo "compare: built in $(( $(date +%s) - start ))s"
for ((round = 1; round <= ${ROUNDS:-2}; ++round)); do
  order="base new"; (( round % 2 == 0 )) && order="new base"
  for tree in $order; do
    for dir in $directions; do
      for family in ${FAMILIES:-default}; do
        log="$out/bench_${dir}_${family}_${tree}_r$round.log"
        env $([ "$family" = default ] || echo "TF_FLASH_CUDA_FAMILY=$family") \
          "/tmp/cmp_$tree/$dir/${dir}_harness" bench $dims > "$log" 2>&1 || echo "compare: $log failed"
      done
    done
  done
done
for dir in $directions; do
  for family in ${FAMILIES:-default}; do
    echo "=== $dir, family $family: TFLOP/s new / base, median over rounds"
    python3 "$root/tests/cuda_harness/compare_summary.py" \
      --new "$out"/bench_${dir}_${family}_new_r*.log --base "$out"/bench_${dir}_${family}_base_r*.log
  done
done
