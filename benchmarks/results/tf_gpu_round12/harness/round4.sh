#!/usr/bin/env bash
# Round 12, fourth harness round: key masks (an attn_mask with one row for every query, e.g. padding
# [B, 1, 1, Sk]) in the sm_80 kernels: the forward stages one row per tile instead of kBlockM, the backward
# reads this thread's columns once per tile instead of once per entry. Against .baseline (HEAD):
#   round4.sh build  forward (full) and backward (reduced) harnesses of this tree, reduced ones of .baseline,
#                    in parallel; the forward and backward tests of this tree
#   round4.sh bench  `feat` of both trees and the backward with key / full masks, order alternating
set -uo pipefail
root="$(cd "$(dirname "$0")/../../../.." && pwd)"
cd "$root"
export OUT="${OUT:-/tmp/out}"
new=build/cuda_harness_dev base=/tmp/base_fwd
case "${1:?build or bench}" in
  build)
    start=$(date +%s)
    (ARCHS=90a VARIANTS=0 JOBS=6 tests/cuda_harness/build.sh $new > "$OUT/fwd_build.log" 2>&1 || echo "new fwd build failed") &
    (ARCHS=90a VARIANTS=0 REDUCED=1 JOBS=3 .baseline/tests/cuda_harness/build.sh $base > "$OUT/base_build.log" 2>&1 ||
       echo "base fwd build failed") &
    (NVCC_ARCHS=90a EXTRA_FLAGS=-DTF_FLASH_CUDA_REDUCED BWD_BUILD=/tmp/new_bwd JOBS=4 BUILD_ONLY=1 \
       tests/cuda_harness/run_bwd_harness.sh > "$OUT/bwd_build.log" 2>&1 || echo "new bwd build failed") &
    (NVCC_ARCHS=90a EXTRA_FLAGS=-DTF_FLASH_CUDA_REDUCED BWD_BUILD=/tmp/base_bwd JOBS=3 BUILD_ONLY=1 \
       .baseline/tests/cuda_harness/run_bwd_harness.sh > "$OUT/base_bwd_build.log" 2>&1 || echo "base bwd build failed") &
    wait
    echo "built in $(( $(date +%s) - start ))s"
    timeout 200 $new/fwd_harness test > "$OUT/fwd_test.log" 2>&1; echo "fwd test rc $?"
    grep -E "FAIL|passed" "$OUT/fwd_test.log" | tail -6
    grep -E "^(key-mask|attn-mask)" "$OUT/fwd_test.log" | awk '{print $1, $3, $NF, $(NF-1)}' | sort | uniq -c
    timeout 200 /tmp/new_bwd/bwd_harness test > "$OUT/bwd_test.log" 2>&1
    echo "bwd test: $(grep -c FAIL "$OUT/bwd_test.log") failed, of which not d256 (unbuilt): $(grep FAIL "$OUT/bwd_test.log" | grep -vc d256)"
    grep -E "key mask|attn_mask" "$OUT/bwd_test.log" | head -12 ;;
  bench)
    for tree in new base base new; do
      echo "== feat $tree"; timeout 100 $(eval echo \$$tree)/fwd_harness feat 2>&1 | grep -E "plain|mask"
    done
    for r in 1 2; do
      for tree in new base; do
        for cfg in "128 2 8192 16 0" "64 16 1024 12 0"; do
          for mask in none keys 1; do
            echo "bwd $tree $cfg mask=$mask: $(env $([ $mask != none ] && echo BWD_BENCH_ATTN_MASK=$mask) /tmp/${tree}_bwd/bwd_harness bench1 bf16 $cfg 0 20 2>&1 | tail -1)"
          done
        done
      done
    done ;;
esac
